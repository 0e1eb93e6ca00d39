"""Repair case 2 in vLLM: the device's full KV with the window a lower tier holds.

The seed's four consistency-repair cases hold in every host; the second is
*host has SWA the device lacks*: the device still holds a prompt's full KV but
gave up the sliding-window KV its hit would end on, and L2 (or L3) holds that
window.  hybridkv's core then keeps the device's full pages and loads only the
window.  In vLLM the device's hit and the connector's are two counts, the
prefix manager's (``get_computed_blocks``: blocks vLLM takes as they are) and
the connector's (``get_num_new_matched_tokens``: new blocks it loads), and a
load must carry at least one token.  With hybridkv's prefix manager
(``--scheduler-cls``) and connector bound together (:meth:`HybridKVCacheManager.repair_windows
<hybridkv_vllm.prefix.HybridKVCacheManager.repair_windows>`):

1. the manager's tree matches the prompt's full KV to ``full`` tokens, and its
   window-safe hit ends at ``safe < full``;
2. the connector's lookup runs from ``safe``, counting the device's full pages
   below ``full`` as held (:meth:`.sources.TierView.hit`'s ``device_full``): its
   hit ``end`` needs from the tiers each sliding group's window before ``end``
   (above ``safe``) and the full pages past ``full``;
3. :func:`device_tokens` picks ``local``, the device tokens vLLM takes: the
   largest page-aligned ``local <= min(full, end - unit)`` past ``safe`` such
   that the tiers hold every full group's pages ``[local, end)`` (the load must
   carry them into vLLM's new blocks); none: no repair, the window-safe hit as
   before;
4. the manager hands vLLM the full blocks up to ``local`` and, for each sliding
   group, the device's window blocks below ``safe`` and *fresh* blocks from
   ``safe`` up to ``local`` for the window before ``end``; the connector's load
   fills those fresh blocks together with its hit ``[local, end)``.

Only ``[local, min(full, end))`` of the device's full KV is loaded again (at
most a unit or a page, counted as ``reloaded_held_tokens``); the rest of the
device's part is counted as ``repaired_tokens``.  A load that fails leaves
vLLM to recompute the request from scratch (``failed_recving``: its computed
tokens go to 0), and the tree caches nothing of a request whose load has not
finished, so no block the load did not fill is ever a hit.
"""

from __future__ import annotations

from collections.abc import Sequence

from .plan import GroupInfo
from .sources import TierView

__all__ = ["device_tokens", "swa_load_from"]


def device_tokens(view: TierView, groups: Sequence[GroupInfo], keys: dict[int, list[bytes]], safe: int,
                  full: int, end: int, unit: int, page: int) -> int:
    """The device tokens a window repair hands vLLM (step 3 of the module
    docstring), or 0 (no repair).  ``keys``: per group index, the prompt's keys
    up to ``end``; the tiers' record (L2's index and what the store is known to
    hold) answers without probing.  O(pages of the last unit or page)."""
    local = min(full, end - unit) // page * page
    if local <= safe:
        return 0
    for g in groups:
        if g.is_swa:
            continue
        ks = keys[g.index][local // g.block_size:end // g.block_size]
        held = view.in_l2({g.index: ks})[g.index] | view.store.held(ks)
        if not held.all():
            return 0
    return local


def swa_load_from(st_repair: tuple[int, int, int] | None, start: int) -> int:
    """Where a load of a hit starting at ``start`` fills each sliding group's window
    from: the device's window-safe hit when a repair handed fresh window blocks below
    ``start`` (``st_repair``: the request's planned ``(safe, local, end)``), else ``start``."""
    if st_repair is not None and st_repair[1] == start:
        return st_repair[0]
    return start

