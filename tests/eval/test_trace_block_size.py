"""Block size of jsonl traces: Mooncake's hash ids cover 512 tokens, the
Qwen-Bailian traces' (``qwen_*_blksz_16.jsonl``, the same schema plus
``chat_id``/``parent_chat_id``/``turn``/``type``) 16.  Read with the wrong size,
two prompts that share one 16-token block would share 512 tokens, so the loader
takes the size from the data (or the file name, or the caller) and the replay
reports it."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from hybridkv.eval.cli import main
from hybridkv.eval.traces import TokenMaterializer, bundled_sample, jsonl_block_size, load_trace


def _qwen_rows(n_chats: int = 40, seed: int = 0) -> list[dict]:
    """Chats in the Qwen-Bailian schema: a 20-block system prompt, first turns of
    varied length, and next turns that extend a turn (its partial last block refilled
    under a new id), 16 tokens per id."""
    rng = np.random.default_rng(seed)
    ids = iter(range(10**6))
    system = [next(ids) for _ in range(20)]
    rows: list[dict] = []
    for chat in range(n_chats):
        if rows and rng.random() < 0.5:
            parent = rows[int(rng.integers(len(rows)))]
            n = parent["input_length"] + int(rng.integers(17, 300))
            kept = parent["hash_ids"][:parent["input_length"] // 16]
            hid = kept + [next(ids) for _ in range(-(-n // 16) - len(kept))]
            pid, turn = parent["chat_id"], parent["turn"] + 1
        else:
            n = 320 + int(rng.integers(1, 900))
            hid = system + [next(ids) for _ in range(-(-n // 16) - 20)]
            pid, turn = -1, 1
        rows.append({"chat_id": chat, "parent_chat_id": pid, "timestamp": round(0.5 * chat, 3),
                     "input_length": n, "output_length": 40, "type": "text", "turn": turn, "hash_ids": hid})
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_qwen_trace_is_read_with_16_token_blocks_and_seconds(tmp_path):
    reqs = load_trace(_write(tmp_path / "trace.jsonl", _qwen_rows()))  # no hint in the name
    assert {r.block_size for r in reqs} == {16}
    assert reqs[3].timestamp == pytest.approx(1.5)  # Qwen timestamps are seconds, Mooncake's ms
    mat = TokenMaterializer()
    toks = [mat.tokens(r) for r in reqs]
    a, b = reqs[0], next(r for r in reqs[1:] if r.blocks[20] != reqs[0].blocks[20])
    ta, tb = toks[0], toks[reqs.index(b)]
    assert a.blocks[:20] == b.blocks[:20]
    assert np.array_equal(ta[:320], tb[:320]) and ta[320] != tb[320]  # they part after 20 blocks of 16


def test_mooncake_traces_keep_512(shared_traces):
    assert {r.block_size for r in load_trace(bundled_sample())} == {512}
    assert {r.block_size for r in load_trace(shared_traces / "mooncake_conversation_trace.jsonl",
                                             limit=50)} == {512}


def test_block_size_from_the_data_the_name_or_mooncake():
    assert jsonl_block_size([(1188, 75), (700, 44), (33, 3)])[0] == 16
    assert jsonl_block_size([(6758, 14), (2290, 5)])[0] == 512
    # few records fit a range: the file name decides, then 512, then the largest power of two
    assert jsonl_block_size([(20, 2)]) == (16, 10, 19)
    assert jsonl_block_size([(20, 2)], "qwen_x_blksz_12.jsonl")[0] == 12
    assert jsonl_block_size([(20, 2)], "x_blksz_64.jsonl")[0] == 16  # a hint the records contradict
    assert jsonl_block_size([(600, 2)])[0] == 512
    _, lo, hi = jsonl_block_size([(20, 2), (20, 1)])
    assert lo > hi  # no one size fits


def test_given_block_size_is_checked(tmp_path):
    p = _write(tmp_path / "qwen.jsonl", _qwen_rows(10))
    assert {r.block_size for r in load_trace(p, block_size=16)} == {16}
    with pytest.raises(ValueError, match=r"qwen.jsonl:1: input_length \d+ with \d+ hash_ids does not fit "
                                         r"the given block_size 512"):
        load_trace(p, block_size=512)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        load_trace(p, block_size=0)
    with pytest.raises(TypeError, match="block_size"):
        load_trace(p, block_size="16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size applies to jsonl"):
        load_trace(_write(tmp_path / "s.json", [{"id": "s", "block_size": 64,
                                                "requests": [{"t": 0, "hash_ids": [1], "in": 64}]}]),
                   block_size=64)


def test_records_no_size_fits_fall_back_to_512_with_a_warning(tmp_path, caplog):
    p = _write(tmp_path / "odd.jsonl", [{"timestamp": 0, "input_length": 20, "hash_ids": [1, 2]},
                                        {"timestamp": 1, "input_length": 20, "hash_ids": [3]}])
    with caplog.at_level(logging.WARNING, logger="hybridkv.eval.traces"):
        reqs = load_trace(p)
    assert {r.block_size for r in reqs} == {512}
    assert "odd.jsonl:1: input_length 20 with 2 hash_ids" in caplog.text


def test_replay_of_a_qwen_trace_reports_its_block_size(tmp_path, capsys):
    p = _write(tmp_path / "qwen_t_blksz_16.jsonl", _qwen_rows(60, seed=1))
    assert main(["replay", str(p), "--hbm-gb", "500", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace_block_sizes"] == [16]
    # an unlimited budget: every system hits the page-level bound, which the shared
    # 320-token system prompt and the extended turns make large
    assert out["prefix_bound_hit_rate"] > 0.3
    assert out["token_hit_rate"] == pytest.approx(out["prefix_bound_hit_rate"])
    assert main(["replay", str(p), "--hbm-gb", "500", "--json", "--no-progress", "--block-size", "512"]) == 2
    assert "does not fit the given block_size 512" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # a usage error, refused by the parser
        main(["replay", str(p), "--block-size", "0", "--no-progress"])
    assert exc.value.code == 2 and "--block-size must be >= 1" in capsys.readouterr().err
