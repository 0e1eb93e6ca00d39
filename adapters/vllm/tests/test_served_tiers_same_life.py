"""One server life, as a multi-turn client sees it: conversations come back
after other prompts pushed their prefixes out of the device cache (hybridkv's
tree, ``--scheduler-cls``), and every later turn hits its whole earlier turn
from the connector's lower tiers in the same server life -- not only after a
restart: from L2 (the host tier this worker saved it to), or, with L2 off
(``l2_gb=0``), from the file L3 the same life wrote it to.

One server per case (~2 min here), 127.0.0.1 only, a port picked here, stopped
by the test.  Small KV memory (~2,400 tokens): each filler needs most of it,
so it evicts the conversations' earlier turns (the tree keeps conversations
that came back over one-shot prompts while there is room: a smaller filler
left them all on the device).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from bench_server import VOCAB, Server, complete, free_port, hkv_transfer_config, server_command
from test_served_scheduler import SCHEDULER, _by_source, _stop_report
from tiny_models import build

KV_BYTES = 24 << 20  # ~2,400 tokens of vLLM KV cache
# a hit ends on a multiple of the lcm of the groups' block sizes (64 full and 32 sliding)
HIT_UNIT = 64


@pytest.mark.parametrize("l2_gb, tier", [(0.25, "host"), (0.0, "disk")], ids=["l2", "l3-only"])
def test_later_turns_whose_prefix_left_l1_hit_in_a_lower_tier_in_the_same_life(
        tmp_path: Path, l2_gb: float, tier: str) -> None:
    model = build("mimo_v2", tmp_path / "mimo_v2", window=64)
    cfg = hkv_transfer_config(f"file:{tmp_path / 'l3'}", l2_gb=l2_gb)
    rnd = random.Random(11)
    words = lambda n: [rnd.randrange(4, VOCAB) for _ in range(n)]  # noqa: E731
    convs = [words(448), words(320), words(384)]  # three conversations, interleaved
    fillers = [words(1900) for _ in range(6)]  # two new ones after each round
    port = free_port()
    cmd = server_command(model, port, cfg, KV_BYTES, max_model_len=2048) + ["--scheduler-cls", SCHEDULER]
    s = Server(f"same-life-{tier}", cmd, port, tmp_path / "same-life.log")
    turns = []  # (conversation, cached tokens, tokens its earlier turn computed)
    try:
        s.start().wait_ready()
        before = _by_source(port)
        computed = [0] * len(convs)
        for turn in range(3):
            for c, prompt in enumerate(convs):
                out = complete(port, prompt, 40)  # its output ends past the prompt's last block
                turns.append((c, out["cached_tokens"], computed[c]))
                # the next turn: this prompt, its answer (all but the last token were
                # computed here) and a new user message
                computed[c] = len(prompt) + len(out["tokens"]) - 1
                convs[c] = prompt + out["tokens"] + words(40)
            for f in fillers[2 * turn:2 * turn + 2]:  # each needs most of the device: it pushes them out
                complete(port, f, 4)
        after = _by_source(port)
    finally:
        s.stop()
    got = {k: after[k] - before[k] for k in after}
    print("turns (conversation, cached, earlier turn computed):", turns, "by source:", got)
    for c, cached, earlier in turns:
        # a later turn hits up to the last hit unit inside what its earlier turn computed
        assert cached >= earlier // HIT_UNIT * HIT_UNIT, (c, cached, earlier, turns)
    assert got[tier] > 0, (f"the prefixes should have left the device and come back from {tier}", got)
    if tier == "disk":
        assert got["host"] == 0, got
    assert got["device"] + got["host"] + got["disk"] == sum(cached for _, cached, _ in turns), got
    assert got["external_unspecified"] == 0, got
    _stop_report(s.name, s.log_path)
