"""The transformers model a megatron-core GPTModel maps to (docs/megatron.md#the-mapping), its config built from the
job's own TransformerConfig and GPTModel arguments:

  RMSNorm, gated SiLU MLP (gated_linear_unit), no linear biases, RoPE  →  LlamaForCausalLM
  the same with biases on Q, K and V alone (add_qkv_bias)               →  Qwen2ForCausalLM
  MoE layers (num_moe_experts) of gated SiLU experts, softmax top-k routing, every layer sparse:
    top-k weights renormalised (moe_router_pre_softmax off), no Q/K norms, no shared expert  →  MixtralForCausalLM
    Q/K norms (qk_layernorm), no shared expert                                                →  Qwen3MoeForCausalLM
    a shared expert behind a sigmoid gate (moe_shared_expert_gate), Q/K/V biases or none      →  Qwen2MoeForCausalLM
  (the last two renormalise the top-k weights or not as moe_router_pre_softmax says: norm_topk_prob)

A MoE config carries megatron-core's router losses as the replay must train them (parity/models/families.py's MoE
seam, docs/moe.md): `router_aux_loss_coef` its moe_aux_loss_coeff with `router_aux_loss_scope` "megatron-core" (per
sparse layer and micro-batch, summed over the layers, averaged over the micro-batches: not transformers' loss pooled
over the layers and the global batch, whose coefficient differs by 1/top-k), and `router_z_loss_coef` its
moe_z_loss_coeff.

Grouped-query attention (num_query_groups), the RoPE base (rotary_base), the norm's eps and tied embeddings carry over.
Anything else — LayerNorm, another activation, biases on other linears, Q/K norms on a dense model, interleaved or
scaled RoPE, another position embedding, a router no family has (sigmoid scores, expert bias, group-limited top-k, a
scaled top-k, token dropping, input jitter, another load-balancing loss), dense layers among the sparse ones — is
refused in one line (MegatronRefused): a replay of another model would judge nothing."""

from __future__ import annotations

import torch

MEGATRON_SCOPE = "megatron-core"  # router_aux_loss_scope of a mapped MoE config: parity/training/routing.py reads it


class MegatronRefused(ValueError):
    """A megatron-core model the harness cannot map onto a transformers model: one line."""


def hf_config(config, vocab_size: int, max_sequence_length: int, rotary_base: float = 10000.0,
              tied: bool = False, position_embedding_type: str = "rope"):
    """The transformers config of a GPTModel built from TransformerConfig `config` with these arguments (GPTModel's
    own names). MegatronRefused, one line, where it cannot be mapped."""
    from transformers import LlamaConfig, Qwen2Config

    moe = bool(getattr(config, "num_moe_experts", None))
    refusals = [
        (position_embedding_type != "rope", f"position_embedding_type {position_embedding_type!r}: the transformers "
                                            f"models the replay builds use RoPE"),
        (bool(getattr(config, "mtp_num_layers", None)), "multi-token prediction (mtp_num_layers): not yet mapped"),
        (getattr(config, "multi_latent_attention", False), "multi-head latent attention (DeepSeek-V3's: "
                                                           "multi_latent_attention): not yet mapped"),
        (bool(getattr(config, "fp8", None)), f"fp8 compute (fp8 {config.fp8!r}): the replay has no fp8 reference to "
                                             f"judge it against; record the job in bf16"),
        (config.normalization != "RMSNorm", f"normalization {config.normalization!r}: Llama and Qwen2 use RMSNorm"),
        (not config.gated_linear_unit or config.activation_func is not torch.nn.functional.silu,
         "an MLP other than the gated SiLU one (gated_linear_unit with activation_func silu)"),
        (config.add_bias_linear, "biases on the linear layers (add_bias_linear): Llama and Qwen2 have none there"),
        (getattr(config, "layernorm_zero_centered_gamma", False), "zero-centred norm weights "
                                                                  "(layernorm_zero_centered_gamma): not yet mapped"),
        (getattr(config, "qk_layernorm", False) and not moe, "Q/K norms (qk_layernorm): not yet mapped"),
        (getattr(config, "rotary_interleaved", False), "interleaved RoPE (rotary_interleaved): transformers rotates "
                                                       "halves"),
        (config.kv_channels not in (None, config.hidden_size // config.num_attention_heads) and not moe,
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
    if moe:
        return moe_config(config, common)
    if getattr(config, "add_qkv_bias", False):
        return Qwen2Config(**common, use_sliding_window=False)
    return LlamaConfig(**common, attention_bias=False, mlp_bias=False)


def router_refusal(config) -> str | None:
    """What of megatron-core's router no transformers MoE family computes, in words (None: Mixtral's, Qwen2-MoE's and
    Qwen3-MoE's softmax top-k)."""
    balancing = config.moe_router_load_balancing_type
    checks = [  # the expert bias first: megatron-core takes it with sigmoid scores only, which the next line names
        (config.moe_router_enable_expert_bias, "the expert bias of aux-loss-free balancing "
                                               "(moe_router_enable_expert_bias): not yet mapped"),
        (config.moe_router_score_function != "softmax", f"moe_router_score_function "
                                                        f"{config.moe_router_score_function!r}: the families mapped "
                                                        f"route by softmax"),
        (config.moe_router_num_groups or config.moe_router_group_topk, "group-limited top-k "
                                                                       "(moe_router_num_groups): not yet mapped"),
        (config.moe_router_topk_scaling_factor not in (None, 1.0), "a scaled top-k "
                                                                   "(moe_router_topk_scaling_factor): not yet mapped"),
        (config.moe_expert_capacity_factor is not None, "token dropping (moe_expert_capacity_factor): the families "
                                                        "mapped drop no token"),
        (config.moe_input_jitter_eps, "input jitter (moe_input_jitter_eps): a random router input the replay cannot "
                                      "draw alike"),
        (balancing not in ("aux_loss", "none"), f"moe_router_load_balancing_type {balancing!r}: the replay trains "
                                                f"megatron-core's micro-batch aux_loss (or none)"),
        (config.moe_layer_freq != 1, "dense layers among the MoE ones (moe_layer_freq): not yet mapped"),
        (config.calculate_per_token_loss and (config.moe_aux_loss_coeff or config.moe_z_loss_coeff),
         "its losses under calculate_per_token_loss (each micro-batch's weighted by its routed tokens over the step's "
         "loss tokens): not yet replayed"),
        (getattr(config, "moe_router_force_load_balancing", False), "forced load balancing "
                                                                    "(moe_router_force_load_balancing): random "
                                                                    "routing"),
    ]
    return next((f"a MoE router with {why}" for refused, why in checks if refused), None)


def moe_config(config, common: dict):
    """The Mixtral, Qwen3-MoE or Qwen2-MoE config of a megatron-core MoE model (the module docstring)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    why = router_refusal(config)
    if why:
        raise MegatronRefused(f"megatron-core model: {why}")
    qk_norm, qkv_bias = bool(config.qk_layernorm), bool(config.add_qkv_bias)
    shared = config.moe_shared_expert_intermediate_size
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    coef = float(config.moe_aux_loss_coeff) if config.moe_router_load_balancing_type == "aux_loss" else 0.0
    routing = dict(num_experts_per_tok=config.moe_router_topk, output_router_logits=True, router_aux_loss_coef=coef,
                   router_aux_loss_scope=MEGATRON_SCOPE, router_z_loss_coef=float(config.moe_z_loss_coeff or 0.0))
    experts = dict(num_experts=config.num_moe_experts, moe_intermediate_size=config.moe_ffn_hidden_size,
                   norm_topk_prob=not config.moe_router_pre_softmax, decoder_sparse_step=1, mlp_only_layers=[])
    if shared:
        if not config.moe_shared_expert_gate or qk_norm:
            raise MegatronRefused("megatron-core model: a shared expert without its sigmoid gate, or beside Q/K norms: "
                                  "Qwen2-MoE's shared expert is gated and its attention has no Q/K norms "
                                  "(DeepSeek-V3's ungated one comes with its latent attention: not yet mapped)")
        return Qwen2MoeConfig(**common, **routing, **experts, shared_expert_intermediate_size=shared,
                              qkv_bias=qkv_bias, head_dim=head_dim, use_sliding_window=False)
    if qk_norm:
        if qkv_bias:
            raise MegatronRefused("megatron-core model: Q/K norms with Q/K/V biases: Qwen3-MoE has neither biases")
        return Qwen3MoeConfig(**common, **routing, **experts, head_dim=head_dim, attention_bias=False,
                              use_sliding_window=False)
    if qkv_bias or config.moe_router_pre_softmax or head_dim != config.hidden_size // config.num_attention_heads:
        raise MegatronRefused("megatron-core model: MoE layers without Q/K norms or a shared expert map to Mixtral, "
                              "whose attention has no biases and whose top-k weights are renormalised "
                              "(moe_router_pre_softmax off)")
    return MixtralConfig(**common | {"intermediate_size": config.moe_ffn_hidden_size}, **routing,
                         num_local_experts=config.num_moe_experts, router_jitter_noise=0.0, sliding_window=None)


__all__ = ["MEGATRON_SCOPE", "MegatronRefused", "hf_config", "router_refusal"]
