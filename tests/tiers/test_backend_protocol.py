"""A storage backend is recognised by its methods, the same on every Python.

Python 3.12 changed ``isinstance`` against a ``runtime_checkable`` Protocol:
attributes served by ``__getattr__`` no longer count, so a wrapper that
delegates to a real backend was refused there (and accepted on 3.11).  The
tiers check the methods with ``getattr`` instead (``backend_lacks``).
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.tiers.manager import TierManager
from hybridkv.tiers.storage import BaseBackend, backend_lacks, open_backend
from hybridkv.tiers.storage.base import BACKEND_METHODS
from hybridkv.tiers.tiered import TierConfig


class Delegating:
    """Serves every method of ``inner`` through ``__getattr__`` (as test
    wrappers and user-side proxies do)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Partial:
    def exists(self, keys: Any) -> list[bool]:
        return [False] * len(keys)

    get = exists


def test_a_delegating_backend_is_accepted(tmp_path: Any) -> None:
    inner = open_backend(f"file://{tmp_path / 'l3'}")
    try:
        wrapper = Delegating(inner)
        assert backend_lacks(wrapper) == []
        TierConfig(l2_bytes=1 << 20, l3=wrapper)  # no TypeError
        manager = TierManager(wrapper)
        manager.close()
    finally:
        inner.close()


def test_a_backend_lacking_methods_is_refused_naming_them() -> None:
    lacking = [m for m in BACKEND_METHODS if m not in ("exists", "get")]
    assert backend_lacks(Partial()) == lacking
    with pytest.raises(TypeError, match=r"l3 must be .* got Partial \(lacks get_into, put, "):
        TierConfig(l2_bytes=1 << 20, l3=Partial())
    with pytest.raises(TypeError, match=r"backend must implement StorageBackend, got Partial \(lacks"):
        TierManager(Partial())  # type: ignore[arg-type]


def test_the_method_list_is_the_protocols() -> None:
    # BaseBackend implements the protocol; every listed method is one of its own
    assert all(callable(getattr(BaseBackend, m, None)) for m in BACKEND_METHODS)
    from hybridkv.tiers.storage.base import StorageBackend
    declared = [n for n in vars(StorageBackend) if not n.startswith("_")]
    assert sorted(declared) == sorted(BACKEND_METHODS)
