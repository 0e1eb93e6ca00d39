"""Fixtures for the routing tests: a real redis-server on 127.0.0.1 (free port),
tiny model specs and caches.  Mirrors the redis fixture of ``tests/tiers``."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridkv import CacheConfig, HybridKVCache, KVShape, ModelSpec

TINY = ModelSpec("tiny", ["full", "swa", "swa"], 8, KVShape(2, 6, 4), KVShape(3, 6, 4), dtype="float32",
                 page_size=4)


def tiny_cache(full_pages: int = 24, swa_pages: int = 12, retention: str = "eager") -> HybridKVCache:
    """A tiny cache where eviction and SWA release happen constantly (W = 2 pages, K = 4 pages)."""
    return HybridKVCache(TINY, CacheConfig(full_pages=full_pages, swa_pages=swa_pages, device="meta",
                                           swa_checkpoint=16, retention=retention))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process that a test may kill and restart on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("redis-server")
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.binary is not None
        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server not listening on {self.port}")

    def kill(self) -> None:
        """SIGKILL: a crash, not a clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def _need_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("redis-py is not installed (pip install 'hybridkv[redis]')")


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server per test (tests kill it)."""
    _need_redis()
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
