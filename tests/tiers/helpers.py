"""Test helpers: reaching under a backend's framing (simulated corruption), serving one request."""

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
    elif scheme == "mooncake":  # one object per frame (see the backend)
        assert backend._ensure().upsert(backend._names([key])[0], blob) == 0
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
        return backend._ensure().get(backend._names([key])[0])
    raise ValueError(scheme)


def serve_once(cache: Any, tokens: Any) -> None:
    """One request on a cache: its hit, the rest computed in one step, finished (cached)."""
    req = cache.begin(tokens)
    n = len(tokens) - req.computed
    cache.reserve(req, n)
    cache.commit(req, n)
    cache.finish(req)
