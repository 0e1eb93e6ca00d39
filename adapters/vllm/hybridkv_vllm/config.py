"""``kv_connector_extra_config`` of :class:`~hybridkv_vllm.connector.HybridKVConnector`.

Every option is documented in ``docs/vllm.md``; unknown keys raise so a typo
never silently falls back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hybridkv.defaults import SWA_CHECKPOINT

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
        checkpoint_interval: where SWA retention checkpoints go: the SWA
            window before every checkpoint of a prompt is stored too, so
            shared prefixes that branch after it stay hittable there.
            ``"auto"`` (default): a position-only grid that scales with the
            prompt (:func:`~hybridkv_vllm.plan.checkpoint_ends`: every hit
            unit up to ``2 * checkpoints_per_doubling`` units, then
            ``checkpoints_per_doubling`` per doubling of the position); an
            int: every multiple of it (a multiple of the hit unit); ``0``:
            tails only.
        checkpoints_per_doubling: density of the ``"auto"`` grid (> 0).
        anchor_checkpoint: which checkpoint windows L2 keeps as anchors (evicted
            last, as tails are): those ending on a multiple of this many tokens,
            hybridkv's own ``swa_checkpoint`` by default, so the connector's L2
            and the core's anchor the same windows; the other checkpoint windows
            enter L2 plain (given up before full KV, and storing one displaces only
            older plain windows).  ``0``: no checkpoint is an anchor.  L3 stores
            every saved window either way.
        save_queue_mb: bound of the page bytes waiting in the worker's save
            thread; prefill saves beyond it are dropped (counted).
        async_save: store pages on the worker's save thread (default); ``False``
            waits for every save inside the step (the old behaviour, for
            comparison).
        backend_options: extra keyword options for ``open_backend``.
        l2_gb: host-memory L2 page cache per worker, in GiB (0 disables it):
            saves are written to L2 and through to L3; loads read L2 first.
        l1_copies_first: L2 evicts its copies of full pages vLLM's device cache
            holds before the pages only it holds, and copies down a page the
            device cache gives up that L2 lacks (:mod:`.l1`; default on, as
            hybridkv's own L2 does under write-through).
        lookup_wait_ms: how long a lookup waits for the store's answer about keys
            the tiers' record cannot answer (asked on the probe thread, off the
            scheduler's); past it the lookup answers "ask again later" and the
            request waits a step, the running ones do not (:mod:`.lookups`).
        repair_windows: with hybridkv's device prefix cache (``--scheduler-cls``),
            a prompt whose full KV the device holds but whose window only a lower
            tier holds takes the device's full KV and loads only the window and
            what lies past the device (repair case 2; default on).  ``False``: the
            device's window-safe hit, with its full KV loaded again.
    """

    l3_url: str = "file:hybridkv-l3"
    namespace: str = "default"
    model_id: str = ""
    save_on_finish: bool = True
    stats_file: str = ""
    max_hit_tokens: int = 0
    checkpoint_interval: int | str = "auto"
    checkpoints_per_doubling: int = 4
    anchor_checkpoint: int = SWA_CHECKPOINT
    backend_options: Mapping[str, Any] | None = None
    l2_gb: float = 1.0
    save_queue_mb: float = 256.0
    async_save: bool = True
    l1_copies_first: bool = True
    lookup_wait_ms: float = 5.0
    repair_windows: bool = True

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
        for name in ("save_on_finish", "async_save", "l1_copies_first", "repair_windows"):
            if name in extra:
                kw[name] = _as_bool(name, extra[name])
        if extra.get("checkpoint_interval") == "auto":
            kw["checkpoint_interval"] = "auto"
        elif "checkpoint_interval" in extra:
            v = extra["checkpoint_interval"]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError("kv_connector_extra_config['checkpoint_interval'] must be "
                                 "\"auto\" or an int >= 0")
            kw["checkpoint_interval"] = v
        for name, low in (("max_hit_tokens", 0), ("checkpoints_per_doubling", 1),
                          ("anchor_checkpoint", 0)):
            if name in extra:
                v = extra[name]
                if not isinstance(v, int) or isinstance(v, bool) or v < low:
                    raise ValueError(f"kv_connector_extra_config[{name!r}] must be an "
                                     f"int >= {low}")
                kw[name] = v
        for name, low in (("l2_gb", 0.0), ("save_queue_mb", 1.0), ("lookup_wait_ms", 0.0)):
            if name in extra:
                v = extra[name]
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= low:
                    raise ValueError(f"kv_connector_extra_config[{name!r}] must be a "
                                     f"number >= {low:g}")
                kw[name] = float(v)
        if "backend_options" in extra:
            if not isinstance(extra["backend_options"], Mapping):
                raise TypeError("kv_connector_extra_config['backend_options'] must be a dict")
            kw["backend_options"] = dict(extra["backend_options"])
        if not kw.get("l3_url", cls.l3_url):
            raise ValueError("kv_connector_extra_config['l3_url'] must not be empty")
        return cls(**kw)
