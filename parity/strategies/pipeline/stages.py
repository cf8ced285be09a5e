"""The pipeline strategy's stages (pipeline_strategy.py): its schedules and their rules on micro-batches, a stage as a
view of the stock model with the other stages' layers passed through, and the rank's own modules under their Hugging
Face names. Why a stage is a view of the whole model, not a model of its own: pipeline_strategy.py's docstring."""

from __future__ import annotations

import copy

import torch
from torch import nn

# torch.distributed.pipelining's schedule classes, by name: the package is imported at setup, not with this module,
# which every driver imports for its flags (0.6 s of a main job that runs no pipeline)
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


def state_file(pp_rank: int) -> str:
    """A checkpoint's file of one pipeline rank: its stages' parameters (HF names) and its optimizer's state."""
    return f"pipeline_pp_rank{pp_rank}.pt"


def stage_count(schedule: str, pp_size: int) -> int:
    """The stages of `schedule` (--pp_schedule) over `pp_size` pipeline ranks."""
    return pp_size * STAGES_PER_RANK[schedule]


def microbatches_fit(schedule: str, pp_size: int, m: int) -> bool:
    """Whether the schedule runs `m` micro-batches (torch's own rules): GPipe any number; 1F1B at least one per stage;
    interleaved 1F1B whole rounds of max(1, m // pp_size) micro-batches each (so m ≤ pp_size, or a multiple of
    m // pp_size: 1, 2, 3, 4, 6, 8 ... at pp_size 2)."""
    if schedule == "1f1b":
        return m >= pp_size
    if schedule == "interleaved_1f1b":
        return m % max(1, m // pp_size) == 0
    return True


def microbatches_requirement(schedule: str, pp_size: int, m: int) -> str:
    """What to use instead of `m`, in words."""
    if schedule == "1f1b":
        return f"at least one per stage: use --microbatches {pp_size} or more"
    fits = [k for k in range(max(1, m - 2 * pp_size), m + 2 * pp_size) if microbatches_fit(schedule, pp_size, k)]
    below, above = max(k for k in fits if k < m), min(k for k in fits if k > m)
    return f"whole rounds of max(1, microbatches // pp_size): use --microbatches {below} or {above}"


class PassThrough(nn.Module):
    """What a stage runs in place of a module another stage owns: its first input, unchanged."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def stage_view(model, family, layers: range, last: bool) -> nn.Module:
    """A view of the stock causal LM that runs the layers `layers` and, on the `last` stage, what follows the stack:
    a shallow copy of the model and of its base model that shares every module and parameter, with PassThrough in
    place of the decoder layers other stages own (and of the base model's final modules before the last stage). The
    model's own forward then computes around the layers exactly what it does unsplit — position ids, each layer
    type's mask and rotary table (Gemma3's sliding and full layers), the embedding's scale, the final norm and
    lm_head — for any family, with each layer at its own index."""
    base_name = model.base_model_prefix
    base = getattr(model, base_name)
    view_base = copy.copy(base)
    view_base._modules = dict(base._modules)  # its own child table; the children themselves are shared
    stack = model.get_submodule(family.stack)
    setattr(view_base, family.stack.rsplit(".", 1)[-1],
            nn.ModuleList([layer if i in layers else PassThrough() for i, layer in enumerate(stack)]))
    if not last:
        for name in family.final:
            if name.startswith(base_name + "."):
                setattr(view_base, name.split(".", 1)[1], PassThrough())
    view = copy.copy(model)
    view._modules = dict(model._modules)
    setattr(view, base_name, view_base)
    return view


class StageModule(nn.Module):
    """One stage: the stock model's forward over this stage's layers (stage_view). Input: token ids (the first stage)
    or the hidden states the previous stage sent; output: hidden states, or the logits (the last stage)."""

    def __init__(self, view: nn.Module, first: bool, last: bool, autocast):
        super().__init__()
        self.first, self.last, self.autocast = first, last, autocast
        object.__setattr__(self, "view", view)  # not a submodule: its parameters belong to the rank's tree

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if position_ids is not None:  # packed or flattened rows': each stage masks its documents apart, rotates by them
            inputs["position_ids"] = position_ids
        with self.autocast():
            if self.last:
                return self.view(**inputs, use_cache=False).logits
            return getattr(self.view, self.view.base_model_prefix)(**inputs, use_cache=False).last_hidden_state


def rank_tree(model, family, owned: list[str], layer_ids: list[int]) -> nn.Module:
    """This rank's modules under their Hugging Face names: the `owned` ends of the model (the embedding on the first
    stage's rank, the final norm and lm_head on the last's), its decoder layers (`layer_ids`, under
    "<stack>.<index>"), and what every stage runs that holds no parameters (the rotary table); and the model's
    config, which what reads a Hugging Face model (the layer check's recorder, the family) finds there."""
    tree = nn.Module()
    tree.config = model.config

    def place(name: str, module: nn.Module) -> None:
        *path, leaf = name.split(".")
        node = tree
        for part in path:
            if not hasattr(node, part):
                setattr(node, part, nn.Module())
            node = getattr(node, part)
        setattr(node, leaf, module)

    for name in owned:
        place(name, model.get_submodule(name))
    stack = nn.ModuleDict({str(i): model.get_submodule(family.stack)[i] for i in layer_ids})
    place(family.stack, stack)
    base = model.base_model_prefix
    ends = {family.embedding, family.stack, *family.final}
    for name, child in getattr(model, base).named_children():
        if f"{base}.{name}" not in ends and not any(True for _ in child.parameters()):
            place(f"{base}.{name}", child)
    return tree
