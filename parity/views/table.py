"""The table that picks the recorder's view of a model a user's loop trains (view_of): each row a module of this
folder whose `VIEW` reads one sharding, asked in order; the first whose `VIEW.read` answers reads it. A framework's
room reads its own module into a view (parity/frameworks/<name>/view.py) and hands the recorder that.

A peft PeftModel (wrapped or sharded as any model) is read through the Hugging Face model inside it, so that its names
are the harness's LoRA names; its adapters' settings are the view's `lora` (adapters.py). What trains is what requires
gradients: the parameter norm, the series and the optimizer's groups take those alone, as the harness's strategies do
under LoRA (the base frozen).

A multimodal model trained on text is read as its language model where it is whole on every rank (plain or DDP:
language_model.py). Refused in one line (ViewRefused): FSDP1 without use_orig_params, DeepSpeed's AutoTP, fully_shard
over several data-parallel meshes, LoRA adapters the replay cannot build, a multimodal model sharded,
ZeroRedundancyOptimizer(overlap_with_ddp=True).
"""

from __future__ import annotations

import importlib

import torch

from parity.models.families import hf_config, multimodal_refusal
from parity.precision import PolicyRequest
from parity.views.adapters import AdaptersRefused, lora_of
from parity.views.base import View, ViewRefused, torch_optimizer

# (module of parity/views/, what its VIEW reads): the first row whose VIEW.read answers (not None) reads the model
VIEWS = (("zero", "a DeepSpeed engine"), ("fsdp1", "FSDP1's root wrapper"),
         ("fully_shard", "FSDP2 / DTensor parameters"), ("zero_redundancy", "torch's ZeroRedundancyOptimizer"),
         ("data_parallel", "plain or DDP: whatever no other row reads"))


def view_classes() -> list[type[View]]:
    """The table's views, in its order (each module imported when asked: FSDP1's and DeepSpeed's only then)."""
    return [importlib.import_module(f"parity.views.{module}").VIEW for module, _ in VIEWS]


def policy_request(model) -> PolicyRequest | None:
    """The precision policy `model`'s own settings ask for: the first view's that reads one (View.policy_request: a
    DeepSpeed engine's config); None where none says."""
    return next((r for r in (cls.policy_request(model) for cls in view_classes()) if r is not None), None)


def view_of(model, optimizer, device: torch.device, unwrap) -> View:
    """The view of the user's `model` (as handed to the recorder: wrapped or not, accelerate's prepared model: DDP or
    the bare module), stepped by `optimizer` (or the torch optimizer inside its wrapper). ViewRefused, one line, for
    one the recorder cannot read, and for LoRA adapters the replay cannot build."""
    if isinstance(model, View):  # a view a framework's room read itself (parity/frameworks/<name>/view.py)
        return model
    optimizer = torch_optimizer(optimizer)
    view = next(v for v in (cls.read(model, optimizer, device, unwrap) for cls in view_classes()) if v is not None)
    config = hf_config(view.model)
    if config is not None and (why := multimodal_refusal(config)):  # sharded
        raise ViewRefused(why)
    try:
        view.lora = lora_of(view.model, view.names())  # a PEFT model's adapters, as the harness builds them
    except AdaptersRefused as exc:
        raise ViewRefused(str(exc)) from None
    return view


__all__ = ["VIEWS", "policy_request", "view_classes", "view_of"]
