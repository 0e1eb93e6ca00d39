"""Mooncake Store L3 backend (``mooncake-transfer-engine[-non-cuda]``).

URL: ``mooncake://<master host>:<rpc port>?metadata=http://host:port/metadata``
with optional ``protocol`` (``tcp``; ``rdma`` where devices exist), ``device``
(RDMA device list), ``local_host`` (address this client's segment is served
on, default ``127.0.0.1``), ``segment_bytes`` (memory this client contributes
to the distributed pool, default 256 MiB), ``buffer_bytes`` (client transfer
buffer, default 64 MiB) and ``key_prefix`` (default ``hkv:``).

Data path: values are staged in a host buffer registered with the store once
(grown on demand) and written with ``batch_upsert_from`` (insert or
overwrite); :meth:`get_into` reads with ``batch_get_into`` into the staging
buffer and copies each verified payload out, so it costs one memcpy instead of
a Python ``bytes`` allocation.  When the caller registered its buffers with
:meth:`register_buffer` and a buffer is exactly the payload size (fixed-size
KV pages), the object is scattered straight into it (header to a scratch
area, payload to the buffer) with ``batch_get_into_multi_buffers``: zero-copy.

Mooncake specifics: a read grants the reader a lease during which a plain
remove fails, so :meth:`delete` removes with ``force=True``.  The master
evicts on its own (watermark + lease expiry); :meth:`touch` only probes the
keys (``batch_is_exist``) and is best effort.  ``setup()`` retries for about
90 s against a dead master, so the backend first checks that the master's
port accepts a TCP connection and fails fast (a miss) otherwise; a failed
setup is retried on the circuit breaker's next probe.
"""

from __future__ import annotations

import ctypes
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
_BUFFER_TOO_SMALL = -600  # returned by batch_get_into when the object does not fit


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
        connect_timeout_s: TCP probe timeout before ``setup()``.
        store: an already set-up ``MooncakeDistributedStore`` to share (e.g.
            the engine's own); it is borrowed, so :meth:`close` leaves it open.
        **base: see :class:`BaseBackend`.
    """

    scheme = "mooncake"
    zero_copy = True  # for registered, exactly-sized buffers (see module doc)

    def __init__(self, master: str, *, metadata: str, protocol: str = "tcp", device: str = "",
                 local_host: str = "127.0.0.1", segment_bytes: int = 256 << 20,
                 buffer_bytes: int = 64 << 20, key_prefix: str = "hkv:",
                 staging_bytes: int = 16 << 20, connect_timeout_s: float = 1.0,
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
        self._lock = threading.Lock()  # guards setup, the staging buffer and registrations
        self._store: Any = None
        self._borrowed = store is not None
        self._staging = np.empty(0, dtype=np.uint8)
        self._staging_want = staging_bytes
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
            self._warn("connect", f"{exc}; the backend answers misses until it connects")

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
        # get_batch returns b"" for a missing key; a framed value is never empty.
        return [v if v else None for v in self._ensure().get_batch(self._names(keys))]

    def _put(self, keys: list[bytes], headers: list[bytes], payloads: list[memoryview]) -> list[bool]:
        store = self._ensure()
        sizes = [HEADER_SIZE + p.nbytes for p in payloads]
        out: list[bool] = []
        with self._lock:
            self._grow_staging(max(sizes))
            base = int(self._staging.ctypes.data)
            cap = self._staging.nbytes
            start = 0
            while start < len(keys):  # chunks that fit the staging buffer
                end, used, ptrs = start, 0, []
                while end < len(keys) and used + sizes[end] <= cap:
                    ptrs.append(base + used)
                    self._staging[used:used + HEADER_SIZE] = np.frombuffer(headers[end], np.uint8)
                    self._staging[used + HEADER_SIZE:used + sizes[end]] = np.frombuffer(payloads[end], np.uint8)
                    used += sizes[end]
                    end += 1
                rcs = store.batch_upsert_from(self._names(keys[start:end]), ptrs, sizes[start:end])
                for rc in rcs:
                    if rc != 0:
                        self._code("batch_upsert_from", rc)
                out.extend(rc == 0 for rc in rcs)
                start = end
        return out

    def _get_into(self, keys: list[bytes], buffers: list[memoryview]) -> list[tuple[bytes, int] | None]:
        store = self._ensure()
        names = self._names(keys)
        out: list[tuple[bytes, int] | None] = [None] * len(keys)
        with self._lock:
            slots = [HEADER_SIZE + b.nbytes for b in buffers]
            self._grow_staging(sum(slots))
            base = int(self._staging.ctypes.data)
            offsets = np.concatenate(([0], np.cumsum(slots)[:-1])).astype(np.int64).tolist()
            direct = [i for i, b in enumerate(buffers) if self._is_registered(b)]
            retry = self._get_direct(store, names, buffers, direct, base, offsets, out)
            staged = [i for i in range(len(keys)) if i not in set(direct)] + retry
            if staged:
                rcs = store.batch_get_into([names[i] for i in staged],
                                           [base + offsets[i] for i in staged],
                                           [slots[i] for i in staged])
                for i, n in zip(staged, rcs):
                    out[i] = self._take_staged(names[i], buffers[i], offsets[i], n)
        return out

    def _get_direct(self, store: Any, names: list[str], buffers: list[memoryview], idx: list[int],
                    base: int, offsets: list[int], out: list[tuple[bytes, int] | None]) -> list[int]:
        """Scatter objects into registered caller buffers; indices to retry via staging."""
        if not idx:
            return []
        rcs = store.batch_get_into_multi_buffers(
            [names[i] for i in idx],
            [[base + offsets[i], _address(buffers[i])] for i in idx],
            [[HEADER_SIZE, buffers[i].nbytes] for i in idx])
        retry = []
        for i, n in zip(idx, rcs):
            if n == _NOT_FOUND:
                continue
            if n < HEADER_SIZE:  # size differs from the buffer: fall back to the staging path
                retry.append(i)
                continue
            o = offsets[i]
            out[i] = (self._staging[o:o + HEADER_SIZE].tobytes(), n - HEADER_SIZE)
        return retry

    def _take_staged(self, name: str, buf: memoryview, offset: int, n: int) -> tuple[bytes, int] | None:
        if n == _NOT_FOUND:
            return None
        if n == _BUFFER_TOO_SMALL:
            self._warn("too-big", f"value for {name[:24]}... does not fit a {buf.nbytes}-byte buffer; miss")
            return None
        if n < 0:
            self._code("batch_get_into", n)
            return None
        header = self._staging[offset:offset + HEADER_SIZE].tobytes()
        payload = max(0, n - HEADER_SIZE)
        if payload <= buf.nbytes:
            np.frombuffer(buf, np.uint8)[:payload] = self._staging[offset + HEADER_SIZE:offset + n]
        return header, payload

    def _touch(self, keys: list[bytes]) -> None:
        self._ensure().batch_is_exist(self._names(keys))

    def _delete(self, keys: list[bytes]) -> int:
        # force=True: a recent reader's lease would otherwise block the removal.
        rcs = self._ensure().batch_remove(self._names(keys), True)
        return sum(1 for rc in rcs if rc == 0)

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
