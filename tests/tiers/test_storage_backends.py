"""Backend specifics: file LRU cap / restart / multi-process, redis TTL and cluster,
mooncake own client and zero-copy, nixl interop, URL factory."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest

from hybridkv.tiers.storage import FileBackend, open_backend

from .conftest import FAST, RedisServer, _need_redis, free_port


def _k(i: int) -> bytes:
    return i.to_bytes(16, "little")


# ------------------------------------------------------------------- file
def test_file_size_cap_evicts_lru_but_keeps_touched(tmp_path):
    b = FileBackend(tmp_path, max_bytes=5 * (1000 + 40), **FAST)
    b.put([_k(i) for i in range(5)], [bytes([i]) * 1000 for i in range(5)])
    b.touch([_k(0)])
    b.get([_k(1)])
    b.put([_k(5), _k(6)], [b"x" * 1000, b"y" * 1000])  # two must go: 2 and 3 are least recent
    assert b.exists([_k(i) for i in range(7)]) == [True, True, False, False, True, True, True]
    assert b.total_bytes <= b.max_bytes and b.stats()["evictions"] == 2
    assert not b.put([_k(9)], [b"z" * 10_000])[0]  # bigger than the cap: refused


def test_file_restart_keeps_keys_and_lru_order(tmp_path):
    b = FileBackend(tmp_path, **FAST)
    b.put([_k(i) for i in range(3)], [b"a", b"b", b"c"])
    old = time.time() - 100
    for i in range(3):  # on-disk recency: 2 oldest, then 0, then 1
        os.utime(b._path(b._name(_k(i))), (old + [1, 2, 0][i],) * 2)
    b.close()
    b2 = FileBackend(tmp_path, max_bytes=2 * 41, **FAST)  # the smaller cap evicts key 2 at start
    assert [bytes(v) if v is not None else None for v in b2.get([_k(0), _k(1), _k(2)])] == [b"a", b"b", None]


def test_file_stale_temp_files_are_removed(tmp_path):
    b = FileBackend(tmp_path, **FAST)
    junk = Path(b.root) / "ab" / ".abcd.1.2.3.tmp"
    junk.write_bytes(b"half a value")
    fresh = Path(b.root) / "ab" / ".abce.1.2.4.tmp"
    fresh.write_bytes(b"being written")
    os.utime(junk, (time.time() - 7200,) * 2)
    FileBackend(tmp_path, **FAST)
    assert not junk.exists() and fresh.exists()


def _writer(root: str, tag: int, rounds: int) -> None:
    b = FileBackend(root)
    for r in range(rounds):
        b.put([b"shared-key-000001"], [bytes([tag]) * (200_000 + r)])


def test_file_two_processes_write_the_same_key(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), t, 15)) for t in (1, 2)]
    for p in procs:
        p.start()
    reader = FileBackend(tmp_path, **FAST)
    seen = 0
    while any(p.is_alive() for p in procs):
        got = reader.get([b"shared-key-000001"])[0]
        if got is not None:
            data = bytes(got)
            assert len(set(data)) == 1 and 200_000 <= len(data) < 200_015  # one writer's whole value
            seen += 1
        time.sleep(0.002)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert reader.stats()["corrupt"] == 0
    assert reader.get([b"shared-key-000001"])[0] is not None
    assert not list(Path(tmp_path).glob("*/.*.tmp"))  # no temp debris


def test_file_long_keys_are_hashed_into_names(tmp_path):
    b = FileBackend(tmp_path, **FAST)
    key = b"L" * 300
    assert b.put([key], [b"v"]) == [True] and bytes(b.get([key])[0]) == b"v"


# ------------------------------------------------------------------ redis
def test_redis_ttl_and_touch(redis_server):
    b = open_backend(redis_server.url, ttl_s=0.6, key_prefix="ttl:", **FAST)
    b.put([_k(1), _k(2)], [b"a", b"b"])
    ttl = b.client.pttl(b._names([_k(1)])[0])
    assert 0 < ttl <= 600
    time.sleep(0.35)
    b.touch([_k(1)])
    time.sleep(0.35)
    assert b.exists([_k(1), _k(2)]) == [True, False]
    b.close()


@pytest.fixture()
def redis_cluster_node(tmp_path):
    """A one-node Redis Cluster owning all 16384 slots (exercises CROSSSLOT rules)."""
    _need_redis()
    # explicit bus port: the default (port + 10000) may be above 65535 or taken
    server = RedisServer(tmp_path, extra=("--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                                          "--cluster-config-file", str(tmp_path / "nodes.conf")))
    server.start()
    import redis
    r = redis.Redis(port=server.port)
    r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    deadline = time.monotonic() + 10
    while b"cluster_state:ok" not in r.execute_command("CLUSTER", "INFO"):
        assert time.monotonic() < deadline, "cluster never became ok"
        time.sleep(0.05)
    r.close()
    yield server
    server.stop()


def test_redis_cluster_batches_span_slots(redis_cluster_node):
    b = open_backend(f"redis+cluster://127.0.0.1:{redis_cluster_node.port}", **FAST)
    keys = [_k(i) for i in range(32)]
    values = [bytes([i]) * (100 + i) for i in range(32)]
    assert b.put(keys, values) == [True] * 32
    assert [bytes(v) for v in b.get(keys)] == values
    bufs = [memoryview(bytearray(200)) for _ in keys]
    assert b.get_into(keys, bufs) == [100 + i for i in range(32)]
    b.touch(keys)
    b.delete(keys[:16])
    assert b.exists(keys) == [False] * 16 + [True] * 16
    assert b.stats()["errors"] == 0
    b.close()
    bt = open_backend(f"redis+cluster://127.0.0.1:{redis_cluster_node.port}?ttl_s=30", **FAST)
    assert bt.put(keys, values) == [True] * 32 and bt.stats()["errors"] == 0
    bt.close()


# --------------------------------------------------------------- mooncake
def test_mooncake_own_client_and_zero_copy(mooncake_master):
    b = open_backend(mooncake_master.url, key_prefix="own:", staging_bytes=4096, **FAST)
    try:
        size = 65536
        keys = [_k(i) for i in range(4)]
        src = np.random.default_rng(0).integers(0, 256, 4 * size, dtype=np.uint8)
        assert b.register_buffer(src)
        values = [memoryview(src[i * size:(i + 1) * size]) for i in range(4)]
        calls: list[str] = []
        store = b._store

        class Spy:  # records which store entry points the backend uses
            def __getattr__(self, name):
                calls.append(name)
                return getattr(store, name)

        b._store = Spy()
        assert b.put(keys, values) == [True] * 4  # payloads sent from registered memory
        assert b._staging.nbytes == 4096  # ... so nothing was staged but the headers
        # one object per frame, gathered from the staged header and the page in place
        assert [len(store.get(n)) for n in b._names(keys)] == [40 + size] * 4
        arena = np.zeros(4 * size + 100, dtype=np.uint8)
        assert b.register_buffer(arena)
        views = [memoryview(arena[i * size:(i + 1) * size]) for i in range(4)]
        calls.clear()
        assert b.get_into(keys, views) == [size] * 4  # exact sizes: one scatter read
        assert [bytes(v) for v in views] == [bytes(v) for v in values]
        assert calls == ["batch_get_into_multi_buffers"]
        calls.clear()
        views[3] = memoryview(arena[3 * size:])  # larger than the payload: read whole, fine too
        assert b.get_into(keys, views) == [size] * 4
        assert bytes(views[3][:size]) == bytes(values[3])
        assert calls == ["batch_get_into_multi_buffers", "get_batch"]
        b._store = store
        assert b.stats()["errors"] == 0 and b.stats()["corrupt"] == 0
        # An evicted object is a plain miss, not corrupt data.
        store.remove(b._names([keys[0]])[0], True)
        assert b.get(keys[:1]) == [None] and b.get_into(keys[:1], views[:1]) == [-1]
        assert b.stats()["corrupt"] == 0
    finally:
        b.close()


# ------------------------------------------------------------------- nixl
def test_nixl_moves_bytes_through_the_agent_and_shares_the_file_format(tmp_path, monkeypatch):
    pytest.importorskip("nixl._api", reason="nixl not installed")
    b = open_backend(f"nixl+posix://{tmp_path}", **FAST)
    ops: list[str] = []
    real = b._xfer
    monkeypatch.setattr(b, "_xfer", lambda op, fd, views: (ops.append(op), real(op, fd, views))[1])
    payload = np.arange(300_000, dtype=np.uint8).tobytes()
    assert b.put([_k(1)], [payload]) == [True]
    buf = memoryview(bytearray(300_000))
    assert b.get_into([_k(1)], [buf]) == [300_000] and bytes(buf) == payload
    assert ops == ["WRITE", "READ"]
    plain = FileBackend(tmp_path, **FAST)  # same on-disk format as the file backend
    assert bytes(plain.get([_k(1)])[0]) == payload
    b.close()


# ------------------------------------------------------------------- urls
def test_url_factory_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = open_backend("file:cache/l3?max_bytes=1000&fsync=1")
    assert isinstance(rel, FileBackend) and rel.max_bytes == 1000 and rel.fsync
    assert Path(rel.root) == Path("cache/l3") and (tmp_path / "cache" / "l3" / "00").is_dir()
    abs_ = open_backend(f"file://{tmp_path / 'abs'}", max_bytes=5)  # keyword overrides
    assert abs_.max_bytes == 5
    with pytest.raises(ValueError, match="url"):
        open_backend("s3://bucket/x")
    with pytest.raises(ValueError, match="url"):
        open_backend("cache/no-scheme")
    with pytest.raises(ValueError, match="bogus"):
        open_backend("file:x?bogus=1")
    with pytest.raises(ValueError, match="max_bytes"):
        open_backend("file:x?max_bytes=lots")
    with pytest.raises(TypeError, match="url"):
        open_backend(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="url"):
        open_backend("mooncake://127.0.0.1?metadata=http://x/metadata")


def test_redis_url_options(redis_server):
    b = open_backend(redis_server.url + "?ttl_s=5&key_prefix=abc:&socket_timeout=0.5")
    assert b.ttl_ms == 5000 and b._names([b"\x01"]) == [b"abc:01"]
    b.close()
