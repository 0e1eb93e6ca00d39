"""The batched engine step's record (:class:`StepBatch`) and the row arguments
and batch assembly of :meth:`~hybridkv.cache.HybridKVCache.step`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._validate import as_token_array

__all__ = ["StepBatch", "build_batch", "check_distinct", "step_counts", "step_tokens"]

_EMPTY64 = np.zeros(0, dtype=np.int64)
_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass
class StepBatch:
    """What :meth:`HybridKVCache.step` handed out for one engine step.

    Row ``i`` is ``requests[i]``.  ``ok[i]`` is False where that request got
    nothing (``errors[i]`` says why: :class:`CacheFullError` or a ``ValueError``
    for a bad row); such a request is exactly as before the call.  For ok rows
    positions ``[start[i], start[i] + num_new[i])`` now have slots:
    ``full_slots[cu_new[i]:cu_new[i + 1]]`` / ``swa_slots[...]`` (logical
    int64 token slots, ``page * page_size + offset``; map them to the arena's
    blocks with ``cache.pool.buffers.of(kind).physical_slots``), and
    ``seq_lens[i] = start[i] + num_new[i]`` is the KV length attention reads.
    Pages added this step (for engines that keep block tables incrementally):
    row ``new_rows[j]``'s page ``new_index[j]`` is ``new_full[j]`` / ``new_swa[j]``.
    """

    requests: list
    ok: np.ndarray
    errors: dict
    start: np.ndarray
    num_new: np.ndarray
    cu_new: np.ndarray
    full_slots: np.ndarray
    swa_slots: np.ndarray
    seq_lens: np.ndarray
    new_rows: np.ndarray
    new_index: np.ndarray
    new_full: np.ndarray
    new_swa: np.ndarray
    committed: bool = field(default=False)


def check_distinct(reqs: list) -> None:
    """Raise ValueError if a request appears twice in ``reqs`` (two rows would both
    grow it).  O(B)."""
    try:
        distinct = len(set(reqs))  # requests hash by identity: ~4x cheaper than a set of ids
    except TypeError:  # unhashable rows (not requests, reported per row by step)
        distinct = len({id(r) for r in reqs})
    if distinct != len(reqs):
        first: dict[int, int] = {}
        for i, r in enumerate(reqs):
            j = first.setdefault(id(r), i)
            if j != i:
                raise ValueError(f"requests[{i}] is the same request as requests[{j}]: "
                                 "a request may appear once per step")


def step_tokens(new_tokens: object, B: int) -> list | None:
    """``step``'s ``new_tokens`` per row: None (append nothing), an int or an int32
    array; None for no tokens at all.  Raises TypeError/ValueError naming it.  O(B)."""
    if new_tokens is None:
        return None
    if isinstance(new_tokens, np.ndarray) or (hasattr(new_tokens, "numpy") and hasattr(new_tokens, "cpu")):
        arr = new_tokens if isinstance(new_tokens, np.ndarray) else new_tokens.cpu().numpy()  # type: ignore[union-attr]
        if arr.ndim != 1 or len(arr) != B:
            raise ValueError(f"new_tokens must be 1-D with one entry per request ({B}), got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"new_tokens must hold integers, got dtype {arr.dtype}")
        if not arr.size:
            return []
        if arr.max() > _INT32_MAX:
            raise ValueError("new_tokens holds ids >= 2**31")
        out = arr.tolist()
        return out if arr.min() >= 0 else [t if t >= 0 else None for t in out]
    if not isinstance(new_tokens, (list, tuple)):
        raise TypeError(f"new_tokens must be an int array or a sequence, got {type(new_tokens).__name__}")
    if len(new_tokens) != B:
        raise ValueError(f"new_tokens has {len(new_tokens)} entries for {B} requests")
    out: list = []
    for i, t in enumerate(new_tokens):
        if t is None:
            out.append(None)
        elif isinstance(t, (int, np.integer)) and not isinstance(t, bool):
            if not 0 <= t < 2**31:
                raise ValueError(f"new_tokens[{i}] must be a token id in [0, 2**31), got {t}")
            out.append(int(t))
        else:
            arr = as_token_array(t, f"new_tokens[{i}]")
            out.append(arr if len(arr) else None)
    return out


def step_counts(num_new: object, B: int) -> list | None:
    """``step``'s ``num_new`` per row (None: the default).  Raises ValueError.  O(B)."""
    if num_new is None:
        return None
    if isinstance(num_new, (int, np.integer)) and not isinstance(num_new, bool):
        return [int(num_new)] * B
    arr = np.asarray(num_new)
    if arr.ndim != 1 or len(arr) != B or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"num_new must be an int or a 1-D int array with {B} entries")
    return arr.tolist()


def build_batch(reqs: list, ok: np.ndarray, errors: dict, starts: list, nums: list, fs: list,
                ss: list, multi: bool, grew: list) -> StepBatch:
    """The :class:`StepBatch` of rows prepared by ``step``: ``fs``/``ss`` hold an int
    slot per single-token row and an int64 array per multi-token row (``multi``);
    ``grew`` lists ``(row, first new page, end)``.  O(batch + slots)."""
    start = np.array(starts, dtype=np.int64)
    num = np.array(nums, dtype=np.int64)
    cu = np.zeros(len(reqs) + 1, dtype=np.int64)
    num.cumsum(out=cu[1:])
    if multi or errors:  # rows of several tokens, or failed rows holding no slot
        keep = ok.tolist()
        fs = [np.array([x], np.int64) if type(x) is int else x for x, o in zip(fs, keep) if o]
        ss = [np.array([x], np.int64) if type(x) is int else x for x, o in zip(ss, keep) if o]
        full = np.concatenate(fs) if fs else _EMPTY64
        swa = np.concatenate(ss) if ss else _EMPTY64
    else:
        full = np.array(fs, dtype=np.int64)
        swa = np.array(ss, dtype=np.int64)
    if grew:
        rows = np.concatenate([np.full(hi - lo, i, np.int64) for i, lo, hi in grew])
        index = np.concatenate([np.arange(lo, hi, dtype=np.int64) for _, lo, hi in grew])
        nf = np.concatenate([reqs[i].full_pages[lo:hi] for i, lo, hi in grew])
        ns = np.concatenate([reqs[i].swa_pages[lo:hi] for i, lo, hi in grew])
    else:
        rows = index = _EMPTY64
        nf = ns = np.zeros(0, np.int32)
    return StepBatch(reqs, ok, errors, start, num.astype(np.int32), cu, full, swa, start + num,
                     rows, index, nf, ns)
