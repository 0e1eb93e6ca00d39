"""Request traces: Mooncake jsonl and kv-cache-tester (json / json.gz) sessions.

Traces carry chained block hashes, not tokens.  :class:`TokenMaterializer`
expands each block id into a deterministic block of token ids, so equal
hash prefixes become equal token prefixes.

**The partial-block extension rule.**  A prompt whose last block is partial
is usually extended by a later prompt, whose block at that position then has
a *new* id (the block filled up).  Read literally, the two prompts diverge at
that block boundary, and a cache could never hit the end of the first one.
We treat it as an extension instead: when a block id is seen for the first
time at position ``k`` after the same prefix (namespace, id of block
``k - 1``) as the most recent earlier prompt whose block ``k`` was partial
with ``r`` tokens, the new block's first ``r`` tokens are that partial
block's tokens.  For kv-cache-tester traces, whose ``hash_ids`` cover
complete blocks only, the partial tail gets a synthetic id first.  Every
report states whether the rule was on (``extension_rule``).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .._validate import check_int

log = logging.getLogger(__name__)

__all__ = ["TraceRequest", "TokenMaterializer", "PrefixBound", "load_trace", "jsonl_block_size", "bundled_sample",
           "default_shared_traces", "FORMATS"]

#: What :func:`load_trace` reads, in words (the CLI's trace help says this).
FORMATS = ("a Mooncake or Qwen-Bailian trace (.jsonl, .jsonl.gz), a kv-cache-tester session "
           "(.json, .json.gz) or a folder of sessions")

_SYNTHETIC = 1 << 62
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class TraceRequest:
    """One prompt of a trace.

    ``blocks`` are namespaced block ids; ``input_length <= len(blocks) * block_size``
    (the last block may be partial).
    """

    namespace: str
    timestamp: float
    input_length: int
    output_length: int
    blocks: tuple[int, ...]
    block_size: int


def bundled_sample() -> Path:
    """The Mooncake conversation sample shipped with the package (first 2,000 requests)."""
    return Path(__file__).resolve().parent / "data" / "mooncake_conversation_sample.jsonl"


def default_shared_traces() -> Path | None:
    """``shared/traces`` beside the checkout (or ``$HYBRIDKV_TRACES``), if present."""
    env = os.environ.get("HYBRIDKV_TRACES")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parents[1]  # the hybridkv package folder
    candidates += [p / "shared" / "traces" for p in (here.parent.parent, here.parent.parent.parent)]
    candidates.append(Path.cwd().parent / "shared" / "traces")
    for c in candidates:
        if c.is_dir():
            return c
    return None


def load_trace(path: str | os.PathLike, *, limit: int | None = None,
               max_sessions: int | None = None, block_size: int | None = None) -> list[TraceRequest]:
    """Load a trace file or a folder of kv-cache-tester sessions.

    A folder is replayed as interleaved tenants: each session is its own
    namespace and requests are merged by timestamp.  Mooncake traces use the
    namespace ``"default"``.  ``max_sessions`` keeps the first N session files of a
    folder; ``limit`` the first N requests.  Raises ValueError for unknown formats.

    ``block_size`` (tokens per hash id) of a jsonl trace: ``None`` takes it from
    the data (:func:`jsonl_block_size`): 512 for the Mooncake traces, 16 for the
    Qwen-Bailian traces (``qwen_*_blksz_16.jsonl``, same schema).  Given, it must
    fit every record (``(len(hash_ids) - 1) * B < input_length <= len(hash_ids) * B``)
    or a ValueError names the first record that does not.  kv-cache-tester
    sessions carry their own ``block_size``; giving one for them is a ValueError.
    """
    if block_size is not None:
        block_size = check_int(block_size, "block_size", 1)
    p = Path(path)
    if not p.exists():
        raise ValueError(f"trace path {str(p)!r} does not exist")
    if p.is_dir():
        files = sorted([f for f in p.iterdir() if f.name.endswith((".json", ".json.gz", ".jsonl"))])
        files = files[:max_sessions] if max_sessions is not None else files
        if not files:
            raise ValueError(f"trace folder {str(p)!r} holds no .json/.json.gz/.jsonl files")
        reqs: list[TraceRequest] = []
        for i, f in enumerate(files):
            reqs.extend(_load_file(f, session=i, block_size=block_size))
        reqs.sort(key=lambda r: r.timestamp)
    else:
        reqs = _load_file(p, session=0, block_size=block_size)
    return reqs[:limit] if limit is not None else reqs


def _load_file(p: Path, session: int, block_size: int | None = None) -> list[TraceRequest]:
    """Parse one trace file; every problem is a one-line ValueError naming the file
    (and, for jsonl, the line number)."""
    opener = gzip.open if p.name.endswith(".gz") else open
    try:
        with opener(p, "rt", encoding="utf-8") as fh:  # type: ignore[operator]
            if p.name.endswith((".jsonl", ".jsonl.gz")):
                rows, lines = [], []
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{p}:{lineno}: not valid JSON ({_json_error(exc, line)})") from None
                    try:
                        rows.append(_mooncake(row))
                    except _BadRecord as exc:
                        raise ValueError(f"{p}:{lineno}: {exc}") from None
                    lines.append(lineno)
                size = _fit_block_size(rows, lines, p, block_size)
                return [TraceRequest("default", ts, n, out, ids, size) for ts, n, out, ids in rows]
            if block_size is not None:
                raise ValueError(f"{p}: block_size applies to jsonl traces; kv-cache-tester sessions carry their own")
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: cannot read the trace ({type(exc).__name__}: {_one_line(exc)})") from None
    if isinstance(data, dict) and "requests" in data:
        try:
            name = str(data.get("id") or p.name.split(".")[0])
            return list(_session(data, name, session, 0.0, _int(data.get("block_size", 64), "block_size", 1)))
        except _BadRecord as exc:
            raise ValueError(f"{p}: {exc}") from None
    raise ValueError(f"trace file {p.name!r} is neither Mooncake jsonl nor a kv-cache-tester session")


class _BadRecord(Exception):
    """A trace record that cannot be used (the caller adds where it is)."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _json_error(exc: json.JSONDecodeError, line: str) -> str:
    """The parser's complaint about one jsonl record, placed by the column within the
    file's line: the parser's own "line 2 column 1" counts lines of the record string,
    whose line 2 is just the record's end."""
    text = line.rstrip("\r\n")
    if exc.pos >= len(text):
        return f"{exc.msg} at the end of the line"
    return f"{exc.msg} at column {exc.pos + 1}"


def _field(row: object, name: str, what: str = "record") -> object:
    if not isinstance(row, dict):
        raise _BadRecord(f"{what} must be a JSON object, got {type(row).__name__}")
    if name not in row:
        raise _BadRecord(f"{what} lacks the required field {name!r} (has {sorted(map(str, row))[:8]})")
    return row[name]


def _int(value: object, name: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")) or int(value) != value or int(value) < lo:
        raise _BadRecord(f"field {name!r} must be an integer >= {lo}, got {value!r:.40}")
    return int(value)


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")):
        raise _BadRecord(f"field {name!r} must be a finite number, got {value!r:.40}")
    return float(value)


def _ids(value: object, name: str = "hash_ids") -> list[int]:
    if not isinstance(value, list):
        raise _BadRecord(f"field {name!r} must be a list of block ids, got {type(value).__name__}")
    if value and (not all(type(h) is int for h in value) or min(value) < 0 or max(value) >= 1 << 62):
        h = next(h for h in value if type(h) is not int or not 0 <= h < 1 << 62)
        raise _BadRecord(f"field {name!r} must hold integer block ids in [0, 2^62), got {h!r:.40}")
    return value


def _mooncake(row: object) -> tuple[float, int, int, tuple[int, ...]]:
    """(timestamp in seconds, input_length, output_length, hash ids) of one jsonl record.
    Mooncake and Qwen-Bailian records share these fields; Mooncake's timestamps
    are milliseconds, Qwen's (records with a ``chat_id``) seconds.  Qwen's
    ``parent_chat_id``, ``turn`` and ``type`` are not read: prefixes come from the ids."""
    ts = _number(_field(row, "timestamp"), "timestamp")
    n = _int(_field(row, "input_length"), "input_length")
    ids = _ids(_field(row, "hash_ids"))
    out = _int(row.get("output_length", 0), "output_length")  # type: ignore[union-attr]
    return (ts if "chat_id" in row else ts / 1000.0), n, out, tuple(ids)  # type: ignore[operator]


_MOONCAKE_BLOCK = 512
_BLKSZ = re.compile(r"blksz_(\d+)")


def jsonl_block_size(lengths: list[tuple[int, int]], name: str = "") -> tuple[int, int, int]:
    """(block size, lowest and highest size every record fits) for a jsonl trace.

    ``lengths`` holds ``(input_length, len(hash_ids))`` per record.  A record of
    ``n`` tokens and ``k`` ids fits block size ``B`` when ``(k - 1) * B < n <= k * B``
    (every block full but the last).  The chosen size is, in this order: the size
    in the file name (``..._blksz_16.jsonl``) when the records fit it, Mooncake's
    512 when they fit it, the largest power of two they fit, and else the lowest
    size they fit.  ``(_, lo, hi)`` with ``lo > hi`` means no size fits every record.
    """
    lo, hi = 1, 1 << 40
    for n, k in lengths:
        if k == 0:
            continue
        lo = max(lo, -(-n // k))
        if k > 1:
            hi = min(hi, (n - 1) // (k - 1))
    hint = _BLKSZ.search(name)
    if hint and lo <= int(hint.group(1)) <= hi:
        return int(hint.group(1)), lo, hi
    if lo <= _MOONCAKE_BLOCK <= hi:
        return _MOONCAKE_BLOCK, lo, hi
    if lo <= hi:
        pow2 = 1 << (hi.bit_length() - 1)
        return (pow2 if pow2 >= lo else lo), lo, hi
    return _MOONCAKE_BLOCK, lo, hi


def _fit_block_size(rows: list, lines: list[int], p: Path, block_size: int | None) -> int:
    """The block size of a parsed jsonl file (:func:`jsonl_block_size`).  A given
    size that a record does not fit is a ValueError naming the record; records
    that fit no single size fall back to Mooncake's 512, with a warning (the
    first record that does not fit it is named)."""
    lengths = [(n, len(ids)) for _, n, _, ids in rows]
    if block_size is None:
        size, lo, hi = jsonl_block_size(lengths, p.name)
        if lo <= hi:
            return size
    else:
        size = block_size
    for (n, k), lineno in zip(lengths, lines):
        if k and not (k - 1) * size < n <= k * size:
            where = f"{p}:{lineno}: input_length {n} with {k} hash_ids"
            if block_size is not None:
                raise ValueError(f"{where} does not fit the given block_size {size} "
                                 f"(needs {(k - 1) * size} < input_length <= {k * size})")
            log.warning("%s: no one block size fits every record; using %d (%s does not fit it)",
                        p, size, where)
            break
    return size


def _session(data: dict, name: str, session: int, t0: float, block: int) -> Iterator[TraceRequest]:
    base = (session + 1) << 40
    reqs = data["requests"]
    if not isinstance(reqs, list):
        raise _BadRecord(f"'requests' must be a list, got {type(reqs).__name__}")
    for i, r in enumerate(reqs, 1):
        what = f"request {i}"
        if not isinstance(r, dict):
            raise _BadRecord(f"{what} must be a JSON object, got {type(r).__name__}")
        try:
            t = t0 + _number(r.get("t", 0.0), "t")
            if r.get("type") == "subagent" and "requests" in r:
                yield from _session(r, name, session, t, block)
                continue
            if "hash_ids" not in r:
                continue
            ids = tuple(base | h for h in _ids(r["hash_ids"]))
            yield TraceRequest(name, t, _int(_field(r, "in", what), "in"), _int(r.get("out", 0), "out"), ids, block)
        except _BadRecord as exc:
            msg = str(exc)
            raise _BadRecord(msg if msg.startswith("request ") else f"{what}: {msg}") from None


def _mix64(x: int) -> int:
    """splitmix64 finaliser on a Python int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class TokenMaterializer:
    """Turns trace requests into token arrays, applying the extension rule.

    Call :meth:`tokens` in replay order (the rule depends on what came before).
    Runtime: O(input_length) numpy work per request; a bounded cache of
    expanded blocks makes repeated prefixes cheap.
    """

    def __init__(self, *, extension_rule: bool = True, seed: int = 0, cache_blocks: int = 20_000) -> None:
        self.extension_rule = extension_rule
        self.seed = np.uint64(seed)
        self._derived: dict[int, tuple[int, int]] = {}
        self._seen: set[int] = set()
        self._pending: dict[tuple[str, int, int], tuple[int, int]] = {}
        self._cache: dict[int, np.ndarray] = {}
        self._cache_cap = cache_blocks
        self._synthetic = _SYNTHETIC
        self._blocks_of: dict[int, int] = {}

    def _blocks(self, bids: list[int], size: int) -> list[np.ndarray]:
        """Tokens of each block: ``top31(base + j * step)`` with per-block hashed
        ``base`` and odd ``step`` (two blocks collide only if both match), then
        the extension rule's inherited prefix.  Missing blocks are made in one
        numpy pass."""
        cache = self._cache
        rows: dict[int, np.ndarray] = {}
        missing = []
        for b in dict.fromkeys(bids):
            row = cache.get(b)
            if row is None:
                missing.append(b)
            else:
                rows[b] = row
        if missing:
            seed = int(self.seed)
            base = np.array([_mix64(b ^ seed) for b in missing], dtype=np.uint64)
            step = np.array([_mix64(b ^ 0x5DEECE66D) | 1 for b in missing], dtype=np.uint64)
            with np.errstate(over="ignore"):
                made = ((np.arange(size, dtype=np.uint64)[None, :] * step[:, None] + base[:, None])
                        >> np.uint64(33)).astype(np.int32)
            if len(cache) + len(missing) > self._cache_cap:
                cache.clear()
            for b, row in zip(missing, made):
                cache[b] = rows[b] = row
            for b in missing:  # inherited prefixes (sources were seen earlier, or just made)
                src = self._derived.get(b)
                if src is not None:
                    rows[b][:src[1]] = self._blocks([src[0]], size)[0][:src[1]]
        return [rows[b] for b in bids]

    def tokens(self, req: TraceRequest) -> np.ndarray:
        """Token ids of ``req`` (int32, length ``input_length``)."""
        size = req.block_size
        blocks = list(req.blocks)
        full_blocks, rem = divmod(req.input_length, size)
        if rem and len(blocks) == full_blocks:  # kv-cache-tester: the partial tail has no id
            self._synthetic += 1
            blocks.append(self._synthetic)
        blocks = blocks[:full_blocks + (1 if rem else 0)]
        if self.extension_rule:
            prev = -1
            for k, bid in enumerate(blocks):
                if bid not in self._seen:
                    self._seen.add(bid)
                    src = self._pending.pop((req.namespace, prev, k), None)
                    if src is not None and src[0] != bid:
                        self._derived[bid] = src
                prev = bid
            if rem:
                before = blocks[-2] if len(blocks) > 1 else -1
                self._pending[(req.namespace, before, len(blocks) - 1)] = (blocks[-1], rem)
        parts = self._blocks(blocks, size)
        out = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return out[:req.input_length]


class PrefixBound:
    """Hits of an unlimited page-aligned prefix cache (the upper bound).

    Uses 64-bit chained page hashes (a statistic only: a collision could
    only overstate the bound, never affect the cache's own hits).
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._seen: dict[str, set[int]] = {}
        rng = np.random.default_rng(12345)
        self._mult = rng.integers(1, 2**63, size=page_size, dtype=np.uint64) | np.uint64(1)

    def hits(self, tokens: np.ndarray, namespace: str, max_len: int) -> int:
        """Record ``tokens``; return the cached prefix length an unlimited cache gives."""
        p = self.page_size
        n = len(tokens) // p
        seen = self._seen.setdefault(namespace, set())
        if n == 0:
            return 0
        pages = tokens[:n * p].astype(np.uint64).reshape(n, p)
        with np.errstate(over="ignore"):
            ph = (pages * self._mult).sum(axis=1, dtype=np.uint64).tolist()
        out = []
        a = 0x12345
        for v in ph:
            a = (a * 0x100000001B3 + v + 0x9E3779B9) & 0xFFFFFFFFFFFFFFFF
            out.append(a)
        cap = max_len // p
        hit = 0
        for v in out[:cap]:
            if v not in seen:
                break
            hit += 1
        seen.update(out)
        return hit * p
