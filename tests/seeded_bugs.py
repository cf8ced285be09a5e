"""Test copies of the FSDP strategy, each with one real bug seeded in it: what the calibrated verdict must
FAIL. Each changes the training while the record says nothing changed (the config is the correct one's)."""

from __future__ import annotations

import torch

from fsdp_strategy import FSDPStrategy, global_norm
from parity.training.strategy import step_optimizer


class ClippingSkipped(FSDPStrategy):
    """The pre-clip norm is computed and recorded, the gradients are never scaled."""

    def optimizer_step(self, lr: float) -> float:
        with torch.no_grad():
            norm = global_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        step_optimizer(self.optimizer, lr)
        return norm


class WeightDecayAdded(FSDPStrategy):
    """AdamW gets weight_decay 0.01 while the config (and so the record) says 0."""

    def setup(self, model) -> None:
        super().setup(model)
        for group in self.optimizer.param_groups:
            group["weight_decay"] = 0.01


class LearningRateOff(FSDPStrategy):
    """Every step runs at 1.05 × the scheduled learning rate (the record holds the scheduled one)."""

    def optimizer_step(self, lr: float) -> float:
        return super().optimizer_step(lr * 1.05)


class GradientsSummedOverDP(FSDPStrategy):
    """Gradients summed over the DP ranks instead of averaged: dp_size × the mean, before the norm."""

    def optimizer_step(self, lr: float) -> float:
        with torch.no_grad():
            torch._foreach_mul_([p.grad.to_local() for p in self.model.parameters() if p.grad is not None],
                                float(self.ctx.dp_size))
        return super().optimizer_step(lr)


class AdamBeta2Off(FSDPStrategy):
    """AdamW runs with beta2 0.99 while the config says 0.999."""

    def setup(self, model) -> None:
        super().setup(model)
        for group in self.optimizer.param_groups:
            group["betas"] = (group["betas"][0], 0.99)


SEEDED_BUGS = (ClippingSkipped, WeightDecayAdded, LearningRateOff, GradientsSummedOverDP, AdamBeta2Off)
