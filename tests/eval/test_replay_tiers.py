"""The tiers under the harness: replay reports hits per tier, a replay survives a
redis-server killed and restarted under it, and verify through L2 and L3 finds
no logit off the dense forward (the tiers' own units are in ``tests/tiers``)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from hybridkv.eval.cli import main
from hybridkv.eval.replay import replay
from hybridkv.eval.traces import bundled_sample, load_trace
from hybridkv.spec import ModelSpec
from hybridkv.tiers.tiered import TierConfig

GB = 10**9
SPEC = ModelSpec.preset("mimo-v2.5-pro")


def test_replay_reports_hits_per_tier(tmp_path, capsys):
    url = f"file://{tmp_path / 'l3'}"
    assert main(["replay", "--limit", "300", "--hbm-gb", "20", "--l2-gb", "300", "--l3", url,
                 "--systems", "hybridkv", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["l1_hit_tokens"] + out["l2_hit_tokens"] + out["l3_hit_tokens"] == out["hit_tokens"]
    assert out["l2_hit_tokens"] > 0 and out["tier_errors"] == 0
    assert out["bytes_moved"] > 0 and out["l3_backend"]["puts"] > 0
    assert main(["replay", "--limit", "5", "--l3", url, "--systems", "hybridkv"]) == 2  # --l3 needs --l2-gb


def test_replay_survives_redis_kill_and_restart(redis_server):
    """Kill redis-server (SIGKILL) a third into the replay, restart it two thirds in."""
    reqs = load_trace(bundled_sample(), limit=90)
    url = redis_server.url + "?breaker_cooldown_s=0.2&socket_timeout=0.5&socket_connect_timeout=0.5"
    seen: dict[str, Any] = {}

    def progress(done: int, total: int) -> None:
        if done == 30:
            redis_server.kill()
        elif done == 60:
            redis_server.start()

    t0 = time.monotonic()
    tiers = TierConfig(l2_bytes=4 * GB, l3=url, l3_timeout_s=5.0)
    out = replay(reqs, SPEC, 2 * GB, systems=["hybridkv"], progress=progress, tiers=tiers, check_every=30)
    assert time.monotonic() - t0 < 90
    res = out["systems"]["hybridkv"]
    seen.update(res["l3_backend"])
    assert res["tier_errors"] == 0
    assert seen["errors"] + seen["skipped"] + seen["timeouts"] > 0  # the crash was noticed
    assert seen["puts"] > 0 and seen["corrupt"] == 0                 # and writes resumed after it
    assert res["l1_hit_tokens"] + res["l2_hit_tokens"] + res["l3_hit_tokens"] == res["hit_tokens"]


@pytest.mark.parametrize("policy, l2_eviction", [("write_through", "own"), ("write_back", "own"),
                                                 ("write_through", "tree")])
def test_verify_through_l2_and_l3_has_no_mismatch(tmp_path, policy, l2_eviction):
    from hybridkv.eval.tier_verify import run_tier_verify
    out = run_tier_verify(requests=10, l3=f"file://{tmp_path / 'l3'}", write_policy=policy,
                          l1_flush_every=2, l2_flush_every=4, l2_eviction=l2_eviction)
    assert out["mismatched_requests"] == 0 and out["tier_errors"] == 0
    assert out["l2_hit_tokens"] > 0 and out["l1_flushes"] > 0 and out["l2_flushes"] > 0
    assert out["l3_hit_tokens"] > 0 and out["l3_backend_corrupt"] == 0  # both policies reach L3
