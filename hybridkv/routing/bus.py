"""Transport of KV-event batches from workers to the global index.

Two buses with one interface:

* :class:`MemoryBus`: an in-process list (simulations, unit tests).
* :class:`RedisStreamBus`: one Redis stream; each batch is one ``XADD``
  entry, trimmed to about ``maxlen`` entries (``MAXLEN ~``).  Readers keep
  their own cursor (stream id), so any number of routers can follow it.

A bus raises :class:`BusError` for every transport failure (server down,
timeout, protocol error): callers turn that into a counter and a fallback,
never into an exception for the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "BusError",
    "EventBatch",
    "EventBus",
    "KVEvent",
    "MemoryBus",
    "RedisStreamBus",
    "decode_batch",
    "encode_batch",
]

#: Event kinds.  ``store``/``remove`` add/drop pages (full KV, SWA with it);
#: ``swa_store``/``swa_remove`` change only SWA validity; ``reset`` drops
#: everything the index believes about the worker's ``tier`` (sent first
#: after a restart or after events were lost).
KINDS = ("store", "remove", "swa_store", "swa_remove", "reset")


class BusError(RuntimeError):
    """The transport failed; the batch was not delivered (or not read)."""


@dataclass(frozen=True)
class KVEvent:
    """Pages of one tier of one worker that changed.

    ``keys`` are the chained page keys (:func:`hybridkv.tiers.keys.page_keys`)
    of consecutive pages; ``swa_valid`` holds one flag per page *after* the
    event (ignored for ``remove`` and ``reset``).
    """

    tier: str
    kind: str
    namespace: str
    keys: tuple[bytes, ...]
    swa_valid: tuple[bool, ...]


@dataclass
class EventBatch:
    """What a publisher sends at one flush.

    ``epoch`` changes when a publisher restarts; ``seq`` counts batches of one
    epoch from 0, so a reader sees a gap (lost batches) as a jump.  ``load`` is
    the worker's queued uncached tokens at flush time (None = not reported).
    """

    worker: int
    epoch: str
    seq: int
    time: float
    events: list[KVEvent] = field(default_factory=list)
    load: float | None = None


def encode_batch(batch: EventBatch) -> dict[str, bytes]:
    """Stream-entry fields of ``batch``: a JSON header and the keys as one blob."""
    head = [[e.tier, e.kind, e.namespace, len(e.keys), "".join("1" if v else "0" for v in e.swa_valid)]
            for e in batch.events]
    meta = {"w": batch.worker, "ep": batch.epoch, "seq": batch.seq, "t": batch.time, "ev": head,
            "load": batch.load}
    return {"meta": json.dumps(meta, separators=(",", ":")).encode(),
            "keys": b"".join(k for e in batch.events for k in e.keys)}


def decode_batch(fields: dict[Any, Any], key_bytes: int = 16) -> EventBatch:
    """Inverse of :func:`encode_batch`; raises ValueError on a malformed entry."""
    try:
        meta = json.loads(fields.get(b"meta", fields.get("meta")))
        blob = fields.get(b"keys", fields.get("keys", b"")) or b""
        events, pos = [], 0
        for tier, kind, ns, n, swa in meta["ev"]:
            if kind not in KINDS:
                raise ValueError(f"unknown event kind {kind!r}")
            keys = tuple(blob[pos + i * key_bytes:pos + (i + 1) * key_bytes] for i in range(n))
            pos += n * key_bytes
            events.append(KVEvent(tier, kind, ns, keys, tuple(c == "1" for c in swa)))
        if pos != len(blob):
            raise ValueError("key blob length does not match the header")
        return EventBatch(int(meta["w"]), str(meta["ep"]), int(meta["seq"]), float(meta["t"]), events,
                          meta.get("load"))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed KV-event entry: {exc}") from None


class EventBus(Protocol):
    """Publish batches; read them after a cursor."""

    def publish(self, batch: EventBatch) -> None: ...

    def read(self, cursor: str, count: int) -> tuple[str, list[EventBatch]]: ...


class MemoryBus:
    """In-process bus: batches kept in a list; the cursor is an index (as str).

    ``fail`` makes every call raise :class:`BusError` (fault tests).
    """

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.fail = False

    def publish(self, batch: EventBatch) -> None:
        if self.fail:
            raise BusError("memory bus marked as failing")
        self.batches.append(batch)

    def read(self, cursor: str, count: int) -> tuple[str, list[EventBatch]]:
        if self.fail:
            raise BusError("memory bus marked as failing")
        start = int(cursor) if cursor not in ("", "0-0") else 0
        out = self.batches[start:start + count]
        return str(start + len(out)), out


class RedisStreamBus:
    """KV events on a Redis stream.

    Args:
        url: ``redis://host:port/db`` (ignored when ``client`` is given).
        stream: stream key (one per model deployment).
        maxlen: approximate cap on stored entries; readers that fall further
            behind see a ``seq`` gap and reset that worker (never a wrong hit).
        socket_timeout: seconds per call, so a dead server costs at most this.
        client: an existing ``redis.Redis``.
    """

    def __init__(self, url: str | None = None, *, stream: str = "hkv:kv-events", maxlen: int = 100_000,
                 socket_timeout: float = 0.5, client: Any = None) -> None:
        if not isinstance(stream, str) or not stream:
            raise ValueError(f"stream must be a non-empty str, got {stream!r}")
        if not isinstance(maxlen, int) or maxlen < 1:
            raise ValueError(f"maxlen must be an int >= 1, got {maxlen!r}")
        if not isinstance(socket_timeout, (int, float)) or socket_timeout <= 0:
            raise ValueError(f"socket_timeout must be > 0 seconds, got {socket_timeout!r}")
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - optional dependency
            raise ImportError("RedisStreamBus needs redis-py: pip install 'hybridkv[redis]'") from exc
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        if client is None:
            if not isinstance(url, str):
                raise TypeError("url must be a redis:// URL string when no client is given")
            client = redis.Redis.from_url(url, socket_timeout=socket_timeout,
                                          socket_connect_timeout=socket_timeout)
        self.client = client
        self.stream = stream
        self.maxlen = maxlen

    def publish(self, batch: EventBatch) -> None:
        """One ``XADD`` (O(1) amortised on the server)."""
        try:
            self.client.xadd(self.stream, encode_batch(batch), maxlen=self.maxlen, approximate=True)
        except self._errors as exc:
            raise BusError(f"XADD {self.stream}: {exc}") from exc

    def read(self, cursor: str, count: int) -> tuple[str, list[EventBatch]]:
        """Up to ``count`` batches after stream id ``cursor`` (``"0-0"``: from the start).

        Malformed entries are skipped (counted by the caller as lost: the
        ``seq`` gap they leave resets their worker).
        """
        try:
            got = self.client.xread({self.stream: cursor or "0-0"}, count=count)
        except self._errors as exc:
            raise BusError(f"XREAD {self.stream}: {exc}") from exc
        out: list[EventBatch] = []
        for _, entries in got or []:
            for entry_id, fields in entries:
                cursor = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                try:
                    out.append(decode_batch(fields))
                except ValueError:
                    continue
        return cursor or "0-0", out

    def close(self) -> None:
        try:
            self.client.close()
        except self._errors:
            pass
