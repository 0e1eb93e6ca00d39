"""Defaults shared by the library, its command line and the adapters.

One definition each: a default that appears in a signature, a dataclass and a
command-line flag is read from here, so the three cannot drift apart.
"""

from __future__ import annotations

__all__ = ["CHUNK", "SWA_CHECKPOINT"]

#: K, the SWA retention checkpoint interval in tokens: the window before every
#: multiple of K is kept (evicted last), so shared prefixes of many lengths stay
#: hittable.  The cache, replay, the simulator and both adapters default to it;
#: :class:`~hybridkv.radix.tree.TreeConfig` alone defaults to 0 (a bare tree has
#: no checkpoints unless asked).
SWA_CHECKPOINT = 16384

#: Prefill chunk size in tokens for replays and simulations.
CHUNK = 8192
