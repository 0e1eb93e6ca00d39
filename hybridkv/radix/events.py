"""Tree events: what the prefix index tells listeners (KV-event publishers).

:class:`~hybridkv.radix.types.TreeEvent` describes a change of what the tree
caches.  Inside an update (a method decorated with :func:`deliver_after`)
events are held and delivered when the update completes, so a listener sees
the tree and its pool consistent.  A listener that raises is logged and
counted (``listener_errors``), never propagated.

A mix-in of :class:`~hybridkv.radix.tree.WindowSafeTree`: the methods run on
the tree's own state (``listeners``, ``listener_errors``, ``_event_queue``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import numpy as np

from .node import TreeNode
from .types import EMPTY, TreeEvent

__all__ = ["EventsMixin", "deliver_after"]

_logger = logging.getLogger("hybridkv.radix")


def deliver_after(fn: Callable) -> Callable:
    """Deliver the tree events ``fn`` emits only when it returns (the tree, and the
    pool its freed pages went back to, are consistent again).  Nested calls join
    the outermost batch."""

    @functools.wraps(fn)
    def run(self: Any, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if self._event_queue is not None or not self.listeners:
            return fn(self, *args, **kwargs)
        self._event_queue = []
        try:
            return fn(self, *args, **kwargs)
        finally:
            queued, self._event_queue = self._event_queue, None
            for event in queued:
                self._deliver(event)

    return run


class EventsMixin:
    """Event emission of :class:`~hybridkv.radix.tree.WindowSafeTree`."""

    def _emit(self, kind: str, node: TreeNode, lo: int = 0, hi: int | None = None) -> None:
        """Tell listeners about ``node``'s pages ``[lo, hi)`` (only built when someone listens).

        Inside an update (:func:`_events_after`) the event is held and delivered
        when the update completes.  A listener that raises is logged and counted
        (``listener_errors``), never propagated."""
        parts = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            parts.append(n.key)
            n = n.parent
        tokens = np.concatenate(parts[::-1]) if parts else EMPTY
        hi = node.n_pages if hi is None else hi
        end = node.start + hi * self.page_size
        ids = node.swa[lo:hi]
        # with several sliding groups a page counts where every group holds it
        held = self.pool.held_by_all(ids) if self.groups else ids >= 0
        event = TreeEvent(kind, node.namespace, node.start + lo * self.page_size, end, tokens[:end], held)
        if self._event_queue is not None:
            self._event_queue.append(event)
        else:
            self._deliver(event)

    def _deliver(self, event: TreeEvent) -> None:
        kind = event.kind
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception as exc:  # noqa: BLE001 - a listener must not leave the tree half-updated
                self.listener_errors += 1
                if self.listener_errors & (self.listener_errors - 1) == 0:  # 1st, 2nd, 4th, ... failure
                    _logger.warning("tree event listener %r failed on %s (%s: %s); event dropped for it "
                                    "(%d listener failures so far)", listener, kind, type(exc).__name__, exc,
                                    self.listener_errors)
