"""Seeded bugs confined to one tensor, from a late step: what the per-tensor verdict must name at that step while the
three curves, whose global norms see the tensor's share alone, barely move (issue 52; tests/test_tensor_bugs.py,
docs/tensors_measured.md). Copies of FSDP2, importable by path as parity.calibration.bugs' entries are, recording under
the strategy's name (loss_fsdp.json).

Each acts after the backward of every step from LATE_ONSET on, where the tensor series reads the gradients (before
clipping and the optimizer), as a code path that starts late would — a branch taken after warm-up, a reducer rebuilt.
The teacher-forced check runs at step 0 and every --checkpoint_interval: a run checked at step 0 only does not see them
there. Each moves the global grad norm by the tensor's share alone, which AdamW then divides away.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_strategy import FSDPStrategy

LATE_ONSET = 4
TP_NORM = "model.layers.1.post_attention_layernorm.weight"  # a norm TP leaves whole (replicated over tp)
EXPERTS = "model.layers.1.mlp.experts.down_proj"  # one sparse layer's experts (fused, sharded over ep)
ROUTER = "model.layers.1.mlp.gate.weight"  # one sparse layer's router
ROUTERS = "model.layers.*.mlp.gate.weight"  # every router: the dropped aux loss moves each (an fnmatch pattern)
ROUTER_RANK = 1  # the rank whose router gradient is doubled


class _LateGradientBug(FSDPStrategy):
    """An FSDP2 copy whose `corrupt()` runs after each step's backward from step LATE_ONSET on."""

    def train_step(self, batch, global_tokens, lr, observe=None):
        self.step_index = getattr(self, "step_index", -1) + 1
        return super().train_step(batch, global_tokens, lr, observe)

    def forward_backward(self, batch, global_tokens):
        local_sum = super().forward_backward(batch, global_tokens)
        if self.step_index >= LATE_ONSET:
            with torch.no_grad():
                self.corrupt()
        return local_sum

    def late(self) -> bool:
        """Whether this step is one the bug acts in (for a bug that acts in the forward, as the aux loss's)."""
        return getattr(self, "step_index", 0) >= LATE_ONSET

    def gradient(self, name: str) -> torch.Tensor:
        """This rank's piece of the parameter `name`'s gradient (a DTensor's local shard), in place."""
        grad = dict(self.model.named_parameters())[name].grad
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def corrupt(self) -> None:
        pass


class FSDPNormGradientSummedOverTP(_LateGradientBug):
    """Under TP, one replicated norm's gradient all-reduced over the TP group once more (Megatron's all-reduce of the
    sequence-parallel norms' gradients added where DTensor already reduced them): its TP ranks' identical copies are
    summed, tp_size × the gradient, every copy alike — no replica parts."""

    def corrupt(self) -> None:
        dist.all_reduce(self.gradient(TP_NORM), group=self.tp_mesh.get_group())


class FSDPExpertGradientDoubled(_LateGradientBug):
    """Under EP, one sparse layer's experts' gradients × 2 on every rank (pytorch/pytorch#160285's 2 × confined to one
    layer: a reduction hook registered twice for one module), while the loss curves agree."""

    def corrupt(self) -> None:
        self.gradient(EXPERTS).mul_(2.0)


class FSDPRouterGradientDoubledOnOneRank(_LateGradientBug):
    """Under EP, one rank's piece of one router's gradient × 2 after the reduction (huggingface/transformers#48687's
    class: a router gradient wrong on some ranks while the loss is right). The router is FSDP-sharded over dp, so no
    other rank holds that piece: no replica parts."""

    def corrupt(self) -> None:
        if self.ctx.rank == ROUTER_RANK:
            self.gradient(ROUTER).mul_(2.0)


class FSDPAuxLossGradientDropped(_LateGradientBug):
    """The load-balancing loss computed, recorded and never backpropagated (NVIDIA-NeMo/Automodel#1408: detached on its
    way into the loss): the routers train on the language-model loss alone. The recorded aux loss is the batch's own,
    as the correct run's at that step."""

    def micro_batch_aux(self, prob_sums, totals, moe):
        aux = super().micro_batch_aux(prob_sums, totals, moe)
        return aux.detach() if self.late() else aux


TENSOR_BUGS = {  # the seeded bug → (its copy, the tensor it is confined to: a name, or an fnmatch pattern of names)
    "a norm's gradient summed over TP": (FSDPNormGradientSummedOverTP, TP_NORM),
    "an expert layer's gradient x 2 under EP": (FSDPExpertGradientDoubled, EXPERTS),
    "a router's gradient x 2 on one rank under EP": (FSDPRouterGradientDoubledOnOneRank, ROUTER),
    "the aux loss's gradient dropped": (FSDPAuxLossGradientDropped, ROUTERS),
}
