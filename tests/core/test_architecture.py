"""The package's shape, enforced: small files, small functions, no reach-ins, no
cycles, objects composed rather than mixed in, no copied ``__dict__``, and the
library apart from its evaluation harness.

A redesign that leaves a 1,400-line class behind, a module reading another
object's ``_private`` state, a class cut into mixins to meet the line caps, a
cycle hidden behind ``TYPE_CHECKING`` or an object built by copying another's
``__dict__`` fails here instead of in review.  Measured over ``hybridkv/`` and
the adapters' packages (tests, benchmarks and scripts are free to poke at
internals); mixins only over ``hybridkv/`` (an adapter may mix into the host
engine's own classes, e.g. vLLM's two schedulers).  The harness
(``hybridkv/eval/``: replay, traces, references, the reference model, soak,
verify, simulators, the CLI) imports the library, never the other way round:
no module of the library or of the adapters imports it, at module level,
lazily or under ``TYPE_CHECKING``; ``python -m hybridkv`` (``__main__``) is the
one declared way in.  Each check is shown to catch a planted fault.  Run as a script it prints the figures:

    python tests/core/test_architecture.py [ROOT]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "hybridkv", ROOT / "adapters" / "sglang" / "hybridkv_sglang",
            ROOT / "adapters" / "vllm" / "hybridkv_vllm"]
LIBRARY = PACKAGES[0]  # where no mixin may split a class
HARNESS = "hybridkv.eval"  # the evaluation harness: imports the library, is imported by none of it
# Library-side modules allowed to import the harness: ``python -m hybridkv`` runs its CLI.
HARNESS_ENTRY_POINTS = {"hybridkv.__main__": "python -m hybridkv runs the harness's CLI"}
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in pkg.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _trees() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), filename=str(p)) for p in _files()}


def long_files() -> list[tuple[str, int]]:
    out = [(_rel(p), len(p.read_text().splitlines())) for p in _files()]
    return sorted([f for f in out if f[1] > MAX_FILE_LINES], key=lambda f: -f[1])


def long_functions() -> list[tuple[str, int]]:
    out = []
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append((f"{_rel(path)}:{node.lineno} {node.name}", n))
    return sorted(out, key=lambda f: -f[1])


def _defined_privates(tree: ast.Module) -> set[str]:
    """``_names`` a module defines: attributes it assigns on ``self``/``cls``, its
    methods, classes, functions and slots (its own objects' private state)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
            names.add(node.value)  # __slots__ entries, getattr names
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reach_ins() -> list[str]:
    """Reads or writes of ``obj._attr`` where ``obj`` is not ``self``/``cls`` and
    the module does not itself define ``_attr`` (so it is another module's
    object's private state)."""
    out = []
    for path, tree in _trees().items():
        own = _defined_privates(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr in own:
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            out.append(f"{_rel(path)}:{node.lineno} .{attr}")
    return out


def _module_name(path: Path) -> str:
    for pkg in PACKAGES:
        if pkg in path.parents or path == pkg:
            parts = [pkg.name, *path.relative_to(pkg).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(parts)
    raise ValueError(path)


def _imports(path: Path, tree: ast.Module, known: set[str]) -> set[str]:
    """Modules of the packages that ``path`` imports, at module level, inside a
    function (a lazy import still ties the two modules together) or under ``if
    TYPE_CHECKING:`` (two modules whose annotations name each other are still
    one design cut in two)."""
    mod = _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for st in ast.walk(tree):
        if isinstance(st, ast.Import):
            names = [a.name for a in st.names]
        elif isinstance(st, ast.ImportFrom):
            if st.level:
                base = pkg.split(".")
                base = base[:len(base) - (st.level - 1)]
                prefix = ".".join(base + ([st.module] if st.module else []))
            else:
                prefix = st.module or ""
            names = [prefix] + [f"{prefix}.{a.name}" for a in st.names]
        else:
            continue
        out.update(n for n in names if n in known and n != mod)
    return out


def import_cycles() -> list[list[str]]:
    """Cycles among the imports of the packages' modules (``TYPE_CHECKING`` ones included)."""
    trees = _trees()
    known = {_module_name(p) for p in trees}
    graph = {_module_name(p): _imports(p, t, known) for p, t in trees.items()}
    # a package __init__ importing its submodules is not a cycle with them
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not (graph.get(d) is not None and mod.startswith(d + "."))}
    cycles, state = [], {}

    def visit(mod: str, stack: list[str]) -> None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [])
    return cycles


def _in_harness(mod: str) -> bool:
    return mod == HARNESS or mod.startswith(HARNESS + ".")


def harness_imports() -> list[str]:
    """Library (or adapter) modules that import the harness: at module level,
    inside a function or under ``TYPE_CHECKING`` (any of them ties the library to
    it).  Only the modules of ``HARNESS_ENTRY_POINTS`` may."""
    trees = _trees()
    known = {_module_name(p) for p in trees}
    out = []
    for path, tree in sorted(trees.items()):
        mod = _module_name(path)
        if _in_harness(mod) or mod in HARNESS_ENTRY_POINTS:
            continue
        for dep in sorted(d for d in _imports(path, tree, known) if _in_harness(d)):
            out.append(f"{_rel(path)} imports {dep}")
    return out


def _library_classes() -> dict[str, tuple[Path, ast.ClassDef]]:
    """Classes defined in the library, by name (a name defined twice keeps one)."""
    out = {}
    for path, tree in _trees().items():
        if LIBRARY in path.parents:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    out[node.name] = (path, node)
    return out


def _base_name(base: ast.expr) -> str:
    """``Foo`` of ``Foo``, ``mod.Foo`` or ``Foo[int]``."""
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Attribute):
        return base.attr
    return base.id if isinstance(base, ast.Name) else ""


def mixins() -> list[str]:
    """Library classes named ``*Mixin``, and library classes with two or more
    library classes as bases (one object split over several classes).  Bases
    from outside the library (``str, Enum``, ``Protocol``, ``Exception``) do not
    count; nor does a Protocol listing another (an interface, not an object)."""
    classes = _library_classes()
    out = []
    for name, (path, node) in sorted(classes.items()):
        where = f"{_rel(path)}:{node.lineno} {name}"
        if name.endswith("Mixin"):
            out.append(f"{where} is a mixin")
        own = [b for b in map(_base_name, node.bases) if b in classes and b != "Protocol"]
        if len(own) >= 2 and "Protocol" not in map(_base_name, node.bases):
            out.append(f"{where} mixes {', '.join(own)}")
    return out


def dict_copies() -> list[str]:
    """Objects built by copying another's state wholesale: ``x.__dict__.update(...)``,
    ``vars(x).update(...)`` and assignments to ``x.__dict__``."""
    out = []
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            hit = False
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
                target = node.func.value
                hit = ((isinstance(target, ast.Attribute) and target.attr == "__dict__")
                       or (isinstance(target, ast.Call) and isinstance(target.func, ast.Name)
                           and target.func.id == "vars"))
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                hit = any(isinstance(t, ast.Attribute) and t.attr == "__dict__" for t in targets)
            if hit:
                out.append(f"{_rel(path)}:{node.lineno} {ast.unparse(node)[:80]}")
    return out


def test_no_file_over_the_limit():
    assert long_files() == [], f"files over {MAX_FILE_LINES} lines"


def test_no_function_over_the_limit():
    assert long_functions() == [], f"functions over {MAX_FUNCTION_LINES} lines"


def test_no_private_reach_ins():
    assert private_reach_ins() == [], "access to another module's object's _private attribute"


def test_no_import_cycle():
    assert import_cycles() == [], "modules that import each other (TYPE_CHECKING imports count)"


def test_no_mixins_in_the_library():
    assert mixins() == [], "a class split into mixins: compose named collaborators instead"


def test_the_library_does_not_import_the_harness():
    assert harness_imports() == [], f"the library imports its evaluation harness ({HARNESS})"


#: the protocols each host supplies the core through (issue: "typed protocol (no Any)")
HOST_PROTOCOLS = ("PagePool", "TierHooks")


def protocol_anys() -> list[str]:
    """Annotations in the host protocols (:data:`HOST_PROTOCOLS`) that name ``Any``."""
    out = []
    for name in HOST_PROTOCOLS:
        path, node = _library_classes()[name]
        for fn in node.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                notes = [a.annotation for a in fn.args.args + fn.args.kwonlyargs if a.annotation] + [fn.returns]
                if any(isinstance(n, ast.Name) and n.id == "Any" for note in notes if note for n in ast.walk(note)):
                    out.append(f"{_rel(path)}:{fn.lineno} {name}.{fn.name}")
    return out


def test_the_host_protocols_name_no_any():
    assert protocol_anys() == [], "a host protocol method typed with Any: name the type"


def test_the_any_check_catches_any(tmp_path, monkeypatch):
    _plant(tmp_path, monkeypatch, {
        "types.py": "from typing import Any, Protocol\n\nclass PagePool(Protocol):\n"
                    "    def alloc(self, n: int) -> list[int]: ...\n",
        "hooks.py": "from typing import Any, Protocol\n\nclass TierHooks(Protocol):\n"
                    "    def stats(self) -> dict[str, Any]: ...\n    def fine(self, x: int) -> None: ...\n"})
    assert protocol_anys() == ["fakepkg/hooks.py:4 TierHooks.stats"]


def test_no_dict_copies():
    assert dict_copies() == [], "an object built by copying another's __dict__: compose or delegate"


def _plant(tmp_path: Path, monkeypatch, files: dict[str, str]) -> Path:  # noqa: ANN001
    """A fake package of ``files`` under ``tmp_path``, measured instead of ours."""
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", [pkg])
    monkeypatch.setattr(sys.modules[__name__], "LIBRARY", pkg)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    return pkg


def test_the_cycle_check_sees_type_checking_imports(tmp_path, monkeypatch):
    _plant(tmp_path, monkeypatch, {
        "a.py": "from . import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n"})
    assert import_cycles(), "a <-> b behind TYPE_CHECKING not found"


def test_the_mixin_check_catches_mixins(tmp_path, monkeypatch):
    _plant(tmp_path, monkeypatch, {
        "parts.py": "class EvictionMixin:\n    pass\n\nclass Events:\n    pass\n",
        "tree.py": "from .parts import EvictionMixin, Events\n\nclass Tree(EvictionMixin, Events):\n    pass\n",
        "fine.py": "from enum import Enum\n\nclass Mode(str, Enum):\n    A = 'a'\n"})
    found = mixins()
    assert any("EvictionMixin is a mixin" in f for f in found), found
    assert any(" Tree mixes EvictionMixin, Events" in f for f in found), found
    assert not any("Mode" in f for f in found), found


def test_the_dict_copy_check_catches_copies(tmp_path, monkeypatch):
    _plant(tmp_path, monkeypatch, {
        "a.py": "def adopt(self, other):\n    self.__dict__.update(other.__dict__)\n",
        "b.py": "def adopt(self, other):\n    vars(self).update(vars(other))\n",
        "c.py": "def adopt(self, other):\n    self.__dict__ = other.__dict__\n",
        "d.py": "def fine(self, other):\n    self.state.update(other.state)\n"})
    found = dict_copies()
    assert [f.split(":")[0] for f in found] == ["fakepkg/a.py", "fakepkg/b.py", "fakepkg/c.py"], found


def test_the_harness_check_catches_library_imports(tmp_path, monkeypatch):
    """Planted: library modules importing the harness at module level (relative and
    absolute), lazily inside a function and under TYPE_CHECKING; the harness
    importing the library and the declared entry point importing the harness are fine."""
    pkg = _plant(tmp_path, monkeypatch, {
        "cache.py": "from .evalpkg import traces\n",
        "tiers.py": "def load():\n    from .evalpkg.replay import replay\n    return replay\n",
        "routing.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .evalpkg.sim import Sim\n",
        "pools.py": "import fakepkg.evalpkg.cli\n",
        "spec.py": "X = 1\n",
        "__main__.py": "from .evalpkg.cli import main\n"})
    harness = pkg / "evalpkg"
    harness.mkdir()
    for name, text in {"__init__.py": "", "traces.py": "from ..spec import X\n", "replay.py": "from . import traces\n",
                       "sim.py": "from .. import cache\n", "cli.py": "from .replay import *\n"}.items():
        (harness / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "HARNESS", "fakepkg.evalpkg")
    monkeypatch.setattr(sys.modules[__name__], "HARNESS_ENTRY_POINTS", {"fakepkg.__main__": "runs the cli"})
    found = harness_imports()
    files = sorted({f.split(" ")[0] for f in found})
    assert files == ["fakepkg/cache.py", "fakepkg/pools.py", "fakepkg/routing.py", "fakepkg/tiers.py"], found
    assert "fakepkg/tiers.py imports fakepkg.evalpkg.replay" in found, found


def test_the_checks_catch_what_they_claim(tmp_path, monkeypatch):
    """The analyzers are not vacuous: a planted reach-in, cycle and long function
    are found."""
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n\ndef f(x):\n    return x._secret\n")
    (pkg / "b.py").write_text("from . import a\n\ndef g():\n" + "    y = 1\n" * 90 + "    return y\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", [pkg])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert any(".\x5fsecret" in r or "._secret" in r for r in private_reach_ins())
    assert import_cycles(), "a <-> b not found"
    assert long_functions() and long_functions()[0][0].endswith(" g")


if __name__ == "__main__":  # [ROOT]: figures of another checkout
    if len(sys.argv) > 1:
        ROOT = Path(sys.argv[1]).resolve()
        PACKAGES = [ROOT / "hybridkv", ROOT / "adapters" / "sglang" / "hybridkv_sglang",
                    ROOT / "adapters" / "vllm" / "hybridkv_vllm"]
        LIBRARY = PACKAGES[0]
    for title, rows in (("files over %d lines" % MAX_FILE_LINES, long_files()),
                        ("functions over %d lines" % MAX_FUNCTION_LINES, long_functions())):
        print(f"{title}: {len(rows)}")
        for name, n in rows:
            print(f"  {n:5d}  {name}")
    reach = private_reach_ins()
    print(f"private reach-ins across modules: {len(reach)}")
    for r in reach:
        print(f"  {r}")
    cyc = import_cycles()
    print(f"import cycles (TYPE_CHECKING imports included): {len(cyc)}")
    for c in cyc:
        print("  " + " -> ".join(c))
    for title, rows in (("mixins in the library", mixins()), ("__dict__ copies", dict_copies()),
                        (f"library -> harness ({HARNESS}) imports", harness_imports())):
        print(f"{title}: {len(rows)}")
        for r in rows:
            print(f"  {r}")
