"""L3 throughput: hybridkv storage backends vs the raw clients, same bytes, same run.

Payload: one MiMo-V2.5-Pro page of the full-attention kind, 64 tokens x 51,200
bytes (10 full layers x 8 KV heads x (192 + 128) dims x bf16) = 3,276,800
bytes; a batch is ``--pages`` such pages (default 8, 26 MB).  For each backend
and each repeat the raw client and hybridkv move the same batch back to back
(alternating order), and the script reports medians (of 41 repeats by
default: on a small shared machine fewer repeats leave the medians noisy):

* ``file``: raw = ``open(path, "wb").write`` / ``open(path, "rb").readinto``
  (into caller buffers, as ``get_into`` reads; ``.read()`` would land in
  freshly recycled, cache-hot pages, which a reader that keeps its pages,
  like L2, never gets); hybridkv = framed, checksummed, temp file +
  ``os.replace``, LRU index.
* ``redis``: raw = redis-py ``MSET`` / ``MGET`` of the payloads; hybridkv =
  framed values through the same calls (hiredis parser when installed).
* ``mooncake``: raw = the faster of ``upsert_batch``/``get_batch`` (Python
  bytes) and ``batch_upsert_from``/``batch_get_into`` (registered buffers);
  hybridkv = ``put``/``get_into`` with pages in memory registered through
  ``register_buffer`` (one object per frame: staged header + page in place).
  The pool lives in a separate storage-node process, as in a deployed
  cluster; ``mooncake.local_segment`` repeats the pair with the pool inside
  the benchmark's own process (an in-process memcpy, against which the
  integrity pass over every byte weighs most).
* ``nixl``: raw = one NIXL POSIX WRITE/READ transfer per page file (DRAM <->
  file, registration per call); hybridkv = the same plus framing, temp file +
  rename, verification.

``l3_overhead_ratio`` = (hybridkv put + get median seconds) / (raw put + get
median seconds); target <= 1.25.  ``checksum_rates``: the checksums over one
batch in cache (NH64 on one thread and on all, xxh3_64, crc32; GB/s medians),
with the machine's ``cpu_count`` and 1-minute load average at the start.  Servers (redis-server, mooncake_master) are
started on 127.0.0.1 free ports and stopped at the end.

Usage: ``python benchmarks/tiers_l3.py --json [--pages 8] [--repeats 41]
[--backends file,redis,mooncake,nixl]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

PAGE_TOKENS = 64
BYTES_PER_TOKEN_FULL = 10 * 8 * (192 + 128) * 2  # MiMo-V2.5-Pro full layers, bf16
PAGE_BYTES = PAGE_TOKENS * BYTES_PER_TOKEN_FULL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Pair:
    """Medians of raw vs hybridkv timings for put and get."""

    def __init__(self) -> None:
        self.t: dict[str, list[float]] = {k: [] for k in ("raw_put", "raw_get", "hkv_put", "hkv_get")}

    def summary(self, nbytes: int) -> dict[str, Any]:
        med = {k: statistics.median(v) for k, v in self.t.items()}
        out: dict[str, Any] = {f"{k}_gbps": round(nbytes / s / 1e9, 3) for k, s in med.items()}
        out["put_ratio"] = round(med["hkv_put"] / med["raw_put"], 3)
        out["get_ratio"] = round(med["hkv_get"] / med["raw_get"], 3)
        out["l3_overhead_ratio"] = round((med["hkv_put"] + med["hkv_get"]) /
                                         (med["raw_put"] + med["raw_get"]), 3)
        out["median_s"] = {k: round(s, 5) for k, s in med.items()}
        return out


def _run_pair(pair: Pair, repeats: int, raw_put: Callable, raw_get: Callable,
              hkv_put: Callable, hkv_get: Callable) -> None:
    for fn in (raw_put, raw_get, hkv_put, hkv_get):  # warm-up (connections, page cache)
        fn()
    for r in range(repeats):
        order = (("raw", raw_put, raw_get), ("hkv", hkv_put, hkv_get))
        for tag, put, get in (order if r % 2 == 0 else order[::-1]):
            pair.t[f"{tag}_put"].append(_timed(put))
            pair.t[f"{tag}_get"].append(_timed(get))


def _check(ok: Any, what: str) -> None:
    if not ok:
        raise RuntimeError(f"benchmark self-check failed: {what}")


def bench_file(tmp: Path, keys: list[bytes], values: list[bytes], repeats: int) -> dict[str, Any]:
    from hybridkv.tiers.storage import open_backend
    raw_dir = tmp / "raw_file"
    raw_dir.mkdir()
    backend = open_backend(f"file://{tmp / 'hkv_file'}")
    bufs = [memoryview(bytearray(PAGE_BYTES)) for _ in keys]
    raw_bufs = [memoryview(bytearray(PAGE_BYTES)) for _ in keys]
    paths = [raw_dir / k.hex() for k in keys]

    def raw_put() -> None:
        for p, v in zip(paths, values):
            with open(p, "wb") as f:
                f.write(v)

    def raw_get() -> None:  # into caller buffers, like hybridkv's get_into()
        for p, b in zip(paths, raw_bufs):
            with open(p, "rb") as f:
                f.readinto(b)

    pair = Pair()
    _run_pair(pair, repeats, raw_put, raw_get, lambda: _check(all(backend.put(keys, values)), "file put"),
              lambda: _check(min(backend.get_into(keys, bufs)) == PAGE_BYTES, "file get_into"))
    _check(bytes(bufs[0]) == values[0] and bytes(raw_bufs[-1]) == values[-1], "file bytes")
    backend.close()
    return pair.summary(len(keys) * PAGE_BYTES)


def bench_redis(tmp: Path, keys: list[bytes], values: list[bytes], repeats: int) -> dict[str, Any]:
    import redis
    from hybridkv.tiers.storage import open_backend
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port)
        client = redis.Redis(port=port)
        backend = open_backend(f"redis://127.0.0.1:{port}/0", socket_timeout=30)
        raw_names = [b"raw:" + k.hex().encode() for k in keys]
        bufs = [memoryview(bytearray(PAGE_BYTES)) for _ in keys]
        mapping = dict(zip(raw_names, values))
        pair = Pair()
        _run_pair(pair, repeats, lambda: client.mset(mapping), lambda: client.mget(raw_names),
                  lambda: _check(all(backend.put(keys, values)), "redis put"),
                  lambda: _check(min(backend.get_into(keys, bufs)) == PAGE_BYTES, "redis get"))
        _check(bytes(bufs[-1]) == values[-1], "redis bytes")
        out = pair.summary(len(keys) * PAGE_BYTES)
        try:
            import hiredis  # noqa: F401
            out["parser"] = "hiredis"
        except ImportError:
            out["parser"] = "python"
        backend.close()
        client.close()
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=10)


_STORAGE_NODE = """
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", sys.argv[1], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[2])
print("ready" if rc == 0 else f"setup failed: {rc}", flush=True)
sys.stdin.read()  # serve the segment until the benchmark closes our stdin
store.close()
"""


def _mooncake_pair(store: Any, backend: Any, keys: list[bytes], values: list[bytes],
                   repeats: int, tag: str) -> dict[str, Any]:
    """Raw client vs hybridkv on one store client; raw = the faster raw API per op."""
    n = len(keys)
    raw_names = [f"raw{tag}:" + k.hex() for k in keys]
    src = np.frombuffer(b"".join(values), dtype=np.uint8).copy()
    dst = np.empty_like(src)
    arena = np.empty(n * PAGE_BYTES, dtype=np.uint8)
    # As the tier manager would: L2 host memory registered once, pages sent and
    # received in place; the raw registered API gets the same registrations.
    for buf in (src, dst, arena):
        _check(backend.register_buffer(buf), "register_buffer")
    ptrs_src = [int(src.ctypes.data) + i * PAGE_BYTES for i in range(n)]
    ptrs_dst = [int(dst.ctypes.data) + i * PAGE_BYTES for i in range(n)]
    sizes = [PAGE_BYTES] * n
    bufs = [memoryview(arena[i * PAGE_BYTES:(i + 1) * PAGE_BYTES]) for i in range(n)]
    pages = [memoryview(src[i * PAGE_BYTES:(i + 1) * PAGE_BYTES]) for i in range(n)]
    hkv_put = lambda: _check(all(backend.put(keys, pages)), "mooncake put")  # noqa: E731
    hkv_get = lambda: _check(min(backend.get_into(keys, bufs)) == PAGE_BYTES, "mooncake get")  # noqa: E731
    bytes_pair, reg_pair, hkv_pair = Pair(), Pair(), Pair()
    _run_pair(bytes_pair, repeats, lambda: _check(store.upsert_batch(raw_names, values) == 0, "raw put"),
              lambda: store.get_batch(raw_names), hkv_put, hkv_get)
    _run_pair(reg_pair, repeats,
              lambda: _check(store.batch_upsert_from(raw_names, ptrs_src, sizes) == [0] * n, "raw put"),
              lambda: _check(store.batch_get_into(raw_names, ptrs_dst, sizes) == sizes, "raw get"),
              hkv_put, hkv_get)
    _check(bytes(bufs[0]) == values[0] and bytes(bufs[-1]) == values[-1], "mooncake bytes")
    _check(dst.tobytes() == src.tobytes(), "mooncake raw bytes")
    # hybridkv timings from both runs; raw = the faster raw API per operation
    for k in ("hkv_put", "hkv_get"):
        hkv_pair.t[k] = bytes_pair.t[k] + reg_pair.t[k]
    for k in ("raw_put", "raw_get"):
        hkv_pair.t[k] = min((bytes_pair.t[k], reg_pair.t[k]), key=statistics.median)
    out = hkv_pair.summary(n * PAGE_BYTES)
    out["raw_bytes_api"] = {k: v for k, v in bytes_pair.summary(n * PAGE_BYTES).items()
                            if k.startswith("raw")}
    out["raw_registered_api"] = {k: v for k, v in reg_pair.summary(n * PAGE_BYTES).items()
                                 if k.startswith("raw")}
    for buf in (src, dst, arena):
        backend.unregister_buffer(buf)
    return out


def bench_mooncake(tmp: Path, keys: list[bytes], values: list[bytes], repeats: int) -> dict[str, Any]:
    """Two layouts, both reported; the storage-node one gives ``l3_overhead_ratio``.

    * storage node (a Mooncake cluster as deployed): the memory pool belongs to
      another process (started here, the way a store server contributes its
      segment); the benchmark's client contributes none, so every byte goes
      through the transfer engine (tcp here).
    * ``local_segment``: the client's own process holds the pool, so the
      "transfer" is an in-process memcpy and the integrity pass (one read of
      every byte on put and on get) is compared with a bare memcpy; reported
      as a second figure, not hidden.
    """
    from mooncake.store import MooncakeDistributedStore
    from hybridkv.tiers.storage import open_backend
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    log = open(tmp / "mooncake_master.log", "wb")
    proc = subprocess.Popen([binary, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                             f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1",
                             f"--metrics_port={metrics}"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    node = None
    try:
        _wait_port(rpc)
        _wait_port(http)
        metadata = f"http://127.0.0.1:{http}/metadata"
        url = f"mooncake://127.0.0.1:{rpc}?metadata={metadata}"
        seg = 512 << 20

        def pair(tag: str, own_segment: int) -> dict[str, Any]:
            store = MooncakeDistributedStore()
            _check(store.setup("127.0.0.1", metadata, own_segment, 128 << 20, "tcp", "",
                               f"127.0.0.1:{rpc}") == 0, "mooncake setup")
            backend = open_backend(url, store=store, key_prefix=f"hkv{tag}:",
                                   staging_bytes=len(keys) * 64)
            try:
                return _mooncake_pair(store, backend, keys, values, repeats, tag)
            finally:
                backend.close()
                store.close()  # unmounts its segment

        # First the pool in this process alone, then a storage node alone
        # (with both mounted the master would spread objects over the two).
        results = {"local": pair("local", seg)}
        node = subprocess.Popen([sys.executable, "-c", _STORAGE_NODE, metadata, f"127.0.0.1:{rpc}", str(seg)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=tmp)
        _check(node.stdout.readline().strip() == b"ready", "mooncake storage node")
        results["node"] = pair("node", 0)
        out = results["node"]
        out["layout"] = "pool in a storage-node process; this client contributes no segment (tcp transfers)"
        out["local_segment"] = results["local"]
        return out
    finally:
        if node is not None:
            node.stdin.close()
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.kill()
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def bench_nixl(tmp: Path, keys: list[bytes], values: list[bytes], repeats: int) -> dict[str, Any]:
    from nixl._api import nixl_agent, nixl_agent_config
    from hybridkv.tiers.storage import open_backend
    agent = nixl_agent("raw-bench", nixl_agent_config(backends=["POSIX"]))
    raw_dir = tmp / "raw_nixl"
    raw_dir.mkdir()
    paths = [str(raw_dir / k.hex()) for k in keys]
    src = [np.frombuffer(v, dtype=np.uint8) for v in values]
    dst = [np.empty(PAGE_BYTES, dtype=np.uint8) for _ in keys]

    def xfer(op: str, arr: np.ndarray, path: str, flags: int) -> None:
        fd = os.open(path, flags, 0o644)
        try:
            d = agent.register_memory([(int(arr.ctypes.data), arr.nbytes, 0, "")], "DRAM")
            f = agent.register_memory([(0, arr.nbytes, fd, "")], "FILE")
            h = agent.initialize_xfer(op, agent.get_xfer_descs([(int(arr.ctypes.data), arr.nbytes, 0)], "DRAM"),
                                      agent.get_xfer_descs([(0, arr.nbytes, fd)], "FILE"), "raw-bench")
            state = agent.transfer(h)
            while state != "DONE":
                state = agent.check_xfer_state(h)
                _check(state != "ERR", "nixl raw transfer")
            agent.release_xfer_handle(h)
            agent.deregister_memory(f)
            agent.deregister_memory(d)
        finally:
            os.close(fd)

    def raw_put() -> None:
        for a, p in zip(src, paths):
            xfer("WRITE", a, p, os.O_RDWR | os.O_CREAT | os.O_TRUNC)

    def raw_get() -> None:
        for a, p in zip(dst, paths):
            xfer("READ", a, p, os.O_RDONLY)

    backend = open_backend(f"nixl+posix://{tmp / 'hkv_nixl'}")
    bufs = [memoryview(bytearray(PAGE_BYTES)) for _ in keys]
    pair = Pair()
    _run_pair(pair, repeats, raw_put, raw_get, lambda: _check(all(backend.put(keys, values)), "nixl put"),
              lambda: _check(min(backend.get_into(keys, bufs)) == PAGE_BYTES, "nixl get"))
    _check(bytes(bufs[0]) == values[0] and dst[0].tobytes() == values[0], "nixl bytes")
    backend.close()
    return pair.summary(len(keys) * PAGE_BYTES)


def bench_checksums(values: list[bytes], repeats: int) -> dict[str, Any]:
    """Checksum rates over one batch (GB/s, medians): what every put and get pays once.

    ``nh64_1_thread`` / ``nh64_all_threads`` through the C host kernel (GIL
    released), ``xxh3_64`` (one core, GIL held) when ``xxhash`` is installed,
    ``crc32``.  The batch is hashed once untimed first, so the figures are for
    pages in cache, as after a copy; a read from DRAM is slower.
    """
    from hybridkv.tiers.storage import framing
    views = [memoryview(v) for v in values]
    nbytes = sum(len(v) for v in values)
    fns: dict[str, Callable[[], Any]] = {}
    kernel = framing.nh64_kernel()
    if kernel is not None:
        fns["nh64_1_thread"] = lambda: kernel.nh64(views, num_threads=1)
        fns["nh64_all_threads"] = lambda: kernel.nh64(views, num_threads=os.cpu_count() or 1)
    if framing.DEFAULT_ALGO == framing.ALGO_XXH3:
        fns["xxh3_64"] = lambda: framing.checksums(views, framing.ALGO_XXH3)
    fns["crc32"] = lambda: framing.checksums(views, framing.ALGO_CRC32)
    t: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t[k].append(_timed(fn))
    return {f"{k}_gbps": round(nbytes / statistics.median(v) / 1e9, 2) for k, v in t.items()}


BENCHES = {"file": bench_file, "redis": bench_redis, "mooncake": bench_mooncake, "nixl": bench_nixl}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: also)")
    ap.add_argument("--pages", type=int, default=8, help="pages per batch (default 8)")
    ap.add_argument("--repeats", type=int, default=41, help="timed repeats per backend (default 41)")
    ap.add_argument("--backends", default=",".join(BENCHES), help="comma-separated subset")
    args = ap.parse_args(argv)
    if args.pages < 1 or args.repeats < 1:
        ap.error("--pages and --repeats must be >= 1")
    names = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        ap.error(f"unknown backends {unknown}; choose from {sorted(BENCHES)}")
    from hybridkv.tiers.storage import framing
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8).tobytes() for _ in range(args.pages)]
    keys = [i.to_bytes(16, "little") for i in range(args.pages)]
    result: dict[str, Any] = {
        "payload_bytes": PAGE_BYTES, "payload": "MiMo-V2.5-Pro full-kind page: 64 tokens x 51200 B (bf16)",
        "pages_per_batch": args.pages, "repeats": args.repeats,
        "checksum": framing.ALGO_NAMES[framing.preferred_algo()],
        "target_ratio": 1.25, "backends": {}}
    t0 = time.perf_counter()
    result["checksum_rates"] = bench_checksums(values, args.repeats)
    result["cpu_count"] = os.cpu_count()
    result["loadavg_1min_start"] = round(os.getloadavg()[0], 2)
    # Client libraries (NIXL) log to stdout: keep stdout for the one JSON object.
    with tempfile.TemporaryDirectory(prefix="hkv-l3-bench-") as tmp, \
            contextlib.redirect_stdout(sys.stderr):
        for name in names:
            workdir = Path(tmp) / name
            workdir.mkdir()
            try:
                result["backends"][name] = BENCHES[name](workdir, keys, values, args.repeats)
            except ImportError as exc:
                result["backends"][name] = {"skipped": f"client not installed: {exc}"}
    result["l3_overhead_ratio"] = {n: r.get("l3_overhead_ratio") for n, r in result["backends"].items()}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
