"""Transfer layer: page copy kernels (CUDA, C host, torch reference),
layerwise prefetch and the NIXL agent.

See docs/transfer.md for the buffer and staging layouts.
"""

from .api import (copy_pages, pack_pages, page_nbytes, prepare_block_rows, prepare_copy,
                  prepare_pack, prepare_unpack, unpack_pages)
from .plan import PreparedCopy, describe_paths
from .layerwise import LayerJob, LayerwiseLoader, PageCopy, arena_layer_jobs, model_layer_jobs

__all__ = [
    "LayerJob",
    "LayerwiseLoader",
    "arena_layer_jobs",
    "PageCopy",
    "PreparedCopy",
    "describe_paths",
    "copy_pages",
    "model_layer_jobs",
    "pack_pages",
    "page_nbytes",
    "prepare_block_rows",
    "prepare_copy",
    "prepare_pack",
    "prepare_unpack",
    "unpack_pages",
]
