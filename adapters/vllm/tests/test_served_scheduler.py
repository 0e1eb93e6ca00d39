"""The served path with hybridkv's scheduler and connector together, as a user runs it
(``--scheduler-cls hybridkv_vllm.scheduler.HybridKVScheduler`` and HybridKVConnector
with an L2 and a file L3), over HTTP on tiny MiMo-V2:

1. ``first`` serves a few requests (a conversation, and a repeat of its first turn
   after ``/reset_prefix_cache``, so the repeat can only hit through the connector:
   L2) and is stopped with SIGTERM; ``second`` starts on the same L3 (its L2 empty),
   serves the first turn again (only L3 can hit it), resets, and again (L2).
2. Each stop leaves a clean log: both connector roles shut down, and no error,
   ``Traceback`` or ``EngineDeadError`` anywhere, before or after vLLM's ``[shutdown]
   MPClient: complete`` line -- except the one record of vLLM's own shutdown race
   (:data:`_VLLM_RACE`), which plain vLLM logs as well and hybridkv cannot prevent.
3. ``/metrics``: vLLM's ``prompt_tokens_cached_by_source`` counts the connector's
   hits as ``host`` (L2) and ``disk`` (a file L3), none as ``external_unspecified``,
   and they add up to hybridkv's own count of its hits.

Two servers one after the other (~1-2 min each here), 127.0.0.1 only, ports picked
here, each stopped by the test (SIGTERM, then SIGKILL to its process group).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import time
from pathlib import Path
from typing import Any

from bench_server import (
    VOCAB,
    Server,
    complete,
    free_port,
    hkv_transfer_config,
    http_get,
    server_command,
)
from tiny_models import build

SCHEDULER = "hybridkv_vllm.scheduler.HybridKVScheduler"
SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


def _reset_prefix_cache(port: int, tries: int = 60) -> None:
    """``POST /reset_prefix_cache`` until it succeeds (it fails while a finished
    request's blocks are still held for its save); at most ``tries`` times."""
    for _ in range(tries):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/reset_prefix_cache", "", {})
            r = conn.getresponse()
            body = r.read()
        finally:
            conn.close()
        assert r.status == 200, (r.status, body[:300])
        if json.loads(body).get("success"):
            return
        time.sleep(0.5)
    raise AssertionError(f"/reset_prefix_cache did not succeed in {tries} tries")


def _by_source(port: int) -> dict[str, float]:
    """``vllm:prompt_tokens_cached_by_source_total`` per ``source`` label."""
    status, text = http_get(port, "/metrics")
    assert status == 200, status
    out = dict.fromkeys(SOURCES, 0.0)
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_cached_by_source"):
            m = re.search(r'source="([a-z_0-9]+)"', line)
            if m and not line.startswith("vllm:prompt_tokens_cached_by_source_created"):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(line.rpartition(" ")[2])
    return out


def _metric(port: int, name: str) -> float:
    _, text = http_get(port, "/metrics")
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


# vLLM 0.32's own shutdown race (vllm-project/vllm#48745, open; fix proposed in #49000):
# the API server tears the engine client down on an executor thread, whose socket
# cleanup makes the output-queue task push an EngineDeadError before the same thread
# cancels the output handler; if the event loop runs the handler first, it logs that
# error with a traceback.  It happens in the API server process, where no hybridkv
# code runs at shutdown: seen here with the connector alone, and plain vLLM (no
# hybridkv) logs it at every stop once that thread lags 0.3 s.  Exactly that record
# is set aside.
_VLLM_RACE = re.compile(
    r"^\(APIServer pid=\d+\) ERROR [^\n]*\[async_llm\.py:\d+\] AsyncLLM output_handler failed\.\n"
    r"(?:\(APIServer pid=\d+\) ERROR [^\n]*\[async_llm\.py:\d+\] [^\n]*\n)*?"
    r"\(APIServer pid=\d+\) ERROR [^\n]*\[async_llm\.py:\d+\] "
    r"vllm\.v1\.engine\.exceptions\.EngineDeadError: EngineCore encountered an issue\. "
    r"See stack trace \(above\) for the root cause\.\n", re.MULTILINE)


def _stop_report(name: str, log_path: Path) -> bool:
    """Assert that a stopped server's log is clean: both connector roles shut down (their
    totals line), the API server got to its own end, and nothing logged an error
    or a traceback -- anywhere, and in particular after vLLM's ``[shutdown] MPClient:
    complete`` -- except vLLM's own shutdown race (:data:`_VLLM_RACE`, only after that
    line, only with its own traceback).  Returns whether that race showed."""
    log = log_path.read_text(errors="replace")
    mark = "[shutdown] MPClient: complete"
    assert mark in log, f"{name}: no {mark!r}:\n{log[-3000:]}"
    before, after = log.split(mark, 1)
    rest, raced = _VLLM_RACE.subn("", after)
    for what in ("hybridkv worker totals",
                 "hybridkv scheduler totals", "[shutdown] API server: shutting down FastAPI HTTP server"):
        assert what in log, f"{name}: no {what!r} in the log:\n{log[-4000:]}"
    for part in (before, rest):
        for bad in ("EngineDeadError", "Traceback", "output_handler failed", "EngineCore encountered a fatal error"):
            assert bad not in part, f"{name}: {bad!r} in the log:\n{part[-4000:]}"
        errors = re.findall(r"^.*\b(?:ERROR|CRITICAL)\b.*$", part, re.MULTILINE)
        assert not errors, f"{name}: {errors[:5]}"
        warned = re.findall(r"^.*WARNING [^\n]*\] hybridkv.*$", part, re.MULTILINE)  # hybridkv's own
        assert not warned, f"{name}: {warned[:5]}"
    return bool(raced)


def test_served_scheduler_stops_cleanly_and_reports_hit_sources(tmp_path: Path) -> None:
    model = build("mimo_v2", tmp_path / "mimo_v2", window=64)
    cfg = hkv_transfer_config(f"file:{tmp_path / 'l3'}", l2_gb=0.25)
    rnd = random.Random(7)
    first_turn = [rnd.randrange(4, VOCAB) for _ in range(400)]
    env_dev = {"VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache

    def server(name: str) -> Server:
        port = free_port()
        cmd = server_command(model, port, cfg, 64 << 20, max_model_len=1024) + ["--scheduler-cls", SCHEDULER]
        return Server(name, cmd, port, tmp_path / f"{name}.log")

    def repeat_through_connector(s: Server) -> dict[str, Any]:
        """The first turn once more, with vLLM's device cache (hybridkv's tree) emptied."""
        _reset_prefix_cache(s.port)
        return complete(s.port, first_turn, 4)

    old = {k: os.environ.get(k) for k in env_dev}
    os.environ.update(env_dev)
    try:
        first = server("first")
        try:
            first.start().wait_ready()
            a = complete(first.port, first_turn, 8)
            turn2 = first_turn + a["tokens"] + [rnd.randrange(4, VOCAB) for _ in range(40)]
            b = complete(first.port, turn2, 8)
            c = repeat_through_connector(first)  # L2 (this worker saved it)
            src1 = _by_source(first.port)
            hits1 = _metric(first.port, "vllm:hybridkv_hit_tokens_total")
        finally:
            first.stop()

        second = server("second")
        try:
            second.start().wait_ready()
            d = complete(second.port, first_turn, 4)  # only L3 has it
            e = repeat_through_connector(second)  # L2 now (the L3 read filled it)
            src2 = _by_source(second.port)
            hits2 = _metric(second.port, "vllm:hybridkv_hit_tokens_total")
            l2_pages = _metric(second.port, "vllm:hybridkv_load_pages_l2_total")
            l3_pages = _metric(second.port, "vllm:hybridkv_load_pages_l3_total")
        finally:
            second.stop()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    # --- the requests were served and hit where they should
    assert a["cached_tokens"] == 0 and b["cached_tokens"] >= 384, (a, b)
    assert c["cached_tokens"] >= 384 and d["cached_tokens"] >= 384 and e["cached_tokens"] >= 384, (c, d, e)
    assert a["tokens"][:4] == c["tokens"] == d["tokens"] == e["tokens"]

    # --- both stops are clean: hybridkv's processes exited gracefully, no error or traceback
    raced = [_stop_report(s.name, s.log_path) for s in (first, second)]
    print("vLLM's own shutdown race (vllm-project/vllm#48745) showed in", sum(raced), "of 2 stops")

    # --- the connector's hits are host (L2) and disk (file L3), never external_unspecified
    assert src1["external_unspecified"] == 0 and src2["external_unspecified"] == 0, (src1, src2)
    assert src1["host"] == c["cached_tokens"] and src1["disk"] == 0, (src1, c)
    assert src1["host"] + src1["disk"] == hits1, (src1, hits1)
    assert src2["disk"] == d["cached_tokens"] and src2["host"] == e["cached_tokens"], (src2, d, e)
    assert src2["host"] + src2["disk"] == hits2, (src2, hits2)
    assert l2_pages > 0 and l3_pages > 0, (l2_pages, l3_pages)  # the worker read where the metric says
