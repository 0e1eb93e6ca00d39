"""Test helpers that reach under a backend's framing (simulated corruption)."""

from __future__ import annotations

from typing import Any


def raw_put(backend: Any, key: bytes, blob: bytes) -> None:
    """Store ``blob`` verbatim (no framing) under ``key``: simulates corruption."""
    scheme = backend.scheme
    if scheme in ("file", "nixl+posix"):
        path = backend._path(backend._name(key))
        with open(path, "wb") as f:
            f.write(blob)
    elif scheme == "redis":
        backend.client.set(backend._names([key])[0], blob)
    elif scheme == "mooncake":  # header and payload are two objects (see the backend)
        pn, hn = backend._names([key])
        store = backend._ensure()
        assert store.upsert(hn[0], blob[:40]) == 0
        assert store.upsert(pn[0], blob[40:] or b"\0") == 0
    else:
        raise ValueError(scheme)


def raw_get(backend: Any, key: bytes) -> bytes:
    """The stored framed bytes of ``key`` (for building corrupt variants)."""
    scheme = backend.scheme
    if scheme in ("file", "nixl+posix"):
        with open(backend._path(backend._name(key)), "rb") as f:
            return f.read()
    if scheme == "redis":
        return backend.client.get(backend._names([key])[0])
    if scheme == "mooncake":
        pn, hn = backend._names([key])
        return backend._ensure().get(hn[0]) + backend._ensure().get(pn[0])
    raise ValueError(scheme)
