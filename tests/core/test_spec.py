import pytest

from hybridkv import AttnKind, KVShape, ModelSpec, preset_names


def test_mimo_pro_bytes_match_the_design_budget():
    spec = ModelSpec.preset("mimo-v2.5-pro")
    assert (len(spec.full_layers), len(spec.swa_layers)) == (10, 60)
    assert spec.bytes_per_token_full == 10 * 8 * (192 + 128) * 2
    assert spec.bytes_per_token_swa == 60 * 8 * (192 + 128) * 2
    # DESIGN.md: 10 full layers x 2M tokens + 60 SWA layers x 1.6M tokens is ~594 GB
    total = 2_000_000 * spec.bytes_per_token_full + 1_600_000 * spec.bytes_per_token_swa
    assert abs(total / 1e9 - 594) < 1
    # a W-token SWA snapshot costs ~39 MB, the price of 768 full tokens
    assert spec.window * spec.bytes_per_token_swa / spec.bytes_per_token_full == 768


def test_flash_layout():
    spec = ModelSpec.preset("mimo-v2-flash")
    assert spec.full_layers == (0, 5, 11, 17, 23, 29, 35, 41, 47)
    assert spec.full == KVShape(4, 192, 128) and spec.swa == KVShape(8, 192, 128)
    assert spec.window == 128 and spec.num_layers == 48


def test_all_presets_load():
    for name in preset_names():
        spec = ModelSpec.preset(name, page_size=16)
        assert spec.page_size == 16 and spec.full_layers and spec.swa_layers


def test_from_hf_config_mimo_pattern():
    cfg = {"num_hidden_layers": 6, "hybrid_layer_pattern": [0, 1, 1, 1, 1, 0], "sliding_window": 128,
           "num_key_value_heads": 4, "swa_num_key_value_heads": 8, "head_dim": 192, "v_head_dim": 128,
           "num_attention_heads": 64, "hidden_size": 4096, "torch_dtype": "bfloat16", "model_type": "mimo_v2"}
    spec = ModelSpec.from_hf_config(cfg, page_size=32)
    assert spec.full_layers == (0, 5)
    assert spec.swa == KVShape(8, 192, 128) and spec.full == KVShape(4, 192, 128)
    assert spec.window == 128 and spec.page_size == 32 and spec.dtype == "bfloat16"


def test_from_hf_config_layer_types_and_gemma_text_config():
    oss = {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
           "sliding_window": 128, "num_key_value_heads": 8, "head_dim": 64, "num_attention_heads": 64,
           "hidden_size": 2880}
    assert ModelSpec.from_hf_config(oss).full_layers == (1, 3)
    gemma = {"text_config": {"num_hidden_layers": 12, "sliding_window_pattern": 6, "sliding_window": 1024,
                             "num_key_value_heads": 16, "head_dim": 128, "num_attention_heads": 32,
                             "hidden_size": 5376}, "torch_dtype": "bfloat16"}
    spec = ModelSpec.from_hf_config(gemma)
    assert spec.full_layers == (5, 11) and spec.window == 1024


@pytest.mark.parametrize("bad, exc", [
    (dict(name="unknown-model"), ValueError),
    (dict(name=3), TypeError),
])
def test_bad_preset(bad, exc):
    with pytest.raises(exc, match="preset"):
        ModelSpec.preset(**bad)


def test_bad_spec_fields_name_the_argument():
    with pytest.raises(ValueError, match="window"):
        ModelSpec("x", [AttnKind.FULL], 0, KVShape(1, 2, 2), KVShape(1, 2, 2))
    with pytest.raises(TypeError, match="page_size"):
        ModelSpec("x", ["swa"], 4, KVShape(1, 2, 2), KVShape(1, 2, 2), page_size=2.5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVShape(0, 2, 2)
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec("x", ["swa"], 4, KVShape(1, 2, 2), KVShape(1, 2, 2), dtype="int7")
    with pytest.raises(ValueError, match="layer_types"):
        ModelSpec.from_hf_config({"num_hidden_layers": 2, "layer_types": ["full_attention"],
                                  "num_attention_heads": 2, "hidden_size": 8})
