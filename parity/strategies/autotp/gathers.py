"""The gathers that turn AutoTP's (and AutoEP's) pieces back into what the shared loop and the comparison see: the
column-parallel outputs this rank holds a slice of (the vocab-parallel logits before the shared loss, a module's output
for the layer check), gathered exactly with a backward that takes this rank's slice; AutoEP's tensors under the stock model's names and layout.
Apart from the strategy because they work on DeepSpeed's layer classes, which differ release by release (0.18 has no
sub-parameter layers nor GatherFromTensorParallelRegion), not on the strategy's state.
"""

from __future__ import annotations

import torch

from parity.models.packing import packed


def column_parallel_outputs(hf_model, family) -> dict[str, tuple]:
    """{module name: (TP group, the per-rank widths of each part of its output)} for every module whose output is this
    rank's slice of the last dim: AutoTP's column-parallel layers that do not gather their output themselves (a
    sub-parameter layer, a fused gate_up, holds a slice of each part), and each MLP's activation, which acts on the
    slice of the gate part (the family's mlp_act). DeepSpeed 0.18's LinearLayer has neither is_tp_parallel,
    gather_output nor _partition_sizes: every one is column-parallel, never gathers, and splits its outputs evenly
    (torch.chunk) over the TP group; 0.18 has no sub-parameter layers."""
    from deepspeed.module_inject import layers

    shards = {}
    for name, module in hf_model.named_modules():
        if isinstance(module, getattr(layers, "SubParamLinearLayer", ())) and module.is_tp_parallel:
            shards[name] = (module.mp_group, [list(w) for w in module._subparam_shard_widths])
        elif isinstance(module, layers.LinearLayer) and getattr(module, "mp_group", None) is not None and \
                getattr(module, "is_tp_parallel", True) and not getattr(module, "gather_output", False):
            even = [module.weight.shape[0]] * module.tp_world_size
            shards[name] = (module.mp_group, [list(getattr(module, "_partition_sizes", even))])
    if family.mlp_in:
        gate = "." + family.mlp_in[0].name
        for name in [n for n in shards if n.endswith(gate)]:
            group, parts = shards[name]
            shards[name.removesuffix(gate) + "." + family.mlp_act] = (group, parts[:1])
    return shards


class GatherLastDim(torch.autograd.Function):
    """The TP shards of a column-parallel output concatenated along the last dim (exactly: a copy), on every rank of
    the TP group; the backward takes this rank's slice of the gradient — not the sum over ranks that
    torch.distributed.nn's all_gather returns (every TP rank computes the same loss from the gathered tensor, so the
    sum would multiply the gradient by tp_size). DeepSpeed 0.19's GatherFromTensorParallelRegion does the same; 0.18
    has none."""

    @staticmethod
    def forward(ctx, group, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        import torch.distributed as dist

        ctx.sizes, ctx.rank = sizes, dist.get_rank(group)
        pieces = [torch.empty((*t.shape[:-1], width), dtype=t.dtype, device=t.device) for width in sizes]
        dist.all_gather(pieces, t.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad.split(ctx.sizes, dim=-1)[ctx.rank].contiguous(), None


def gather_last_dim(column_shards: dict[str, tuple], module_name: str, t: torch.Tensor) -> torch.Tensor:
    """Concatenate the TP shards of a column-parallel output along the last dim — part by part for a layer whose
    output packs several parts (each rank holds a slice of each). The backward takes this rank's slice of the
    gradient (not the sum over ranks that torch.distributed.nn's all_gather returns): every TP rank computes
    the same loss from the gathered tensor. `column_shards`: column_parallel_outputs."""
    if module_name not in column_shards:
        return t
    group, parts = column_shards[module_name]
    per_rank = [sum(widths) for widths in zip(*parts)]
    full = GatherLastDim.apply(group, t, per_rank)
    if len(parts) == 1:
        return full
    pieces = [piece.split([widths[r] for widths in parts], -1) for r, piece in enumerate(full.split(per_rank, -1))]
    return torch.cat([pieces[r][j] for j in range(len(parts)) for r in range(len(per_rank))], -1)


AUTOEP_EXPERTS = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}  # its unfused experts' stock tensors


def stock_name(name: str, autoep: dict) -> str:
    """The stock model's name of the parameter `name` of the engine's module: an AutoEP layer's router's as the block's
    gate's, its experts' w1 and w3 as the fused gate_up_proj (whose two halves they are), w2 as down_proj; any other
    name as it is. `autoep`: {block name: its AutoEP layer}."""
    for block in autoep:
        if name.startswith(block + "."):
            kind, _, rest = name[len(block) + 1:].partition(".")
            if kind == "router":
                return f"{block}.gate.{rest.removeprefix('gate.')}"
            if kind == "experts" and rest in AUTOEP_EXPERTS:
                return f"{block}.experts.{AUTOEP_EXPERTS[rest]}"
    return name


def stock_names(full: dict[str, torch.Tensor], autoep: dict, device: torch.device,
                experts: bool = True) -> dict[str, torch.Tensor]:
    """AutoEP's tensors under the stock model's names and layout: its router's (router.gate.weight, the routing
    bias) as the block's gate's, its experts gathered over the EP group and fused back (gate_up_proj = [w1; w3] on
    dim 1, down_proj = w2). `autoep`: {block name: its AutoEP layer}. Collective (the gathers), in one order on every
    rank."""
    import torch.distributed as dist

    for block, layer in autoep.items():
        for key in [k for k in full if k.startswith(f"{block}.router.")]:
            full[stock_name(key, autoep)] = full.pop(key)
        if not experts:
            continue
        whole = {}
        for w in ("w1", "w2", "w3"):
            mine = full.pop(f"{block}.experts.{w}")
            pieces = [torch.empty_like(mine) for _ in range(layer.ep_size)]
            dist.all_gather(pieces, mine.to(device).contiguous(), group=layer.ep_group)
            whole[w] = torch.cat(pieces).cpu()
        full[f"{block}.experts.gate_up_proj"] = packed((whole["w1"], whole["w3"]), dim=1)
        full[f"{block}.experts.down_proj"] = whole["w2"]
    return full
