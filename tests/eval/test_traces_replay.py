import gzip
import json

import numpy as np
import pytest

from hybridkv import ModelSpec
from hybridkv.eval.cli import main
from hybridkv.eval.replay import replay
from hybridkv.eval.traces import PrefixBound, TokenMaterializer, TraceRequest, bundled_sample, load_trace


def test_bundled_sample_loads_with_attribution():
    reqs = load_trace(bundled_sample())
    assert len(reqs) == 2000 and reqs[0].block_size == 512
    assert all(len(r.blocks) == -(-r.input_length // 512) for r in reqs)
    assert "Apache-2.0" in (bundled_sample().parent / "README.md").read_text()


def test_materializer_is_deterministic_and_shares_prefixes():
    r1 = TraceRequest("default", 0, 1024, 0, (1, 2), 512)  # no partial block: no extension
    r2 = TraceRequest("default", 0, 1100, 0, (1, 3, 4), 512)
    a = TokenMaterializer().tokens(r1)
    b = TokenMaterializer().tokens(r1)
    assert a.dtype == np.int32 and len(a) == 1024 and np.array_equal(a, b)
    m = TokenMaterializer()
    t1, t2 = m.tokens(r1), m.tokens(r2)
    assert np.array_equal(t1[:512], t2[:512]) and not np.array_equal(t1[512:600], t2[512:600])


def test_extension_rule_extends_a_refilled_partial_block():
    first = TraceRequest("default", 0, 700, 0, (10, 11), 512)      # block 11 partial: 188 tokens
    later = TraceRequest("default", 1, 1500, 0, (10, 12, 13), 512)  # 12 is 11 refilled
    on = TokenMaterializer(extension_rule=True)
    a, b = on.tokens(first), on.tokens(later)
    assert np.array_equal(a, b[:700])
    off = TokenMaterializer(extension_rule=False)
    a, b = off.tokens(first), off.tokens(later)
    assert not np.array_equal(a[512:700], b[512:700])


def test_weka_session_partial_tail_has_synthetic_id(tmp_path):
    sess = {"id": "s", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 100, "out": 5, "hash_ids": [1]},
        {"t": 1.0, "type": "n", "in": 200, "out": 5, "hash_ids": [1, 2, 3]},
        {"t": 2.0, "type": "subagent", "requests": [{"t": 0.5, "type": "n", "in": 64, "out": 1, "hash_ids": [9]}]},
    ]}
    path = tmp_path / "trace_0001.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump(sess, fh)
    reqs = load_trace(path)
    assert [r.timestamp for r in reqs] == [0.0, 1.0, 2.5]
    m = TokenMaterializer()
    a, b = m.tokens(reqs[0]), m.tokens(reqs[1])
    assert len(a) == 100 and np.array_equal(a, b[:100])  # the id-less tail was extended


def test_prefix_bound():
    pb = PrefixBound(4)
    x = np.arange(20, dtype=np.int32)
    assert pb.hits(x, "a", 19) == 0
    assert pb.hits(x, "a", 19) == 16
    assert pb.hits(x, "b", 19) == 0
    assert pb.hits(np.concatenate([x[:9], [99] * 8]), "a", 16) == 8


def test_load_trace_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="neither"):
        load_trace(tmp_path / "x.json")


def test_replay_beats_baselines_on_the_sample():
    spec = ModelSpec.preset("mimo-v2.5-pro")
    reqs = load_trace(bundled_sample(), limit=600)
    out = replay(reqs, spec, int(594e9), check_every=200)
    s = out["systems"]
    assert s["hybridkv"]["token_hit_rate"] >= s["naive"]["token_hit_rate"]
    assert s["hybridkv"]["token_hit_rate"] >= s["tombstone"]["token_hit_rate"]
    assert 0 < s["hybridkv"]["token_hit_rate"] <= out["prefix_bound_hit_rate"]
    assert out["metadata_bytes_per_cached_token"] < 32


def test_replay_under_pressure_keeps_invariants():
    spec = ModelSpec.preset("mimo-v2.5-pro")
    reqs = load_trace(bundled_sample(), limit=300)
    out = replay(reqs, spec, int(20e9), check_every=25)
    assert out["systems"]["hybridkv"]["evicted_tokens"] > 0
    assert out["systems"]["hybridkv"]["hit_tokens"] > 0


def test_replay_blocks_keep_systems_independent_and_report_every_request():
    """Systems serve each block back to back (not request by request): each system's
    figures equal a replay of that system alone, and progress sees every request."""
    spec = ModelSpec.preset("mimo-v2.5-pro")
    reqs = load_trace(bundled_sample(), limit=150)  # blocks of 64: two whole, one partial
    seen = []
    both = replay(reqs, spec, int(20e9), systems=("hybridkv", "naive"), references=False,
                  progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i + 1, len(reqs)) for i in range(len(reqs))]
    for name in ("hybridkv", "naive"):
        alone = replay(reqs, spec, int(20e9), systems=(name,), references=False)
        for key in ("hit_tokens", "evicted_tokens", "rejected_requests"):
            assert both["systems"][name][key] == alone["systems"][name][key], (name, key)
    assert both["systems"]["hybridkv"]["evicted_tokens"] > 0  # the budget binds: order matters
    assert both["prefix_bound_hit_tokens"] > 0


def test_cli_replay_json(capsys):
    assert main(["replay", "--limit", "150", "--json", "--hbm-gb", "100"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("requests", "input_tokens", "hit_tokens", "token_hit_rate", "prefix_bound_hit_rate",
                "full_pool_tokens", "swa_pool_tokens", "evicted_tokens", "match_us_p50", "match_us_p99"):
        assert key in out
    assert set(out["baselines"]) == {"naive", "tombstone"}
    assert out["requests"] == 150 and out["extension_rule"] == "on"


def test_cli_replay_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib (the 'plot' extra) is not installed")
    png = tmp_path / "sweep.png"
    assert main(["replay", "--limit", "80", "--budgets", "20,200", "--plot", str(png), "--json"]) == 0
    assert png.stat().st_size > 1000
    assert len(json.loads(capsys.readouterr().out)["runs"]) == 2


def test_cli_errors(capsys):
    assert main(["replay", "--systems", "nope", "--limit", "5"]) == 2
    assert "unknown system" in capsys.readouterr().err
    assert main(["replay", "missing-file.jsonl"]) == 2
    with pytest.raises(SystemExit):
        main(["replay", "--model", "no-such-model"])


def test_cli_info(capsys):
    assert main(["info", "--model", "mimo-v2.5-pro", "--hbm-gb", "594", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token_full"] == 51200 and out["window_snapshot_in_full_tokens"] == 768
    assert out["concurrent_sequences"]["131072"]["dual_pool"] > 3 * out["concurrent_sequences"]["131072"]["single_pool"]


def test_weka_folder_replays(shared_traces):
    spec = ModelSpec.preset("mimo-v2.5-pro")
    files = sorted((shared_traces / "weka").glob("*.json.gz"))[:2]
    reqs = []
    for i, f in enumerate(files):
        reqs += load_trace(f)[:15]
    out = replay(reqs, spec, int(594e9), check_every=10)
    assert out["systems"]["hybridkv"]["token_hit_rate"] > 0.5
