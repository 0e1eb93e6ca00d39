"""The window-safe prefix tree: decides what is a hit and what is evicted."""

from .node import NO_PAGE, TreeNode, window_safe_pages
from .tree import InsertResult, LockHandle, MatchResult, PagePool, TreeConfig, TreeEvent, WindowSafeTree
from .types import OneWindowPool, PageNames, SideGroup, pool_lacks

__all__ = ["NO_PAGE", "InsertResult", "LockHandle", "MatchResult", "OneWindowPool", "PageNames", "PagePool", "SideGroup",
           "TreeConfig", "TreeEvent", "TreeNode", "WindowSafeTree", "pool_lacks", "window_safe_pages"]
