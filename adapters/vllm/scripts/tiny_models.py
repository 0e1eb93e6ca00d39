"""Tiny random-weight hybrid-SWA checkpoints with a locally built tokenizer.

No hub access: configs are written by hand, weights are random (seeded) and
saved as safetensors, the tokenizer is a WordLevel model over ``w0..wN``
built with the ``tokenizers`` library.

    python scripts/tiny_models.py gemma2 OUT_DIR
    python scripts/tiny_models.py mimo_v2 OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

VOCAB = 512
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Chat-template role markers: the top ids of the vocabulary (special tokens,
# never split, skipped when decoding).  Words ``w<i>`` fill the ids between.
ROLES = ["<|system|>", "<|user|>", "<|assistant|>"]

# What ``/v1/chat/completions`` renders a conversation with (transformers reads
# ``chat_template.jinja`` beside the tokenizer; vLLM's renderer uses it, so the
# server needs no ``--chat-template``): ``<bos>``, then per message its role
# marker and its text, then ``<|assistant|>`` for the answer.  A later turn's
# prompt extends an earlier one (prompt + answer + new message), so prefix
# caches hit across turns.  Other roles (``developer``, ``tool``) render as user.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = message['role'] if message['role'] in ['system', 'user', 'assistant']"
    " else 'user' %}"
    "{{ '<|' + role + '|> ' }}{{ message['content'] or '' }}{{ ' ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def write_tokenizer(out: Path, vocab: int = VOCAB) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja.

    Ids 0-3 are ``SPECIALS``, the last ``len(ROLES)`` ids the role markers,
    the ids between the words ``w0, w1, ...``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    words = {tok: i for i, tok in enumerate(SPECIALS)}
    n_words = vocab - len(SPECIALS) - len(ROLES)
    words.update({f"w{i}": i + len(SPECIALS) for i in range(n_words)})
    words.update({r: vocab - len(ROLES) + i for i, r in enumerate(ROLES)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS + ROLES])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
        "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE}))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def gemma2_config(window: int = 64) -> dict[str, Any]:
    """Gemma-2 with interleaved sliding window (even layers SWA): 2 KV-cache groups."""
    return {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": window,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "tie_word_embeddings": True, "torch_dtype": "float32",
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(4)],
    }


def mimo_v2_config(window: int = 64, head_dim: int = 128, v_head_dim: int = 128
                   ) -> dict[str, Any]:
    """MiMo-V2-Flash shape, shrunk: its hybrid pattern (full at 0 and last, SWA
    between), SWA KV heads (2) != full KV heads (1), SWA attention sinks, dense
    MLP only (``moe_layer_freq`` all 0).

    The real model has K head dim 192 / V 128; vLLM 0.32 routes K != V to its
    DiffKV Triton backend, which the CPU build cannot run (see the e2e test),
    so the default here is K = V = 128 (vLLM's CPU attention backend).  The
    per-token KV bytes still differ between the full and SWA groups, so vLLM
    gives them different block sizes, as for the real model."""
    n = 6
    pattern = [0 if i in (0, n - 1) else 1 for i in range(n)]  # 1 = SWA (vLLM's reading)
    return {
        "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": n, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": head_dim, "v_head_dim": v_head_dim, "swa_num_attention_heads": 2,
        "swa_num_key_value_heads": 2, "swa_head_dim": head_dim, "swa_v_head_dim": v_head_dim,
        "sliding_window_size": window, "sliding_window": window,
        "hybrid_layer_pattern": pattern, "moe_layer_freq": [0] * n,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "hidden_act": "silu", "layernorm_epsilon": 1e-6, "attention_bias": False,
        "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
        "partial_rotary_factor": 0.334, "rope_theta": 10000.0, "swa_rope_theta": 10000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }


def _random_state(cfg: dict[str, Any], arch: str) -> dict[str, torch.Tensor]:
    """Instantiate vLLM-free: build the HF model where transformers knows it."""
    import transformers

    if arch == "gemma2":
        conf = transformers.Gemma2Config(**{k: v for k, v in cfg.items()
                                            if k not in ("architectures", "model_type")})
        torch.manual_seed(0)
        model = transformers.Gemma2ForCausalLM(conf)
        # vLLM ties Gemma-2's embeddings; with default init the residual stream
        # echoes the input token and greedy decoding repeats one token forever.
        # Unit-norm embeddings, larger weights and strong post-norms give varied
        # outputs, so "equal outputs" in the tests means something.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.5)
                elif "post_" in name:
                    p.fill_(5.0)
            e = model.model.embed_tokens.weight
            e.copy_(e / e.norm(dim=1, keepdim=True))
        return model.state_dict()
    raise ValueError(f"arch {arch!r} has no HF builder")


def _mimo_state(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Weights named as vLLM's mimo_v2 loader expects (HF MiMo-V2 naming)."""
    g = torch.Generator().manual_seed(0)
    h, n = cfg["hidden_size"], cfg["num_hidden_layers"]

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.15

    sd = {"model.embed_tokens.weight": r(VOCAB, h), "model.norm.weight": torch.ones(h),
          "lm_head.weight": r(VOCAB, h)}
    for i in range(n):
        swa = cfg["hybrid_layer_pattern"][i] == 1
        heads = cfg["swa_num_attention_heads" if swa else "num_attention_heads"]
        kvh = cfg["swa_num_key_value_heads" if swa else "num_key_value_heads"]
        kd, vd = cfg["head_dim"], cfg["v_head_dim"]
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": r(heads * kd, h),
                   p + "self_attn.k_proj.weight": r(kvh * kd, h),
                   p + "self_attn.v_proj.weight": r(kvh * vd, h),
                   p + "self_attn.o_proj.weight": r(h, heads * vd),
                   p + "mlp.gate_proj.weight": r(cfg["intermediate_size"], h),
                   p + "mlp.up_proj.weight": r(cfg["intermediate_size"], h),
                   p + "mlp.down_proj.weight": r(h, cfg["intermediate_size"]),
                   p + "input_layernorm.weight": torch.ones(h),
                   p + "post_attention_layernorm.weight": torch.ones(h)})
        if swa and cfg.get("add_swa_attention_sink_bias"):
            sd[p + "self_attn.attention_sink_bias"] = torch.zeros(heads)
    return sd


_MIMO_CONFIG_PY = """from transformers import PretrainedConfig


class MiMoV2Config(PretrainedConfig):
    model_type = "mimo_v2"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
"""


def build(arch: str, out: str | Path, window: int = 64, **kw: Any) -> Path:
    """Write a tiny ``arch`` checkpoint (``gemma2`` or ``mimo_v2``) into ``out``.

    ``kw`` goes to the config builder (``mimo_v2``: ``head_dim``, ``v_head_dim``)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if arch == "gemma2":
        cfg = gemma2_config(window)
        sd = _random_state(cfg, arch)
    elif arch == "mimo_v2":
        cfg = mimo_v2_config(window, **kw)
        sd = _mimo_state(cfg)
        # Real MiMo checkpoints ship their config class as remote code (transformers
        # has no mimo_v2); a minimal one is written here (load with trust_remote_code).
        cfg["auto_map"] = {"AutoConfig": "configuration_mimo_v2.MiMoV2Config"}
        (out / "configuration_mimo_v2.py").write_text(_MIMO_CONFIG_PY)
    else:
        raise ValueError(f"arch must be 'gemma2' or 'mimo_v2', got {arch!r}")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1,
                                                            "eos_token_id": 2}))
    tied = cfg.get("tie_word_embeddings", False)
    save_file({k: v.detach().clone().float().contiguous() for k, v in sd.items()
               if not k.endswith("rotary_emb.inv_freq") and not (tied and k == "lm_head.weight")},
              str(out / "model.safetensors"))
    write_tokenizer(out)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1], sys.argv[2]))
