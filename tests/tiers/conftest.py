"""Fixtures for the L3 storage tests: real servers on 127.0.0.1, free ports.

Servers are started by the fixtures and stopped in their teardown.  A fixture
skips (naming the missing package) only when a server binary or client package
is not installed; CI installs all of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from _servers import RedisServer, _need_redis, _stop, free_port, running_redis, wait_port  # noqa: F401 (re-exported to tests)
from hybridkv.tiers.storage import open_backend



@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture()
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server (for kill/restart tests)."""
    with running_redis(tmp_path) as server:
        yield server


class MooncakeMaster:
    def __init__(self, workdir: Path) -> None:
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return (f"mooncake://127.0.0.1:{self.rpc_port}"
                f"?metadata=http://127.0.0.1:{self.http_port}/metadata"
                f"&segment_bytes={64 << 20}&buffer_bytes={32 << 20}")

    def start(self) -> None:
        binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
        log = open(self.workdir / "master.log", "wb")
        self.proc = subprocess.Popen(
            [binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics_port}", "--default_kv_lease_ttl=100"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()
        wait_port(self.rpc_port, proc=self.proc)
        wait_port(self.http_port, proc=self.proc)

    def stop(self) -> None:
        _stop(self.proc)


def _need_mooncake() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mooncake-transfer-engine-non-cuda is not importable ({exc}); "
                    "pip install 'hybridkv[mooncake]' and apt-get install libibverbs1")
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not os.path.exists(binary):
        pytest.skip("mooncake_master binary not found (pip install mooncake-transfer-engine-non-cuda)")


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    _need_mooncake()
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    master.start()
    yield master
    master.stop()


@pytest.fixture(scope="session")
def mooncake_store(mooncake_master: MooncakeMaster) -> Iterator[Any]:
    """One set-up Mooncake client shared by the tests' backends."""
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", f"http://127.0.0.1:{mooncake_master.http_port}/metadata",
                     128 << 20, 64 << 20, "tcp", "", f"127.0.0.1:{mooncake_master.rpc_port}")
    assert rc == 0, f"mooncake setup returned {rc}"
    yield store
    store.close()


def _need_nixl() -> None:
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"nixl is not importable ({exc}); pip install 'hybridkv[nixl]'")


BACKENDS = ["file", "redis", "mooncake", "nixl"]
FAST = dict(breaker_threshold=3, breaker_cooldown_s=0.2, warn_interval_s=0.0)


@pytest.fixture()
def make_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory ``make_backend(kind, **opts)``; every backend made is closed at teardown."""
    made: list[Any] = []

    def make(kind: str, **opts: Any) -> Any:
        opts = {**FAST, **opts}
        if kind == "file":
            backend = open_backend(f"file://{tmp_path / 'l3'}", **opts)
        elif kind == "nixl":
            _need_nixl()
            backend = open_backend(f"nixl+posix://{tmp_path / 'nixl'}", **opts)
        elif kind == "redis":
            server = request.getfixturevalue("redis_server")
            backend = open_backend(server.url, key_prefix=f"t{uuid.uuid4().hex[:8]}:", **opts)
        elif kind == "mooncake":
            master = request.getfixturevalue("mooncake_master")
            if "store" not in opts:  # share one client: closing a client costs ~2 s
                opts["store"] = request.getfixturevalue("mooncake_store")
            backend = open_backend(master.url, key_prefix=f"t{uuid.uuid4().hex[:8]}:", **opts)
        else:
            raise ValueError(kind)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, make_backend: Callable[..., Any]) -> Any:
    return make_backend(request.param)
