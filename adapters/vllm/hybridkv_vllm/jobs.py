"""The connector's work items: what the scheduler side hands the workers each
step (``HybridKVMetadata`` of ``PageJob`` s) and what it keeps per request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.tiers.keys import page_keys
from hybridkv.tiers.records import TreeWalk

from .kvio import as_np_tokens

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from .plan import GroupInfo

__all__ = ["HybridKVMetadata", "PageJob", "ReqState"]


@dataclass
class PageJob:
    """Pages of one request to move: per group index, parallel block ids and keys."""

    req_id: str
    groups: dict[int, tuple[list[int], list[bytes]]] = field(default_factory=dict)
    finish: bool = False  # a finish save: report the request in finished_sending
    # per group index: the L2 row of each page (parallel to its keys; -1: none), which
    # the scheduler's index of L2 assigned (:mod:`.l2`); the workers read and write
    # only these rows
    slots: dict[int, list[int]] = field(default_factory=dict)
    # The rest is the scheduler side's, used when it applies the job to L2's index
    # (left out of the job the workers get, :meth:`for_workers`):
    # SWA keys whose anchored L2 windows the finished request moved past: made plain
    # before this job's pages are stored
    demote: list[bytes] = field(default_factory=list)
    # per sliding group index: the full key each of its pages goes with in L2
    # (:func:`.plan.full_bases`; ``None``: none)
    bases: dict[int, list[bytes | None] | None] = field(default_factory=dict)
    # SWA keys of this job that enter L2 plain: checkpoint windows L2 does not keep as
    # anchors (:attr:`.config.ConnectorConfig.anchor_checkpoint`)
    plain: list[bytes] = field(default_factory=list)
    # per group index: the key of the page before each page (:func:`hybridkv.tiers.keys.parent_keys`)
    parents: dict[int, list[bytes | None]] = field(default_factory=dict)
    # per group index: each page's index in the request's pages of that group (parallel to its keys)
    pages: dict[int, list[int]] = field(default_factory=dict)
    # the request's state (a finish save is placed in L2 after the request left the connector)
    state: ReqState | None = None

    def for_workers(self) -> PageJob:
        """This job as the workers get it: pages and slots, without the fields only
        the scheduler side reads.  O(1) (shares the page lists)."""
        return PageJob(self.req_id, self.groups, self.finish, self.slots)

    def num_pages(self) -> int:
        return sum(len(b) for b, _ in self.groups.values())


@dataclass
class HybridKVMetadata(KVConnectorMetadata):
    """What the workers do this step (built by the scheduler side)."""

    loads: list[PageJob] = field(default_factory=list)
    saves: list[PageJob] = field(default_factory=list)
    touches: list[bytes] = field(default_factory=list)  # store keys to keep alive (repair case 3)
    # per full group index: blocks vLLM's cache gave up whose pages L2 lacked, their keys and
    # the L2 rows to copy them to, before this step writes any block (repair case 1, :mod:`.l1`)
    rescues: dict[int, tuple[list[int], list[bytes], list[int]]] = field(default_factory=dict)
    idle: bool = False  # an empty step (no tokens, loads or saves): see progress.py


@dataclass
class ReqState:
    """What the scheduler side knows of one request: its page keys, hit and saves."""

    request: Request
    namespace: str
    keys: dict[int, list[bytes]] = field(default_factory=dict)  # per group, its block size
    hit_tokens: int = 0
    local_tokens: int = 0  # the engine's own hit at the last lookup
    hit_sources: dict[CacheHitSource, int] = field(default_factory=dict)  # of the last load job
    saved_tokens: int = 0     # full-group KV up to here already handed to a save job
    l1_marked: int = 0  # full-group KV up to here told to L1's view as held (each lookup starts it over)
    saved_swa: dict[int, set[int]] = field(default_factory=dict)  # per SWA group: pages saved
    reported: bool = False
    #: a window repair the lookup planned (``(safe, local, end)`` tokens: the device's
    #: window-safe hit, what the device hands vLLM, the hit's end; :mod:`.repair`)
    repair: tuple[int, int, int] | None = None
    #: the tree walk its first lookup read keys off (with hybridkv's prefix cache and an
    #: L2: the entries' L2 records, :meth:`.names.TreeNames.l2_held`), None: none
    walk: TreeWalk | None = None
    #: per group index, where the saves that placed its pages in L2 put them: int64 rows
    #: (page index, L2 slot, the slot's stamp then), for the tree's records at the prefix
    #: manager's insert (:meth:`.names.TreeNames.placed`)
    l2_at: dict[int, list[np.ndarray]] = field(default_factory=dict)

    def page_keys(self, tokens: int, groups: Sequence[GroupInfo],
                  fingerprints: dict[int, str]) -> dict[int, list[bytes]]:
        """Chained keys of each group's pages inside ``[0, tokens)``, extended
        incrementally (kept in :attr:`keys`): group ``g`` gets ``tokens //
        g.block_size`` keys at its own block size.  O(new pages)."""
        all_tokens = self.request.all_token_ids
        out = {}
        for g in groups:
            bs, pages = g.block_size, tokens // g.block_size
            have = self.keys.setdefault(g.index, [])
            if len(have) < pages:
                parent = have[-1] if have else None
                chunk = as_np_tokens(all_tokens[len(have) * bs: pages * bs])
                have.extend(page_keys(chunk, bs, namespace=self.namespace,
                                      fingerprint=fingerprints[g.index], parent=parent))
            out[g.index] = have[:pages]
        return out
