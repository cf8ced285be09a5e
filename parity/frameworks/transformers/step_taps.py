"""What Trainer computes at every step but logs only at its logging steps, taken at every step: the loss each
micro-batch's `training_step` returns, summed as Trainer sums them into its `_tr_loss` and gathered and averaged over
the ranks as its log does (`nested_gather(...).mean()`), and the gradient norm its `_get_grad_norm` returns (its logs'
`grad_norm`). The callback reads them at `on_step_end`, so a run logging every 500 steps (Trainer's default) is recorded
as one logging every step would be: the same two numbers, bit for bit, at each step.

The taps wrap the two methods on the Trainer instance (the class is left alone) and are removed at the end of training.
"""

from __future__ import annotations

import torch

TAPPED = ("training_step", "_get_grad_norm")


class StepTaps:
    """The step's loss and gradient norm as Trainer computes them (take() at on_step_end; remove() at the end)."""

    def __init__(self, trainer):
        self.trainer, self.loss, self.norm = trainer, None, None
        self._own = {name: trainer.__dict__[name] for name in TAPPED if name in trainer.__dict__}
        step, norm = trainer.training_step, trainer._get_grad_norm

        def training_step(*args, **kwargs):
            loss = step(*args, **kwargs)
            if self.loss is None:
                self.loss = torch.zeros((), device=loss.device)  # Trainer's _tr_loss: fp32, zeroed at each log
            self.loss += loss.detach()
            return loss

        def get_grad_norm(*args, **kwargs):
            self.norm = norm(*args, **kwargs)
            return self.norm

        trainer.training_step, trainer._get_grad_norm = training_step, get_grad_norm

    def take(self) -> tuple[float | None, float | None]:
        """(the step's loss as Trainer logs it at logging_steps=1, its gradient norm as it logs it); None for what the
        step did not compute. A collective over the ranks where they are several (every rank calls it)."""
        from transformers.trainer_pt_utils import nested_gather

        loss = None if self.loss is None else \
            nested_gather(self.loss, self.trainer.args.parallel_mode).mean().item()
        norm = self.norm.item() if isinstance(self.norm, torch.Tensor) else self.norm
        self.loss, self.norm = None, None
        return loss, None if norm is None else float(norm)

    def remove(self) -> None:
        for name in TAPPED:
            self.trainer.__dict__.pop(name, None)
        self.trainer.__dict__.update(self._own)
