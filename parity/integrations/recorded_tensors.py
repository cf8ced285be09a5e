"""Every trainable tensor's gradient and parameter norm at every recorded step, for the series beside the record
(parity/training/tensor_series.py): read from the loop's layout (sharded.py: each layout's pieces, with the harness's
own code for that sharding), summed over the ranks as a harness run sums them (parity/training/tensor_norms.py).

Which gradient a record holds follows from where the loop lets the recorder see it, declared once for the run:
- PRE_CLIP, before the loop's clipping: read at before_step() — a hand-written loop calls it there, Lightning's
  on_before_optimizer_step comes before its clipping, and a DeepSpeed loop calls it before the boundary's
  engine.step(), while ZeRO still holds the reduced partitions (engine.step() clips and frees them);
- CLIPPED, after the framework clipped: read at the optimizer's step pre-hook (Trainer's callbacks all come after its
  clipping), with the step's clip coefficient beside it — torch's formula on the step's recorded pre-clip norm and the
  loop's max_grad_norm: the clipped gradient is the pre-clip one × it.
A step whose gradients were not seen there (before_step() not called, or only after the optimizer's step applied them,
when they are gone or ZeRO's partitions stale: a step post-hook says when) holds NaN for every gradient norm and its
parameter norms as measured; one line names the first such step. A read that fails leaves its step so too: a recorder
failure never stops the user's training. Not the step pre-hook's count: Lightning's optimizer step runs its closure —
forward, backward, on_before_optimizer_step — inside the step, after that hook.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable

import torch

from parity.training.optimizer import clip_coefficient
from parity.training.tensor_norms import CLIPPED, PRE_CLIP, local_squares, norms_of

__all__ = ["CLIPPED", "PRE_CLIP", "RecordedTensors"]


class RecordedTensors:
    """One recorded run's per-tensor norms, on every rank: `layout` (sharded.py) hands over the pieces, `grad` says
    which gradient the record holds (PRE_CLIP or CLIPPED), `max_grad_norm` is what the loop clips to (0: it does not),
    `log` takes rank 0's lines."""

    def __init__(self, layout, device: torch.device, grad: str, max_grad_norm: float, log: Callable[[str], object]):
        if grad not in (PRE_CLIP, CLIPPED):
            raise ValueError(f"tensor_grad {grad!r}: {PRE_CLIP!r} or {CLIPPED!r}")
        self.layout, self.device, self.grad, self.log = layout, device, grad, log
        self.clipping = SimpleNamespace(max_grad_norm=max_grad_norm)  # what clip_coefficient reads
        self.names = layout.tensor_names()
        self.squares: torch.Tensor | None = None  # this step's gradient squares, once read
        self.applied = False  # whether the optimizer's step has applied this step's gradients (its post-hook)
        self.missed = False  # whether a step's gradients went unseen already (its line said so)

    def observer_arguments(self) -> dict:
        """What the StepObserver takes of the series: the names and which gradient."""
        return {"tensor_names": self.names, "tensor_grad": self.grad}

    def watch(self, optimizer, pre_hook) -> "Hooks":
        """The recorder's step `pre_hook` on `optimizer` and a post-hook that marks this step's gradients applied, as
        one handle the recorder removes."""
        return Hooks(optimizer.register_step_pre_hook(pre_hook),
                     optimizer.register_step_post_hook(lambda *_: setattr(self, "applied", True)))

    def read(self, where: str) -> None:
        """The gradients' squares of this rank's pieces, where the loop stands at `where` (PRE_CLIP: before_step;
        CLIPPED: the optimizer's step pre-hook) if that is the record's place, this step's are not read yet and the
        optimizer has not applied them. Local."""
        if where != self.grad or self.squares is not None or self.applied:
            return
        try:
            self.squares = local_squares(self.layout.gradient_pieces(), self.names, self.device)
        except Exception:  # the step's gradients are NaN (module docstring): never the user's training
            self.squares = None

    def local(self, step: int) -> torch.Tensor:
        """This rank's float64 sums of squares of step `step` (after the optimizer's step): every tensor's gradient's
        (NaN where unseen), then its parameter's — summed over the world in rank order (the recorder's step exchange
        carries them, as a harness strategy's ride its loss gather: Strategy.gather_step), they are `norms`' `summed`. Local."""
        squares = self.squares
        if squares is None:
            squares = torch.full((len(self.names),), math.nan, dtype=torch.float64, device=self.device)
            if not self.missed:
                self.missed = True
                place = ("before_step() before clipping (before a DeepSpeed loop's engine.step())"
                         if self.grad == PRE_CLIP else "the optimizer's step")
                self.log(f"step {step}: the gradients were not seen at {place}: its tensors' gradient norms are NaN, "
                         f"and so are any later step's that are not seen either")
        self.squares, self.applied = None, False
        return torch.cat([squares, local_squares(self.layout.parameter_pieces(), self.names, self.device)])

    def norms(self, summed: torch.Tensor, grad_norm: float) -> dict:
        """Every tensor's gradient and parameter norm from `summed` (local's, summed over the world), and under CLIPPED
        the step's clip coefficient from its pre-clip `grad_norm`: observe_step's arguments."""
        grads, params = norms_of(summed)
        coef = clip_coefficient(grad_norm, self.clipping) if self.grad == CLIPPED else None
        return {"tensor_grad_norms": grads, "tensor_param_norms": params, "clip_coef": coef}


class Hooks:
    """Hook handles removed together."""

    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
