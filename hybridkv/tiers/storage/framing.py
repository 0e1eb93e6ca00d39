"""Self-checking frame around every value stored in L3.

Layout (little endian, :data:`HEADER_SIZE` = 40 bytes, then the payload)::

    offset size field
    0      4    magic  b"HKVP"
    4      1    version (1)
    5      1    checksum algorithm: 1 = zlib.crc32, 2 = xxh3_64 (xxhash package)
    6      2    reserved, 0
    8      16   BLAKE2b-128 of the storage key: a value copied/renamed under
                another key is detected, not served
    24     8    payload length in bytes
    32     8    checksum of the payload (crc32 zero-extended to 64 bits)

Readers verify magic, version, key digest, exact length (truncation and
trailing garbage both fail) and checksum; any mismatch raises
:class:`FrameError`, which backends turn into a counted, logged miss.
Nothing read from storage is ever unpickled or otherwise interpreted.

xxh3_64 (~25 GB/s here) is used when ``xxhash`` is installed, otherwise
zlib.crc32 (~2.3 GB/s, which dominates the cost of a multi-MB put/get).
A reader without ``xxhash`` treats xxh3 frames as unverifiable (a miss).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any, Callable

try:  # optional fast checksum
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

__all__ = ["MAGIC", "VERSION", "HEADER_SIZE", "ALGO_CRC32", "ALGO_XXH3", "DEFAULT_ALGO",
           "FrameError", "key_digest", "checksum", "new_hasher", "frame_header", "frame",
           "parse_header", "verify_payload", "unframe"]

MAGIC = b"HKVP"
VERSION = 1
ALGO_CRC32 = 1
ALGO_XXH3 = 2
_HEADER = struct.Struct("<4sBBH16sQQ")
HEADER_SIZE = _HEADER.size
DEFAULT_ALGO = ALGO_XXH3 if _xxhash is not None else ALGO_CRC32

Buffer = bytes | bytearray | memoryview


class FrameError(ValueError):
    """A stored value failed verification; ``reason`` names the check."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _crc32(data: Buffer) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _checksum_fn(algo: int) -> Callable[[Buffer], int]:
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
    return _xxhash.xxh3_64() if algo == ALGO_XXH3 else _Crc32Stream()


def key_digest(key: bytes) -> bytes:
    """BLAKE2b-128 digest of a storage key (16 bytes). O(len(key))."""
    return hashlib.blake2b(key, digest_size=16, person=b"hybridkv-frame").digest()


def checksum(payload: Buffer, algo: int = DEFAULT_ALGO) -> int:
    """Checksum of ``payload`` with algorithm ``algo``. O(len(payload))."""
    return _checksum_fn(algo)(payload)


def frame_header(key: bytes, payload: Buffer, algo: int = DEFAULT_ALGO) -> bytes:
    """The 40-byte header for ``payload`` stored under ``key``.

    Backends that can write scattered buffers (writev, multi-buffer puts) send
    ``header`` and ``payload`` separately and avoid a copy of the payload.
    """
    n = memoryview(payload).nbytes
    return _HEADER.pack(MAGIC, VERSION, algo, 0, key_digest(key), n, checksum(payload, algo))


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


def verify_payload(payload: Buffer, algo: int, length: int, csum: int,
                   computed: int | None = None) -> None:
    """Raise :class:`FrameError` unless ``payload`` has ``length`` bytes and checksum ``csum``.

    ``computed``: the checksum the caller already took of exactly these bytes
    with ``algo`` (streamed while reading); then the payload is not hashed again.
    """
    n = memoryview(payload).nbytes
    if n != length:
        raise FrameError("truncated" if n < length else "length-mismatch", f"{n} != {length}")
    if (computed if computed is not None else _checksum_fn(algo)(payload)) != csum:
        raise FrameError("checksum", "payload checksum mismatch")


def unframe(key: bytes, blob: Buffer) -> memoryview:
    """Verify a framed value read for ``key`` and return a view of its payload.

    No copy: the result is a memoryview into ``blob``.  O(len(blob)).
    """
    view = memoryview(blob)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    algo, length, csum = parse_header(key, view)
    payload = view[HEADER_SIZE:]
    verify_payload(payload, algo, length, csum)
    return payload
