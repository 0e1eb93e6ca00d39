"""Self-checking frame around every value stored in L3.

Layout (little endian, :data:`HEADER_SIZE` = 40 bytes, then the payload)::

    offset size field
    0      4    magic  b"HKVP"
    4      1    version (1)
    5      1    checksum algorithm: 1 = zlib.crc32, 2 = xxh3_64 (xxhash package),
                3 = NH64 (hybridkv's C host kernel, numpy fallback)
    6      2    reserved, 0
    8      16   BLAKE2b-128 of the storage key: a value copied/renamed under
                another key is detected, not served
    24     8    payload length in bytes
    32     8    checksum of the payload (crc32 zero-extended to 64 bits)

Readers verify magic, version, key digest, exact length (truncation and
trailing garbage both fail) and checksum; any mismatch raises
:class:`FrameError`, which backends turn into a counted, logged miss.
Nothing read from storage is ever unpickled or otherwise interpreted.

Writers use :func:`preferred_algo`: NH64 (algorithm 3, defined in
``hybridkv/transfer/checksum.c``) when the C host kernel builds, because it
runs with the GIL released on every core (~24 GB/s per core here, ~50 GB/s
on two), inside one payload as well as across a batch; otherwise xxh3_64
(~25 GB/s, one core, GIL held) when ``xxhash`` is installed, otherwise
zlib.crc32 (~2.3 GB/s).  Readers accept all three: NH64 without the kernel
falls back to a numpy implementation of the same definition (slow, exact);
a reader without ``xxhash`` treats xxh3 frames as unverifiable (a miss).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any, Callable

import numpy as np

try:  # optional fast checksum
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

__all__ = ["MAGIC", "VERSION", "HEADER_SIZE", "ALGO_CRC32", "ALGO_XXH3", "ALGO_NH64",
           "DEFAULT_ALGO", "ALGO_NAMES", "FrameError", "preferred_algo", "nh64_kernel", "key_digest", "checksum",
           "checksums", "nh64_numpy", "new_hasher", "frame_header", "header_for", "frame",
           "parse_header", "check_length", "split_frame", "verify_payload", "unframe"]

MAGIC = b"HKVP"
VERSION = 1
ALGO_CRC32 = 1
ALGO_XXH3 = 2
ALGO_NH64 = 3
ALGO_NAMES = {ALGO_CRC32: "crc32", ALGO_XXH3: "xxh3_64", ALGO_NH64: "nh64"}
_HEADER = struct.Struct("<4sBBH16sQQ")
HEADER_SIZE = _HEADER.size
#: The best algorithm that needs no compiled code (see :func:`preferred_algo`).
DEFAULT_ALGO = ALGO_XXH3 if _xxhash is not None else ALGO_CRC32

Buffer = bytes | bytearray | memoryview


class FrameError(ValueError):
    """A stored value failed verification; ``reason`` names the check."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _crc32(data: Buffer) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


# ---------------------------------------------------------------- NH64
_M64 = (1 << 64) - 1
_NH_K = (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89,
         0x452821E638D01377, 0xBE5466CF34E90C6C, 0xC0AC29B7C97C50DD, 0x3F84D5B5B5470917)
_NH_STEP = 0x9E3779B97F4A7C15
_NH_SEED = 0x6A09E667F3BCC909
_NH_KEYS = np.array(_NH_K, dtype=np.uint64)
_NH_SWAP = [1, 0, 3, 2, 5, 4, 7, 6]
_NH_CHUNK_STRIPES = 1 << 15  # bounds the numpy temporaries (2 MiB of stripes)
_kernel_state: list[Any] = []  # [kernel or None] once resolved


def nh64_kernel() -> Any:
    """The C host kernel that computes NH64 (and the fused read+hash), built
    on first use; ``None`` without a compiler."""
    if not _kernel_state:
        from ...transfer.host_kernel import load_host_kernel
        _kernel_state.append(load_host_kernel())
    return _kernel_state[0]


def preferred_algo() -> int:
    """Checksum algorithm for new frames: NH64 when the C kernel loads, else :data:`DEFAULT_ALGO`."""
    return ALGO_NH64 if nh64_kernel() is not None else DEFAULT_ALGO


def _nh_accumulate_numpy(data: Buffer, first: int, acc: np.ndarray) -> None:
    """Add whole stripes of ``data`` (length a multiple of 64) from stripe ``first``."""
    words = np.frombuffer(data, dtype="<u8").reshape(-1, 8)
    step = np.uint64(_NH_STEP)
    for lo in range(0, len(words), _NH_CHUNK_STRIPES):
        w = words[lo:lo + _NH_CHUNK_STRIPES]
        idx = np.arange(first + lo + 1, first + lo + 1 + len(w), dtype=np.uint64)
        with np.errstate(over="ignore"):
            k = w ^ (_NH_KEYS[None, :] + (idx * step)[:, None])
            acc += ((k & np.uint64(0xFFFFFFFF)) * (k >> np.uint64(32))).sum(axis=0, dtype=np.uint64)
            acc += w[:, _NH_SWAP].sum(axis=0, dtype=np.uint64)


def _nh_accumulate_tail_numpy(tail: Buffer, stripe: int, acc: np.ndarray) -> None:
    """Add the last partial stripe (< 64 bytes, zero padded) as stripe ``stripe``."""
    if len(tail):
        pad = bytearray(64)
        pad[:len(tail)] = tail
        _nh_accumulate_numpy(pad, stripe, acc)


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def _nh_finish(acc: Any, length: int) -> int:
    h = ((length * _NH_STEP) & _M64) ^ _NH_SEED
    for i in range(8):
        h = _fmix64(h ^ ((int(acc[i]) + _NH_K[i]) & _M64))
    return h


def nh64_numpy(payload: Buffer) -> int:
    """NH64 in numpy (the reference the C kernel is tested against; slow). O(n)."""
    view = memoryview(payload).cast("B")
    n = view.nbytes
    acc = np.zeros(8, dtype=np.uint64)
    full = n - n % 64
    _nh_accumulate_numpy(view[:full], 0, acc)
    _nh_accumulate_tail_numpy(view[full:], full // 64, acc)
    return _nh_finish(acc, n)


def _nh64_one(payload: Buffer) -> int:
    kernel = nh64_kernel()
    if kernel is None:
        return nh64_numpy(payload)
    return kernel.nh64([memoryview(payload).cast("B")])[0]


class _NH64Stream:
    """Incremental NH64: pieces of any size give the same value as one call."""

    def __init__(self) -> None:
        self._kernel = nh64_kernel()
        self._acc = (self._kernel.ffi.new("uint64_t[8]") if self._kernel is not None
                     else np.zeros(8, dtype=np.uint64))
        self._pending = bytearray()
        self._stripes = 0
        self._length = 0

    def _add(self, data: Buffer) -> None:
        if self._kernel is not None:
            self._kernel.nh64_accumulate(data, self._stripes, self._acc)
        else:
            _nh_accumulate_numpy(data, self._stripes, self._acc)
        self._stripes += memoryview(data).nbytes // 64

    def update(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        self._length += view.nbytes
        if self._pending:
            take = min(64 - len(self._pending), view.nbytes)
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) < 64:
                return
            self._add(bytes(self._pending))
            self._pending.clear()
        full = view.nbytes - view.nbytes % 64
        if full:
            self._add(view[:full])
        self._pending += view[full:]

    def intdigest(self) -> int:
        acc = np.array([int(self._acc[i]) for i in range(8)], dtype=np.uint64)
        _nh_accumulate_tail_numpy(self._pending, self._stripes, acc)
        return _nh_finish(acc, self._length)


def _checksum_fn(algo: int) -> Callable[[Buffer], int]:
    if algo == ALGO_NH64:
        return _nh64_one
    if algo == ALGO_CRC32:
        return _crc32
    if algo == ALGO_XXH3:
        if _xxhash is None:
            raise FrameError("unsupported-checksum", "xxh3 frame but xxhash is not installed")
        return _xxhash.xxh3_64_intdigest
    raise FrameError("unsupported-checksum", f"algorithm id {algo}")


class _Crc32Stream:
    """Incremental crc32 with the xxhash streaming interface."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Buffer) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value & 0xFFFFFFFF


def new_hasher(algo: int) -> Any:
    """Streaming hasher for ``algo`` (``update(buf)``, ``intdigest()``).

    Feeding a payload in pieces gives the same value as :func:`checksum`, so a
    backend can hash each chunk right after reading it, while it is in cache.
    """
    _checksum_fn(algo)  # validates
    if algo == ALGO_NH64:
        return _NH64Stream()
    return _xxhash.xxh3_64() if algo == ALGO_XXH3 else _Crc32Stream()


def key_digest(key: bytes) -> bytes:
    """BLAKE2b-128 digest of a storage key (16 bytes). O(len(key))."""
    return hashlib.blake2b(key, digest_size=16, person=b"hybridkv-frame").digest()


def checksum(payload: Buffer, algo: int = DEFAULT_ALGO) -> int:
    """Checksum of ``payload`` with algorithm ``algo``. O(len(payload))."""
    return _checksum_fn(algo)(payload)


def checksums(payloads: list[Buffer], algo: int) -> list[int]:
    """Checksums of a batch; NH64 runs as one kernel call on all cores. O(total bytes)."""
    fn = _checksum_fn(algo)
    kernel = nh64_kernel() if algo == ALGO_NH64 else None
    if kernel is not None and payloads:
        return kernel.nh64([memoryview(p).cast("B") for p in payloads])
    return [fn(p) for p in payloads]


def header_for(key: bytes, length: int, csum: int, algo: int) -> bytes:
    """The 40-byte header for a payload of ``length`` bytes with checksum ``csum``."""
    return _HEADER.pack(MAGIC, VERSION, algo, 0, key_digest(key), length, csum)


def frame_header(key: bytes, payload: Buffer, algo: int = DEFAULT_ALGO) -> bytes:
    """The 40-byte header for ``payload`` stored under ``key``.

    Backends that can write scattered buffers (writev, multi-buffer puts) send
    ``header`` and ``payload`` separately and avoid a copy of the payload.
    """
    return header_for(key, memoryview(payload).nbytes, checksum(payload, algo), algo)


def frame(key: bytes, payload: Buffer, algo: int = DEFAULT_ALGO) -> bytes:
    """Header and payload joined into one ``bytes`` (one copy of the payload)."""
    return b"".join((frame_header(key, payload, algo), payload))


def parse_header(key: bytes, header: Buffer) -> tuple[int, int, int]:
    """Check a header against ``key``; return ``(algo, payload_len, checksum)``.

    Raises :class:`FrameError` on a short header, bad magic, unknown version or
    algorithm, or a header written for another key.
    """
    if memoryview(header).nbytes < HEADER_SIZE:
        raise FrameError("truncated", f"{memoryview(header).nbytes} < {HEADER_SIZE} header bytes")
    magic, version, algo, _reserved, digest, length, csum = _HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        raise FrameError("bad-magic", repr(magic))
    if version != VERSION:
        raise FrameError("bad-version", str(version))
    _checksum_fn(algo)  # raises for an unknown/unavailable algorithm
    if digest != key_digest(key):
        raise FrameError("key-mismatch", "value was written for another key")
    return algo, length, csum


def check_length(n: int, length: int) -> None:
    """Raise :class:`FrameError` unless ``n`` stored payload bytes match the announced ``length``."""
    if n != length:
        raise FrameError("truncated" if n < length else "length-mismatch", f"{n} != {length}")


def split_frame(key: bytes, blob: Buffer) -> tuple[int, int, int, memoryview]:
    """Check the header of a whole framed value read for ``key``.

    Returns ``(algo, payload_len, checksum, payload view)`` (no copy); the
    payload itself is not checked yet.  Raises :class:`FrameError`.
    """
    view = memoryview(blob)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    algo, length, csum = parse_header(key, view)
    return algo, length, csum, view[HEADER_SIZE:]


def verify_payload(payload: Buffer, algo: int, length: int, csum: int,
                   computed: int | None = None) -> None:
    """Raise :class:`FrameError` unless ``payload`` has ``length`` bytes and checksum ``csum``.

    ``computed``: the checksum the caller already took of exactly these bytes
    with ``algo`` (streamed while reading); then the payload is not hashed again.
    """
    check_length(memoryview(payload).nbytes, length)
    if (computed if computed is not None else _checksum_fn(algo)(payload)) != csum:
        raise FrameError("checksum", "payload checksum mismatch")


def unframe(key: bytes, blob: Buffer) -> memoryview:
    """Verify a framed value read for ``key`` and return a view of its payload.

    No copy: the result is a memoryview into ``blob``.  O(len(blob)).
    """
    algo, length, csum, payload = split_frame(key, blob)
    verify_payload(payload, algo, length, csum)
    return payload
