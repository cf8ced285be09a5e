"""Seeded bugs inside a strategy's own optimizer step, between where the tensor record used to read the gradients (after
backward, before optimizer_step) and where the strategy takes the norm it clips by (issue 58; tests/test_calibration.py,
docs/tensors.md#reading-point). Copies of each strategy family, importable by path as parity.calibration.bugs' entries
are, recording under the strategy's name.

At one step (STEP: no checkpoint, no teacher-forced check there) each doubles one tensor's gradient in its optimizer
step, before the clip — a reduction or unscaling done twice in a framework's step, a hook that edits a gradient. Read at
the clip, the tensor record sees the doubled tensor and the tensor verdict names it at that step; the three curves see
its share of the global norm only. `...ScaledAfterTheRead` scales every gradient after the read and before the norm: the
record's invariant (parity/comparing/clip_read.py) FAILs it at that step.

SCALED_FROM_STEP_0: bugs whose only sign used to be the global grad norm between 1e-5 and 1e-4 in fp32 (before issue
52's 1e-4 bound): a scale too small for the tensor verdict's fixed fp32 bound (1e-3 of the tensor) on a tensor with a
large share of the global norm, at every step. The teacher-forced check's step from the run's own state holds the grad
norm to 1e-5 at step 0 and FAILs them there.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from autotp_strategy import DeepSpeedStrategy
from ddp_strategy import DDPStrategy
from fsdp_strategy import FSDPStrategy
from pipeline_strategy import PipelineStrategy
from transformers_strategy import TransformersStrategy

STEP = 3  # the step each acts at (the calibration setting checkpoints never, the teacher-forced check runs at 0)
TENSOR = "model.layers.1.post_attention_layernorm.weight"  # 64 elements, replicated over TP: ~3e-3 of the global norm
EMBEDDING = "model.embed_tokens.weight"  # about 55 % of qwen2-tiny's squared gradient norm
SHARDED = "model.layers.0.self_attn.v_proj.weight"  # about 11 %, column-parallel under TP
EMBEDDING_SCALE, SHARD_SCALE = 1 + 1e-4, 1 + 1e-3  # each moves the global norm by ~5e-5


class _InStep:
    """A copy whose `corrupt()` runs in its optimizer step at STEP (every step: `every_step`), before the clip."""

    every_step = False

    def train_step(self, batch, global_tokens, lr, observe=None):
        self.step_index = getattr(self, "step_index", -1) + 1
        return super().train_step(batch, global_tokens, lr, observe)

    def acts(self) -> bool:
        return self.every_step or getattr(self, "step_index", -1) == STEP

    def optimizer_step(self, lr: float):
        if self.acts():
            with torch.no_grad():
                self.corrupt()
        return super().optimizer_step(lr)

    def gradient(self, name: str) -> torch.Tensor | None:
        """This rank's piece of the parameter `name`'s gradient, in place (None where it holds none)."""
        params = dict(self.hf_model.named_parameters())
        grad = params[name].grad if name in params else None
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def corrupt(self) -> None:
        grad = self.gradient(TENSOR)
        if grad is not None:
            grad.mul_(2.0)


class DDPGradientDoubledInStep(_InStep, DDPStrategy):
    """DDP: the norm weight's reduced gradient × 2 in the step, before the PolicyOptimizer's clip."""

    name = "ddp_gradient_doubled_in_step"  # (its record beside DDP's own)


class FSDPGradientDoubledInStep(_InStep, FSDPStrategy):
    """FSDP2 + TP: the norm weight's local shards × 2 on every rank, after the reduce-scatter, before the clip."""


class TransformersGradientDoubledInStep(_InStep, TransformersStrategy):
    """transformers' TP: as FSDP2's."""


class PipelineGradientDoubledInStep(_InStep, PipelineStrategy):
    """The pipeline: the norm weight's gradient × 2 on the ranks of the stage that holds it."""


class DeepSpeedGradientDoubledInStep(_InStep, DeepSpeedStrategy):
    """DeepSpeed: the norm weight's gradient × 2 where ZeRO holds it (this rank's fragment of the averaged gradient
    partition), before engine.step() clips it."""

    def gradient(self, name: str) -> torch.Tensor | None:
        from parity.views.zero_state import local_gradient

        (param,) = [p for n, p in self._stock_named if n == name]
        return local_gradient(param, self.zero_stage)


class FSDPGradientsScaledAfterTheRead(FSDPStrategy):
    """Every gradient × 1.5 at STEP just after the tensor record read them and before the norm and the clip: what the
    optimizer clips and applies is not what was recorded — the record's invariant names the step."""

    def train_step(self, batch, global_tokens, lr, observe=None):
        self.step_index = getattr(self, "step_index", -1) + 1
        return super().train_step(batch, global_tokens, lr, observe)

    def record_gradients(self, loss_scale: float = 1.0) -> None:
        super().record_gradients(loss_scale)
        if self.step_index == STEP:
            with torch.no_grad():
                torch._foreach_mul_([p.grad.to_local() for p in self.model.parameters() if p.grad is not None], 1.5)


class FSDPEmbeddingGradientScaled(_InStep, FSDPStrategy):
    """The embedding's gradient × (1 + 1e-4) at every step: 1e-4 of its own norm, ~5e-5 of the global."""

    every_step = True

    def corrupt(self) -> None:
        self.gradient(EMBEDDING).mul_(EMBEDDING_SCALE)


class FSDPShardGradientScaled(_InStep, FSDPStrategy):
    """One TP shard of a column-parallel weight (TP rank 0's, on every DP rank) × (1 + 1e-3) at every step: a scale
    applied to one rank's shard, ~5e-5 of the global norm."""

    every_step = True

    def corrupt(self) -> None:
        if self.ctx.tp_rank == 0:
            self.gradient(SHARDED).mul_(SHARD_SCALE)


IN_STEP = {  # strategy → its copy doubling TENSOR's gradient inside its step at STEP
    "ddp": DDPGradientDoubledInStep, "deepspeed": DeepSpeedGradientDoubledInStep, "fsdp": FSDPGradientDoubledInStep,
    "pipeline": PipelineGradientDoubledInStep, "transformers": TransformersGradientDoubledInStep,
}
SCALED_FROM_STEP_0 = (FSDPEmbeddingGradientScaled, FSDPShardGradientScaled)
