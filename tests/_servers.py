"""Servers the tests start on 127.0.0.1 (free ports) and stop: shared by
``tests/tiers`` and ``tests/routing``."""

from __future__ import annotations

import contextlib

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 15.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


class RedisServer:
    """A redis-server process on 127.0.0.1 that tests may stop and restart."""

    def __init__(self, workdir: Path, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.binary = shutil.which("redis-server")
        self.port = port or free_port()
        self.workdir = workdir
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, proc=self.proc)

    def kill(self) -> None:
        """SIGKILL (a crash, not a clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def stop(self) -> None:
        _stop(self.proc)


def _need_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("redis-py is not installed (pip install 'hybridkv[redis]')")


@contextlib.contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    """A redis-server of its own in ``workdir`` on a free port, stopped on exit
    (skips the test when redis-server is not installed)."""
    _need_redis()
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
