"""The connector's work items: what the scheduler side hands the workers each
step (``HybridKVMetadata`` of ``PageJob`` s) and what it keeps per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.v1.request import Request

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
    saved_swa: dict[int, set[int]] = field(default_factory=dict)  # per SWA group: pages saved
    reported: bool = False
