"""Shared pieces of the peer drivers: the token-sequence file, pool sizing,
per-request timing and the result record.

Imports numpy and the standard library only, so every peer's venv can load it
(the drivers put this folder on ``sys.path``).

The sequence file is a folder written once by ``run.py`` in the main
interpreter and memory-mapped by every driver, so all systems replay the
*same* token ids:

* ``tokens.npy``  int32, all prompts concatenated
* ``offsets.npy`` int64, ``len = n + 1``; prompt ``i`` is ``tokens[offsets[i]:offsets[i+1]]``
* ``meta.json``   ``namespaces`` (one per prompt), trace, extension rule,
  prefix bound and the model preset's bytes per token.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

GB = 10**9


# ------------------------------------------------------------------ sequences
def save_sequences(folder: str | os.PathLike, seqs: Sequence[np.ndarray], namespaces: Sequence[str],
                   meta: dict[str, Any]) -> None:
    """Write ``seqs`` (1-D int arrays) and their namespaces to ``folder``."""
    if len(seqs) != len(namespaces):
        raise ValueError(f"namespaces has {len(namespaces)} entries for {len(seqs)} sequences")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.lib.format.open_memmap(out / "tokens.npy", mode="w+", dtype=np.int32,
                                       shape=(int(offsets[-1]),))
    for s, a, b in zip(seqs, offsets[:-1], offsets[1:]):
        tokens[a:b] = s
    tokens.flush()
    del tokens
    np.save(out / "offsets.npy", offsets)
    (out / "meta.json").write_text(json.dumps(dict(meta, namespaces=list(namespaces))))


@dataclass
class Sequences:
    """Memory-mapped prompts; ``seq(i)`` is an int32 view (no copy)."""

    tokens: np.ndarray
    offsets: np.ndarray
    namespaces: list[str]
    meta: dict[str, Any]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def seq(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def __iter__(self) -> Iterator[tuple[np.ndarray, str]]:
        for i in range(len(self)):
            yield self.seq(i), self.namespaces[i]

    @property
    def input_tokens(self) -> int:
        return int(self.offsets[-1])


def load_sequences(folder: str | os.PathLike) -> Sequences:
    """Open a folder written by :func:`save_sequences`."""
    f = Path(folder)
    meta = json.loads((f / "meta.json").read_text())
    ns = meta.pop("namespaces")
    return Sequences(np.load(f / "tokens.npy", mmap_mode="r"), np.load(f / "offsets.npy"), ns, meta)


# ------------------------------------------------------------------ peer settings
# Each peer's own knob of its prefix cache, the value its server uses when the
# flag is not given, and the values the benchmark sweeps by default.
VLLM_RETENTION_DEFAULT: int | None = 0  # vllm.config.CacheConfig.prefix_cache_retention_interval
VLLM_RETENTION_SWEEP: tuple[int | None, ...] = (0, 4096, 16384, None)
SGLANG_RATIO_DEFAULT = 0.8  # SGLang's --swa-full-tokens-ratio
SGLANG_RATIO_SWEEP: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0)


def _parse_list(text: str, arg: str, parse_one: Callable[[str], Any], *, fold: bool = False) -> list[Any]:
    """The comma-separated values of ``text`` (stripped, lower-cased if ``fold``), each
    through ``parse_one`` (which raises ValueError with its own message); ValueError
    naming ``arg`` for an empty list or a repeated value, TypeError if ``text`` is not
    a string."""
    if not isinstance(text, str):
        raise TypeError(f"{arg} must be a string, got {type(text).__name__}")
    out: list[Any] = []
    for item in (x.strip() for x in text.split(",")):
        item = item.lower() if fold else item
        if not item:
            continue
        value = parse_one(item)
        if value in out:
            raise ValueError(f"{arg}: {item!r} is given twice")
        out.append(value)
    if not out:
        raise ValueError(f"{arg}: no values in {text!r}")
    return out


def parse_retention(text: str, arg: str = "--vllm-retention") -> list[int | None]:
    """``"0,4096,none"`` -> ``[0, 4096, None]``: vLLM retention intervals in
    tokens (``none`` = dense retention).  Raises ValueError naming ``arg`` for
    an empty list, a negative or non-integer value, or a repeated one."""

    def one(item: str) -> int | None:
        if item == "none":
            return None
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"{arg}: {item!r} is neither an integer nor 'none'") from None
        if value < 0:
            raise ValueError(f"{arg}: {value} is negative")
        return value

    return _parse_list(text, arg, one, fold=True)


def parse_ratios(text: str, arg: str = "--sglang-ratios") -> list[float]:
    """``"0.1,0.8"`` -> ``[0.1, 0.8]``: SGLang ``swa_full_tokens_ratio`` values.
    Raises ValueError naming ``arg`` for an empty list, a value that is not a
    positive finite number, or a repeated one."""

    def one(item: str) -> float:
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"{arg}: {item!r} is not a number") from None
        if not (0.0 < value < float("inf")):
            raise ValueError(f"{arg}: {item!r} must be a positive finite number")
        return value

    return _parse_list(text, arg, one)


def format_retention(values: Sequence[int | None]) -> str:
    """Inverse of :func:`parse_retention` (the driver's command-line form)."""
    return ",".join("none" if v is None else str(v) for v in values)


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc), so the next
    replay in the same process starts its resident-memory baseline low.
    Mutates nothing but the process heap."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the baseline is just higher
        pass


# ------------------------------------------------------------------ sizing
def sglang_pool_tokens(budget_bytes: int, full_bpt: int, swa_bpt: int, ratio: float, page: int) -> tuple[int, int]:
    """SGLang's hybrid SWA pool sizes: ``swa = ratio * full`` tokens and
    ``full * full_bpt + swa * swa_bpt <= budget`` (page-aligned)."""
    full = int(budget_bytes // (full_bpt + ratio * swa_bpt))
    full -= full % page
    swa = int(full * ratio)
    swa -= swa % page
    return full, swa


def vllm_num_blocks(budget_bytes: int, per_layer_bpt: int, page: int, group_size: int) -> int:
    """vLLM's hybrid allocator: every KV-cache group has ``group_size`` layers
    and every block of the shared pool holds one page of each of those layers,
    so a block costs ``page * per_layer_bpt * group_size`` bytes."""
    return int(budget_bytes // (page * per_layer_bpt * group_size))


# ------------------------------------------------------------------ timing
@dataclass
class OpTimes:
    """Per-request cache-operation times in microseconds.

    ``match``: prefix lookup; ``alloc``: allocation of the uncached suffix,
    eviction included, summed over prefill chunks; ``insert``: caching the
    prompt and freeing the request.  ``op`` is their sum per request.
    ``kernel``: the part of ``alloc`` spent in a CPU stand-in for a peer's
    GPU allocation kernel (SGLang's paged ``alloc_extend``);
    ``op_excl_kernel`` leaves it out, so a peer is not charged for running
    its GPU path on a CPU.
    """

    match: list[float] = field(default_factory=list)
    alloc: list[float] = field(default_factory=list)
    insert: list[float] = field(default_factory=list)
    kernel: list[float] = field(default_factory=list)

    def add(self, match_s: float, alloc_s: float, insert_s: float, kernel_s: float = 0.0) -> None:
        self.match.append(match_s * 1e6)
        self.alloc.append(alloc_s * 1e6)
        self.insert.append(insert_s * 1e6)
        self.kernel.append(kernel_s * 1e6)

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        cols = {"match": self.match, "alloc": self.alloc, "insert": self.insert}
        cols["op"] = [a + b + c for a, b, c in zip(self.match, self.alloc, self.insert)]
        cols["kernel"] = self.kernel
        cols["op_excl_kernel"] = [o - k for o, k in zip(cols["op"], self.kernel)]
        for name, values in cols.items():
            arr = np.asarray(values, dtype=np.float64) if values else np.zeros(1)
            out[f"{name}_us_p50"] = float(np.percentile(arr, 50))
            out[f"{name}_us_p99"] = float(np.percentile(arr, 99))
        out["op_us_mean"] = float(np.mean(cols["op"])) if cols["op"] else 0.0
        return out


def rss_bytes() -> int:
    """Anonymous resident memory of this process (resident minus file-backed
    pages), so the memory-mapped token file the replay reads is not counted."""
    with open("/proc/self/statm") as fh:
        fields = fh.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Run:
    """Accumulates one system's replay at one budget."""

    system: str
    budget_gb: float
    input_tokens: int = 0
    hit_tokens: int = 0
    rejected: int = 0
    requests: int = 0
    times: OpTimes = field(default_factory=OpTimes)
    rss_before: int = field(default_factory=rss_bytes)
    t0: float = field(default_factory=time.perf_counter)
    extra: dict[str, Any] = field(default_factory=dict)

    peak_rss: int = 0

    def record(self, prompt_len: int, hit: int) -> None:
        self.requests += 1
        self.input_tokens += prompt_len
        self.hit_tokens += hit
        if self.requests % 16 == 1:  # sampled: ru_maxrss would include import-time peaks
            self.peak_rss = max(self.peak_rss, rss_bytes())

    def result(self, kv_buffer_bytes: int = 0) -> dict[str, Any]:
        """The JSON record.  ``peak_metadata_mb``: peak growth of anonymous
        resident memory (sampled every 16 requests and at the end) from before
        the cache was built, minus KV buffers the peer allocates for real: an
        upper bound on metadata (it also holds allocator slack and transient
        request objects)."""
        out: dict[str, Any] = {
            "system": self.system, "budget_gb": self.budget_gb, "requests": self.requests,
            "input_tokens": self.input_tokens, "hit_tokens": self.hit_tokens,
            "token_hit_rate": self.hit_tokens / max(1, self.input_tokens),
            "prefill_tokens_saved": self.hit_tokens, "rejected_requests": self.rejected,
            "replay_s": time.perf_counter() - self.t0,
            "peak_metadata_mb": max(0, max(self.peak_rss, rss_bytes()) - self.rss_before - kv_buffer_bytes) / 2**20,
        }
        out.update(self.times.summary())
        out.update(self.extra)
        return out


# ------------------------------------------------------------------ driver CLI
def driver_args(description: str, argv: Sequence[str] | None = None,
                extra: dict[str, dict[str, Any]] | None = None) -> argparse.Namespace:
    """Arguments shared by every driver: sequences folder, budgets, preset bytes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("sequences", help="folder written by run.py (tokens.npy, offsets.npy, meta.json)")
    p.add_argument("--budgets", required=True, help="comma-separated budgets in GB (1e9 bytes)")
    p.add_argument("--chunk", type=int, default=8192, help="chunked-prefill size in tokens")
    for name, kw in (extra or {}).items():
        p.add_argument(name, **kw)
    args = p.parse_args(argv)
    args.budgets = [float(x) for x in args.budgets.split(",") if x.strip()]
    if not args.budgets or min(args.budgets) <= 0:
        p.error("--budgets needs positive numbers")
    if args.chunk < 1:
        p.error("--chunk must be >= 1")
    return args


def emit(result: dict[str, Any]) -> None:
    """One JSON line per (system, budget) on stdout; run.py collects them."""
    print("RESULT " + json.dumps(result), flush=True)
