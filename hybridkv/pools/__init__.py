"""Dual Full/SWA page pools: page allocation, KV buffers, accounting."""

from .allocator import PageAllocator
from .arena import ArenaLayout, KindLayout, arena_page_bytes
from .buffers import KindBuffers, KVArena, KVBuffers, slots_of_pages
from .dual import DualPool, PoolStats, check_device
from .groups import GroupPages

__all__ = ["ArenaLayout", "DualPool", "GroupPages", "KVArena", "KVBuffers", "KindBuffers", "KindLayout", "PageAllocator",
           "PoolStats", "arena_page_bytes", "check_device", "slots_of_pages"]
