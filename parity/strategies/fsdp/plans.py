"""The FSDP2 strategy's plans: how a model family's decoder layers are tensor-parallelised (the default Megatron-style
plan, or with sequence parallelism between the TP regions) and how a mixture of experts' experts are spread (over
"ep", or within each expert over "tp"). They live apart from fsdp_strategy.py, which keeps the strategy class and its
FSDP2 wrapping, because they are written from the family seam (parity.models.families) alone — never from
transformers' own plan, so the two TP implementations check each other — and the seeded bugs
(parity.calibration.bugs) build their faulty plans from these pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from parity.models.adapters import ADAPTER_NAME as ADAPTER
from parity.models.families import family_of
from parity.models.packing import per_rank_placement
from parity.strategies.fsdp.expert_parallel import apply_ep, apply_etp


class PackedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a linear layer whose output packs `parts` equal parts (Phi3's gate_up_proj: gate, then up),
    sharded part by part: TP rank r holds the r-th slice of every part (parity/models/packing.py), so its local
    output is [gate_r, up_r] and the model's own chunk(2) pairs each gate column with its up column on every rank —
    the MLP's activation and down_proj (rowwise) then run on local shards as for separate gate/up projections.
    Sharded as one block (Shard(0)), rank 0 would hold all of gate and rank 1 all of up: the bug
    parity.calibration.bugs:FSDPFusedGateUpSplitInHalves. DTensor carries the strided layout through the matmul and
    its gradient, so full tensors, norms, FSDP2 and checkpoints see the true parameter."""

    def __init__(self, parts: int):
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters():
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [per_rank_placement(self.parts)],
                                  src_data_rank=self.src_data_rank), requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()  # this rank's slice of every part, in the packed order


class WidthNormParallel(ParallelStyle):
    """A norm over the whole width of a head-sharded projection's output (OLMo2's q_norm/k_norm: RMSNorm over all
    heads × head_dim). Its weight is sharded like the projection's output (Shard(0)), and it runs on the
    projection's output as a DTensor sharded on the last dim (ColwiseParallel(use_local_output=False)): DTensor
    takes the mean of squares over the whole width (a sum over the TP ranks), so every rank normalises its heads by
    the full-width statistic, then hands the attention its local heads. Run on the local shard alone, each rank would
    normalise by its own heads' statistic: the bug parity.calibration.bugs:FSDPWidthNormOnLocalShard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name, mod, mesh):
            for pname, param in mod.named_parameters(recurse=False):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        return distribute_module(module, device_mesh, shard,
                                 output_fn=lambda mod, outputs, mesh: outputs.to_local())


@dataclass(frozen=True)
class TPPlan:
    """The harness's torch-native TP plan of one model family's decoder layer (names relative to a layer), and the
    modules whose output each rank holds only its piece of: {name: (the dim it is sharded on, the parts of a packed
    output)} — what the layer check gathers back to full size."""

    layer: dict
    local_outputs: dict[str, tuple[int, int]]


def tp_plan(family, sequence_parallel: bool = False, norm_style=SequenceParallel) -> TPPlan:
    """The plan, from what the family decides (parity.models.families) — never from transformers' own plan, so
    the two TP implementations check each other. Megatron-style: the projections that read the residual stream
    are colwise, the ones that write back to it rowwise (one all-reduce per block); the residual stream, its norms
    and the logits stay replicated (with `sequence_parallel`: sharded over the sequence between the TP regions).

    - q/k/v (and gate/up) colwise with local outputs: HF attention reshapes with view(..., -1, head_dim), so each
      rank sees its heads ÷ tp query and KV heads (tp divides the KV heads, checked before launch) and the GQA
      ratio holds; no attention code is patched.
    - A fused qkv (Phi3): the attention slices its output at full-width offsets from the config, so the output is
      gathered (Replicate) and attention runs whole on every rank; o_proj takes its rows of the replicated input.
    - A fused gate_up (Phi3): sharded part by part (PackedColwiseParallel), local output.
    - Per-head q/k norms (Qwen3, Gemma3): replicated weights on inputs sharded over the heads dim — SequenceParallel
      on that dim, so each rank's gradient is a Partial DTensor that FSDP2 sums over tp (left as plain modules, the
      gradients stay per rank: parity.calibration.bugs:FSDPHeadNormGradientsUnreduced).
    - Full-width q/k norms (OLMo2): WidthNormParallel on the projection's DTensor output.
    The tied embedding / lm_head stays replicated: a vocab-parallel pair would need a manual re-tie and a
    vocab-parallel loss, while a replicated one keeps the tie as one Parameter and computes exactly DDP's logits."""
    plan, local = {}, {}
    fused_qkv = any(p.fused for p in family.attention_in)
    for proj in family.attention_in:
        if proj.fused:
            plan[proj.name] = ColwiseParallel(output_layouts=Replicate())
        elif proj.name in family.width_norms.values():
            plan[proj.name] = ColwiseParallel(use_local_output=False)
        else:
            plan[proj.name], local[proj.name] = ColwiseParallel(), (-1, 1)
    for norm, heads_dim in family.head_norms.items():
        plan[norm], local[norm] = SequenceParallel(sequence_dim=heads_dim, use_local_output=True), (heads_dim, 1)
    for norm in family.width_norms:
        plan[norm], local[norm] = WidthNormParallel(), (-1, 1)
    for proj in family.mlp_in:
        plan[proj.name] = PackedColwiseParallel(len(proj.parts)) if proj.fused else ColwiseParallel()
        local[proj.name] = (-1, len(proj.parts))
    if family.mlp_act:  # a mixture of experts whose every layer is sparse has no dense MLP
        local[family.mlp_act] = (-1, 1)
    attention_input = Replicate() if fused_qkv else Shard(-1)
    if not sequence_parallel:
        plan[family.attention_out] = RowwiseParallel(input_layouts=attention_input)
        if family.mlp_out:
            plan[family.mlp_out] = RowwiseParallel()
        return TPPlan(plan, local)
    plan.update({norm: norm_style() for norm in family.layer_norms})
    plan[family.attention] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                use_local_output=True)
    plan[family.attention_out] = RowwiseParallel(input_layouts=attention_input, output_layouts=Shard(1),
                                                 use_local_output=False)
    plan[family.mlp] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    plan[family.mlp_out] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return TPPlan(plan, local)


def apply_tp(model, tp_mesh: DeviceMesh, plan: TPPlan) -> None:
    """Tensor-parallelise each decoder layer by `plan` (the rules naming its modules: a dense MLP's are not a sparse
    layer's); leave the embedding, lm_head and the residual stream's norms replicated over tp."""
    for layer in model.get_submodule(family_of(model.config).stack):
        parallelize_module(layer, tp_mesh, layer_rules(layer, plan.layer))


def tensor_parallel(model, tp_mesh: DeviceMesh) -> None:
    """The harness's TP plan for `model`'s family applied over `tp_mesh` (a loop of your own sharding a transformers
    model as FSDP2 + TP does: examples/sharded_loop.py --tp 2; public as parity.tensor_parallel)."""
    apply_tp(model, tp_mesh, tp_plan(family_of(model.config)))


def layer_rules(layer, rules: dict) -> dict:
    """The rules of a plan that name a module of this decoder layer; a module peft wrapped in a LoRA layer
    (--lora_r: parity/models/adapters.py) by adapter_rules, and one it saves whole (--lora_modules_to_save) by the
    module's rule for both its frozen original and its trained copy."""
    names = dict(layer.named_modules())
    found = {}
    for name, style in rules.items():
        if name not in names:
            continue
        if hasattr(names[name], "lora_A"):
            found.update(adapter_rules(name, style))
        elif hasattr(names[name], "modules_to_save"):
            found.update({f"{name}.original_module": style, f"{name}.modules_to_save.{ADAPTER}": style})
        else:
            found[name] = style
    return found


def adapter_rules(name: str, style: ParallelStyle) -> dict:
    """The rules for peft's LoRA layer `name` (its output: base_layer(x) + lora_B(lora_A(x)) × scale) in place of
    `style`, the rule of the projection it wraps: the projection (base_layer) by `style`, and its adapter path so that it
    adds the same piece of the output. A colwise projection's lora_B is colwise like it (lora_A, r × in, reads the
    replicated input whole: its gradient, a sum over the TP ranks' output columns, is all-reduced by lora_B's input
    layout); a rowwise projection's lora_A is rowwise (it reads the same input shard, its r outputs all-reduced) and
    lora_B, out × r, stays whole. A rowwise output left sharded (sequence parallelism) has no such partner: the
    strategy refuses LoRA there."""
    adapter = f"{name}.lora_{'{}'}.{ADAPTER}"
    if isinstance(style, ColwiseParallel):
        return {f"{name}.base_layer": style, adapter.format("B"): style}
    if isinstance(style, RowwiseParallel) and style.output_layouts == (Replicate(),):
        return {f"{name}.base_layer": style, adapter.format("A"): RowwiseParallel(input_layouts=style.input_layouts[0])}
    raise ValueError(f"no LoRA rule for {name} under {type(style).__name__} with outputs {style.output_layouts}")


def local_output_of(plan: TPPlan, name: str) -> tuple[int, int] | None:
    """The plan's local output (TPPlan.local_outputs) of the layer's module `name`, LoRA's modules too: a wrapped
    projection's base_layer and (colwise) lora_B hold the piece of its output the projection would (adapter_rules), as a
    saved module's original and copy do (layer_rules); the
    adapters' dropout (an identity at --lora_dropout 0) outputs the projection's input, a rowwise one's shard of it."""
    dropout = f".lora_dropout.{ADAPTER}"
    if name.endswith(dropout):
        style = plan.layer.get(name[:-len(dropout)])
        sharded = isinstance(style, RowwiseParallel) and isinstance(style.input_layouts[0], Shard)
        return (-1, 1) if sharded else None
    for suffix in (".base_layer", f".lora_B.{ADAPTER}", ".original_module", f".modules_to_save.{ADAPTER}"):
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return plan.local_outputs.get(name)


def apply_moe(model, mesh: DeviceMesh, ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh, etp=apply_etp) -> None:
    """A mixture of experts' experts: over "ep" by expert with all-to-all token dispatch when --ep_size > 1
    (expert_parallel.apply_ep), else split within each expert over "tp" when --tp_size > 1 (expert_parallel.apply_etp,
    by the family's description of the fused weights); the routers and shared experts stay replicated, as the
    residual stream they read. `mesh` is the ("dp", "tp") mesh."""
    family = family_of(model.config)
    stack = model.get_submodule(family.stack)
    for i in family.moe.layers:
        experts = stack[i].get_submodule(family.moe.experts)
        if ep_mesh is not None:
            apply_ep(experts, ep_mesh["ep"], tp_mesh)
        elif tp_mesh.size() > 1:
            etp(experts, tp_mesh, family.moe.expert_weights)


def apply_sequence_parallel(model, tp_mesh: DeviceMesh, plan: TPPlan, norm_style=SequenceParallel) -> None:
    """--tp_plan sequence_parallel: the default plan, plus the residual stream and its norms sharded over the sequence
    between the TP regions (torchtitan's plan, on Hugging Face's modules; `plan` is tp_plan(..., sequence_parallel)).

    Layer 0 takes the replicated embedding output and keeps its own sequence chunk (Shard(1), no communication); each
    of the layer's norms (SequenceParallel) normalises the chunk it holds; attention and the MLP all-gather the
    sequence before their colwise projections (PrepareModuleInput); the rowwise projections reduce-scatter their
    partial sums back onto sequence chunks (Shard(1) outputs) instead of all-reducing them. The residual stream
    between layers is a DTensor sharded over the sequence; the final norm runs on chunks too, and lm_head gathers the
    sequence back: the logits are DDP's full ones, the tied embedding stays replicated as in the default plan. Same
    collectives' volume as the default plan's all-reduces; the activations between the regions take 1/tp_size of
    the memory.

    The norm weights are replicated over tp but each rank's chunk gives only its part of their gradient: a Partial
    DTensor that must be summed over tp before the gradient norm and clipping (FSDP2 does it when it reduce-scatters
    over dp; clip_sharded_gradients asserts no gradient is still Partial). A norm taken of the local parts, or
    weights kept as plain tensors, is the classic bug of this plan: the copy
    parity.calibration.bugs:FSDPSequenceParallelNormsUnreduced."""
    family = family_of(model.config)
    for i, layer in enumerate(model.get_submodule(family.stack)):
        layer_plan = dict(plan.layer)
        if i == 0:  # the embedding's full output → this rank's sequence chunk
            layer_plan[""] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                use_local_output=False)
        parallelize_module(layer, tp_mesh, layer_plan)
    *final_norms, head = family.final
    parallelize_module(model, tp_mesh, {**{norm: norm_style() for norm in final_norms}, head: PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)})
