"""benchmarks/engine_outputs.py on the first 2,000 requests of the shared
conversation trace: with each request's output cached behind its prompt and
the next turn leaving at the previous prompt's end, the learned prompt-end
windows must beat the same cache with the divergence model held off."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.mark.skipif(not TRACE.exists(), reason="needs ../shared/traces beside the checkout")
def test_learned_prompt_end_windows_beat_the_model_held_off(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import engine_outputs
    finally:
        sys.path.pop(0)
    assert engine_outputs.main(["--trace", str(TRACE), "--limit", "2000", "--budgets", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (run,) = out["runs"]
    learned, off = run["learned"], run["held_off"]
    assert learned["decisions"] >= 1 and learned["pretail_pages"] >= 0
    assert off["decisions"] == 0 and off["pretail_pages"] == -1
    assert learned["token_hit_rate"] > 1.05 * off["token_hit_rate"], run
