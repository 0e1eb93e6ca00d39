"""The L3 storage contract and the fault handling every backend shares.

:class:`StorageBackend` is the structural protocol the tier manager codes
against.  :class:`BaseBackend` implements it once: argument validation,
framing (see :mod:`.framing`), verification of everything read, counters, a
circuit breaker and rate-limited warnings.  A concrete backend only moves
framed bytes (``_exists/_get/_put/_touch/_delete/_close`` and optionally
``_get_into`` for zero-copy reads).

Failure policy: a backend that is down, slow, or returns
truncated/corrupt bytes never raises into the caller and never returns wrong
bytes.  Reads degrade to misses, writes to ``False``; each fault bumps a
counter.  A backend whose calls start failing logs one WARNING (it is
unreachable, with the first error) and every further failed call at DEBUG
until a call succeeds again (INFO); other faults (corrupt values, oversized
payloads) log a warning at most once per ``warn_interval_s`` per category.
Only bad *arguments* raise (``TypeError``/``ValueError`` naming the argument),
before anything is sent.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Protocol, Sequence, TypeVar, runtime_checkable

from . import framing
from .framing import FrameError

__all__ = ["StorageBackend", "BaseBackend", "CircuitBreaker", "STAT_NAMES", "backend_lacks", "logger"]

logger = logging.getLogger("hybridkv.tiers.storage")
T = TypeVar("T")

#: Counters reported by :meth:`StorageBackend.stats`.
STAT_NAMES = ("hits", "misses", "puts", "put_failures", "deletes", "errors", "corrupt",
              "timeouts", "skipped", "evictions", "bytes_read", "bytes_written",
              "read_keys_failed", "write_keys_failed")
_READ_OPS = ("exists", "get", "get_into")
MAX_KEY_BYTES = 512


@runtime_checkable
class StorageBackend(Protocol):
    """Batched page store keyed by page keys (``bytes``, see :mod:`hybridkv.tiers.keys`).

    Values are opaque payloads (bytes-like).  All methods take batches; the
    i-th result belongs to the i-th key.  None of them raises on a backend
    fault; bad arguments raise ``TypeError``/``ValueError``.
    """

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (a hint: a later get may still miss)."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        """Verified payload of each key, or ``None`` for a miss."""
        ...

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Read payload i into ``buffers[i]``; bytes read, or -1 for a miss."""
        ...

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[bool]:
        """Store (or overwrite) each value; ``True`` where it was stored."""
        ...

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark keys as recently used (refresh LRU position / TTL)."""
        ...

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove keys (missing keys are ignored)."""
        ...

    def close(self) -> None:
        """Release connections, registrations and servers' client state."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters (see :data:`STAT_NAMES`)."""
        ...


#: The methods a storage backend must have (the protocol's, in order).
BACKEND_METHODS = ("exists", "get", "get_into", "put", "touch", "delete", "close", "stats")


def backend_lacks(obj: object) -> list[str]:
    """The :class:`StorageBackend` methods ``obj`` does not have as callables.

    Looked up with ``getattr``, so a wrapper that serves them by delegation
    (``__getattr__``) qualifies on every Python: ``isinstance`` against the
    runtime-checkable protocol stopped seeing such attributes in 3.12.
    O(methods).
    """
    return [m for m in BACKEND_METHODS if not callable(getattr(obj, m, None))]


class CircuitBreaker:
    """Skip a failing backend for a cool-down, then let one probe through.

    States: *closed* (all calls pass), *open* (calls are refused until
    ``cooldown_s`` has elapsed since the last failure), *half-open* (one probe
    call passes; success closes the breaker, failure re-opens it).  The breaker
    opens after ``threshold`` consecutive failed calls.  Thread-safe; O(1).
    """

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"threshold must be an int >= 1, got {threshold!r}")
        if not isinstance(cooldown_s, (int, float)) or cooldown_s < 0:
            raise ValueError(f"cooldown_s must be a number >= 0, got {cooldown_s!r}")
        self.threshold = threshold
        self.cooldown_s = float(cooldown_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False
        self.opened = 0  # how many times the breaker has opened

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half-open"``."""
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "half-open" if self._clock() >= self._open_until else "open"

    def allow(self) -> bool:
        """Whether a call may go to the backend now (claims the probe slot)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._clock() < self._open_until or self._probing:
                return False
            self._probing = True
            return True

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._open_until = None
            self._probing = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._probing or self._failures >= self.threshold:
                if self._open_until is None or self._probing:
                    self.opened += 1
                self._open_until = self._clock() + self.cooldown_s
                self._probing = False


def _as_bytes_view(value: Any, name: str) -> memoryview:
    try:
        view = memoryview(value)
    except TypeError:
        raise TypeError(f"{name} must be bytes-like, got {type(value).__name__}") from None
    if not view.contiguous:
        raise ValueError(f"{name} must be a contiguous buffer")
    return view if (view.ndim == 1 and view.format == "B") else view.cast("B")


class BaseBackend(ABC):
    """Shared implementation of :class:`StorageBackend`.

    Args:
        breaker_threshold: consecutive failed calls that open the circuit breaker.
        breaker_cooldown_s: seconds a tripped backend is skipped before a probe.
        warn_interval_s: minimum seconds between two warnings of one category.
        checksum_algo: algorithm for values written by this object
            (:data:`framing.ALGO_NH64`, ``ALGO_XXH3`` or ``ALGO_CRC32``; reads
            accept all); ``None``: :func:`framing.preferred_algo`.

    Thread-safe as far as the concrete backend's client is; counters are locked.
    """

    scheme = "abstract"
    #: whether ``_get_into`` reads straight into caller buffers (else get + copy)
    zero_copy = False

    def __init__(self, *, breaker_threshold: int = 3, breaker_cooldown_s: float = 5.0,
                 warn_interval_s: float = 10.0, checksum_algo: int | None = None) -> None:
        if checksum_algo is None:
            checksum_algo = framing.preferred_algo()
        framing.checksum(b"", checksum_algo)  # validates the algorithm id
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown_s)
        self._warn_interval = float(warn_interval_s)
        self._algo = checksum_algo
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._last_warn: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._closed = False
        self._answering = True  # False from the first failed call until one succeeds
        #: the last read/write fault in one line (``"get: ConnectionError: ..."``), or None
        self.last_error: str | None = None

    # ----------------------------------------------------------- subclass API
    @abstractmethod
    def _exists(self, keys: list[bytes]) -> list[bool]: ...

    @abstractmethod
    def _get(self, keys: list[bytes]) -> list[Any]:
        """Per key: the framed value (bytes-like), ``(header, payload[, checksum])``, or ``None``."""

    @abstractmethod
    def _put(self, keys: list[bytes], headers: list[bytes], payloads: list[memoryview]) -> list[bool]:
        """Store ``headers[i] + payloads[i]`` under ``keys[i]``, atomically per key."""

    @abstractmethod
    def _touch(self, keys: list[bytes]) -> None: ...

    @abstractmethod
    def _delete(self, keys: list[bytes]) -> int:
        """Remove keys; return how many were removed."""

    @abstractmethod
    def _close(self) -> None: ...

    def _get_into(self, keys: list[bytes], buffers: list[memoryview]) -> list[tuple[Any, ...] | None] | None:
        """Zero-copy read hook: payload i into ``buffers[i]``.

        Return ``None`` to use the generic get-and-copy path, else per key
        ``None`` (miss) or ``(header, n)``: the raw header and the payload bytes
        now in ``buffers[i][:n]``, optionally ``(header, n, checksum)`` with the
        checksum (header's algorithm) streamed over exactly those bytes.  If
        the header announces more bytes than the buffer holds, return
        ``(header, announced_len)`` without reading.
        """
        return None

    def _classify(self, exc: BaseException) -> str:
        """Counter for an exception raised by the client: ``timeouts`` or ``errors``."""
        return "timeouts" if isinstance(exc, TimeoutError) else "errors"

    # ------------------------------------------------------------ accounting
    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[name] += n

    def _warn(self, category: str, message: str) -> None:
        """Log ``message`` unless ``category`` already logged within the interval."""
        now = time.monotonic()
        with self._stats_lock:
            last = self._last_warn.get(category)
            if last is not None and now - last < self._warn_interval:
                self._suppressed[category] = self._suppressed.get(category, 0) + 1
                return
            self._last_warn[category] = now
            suppressed = self._suppressed.pop(category, 0)
        extra = f" ({suppressed} similar warnings suppressed)" if suppressed else ""
        logger.warning("%s backend: %s%s", self.scheme, message, extra)

    def _call_failed(self, what: str, exc: BaseException) -> None:
        """Log a failed call: one WARNING when the backend stops answering, DEBUG for the
        rest (a down backend fails every call; one line says so).  Mutates the answering flag.

        The WARNING record carries ``l3_unreachable`` (the error in one line) so that a
        front end can word it for its users.
        """
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        with self._stats_lock:
            first, self._answering = self._answering, False
        if first:
            logger.warning("%s backend unreachable (%s, in %s); reads are misses and writes are dropped "
                           "until it answers again", self.scheme, why, what, extra={"l3_unreachable": why})
        else:
            logger.debug("%s backend: %s failed (%s; breaker %s)", self.scheme, what, why, self.breaker.state)

    def _call_succeeded(self) -> None:
        """Close the breaker; log at INFO when a backend that had stopped answering answers again."""
        self.breaker.record_success()
        if not self._answering:  # unlocked read keeps the hot path cheap; the lock settles races
            with self._stats_lock:
                back = not self._answering
                self._answering = True
            if back:
                logger.info("%s backend answers again", self.scheme)

    def stats(self) -> dict[str, int]:
        """Snapshot of the counters plus ``breaker_open`` (0/1) and ``breaker_trips``. O(1)."""
        with self._stats_lock:
            out = dict(self._stats)
        out["breaker_open"] = int(self.breaker.state == "open")
        out["breaker_trips"] = self.breaker.opened
        return out

    def _guard(self, op: str, n: int, call: Callable[[], T], fallback: Callable[[], T]) -> T:
        """Run a backend call behind the breaker; faults become ``fallback()``."""
        failed = "read_keys_failed" if op in _READ_OPS else "write_keys_failed" if op == "put" else None
        if self._closed:
            self._count("errors")
            if failed:
                self._count(failed, n)
                self.last_error = f"{op}: the backend is closed"
            self._warn("closed", f"{op} on a closed backend; treated as a miss")
            return fallback()
        if not self.breaker.allow():
            self._count("skipped", n)
            if failed:
                self._count(failed, n)
            return fallback()
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - any client fault must degrade, not raise
            category = self._classify(exc)
            self._count(category)
            if failed:  # why reads/writes failed (touch/delete faults only log)
                self._count(failed, n)
                self.last_error = f"{op}: {type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
            self.breaker.record_failure()
            self._call_failed(f"{op} of {n} keys", exc)
            return fallback()
        self._call_succeeded()
        return result

    # ------------------------------------------------------------ validation
    @staticmethod
    def _check_keys(keys: Any) -> list[bytes]:
        if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
            raise TypeError(f"keys must be a sequence of bytes keys, got {type(keys).__name__}")
        out = list(keys)
        for i, key in enumerate(out):
            if not isinstance(key, bytes):
                raise TypeError(f"keys[{i}] must be bytes, got {type(key).__name__}")
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"keys[{i}] must have 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        return out

    # ------------------------------------------------------------ public API
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored.  O(len(keys)) round trips batched per backend."""
        ks = self._check_keys(keys)
        if not ks:
            return []
        res = self._guard("exists", len(ks), lambda: self._exists(ks), lambda: [False] * len(ks))
        return [bool(r) for r in res]

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        """Verified payloads (memoryviews into freshly read buffers) or ``None``.

        Every value is checked (magic, version, key, length, checksum); a
        failed check is a miss counted in ``corrupt``.  O(total bytes).
        """
        ks = self._check_keys(keys)
        if not ks:
            return []
        raw = self._guard("get", len(ks), lambda: self._get(ks), lambda: [None] * len(ks))
        out: list[bytes | memoryview | None] = []
        for key, payload in zip(ks, self._verify_many(ks, raw)):
            out.append(payload)
            if payload is None:
                self._count("misses")
            else:
                self._count("hits")
                self._count("bytes_read", payload.nbytes)
        return out

    def _verify_many(self, keys: list[bytes], blobs: list[Any]) -> list[memoryview | None]:
        """Verified payload views (``None`` = miss) for what ``_get`` returned.

        Headers are checked first; the payloads that still need a checksum
        are hashed in one batch (NH64: one kernel call on all cores).
        """
        todo: list[tuple[int, bytes, memoryview, int, int, int]] = []
        out: list[memoryview | None] = [None] * len(keys)
        for i, (key, blob) in enumerate(zip(keys, blobs)):
            if blob is None:
                continue
            try:
                if isinstance(blob, tuple):  # (header, payload[, checksum computed while reading])
                    header, payload = blob[0], blob[1]
                    algo, length, csum = framing.parse_header(key, header)
                    if memoryview(header).nbytes != framing.HEADER_SIZE:
                        raise FrameError("length-mismatch", "header has trailing bytes")
                    view = memoryview(payload).cast("B")
                    if len(blob) > 2:
                        framing.verify_payload(view, algo, length, csum, blob[2])
                        out[i] = view
                        continue
                else:
                    algo, length, csum, view = framing.split_frame(key, blob)
                framing.check_length(view.nbytes, length)
                todo.append((i, key, view, algo, length, csum))
            except FrameError as exc:
                self._corrupt(key, exc)
        self._check_sums(todo, lambda i, view: out.__setitem__(i, view))
        return out

    def _check_sums(self, todo: list[tuple[int, bytes, memoryview, int, int, int]],
                    accept: Callable[[int, memoryview], None]) -> None:
        """Hash ``(index, key, view, algo, length, checksum)`` entries per
        algorithm in one batch each; ``accept`` the ones that match."""
        for algo in sorted({t[3] for t in todo}):
            group = [t for t in todo if t[3] == algo]
            try:
                sums = framing.checksums([t[2] for t in group], algo)
            except FrameError as exc:  # e.g. xxh3 frames without xxhash installed
                for t in group:
                    self._corrupt(t[1], exc)
                continue
            for (i, key, view, _algo, length, csum), got in zip(group, sums):
                try:
                    framing.verify_payload(view, algo, length, csum, got)
                except FrameError as exc:
                    self._corrupt(key, exc)
                    continue
                accept(i, view)

    def _corrupt(self, key: bytes, exc: FrameError) -> None:
        self._count("corrupt")
        self._warn(f"corrupt:{exc.reason}", f"value for key {key.hex()[:16]}... rejected ({exc}); miss")

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Read each verified payload into ``buffers[i]`` (writable, contiguous).

        Returns bytes written per key, or -1 for a miss (also when the payload
        does not fit the buffer).  After -1 the buffer's content is undefined.
        Zero-copy where the backend supports it (:attr:`zero_copy`), else one
        copy from :meth:`get`.  O(total bytes).
        """
        ks = self._check_keys(keys)
        if isinstance(buffers, (bytes, bytearray, memoryview)) or not isinstance(buffers, Sequence):
            raise TypeError(f"buffers must be a sequence of memoryviews, got {type(buffers).__name__}")
        if len(buffers) != len(ks):
            raise ValueError(f"buffers has {len(buffers)} entries for {len(ks)} keys")
        views = []
        for i, buf in enumerate(buffers):
            view = _as_bytes_view(buf, f"buffers[{i}]")
            if view.readonly:
                raise TypeError(f"buffers[{i}] must be writable")
            views.append(view)
        if not ks:
            return []
        direct = self._guard("get_into", len(ks), lambda: self._get_into(ks, views),
                             lambda: [None] * len(ks))
        if direct is None:
            return self._get_into_by_copy(ks, views)
        out = [-1] * len(ks)
        todo: list[tuple[int, bytes, memoryview, int, int, int]] = []
        for i, (key, view, res) in enumerate(zip(ks, views, direct)):
            if res is None:
                continue
            header, n = res[0], res[1]
            computed = res[2] if len(res) > 2 else None  # checksum streamed by the backend
            try:
                algo, length, csum = framing.parse_header(key, header)
                if length > view.nbytes:
                    self._warn_too_big(key, length, view.nbytes)
                    continue
                framing.check_length(n, length)  # stored bytes vs the announced length
                if computed is not None:
                    framing.verify_payload(view[:n], algo, length, csum, computed)
                    out[i] = n
                else:
                    todo.append((i, key, view[:n], algo, length, csum))
            except FrameError as exc:
                self._corrupt(key, exc)
        self._check_sums(todo, lambda i, v: out.__setitem__(i, v.nbytes))
        hits = [n for n in out if n >= 0]
        self._count("hits", len(hits))
        self._count("misses", len(out) - len(hits))
        self._count("bytes_read", sum(hits))
        return out

    def _miss_too_big(self, key: bytes, length: int, room: int) -> None:
        self._count("misses")
        self._warn_too_big(key, length, room)

    def _warn_too_big(self, key: bytes, length: int, room: int) -> None:
        self._warn("too-big", f"payload of {length} bytes for key {key.hex()[:16]}... does not fit "
                              f"a {room}-byte buffer; miss")

    def _get_into_by_copy(self, keys: list[bytes], views: list[memoryview]) -> list[int]:
        out = []
        for key, view, payload in zip(keys, views, self.get(keys)):
            if payload is None:
                out.append(-1)
                continue
            n = memoryview(payload).nbytes
            if n > view.nbytes:
                self._count("hits", -1)  # get() counted it; it is a miss for this caller
                self._miss_too_big(key, n, view.nbytes)
                out.append(-1)
                continue
            view[:n] = payload
            out.append(n)
        return out

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[bool]:
        """Store each value framed (header + payload); overwrites existing keys.

        Returns per key whether it was stored.  O(total bytes) (checksum + I/O).
        """
        ks = self._check_keys(keys)
        if isinstance(values, (bytes, bytearray, memoryview)) or not isinstance(values, Sequence):
            raise TypeError(f"values must be a sequence of bytes-like values, got {type(values).__name__}")
        if len(values) != len(ks):
            raise ValueError(f"values has {len(values)} entries for {len(ks)} keys")
        payloads = [_as_bytes_view(v, f"values[{i}]") for i, v in enumerate(values)]
        if not ks:
            return []
        sums = framing.checksums(payloads, self._algo)  # NH64: one call, all cores
        headers = [framing.header_for(k, p.nbytes, c, self._algo) for k, p, c in zip(ks, payloads, sums)]
        res = self._guard("put", len(ks), lambda: self._put(ks, headers, payloads),
                          lambda: [False] * len(ks))
        ok = [bool(r) for r in res]
        stored = sum(ok)
        self._count("puts", stored)
        self._count("put_failures", len(ok) - stored)
        self._count("bytes_written", sum(p.nbytes for p, s in zip(payloads, ok) if s))
        return ok

    def touch(self, keys: Sequence[bytes]) -> None:
        """Refresh recency/TTL of ``keys`` (missing keys are ignored)."""
        ks = self._check_keys(keys)
        if ks:
            self._guard("touch", len(ks), lambda: self._touch(ks), lambda: None)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys`` (missing keys are ignored); counted in ``deletes``."""
        ks = self._check_keys(keys)
        if ks:
            n = self._guard("delete", len(ks), lambda: self._delete(ks), lambda: 0)
            self._count("deletes", int(n or 0))

    def register_buffer(self, buffer: Any) -> bool:
        """Register host memory for zero-copy :meth:`get_into` (default: no-op, ``False``)."""
        _as_bytes_view(buffer, "buffer")
        return False

    def unregister_buffer(self, buffer: Any) -> None:
        """Undo :meth:`register_buffer` (default: no-op)."""
        _as_bytes_view(buffer, "buffer")

    def close(self) -> None:
        """Release the client; later calls are counted misses.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
        except Exception as exc:  # noqa: BLE001 - shutting down must not raise
            self._warn("close", f"close failed ({type(exc).__name__}: {exc})")

    def __enter__(self) -> "BaseBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.scheme}>"

