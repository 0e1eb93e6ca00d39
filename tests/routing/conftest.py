"""Fixtures for the routing tests: a real redis-server on 127.0.0.1 (free port),
tiny model specs and caches.  The server class is shared with ``tests/tiers``
(``tests/_servers.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from _servers import RedisServer, running_redis
from hybridkv import CacheConfig, HybridKVCache, KVShape, ModelSpec

TINY = ModelSpec("tiny", ["full", "swa", "swa"], 8, KVShape(2, 6, 4), KVShape(3, 6, 4), dtype="float32",
                 page_size=4)


def tiny_cache(full_pages: int = 24, swa_pages: int = 12, retention: str = "eager") -> HybridKVCache:
    """A tiny cache where eviction and SWA release happen constantly (W = 2 pages, K = 4 pages)."""
    return HybridKVCache(TINY, CacheConfig(full_pages=full_pages, swa_pages=swa_pages, device="meta",
                                           swa_checkpoint=16, retention=retention))


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server per test (tests kill it)."""
    with running_redis(tmp_path) as server:
        yield server
