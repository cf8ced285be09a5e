"""Plain PyTorch or DDP: every rank of the world a DP rank holding the whole model, read with the harness's own code
for it — the float64 norms of plain tensors (parity.training.optimizer.local_norm), every parameter and its moments
on every rank (replicas.whole_model), the moments as the harness's strategies export theirs (optimizer.full_moments).
DDP's communication hook is a precision setting (`policy_request`): torch's fp16_compress_hook and bf16_compress_hook
average the gradients in fp16 or bf16 — the policy's reduce dtype, which the replay's DDP reduces in too —,
allreduce_hook is DDP's own reduction; any other hook (PowerSGD, a loop's own) is refused in one line. So is the
dtype of the parameters the optimizer steps: a model loaded or cast to bf16 and trained so (no autocast, no fp32
masters: AdamW's state in bf16 too) is the bf16_pure policy; fp32 ones over a frozen bf16 base (peft's LoRA adapters
on a model loaded in bf16) the bf16_base policy; fp16 ones, trainable parameters in several dtypes, or another frozen
base are refused in one line. (This view is the table's last row: asked of any model no other view's policy said.)
"""

from __future__ import annotations

import math

import torch

from parity.errors import ConfigError
from parity.precision import PolicyRequest
from parity.training.optimizer import full_moments, local_norm
from parity.training.replicas import whole_model
from parity.training.tensor_norms import Piece, rank0_pieces
from parity.views.adapters import peft_inner
from parity.views.base import View
from parity.views.language_model import text_alias
from parity.views.mixed_precision import trained_dtypes


class DataParallel(View):
    """Every rank of the world a DP rank holding the whole model and its optimizer's state (rank 0 reads its own: no
    collective)."""

    kind = "data parallel"
    whole = True

    @classmethod
    def policy_request(cls, model) -> PolicyRequest | None:
        """bf16_pure where the trainable parameters are bf16, bf16_base where they are fp32 over a frozen bf16 base,
        with the reduce dtype DDP's communication hook averages the gradients in (None: fp32 parameters and no hook, or
        DDP's own reduction); ConfigError in one line for a hook the replay cannot reduce as and for parameters no
        policy steps."""
        hook = cls._hook_request(model)
        if not isinstance(model, torch.nn.Module):
            return hook
        dtypes = trained_dtypes(model)
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
        shown = ", ".join(sorted(str(d) for d in dtypes))
        reduce = hook.reduce_dtype if hook else None
        if dtypes and frozen - dtypes:
            if (dtypes, frozen) == ({torch.float32}, {torch.bfloat16}):
                return PolicyRequest("the optimizer stepping fp32 parameters over a frozen bf16 base",
                                     precision="bf16_base", reduce_dtype=reduce)
            raise ConfigError(f"the model's frozen parameters are {', '.join(sorted(map(str, frozen)))} and the ones "
                              f"it trains {shown}: the replay computes a frozen bf16 base under fp32 adapters "
                              f"(bf16_base) or both in one dtype; load the base in bf16, or train the adapters in "
                              f"the base's dtype (get_peft_model(..., autocast_adapter_dtype=False))")
        if not dtypes or dtypes == {torch.float32}:
            return hook
        if dtypes != {torch.bfloat16}:
            raise ConfigError(f"the optimizer steps the model's parameters in {shown}, without fp32 master weights: "
                              f"the replay steps fp32 parameters or bf16 ones alone (the bf16_pure policy); train them "
                              f"in fp32 under autocast (torch's AMP recipe) or all in bf16")
        return PolicyRequest(f"the optimizer stepping {shown} parameters", precision="bf16_pure", reduce_dtype=reduce)

    @staticmethod
    def _hook_request(model) -> PolicyRequest | None:
        """The reduce dtype DDP's communication hook averages the gradients in (None: no hook, or DDP's own
        reduction); ConfigError in one line for a hook the replay cannot reduce as."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel) or not getattr(model, "_comm_hooks", None):
            return None
        reduces = {default_hooks.fp16_compress_hook: "fp16", default_hooks.bf16_compress_hook: "bf16",
                   default_hooks.allreduce_hook: None}
        (hook, _), = model._comm_hooks[-1:]  # DDP runs the last one registered
        if hook not in reduces:
            name = getattr(hook, "__name__", type(hook).__name__)
            raise ConfigError(f"DDP's communication hook {name!r} reduces the gradients in a way the replay cannot (it "
                              f"reduces as DDP does, or in fp16 or bf16 as torch's fp16_compress_hook and "
                              f"bf16_compress_hook do): record the run without it")
        dtype = reduces[hook]
        return PolicyRequest(f"DDP's {hook.__name__}", reduce_dtype=dtype) if dtype else None

    @classmethod
    def read(cls, model, optimizer, device: torch.device, unwrap) -> "DataParallel":
        """The table's last row (table.py): whatever no other view reads — a multimodal model as its language model
        (language_model.py)."""
        alias, towers = text_alias(peft_inner(unwrap(model))[0])
        view = cls(alias, optimizer)
        view.towers, view.outside = towers, {id(p) for _, tower in towers for p in tower.parameters()}
        return view

    def grad_norm(self, squares: torch.Tensor | None = None) -> float:
        """local_norm of every gradient; on rank 0, whose pieces are each trainable gradient whole and counted, the
        sum of the `squares` read of them where every gradient is a trainable tensor's — the same squares added in the
        same order, bit for bit, without a second pass over the gradients (on a GPU, its launches and its copy)."""
        grads = [(p.grad, p.requires_grad) for p in self.model.parameters() if p.grad is not None]
        if squares is not None and self.rank == 0 and all(trained for _, trained in grads):
            return math.sqrt(sum(squares.tolist()))
        return local_norm([g for g, _ in grads])

    def parameter_norm(self) -> float:
        """The global norm of the full trainable parameters (LoRA's adapters, not its frozen base: as the harness's
        strategies take it), float64."""
        return local_norm([p.detach() for p in self.model.parameters() if p.requires_grad])

    def full_optimizer_state(self):
        """As the harness's strategies export theirs (Strategy.full_optimizer_state's shape and, for a torch optimizer
        over the module's parameters, its code: parity.training.optimizer.full_moments)."""
        return full_moments(self.model.named_parameters(), self.optimizer, torch.device("cpu"))

    def replicas(self):
        """What every rank holds alike under data parallelism: every parameter and its Adam moments."""
        return whole_model(self.model, self.optimizer, tuple(range(self.world)))

    def gradient_pieces(self) -> list[Piece]:
        """This rank's piece of each trainable tensor's gradient (local): here whole, rank 0's counted."""
        return rank0_pieces((name, p.grad) for name, p in self.trainable())

    def parameter_pieces(self) -> list[Piece]:
        return rank0_pieces(self.trainable())  # their squares are taken under no_grad (stacked_squares_fp64)


VIEW = DataParallel
__all__ = ["DataParallel", "VIEW"]
