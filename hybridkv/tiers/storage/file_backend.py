"""Embedded L3 backend: one file per page under a local directory.

Layout: ``root/<first 2 hex chars of the key>/<key hex>`` (256 fan-out
directories, created up front), each file a framed value (see
:mod:`.framing`).  Writes go to a private temporary file in the same
directory and are published with ``os.replace``, so a reader (this or another
process) sees the old value or the new one, never a torn file; two processes
writing the same key both publish complete frames and the last rename wins.

Recency is kept in an in-memory LRU index rebuilt from the directory at start
(ordered by file mtime, which hits and :meth:`touch` refresh), so a new
backend over the same directory keeps both the keys and their LRU order.
``max_bytes`` caps the bytes of files this process knows about; exceeding it
evicts least-recently-used files.  With several processes sharing one
directory each enforces the cap on its own index (call :meth:`rescan` to
re-read the directory).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from . import framing
from .base import BaseBackend
from .framing import HEADER_SIZE

__all__ = ["FileBackend"]

_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 3600.0      # temp files older than this are debris from a crash
_UTIME_GRANULARITY_S = 1.0  # skip the utime syscall when mtime is already this fresh
_CHUNK = 256 << 10          # read+hash granularity: each chunk is hashed while still in L2


class FileBackend(BaseBackend):
    """Directory-backed page store with atomic writes and an LRU size cap.

    Args:
        root: directory (created if missing).
        max_bytes: cap on stored bytes (headers included); ``None`` = unlimited.
        fsync: fsync each file before publishing it (durability across power
            loss; a cache normally does not need it: torn files fail checksums).
        **base: see :class:`BaseBackend`.

    Complexity: index operations O(1) per key; I/O O(value size).
    """

    scheme = "file"
    zero_copy = True

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int | None = None,
                 fsync: bool = False, **base: Any) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path, got {type(root).__name__}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
                                      or max_bytes < 1):
            raise ValueError(f"max_bytes must be None or an int >= 1, got {max_bytes!r}")
        super().__init__(**base)
        self.root = os.fspath(root)
        self.max_bytes = max_bytes
        self.fsync = bool(fsync)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # name -> file size, LRU first
        self._total = 0
        self._tmp_ids = itertools.count()
        for i in range(256):
            os.makedirs(os.path.join(self.root, f"{i:02x}"), exist_ok=True)
        self.rescan()

    # ----------------------------------------------------------------- layout
    @staticmethod
    def _name(key: bytes) -> str:
        # Long keys would exceed NAME_MAX; hash them (the frame still binds the real key).
        return key.hex() if len(key) <= 64 else "h" + hashlib.blake2b(key, digest_size=32).hexdigest()

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name[:2] if name[0] != "h" else name[1:3], name)

    @property
    def total_bytes(self) -> int:
        """Bytes of the files in the index (headers included)."""
        return self._total

    def __len__(self) -> int:
        return len(self._index)

    def rescan(self) -> None:
        """Rebuild the LRU index from the directory (oldest mtime first).

        Removes temporary files older than an hour (left by crashed writers).
        O(files) stat calls.
        """
        entries: list[tuple[float, str, int]] = []
        now = time.time()
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            for ent in os.scandir(sub.path):
                try:
                    st = ent.stat()
                except FileNotFoundError:
                    continue
                if ent.name.startswith("."):
                    if ent.name.endswith(_TMP_SUFFIX) and now - st.st_mtime > _STALE_TMP_S:
                        _unlink_quiet(ent.path)
                    continue
                entries.append((st.st_mtime, ent.name, st.st_size))
        entries.sort()
        with self._lock:
            self._index = OrderedDict((name, size) for _, name, size in entries)
            self._total = sum(size for _, _, size in entries)
        self._evict()

    def lru_names(self) -> list[str]:
        """File names in LRU order (least recent first); for tests and tools. O(n)."""
        with self._lock:
            return list(self._index)

    # ------------------------------------------------------------- index ops
    def _note(self, name: str, size: int | None) -> None:
        """Record ``name`` as most recently used with ``size`` (None = gone)."""
        with self._lock:
            old = self._index.pop(name, None)
            if old is not None:
                self._total -= old
            if size is not None:
                self._index[name] = size
                self._total += size

    def _evict(self, keep: frozenset[str] = frozenset()) -> None:
        if self.max_bytes is None:
            return
        victims: list[str] = []
        with self._lock:
            for name in list(self._index):
                if self._total <= self.max_bytes:
                    break
                if name in keep:
                    continue
                self._total -= self._index.pop(name)
                victims.append(name)
        for name in victims:
            _unlink_quiet(self._path(name))
        self._count("evictions", len(victims))

    def _refresh_mtime(self, path: str, mtime: float) -> None:
        if time.time() - mtime > _UTIME_GRANULARITY_S:
            try:
                os.utime(path)
            except OSError:
                pass  # recency on disk is best effort; the in-memory index is updated anyway

    # ------------------------------------------------------------ operations
    def _exists(self, keys: list[bytes]) -> list[bool]:
        out = []
        for key in keys:
            name = self._name(key)
            try:
                size = os.stat(self._path(name)).st_size
            except FileNotFoundError:
                self._forget(name)
                out.append(False)
                continue
            out.append(True)
            with self._lock:
                known = name in self._index
            if not known:  # written by another process
                self._note(name, size)
        return out

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._total -= size

    # I/O hooks: the NIXL POSIX backend replaces these with agent transfers.
    def _write_file(self, fd: int, header: bytes, payload: memoryview) -> None:
        """Write ``header`` then ``payload`` at offset 0 of ``fd``."""
        _write_full(fd, [memoryview(header), payload])

    def _read_file(self, fd: int, views: list[memoryview]) -> int:
        """Fill ``views`` back to back from offset 0 of ``fd``; bytes read (short at EOF)."""
        return _preadv_full(fd, views, 0)

    def _read_framed(self, fd: int, header: memoryview, payload: memoryview) -> tuple[int, int | None]:
        """Read the header, then the payload.

        NH64 frames: one kernel call reads the payload in 1 MiB chunks and
        hashes each while it is still in cache, GIL released (no Python per
        chunk, no second pass over memory).  Other algorithms: the payload is
        read in chunks from Python and each chunk hashed right after it.

        Returns ``(payload bytes read, streamed checksum or None)``.
        """
        if _preadv_full(fd, [header], 0) < HEADER_SIZE:
            return 0, None
        if header[5] == framing.ALGO_NH64:
            kernel = framing.nh64_kernel()
            if kernel is not None and payload.nbytes:  # read and hash chunk by chunk, in cache
                return kernel.pread_nh64(fd, payload, HEADER_SIZE)
            return _preadv_full(fd, [payload], HEADER_SIZE), None
        try:
            hasher = framing.new_hasher(header[5])
        except framing.FrameError:
            hasher = None  # unknown algorithm: verification rejects the header anyway
        got = 0
        while got < payload.nbytes:
            chunk = payload[got:got + _CHUNK]
            n = _preadv_full(fd, [chunk], HEADER_SIZE + got)
            if hasher is not None:
                hasher.update(chunk[:n])
            got += n
            if n < chunk.nbytes:
                break
        return got, (hasher.intdigest() if hasher is not None else None)

    def _open_read(self, key: bytes) -> tuple[str, str, int] | None:
        name = self._name(key)
        path = self._path(name)
        try:
            return name, path, os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(name)
            return None

    def _get(self, keys: list[bytes]) -> list[Any]:
        out: list[Any] = []
        for key in keys:
            opened = self._open_read(key)
            if opened is None:
                out.append(None)
                continue
            name, path, fd = opened
            try:
                st = os.fstat(fd)
                # np.empty: no zero-fill of memory that the read overwrites anyway
                blob = memoryview(np.empty(max(st.st_size, HEADER_SIZE), dtype=np.uint8))
                n, computed = self._read_framed(fd, blob[:HEADER_SIZE], blob[HEADER_SIZE:])
            finally:
                os.close(fd)
            if st.st_size < HEADER_SIZE:
                out.append(blob[:st.st_size])  # truncated: rejected by the base
                continue
            out.append((blob[:HEADER_SIZE], blob[HEADER_SIZE:HEADER_SIZE + n], computed))
            self._note(name, st.st_size)
            self._refresh_mtime(path, st.st_mtime)
        return out

    def _get_into(self, keys: list[bytes], buffers: list[memoryview]) -> list[tuple[Any, ...] | None]:
        out: list[tuple[Any, ...] | None] = []
        for key, buf in zip(keys, buffers):
            opened = self._open_read(key)
            if opened is None:
                out.append(None)
                continue
            name, path, fd = opened
            header = memoryview(bytearray(HEADER_SIZE))
            try:
                st = os.fstat(fd)
                stored = st.st_size - HEADER_SIZE
                if stored < 0 or stored > buf.nbytes:
                    # truncated, or too big for the buffer: the header alone lets the
                    # base report it (truncation / "does not fit")
                    got = self._read_file(fd, [header[:min(st.st_size, HEADER_SIZE)]])
                    out.append((header[:got].tobytes(), max(stored, 0)))
                    continue
                # Header to a scratch area, payload straight into the caller's buffer.
                n, computed = self._read_framed(fd, header, buf[:stored])
            finally:
                os.close(fd)
            out.append((header.tobytes(), n, computed))
            self._note(name, st.st_size)
            self._refresh_mtime(path, st.st_mtime)
        return out

    def _put(self, keys: list[bytes], headers: list[bytes], payloads: list[memoryview]) -> list[bool]:
        out = []
        written: set[str] = set()
        for key, header, payload in zip(keys, headers, payloads):
            size = HEADER_SIZE + payload.nbytes
            if self.max_bytes is not None and size > self.max_bytes:
                self._warn("too-big", f"value of {size} bytes exceeds max_bytes={self.max_bytes}; not stored")
                out.append(False)
                continue
            name = self._name(key)
            try:
                self._write_atomic(self._path(name), header, payload)
            except OSError as exc:
                self._count("errors")
                self._warn("write", f"write of {name[:16]}... failed ({exc}); not stored")
                out.append(False)
                continue
            self._note(name, size)
            written.add(name)
            out.append(True)
        self._evict(keep=frozenset(written))
        return out

    def _write_atomic(self, path: str, header: bytes, payload: memoryview) -> None:
        directory, name = os.path.split(path)
        # pid + thread id + counter: private to this writer, so two processes or
        # threads writing the same key never share a temp file.
        tmp = os.path.join(directory, f".{name}.{os.getpid()}.{threading.get_ident()}."
                                      f"{next(self._tmp_ids)}{_TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            self._write_file(fd, header, payload)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quiet(tmp)
            raise
        os.close(fd)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink_quiet(tmp)
            raise

    def _touch(self, keys: list[bytes]) -> None:
        for key in keys:
            name = self._name(key)
            try:
                os.utime(self._path(name))
                size = os.stat(self._path(name)).st_size
            except FileNotFoundError:
                self._forget(name)
                continue
            self._note(name, size)

    def _delete(self, keys: list[bytes]) -> int:
        removed = 0
        for key in keys:
            name = self._name(key)
            self._forget(name)
            removed += _unlink_quiet(self._path(name))
        return removed

    def _close(self) -> None:
        with self._lock:
            self._index.clear()
            self._total = 0


def _unlink_quiet(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def _preadv_full(fd: int, views: list[memoryview], offset: int) -> int:
    """preadv from ``offset`` until ``views`` are full or EOF; bytes read."""
    got = 0
    views = [v for v in views if v.nbytes]
    while views:
        n = os.preadv(fd, views, offset + got)
        if n <= 0:
            break
        got += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if views and n:
            views[0] = views[0][n:]
    return got


def _write_full(fd: int, parts: list[memoryview]) -> None:
    """writev all of ``parts`` (loops on short writes)."""
    while parts:
        n = os.writev(fd, parts)
        while parts and n >= parts[0].nbytes:
            n -= parts[0].nbytes
            parts = parts[1:]
        if parts and n:
            parts[0] = parts[0][n:]
