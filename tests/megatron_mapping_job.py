"""One step of a tiny megatron-core GPTModel (tests/test_megatron.py): built at TP `argv[2]` over the ranks torchrun
started (through tests/megatron_cpu.py), its loss on fixed rows and its backward; then every parameter and gradient
gathered over TP and put under Hugging Face names (parity/frameworks/megatron/names.py), and rank 0 loads them into
the transformers model of the job's config (strict), takes the same loss and backward, and writes to `argv[1]` the
two losses and each gradient's largest relative difference. `argv[3]`: "llama" (no biases) or "qwen2" (Q/K/V
biases)."""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, SEQ = 512, 16


def weights_of(weights: dict, name: str) -> torch.Tensor:
    """linear_fc1's full weight again, from its gate and up under Hugging Face names (in TP rank order)."""
    prefix = f"model.layers.{name.split('.')[2]}.mlp."
    gate, up = weights[prefix + "gate_proj.weight"], weights[prefix + "up_proj.weight"]
    tp = int(sys.argv[2])
    return torch.cat([torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))])


# a MoE config of the job's (Mixtral's mapping: softmax top-2 renormalised, no Q/K norms, no biases, no shared expert)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-2,
           moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
           add_qkv_bias=False)
# what does not map, one setting each (GPTModel's own arguments after the config's): the dense model's, then the MoE's
DENSE_CHANGES = [({"normalization": "LayerNorm"}, {}), ({"add_bias_linear": True}, {}), ({"qk_layernorm": True}, {}),
                 ({"gated_linear_unit": False}, {}), ({"mtp_num_layers": 1}, {}),
                 ({}, {"position_embedding_type": "learned_absolute"}), ({"multi_latent_attention": True}, {}),
                 ({"fp8": "hybrid"}, {}), ({"layernorm_zero_centered_gamma": True}, {}),
                 ({"rotary_interleaved": True}, {}), ({"kv_channels": 32}, {})]
MOE_CHANGES = [{"moe_router_score_function": "sigmoid"},
               {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
               {"moe_router_num_groups": 2, "moe_router_group_topk": 1}, {"moe_router_topk_scaling_factor": 2.0},
               {"moe_expert_capacity_factor": 1.0}, {"moe_input_jitter_eps": 0.01},
               {"moe_router_load_balancing_type": "seq_aux_loss"}, {"moe_layer_freq": [0, 1]},
               {"calculate_per_token_loss": True}, {"moe_router_force_load_balancing": True},
               {"moe_shared_expert_intermediate_size": 96}, {"qk_layernorm": True, "add_qkv_bias": True},
               {"add_qkv_bias": True}, {"moe_router_pre_softmax": True}]


def refusals(config, model) -> list[str]:
    """The lines of what does not map: configs changed one setting each (DENSE_CHANGES, then MOE_CHANGES on the MoE
    config), a parameter the mapping does not know, a model that is not a GPTModel, and one model chunk given twice."""
    from dataclasses import replace

    from parity.frameworks.megatron.config import MegatronRefused, hf_config
    from parity.frameworks.megatron.view import gpt_models
    from parity.frameworks.megatron.names import to_hf

    lines = []
    moe = replace(config, **MOE)
    hf_config(moe, VOCAB, SEQ)  # maps (Mixtral): each change below alone is refused
    for base, change, arguments in [(config, c, a) for c, a in DENSE_CHANGES] + [(moe, c, {}) for c in MOE_CHANGES]:
        try:
            hf_config(replace(base, **change), VOCAB, SEQ, **arguments)
            lines.append(f"mapped: {change} {arguments}")
        except MegatronRefused as exc:
            lines.append(str(exc))
    try:
        to_hf("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias", torch.zeros(2), config, 1)
    except MegatronRefused as exc:
        lines.append(str(exc))
    for job_model in (torch.nn.Linear(2, 2), [model, model]):
        try:
            gpt_models(job_model)
        except MegatronRefused as exc:
            lines.append(str(exc))
    return lines


def router_losses() -> dict:
    """The replay's megatron-core router losses (parity/training/routing.py) against megatron-core's own functions and
    transformers' loss, on a Mixtral's router calls (tests/test_megatron.py says what is asserted): each layer's
    (megatron-core's load-balancing, transformers' of that layer alone, megatron-core's z), the replay's sums over the
    layers, transformers' loss pooled over them."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from parity.models.families import family_of
    from parity.models.model import build_model, resolve_model_config
    from parity.training import routing

    config = resolve_model_config("mixtral-tiny")
    config.router_aux_loss_scope, config.router_z_loss_coef = routing.MEGATRON_CORE, 1e-3
    model, moe = build_model(config, 0), family_of(config).moe
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with routing.RouterTap(model, family_of(config)).recording() as calls, torch.no_grad():
        model(input_ids=ids)
    seen = routing.seen_tokens(ids)  # a recorded row's every position but its last
    aux, z = routing.layer_terms(calls, seen, moe).tolist()
    layers = []
    for logits, chosen in calls:
        taken = logits[seen]
        routing_map = torch.zeros_like(taken, dtype=torch.bool).scatter(1, chosen[seen], True)
        layers.append([float(switch_load_balancing_loss_func(torch.softmax(taken, -1), routing_map.sum(0),
                                                             taken.shape[0], moe.top_k, moe.num_experts, 1.0)),
                       float(load_balancing_loss_func((taken,), moe.num_experts, moe.top_k)),
                       float(z_loss_func(taken, 1.0))])
    pooled = float(load_balancing_loss_func(tuple(logits[seen] for logits, _ in calls), moe.num_experts, moe.top_k))
    return {"seen": int(seen.sum()), "scope": [moe.aux_loss_scope, moe.z_loss_coef], "top_k": moe.top_k,
            "aux": aux, "z": z, "layers": layers, "pooled": pooled}


def loss_scales() -> list:
    """megatron-core's DynamicGradScaler (and ConstantGradScaler) driven over fixed overflow patterns, each step's scale
    before its update, beside the verdict's account of its rules (parity/comparing/loss_scales.py): [[settings,
    skipped, megatron-core's scales, the verdict's]] for tests/test_megatron.py to hold equal."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    from parity.comparing.loss_scales import megatron_core

    patterns = [[False, True, True, False], [True] * 3 + [False] * 5 + [True, False, True, True, False, False],
                [False] * 7 + [True, True, True, False, False, True] + [False] * 4]
    found = []
    for window, hysteresis, power, least in ((1, 2, 19, 1.0), (2, 1, 16, 1.0), (3, 2, 3, 2.0), (4, 3, 10, 1.0),
                                             (1, 2, 0, 0.0)):  # the last: a static scale of 1024
        for skipped in patterns:
            scaler = ConstantGradScaler(1024.0) if not least else DynamicGradScaler(
                initial_scale=2.0 ** power, min_scale=least, growth_factor=2.0, backoff_factor=0.5,
                growth_interval=window, hysteresis=hysteresis)
            scales = []
            for skip in skipped:
                scales.append(float(scaler.scale))
                scaler.update(skip)
            settings = {"loss_scale": 0.0 if least else 1024.0, "initial_scale_power": power,
                        "loss_scale_window": window, "hysteresis": hysteresis, "min_loss_scale": least}
            found.append([settings, skipped, scales, megatron_core(settings, skipped)])
    return found


def main() -> None:
    out, tp, family = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from parity.frameworks.megatron.config import hf_config
    from parity.frameworks.megatron.names import full_tensor, to_hf

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=1e-6,
        add_bias_linear=False, add_qkv_bias=family == "qwen2", use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope", rotary_base=10000,
                     share_embeddings_and_output_weights=False)
    if family == "qwen2":  # megatron-core zeroes biases at init: give them values a mapping error would show
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("linear_qkv.bias"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ)[None].expand(2, -1)
    loss = model(ids[:, :-1], positions, None, labels=ids[:, 1:]).float().mean()
    loss.backward()
    group = parallel_state.get_tensor_model_parallel_group()
    weights, grads = {}, {}
    for name, p in model.named_parameters():
        weights.update(to_hf(name, full_tensor(p, p.data, group), config, tp))
        grads.update(to_hf(name, full_tensor(p, p.grad, group), config, tp))
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_config(hf_config(config, VOCAB, SEQ, 10000), attn_implementation="eager")
        hf.load_state_dict(weights, strict=True)
        logits = hf(ids[:, :-1]).logits
        hf_loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
        hf_loss.backward()
        differences = {n: float((p.grad - grads[n]).abs().max() / p.grad.abs().max()) for n, p in hf.named_parameters()}
        # the classic mapping bug: linear_fc1 split as if trained at TP 1 (gate and up interleaved per TP rank)
        interleaved = {n: t for name, p in model.named_parameters() if name.endswith("linear_fc1.weight")
                       for n, t in to_hf(name, weights_of(weights, name), config, 1).items()}
        hf.load_state_dict({**weights, **interleaved}, strict=True)
        with torch.no_grad():
            wrong = F.cross_entropy(hf(ids[:, :-1]).logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
        with open(out, "w") as f:
            json.dump({"loss": float(loss), "hf_loss": float(hf_loss), "grads": differences,
                       "model": type(hf).__name__, "fc1_as_tp1_loss": float(wrong),
                       "refusals": refusals(config, model), "router_losses": router_losses(),
                       "loss_scales": loss_scales()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
