"""``open_backend(url, **opts)``: one entry point for every L3 backend.

=============================================  ========================================
URL                                            backend
=============================================  ========================================
``file:///abs/dir``, ``file:rel/dir``          :class:`.FileBackend` (embedded default)
``redis://host:port/db``, ``rediss://``        :class:`.RedisBackend`
``redis+cluster://host:port``                  :class:`.RedisBackend` with RedisCluster
``mooncake://host:rpc_port?metadata=...``      :class:`.MooncakeBackend`
``nixl+posix:///abs/dir``, ``nixl+posix:rel``  :class:`.NixlPosixBackend`
=============================================  ========================================

Query parameters set backend options (``file:///d?max_bytes=1000000``);
keyword ``opts`` override them.  Options common to all backends:
``breaker_threshold``, ``breaker_cooldown_s``, ``warn_interval_s``.
Unknown query parameters raise ``ValueError`` (except for redis, where they are
passed on to redis-py's URL parser).
"""

from __future__ import annotations

from typing import Any, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .base import BaseBackend

__all__ = ["open_backend", "SCHEMES"]


def _bool(v: str) -> bool:
    low = v.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {v!r}")


def _opt_float(v: str) -> float | None:
    return None if v.lower() in ("", "none") else float(v)


def _opt_int(v: str) -> int | None:
    return None if v.lower() in ("", "none") else int(v)


_COMMON: dict[str, Callable[[str], Any]] = {
    "breaker_threshold": int, "breaker_cooldown_s": float, "warn_interval_s": float,
}
_FILE = {"max_bytes": _opt_int, "fsync": _bool}
_REDIS = {"ttl_s": _opt_float, "key_prefix": str, "socket_timeout": float,
          "socket_connect_timeout": float, "retries": int, "max_connections": _opt_int}
_MOONCAKE = {"metadata": str, "protocol": str, "local_host": str, "device": str,
             "segment_bytes": int, "buffer_bytes": int, "key_prefix": str,
             "staging_bytes": int, "max_staging_bytes": int}
_NIXL = {"agent_name": str, "staging_bytes": int}

SCHEMES = ("file", "redis", "rediss", "redis+cluster", "mooncake", "nixl+posix")


def _split_query(query: str, allowed: dict[str, Callable[[str], Any]], *, url_arg: str,
                 passthrough: bool = False) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    known: dict[str, Any] = {}
    rest: list[tuple[str, str]] = []
    table = {**_COMMON, **allowed}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in table:
            try:
                known[name] = table[name](value)
            except ValueError as exc:
                raise ValueError(f"{url_arg}: bad value for {name!r}: {exc}") from None
        elif passthrough:
            rest.append((name, value))
        else:
            raise ValueError(f"{url_arg}: unknown option {name!r}; known: {sorted(table)}")
    return known, rest


def _local_path(parts: Any, url: str) -> str:
    # file:///abs -> "/abs"; file:rel/dir -> "rel/dir"; file://./rel -> "./rel"
    path = (parts.netloc + parts.path) if parts.netloc else parts.path
    if not path:
        raise ValueError(f"url {url!r} names no directory")
    return path


def open_backend(url: str, **opts: Any) -> BaseBackend:
    """Open the L3 backend named by ``url`` (see the module table).

    Args:
        url: backend URL.
        **opts: backend options; override the URL's query parameters.

    Raises:
        TypeError: ``url`` is not a str.
        ValueError: unknown scheme or option, or a malformed URL.
        ImportError: the backend's client package is not installed (the
            message names the pip extra).
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        q, _ = _split_query(parts.query, _FILE, url_arg="url")
        from .file_backend import FileBackend
        return FileBackend(_local_path(parts, url), **{**q, **opts})
    if scheme in ("redis", "rediss", "redis+cluster"):
        q, rest = _split_query(parts.query, _REDIS, url_arg="url", passthrough=True)
        cluster = scheme == "redis+cluster"
        real = urlunsplit(("redis" if cluster else scheme, parts.netloc, parts.path,
                           urlencode(rest), ""))
        if not parts.hostname:
            raise ValueError(f"url {url!r} names no host")
        from .redis_backend import RedisBackend
        return RedisBackend(real, cluster=cluster, **{**q, **opts})
    if scheme == "mooncake":
        q, _ = _split_query(parts.query, _MOONCAKE, url_arg="url")
        if not parts.hostname or not parts.port:
            raise ValueError(f"url {url!r} must name the master as host:rpc_port")
        if "metadata" not in q and "metadata" not in opts:
            raise ValueError(f"url {url!r} needs the transfer engine's metadata server: "
                             f"mooncake://{parts.hostname}:{parts.port}?metadata=http://HOST:PORT/metadata")
        from .mooncake_backend import MooncakeBackend
        return MooncakeBackend(f"{parts.hostname}:{parts.port}", **{**q, **opts})
    if scheme == "nixl+posix":
        q, _ = _split_query(parts.query, _NIXL, url_arg="url")
        from .nixl_backend import NixlPosixBackend
        return NixlPosixBackend(_local_path(parts, url), **{**q, **opts})
    raise ValueError(f"url has unknown scheme {parts.scheme!r}; expected one of {SCHEMES}")
