"""Mooncake Store L3 backend (``mooncake-transfer-engine[-non-cuda]``).

URL: ``mooncake://<master host>:<rpc port>?metadata=http://host:port/metadata``
with optional ``protocol`` (``tcp``; ``rdma`` where devices exist), ``device``
(RDMA device list), ``local_host`` (address this client's segment is served
on, default ``127.0.0.1``), ``segment_bytes`` (memory this client contributes
to the distributed pool, default 256 MiB), ``buffer_bytes`` (client transfer
buffer, default 64 MiB) and ``key_prefix`` (default ``hkv:``).

Layout: the frame is split over two objects, ``<prefix><key hex>`` (the
payload) and ``<prefix><key hex>:h`` (the 40-byte header), written and read in
one batch call.  That lets the payload move straight between Mooncake and the
caller's memory: headers live in a staging buffer registered once, payloads
in memory the caller registered with :meth:`register_buffer` (e.g. the L2
host pool) are sent/received in place (``batch_upsert_from`` /
``batch_get_into``: zero-copy); other payloads are copied through the staging
buffer (one memcpy).  The header's length and checksum bind the pair: a torn
pair (one half evicted, or a read racing an overwrite) is a miss, never wrong
bytes.  :meth:`get` (no buffers) uses ``get_batch``.

Thread safety: one batch upsert of the two halves is not atomic, so a read
racing an overwrite or a delete of the same key can see the new payload with
the old header (or a header whose payload is mid-replace and reads back
empty).  That would be a spurious miss counted as ``corrupt``.  Every read,
write and delete of one backend object therefore runs under its lock (the
same lock that guards the staging buffer); exists/touch are hints and stay
unlocked.  Two *different* clients writing one key can still tear a pair:
that stays a verified miss.

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
_BUFFER_TOO_SMALL = -600  # returned by batch_get_into when the object does not fit


def _port_open(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _announced(header: bytes) -> int:
    """Payload length field of a (possibly bad) header; -1 if too short."""
    return int.from_bytes(header[24:32], "little") if len(header) >= 32 else -1


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

    def _names(self, keys: list[bytes]) -> tuple[list[str], list[str]]:
        """(payload object names, header object names)."""
        names = [self._prefix + k.hex() for k in keys]
        return names, [n + ":h" for n in names]

    def _code(self, op: str, rc: int) -> None:
        self._count("errors")
        self._warn(f"{op}:{rc}", f"{op} returned error code {rc}; treated as a miss")

    def _torn(self, name: str) -> None:
        self._warn("torn", f"only one half of {name[:24]}... is stored (evicted or being "
                           "overwritten); miss")

    # ------------------------------------------------------------ operations
    def _exists(self, keys: list[bytes]) -> list[bool]:
        pn, hn = self._names(keys)
        res = self._ensure().batch_is_exist(pn + hn)
        for rc in res:
            if rc < 0:
                self._code("batch_is_exist", rc)
        n = len(keys)
        return [res[i] == 1 and res[n + i] == 1 for i in range(n)]

    def _get(self, keys: list[bytes]) -> list[Any]:
        pn, hn = self._names(keys)
        store = self._ensure()
        with self._lock:  # not concurrently with a put/delete of this client (module doc)
            vals = store.get_batch(pn + hn)  # b"" for a missing object
        n = len(keys)
        out: list[Any] = []
        for i in range(n):
            payload, header = vals[i], vals[n + i]
            if not header:
                if payload:
                    self._torn(pn[i])
                out.append(None)
            elif _announced(header) == 0 and len(payload) == 1:
                out.append((header, b""))  # empty payloads are stored as 1 dummy byte
            else:  # a header without payload object verifies as truncated
                out.append((header, payload))
        return out

    def _put(self, keys: list[bytes], headers: list[bytes], payloads: list[memoryview]) -> list[bool]:
        store = self._ensure()
        n = len(keys)
        direct = [self._is_registered(p) for p in payloads]
        need = n * HEADER_SIZE + sum(p.nbytes for p, d in zip(payloads, direct) if not d)
        if n > 1 and need > self._max_staging:  # split: staging memory stays bounded
            h = n // 2
            return (self._put(keys[:h], headers[:h], payloads[:h]) +
                    self._put(keys[h:], headers[h:], payloads[h:]))
        pn, hn = self._names(keys)
        with self._lock:
            self._grow_staging(need)
            stage = self._staging
            base = int(stage.ctypes.data)
            stage[:n * HEADER_SIZE] = np.frombuffer(b"".join(headers), np.uint8)
            ptrs, used = [], n * HEADER_SIZE
            for p, d in zip(payloads, direct):
                if d:
                    ptrs.append(_address(p))
                else:  # not registered: one copy into the staging buffer
                    stage[used:used + p.nbytes] = np.frombuffer(p, np.uint8)
                    ptrs.append(base + used)
                    used += p.nbytes
            # Mooncake refuses 0-byte objects: an empty payload is stored as one
            # dummy byte, which readers drop because the header announces 0.
            sizes = [max(1, p.nbytes) for p in payloads]
            ptrs = [ptr if p.nbytes else base for ptr, p in zip(ptrs, payloads)]
            rcs = store.batch_upsert_from(pn + hn, ptrs + [base + i * HEADER_SIZE for i in range(n)],
                                          sizes + [HEADER_SIZE] * n)
        for rc in rcs:
            if rc != 0:
                self._code("batch_upsert_from", rc)
        return [rcs[i] == 0 and rcs[n + i] == 0 for i in range(n)]

    def _get_into(self, keys: list[bytes], buffers: list[memoryview]) -> list[tuple[bytes, int] | None]:
        store = self._ensure()
        n = len(keys)
        direct = [self._is_registered(b) for b in buffers]
        slot = [b.nbytes + 1 for b in buffers]  # +1: empty payloads are 1-byte objects (see _put)
        need = n * HEADER_SIZE + sum(s for s, d in zip(slot, direct) if not d)
        if n > 1 and need > self._max_staging:  # split: staging memory stays bounded
            h = n // 2
            return self._get_into(keys[:h], buffers[:h]) + self._get_into(keys[h:], buffers[h:])
        pn, hn = self._names(keys)
        with self._lock:
            self._grow_staging(need)
            stage = self._staging
            base = int(stage.ctypes.data)
            ptrs, offs, used = [], [], n * HEADER_SIZE
            for b, d, s in zip(buffers, direct, slot):
                offs.append(used)
                if d and b.nbytes:
                    ptrs.append(_address(b))
                else:
                    ptrs.append(base + used)
                    used += s
            sizes = [b.nbytes if (d and b.nbytes) else s for b, d, s in zip(buffers, direct, slot)]
            rcs = store.batch_get_into(pn + hn, ptrs + [base + i * HEADER_SIZE for i in range(n)],
                                       sizes + [HEADER_SIZE] * n)
            out = [self._take(i, pn[i], buffers[i], direct[i], offs[i], rcs[i], rcs[n + i])
                   for i in range(n)]
        return out

    def _take(self, i: int, name: str, buf: memoryview, direct: bool, off: int,
              rp: int, rh: int) -> tuple[bytes, int] | None:
        """Result of one key of :meth:`_get_into` (staging lock held)."""
        if rh == _NOT_FOUND:
            if rp != _NOT_FOUND:
                self._torn(name)
            return None
        if rh < 0:
            self._code("batch_get_into", rh)
            return None
        header = self._staging[i * HEADER_SIZE:i * HEADER_SIZE + rh].tobytes()
        if rp == _NOT_FOUND:
            return (header, 0)  # header without payload: verification reports truncation
        if rp == _BUFFER_TOO_SMALL:
            return (header, buf.nbytes + 1)  # the base reports "does not fit"
        if rp < 0:
            self._code("batch_get_into", rp)
            return None
        if rp == 1 and _announced(header) == 0:
            return (header, 0)  # empty payloads are stored as 1 dummy byte
        if not (direct and buf.nbytes) and 0 < rp <= buf.nbytes:
            np.frombuffer(buf, np.uint8)[:rp] = self._staging[off:off + rp]
        return (header, rp)

    def _touch(self, keys: list[bytes]) -> None:
        pn, hn = self._names(keys)
        self._ensure().batch_is_exist(pn + hn)

    def _delete(self, keys: list[bytes]) -> int:
        pn, hn = self._names(keys)
        store = self._ensure()
        with self._lock:  # a reader must not see one half removed (module doc)
            # force=True: a recent reader's lease would otherwise block the removal.
            rcs = store.batch_remove(pn + hn, True)
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
