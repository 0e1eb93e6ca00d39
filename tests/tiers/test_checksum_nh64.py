"""NH64 (frame checksum algorithm 3): C kernel == numpy definition, streaming,
error detection, and the fallback when no kernel can be built."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybridkv.tiers.storage import framing, open_backend
from hybridkv.transfer.host_kernel import load_host_kernel

KERNEL = load_host_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the host kernel did not build")

# Lengths around stripe (64 B) and task (256 KiB) boundaries, and one of several tasks.
LENGTHS = [0, 1, 7, 63, 64, 65, 127, 128, 1000, 4096 * 64 - 1, 4096 * 64, 4096 * 64 + 5,
           3 * 4096 * 64 + 100, (1 << 20) + 3]


def _data(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_known_answers_pin_the_definition():
    # Values stored in L3 must stay readable: a change of the definition breaks them.
    assert framing.nh64_numpy(b"") == 0xE046ED7E4C1D9635
    assert framing.nh64_numpy(bytes(range(256)) * 5) == 0x1FEFF8F990735167


@needs_kernel
@pytest.mark.parametrize("simd", [0, 1, 2])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_numpy_reference(simd, threads):
    payloads = [_data(n) for n in LENGTHS]
    want = [framing.nh64_numpy(p) for p in payloads]
    assert KERNEL.nh64([memoryview(p) for p in payloads], threads, simd) == want
    # a batch of several multi-task payloads spreads tasks over threads
    big = [_data(3_276_800, s) for s in range(3)]
    assert KERNEL.nh64([memoryview(b) for b in big], threads, simd) == [framing.nh64_numpy(b) for b in big]


@pytest.mark.parametrize("use_kernel", [True, False])
def test_streaming_equals_one_shot(use_kernel, monkeypatch):
    if use_kernel and KERNEL is None:
        pytest.skip("no C compiler: the host kernel did not build")
    if not use_kernel:
        monkeypatch.setattr(framing, "_kernel_state", [None])
    rng = np.random.default_rng(5)
    for n in (0, 5, 64, 1000, 70_000):
        data = _data(n, 9)
        h = framing.new_hasher(framing.ALGO_NH64)
        i = 0
        while i < n:
            j = min(n, i + int(rng.integers(1, 300)))
            h.update(data[i:j])
            i = j
        assert h.intdigest() == framing.nh64_numpy(data) == framing.checksum(data, framing.ALGO_NH64)


def test_detects_bit_flips_moves_and_length_changes():
    data = bytearray(_data(64 * 40 + 17, 3))
    ref = framing.checksum(bytes(data), framing.ALGO_NH64)
    rng = np.random.default_rng(11)
    for _ in range(200):  # every single-bit flip changes the value (an accumulator changes)
        pos, bit = int(rng.integers(len(data))), int(rng.integers(8))
        data[pos] ^= 1 << bit
        assert framing.checksum(bytes(data), framing.ALGO_NH64) != ref
        data[pos] ^= 1 << bit
    # swapped stripes (pages written in the wrong order) and the same bytes shifted
    swapped = data[64:128] + data[:64] + data[128:]
    assert framing.checksum(bytes(swapped), framing.ALGO_NH64) != ref
    assert framing.checksum(bytes(data) + b"\0", framing.ALGO_NH64) != ref
    assert framing.checksum(b"\0" + bytes(data[:-1]), framing.ALGO_NH64) != ref
    # the top bit flipped in two words of one lane: plain sums would cancel, NH64 does not
    twice = bytearray(data)
    twice[7] ^= 0x80
    twice[64 * 2 + 7] ^= 0x80
    assert framing.checksum(bytes(twice), framing.ALGO_NH64) != ref


@needs_kernel
def test_checksums_batch_equals_single_calls():
    payloads = [_data(n, 1) for n in (0, 100, 300_000)]
    for algo in (framing.ALGO_NH64, framing.ALGO_CRC32, framing.DEFAULT_ALGO):
        assert framing.checksums(payloads, algo) == [framing.checksum(p, algo) for p in payloads]


def test_without_kernel_writers_fall_back_and_nh64_frames_still_verify(tmp_path, monkeypatch):
    writer = open_backend(f"file://{tmp_path}", checksum_algo=framing.ALGO_NH64)
    assert writer.put([b"k1"], [b"payload" * 100]) == [True]
    monkeypatch.setattr(framing, "_kernel_state", [None])  # as on a machine without a compiler
    assert framing.preferred_algo() == framing.DEFAULT_ALGO
    reader = open_backend(f"file://{tmp_path}")
    assert bytes(reader.get([b"k1"])[0]) == b"payload" * 100  # numpy verifies the NH64 frame
    buf = memoryview(bytearray(700))
    assert reader.get_into([b"k1"], [buf]) == [700] and bytes(buf) == b"payload" * 100
    assert reader.put([b"k2"], [b"x"]) == [True]
    with open(reader._path(reader._name(b"k2")), "rb") as f:
        assert f.read(6)[5] == framing.DEFAULT_ALGO
    assert reader.stats()["corrupt"] == 0


@needs_kernel
def test_backends_write_nh64_when_the_kernel_is_there(tmp_path):
    assert framing.preferred_algo() == framing.ALGO_NH64
    b = open_backend(f"file://{tmp_path}")
    b.put([b"k"], [b"abc"])
    with open(b._path(b._name(b"k")), "rb") as f:
        blob = f.read()
    assert blob[5] == framing.ALGO_NH64
    assert bytes(framing.unframe(b"k", blob)) == b"abc"


@needs_kernel
def test_fused_read_and_hash_equals_read_then_hash(tmp_path):
    data = _data((3 << 20) + 77, 4)  # several 1 MiB chunks and a ragged tail
    path = tmp_path / "blob"
    path.write_bytes(b"H" * 40 + data)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = memoryview(bytearray(len(data)))
        assert KERNEL.pread_nh64(fd, buf, 40) == (len(data), framing.nh64_numpy(data))
        assert bytes(buf) == data
        short = memoryview(bytearray(len(data) + 100))  # asks past EOF: short read, hash of what came
        assert KERNEL.pread_nh64(fd, short, 40) == (len(data), framing.nh64_numpy(data))
        assert KERNEL.pread_nh64(fd, memoryview(bytearray(10)), 1 << 40) == (0, framing.nh64_numpy(b""))
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        KERNEL.pread_nh64(fd, memoryview(bytearray(10)), 0)  # closed descriptor
