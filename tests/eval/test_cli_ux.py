"""A newcomer's first commands: one-line usage errors, quiet exits on a closed pipe,
true help text, progress only on a terminal, and a replay that says what it ran."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.eval.cli import main

ROOT = Path(__file__).resolve().parents[2]
LINE = '{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}\n'


def _cli(*args: str, stdout: int | None = subprocess.PIPE, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridkv", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=timeout, cwd=ROOT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, option", [
    (["replay", "--hbm-gb", "-1"], "--hbm-gb"),
    (["replay", "--limit", "0"], "--limit"),
    (["replay", "--budgets", "1,x"], "--budgets"),
    (["verify", "--requests", "0"], "--requests"),
    (["verify", "--l2-gb", "nan"], "--l2-gb"),
    (["info", "--hbm-gb", "-1"], "--hbm-gb"),
    (["info", "--page-size", "zero"], "--page-size"),
    (["route-sim", "--hbm-gb", "-1"], "--hbm-gb"),
    (["replay", "--model", "no-such-model"], "--model"),
])
def test_a_bad_option_value_is_one_line_with_a_help_hint(argv, option, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err  # no usage block before the error
    prog = f"hybridkv {argv[0]}"
    assert err.startswith(f"{prog}: error: {option}") and f"'{prog} --help'" in err, err
    assert "usage:" not in err


def test_hbm_gb_error_reads_as_a_sentence(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--hbm-gb", "-1"])
    assert capsys.readouterr().err.startswith("hybridkv replay: error: --hbm-gb must be > 0 (got -1);")


def _write_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI with a stdout whose reader is already gone: every write fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return _cli(*args, stdout=write_end)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [("info",), ("info", "--json"), ("--help",), ("replay", "--help")])
def test_closed_stdout_exits_quietly(args):
    res = _write_into_closed_pipe(*args)
    assert res.stderr == "", res.stderr  # no "[Errno 32] Broken pipe", no traceback
    # a command's output: 1, as after EPIPE; argparse's help printer swallows the error itself
    assert res.returncode == (0 if "--help" in args else 1)


def test_reader_that_stops_after_one_line_sees_no_error():
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    first = proc.stdout.readline()  # like `| head -1`
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    rc = proc.wait(timeout=60)
    assert first.startswith("mimo-v2.5-pro")
    assert err == "" and rc in (0, 1)  # 0 when everything fit in the pipe before the close


def test_verify_help_says_how_many_prompts_how_long_and_how_to_be_quick():
    out = _cli("verify", "--help").stdout
    assert "80 prompts" in out and "60" in out  # 60 trace requests + 20 branch prompts
    assert "about 30 s" in out and "--quick" in out


def test_verify_quick_runs_its_prompt_count_and_draws_no_progress_into_a_pipe(capsys):
    assert main(["verify", "--quick"]) == 0
    cap = capsys.readouterr()
    last = cap.out.strip().splitlines()[-1]
    assert last.startswith("PASS: 20 prompts (15 trace requests")
    assert "\r" not in cap.err and "verify [" not in cap.err  # stderr is not a terminal here


def test_replay_progress_only_on_a_terminal(capsys, monkeypatch):
    args = ["replay", "--limit", "5", "--systems", "hybridkv", "--no-references"]
    assert main(args) == 0
    assert "\r" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(args) == 0
    assert "\r" in capsys.readouterr().err


def test_replay_names_the_bundled_sample_and_its_count(capsys):
    assert main(["replay", "--limit", "12", "--systems", "hybridkv", "--no-references"]) == 0
    first = capsys.readouterr().out.splitlines()[:2]
    assert "bundled sample of the Mooncake conversation trace" in first[0]
    assert "first 2,000 requests" in first[0] and "12 replayed" in first[0]
    assert first[1].startswith("12 requests")
    assert main(["replay", "--limit", "12", "--systems", "hybridkv", "--no-references", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 12 and "bundled sample" in out["trace_name"]


def test_replay_names_a_given_trace_file(tmp_path, capsys):
    p = tmp_path / "mine.jsonl"
    p.write_text(LINE * 3)
    assert main(["replay", str(p), "--systems", "hybridkv", "--no-references"]) == 0
    first = capsys.readouterr().out.splitlines()
    assert first[0] == f"trace: {p}" and first[1].startswith("3 requests")


def test_unreachable_l3_is_one_line_and_the_run_goes_on(capsys):
    pytest.importorskip("redis", reason="the 'redis' extra is not installed (pip install 'hybridkv[redis]')")
    url = f"redis://127.0.0.1:{_free_port()}/0?socket_timeout=0.2&socket_connect_timeout=0.2&retries=0"
    args = ["replay", "--limit", "30", "--systems", "hybridkv", "--no-references", "--budgets", "5,6",
            "--l2-gb", "1", "--l3", url]
    assert main(args) == 0
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert len(lines) == 1, cap.err  # two budgets, two backends, many failed calls: one line
    assert lines[0].startswith(f"hybridkv replay: L3 {url} is unreachable (")
    assert lines[0].endswith("the run continues without it")
    assert "breaker" not in cap.err and "WARNING" not in cap.err
    assert cap.out.count("trace: ") == 2  # both budgets ran


_COMMANDS = ("replay", "verify", "info", "route-sim")


@pytest.mark.parametrize("command", ("",) + _COMMANDS)
def test_help_is_plain_text_not_rst(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"] if command else ["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for markup in ("``", ":class:", ":func:", ":doc:"):
        assert markup not in out, (command, markup)
    if not command:
        assert "'hybridkv COMMAND --help'" in out and all(c in out for c in _COMMANDS)


@pytest.mark.parametrize("argv", [["replay", "--bogus"], ["verify", "--quick", "--bogus"],
                                  ["info", "extra"], ["route-sim", "a", "b"]])
def test_an_unknown_argument_of_a_subcommand_points_to_its_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    prog = f"hybridkv {argv[0]}"
    assert err == f"{prog}: error: unrecognized arguments: {argv[-1]}; see '{prog} --help'\n", err


def test_an_unknown_top_level_option_still_points_to_the_top_level_help(capsys):
    with pytest.raises(SystemExit):
        main(["--bogus", "info"])
    assert capsys.readouterr().err == "hybridkv: error: unrecognized arguments: --bogus; see 'hybridkv --help'\n"


def test_replay_help_shows_the_checkpoint_and_chunk_defaults(capsys):
    from hybridkv.defaults import CHUNK, SWA_CHECKPOINT

    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"0 = off (default {SWA_CHECKPOINT})" in out
    assert f"prefill chunk size in tokens (default {CHUNK})" in out


def test_trace_help_names_every_format_the_loader_reads(capsys):
    from hybridkv.eval.traces import FORMATS

    for name in ("Mooncake", "Qwen-Bailian", "kv-cache-tester", ".jsonl", ".json.gz", "folder"):
        assert name in FORMATS
    for command in ("replay", "verify", "route-sim"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert FORMATS in " ".join(capsys.readouterr().out.split()), command


def test_a_qwen_bailian_trace_replays_with_its_block_size(tmp_path, capsys):
    """What the trace help promises: a Qwen-Bailian jsonl (16-token blocks, seconds,
    ``chat_id``) loads and replays."""
    rows = [{"chat_id": i, "parent_chat_id": -1, "timestamp": i * 0.5, "input_length": 40,
             "output_length": 4, "hash_ids": [1, 2, 3], "turn": 1, "type": "text"} for i in range(3)]
    p = tmp_path / "qwen_traceA_blksz_16.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["replay", str(p), "--systems", "hybridkv", "--no-references", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3 and out["trace_block_sizes"] == [16]
