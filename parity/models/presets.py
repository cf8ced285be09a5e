"""The built-in models: published configs of real models (their config.json values, so no hub is needed) and tiny
presets of each family for CPU runs. Each entry is a config.json as Hugging Face publishes it (`model_type` and
the fields); transformers' own config class reads it (parity.models.families.config_from_dict), legacy fields
(rope_theta, sliding_window_pattern) included.

The tiny presets share one shape — vocabulary 2048, hidden 64, 2 layers, 4 attention heads over 2 KV heads (so
TP=2 divides both), MLP 256 — and keep what makes their family differ: Qwen3's per-head q/k norms with a head_dim
that is not hidden ÷ heads, Gemma3's scaled embedding, GELU and four norms per layer with one sliding-window and
one full-attention layer, OLMo2's full-width q/k norms and post-norms, Phi3's fused qkv_proj and gate_up_proj,
Mistral's sliding window. gemma3-tiny is 48 wide: its embedding scale √48 is not a bf16 number (√64 would be), so
a scale applied in the wrong dtype shows. Tied embeddings: qwen2, qwen3, gemma3; untied: llama, mistral, olmo2, phi3. Their
sliding windows (16, 32 tokens) are shorter than the tests' sequences, so the masks really cut.

The mixture-of-experts presets (docs/moe.md) keep that shape with 4 experts, top-2 (EP=2 holds 2 experts per rank)
and what makes each family's sparse block differ: Qwen3-MoE's softmax router with normalised top-k weights and its
load-balancing loss (coefficient 0.001, as Qwen3-30B-A3B); Mixtral's (0.02, as Mixtral-8x7B); DeepSeek-V3's
multi-head latent attention, its first layer dense, a shared expert beside the routed ones, and its sigmoid router
with group-limited, bias-corrected top-k (8 experts in 4 groups, 2 groups kept, scaled by 2.5) and no auxiliary loss.
Their output_router_logits is on, so the load-balancing loss is in the training loss as transformers adds it; the
published configs keep theirs (off).
"""

from __future__ import annotations

_TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.02, rms_norm_eps=1e-6,
             attention_dropout=0.0, bos_token_id=0, eos_token_id=0)

PRESETS: dict[str, dict] = {
    # --- published configs (config.json of the model on the hub) ------------------------------------------------
    "Qwen/Qwen2.5-0.5B": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768,
        initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=32768, max_window_layers=24, attention_dropout=0.0,
        bos_token_id=151643, eos_token_id=151643),
    "Qwen/Qwen3-0.6B": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=40960,
        initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000,
        use_sliding_window=False, sliding_window=None, max_window_layers=28, attention_bias=False,
        attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645),
    "meta-llama/Llama-3.2-1B": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072,
        initializer_range=0.02, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        attention_bias=False, mlp_bias=False, attention_dropout=0.0, bos_token_id=128000, eos_token_id=128001),
    "google/gemma-3-1b-pt": dict(  # one KV head: trains at TP=1 only
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6, rope_theta=1000000,
        rope_local_base_freq=10000, sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
        attn_logit_softcapping=None, final_logit_softcapping=None, attention_bias=False, attention_dropout=0.0,
        pad_token_id=0, bos_token_id=2, eos_token_id=1),
    "Qwen/Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_act="silu", max_position_embeddings=40960,
        initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=None, max_window_layers=48, attention_bias=False,
        attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, output_router_logits=False,
        router_aux_loss_coef=0.001, bos_token_id=151643, eos_token_id=151645),
    "mistralai/Mixtral-8x7B-v0.1": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=32768,
        initializer_range=0.02, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=1000000.0,
        sliding_window=None, attention_dropout=0.0, num_local_experts=8, num_experts_per_tok=2,
        output_router_logits=False, router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2),
    # --- tiny presets, one per family ---------------------------------------------------------------------------
    "qwen2-tiny": dict(
        model_type="qwen2", **_TINY, hidden_act="silu", tie_word_embeddings=True, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=4096, max_window_layers=2),
    "llama-tiny": dict(
        model_type="llama", **_TINY, hidden_act="silu", tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 512, "rope_type": "llama3"}),
    "qwen3-tiny": dict(
        model_type="qwen3", **_TINY, head_dim=32, hidden_act="silu", tie_word_embeddings=True, rope_theta=1000000,
        use_sliding_window=False, sliding_window=None),
    "gemma3-tiny": dict(
        model_type="gemma3_text", **{**_TINY, "hidden_size": 48, "intermediate_size": 192, "bos_token_id": 2,
                                     "eos_token_id": 1}, pad_token_id=0, head_dim=16,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, rope_theta=1000000,
        rope_local_base_freq=10000, sliding_window=16, sliding_window_pattern=2,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16, attn_logit_softcapping=None, final_logit_softcapping=None),
    "mistral-tiny": dict(
        model_type="mistral", **_TINY, hidden_act="silu", tie_word_embeddings=False, rope_theta=10000.0,
        sliding_window=32),
    "olmo2-tiny": dict(
        model_type="olmo2", **_TINY, pad_token_id=1, hidden_act="silu", tie_word_embeddings=False,
        rope_theta=500000.0),
    "phi3-tiny": dict(
        model_type="phi3", **_TINY, pad_token_id=0, hidden_act="silu", tie_word_embeddings=False, rope_theta=10000.0,
        sliding_window=None),
    # --- mixture-of-experts tiny presets ---------------------------------------------------------------------
    "qwen3-moe-tiny": dict(
        model_type="qwen3_moe", **_TINY, head_dim=32, hidden_act="silu", tie_word_embeddings=False,
        rope_theta=1000000, use_sliding_window=False, sliding_window=None, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        output_router_logits=True, router_aux_loss_coef=0.001),
    "mixtral-tiny": dict(
        model_type="mixtral", **{**_TINY, "intermediate_size": 64}, hidden_act="silu", tie_word_embeddings=False,
        rope_theta=1000000.0, sliding_window=None, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.02, router_jitter_noise=0.0),
    "deepseek-v3-tiny": dict(
        model_type="deepseek_v3", **{**_TINY, "intermediate_size": 128, "num_key_value_heads": 4}, hidden_act="silu",
        tie_word_embeddings=False, rope_theta=10000.0, rope_interleave=True, kv_lora_rank=32, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0),
}

TINY_PRESETS = tuple(name for name in PRESETS if name.endswith("-tiny"))
MOE_PRESETS = ("qwen3-moe-tiny", "mixtral-tiny", "deepseek-v3-tiny")  # the mixtures of experts among them

# The learning rate a preset trains well with when --learning_rate is not given. 1e-5 is the seed's; the tiny
# models need a larger one for their loss to move within 100 steps.
DEFAULT_LEARNING_RATE = 1e-5
PRESET_LEARNING_RATES = {name: 1e-3 for name in TINY_PRESETS}


def default_learning_rate(model_name: str) -> float:
    return PRESET_LEARNING_RATES.get(model_name, DEFAULT_LEARNING_RATE)


def default_tokenizer(model_name: str) -> str:
    """Text data's tokenizer when --tokenizer is not given: UTF-8 bytes for a tiny preset (its vocabulary is 2048),
    else the model's own (by its name, from the hub or a local directory)."""
    return "bytes" if model_name in TINY_PRESETS else model_name
