"""The transformers model a torchtitan job's model maps to (docs/torchtitan.md#the-mapping): its config, built from
the job's own model config — the widths, heads, RoPE and norm settings the job built its model from — for the
families whose state-dict adapter names Hugging Face's tensors and whose architecture transformers has:

  torchtitan llama3 (Llama3Model)  →  transformers LlamaForCausalLM (RoPE "llama" scaling as rope_type llama3)
  torchtitan qwen3 (dense)         →  transformers Qwen3ForCausalLM (q/k norms over head_dim)

Anything else — a MoE model, a model with no state-dict adapter, a RoPE or attention the transformers class does not
compute alike (yarn scaling, biases, a norm without affine weights) — is refused in one line (TitanRefused) before
anything is recorded: a replay of another model would judge nothing. Whether the mapped tensors are exactly the
transformers model's is the view's check (frameworks/torchtitan/view.py), by name and shape."""

from __future__ import annotations


class TitanRefused(ValueError):
    """A torchtitan job the recorder cannot map onto a transformers model: one line, and it records nothing."""


def hf_config(model_spec):
    """The transformers config of `model_spec`'s model (a torchtitan ModelSpec: its name and model config).
    TitanRefused, one line, where it cannot be mapped."""
    name = model_spec.name
    if model_spec.state_dict_adapter is None:
        raise TitanRefused("the model has no state-dict adapter: nothing names its tensors as a transformers model's, "
                           "so no replay can be built for it")
    builder = FAMILIES.get(name)
    if builder is None:
        raise TitanRefused(f"{name} maps to no transformers model the harness builds (it maps "
                           f"{', '.join(sorted(FAMILIES))}): a MoE model or another family is not replayed")
    return builder(model_spec.model)


def _common(model, layer) -> dict:
    """What every mapped decoder family shares: widths, heads, depth, vocabulary, norm eps, tying, RoPE."""
    attention, ffn = layer.attention, layer.feed_forward
    rope = attention.rope
    if getattr(rope, "scaling", "none") not in ("none", "llama"):
        raise TitanRefused(f"RoPE scaling {rope.scaling!r}: the transformers model the replay builds computes 'none' "
                           f"and 'llama' (rope_type llama3) alike; record a job without it")
    if ffn is None or any(getattr(getattr(ffn, w), "bias", False) for w in ("w1", "w2", "w3")):
        raise TitanRefused("a decoder layer without a gated MLP, or with MLP biases: not the transformers model the "
                           "replay builds")
    norm = layer.attention_norm
    if not getattr(norm, "elementwise_affine", True):
        raise TitanRefused("RMSNorm without weights: not the transformers model the replay builds")
    heads = attention.n_heads
    kv = attention.n_kv_heads or heads
    parameters = {"rope_type": "default", "rope_theta": float(rope.theta)}
    if rope.scaling == "llama":
        parameters = {"rope_type": "llama3", "rope_theta": float(rope.theta), "factor": float(rope.scaling_factor),
                      "low_freq_factor": float(rope.low_freq_factor), "high_freq_factor": float(rope.high_freq_factor),
                      "original_max_position_embeddings": int(rope.original_max_position_embeddings)}
    return {"vocab_size": model.vocab_size, "hidden_size": model.dim, "intermediate_size": ffn.w1.out_features,
            "num_hidden_layers": len(model.layers), "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": attention.head_dim or model.dim // heads, "max_position_embeddings": max(rope.max_seq_len, rope.original_max_position_embeddings if rope.scaling == "llama" else 0),
            "rms_norm_eps": float(norm.eps), "tie_word_embeddings": bool(getattr(model, "enable_weight_tying", False)),
            "rope_parameters": parameters, "hidden_act": "silu", "attention_bias": False, "use_cache": False,
            "attention_dropout": 0.0}


def _llama(model):
    from transformers import LlamaConfig

    layer = model.layers[0]
    if getattr(layer.attention, "qk_norm", None) is not None:
        raise TitanRefused("a llama3 model with q/k norms: not transformers' Llama")
    return LlamaConfig(**_common(model, layer), mlp_bias=False)


def _qwen3(model):
    from transformers import Qwen3Config

    layer = model.layers[0]
    if getattr(layer, "moe", None) is not None or getattr(layer, "moe_enabled", False):
        raise TitanRefused("a qwen3 MoE model: its experts are not mapped onto transformers' Qwen3-MoE here")
    common = _common(model, layer)
    common["rope_parameters"] = {"rope_type": "default", "rope_theta": common["rope_parameters"]["rope_theta"]}
    return Qwen3Config(**common)


FAMILIES = {"llama3": _llama, "qwen3": _qwen3}

__all__ = ["FAMILIES", "TitanRefused", "hf_config"]
