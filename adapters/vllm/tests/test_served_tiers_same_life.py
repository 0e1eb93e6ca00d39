"""One server life, as a multi-turn client sees it: a conversation's next turn
comes back after other prompts pushed its prefix out of the device cache
(hybridkv's tree, ``--scheduler-cls``), and its hit comes from the connector's
L2 (the host tier this worker saved it to) in the same server life -- not only
after a restart (L3).

One server (~1-2 min here), 127.0.0.1 only, a port picked here, stopped by the
test.  Small KV memory (~2,400 tokens): the fillers evict the first turn.
"""

from __future__ import annotations

import random
from pathlib import Path

from bench_server import VOCAB, Server, complete, free_port, hkv_transfer_config, server_command
from test_served_scheduler import SCHEDULER, _by_source, _stop_report
from tiny_models import build

KV_BYTES = 24 << 20  # ~2,400 tokens of vLLM KV cache


def test_a_turn_whose_prefix_left_l1_hits_in_l2_in_the_same_life(tmp_path: Path) -> None:
    model = build("mimo_v2", tmp_path / "mimo_v2", window=64)
    cfg = hkv_transfer_config(f"file:{tmp_path / 'l3'}", l2_gb=0.25)
    rnd = random.Random(11)
    first_turn = [rnd.randrange(4, VOCAB) for _ in range(448)]
    fillers = [[rnd.randrange(4, VOCAB) for _ in range(900)] for _ in range(12)]
    port = free_port()
    cmd = server_command(model, port, cfg, KV_BYTES, max_model_len=1024) + ["--scheduler-cls", SCHEDULER]
    s = Server("same-life", cmd, port, tmp_path / "same-life.log")
    try:
        s.start().wait_ready()
        a = complete(port, first_turn, 72)  # its output ends past the prompt's last block
        for f in fillers:  # unrelated prompts: together more than the device holds
            complete(port, f, 4)
        before = _by_source(port)
        turn2 = first_turn + a["tokens"] + [rnd.randrange(4, VOCAB) for _ in range(40)]
        b = complete(port, turn2, 8)
        after = _by_source(port)
    finally:
        s.stop()
    got = {k: after[k] - before[k] for k in after}
    print("turn 2:", b["cached_tokens"], "cached tokens, by source:", got)
    # turn 1 (448 prompt + 72 output tokens, 519 of them computed) is a prefix of
    # turn 2: it hits up to the last hit unit (64 tokens: the lcm of the groups'
    # block sizes, 64 full and 32 sliding) inside what turn 1 computed
    assert b["cached_tokens"] >= 512, (b["cached_tokens"], got)
    assert got["host"] > 0, ("the prefix should have left the device and come back from L2", got)
    assert got["device"] + got["host"] + got["disk"] == b["cached_tokens"], got
    assert got["external_unspecified"] == 0, got
    _stop_report(s.name, s.log_path)
