"""The package's shape, enforced: small files, small functions, no reach-ins, no cycles.

A redesign that leaves a 1,400-line class behind, or a module reading another
object's ``_private`` state, fails here instead of in review.  Measured over
``hybridkv/`` and the adapters' packages (tests, benchmarks and scripts are
free to poke at internals).  Run as a script it prints the figures:

    python tests/core/test_architecture.py [ROOT]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "hybridkv", ROOT / "adapters" / "sglang" / "hybridkv_sglang",
            ROOT / "adapters" / "vllm" / "hybridkv_vllm"]
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
    """Modules of the packages that ``path`` imports, at module level or inside a
    function (a lazy import still ties the two modules together); imports under
    ``if TYPE_CHECKING:`` are annotations only and do not count."""
    mod = _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    skip = {id(n) for st in ast.walk(tree) if isinstance(st, ast.If) and "TYPE_CHECKING" in ast.unparse(st.test)
            for n in ast.walk(st)}
    out: set[str] = set()
    for st in ast.walk(tree):
        if id(st) in skip:
            continue
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
    """Cycles among module-level imports of the packages' modules."""
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


def test_no_file_over_the_limit():
    assert long_files() == [], f"files over {MAX_FILE_LINES} lines"


def test_no_function_over_the_limit():
    assert long_functions() == [], f"functions over {MAX_FUNCTION_LINES} lines"


def test_no_private_reach_ins():
    assert private_reach_ins() == [], "access to another module's object's _private attribute"


def test_no_import_cycle():
    assert import_cycles() == [], "modules that import each other"


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
    print(f"import cycles: {len(cyc)}")
    for c in cyc:
        print("  " + " -> ".join(c))
