"""``kv_connector_extra_config`` of :class:`~hybridkv_vllm.connector.HybridKVConnector`.

Every option is documented in ``docs/vllm.md``; unknown keys raise so a typo
never silently falls back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["ConnectorConfig"]


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise TypeError(f"kv_connector_extra_config[{name!r}] must be a bool, got {value!r}")


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector options.

    Attributes:
        l3_url: URL of the hybridkv L3 backend (``hybridkv.tiers.storage.open_backend``);
            default a file backend under ``./hybridkv-l3``.
        namespace: tenant / cache-salt prefix of every page key; requests that
            carry vLLM's ``cache_salt`` get ``namespace/cache_salt``.
        model_id: stable model name used in the key fingerprint (default: the
            HF ``_name_or_path`` basename); change it to invalidate stored KV.
        save_on_finish: also store the pages completed during decode when a
            request finishes (blocks are held until the worker reports them).
        stats_file: optional path; each side appends JSON lines with its
            counters (hit tokens per request, pages loaded/saved, faults).
        max_hit_tokens: cap of one external hit (0 = no cap).
        checkpoint_interval: tokens between SWA retention checkpoints (a
            multiple of the block size; 0 = tails only): the SWA window before
            every such position of a prompt is stored too, so shared prefixes
            that branch there stay hittable.
        backend_options: extra keyword options for ``open_backend``.
        l2_gb: host-memory L2 page cache per worker, in GiB (0 disables it):
            saves are written to L2 and through to L3; loads read L2 first.
    """

    l3_url: str = "file:hybridkv-l3"
    namespace: str = "default"
    model_id: str = ""
    save_on_finish: bool = True
    stats_file: str = ""
    max_hit_tokens: int = 0
    checkpoint_interval: int = 4096
    backend_options: Mapping[str, Any] | None = None
    l2_gb: float = 1.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse vLLM's ``kv_connector_extra_config`` dict (``None`` = defaults).

        Raises ``TypeError``/``ValueError`` naming the offending key.  O(keys).
        """
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config has unknown keys {unknown}; "
                             f"known: {sorted(known)}")
        kw: dict[str, Any] = {}
        for name in ("l3_url", "namespace", "model_id", "stats_file"):
            if name in extra:
                if not isinstance(extra[name], str):
                    raise TypeError(f"kv_connector_extra_config[{name!r}] must be a str")
                kw[name] = extra[name]
        if "save_on_finish" in extra:
            kw["save_on_finish"] = _as_bool("save_on_finish", extra["save_on_finish"])
        for name in ("max_hit_tokens", "checkpoint_interval"):
            if name in extra:
                v = extra[name]
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ValueError(f"kv_connector_extra_config[{name!r}] must be an int >= 0")
                kw[name] = v
        if "l2_gb" in extra:
            v = extra["l2_gb"]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ValueError("kv_connector_extra_config['l2_gb'] must be a number >= 0")
            kw["l2_gb"] = float(v)
        if "backend_options" in extra:
            if not isinstance(extra["backend_options"], Mapping):
                raise TypeError("kv_connector_extra_config['backend_options'] must be a dict")
            kw["backend_options"] = dict(extra["backend_options"])
        if not kw.get("l3_url", cls.l3_url):
            raise ValueError("kv_connector_extra_config['l3_url'] must not be empty")
        return cls(**kw)
