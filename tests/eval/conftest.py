"""Fixtures for the harness tests: the shared traces folder beside the checkout
and a real redis-server on 127.0.0.1 (free port; the server class is shared with
``tests/routing`` and ``tests/tiers``, ``tests/_servers.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from _servers import RedisServer, running_redis
from hybridkv.eval.traces import default_shared_traces


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    path = default_shared_traces()
    if path is None:
        pytest.skip("the shared traces folder (../shared/traces beside the checkout) is absent")
    return path


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server per test (tests kill it)."""
    with running_redis(tmp_path) as server:
        yield server
