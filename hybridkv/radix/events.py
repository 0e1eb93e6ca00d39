"""Tree events: what the prefix index tells listeners (KV-event publishers).

:class:`~hybridkv.radix.types.TreeEvent` describes a change of what the tree
caches.  :class:`TreeEvents` builds and delivers them for one tree.  Inside an
update (a tree method decorated with :func:`deliver_after`) events are held
and delivered when the update completes, so a listener sees the tree and its
pool consistent.  A listener that raises is logged and counted
(``TreeEvents.errors``), never propagated.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import numpy as np

from .node import TreeNode
from .types import EMPTY, TreeEvent

__all__ = ["TreeEvents", "deliver_after"]

_logger = logging.getLogger("hybridkv.radix")


def deliver_after(fn: Callable) -> Callable:
    """Deliver the tree events ``fn`` (a method of an object with an ``events``
    :class:`TreeEvents`) emits only when it returns (the tree, and the pool its
    freed pages went back to, are consistent again).  Nested calls join the
    outermost batch."""

    @functools.wraps(fn)
    def run(self: Any, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        events = self.events
        if events.queue is not None or not events.listeners:
            return fn(self, *args, **kwargs)
        events.queue = []
        try:
            return fn(self, *args, **kwargs)
        finally:
            queued, events.queue = events.queue, None
            for event in queued:
                events.deliver(event)

    return run


class TreeEvents:
    """The listeners of one tree and the events it emits.

    Args:
        page_size: tokens per page (events are in tokens).

    With several sliding groups an event counts a page's SWA as held where
    every group holds its page there (the node's ``swa`` and ``side`` ids).

    Attributes: ``listeners`` (callables taking a :class:`TreeEvent`),
    ``errors`` (listener exceptions caught), ``queue`` (events held while an
    update runs, None outside one; written only by :func:`deliver_after`).
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.listeners: list[Callable[[TreeEvent], None]] = []
        self.errors = 0
        self.queue: list[TreeEvent] | None = None

    def emit(self, kind: str, node: TreeNode, lo: int = 0, hi: int | None = None) -> None:
        """Tell listeners about ``node``'s pages ``[lo, hi)``; callers check
        ``listeners`` first, so nothing is built when no one listens.

        Inside an update (:func:`deliver_after`) the event is held and delivered
        when the update completes.  O(depth + tokens of the prefix)."""
        parts = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            parts.append(n.key)
            n = n.parent
        tokens = np.concatenate(parts[::-1]) if parts else EMPTY
        hi = node.n_pages if hi is None else hi
        end = node.start + hi * self.page_size
        held = node.swa[lo:hi] >= 0
        for side in node.side or ():  # with several sliding groups: where every group holds it
            held &= side[lo:hi] >= 0
        event = TreeEvent(kind, node.namespace, node.start + lo * self.page_size, end, tokens[:end], held)
        if self.queue is not None:
            self.queue.append(event)
        else:
            self.deliver(event)

    def deliver(self, event: TreeEvent) -> None:
        """Hand ``event`` to every listener; a listener that raises is logged (1st,
        2nd, 4th, ... failure) and counted, never propagated.  O(listeners)."""
        kind = event.kind
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception as exc:  # noqa: BLE001 - a listener must not leave the tree half-updated
                self.errors += 1
                if self.errors & (self.errors - 1) == 0:  # 1st, 2nd, 4th, ... failure
                    _logger.warning("tree event listener %r failed on %s (%s: %s); event dropped for it "
                                    "(%d listener failures so far)", listener, kind, type(exc).__name__, exc,
                                    self.errors)
