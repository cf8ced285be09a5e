"""fp16's dynamic loss scaling for the strategies that step the shared AdamW themselves (DDP, FSDP2, the pipeline, your
own), with DeepSpeed's rules, so that a DeepSpeed fp16 run and its DDP baseline scale, skip and recover alike.

DeepSpeed's DynamicLossScaler (deepspeed/runtime/fp16/loss_scaler.py), by its fp16 config keys: the scale starts at
2**initial_scale_power; a step whose gradients hold an inf or a NaN on any rank is skipped, and after `hysteresis`
such steps (not necessarily consecutive; `consecutive_hysteresis` refills the count at every good step) the scale is
halved, never below min_loss_scale (an overflow at the minimum stops the run, as DeepSpeed raises); every
loss_scale_window good steps since the last overflow double it (and refill the hysteresis). A loss_scale > 0 is a
static scale: never changed, and an overflow still skips its step. torch's GradScaler has neither hysteresis nor a
minimum, and refuses fp16 gradients.

One rule differs by design: the gradients are unscaled by the scale they were computed with. DeepSpeed's ZeRO step
updates the scale first and unscales by `self.loss_scale` afterwards, so on a step where the scale grows an unclipped
gradient is divided by the new (doubled) scale; with clipping active its combined factor cancels the scale. The
teacher-forced check FAILs DeepSpeed's fp16 mode at those steps (docs/deepspeed.md; tests/test_precision.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from parity.errors import RunStopped
from parity.precision import LOSS_SCALING_DEFAULTS, LossScaling
from parity.training.optimizer import OptimizerStep


@dataclass
class LossScaler(LossScaling):
    """DeepSpeed's dynamic loss scaler (module docstring), with its config keys (parity.precision.LossScaling's fields,
    the policy table's) as constructor arguments."""

    def __post_init__(self):
        self.scale = float(self.loss_scale) if self.loss_scale else float(2 ** self.initial_scale_power)
        self.iteration, self.last_overflow, self.hysteresis_left = 0, -1, self.hysteresis
        # Whether an overflow is looked for on every rank of the run (a collective) or in this process's gradients
        # alone: a step taken by one process for itself (the teacher-forced check's reference) joins no collective.
        self.collective = True

    @property
    def dynamic(self) -> bool:
        return not self.loss_scale

    def update(self, overflow: bool) -> None:
        """After a step: its gradients overflowed (the step is skipped) or not."""
        if self.dynamic and overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale == self.min_loss_scale:
                    raise RunStopped(f"fp16 gradients overflow at the minimum loss scale ({self.min_loss_scale:g}) at "
                                     f"step {self.iteration}: the loss scale cannot go lower (DeepSpeed stops here too); "
                                     f"lower --learning_rate or --min_loss_scale, or train in bf16")
                self.scale = max(self.scale / 2, self.min_loss_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        elif self.dynamic:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.loss_scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2
        self.iteration += 1

    @torch.no_grad()
    def unscale_or_skip(self, grads: list[torch.Tensor], device: torch.device) -> bool:
        """After backward (gradients reduced): whether any rank's `grads` (plain tensors: local shards of DTensors) hold
        an inf or a NaN — then the step is to be skipped — with the scale updated either way; if not, the gradients
        are divided by the scale they were computed with, in place. Collective (unless `collective` is off)."""
        overflow = any_nonfinite(grads, device, collective=self.collective)
        scale = self.scale
        self.update(overflow)
        if not overflow:
            torch._foreach_mul_(grads, 1.0 / scale)
        return overflow

    def state_dict(self) -> dict:
        return {**asdict(self), "scale": self.scale, "iteration": self.iteration, "last_overflow": self.last_overflow,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        for key in ("scale", "iteration", "last_overflow", "hysteresis_left"):
            setattr(self, key, state[key])


class FollowedScaler:
    """A recorded fp16 run's loss scaler, followed by its replay (parity/replay/replay.py: RunConfig.loss_scales, the
    record's scale and skip of each step): each step's gradients are computed at the record's scale, and the step is
    skipped where the record skipped it — not where the replay's own gradients overflow: at the edge of fp16's range
    one side overflows and the other not, and a correct run would FAIL there. Whether the replay's own gradients
    overflowed at that scale is kept (`overflowed`: the step's record, which the verdict reports where it is not the
    record's skip). Where they overflowed at a step the record applied, the step is computed again (`again`) at half
    the scale, up to RETRIES times, and applied: a power of 2 scales every fp16 rounding alike, so the gradients are
    those of the record's scale but where they fall below fp16's normal range. Whether the record's skips and scales
    are right is judged from the record (parity/comparing/loss_scales.py)."""

    RETRIES = 4

    def __init__(self, steps):
        self.steps = [(float(scale), bool(skipped)) for scale, skipped in steps]
        self.iteration, self.halvings, self.overflowed, self.again, self.collective = 0, 0, None, False, True

    @property
    def scale(self) -> float:
        return self.steps[min(self.iteration, len(self.steps) - 1)][0] / 2 ** self.halvings

    @torch.no_grad()
    def unscale_or_skip(self, grads: list[torch.Tensor], device: torch.device) -> bool:
        """LossScaler's, by the record: whether the step is not applied now — skipped as the record skipped it, or
        to be computed again at half the scale (`again`) —; if it is, the gradients divided by their scale in place.
        Collective (unless `collective` is off)."""
        overflow = any_nonfinite(grads, device, collective=self.collective)
        self.overflowed = overflow if not self.halvings else self.overflowed
        skipped = self.steps[min(self.iteration, len(self.steps) - 1)][1]
        self.again = overflow and not skipped and self.halvings < self.RETRIES
        if self.again:
            self.halvings += 1
            return True
        if not (skipped or overflow):  # overflowing still: not applied, and the verdict's skip rule FAILs there
            torch._foreach_mul_(grads, 1.0 / self.scale)
        self.iteration, self.halvings = self.iteration + 1, 0
        return skipped or overflow

    def state_dict(self) -> dict:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = state["iteration"]


def scaler_of(cfg) -> LossScaler | FollowedScaler | None:
    """The run's fp16 loss scaler: a replay's of an fp16 record follows the record's (cfg.loss_scales); any other fp16
    run's is the harness's own, by the run's settings (a record's `rules`, which the verdict reads, left out); None
    outside fp16."""
    if getattr(cfg, "loss_scales", None):
        return FollowedScaler(cfg.loss_scales)
    if not cfg.loss_scaling:
        return None
    return LossScaler(**{k: v for k, v in cfg.loss_scaling.items() if k in LOSS_SCALING_DEFAULTS})


def unscaled_or_skipped(scaler: LossScaler | FollowedScaler | None, grads: Iterable[torch.Tensor],
                        device: torch.device, zero_grad: Callable[[], None]) -> OptimizerStep | None:
    """fp16's unscale-or-skip before a step, written once for every strategy that runs the harness's scaler (the
    PolicyOptimizer's plain tensors, the DTensor strategies' local shards): None where the step goes on — there is no
    scaler, or the gradients `grads` (plain tensors, read only under a scaler) held no inf or NaN on any rank and are
    now unscaled in place —, else the skipped step's OptimizerStep (norm inf, the scale its gradients were computed
    with; `again` where a FollowedScaler computes it again), every gradient dropped by `zero_grad`. Collective under a
    scaler."""
    if scaler is None:
        return None
    scale = scaler.scale
    if not scaler.unscale_or_skip(list(grads), device):
        return None
    zero_grad()
    return OptimizerStep(float("inf"), skipped=True, loss_scale=scale, again=getattr(scaler, "again", False),
                         overflowed=getattr(scaler, "overflowed", None))


def applied(scaler: LossScaler | FollowedScaler | None, norm: float, scale: float) -> OptimizerStep:
    """The OptimizerStep of a step applied (pre-clip norm `norm`) under `scaler`: the scale its gradients were computed
    with, and a replay's overflow at the record's scale (FollowedScaler.overflowed)."""
    return OptimizerStep(norm, loss_scale=scale if scaler else None, overflowed=getattr(scaler, "overflowed", None))


def any_nonfinite(tensors, device: torch.device, group=None, collective: bool = True) -> bool:
    """Whether any rank's `tensors` (local gradients, or a DTensor's local shards) hold an inf or a NaN. Collective over
    `group` (default: every rank of the run), so that every rank skips the same steps; without `collective`, this
    process's tensors alone."""
    flags = [(~torch.isfinite(t)).any().to(device) for t in tensors]  # on the device: one host sync, not one a tensor
    flag = torch.stack(flags).any().float().reshape(1) if flags else torch.zeros(1, device=device)
    if collective:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
