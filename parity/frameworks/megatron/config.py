"""The transformers model a megatron-core GPTModel maps to (docs/megatron.md#the-mapping), its config built from the
job's own TransformerConfig and GPTModel arguments:

  RMSNorm, gated SiLU MLP (gated_linear_unit), no linear biases, RoPE  →  LlamaForCausalLM
  the same with biases on Q, K and V alone (add_qkv_bias)               →  Qwen2ForCausalLM

Grouped-query attention (num_query_groups), the RoPE base (rotary_base), the norm's eps and tied embeddings carry over.
Anything else — a MoE layer, LayerNorm, another activation, biases on other linears, Q/K norms, interleaved or scaled
RoPE, another position embedding — is refused in one line (MegatronRefused): a replay of another model would judge
nothing."""

from __future__ import annotations

import torch


class MegatronRefused(ValueError):
    """A megatron-core model the harness cannot map onto a transformers model: one line."""


def hf_config(config, vocab_size: int, max_sequence_length: int, rotary_base: float = 10000.0,
              tied: bool = False, position_embedding_type: str = "rope"):
    """The transformers config of a GPTModel built from TransformerConfig `config` with these arguments (GPTModel's
    own names). MegatronRefused, one line, where it cannot be mapped."""
    from transformers import LlamaConfig, Qwen2Config

    refusals = [
        (position_embedding_type != "rope", f"position_embedding_type {position_embedding_type!r}: the transformers "
                                            f"models the replay builds use RoPE"),
        (bool(getattr(config, "num_moe_experts", None)), "a MoE layer (num_moe_experts): not yet mapped"),
        (bool(getattr(config, "mtp_num_layers", None)), "multi-token prediction (mtp_num_layers): not yet mapped"),
        (config.normalization != "RMSNorm", f"normalization {config.normalization!r}: Llama and Qwen2 use RMSNorm"),
        (not config.gated_linear_unit or config.activation_func is not torch.nn.functional.silu,
         "an MLP other than the gated SiLU one (gated_linear_unit with activation_func silu)"),
        (config.add_bias_linear, "biases on the linear layers (add_bias_linear): Llama and Qwen2 have none there"),
        (getattr(config, "qk_layernorm", False), "Q/K norms (qk_layernorm): not yet mapped"),
        (getattr(config, "rotary_interleaved", False), "interleaved RoPE (rotary_interleaved): transformers rotates "
                                                       "halves"),
        (config.kv_channels not in (None, config.hidden_size // config.num_attention_heads),
         f"kv_channels {config.kv_channels} other than hidden_size ÷ heads"),
    ]
    for refused, why in refusals:
        if refused:
            raise MegatronRefused(f"megatron-core model: {why}")
    common = dict(vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
                  num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
                  num_key_value_heads=config.num_query_groups or config.num_attention_heads,
                  rms_norm_eps=config.layernorm_epsilon, max_position_embeddings=max_sequence_length,
                  tie_word_embeddings=tied, rope_theta=float(rotary_base), hidden_act="silu")
    if getattr(config, "add_qkv_bias", False):
        return Qwen2Config(**common, use_sliding_window=False)
    return LlamaConfig(**common, attention_bias=False, mlp_bias=False)


__all__ = ["MegatronRefused", "hf_config"]
