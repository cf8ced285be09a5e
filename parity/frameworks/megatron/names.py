"""A megatron-core GPTModel's tensors under Hugging Face names (docs/megatron.md#the-mapping), as Megatron-Bridge's
param_mapping.py lays them out: each parameter gathered over tensor parallelism along the dimension megatron-core
tags it with (`tensor_model_parallel`, `partition_dim`), then

- `embedding.word_embeddings.weight` → `model.embed_tokens.weight`, `output_layer.weight` → `lm_head.weight`,
  `decoder.final_layernorm.weight` → `model.norm.weight`;
- per layer, `input_layernorm` and `pre_mlp_layernorm` → `input_layernorm` and `post_attention_layernorm`;
  `self_attention.linear_proj` → `self_attn.o_proj`; `mlp.linear_fc2` → `mlp.down_proj`;
- the fused `self_attention.linear_qkv` split per query group — each group's rows are its heads' queries, then one
  key head, then one value head — into `q_proj`, `k_proj`, `v_proj` (weight, and bias where add_qkv_bias);
- the fused `mlp.linear_fc1` — each TP rank's rows are its gate rows, then its up rows — into `gate_proj`, `up_proj`;
- a MoE layer's (Mixtral's, Qwen3-MoE's, Qwen2-MoE's names): `mlp.router` → `mlp.gate`; expert e's
  `mlp.experts.local_experts.e.linear_fc1` (numbered in the whole model: view.py renumbers each EP rank's local
  experts) → row e of the fused `mlp.experts.gate_up_proj` [experts, 2 × FFN, hidden], gate rows then up rows as
  transformers' experts chunk them (its rows laid out per expert-TP rank as linear_fc1's per TP rank), and
  `linear_fc2` → row e of `mlp.experts.down_proj`; `mlp.shared_experts.linear_fc1` / `linear_fc2` / `gate_weight` →
  `mlp.shared_expert.gate_proj` + `up_proj` / `down_proj` / `mlp.shared_expert_gate`; `self_attention.q_layernorm` /
  `k_layernorm` → `self_attn.q_norm` / `k_norm`. An expert's tensors are parts `NAME[e]` of the fused tensor NAME
  (`part_of`), stacked whole by `stacked` once every EP rank's experts are together;
- TransformerEngine's spec (on GPUs): the norms fused into the linear after them, `linear_qkv.layer_norm_weight` →
  `input_layernorm`, `mlp.linear_fc1.layer_norm_weight` → `post_attention_layernorm`, and its grouped experts'
  `mlp.experts.linear_fc1.weight{e}` / `linear_fc2.weight{e}` as the local spec's expert e.

A split moves elements and never mixes them, so a parameter's gradient and its optimizer's moments translate alike.
A name the mapping does not know is refused in one line (MegatronRefused)."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from parity.frameworks.megatron.config import MegatronRefused
from parity.models.packing import packed, unpacked_per_rank

RENAMED = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight",
           "decoder.final_layernorm.weight": "model.norm.weight"}
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
LAYER_RENAMED = {"input_layernorm.weight": "input_layernorm.weight",
                 "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                 "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                 "mlp.linear_fc2.weight": "mlp.down_proj.weight", "mlp.router.weight": "mlp.gate.weight",
                 "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                 "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
                 "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
                 "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight"}
EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")
# TransformerEngine's spec: its norms fused into the linear after them, its grouped experts' weights numbered
TE_RENAMED = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
              "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight"}
GROUPED = re.compile(r"mlp\.experts\.linear_fc([12])\.weight(\d+)")
PART = re.compile(r"(.+)\[(\d+)\]")


def full_tensor(param: torch.Tensor, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """`tensor` (the parameter `param`, or its gradient or a moment: the same shape) whole over the TP `group`: the
    ranks' pieces concatenated along the parameter's partition_dim where megatron-core split it, as it is elsewhere."""
    if not getattr(param, "tensor_model_parallel", False) or group is None or dist.get_world_size(group) == 1:
        return tensor.detach()
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.detach().contiguous(), group=group)
    return torch.cat(pieces, dim=param.partition_dim)


def to_hf(name: str, tensor: torch.Tensor, config, tp_size: int) -> dict[str, torch.Tensor]:
    """One full megatron-core tensor (`name` the parameter's) as {Hugging Face name: tensor}; `config` the job's
    TransformerConfig, `tp_size` the TP degree it was trained at (linear_fc1's rows are laid out per TP rank)."""
    name = name.removeprefix("module.")
    if name in RENAMED:
        return {RENAMED[name]: tensor}
    found = LAYER.fullmatch(name)
    if found is None:
        raise MegatronRefused(f"megatron-core parameter {name}: the mapping to Hugging Face names does not know it")
    prefix, rest = f"model.layers.{found.group(1)}.", found.group(2)
    if rest in LAYER_RENAMED or rest in TE_RENAMED:
        return {prefix + {**LAYER_RENAMED, **TE_RENAMED}[rest]: tensor}
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return {f"{prefix}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", split_qkv(tensor, config))}
    if rest in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
        gate, up = unpacked_per_rank(tensor, tp_size)  # each TP rank's rows [gate_r; up_r]
        mlp = prefix + ("mlp." if rest.startswith("mlp.linear") else "mlp.shared_expert.")
        return {mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up}
    expert, grouped = EXPERT.fullmatch(rest), GROUPED.fullmatch(rest)
    if expert is not None or grouped is not None:  # one expert's part of the fused 3-D weight (part_of)
        e, fc = expert.groups() if expert is not None else grouped.groups()[::-1]
        if fc == "2":
            return {f"{prefix}mlp.experts.down_proj[{e}]": tensor}
        return {f"{prefix}mlp.experts.gate_up_proj[{e}]": packed(unpacked_per_rank(tensor, tp_size))}
    raise MegatronRefused(f"megatron-core parameter {name}: the mapping to Hugging Face names does not know it")


def part_of(name: str) -> tuple[str, int | None]:
    """(the Hugging Face tensor, the expert) of a key of to_hf's: an expert's part NAME[e] of a fused 3-D weight, or
    (name, None)."""
    found = PART.fullmatch(name)
    return (name, None) if found is None else (found.group(1), int(found.group(2)))


def stacked(tensors: dict) -> dict:
    """to_hf's tensors (or {moment: tensor} of each) with every expert's part of a fused weight stacked in expert
    order (every expert there)."""
    whole, parts = {}, {}
    for key, t in tensors.items():
        name, e = part_of(key)
        if e is None:
            whole[name] = t
        else:
            parts.setdefault(name, {})[e] = t
    for name, experts in parts.items():
        rows = [experts[e] for e in range(len(experts))]
        whole[name] = ({k: torch.stack([row[k] for row in rows]) for k in rows[0]} if isinstance(rows[0], dict)
                       else torch.stack(rows))
    return whole


def split_qkv(tensor: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV weight [groups × (heads_per_group + 2) × head_dim, …] (or its bias) as Q, K, V."""
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    head_dim = config.kv_channels or config.hidden_size // heads
    per_group = tensor.reshape(groups, (heads // groups + 2) * head_dim, *tensor.shape[1:])
    q_rows = heads // groups * head_dim
    q = per_group[:, :q_rows].reshape(heads * head_dim, *tensor.shape[1:])
    k = per_group[:, q_rows:q_rows + head_dim].reshape(groups * head_dim, *tensor.shape[1:])
    v = per_group[:, q_rows + head_dim:].reshape(groups * head_dim, *tensor.shape[1:])
    return q, k, v


__all__ = ["full_tensor", "part_of", "split_qkv", "stacked", "to_hf"]
