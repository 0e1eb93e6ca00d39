"""The package's structure, two checkouts side by side: a before / after table.

    python scripts/structure_ab.py BEFORE_ROOT AFTER_ROOT [--json]

Figures per checkout, all read from the code (``ast``) or from one traced run:

- **classes**: the library's classes (``hybridkv/`` without the harness:
  ``hybridkv/eval``, or before it existed the same modules beside the library), the number of methods and ``self.`` attributes of the
  largest, counting what each inherits from library classes (a mixin's methods
  are the object's methods), and the files one object spans;
- **shape**: the findings of ``tests/core/test_architecture.py``'s analyzers run
  on the checkout (mixins, import cycles counting ``TYPE_CHECKING`` imports,
  ``__dict__`` copies, reach-ins into another module's private names);
- **lifecycle call sites per host**: in each host's own modules (the core's
  cache, the vLLM prefix manager, the SGLang radix cache), the calls made on
  the tree (``tree.<method>(``) and on the shared lifecycle (``lifecycle.<method>(``);
- **hops**: a tiny tiered cache (L1 meta, L2, L3 in a local directory) serves a
  prompt, loses it from L1 and L2, and serves it again; every call into the
  library's functions from that ``begin`` until the first read of a lower tier
  is recorded (all threads): for L2 the first page lookup in ``tiers/host.py``
  (``HostTier.lookup_*``: reading L2's size is not a read of a page), for L3 the
  first call into ``tiers/storage/``.  Printed: the calls, the functions on
  the stack at the read, the files passed in order, and how many times control
  came back into ``tiers/coordinator.py`` from another file.

The traced run imports the checkout given (``PYTHONPATH``), in a subprocess.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

HOSTS = {"core": ["hybridkv/cache.py", "hybridkv/allocation.py"],
         "vLLM": ["adapters/vllm/hybridkv_vllm/prefix.py"],
         "SGLang": ["adapters/sglang/hybridkv_sglang/radix_cache.py"]}
NAMED = ["WindowSafeTree", "Eviction", "WindowAnchors", "MatchLearning", "TreeEvents", "PathLocks", "Lifecycle",
         "RequestPages", "HybridKVCache", "TieredCache", "TierCoordinator", "HostTier", "L2Backup"]


# The harness's modules where they lived beside the library (before ``hybridkv/eval``):
# replay, traces, references, the reference model, soak, verify, simulators, the CLI.
HARNESS_STEMS = {"cli", "cli_parsing", "references", "replay", "soak", "traces", "verify", "tier_verify",
                 "sim", "route_sim", "route_cli"}


def _is_harness(root: Path, p: Path) -> bool:
    parts = p.relative_to(root / "hybridkv").parts
    return parts[0] in ("eval", "model") or p.stem in HARNESS_STEMS


def _library(root: Path) -> list[Path]:
    return sorted(p for p in (root / "hybridkv").rglob("*.py") if not _is_harness(root, p))


def _arch(root: Path):  # noqa: ANN202 - the architecture test's module
    """The architecture test's analyzers (this checkout's copy), pointed at ``root``."""
    here = Path(__file__).resolve().parents[1] / "tests" / "core" / "test_architecture.py"
    spec = importlib.util.spec_from_file_location("_arch", here)
    arch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arch)
    arch.ROOT = root
    arch.PACKAGES = [root / "hybridkv", root / "adapters/sglang/hybridkv_sglang", root / "adapters/vllm/hybridkv_vllm"]
    arch.LIBRARY = arch.PACKAGES[0]
    return arch


def _harness_imports(root: Path, arch) -> list[str]:  # noqa: ANN001
    """Library modules importing a harness module (any import, ``TYPE_CHECKING`` and
    lazy ones included, as the architecture test reads them); ``__main__``
    (``python -m hybridkv``) excepted."""
    harness = {arch._module_name(p) for p in (root / "hybridkv").rglob("*.py") if _is_harness(root, p)}
    out = []
    for p in _library(root):
        hit = arch._imports(p, ast.parse(p.read_text()), harness) if p.name != "__main__.py" else set()
        out += [f"{p.relative_to(root)} imports {m}" for m in sorted(hit)]
    return out


def _classes(root: Path) -> dict[str, tuple[Path, ast.ClassDef]]:
    out = {}
    for p in _library(root):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, (p, node))
    return out


def _object(name: str, classes: dict, base_name) -> dict:  # noqa: ANN001
    """Methods, ``self.`` attributes and files of class ``name`` with its library bases."""
    methods, attrs, files, todo, seen = set(), set(), set(), [name], set()
    while todo:
        c = todo.pop()
        if c in seen or c not in classes or c == "Protocol":
            continue
        seen.add(c)
        path, node = classes[c]
        files.add(path.name)
        methods |= {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for n in ast.walk(node):
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                    and n.value.id == "self"):
                attrs.add(n.attr)
        todo += [base_name(b) for b in node.bases]
    return {"methods": len(methods), "attributes": len(attrs), "files": len(files),
            "bases": sorted(b for b in seen if b != name)}


def _shape(arch) -> dict:  # noqa: ANN001
    """The architecture test's findings on the checkout ``arch`` points at."""
    return {"mixins": arch.mixins(), "cycles": [" -> ".join(c) for c in arch.import_cycles()],
            "dict_copies": arch.dict_copies(), "reach_ins": arch.private_reach_ins()}


def _call_sites(root: Path) -> dict:
    """Per host: ``{"tree": {method: n}, "lifecycle": {method: n}}`` of its calls."""
    out = {}
    for host, files in HOSTS.items():
        got: dict[str, dict[str, int]] = {"tree": {}, "lifecycle": {}}
        for f in files:
            for n in ast.walk(ast.parse((root / f).read_text())):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                    owner = n.func.value
                    owner = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                    for kind in ("tree", "lifecycle"):
                        if owner.lstrip("_") == kind:
                            got[kind][n.func.attr] = got[kind].get(n.func.attr, 0) + 1
        out[host] = got
    return out


_TRACE = textwrap.dedent('''
    import json, os, sys, tempfile, threading
    import numpy as np
    from hybridkv import CacheConfig, ModelSpec
    from hybridkv.spec import KVShape
    from hybridkv.tiers.storage import open_backend
    from hybridkv.tiers.tiered import TierConfig, TieredCache
    lib = os.path.join(sys.argv[1], "hybridkv") + os.sep
    spec = ModelSpec("tiny", ("full", "swa", "swa"), 8, KVShape(1, 4, 4), KVShape(2, 4, 4),
                     dtype="float32", page_size=4)
    page = spec.bytes_per_page("full") + spec.bytes_per_page("swa")
    res = {}
    for tier in ("L2", "L3"):
        d = tempfile.mkdtemp()
        l3 = open_backend("file://" + d) if tier == "L3" else None
        cache = TieredCache(spec, CacheConfig(budget_bytes=64 * page, device="meta"),
                            tiers=TierConfig(l2_bytes=256 * page, l3=l3))
        tokens = np.arange(1, 42, dtype=np.int32)
        r = cache.begin(tokens)
        cache.finish(r)
        cache.lower_tiers.flush() if hasattr(cache, "lower_tiers") else cache.flush()
        cache.tree.evict(full_pages=cache.tree.evictable_full_pages(), swa_pages=cache.tree.evictable_swa_pages())
        if tier == "L3":
            cache.clear_l2()
        target = lib + ("tiers" + os.sep + "host.py" if tier == "L2" else "tiers" + os.sep + "storage" + os.sep)
        calls, stack, done, lock = [], [], [], threading.Lock()
        def prof(frame, event, arg):
            f = frame.f_code.co_filename
            if event != "call" or done or not f.startswith(lib) or os.sep + "eval" + os.sep in f:
                return
            if frame.f_code.co_name.startswith("<") and frame.f_code.co_name != "<lambda>":
                return
            with lock:
                calls.append((threading.get_ident(), f[len(lib):], frame.f_code.co_name))
                if f.startswith(target) and (tier == "L3" or frame.f_code.co_name.startswith("lookup")):
                    done.append(1)
                    fr = frame
                    while fr is not None:
                        g = fr.f_code.co_filename
                        if g.startswith(lib):
                            stack.append(g[len(lib):] + ":" + fr.f_code.co_name)
                        fr = fr.f_back
        threading.setprofile(prof)
        sys.setprofile(prof)
        r = cache.begin(tokens)
        sys.setprofile(None)
        threading.setprofile(None)
        cache.finish(r)
        res[tier] = {"calls": calls, "stack": stack[::-1], "hit": int(r.prefix_len)}
        cache.close() if hasattr(cache, "close") else None
    print(json.dumps(res))
''')


def _hops(root: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", _TRACE, str(root)], env=env, capture_output=True, text=True,
                         check=True, cwd=root)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    res = {}
    for tier, t in got.items():
        files = [c[1] for c in t["calls"]]
        runs = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
        res[tier] = {"calls": len(files), "files_in_order": runs,
                     "into_coordinator": sum(1 for f in runs if f.endswith("coordinator.py")),
                     "stack_at_read": t["stack"], "hit_tokens": t["hit"]}
    return res


def figures(root: Path) -> dict:
    arch = _arch(root)
    classes = _classes(root)
    objs = {n: _object(n, classes, arch._base_name) for n in classes}
    top = sorted(objs.items(), key=lambda kv: -kv[1]["methods"])[:8]
    lib = _library(root)
    return {"library_files": len(lib), "library_lines": sum(len(p.read_text().splitlines()) for p in lib),
            "harness_files": len([p for p in (root / "hybridkv").rglob("*.py") if p not in lib]),
            "harness_imports": _harness_imports(root, arch),
            "classes": len(classes), "named": {n: objs[n] for n in NAMED if n in objs}, "largest": dict(top),
            "shape": _shape(arch), "call_sites": _call_sites(root), "hops": _hops(root)}


def _sites(s: dict) -> str:
    parts = [f"{k}: " + ", ".join(f"{m} {n}" for m, n in sorted(v.items())) for k, v in s.items() if v]
    return "; ".join(parts) or "-"


def table(a: dict, b: dict) -> str:
    rows = [("library files / lines", f"{a['library_files']} / {a['library_lines']}",
             f"{b['library_files']} / {b['library_lines']}"),
            ("harness files (hybridkv/eval; before: beside the library)", a["harness_files"], b["harness_files"]),
            ("library -> harness imports", len(a["harness_imports"]), len(b["harness_imports"])),
            ("library classes", a["classes"], b["classes"])]
    for n in NAMED:
        cell = [(f"{x['named'][n]['methods']} methods, {x['named'][n]['attributes']} attrs, "
                 f"{x['named'][n]['files']} file(s)") if n in x["named"] else "-" for x in (a, b)]
        rows.append((f"`{n}`", *cell))
    for k in ("mixins", "cycles", "dict_copies", "reach_ins"):
        rows.append((k.replace("_", " "), len(a["shape"][k]), len(b["shape"][k])))
    for host in HOSTS:
        rows.append((f"{host}: calls on tree / lifecycle", _sites(a["call_sites"][host]),
                     _sites(b["call_sites"][host])))
    for tier in ("L2", "L3"):
        ha, hb = a["hops"][tier], b["hops"][tier]
        rows.append((f"begin -> {tier} read: calls, stack, into coordinator.py",
                     f"{ha['calls']}, {len(ha['stack_at_read'])}, {ha['into_coordinator']}",
                     f"{hb['calls']}, {len(hb['stack_at_read'])}, {hb['into_coordinator']}"))
    lines = ["| figure | before | after |", "|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--json", action="store_true", help="print every figure as JSON")
    args = ap.parse_args()
    a, b = figures(args.before.resolve()), figures(args.after.resolve())
    if args.json:
        print(json.dumps({"before": a, "after": b}, indent=1))
        return
    print(table(a, b))
    for name, x in (("before", a), ("after", b)):
        print(f"\n{name}: largest classes (methods, with library bases):")
        for n, o in x["largest"].items():
            print(f"  {n}: {o['methods']} methods, {o['attributes']} attrs, files {o['files']}, bases {o['bases']}")
        for k in ("mixins", "cycles", "dict_copies"):
            for item in x["shape"][k]:
                print(f"  {k}: {item}")
        for tier in ("L2", "L3"):
            h = x["hops"][tier]
            print(f"  {tier} read: stack {' > '.join(h['stack_at_read'])}")
            print(f"  {tier} files in order: {' > '.join(h['files_in_order'])}")
        for item in x["harness_imports"]:
            print(f"  library -> harness: {item}")


if __name__ == "__main__":
    main()
