"""The CLI tells the user what is wrong."""

from __future__ import annotations

import json
import logging
import re
import socket
import sys

import pytest
import torch

import hybridkv
from hybridkv.eval.cli import _parser, main

torch.set_num_threads(1)
SAMPLE_LINE = '{"timestamp": 0, "input_length": 300, "output_length": 5, "hash_ids": [0, 1]}\n'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_empty_trace_and_limit_zero_exit_non_zero(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["replay", str(empty), "--systems", "hybridkv"]) == 2
    err = capsys.readouterr()
    assert "no requests" in err.err and "inf" not in err.out
    with pytest.raises(SystemExit) as exc:  # a usage error: argparse's exit status 2
        main(["replay", "--limit", "0"])
    assert exc.value.code == 2 and "--limit" in capsys.readouterr().err


def test_malformed_trace_is_one_line_not_a_traceback(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text(SAMPLE_LINE + '{"timestamp": 1, "input_length": 5}\n')
    assert main(["replay", str(p), "--systems", "hybridkv"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridkv replay: error:") and "t.jsonl:2" in err and "hash_ids" in err
    assert len(err.splitlines()) == 1


def test_mooncake_url_without_metadata_is_a_clear_error(capsys):
    assert main(["replay", "--limit", "3", "--systems", "hybridkv", "--l2-gb", "1",
                 "--l3", "mooncake://127.0.0.1:50051"]) == 2
    err = capsys.readouterr().err
    assert "metadata" in err and "Traceback" not in err


def test_unreachable_l3_ends_with_a_failure_summary(capsys):
    url = f"redis://127.0.0.1:{_free_port()}/0?socket_timeout=0.2&socket_connect_timeout=0.2&retries=0"
    pytest.importorskip("redis", reason="the 'redis' extra is not installed")
    args = ["replay", "--limit", "20", "--systems", "hybridkv", "--hbm-gb", "5", "--l2-gb", "1", "--l3", url]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "page reads" in out and "Connection" in out  # how many and why
    last = [ln for ln in out.splitlines() if ln.strip()][-1]
    assert "L3" in last and "failed" in last
    assert main(args + ["--strict"]) == 1


def test_file_l3_hits_from_older_data_are_reported_separately(tmp_path, capsys):
    url = f"file://{tmp_path / 'l3'}"
    args = ["replay", "--limit", "40", "--systems", "hybridkv", "--hbm-gb", "2", "--l2-gb", "2", "--l3", url,
            "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["l3_preexisting_hit_tokens"] == 0
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["l3_preexisting_hit_tokens"] > 0
    assert second["l3_preexisting_hit_tokens"] <= second["l3_hit_tokens"]
    assert main(args[:-1]) == 0
    text = capsys.readouterr().out
    assert "older than this run" in text


def test_version_and_log_level(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and hybridkv.__version__ in capsys.readouterr().out
    import hybridkv.eval.cli as cli
    seen = []
    info = cli._info
    monkeypatch.setattr(cli, "_info", lambda args: seen.append(
        logging.getLogger("hybridkv.tiers").getEffectiveLevel()) or info(args))
    before = logging.getLogger("hybridkv").getEffectiveLevel()
    for flags in (["-q"], ["--log-level", "debug"], ["-v"], ["-vv"], []):
        assert main(flags + ["info", "--json"]) == 0
    assert seen == [logging.ERROR, logging.DEBUG, logging.INFO, logging.DEBUG, logging.WARNING]
    assert logging.getLogger("hybridkv").getEffectiveLevel() == before  # restored after the command
    capsys.readouterr()


def test_text_output_has_per_tier_hits(tmp_path, capsys):
    assert main(["replay", "--limit", "30", "--systems", "hybridkv", "--hbm-gb", "2", "--l2-gb", "2",
                 "--l3", f"file://{tmp_path / 'l3'}"]) == 0
    out = capsys.readouterr().out
    assert "L1" in out and "L2" in out and "L3" in out and "tier hits" in out


def test_verify_shows_progress_and_ends_with_one_verdict_line(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # progress is drawn on a terminal only
    assert main(["verify", "--requests", "4"]) == 0
    cap = capsys.readouterr()
    lines = [ln for ln in cap.out.splitlines() if ln.strip()]
    assert lines[-1].startswith("PASS")
    assert sum(ln.startswith(("PASS", "FAIL")) for ln in lines) == 1
    assert "100%" in cap.err and re.search(r" (\d+)/\1 ", cap.err)  # progress on stderr, to the end


def test_plot_checks_matplotlib_first_and_says_where(tmp_path, capsys, monkeypatch):
    png = tmp_path / "p.png"
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "matplotlib", None)  # import fails like a missing package
        assert main(["replay", "--limit", "5", "--budgets", "20,200", "--plot", str(png), "--systems",
                     "hybridkv", "--no-references"]) == 2
    cap = capsys.readouterr()
    assert "matplotlib" in cap.err and cap.out == ""  # refused before the sweep ran
    pytest.importorskip("matplotlib", reason="the 'plot' extra is not installed")
    assert main(["replay", "--limit", "5", "--budgets", "20,200", "--plot", str(png), "--systems",
                 "hybridkv", "--no-references"]) == 0
    assert f"wrote {png}" in capsys.readouterr().out and png.exists()


def _actions(parser):
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):  # subparsers
            for name, sub in action.choices.items():
                yield from ((f"{name} {a}", h) for a, h in _actions(sub))
        elif action.dest != "help":
            yield "/".join(action.option_strings) or action.dest, action.help


def test_every_option_has_help_and_gb_is_named():
    missing = [name for name, h in _actions(_parser()) if not h]
    assert not missing, missing
    for name, h in _actions(_parser()):
        if "-gb" in name or "--budgets" in name:
            assert "10^9 bytes" in h, (name, h)


def test_every_option_that_takes_a_value_names_its_default():
    """``--help`` says what each option is when it is not given: either its help says
    "default" or the help formatter appends the value."""
    def help_strings(parser):
        fmt = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action.choices, dict):  # subparsers
                for name, sub in action.choices.items():
                    yield from ((f"{name} {n}", h) for n, h in help_strings(sub))
            elif action.option_strings and action.nargs != 0:
                yield "/".join(action.option_strings), fmt._expand_help(action)

    silent = [(name, h) for name, h in help_strings(_parser()) if "default" not in h]
    assert not silent, silent
