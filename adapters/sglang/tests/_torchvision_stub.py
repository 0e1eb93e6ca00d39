"""A stand-in for ``torchvision`` so SGLang imports beside a CPU-only torch.

SGLang imports torchvision eagerly (multimodal helpers pulled in by its
config package), but PyPI torchvision wheels are built against a CUDA torch
and cannot load beside the CPU torch used in tests.  Nothing on the KV-cache
path calls torchvision, so any ``torchvision[.x.y]`` import resolves to a
module whose attributes are inert placeholders.  Installed only when the real
package cannot be imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["install"]


class _Inert:
    """Any attribute, call, item or iteration yields another placeholder."""

    def __init__(self, name: str = "torchvision.<stub>") -> None:
        self._name = name

    def __getattr__(self, item: str) -> "_Inert":
        if item.startswith("__"):
            raise AttributeError(item)
        return _Inert(f"{self._name}.{item}")

    def __call__(self, *args: object, **kwargs: object) -> "_Inert":
        return _Inert(f"{self._name}()")

    def __getitem__(self, item: object) -> "_Inert":
        return _Inert(f"{self._name}[]")

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)  # lets `class X(torchvision.thing)` define a plain class

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so submodules resolve through the finder
        module.__version__ = "0.0.0+stub"
        module.__getattr__ = lambda item, _n=spec.name: (  # type: ignore[attr-defined]
            _Inert(f"{_n}.{item}") if not item.startswith("__") else (_ for _ in ()).throw(AttributeError(item)))
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def install() -> bool:
    """Register the stub unless a working torchvision imports.  Returns True if stubbed."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision  # noqa: F401
            return False
        except Exception:  # a CUDA build beside CPU torch fails to load its ops
            for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[name]
    sys.meta_path.insert(0, _StubFinder())
    return True
