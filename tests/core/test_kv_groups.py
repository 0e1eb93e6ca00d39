"""KV groups of a model: ModelSpec.groups, per-layer windows, HF configs with
per-layer windows, and the reference model / verify over a two-window model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.eval.model.reference import ReferenceModel, tiny_spec, tiny_two_window_spec
from hybridkv.eval.model.verify import run_verify
from hybridkv.spec import AttnKind, KVShape, ModelSpec, preset_names

_SIX = ["full_attention", "sliding_attention", "sliding_attention"] * 2


def _hf(**extra: object) -> dict:
    return {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, **extra}


@pytest.mark.parametrize("name", preset_names())
def test_preset_groups_cover_every_layer_once_and_sum_to_the_kinds_bytes(name: str) -> None:
    spec = ModelSpec.preset(name)
    groups = spec.groups
    assert sorted(i for g in groups for i in g.layers) == list(range(spec.num_layers))
    assert [g.name for g in groups] == ["full", f"swa-{spec.window}"]
    full, swa = groups
    assert full.layers == spec.full_layers and swa.layers == spec.swa_layers
    assert full.bytes_per_token(spec.dtype_bytes) == spec.bytes_per_token_full
    assert swa.bytes_per_token(spec.dtype_bytes) == spec.bytes_per_token_swa
    assert swa.window_pages(spec.page_size) == spec.window_pages and full.window_pages(spec.page_size) == 0
    assert spec.layer_windows == ()


def test_mimo_pro_is_one_full_and_one_sliding_group() -> None:
    spec = ModelSpec.preset("mimo-v2.5-pro")
    assert [(g.kind, g.window, len(g.layers)) for g in spec.groups] == [
        (AttnKind.FULL, None, 10), (AttnKind.SWA, 128, 60)]


def test_two_windows_make_three_groups_smallest_window_first() -> None:
    spec = tiny_two_window_spec()
    assert [(g.name, g.layers) for g in spec.groups] == [("full", (0, 3)), ("swa-8", (1, 4)), ("swa-16", (2, 5))]
    assert spec.window == 16
    assert [spec.layer_window(i) for i in range(6)] == [None, 8, 16, None, 8, 16]
    assert spec.fingerprint() != tiny_spec().fingerprint()


def test_uniform_layer_windows_are_the_plain_spec() -> None:
    plain = tiny_spec()
    same = ModelSpec(plain.name, plain.layer_kinds, 16, plain.full, plain.swa, dtype="float64",
                     page_size=4, layer_windows=(0, 16, 16, 0, 16, 16))
    assert same == plain and same.fingerprint() == plain.fingerprint()


@pytest.mark.parametrize("windows, window, exc, needle", [
    ((0, 8, 16), 16, ValueError, "entries"),
    ((0, 8, 16, 0, 8, 16), 32, ValueError, "largest"),
    ((0, 0, 16, 0, 8, 16), 16, ValueError, "layer_windows[1]"),
    ((0, True, 16, 0, 8, 16), 16, TypeError, "layer_windows[1]"),
    ("8,16", 16, TypeError, "layer_windows"),
])
def test_bad_layer_windows_name_the_argument(windows: object, window: int, exc: type, needle: str) -> None:
    kinds = ["full", "swa", "swa", "full", "swa", "swa"]
    with pytest.raises(exc, match=needle.replace("[", r"\[").replace("]", r"\]")):
        ModelSpec("x", kinds, window, KVShape(2, 8, 6), KVShape(4, 8, 6), layer_windows=windows)


def test_from_hf_config_per_layer_sliding_window_list() -> None:
    windows = [None, 512, 1024, None, 512, 1024]
    spec = ModelSpec.from_hf_config(_hf(layer_types=_SIX, sliding_window=windows), page_size=16)
    assert spec.full_layers == (0, 3) and spec.window == 1024
    assert [(g.name, g.layers) for g in spec.groups] == [("full", (0, 3)), ("swa-512", (1, 4)),
                                                          ("swa-1024", (2, 5))]
    # without layer_types, the list alone says which layers are full (None / 0)
    alone = ModelSpec.from_hf_config(_hf(sliding_window=[0, 512, 1024, 0, 512, 1024]), page_size=16)
    assert alone.layer_kinds == spec.layer_kinds and alone.groups == spec.groups


def test_from_hf_config_today_forms_still_give_one_window() -> None:
    spec = ModelSpec.from_hf_config(_hf(layer_types=_SIX, sliding_window=128))
    assert spec.layer_windows == () and [g.name for g in spec.groups] == ["full", "swa-128"]


@pytest.mark.parametrize("cfg, needle", [
    (_hf(layer_types=_SIX, sliding_window=[None, 512, 1024]), "entries"),
    (_hf(layer_types=_SIX, sliding_window=[None, 0, 1024, None, 512, 1024]), r"sliding_window'\]\[1\]"),
    (_hf(layer_types=_SIX, sliding_window=[None, "8", 1024, None, 512, 1024]), r"sliding_window'\]\[1\]"),
])
def test_from_hf_config_bad_window_lists(cfg: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ModelSpec.from_hf_config(cfg)


def test_reference_model_attends_each_layer_over_its_own_window() -> None:
    """Same weights (same seed and shapes), windows 8/16 vs 16/16: the logits of
    a prompt longer than 8 differ, those of a prompt shorter than 8 do not."""
    tokens = np.arange(40) % 17
    one = ReferenceModel(tiny_spec(), seed=3)
    two = ReferenceModel(tiny_two_window_spec(), seed=3)
    assert torch.equal(one.forward_dense(tokens[:8]), two.forward_dense(tokens[:8]))
    assert not torch.allclose(one.forward_dense(tokens), two.forward_dense(tokens))


def test_verify_on_a_two_window_model_has_no_mismatch() -> None:
    out = run_verify(requests=8, spec=tiny_two_window_spec())
    assert out["mismatched_requests"] == 0, out
    assert out["hit_tokens"] > 0 and out["evicted_swa_tokens"] > 0, out


def _two_window_config(tmp_path) -> str:  # noqa: ANN001
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_hf(model_type="two-window", head_dim=16, layer_types=_SIX,
                                   sliding_window=[None, 512, 1024, None, 512, 1024])))
    return str(path)


def test_scaled_spec_keeps_layer_kinds_and_window_ratios() -> None:
    from hybridkv.eval.model.reference import scaled_spec

    spec = ModelSpec.from_hf_config(_hf(layer_types=_SIX, sliding_window=[None, 512, 1024, None, 512, 1024]))
    tiny = scaled_spec(spec)
    assert tiny.layer_kinds == spec.layer_kinds and tiny.dtype == "float64"
    assert [g.name for g in tiny.groups] == ["full", "swa-8", "swa-16"]
    assert scaled_spec(ModelSpec.preset("gpt-oss-120b")).groups[1].window == 16
    with pytest.raises(TypeError, match="spec"):
        scaled_spec({"num_hidden_layers": 2})


def test_cli_verify_runs_the_users_config(tmp_path, capsys) -> None:  # noqa: ANN001
    from hybridkv.eval.cli import main

    rc = main(["verify", "--quick", "--no-progress", "--hf-config", _two_window_config(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "kv_groups: ['full', 'swa-8', 'swa-16']" in out and "PASS" in out


def test_cli_hf_config_errors_are_one_line_naming_the_option(tmp_path, capsys) -> None:  # noqa: ANN001
    from hybridkv.eval.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path in (str(tmp_path / "missing.json"), str(bad)):
        assert main(["info", "--hf-config", path]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hybridkv info: error: --hf-config ") and "\n" not in err, err
    assert main(["info", "--json", "--hf-config", _two_window_config(tmp_path)]) == 0
    assert '"swa-512"' in capsys.readouterr().out
