"""benchmarks/peers: each peer's own knob (vLLM prefix_cache_retention_interval,
SGLang swa_full_tokens_ratio) is parsed, swept with its default always in the
sweep, and every budget reports the peer at its default and at its best
(most hit tokens) setting, with hybridkv's ratio to both.  No peer venv is
needed: the end-to-end test stands a fake interpreter in for vLLM's."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS_DIR))

import common  # noqa: E402
import run  # noqa: E402


def test_parse_retention_accepts_none_and_integers():
    assert common.parse_retention("0, 4096,16384 ,None") == [0, 4096, 16384, None]
    assert common.format_retention([0, None, 64]) == "0,none,64"
    assert common.parse_retention(common.format_retention([None, 128])) == [None, 128]


@pytest.mark.parametrize("text", ["", ",", "-64", "4k", "0,0", "none,NONE"])
def test_parse_retention_rejects_bad_lists_naming_the_option(text):
    with pytest.raises(ValueError, match="--vllm-retention"):
        common.parse_retention(text)


def test_parse_ratios():
    assert common.parse_ratios("0.05,0.8,1") == [0.05, 0.8, 1.0]
    for bad in ("", "0", "-0.2", "x", "0.4,0.40", "inf", "nan"):
        with pytest.raises(ValueError, match="--sglang-ratios"):
            common.parse_ratios(bad)
    with pytest.raises(TypeError, match="--sglang-ratios"):
        common.parse_ratios(0.8)  # type: ignore[arg-type]


def test_default_mode_replays_only_the_peers_defaults():
    args = run.parse_args(["--peer-settings", "default"])
    assert args.settings == {"vllm": [0], "sglang": [0.8]}
    assert common.VLLM_RETENTION_DEFAULT == 0 and common.SGLANG_RATIO_DEFAULT == 0.8


def test_sweep_is_the_default_mode_and_always_holds_the_default_setting():
    args = run.parse_args([])
    assert args.peer_settings == "sweep"
    assert args.settings["vllm"] == [0, 4096, 16384, None]
    assert args.settings["sglang"] == [0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0]
    args = run.parse_args(["--vllm-retention", "none,16384", "--sglang-ratios", "0.2"])
    assert args.settings == {"vllm": [0, None, 16384], "sglang": [0.8, 0.2]}
    assert run.settings_args("vllm", args.settings["vllm"]) == ["--retention", "0,none,16384"]
    assert run.settings_args("sglang", args.settings["sglang"]) == ["--ratios", "0.8,0.2"]


@pytest.mark.parametrize("argv, option", [
    (["--peer-settings", "best"], "--peer-settings"),
    (["--vllm-retention", "12,x"], "--vllm-retention"),
    (["--sglang-ratios", "0"], "--sglang-ratios"),
    (["--systems", "vllm-9"], "--systems"),
    (["--max-sessions", "0"], "--max-sessions"),
    (["--budgets", "0"], "--budgets"),
])
def test_bad_arguments_exit_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(argv)
    assert e.value.code == 2
    assert option in capsys.readouterr().err


def _row(system: str, gb: float, hits: int, settings: dict[str, Any], default: bool) -> dict[str, Any]:
    return {"system": system, "budget_gb": gb, "hit_tokens": hits, "input_tokens": 1000,
            "token_hit_rate": hits / 1000, "settings": settings, "default": default,
            "op_us_p50": 10.0, "op_us_p99": 20.0}


def test_best_is_the_most_hit_tokens_ties_go_to_the_default_then_the_earlier():
    rows = [_row("hybridkv", 59, 300, {"swa_checkpoint": 16384}, True),
            _row("vllm-0.32", 59, 100, {"prefix_cache_retention_interval": 0}, True),
            _row("vllm-0.32", 59, 150, {"prefix_cache_retention_interval": None}, False),
            _row("vllm-0.32", 59, 150, {"prefix_cache_retention_interval": 4096}, False),
            _row("sglang-0.5.23", 59, 120, {"swa_full_tokens_ratio": 0.2}, False),
            _row("sglang-0.5.23", 59, 120, {"swa_full_tokens_ratio": 0.8}, True),
            _row("vllm-0.32", 594, 400, {"prefix_cache_retention_interval": 0}, True)]
    out = run.summarize({"results": rows, "meta": {}, "trace": "t"})
    best = {(r["system"], r["budget_gb"]): r["settings"] for r in rows if r.get("best")}
    assert best == {("vllm-0.32", 59): {"prefix_cache_retention_interval": None},
                    ("sglang-0.5.23", 59): {"swa_full_tokens_ratio": 0.8},
                    ("vllm-0.32", 594): {"prefix_cache_retention_interval": 0}}
    assert "best" not in rows[0]  # hybridkv is not a peer
    comp = {(c["budget_gb"], c["peer"]): c for c in out["comparison"]}
    v = comp[(59.0, "vllm-0.32")]
    assert v["hybridkv_vs_default"] == pytest.approx(3.0) and v["hybridkv_vs_best"] == pytest.approx(2.0)
    assert len(v["settings_swept"]) == 3
    s = comp[(59.0, "sglang-0.5.23")]
    assert s["hybridkv_vs_default"] == s["hybridkv_vs_best"] == pytest.approx(2.5)
    assert comp[(594.0, "vllm-0.32")]["hybridkv_vs_best"] is None  # no hybridkv row at 594
    md = run.comparison_table(out["comparison"])
    assert "| 59 | vllm-0.32 | retention 0 | 10.00% | retention none | 15.00% | 30.00% | 3.00x | 2.00x |" in md


FAKE_VLLM = '''#!{python}
"""Stands in for the vLLM venv's interpreter: answers drive_vllm.py's command
line with one result row per retention interval, more hits for larger ones."""
import json, sys
argv = sys.argv[1:]
assert argv[0].endswith("drive_vllm.py"), argv
budget = float(argv[argv.index("--budgets") + 1])
for item in argv[argv.index("--retention") + 1].split(","):
    ret = None if item == "none" else int(item)
    hits = 900 if ret is None else 100 + ret // 64
    row = {{"system": "vllm-0.32", "budget_gb": budget, "requests": 1, "input_tokens": 1000,
           "hit_tokens": hits, "token_hit_rate": hits / 1000, "prefill_tokens_saved": hits,
           "settings": {{"prefix_cache_retention_interval": ret}}, "default": ret == 0}}
    for k in ("op", "op_excl_kernel", "match", "alloc", "insert"):
        row[k + "_us_p50"] = row[k + "_us_p99"] = 1.0
    row.update(peak_metadata_mb=0.0, replay_s=0.0)
    print("RESULT " + json.dumps(row))
'''


def test_run_passes_the_sweep_to_the_driver_and_reports_default_and_best(tmp_path, capsys):
    fake = tmp_path / "python-vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    from hybridkv.eval.traces import bundled_sample

    argv = ["--trace", str(bundled_sample()), "--limit", "40", "--budgets", "5", "--json",
            "--systems", "hybridkv,vllm-0.32", "--python-vllm", str(fake), "--vllm-retention", "4096,none"]
    env_before = dict(os.environ)
    assert run.main(argv) == 0
    assert dict(os.environ) == env_before
    out = json.loads(capsys.readouterr().out)
    assert out["skipped"] == {}
    vllm = [r for r in out["results"] if r["system"] == "vllm-0.32"]
    assert [r["settings"]["prefix_cache_retention_interval"] for r in vllm] == [0, 4096, None]
    assert [r["default"] for r in vllm] == [True, False, False]
    assert [r["best"] for r in vllm] == [False, False, True]
    (c,) = out["comparison"]
    h = next(r for r in out["results"] if r["system"] == "hybridkv")
    assert c["default_hit_rate"] == pytest.approx(0.1) and c["best_hit_rate"] == pytest.approx(0.9)
    assert c["hybridkv_vs_default"] == pytest.approx(h["token_hit_rate"] / 0.1)
    assert c["hybridkv_vs_best"] == pytest.approx(h["token_hit_rate"] / 0.9)
    assert h["settings"] == {"swa_checkpoint": 16384}
    assert "hybridkv / best" in run.table(out)
