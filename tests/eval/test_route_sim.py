"""Route simulator and the ``hybridkv route-sim`` command."""

from __future__ import annotations

import json

import pytest
from _servers import RedisServer

from hybridkv import ModelSpec
from hybridkv.eval.cli import main
from hybridkv.eval.route_sim import SimConfig, run_policy, simulate
from hybridkv.eval.traces import bundled_sample, load_trace
from hybridkv.routing import RedisStreamBus

SPEC = ModelSpec.preset("mimo-v2.5-pro", page_size=64)
CFG = SimConfig(workers=3, budget_bytes=60 * 10**9, prefill_tps=12_000.0)


@pytest.fixture(scope="module")
def requests_400():
    return load_trace(bundled_sample(), limit=400)


def test_affinity_beats_blind_policies(requests_400) -> None:
    out = simulate(requests_400, SPEC, CFG)
    pol = out["policies"]
    assert set(pol) == {"round_robin", "least_loaded", "affinity"}
    for m in pol.values():
        assert m["requests"] == 400 and 0 <= m["hit_rate"] <= 1
        assert m["load_max_over_mean"] >= 1.0 and m["ttft_p90"] >= m["ttft_p50"] > 0
    assert pol["affinity"]["hit_rate"] > 1.2 * pol["round_robin"]["hit_rate"]
    assert pol["affinity"]["prefill_busy_s"] < pol["round_robin"]["prefill_busy_s"]
    assert pol["affinity"]["load_max_over_mean"] < 1.5
    # predictions come from the events; the worker's tree is the truth, and they mostly agree
    assert pol["affinity"]["prediction_exact_rate"] > 0.9
    assert pol["round_robin"]["requests_per_worker"] == [134, 133, 133]


def test_redis_bus_gives_the_same_run(requests_400, redis_server: RedisServer) -> None:
    reqs = requests_400[:150]
    mem = run_policy(reqs, SPEC, CFG, "affinity")
    bus = RedisStreamBus(redis_server.url, stream="hkv:sim")
    red = run_policy(reqs, SPEC, CFG, "affinity", bus=bus)
    for key in ("hit_rate", "ttft_p50", "ttft_p90", "requests_per_worker"):
        assert red[key] == mem[key], key
    assert red["publish_failures"] == 0 and red["index_counters"]["batches"] > 150


def test_fifo_vs_uncached_queue_and_config_errors(requests_400) -> None:
    hot = SimConfig(workers=2, budget_bytes=60 * 10**9, prefill_tps=8_000.0, time_scale=2.0)
    fifo = run_policy(requests_400[:200], SPEC, SimConfig(**{**hot.__dict__, "queue": "fifo"}), "least_loaded")
    srpt = run_policy(requests_400[:200], SPEC, hot, "least_loaded")
    assert srpt["ttft_p50"] < fifo["ttft_p50"]  # shortest-uncached-first helps the median under load
    with pytest.raises(ValueError, match="workers"):
        SimConfig(workers=0)
    with pytest.raises(ValueError, match="queue"):
        SimConfig(queue="lifo")
    with pytest.raises(ValueError, match="prefill_tps"):
        SimConfig(prefill_tps=0)
    with pytest.raises(ValueError, match="policy"):
        run_policy(requests_400[:5], SPEC, CFG, "random")


def test_cli_json_and_errors(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert main(["route-sim", "--limit", "120", "--workers", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for name in ("round_robin", "least_loaded", "affinity"):
        assert set(out["policies"][name]) >= {"hit_rate", "load_max_over_mean", "ttft_p50", "ttft_p90"}
    assert out["requests"] == 120 and out["extension_rule"] == "on"
    assert main(["route-sim", "--limit", "50", "--policies", "affinity,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["route-sim", "--limit", "60", "--policies", "round_robin,affinity"]) == 0
    text = capsys.readouterr().out
    assert "affinity vs round_robin" in text and "TTFT p90" in text
