"""Redis / Redis Cluster L3 backend (redis-py; hiredis parser when installed).

Storage keys are ``key_prefix + key.hex()`` with no ``{hash tag}``, so pages
spread over all cluster slots.  Batches are therefore never sent as one
multi-key command in cluster mode: reads use ``MGET`` (standalone) or
``mget_nonatomic`` (cluster: one MGET per slot), writes ``MSET`` /
``mset_nonatomic`` or, with a TTL, a non-transactional pipeline of
``SET key value EX ttl``; exists/touch/delete are pipelines of single-key
commands (the cluster client routes each to its node).

Eviction story: with ``ttl_s`` every put sets a TTL and :meth:`touch`
re-arms it (``EXPIRE``), so hot prefixes stay while cold ones expire.
Without a TTL, run the server with ``maxmemory`` and
``maxmemory-policy allkeys-lru``; :meth:`touch` then sends ``TOUCH``, which
refreshes the key's LRU clock.

Connections: ``socket_timeout`` / ``socket_connect_timeout`` bound every call;
``retries`` (default 1, no back-off) lets a call reconnect once, which is what
makes the first call after a server restart succeed.  A server that stays down
trips the circuit breaker of :class:`BaseBackend`.
"""

from __future__ import annotations

from typing import Any

from .base import BaseBackend

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - optional dependency
    raise ImportError("the redis backend needs redis-py: pip install 'hybridkv[redis]'") from exc

__all__ = ["RedisBackend"]


class RedisBackend(BaseBackend):
    """Page store in Redis or Redis Cluster.

    Args:
        url: ``redis://[user:pass@]host:port/db`` or ``rediss://...`` (TLS).
        cluster: use :class:`redis.cluster.RedisCluster` (``redis+cluster://`` in
            :func:`open_backend`); ``url`` then names any one node.
        ttl_s: seconds a page lives after its last put/touch; ``None`` = no TTL.
        key_prefix: prepended to every storage key (namespaces a shared server).
        socket_timeout, socket_connect_timeout: seconds per call / per connect.
        retries: reconnect attempts per call after a connection error.
        max_connections: connection pool size (None = redis-py default).
        client: an existing ``redis.Redis``/``RedisCluster`` (then ``url`` and
            the connection options are ignored).
        **base: see :class:`BaseBackend`.
    """

    scheme = "redis"

    def __init__(self, url: str | None = None, *, cluster: bool = False, ttl_s: float | None = None,
                 key_prefix: str = "hkv:", socket_timeout: float = 1.0,
                 socket_connect_timeout: float = 1.0, retries: int = 1,
                 max_connections: int | None = None, client: Any = None, **base: Any) -> None:
        if ttl_s is not None and (not isinstance(ttl_s, (int, float)) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be None or > 0, got {ttl_s!r}")
        if not isinstance(key_prefix, str):
            raise TypeError(f"key_prefix must be a str, got {type(key_prefix).__name__}")
        for name, val in (("socket_timeout", socket_timeout),
                          ("socket_connect_timeout", socket_connect_timeout)):
            if not isinstance(val, (int, float)) or val <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {val!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if client is None and not isinstance(url, str):
            raise TypeError("url must be a redis:// URL string when no client is given")
        super().__init__(**base)
        self.cluster = bool(cluster)
        self.ttl_ms = None if ttl_s is None else max(1, int(round(ttl_s * 1000)))
        self._prefix = key_prefix.encode()
        if client is not None:
            self.client = client
        else:
            opts: dict[str, Any] = dict(socket_timeout=socket_timeout,
                                        socket_connect_timeout=socket_connect_timeout,
                                        retry=Retry(NoBackoff(), retries))
            if max_connections is not None:
                opts["max_connections"] = max_connections
            if self.cluster:
                from redis.cluster import RedisCluster
                self.client = RedisCluster.from_url(url, **opts)
            else:
                self.client = redis.Redis.from_url(url, **opts)

    def _names(self, keys: list[bytes]) -> list[bytes]:
        return [self._prefix + k.hex().encode() for k in keys]

    def _classify(self, exc: BaseException) -> str:
        return "timeouts" if isinstance(exc, (redis.TimeoutError, TimeoutError)) else "errors"

    def _pipeline_each(self, method: str, names: list[bytes], *args: Any) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            getattr(pipe, method)(name, *args)
        return pipe.execute()

    # ------------------------------------------------------------ operations
    def _exists(self, keys: list[bytes]) -> list[bool]:
        return [bool(r) for r in self._pipeline_each("exists", self._names(keys))]

    def _get(self, keys: list[bytes]) -> list[Any]:
        names = self._names(keys)
        if self.cluster:
            return self.client.mget_nonatomic(names)
        return self.client.mget(names)

    def _put(self, keys: list[bytes], headers: list[bytes], payloads: list[memoryview]) -> list[bool]:
        names = self._names(keys)
        # One joined value per key: SET takes a single argument; the copy runs
        # at memcpy speed and is small next to the socket transfer.
        values = [b"".join((h, p)) for h, p in zip(headers, payloads)]
        if self.ttl_ms is None:
            mapping = dict(zip(names, values))
            if self.cluster:
                self.client.mset_nonatomic(mapping)
            else:
                self.client.mset(mapping)
            return [True] * len(keys)
        pipe = self.client.pipeline(transaction=False)
        for name, value in zip(names, values):
            pipe.set(name, value, px=self.ttl_ms)
        return [bool(r) for r in pipe.execute()]

    def _touch(self, keys: list[bytes]) -> None:
        names = self._names(keys)
        if self.ttl_ms is None:
            self._pipeline_each("touch", names)
        else:
            self._pipeline_each("pexpire", names, self.ttl_ms)

    def _delete(self, keys: list[bytes]) -> int:
        return sum(int(r) for r in self._pipeline_each("delete", self._names(keys)))

    def _close(self) -> None:
        self.client.close()
