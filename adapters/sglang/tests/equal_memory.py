"""Equal KV memory inside SGLang 0.5.23: hybridkv's backend vs ``UnifiedRadixCache``.

Mooncake conversation requests run through :mod:`sglang_flow` (SGLang's real
``SWAKVPool``, ``SWATokenToKVPoolAllocator``, ``ReqToTokenPool``, ``Req`` and
scheduler helpers; content tags in the K/V buffers checked behind every hit;
SGLang's pool accounting checked after every step) at two KV-memory sizes
given in bytes of a MiMo-V2.5-Pro-shaped model (51,200 B per token of full KV,
307,200 B per token of SWA KV, W = 128).  Every system spends the same bytes:

* ``hybridkv``: :class:`~hybridkv_sglang.radix_cache.HybridKVRadixCache` with the
  split :func:`~hybridkv_sglang.split.plan_swa_split` chooses (SWA for running
  requests plus one window per cached sequence of the workload's mean prompt
  length);
* ``unified_default``: ``UnifiedRadixCache`` (FULL + SWA) at SGLang's default
  ``--swa-full-tokens-ratio`` 0.8;
* ``unified_best``: the same at the ratio of :data:`RATIOS` with the most hit
  tokens (picked after the fact, which favours it).

Sizes come from the workload, the way the replays' 594 GB and 59 GB regimes
relate to the full trace: ``roomy`` is the smallest memory at which an LRU
cache of full KV alone (SWA charged nothing, 64-token blocks) reaches
:data:`ROOMY_BOUND_SHARE` of the unlimited prefix bound of the requests
replayed (at 594 GB on the full trace: 31.8% of 38.3%); ``tight`` is a tenth
of it (59 GB).

``page_size`` (default 1) is SGLang's ``--page-size``: the pools, both systems'
pool sizes and every allocation are paged (``alloc_extend`` / ``alloc_decode``
at page sizes above 1), hits end on page boundaries.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

import hicache_pick
from hicache_pick import DEFAULT_RATIO  # SGLang's --swa-full-tokens-ratio default
from sglang_flow import Driver, Pools, prefix_hashes

FULL_BYTES_PER_TOKEN = 51_200    # MiMo-V2.5-Pro: 10 full layers x 8 KV heads x (192 + 128) x 2 B
SWA_BYTES_PER_TOKEN = 307_200    # 60 SWA layers, same heads
WINDOW = 128
RATIOS = (0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0)  # SGLang accepts (0, 1]
SYSTEMS = ("hybridkv", "unified")  # unified: the ratio sweep, unified_default and unified_best
ROOMY_BOUND_SHARE = 0.83         # 31.8% / 38.3%: full-KV LRU vs prefix bound at 594 GB
TIGHT_FRACTION = 0.1             # 59 GB / 594 GB
CHUNK = 2048
MAX_LIVE = 3
OUTPUT_TOKENS = 8
LRU_BLOCK = 64


@dataclass
class Row:
    size: str
    kv_bytes: int
    system: str
    swa_ratio: float
    full_tokens: int
    swa_tokens: int
    hit_tokens: int
    input_tokens: int
    requests: int
    rejected: int
    accounting_checks: int
    hits_verified: int
    seconds: float
    page_size: int = 1

    def public(self) -> dict:
        return {"kv_bytes": self.kv_bytes, "system": self.system, "swa_ratio": round(self.swa_ratio, 4),
                "hit_tokens": self.hit_tokens, "input_tokens": self.input_tokens, "page_size": self.page_size}


# ------------------------------------------------------------------ workload
def mooncake_prompts(trace: Path, limit: int, max_len: int | None = None) -> list[np.ndarray]:
    """The first ``limit`` requests of a trace as token arrays (extension rule on);
    with ``max_len``, only those of them with at most ``max_len`` tokens."""
    from hybridkv.eval.traces import TokenMaterializer, load_trace

    mat = TokenMaterializer()
    prompts = [mat.tokens(r).astype(np.int64) for r in load_trace(trace, limit=limit)]
    return prompts if max_len is None else [p for p in prompts if len(p) <= max_len]


def conversation_outputs(prompts: Sequence[np.ndarray], n_out: int = OUTPUT_TOKENS) -> list[np.ndarray]:
    """Each request's decoded tokens: the ``n_out`` tokens that follow its prompt
    in the first later request whose prompt extends it (the next turn quotes the
    answer), else ``n_out`` tokens derived from the prompt (no later turn).
    O(N^2) vectorised comparisons of prefix hashes."""
    lens = np.array([len(p) for p in prompts], dtype=np.int64)
    hashes = [prefix_hashes(p) for p in prompts]
    last = np.array([h[-1] for h in hashes], dtype=np.int64)
    nxt = np.full(len(prompts), -1, dtype=np.int64)
    for j in range(1, len(prompts)):
        i = np.arange(j)
        i = i[(lens[:j] + n_out <= lens[j]) & (nxt[:j] < 0)]
        if i.size:
            i = i[hashes[j][lens[i] - 1] == last[i]]
            nxt[i] = j
    out = []
    for i, p in enumerate(prompts):
        if nxt[i] >= 0:
            out.append(prompts[nxt[i]][lens[i]:lens[i] + n_out].copy())
        else:
            out.append(((hashes[i][-1:] + np.arange(1, n_out + 1)) % 50000 + 7).astype(np.int64))
    return out


def _block_keys(tokens: np.ndarray, block: int) -> list[int]:
    # a request never hits its own last token, as in SGLang's match
    n = (len(tokens) - 1) // block
    return prefix_hashes(tokens)[block - 1:n * block:block].tolist() if n else []


def full_kv_lru_hits(prompts: Sequence[np.ndarray], capacity_tokens: float | None,
                     block: int = LRU_BLOCK) -> int:
    """Hit tokens of an LRU prefix cache of full KV only (whole blocks; ``None``:
    unlimited, the prefix bound), requests one at a time.  O(total blocks)."""
    cap = None if capacity_tokens is None else int(capacity_tokens // block)
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for tokens in prompts:
        keys = _block_keys(tokens, block)
        k = 0
        while k < len(keys) and keys[k] in lru:
            k += 1
        hits += k * block
        for key in keys:
            lru[key] = None
            lru.move_to_end(key)
        if cap is not None:
            while len(lru) > cap:
                lru.popitem(last=False)
    return hits


def pick_sizes(prompts: Sequence[np.ndarray]) -> dict[str, dict]:
    """``{"roomy": {...}, "tight": {...}}`` with ``kv_bytes`` and the full-KV LRU
    hits / prefix bound there (see the module docstring)."""
    bound = full_kv_lru_hits(prompts, None)
    total = sum(len(p) for p in prompts)
    lo, hi = LRU_BLOCK, total
    while hi - lo > max(LRU_BLOCK, total // 2000):  # bisection on the capacity in tokens
        mid = (lo + hi) // 2
        if full_kv_lru_hits(prompts, mid) >= ROOMY_BOUND_SHARE * bound:
            hi = mid
        else:
            lo = mid
    roomy_tokens = hi
    sizes = {}
    for name, tokens in (("roomy", roomy_tokens), ("tight", int(roomy_tokens * TIGHT_FRACTION))):
        sizes[name] = {"kv_bytes": tokens * FULL_BYTES_PER_TOKEN, "full_kv_lru_hits": full_kv_lru_hits(prompts, tokens),
                       "prefix_bound": bound, "input_tokens": total}
    return sizes


# ------------------------------------------------------------------ systems
def hybridkv_split(kv_bytes: int, prompts: Sequence[np.ndarray], chunk: int = CHUNK, max_live: int = MAX_LIVE,
                   page_size: int = 1):
    """:func:`~hybridkv_sglang.split.plan_swa_split` for the harness: ``max_live``
    requests that may all be prefilling a chunk at once; L = mean prompt length."""
    from hybridkv_sglang.split import plan_swa_split

    mean_len = int(np.mean([len(p) for p in prompts]))
    return plan_swa_split(kv_bytes, FULL_BYTES_PER_TOKEN, SWA_BYTES_PER_TOKEN, window=WINDOW,
                          chunked_prefill_size=chunk, max_running_requests=max_live, page_size=page_size,
                          prefill_chunks_in_flight=max_live, tokens_per_window=mean_len)


def run_one(system: str, prompts: Sequence[np.ndarray], full: int, swa: int, *,
            sanity_every: int = 0, chunk: int = CHUNK, max_live: int = MAX_LIVE,
            quoted_answers: bool = True, page_size: int = 1) -> tuple[dict, float]:
    """Replay ``prompts`` through ``system`` (``"hybridkv"`` or ``"unified"``) on
    pools of ``full`` / ``swa`` tokens of ``page_size``-token pages.
    ``quoted_answers``: the decoded tokens are what the next turn quotes
    (:func:`conversation_outputs`), else tokens no later prompt holds.  Returns
    the driver's stats and seconds."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from hybridkv_sglang.radix_cache import HybridKVRadixCache

    longest = max(len(p) for p in prompts) + OUTPUT_TOKENS + 1
    pools = Pools(full_tokens=full, swa_tokens=swa, page_size=page_size, max_reqs=max_live + 2,
                  max_context=longest)
    params = pools.init_params(WINDOW)
    if system == "unified":
        params.tree_components = (ComponentType.FULL, ComponentType.SWA)
        cache = UnifiedRadixCache(params)
    elif system == "hybridkv":
        cache = HybridKVRadixCache(params)
    else:
        raise ValueError(f"system must be 'hybridkv' or 'unified', got {system!r}")
    driver = Driver(cache, pools, WINDOW, chunk=chunk, max_live=max_live)
    if sanity_every:
        steps = [0]

        def sanity(d: Driver) -> None:
            steps[0] += 1
            if steps[0] % sanity_every == 0:
                d.cache.sanity_check()
        driver.after_step = sanity
    start = time.perf_counter()
    outputs = conversation_outputs(prompts) if quoted_answers else [OUTPUT_TOKENS] * len(prompts)
    stats = driver.run([(p, o, None) for p, o in zip(prompts, outputs)])
    cache.sanity_check()
    return ({"hit_tokens": stats.hit_tokens, "input_tokens": stats.input_tokens, "requests": stats.requests,
             "rejected": stats.rejected, "checks": stats.checks,
             "hits_verified": sum(1 for h in stats.hits if h)}, time.perf_counter() - start)


def equal_memory(prompts: Sequence[np.ndarray], sizes: dict[str, dict], *, ratios: Sequence[float] = RATIOS,
                 sanity_every: int = 0, chunk: int = CHUNK, max_live: int = MAX_LIVE,
                 quoted_answers: bool = True, progress: Callable[[str], None] | None = None,
                 systems: Sequence[str] = SYSTEMS, page_size: int = 1) -> list[Row]:
    """hybridkv, unified_default and unified_best at every size (and, with
    ``progress``, a line per run); ``systems`` a subset of :data:`SYSTEMS`
    (``"unified"``: the sweep and both of its rows).  A ratio whose pools reject a
    request (SWA too small for the running requests) is not eligible as
    ``unified_best``.  ``page_size``: SGLang's ``--page-size`` for every run.
    Raises ValueError naming ``systems`` for an unknown name, ``page_size`` for
    one that is not a positive int."""
    if isinstance(systems, str) or not systems or any(x not in SYSTEMS for x in systems):
        raise ValueError(f"systems must be a non-empty subset of {SYSTEMS}, got {systems!r}")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    rows: list[Row] = []

    def record(size, kv_bytes, system, ratio, full, swa) -> Row:
        st, secs = run_one("hybridkv" if system == "hybridkv" else "unified", prompts, full, swa,
                           sanity_every=sanity_every, chunk=chunk, max_live=max_live,
                           quoted_answers=quoted_answers, page_size=page_size)
        row = Row(size, kv_bytes, system, ratio, full, swa, st["hit_tokens"], st["input_tokens"], st["requests"],
                  st["rejected"], st["checks"], st["hits_verified"], round(secs, 1), page_size)
        if progress:
            progress(f"{size} {system} page={page_size} ratio={ratio:.4f} full={full} swa={swa}: hit "
                     f"{row.hit_tokens} of {row.input_tokens}, {row.hits_verified} hits content-checked (a wrong "
                     f"one stops the run), rejected {row.rejected}, {row.seconds} s")
        return row

    from hybridkv_sglang.split import pools_at_ratio

    for size, info in sizes.items():
        kv_bytes = info["kv_bytes"]
        if "hybridkv" in systems:
            split = hybridkv_split(kv_bytes, prompts, chunk, max_live, page_size)
            rows.append(record(size, kv_bytes, "hybridkv", split.swa_full_tokens_ratio, split.full_tokens,
                               split.swa_tokens))
        if "unified" not in systems:
            continue
        sweep = []
        for r in sorted(set(ratios) | {DEFAULT_RATIO}):
            full, swa = pools_at_ratio(kv_bytes, FULL_BYTES_PER_TOKEN, SWA_BYTES_PER_TOKEN, r, page_size)
            if swa <= WINDOW + 1:  # SGLang refuses such a pool (validate_swa_pool_size)
                continue
            sweep.append(record(size, kv_bytes, f"unified@{r}", r, full, swa))
        runs = [{"setting": {"swa_full_tokens_ratio": x.swa_ratio}, "rejected": x.rejected,
                 "hit_tokens": x.hit_tokens} for x in sweep]
        default, best = hicache_pick.default_index(runs), hicache_pick.best_index(runs)
        assert default is not None and best is not None, "SGLang's default ratio was not swept"
        rows.append(Row(**{**asdict(sweep[default]), "system": "unified_default"}))
        rows.append(Row(**{**asdict(sweep[best]), "system": "unified_best"}))
        rows.extend(x for x in sweep)
    return rows
