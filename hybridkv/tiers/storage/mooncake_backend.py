"""Mooncake Store L3 backend (``mooncake-transfer-engine[-non-cuda]``).

URL: ``mooncake://<master host>:<rpc port>?metadata=http://host:port/metadata``
with optional ``protocol`` (``tcp``; ``rdma`` where devices exist), ``device``
(RDMA device list), ``local_host`` (address this client's segment is served
on, default ``127.0.0.1``), ``segment_bytes`` (memory this client contributes
to the distributed pool, default 256 MiB), ``buffer_bytes`` (client transfer
buffer, default 64 MiB) and ``key_prefix`` (default ``hkv:``).

Layout: one object per page, ``<prefix><key hex>``, holding the whole frame
(40-byte header, then the payload).  Headers live in a staging buffer
registered once; payloads in memory the caller registered with
:meth:`register_buffer` (e.g. the L2 host pool) are sent and received in
place, the object being gathered from / scattered to the two pieces
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``:
zero-copy); other payloads go through the staging buffer (one memcpy).
A Mooncake put does not replace an existing object, so a put first removes
the keys (force) and then puts them: upsert semantics in two metadata calls
and one data transfer.  Objects are immutable once written, so a reader
sees a whole old frame, a whole new one, or a miss; the checksum turns
anything else (a force-removed object's memory reused mid-read) into a
verified miss.  :meth:`get` (no buffers) uses ``get_batch``.

Thread safety: the staging buffer is shared, so reads, writes and deletes
of one backend object run under its lock; exists/touch stay unlocked.

Mooncake specifics: a read grants the reader a lease during which a plain
remove fails, so :meth:`delete` removes with ``force=True``.  The master
evicts on its own (watermark + lease expiry); :meth:`touch` only probes the
keys (``batch_is_exist``) and is best effort.  ``setup()`` retries for about
90 s against a dead master, so the backend first checks that the master's
port accepts a TCP connection and fails fast (a miss) otherwise; a failed
setup is retried on the circuit breaker's next probe.
"""

from __future__ import annotations

import socket
import threading
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from .base import BaseBackend
from .framing import HEADER_SIZE

try:
    from mooncake.store import MooncakeDistributedStore
except ImportError as exc:  # pragma: no cover - optional dependency
    raise ImportError("the mooncake backend needs Mooncake Store: "
                      "pip install 'hybridkv[mooncake]' (and apt-get install libibverbs1)") from exc

__all__ = ["MooncakeBackend"]

_NOT_FOUND = -704        # ErrorCode::OBJECT_NOT_FOUND
_BUFFER_TOO_SMALL = -600  # the object is larger than the buffers
_SIZE_MISMATCH = -800     # scatter read: the buffers are larger than the object


def _port_open(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _address(view: memoryview) -> int:
    """Address of a contiguous buffer (writable or not) without copying."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class MooncakeBackend(BaseBackend):
    """Page store in a Mooncake Store cluster (one client per backend object).

    Args:
        master: ``host:rpc_port`` of ``mooncake_master``.
        metadata: transfer-engine metadata server URL (``http://.../metadata``).
        protocol, device, local_host, segment_bytes, buffer_bytes, key_prefix:
            see the module docstring.
        staging_bytes: initial size of the registered staging buffer.
        max_staging_bytes: batches needing more staging are split (bounds memory).
        connect_timeout_s: TCP probe timeout before ``setup()``.
        store: an already set-up ``MooncakeDistributedStore`` to share (e.g.
            the engine's own); it is borrowed, so :meth:`close` leaves it open.
        **base: see :class:`BaseBackend`.
    """

    scheme = "mooncake"
    zero_copy = True  # for memory registered with register_buffer (see module doc)

    def __init__(self, master: str, *, metadata: str, protocol: str = "tcp", device: str = "",
                 local_host: str = "127.0.0.1", segment_bytes: int = 256 << 20,
                 buffer_bytes: int = 64 << 20, key_prefix: str = "hkv:",
                 staging_bytes: int = 1 << 20, max_staging_bytes: int = 256 << 20,
                 connect_timeout_s: float = 1.0,
                 store: Any = None, **base: Any) -> None:
        if not isinstance(master, str) or ":" not in master:
            raise ValueError(f"master must be 'host:rpc_port', got {master!r}")
        if not isinstance(metadata, str) or not metadata:
            raise ValueError("metadata must be the metadata server URL, e.g. http://host:port/metadata")
        for name, val in (("segment_bytes", segment_bytes), ("buffer_bytes", buffer_bytes),
                          ("staging_bytes", staging_bytes)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        super().__init__(**base)
        self.master = master
        self.metadata = metadata
        self._setup_args = (local_host, metadata, segment_bytes, buffer_bytes, protocol, device, master)
        self._prefix = key_prefix
        self._connect_timeout = float(connect_timeout_s)
        self._lock = threading.Lock()  # guards setup, staging, registrations and every get/put/delete
        self._store: Any = None
        self._borrowed = store is not None
        self._staging = np.empty(0, dtype=np.uint8)
        self._staging_want = staging_bytes
        self._max_staging = max_staging_bytes
        self._registered: list[tuple[int, int]] = []  # caller regions (addr, size)
        if store is not None:
            self._store = store
            self._grow_staging(staging_bytes)
            return
        try:
            self._ensure()
        except ConnectionError as exc:
            self._count("errors")
            self.breaker.record_failure()
            self._call_failed("connect", exc)

    # ------------------------------------------------------------ connection
    def _ensure(self) -> Any:
        """The set-up store client; connects on first use or after a failed setup."""
        with self._lock:
            if self._store is not None:
                return self._store
            for label, hostport in (("master", self.master), ("metadata", urlsplit(self.metadata).netloc)):
                host, _, port = hostport.rpartition(":")
                if not port.isdigit() or not _port_open(host, int(port), self._connect_timeout):
                    raise ConnectionError(f"mooncake {label} {hostport} is not reachable")
            store = MooncakeDistributedStore()
            rc = store.setup(*self._setup_args)
            if rc != 0:
                raise ConnectionError(f"mooncake setup() returned {rc}")
            self._store = store
            if self._staging.nbytes:  # a reconnect: the new client needs the old registration
                store.register_buffer(int(self._staging.ctypes.data), self._staging.nbytes)
            self._grow_staging(self._staging_want)
            for addr, size in self._registered:
                store.register_buffer(addr, size)
            return store

    def _grow_staging(self, nbytes: int) -> None:
        """Make the registered staging buffer at least ``nbytes`` (lock held)."""
        if self._staging.nbytes >= nbytes:
            return
        store = self._store
        if self._staging.nbytes:
            store.unregister_buffer(int(self._staging.ctypes.data))
        self._staging = np.empty(max(nbytes, 2 * self._staging.nbytes), dtype=np.uint8)
        rc = store.register_buffer(int(self._staging.ctypes.data), self._staging.nbytes)
        if rc != 0:
            raise ConnectionError(f"mooncake register_buffer(staging) returned {rc}")

    def _names(self, keys: list[bytes]) -> list[str]:
        return [self._prefix + k.hex() for k in keys]

    def _code(self, op: str, rc: int) -> None:
        self._count("errors")
        self._warn(f"{op}:{rc}", f"{op} returned error code {rc}; treated as a miss")

    # ------------------------------------------------------------ operations
    def _exists(self, keys: list[bytes]) -> list[bool]:
        res = self._ensure().batch_is_exist(self._names(keys))
        for rc in res:
            if rc < 0:
                self._code("batch_is_exist", rc)
        return [rc == 1 for rc in res]

    def _get(self, keys: list[bytes]) -> list[Any]:
        store = self._ensure()
        with self._lock:
            vals = store.get_batch(self._names(keys))  # b"" for a missing object
        return [v if v else None for v in vals]  # the whole frame: the base verifies it

    def _put(self, keys: list[bytes], headers: list[bytes], payloads: list[memoryview]) -> list[bool]:
        store = self._ensure()
        n = len(keys)
        direct = [self._is_registered(p) for p in payloads]
        need = n * HEADER_SIZE + sum(p.nbytes for p, d in zip(payloads, direct) if not d)
        if n > 1 and need > self._max_staging:  # split: staging memory stays bounded
            h = n // 2
            return (self._put(keys[:h], headers[:h], payloads[:h]) +
                    self._put(keys[h:], headers[h:], payloads[h:]))
        names = self._names(keys)
        with self._lock:
            self._grow_staging(need)
            stage = self._staging
            base = int(stage.ctypes.data)
            stage[:n * HEADER_SIZE] = np.frombuffer(b"".join(headers), np.uint8)
            ptrs, sizes, used = [], [], n * HEADER_SIZE
            for i, (p, d) in enumerate(zip(payloads, direct)):
                if not p.nbytes:
                    ptrs.append([base + i * HEADER_SIZE])
                    sizes.append([HEADER_SIZE])
                    continue
                if d:
                    addr = _address(p)
                else:  # not registered: one copy into the staging buffer
                    stage[used:used + p.nbytes] = np.frombuffer(p, np.uint8)
                    addr = base + used
                    used += p.nbytes
                ptrs.append([base + i * HEADER_SIZE, addr])
                sizes.append([HEADER_SIZE, p.nbytes])
            # A put never replaces an object: remove first (force: a reader's
            # lease must not keep a stale value), then put.
            store.batch_remove(names, True)
            rcs = store.batch_put_from_multi_buffers(names, ptrs, sizes)
        for rc in rcs:
            if rc != 0:
                self._code("batch_put_from_multi_buffers", rc)
        return [rc == 0 for rc in rcs]

    def _get_into(self, keys: list[bytes], buffers: list[memoryview]) -> list[tuple[bytes, int] | None]:
        store = self._ensure()
        n = len(keys)
        direct = [self._is_registered(b) and b.nbytes > 0 for b in buffers]
        need = n * HEADER_SIZE + sum(b.nbytes for b, d in zip(buffers, direct) if not d)
        if n > 1 and need > self._max_staging:  # split: staging memory stays bounded
            h = n // 2
            return self._get_into(keys[:h], buffers[:h]) + self._get_into(keys[h:], buffers[h:])
        names = self._names(keys)
        with self._lock:
            self._grow_staging(need)
            stage = self._staging
            base = int(stage.ctypes.data)
            ptrs, sizes, offs, used = [], [], [], n * HEADER_SIZE
            for i, (b, d) in enumerate(zip(buffers, direct)):
                offs.append(used)
                if not b.nbytes:
                    ptrs.append([base + i * HEADER_SIZE])
                    sizes.append([HEADER_SIZE])
                    continue
                ptrs.append([base + i * HEADER_SIZE, _address(b) if d else base + used])
                sizes.append([HEADER_SIZE, b.nbytes])
                if not d:
                    used += b.nbytes
            # Scatter reads need the exact object size: an object that is not
            # header + len(buffer) bytes fails here and is read whole below.
            rcs = store.batch_get_into_multi_buffers(names, ptrs, sizes)
            out: list[tuple[bytes, int] | None] = []
            odd: list[int] = []
            for i, rc in enumerate(rcs):
                if rc == _NOT_FOUND:
                    out.append(None)
                elif rc < 0:
                    out.append(None)
                    odd.append(i)
                else:
                    got = rc - HEADER_SIZE
                    header = stage[i * HEADER_SIZE:(i + 1) * HEADER_SIZE].tobytes()
                    if got > 0 and not direct[i]:
                        np.frombuffer(buffers[i], np.uint8)[:got] = stage[offs[i]:offs[i] + got]
                    out.append((header, max(got, 0)))
            if odd:  # size mismatch (or another error): fetch those frames whole
                blobs = store.get_batch([names[i] for i in odd])
                for i, blob in zip(odd, blobs):
                    out[i] = self._whole(i, names[i], rcs[i], blob, buffers[i])
        return out

    def _whole(self, i: int, name: str, rc: int, blob: bytes, buf: memoryview) -> tuple[bytes, int] | None:
        """Result of a frame that the scatter read refused (lock held)."""
        if not blob:
            if rc not in (_BUFFER_TOO_SMALL, _SIZE_MISMATCH):
                self._code("batch_get_into_multi_buffers", rc)
            return None
        header, payload = blob[:HEADER_SIZE], memoryview(blob)[HEADER_SIZE:]
        if len(header) < HEADER_SIZE:
            return (header, 0)  # verification reports the truncation
        if payload.nbytes <= buf.nbytes:
            buf[:payload.nbytes] = payload
        return (header, payload.nbytes)  # longer than the buffer: the base reports "does not fit"

    def _touch(self, keys: list[bytes]) -> None:
        self._ensure().batch_is_exist(self._names(keys))

    def _delete(self, keys: list[bytes]) -> int:
        store = self._ensure()
        with self._lock:
            # force=True: a recent reader's lease would otherwise block the removal.
            rcs = store.batch_remove(self._names(keys), True)
        return sum(1 for rc in rcs[:len(keys)] if rc == 0)

    def _close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
            if store is None:
                return
            if self._borrowed:  # leave a shared client open, but drop our registrations
                if self._staging.nbytes:
                    store.unregister_buffer(int(self._staging.ctypes.data))
                for addr, _ in self._registered:
                    store.unregister_buffer(addr)
            else:
                store.close()

    # --------------------------------------------------------- registrations
    def _is_registered(self, view: memoryview) -> bool:
        addr = _address(view)
        return any(a <= addr and addr + view.nbytes <= a + s for a, s in self._registered)

    def register_buffer(self, buffer: Any) -> bool:
        """Register host memory so exactly-sized :meth:`get_into` reads are zero-copy.

        ``buffer`` must stay alive until :meth:`unregister_buffer` or close.
        Returns whether the store accepted it.  O(1) plus the store's cost.
        """
        view = memoryview(buffer).cast("B")
        addr, size = _address(view), view.nbytes
        with self._lock:
            if (addr, size) in self._registered:  # idempotent: a second registration slows the store
                return True
            if self._store is not None and self._store.register_buffer(addr, size) != 0:
                return False
            self._registered.append((addr, size))
        return True

    def unregister_buffer(self, buffer: Any) -> None:
        """Forget a region registered with :meth:`register_buffer`."""
        view = memoryview(buffer).cast("B")
        addr = _address(view)
        with self._lock:
            self._registered = [(a, s) for a, s in self._registered if a != addr]
            if self._store is not None:
                self._store.unregister_buffer(addr)
