"""Behaviour every L3 backend must share (parametrized over file/redis/mooncake/nixl)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hybridkv.tiers.storage import StorageBackend, framing

from .helpers import raw_get, raw_put

rng = np.random.default_rng(1234)


def _keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(4, "little") + bytes(11) for i in range(n)]


def _payload(n: int) -> bytes:
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def test_is_a_storage_backend(backend):
    assert isinstance(backend, StorageBackend)


def test_roundtrip_random_payloads(backend):
    sizes = [0, 1, 17, 4096, 65536 + 3]
    keys = _keys(len(sizes))
    values = [_payload(n) for n in sizes]
    assert backend.put(keys, values) == [True] * len(keys)
    got = backend.get(keys)
    assert [bytes(g) for g in got] == values
    s = backend.stats()
    assert s["hits"] == len(keys) and s["puts"] == len(keys)
    assert s["bytes_written"] == s["bytes_read"] == sum(sizes)


def test_exists_and_missing(backend):
    keys = _keys(4)
    backend.put(keys[:2], [b"a", b"b"])
    assert backend.exists(keys) == [True, True, False, False]
    got = backend.get(keys)
    assert bytes(got[0]) == b"a" and bytes(got[1]) == b"b" and got[2] is None and got[3] is None
    bufs = [memoryview(bytearray(8)) for _ in keys]
    assert backend.get_into(keys, bufs) == [1, 1, -1, -1]
    assert bytes(bufs[0][:1]) == b"a" and bytes(bufs[1][:1]) == b"b"
    assert backend.stats()["misses"] == 4


def test_batch_of_many_keys(backend):
    keys = _keys(48)
    values = [_payload(int(rng.integers(1, 3000))) for _ in keys]
    assert all(backend.put(keys, values))
    order = rng.permutation(len(keys))
    got = backend.get([keys[i] for i in order])
    assert [bytes(g) for g in got] == [values[i] for i in order]


def test_delete(backend):
    keys = _keys(3)
    backend.put(keys, [b"x", b"y", b"z"])
    backend.get(keys[:1])  # a read may hold a lease (mooncake): delete must still work
    backend.delete(keys[:2] + _keys(1, b"m"))
    assert backend.exists(keys) == [False, False, True]
    assert backend.get(keys)[:2] == [None, None]
    assert backend.stats()["deletes"] == 2


def test_touch_keeps_values(backend):
    keys = _keys(2)
    backend.put(keys, [b"one", b"two"])
    backend.touch(keys + _keys(1, b"m"))  # missing keys are ignored
    assert [bytes(v) for v in backend.get(keys)] == [b"one", b"two"]
    assert backend.stats()["errors"] == 0


def test_overwrite(backend):
    key = _keys(1)
    backend.put(key, [b"first value"])
    backend.get(key)  # take a read lease first (mooncake): overwrite must still win
    backend.put(key, [b"2nd"])
    assert bytes(backend.get(key)[0]) == b"2nd"


def test_large_values(backend):
    keys = _keys(2)
    values = [_payload(3 << 20), _payload((5 << 20) + 7)]
    assert backend.put(keys, values) == [True, True]
    assert [bytes(g) for g in backend.get(keys)] == values
    bufs = [memoryview(bytearray(len(v))) for v in values]
    assert backend.get_into(keys, bufs) == [len(v) for v in values]
    assert [bytes(b) for b in bufs] == values


def test_get_into_sizes(backend):
    keys = _keys(3)
    values = [b"0123456789", b"abc", _payload(1000)]
    backend.put(keys, values)
    big = np.zeros(64, dtype=np.uint8)  # numpy buffers are accepted
    small = memoryview(bytearray(5))
    exact = memoryview(bytearray(1000))
    assert backend.get_into(keys, [memoryview(big), small, exact]) == [10, 3, 1000]
    assert big[:10].tobytes() == values[0] and bytes(small[:3]) == b"abc" and bytes(exact) == values[2]
    # A payload larger than its buffer is a miss, never a partial copy.
    tiny = memoryview(bytearray(4))
    before = backend.stats()
    assert backend.get_into(keys[:1], [tiny]) == [-1]
    after = backend.stats()
    assert after["misses"] == before["misses"] + 1 and after["hits"] == before["hits"]


def test_concurrent_two_threads(backend):
    shared = _keys(4, b"s")
    errors: list[BaseException] = []
    bad: list[str] = []
    vals = {t: [bytes([t + 1]) * (1000 + 37 * i) for i in range(4)] for t in range(2)}

    def work(t: int) -> None:
        try:
            own = _keys(8, bytes([65 + t]))
            for rnd in range(5):
                data = [bytes([t, rnd]) * (500 + i) for i in range(8)]
                backend.put(own, data)
                if [bytes(g) for g in backend.get(own)] != data:
                    bad.append(f"thread {t} round {rnd}: own values differ")
                backend.put(shared, vals[t])
                for i, g in enumerate(backend.get(shared)):
                    if g is not None and bytes(g) not in (vals[0][i], vals[1][i]):
                        bad.append(f"thread {t}: shared key {i} holds a torn value")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors and not bad
    assert backend.stats()["corrupt"] == 0



def test_reads_racing_overwrites_see_whole_values(backend):
    """One thread overwrites keys with two alternating values while another reads.

    Every read must be a whole value (or a miss), and a racing overwrite is
    not corruption: ``corrupt`` stays 0 (a torn two-object pair used to count).
    Bounded: 200 write batches.
    """
    keys = _keys(4, b"r")
    vals = [[bytes([v + 1]) * (2000 + 61 * i) for i in range(4)] for v in range(2)]
    backend.put(keys, vals[0])
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        bufs = [memoryview(bytearray(4000)) for _ in keys]
        while not stop.is_set():
            for i, g in enumerate(backend.get(keys)):
                if g is not None and bytes(g) not in (vals[0][i], vals[1][i]):
                    bad.append(f"get: key {i} torn")
            for i, n in enumerate(backend.get_into(keys, bufs)):
                if n >= 0 and bytes(bufs[i][:n]) not in (vals[0][i], vals[1][i]):
                    bad.append(f"get_into: key {i} torn")

    th = threading.Thread(target=reader)
    th.start()
    try:
        for rnd in range(200):
            backend.put(keys, vals[rnd % 2])
    finally:
        stop.set()
        th.join(timeout=60)
    assert not bad
    s = backend.stats()
    assert s["corrupt"] == 0 and s["hits"] > 0

CORRUPTIONS = {
    "truncated": lambda blob, other: blob[:-3],
    "header-only-part": lambda blob, other: blob[:20],
    "flipped-byte": lambda blob, other: blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:],
    "bad-magic": lambda blob, other: b"XXXX" + blob[4:],
    "trailing-garbage": lambda blob, other: blob + b"!",
    "other-key": lambda blob, other: other,
    "not-framed": lambda blob, other: b"\x80\x04\x95pickle-like bytes",
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_values_are_misses(backend, kind, caplog):
    keys = _keys(2)
    values = [_payload(3000), _payload(3000)]
    backend.put(keys, values)
    raw_put(backend, keys[0], CORRUPTIONS[kind](raw_get(backend, keys[0]), raw_get(backend, keys[1])))
    with caplog.at_level("WARNING", logger="hybridkv.tiers.storage"):
        got = backend.get(keys)
        buf = memoryview(bytearray(4000))
        n = backend.get_into(keys[:1], [buf])
    assert got[0] is None and bytes(got[1]) == values[1]
    assert n == [-1]
    s = backend.stats()
    assert s["corrupt"] == 2 and s["misses"] == 2 and s["hits"] == 1
    assert "rejected" in caplog.text


def test_bad_arguments_raise_and_change_nothing(backend):
    key = _keys(1)
    backend.put(key, [b"v"])
    before = backend.stats()
    with pytest.raises(TypeError, match="keys"):
        backend.get(b"not-a-list")
    with pytest.raises(TypeError, match=r"keys\[0\]"):
        backend.put(["str-key"], [b"v"])
    with pytest.raises(ValueError, match="values"):
        backend.put(key, [b"a", b"b"])
    with pytest.raises(TypeError, match=r"values\[0\]"):
        backend.put(key, [12345])
    with pytest.raises(TypeError, match=r"buffers\[0\]"):
        backend.get_into(key, [memoryview(b"readonly")])
    with pytest.raises(ValueError, match=r"keys\[0\]"):
        backend.exists([b""])
    assert backend.stats() == before
    assert bytes(backend.get(key)[0]) == b"v"


def test_frames_carry_checksum_of_payload(backend):
    key = _keys(1)
    payload = _payload(777)
    backend.put(key, [payload])
    blob = raw_get(backend, key[0])
    assert blob[:4] == framing.MAGIC and len(blob) == framing.HEADER_SIZE + 777
    assert bytes(framing.unframe(key[0], blob)) == payload
