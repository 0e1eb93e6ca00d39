"""Dual Full/SWA page pools: page allocation, KV buffers, accounting."""

from .allocator import PageAllocator
from .buffers import KVBuffers, slots_of_pages
from .dual import DualPool, PoolStats

__all__ = ["DualPool", "KVBuffers", "PageAllocator", "PoolStats", "slots_of_pages"]
