"""Tier events: what the L2 host tier and the L3 manager store and drop.

Mirrors the L1 tree's ``listeners`` (``TreeEvent``): each tier object keeps a
``listeners`` list of callables that receive a :class:`TierEvent` whenever
pages enter or leave the tier.  Keys are always the *full-KV* chained page
keys (:func:`hybridkv.tiers.keys.page_keys`), also for SWA events, so a
reader (``hybridkv.routing.KVEventPublisher``) can compute the same
window-safe length per tier as for L1.  Events are built only when someone
listens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["TIER_EVENT_KINDS", "TierEvent", "TierListener", "emit", "listener_errors"]

_logger = logging.getLogger("hybridkv.tiers")

#: ``store``: full KV of the pages entered the tier (``swa_valid`` says whether
#: the tier also holds their SWA); ``remove``: full KV left (the tier's SWA of
#: those pages no longer counts); ``swa_store`` / ``swa_remove``: SWA KV of the
#: pages entered / left, full KV unchanged.
TIER_EVENT_KINDS = ("store", "remove", "swa_store", "swa_remove")


@dataclass(frozen=True)
class TierEvent:
    """One change of a tier's content.

    Attributes:
        tier: ``"L2"`` or ``"L3"``.
        kind: one of :data:`TIER_EVENT_KINDS`.
        keys: full-KV page keys of the affected pages.
        swa_valid: one flag per key after the event (``()`` for ``remove``).
    """

    tier: str
    kind: str
    keys: tuple[bytes, ...]
    swa_valid: tuple[bool, ...] = ()


TierListener = Callable[[TierEvent], None]


_errors = [0]


def listener_errors() -> int:
    """Tier listener exceptions caught by :func:`emit` in this process so far."""
    return _errors[0]


def emit(listeners: list[TierListener], event: TierEvent) -> None:
    """Call every listener with ``event`` (nothing when ``event.keys`` is empty).

    A listener that raises is logged and counted (:func:`listener_errors`),
    never propagated: the tier calling ``emit`` is mid-update and must finish.
    """
    if event.keys:
        for listener in list(listeners):
            try:
                listener(event)
            except Exception as exc:  # noqa: BLE001 - listeners cannot corrupt a tier
                _errors[0] += 1
                if _errors[0] & (_errors[0] - 1) == 0:  # 1st, 2nd, 4th, ... failure
                    _logger.warning("tier event listener %r failed on %s %s (%s: %s); event dropped for it "
                                    "(%d listener failures so far)", listener, event.tier, event.kind,
                                    type(exc).__name__, exc, _errors[0])
