"""Trace parsing tells the user what is wrong: a malformed
line names the file and line, a missing field is a one-line ValueError, and a
fuzzed file either parses or raises exactly that kind of error."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.eval.traces import TraceRequest, load_trace

GOOD = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1, 2]}


def test_malformed_line_names_file_and_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(GOOD) + "\n\n" + '{"timestamp": 1, "input_length": \n')
    with pytest.raises(ValueError) as exc:
        load_trace(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}:3: not valid JSON (") and "\n" not in msg
    assert "line 2" not in msg and "end of the line" in msg  # the file's line, not the parser's


@pytest.mark.parametrize("field", ["hash_ids", "input_length", "timestamp"])
def test_missing_field_is_a_one_line_error(tmp_path, field):
    rec = dict(GOOD)
    del rec[field]
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=f"t.jsonl:2: .*'{field}'") as exc:
        load_trace(p)
    assert "\n" not in str(exc.value)


def test_wrong_types_are_one_line_errors(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({**GOOD, "hash_ids": "abc"}) + "\n")
    with pytest.raises(ValueError, match="t.jsonl:1: .*hash_ids"):
        load_trace(p)
    p.write_text("[1, 2, 3]\n")
    with pytest.raises(ValueError, match="t.jsonl:1: .*object"):
        load_trace(p)


def test_session_request_without_in_is_an_error(tmp_path):
    p = tmp_path / "s.json.gz"
    with gzip.open(p, "wt") as fh:
        json.dump({"id": "s", "block_size": 64, "requests": [{"t": 0, "hash_ids": [1], "in": 50},
                                                              {"t": 1, "hash_ids": [1, 2]}]}, fh)
    with pytest.raises(ValueError, match=r"s.json.gz: request 2.*'in'"):
        load_trace(p)
    bad = tmp_path / "b.json"
    bad.write_text('{"requests": [')
    with pytest.raises(ValueError, match="b.json:1: not valid JSON"):
        load_trace(bad)


_value = st.recursive(st.none() | st.booleans() | st.integers(-5, 2**65) | st.floats(allow_nan=True)
                      | st.text(max_size=5), lambda c: st.lists(c, max_size=3) | st.dictionaries(
                          st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "x"]), c,
                          max_size=5), max_leaves=8)
_record = st.fixed_dictionaries({}, optional={"timestamp": _value | st.integers(0, 10**6),
                                              "input_length": _value | st.integers(0, 4096),
                                              "output_length": _value,
                                              "hash_ids": _value | st.lists(st.integers(0, 2**62), max_size=9)})
_line = st.one_of(_record.map(json.dumps), _value.map(json.dumps), st.text(max_size=30))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_line, max_size=6))
def test_fuzzed_mooncake_traces_parse_or_fail_cleanly(tmp_path, lines):
    p = tmp_path / "fuzz.jsonl"
    p.write_text("\n".join(lines), encoding="utf-8")
    try:
        reqs = load_trace(p)
    except ValueError as exc:
        msg = str(exc)
        assert msg.startswith(f"{p}:") and "\n" not in msg, msg
        return
    for r in reqs:
        assert isinstance(r, TraceRequest)
        assert r.input_length >= 0 and all(isinstance(b, int) for b in r.blocks)
