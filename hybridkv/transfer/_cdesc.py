"""Shared cffi glue: the C declarations and filling ``hkv_page_copy_t``.

The struct is declared once, in ``hkv_page_copy.h`` (package data); both the
host kernel (cffi API mode) and the CUDA library (cffi ABI mode) read the
declarations from its CDEF block, so Python and C cannot drift apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ._layout import CopyPlan

HEADER = Path(__file__).with_name("hkv_page_copy.h")


def read_cdef(path: Path) -> str:
    """Return the text between ``/* CDEF-BEGIN */`` and ``/* CDEF-END */``."""
    text = path.read_text()
    try:
        start = text.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
        end = text.index("/* CDEF-END */", start)
    except ValueError as exc:
        raise RuntimeError(f"{path.name} lacks its CDEF-BEGIN/CDEF-END block") from exc
    return text[start:end]


def fill_desc(
    ffi: Any, plan: CopyPlan, *,
    src_idx_ptr: Optional[int], dst_idx_ptr: Optional[int], mask_ptr: Optional[int],
    src_base: tuple[int, int], dst_base: tuple[int, int],
) -> Any:
    """Build a ``hkv_page_copy_t *`` for ``plan``.

    Pointers are passed separately from the plan because the CUDA path uses
    device copies of the index arrays and mapped device addresses of pinned
    host buffers.  The caller keeps the pointed-to memory alive for the call.
    """
    d = ffi.new("hkv_page_copy_t *")
    d.n_pages = plan.n_pages
    d.src_idx = ffi.cast("const int64_t *", src_idx_ptr) if src_idx_ptr else ffi.NULL
    d.dst_idx = ffi.cast("const int64_t *", dst_idx_ptr) if dst_idx_ptr else ffi.NULL
    d.mask = ffi.cast("const uint8_t *", mask_ptr) if mask_ptr else ffi.NULL
    d.layer_begin = plan.layer_begin
    d.layer_end = plan.layer_end
    d.src_limit = plan.src.limit
    d.dst_limit = plan.dst.limit
    for t in (0, 1):
        d.src[t] = ffi.cast("const char *", src_base[t])
        d.dst[t] = ffi.cast("char *", dst_base[t])
        d.run_bytes[t] = plan.run_bytes[t]
        d.src_layer_stride[t] = plan.src.layer_stride[t]
        d.src_page_stride[t] = plan.src.page_stride[t]
        d.dst_layer_stride[t] = plan.dst.layer_stride[t]
        d.dst_page_stride[t] = plan.dst.page_stride[t]
    return d
