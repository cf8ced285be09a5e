"""One view of a sharded model: a model trained in pieces across ranks, read under Hugging Face names. Two families
play the role, with one set of method names:

- a strategy (parity/training/strategy.py: a model the harness shards — DDP, ZeRO + AutoTP, FSDP2 + TP, pipelines);
- a recorder's view (parity/views/: a model a user's loop shards — DDP, FSDP2, FSDP1, a DeepSpeed engine — picked by
  the table there; a framework's translation, parity/frameworks/<name>/view.py: a model under a framework's own
  names, torchtitan's and megatron-core's).

What reads a sharded model reads it through these methods alone, so that the harness's loop and a recorder feed the
same code: every tensor's norms (parity/training/tensor_norms.py: the names and each rank's pieces), the replica check
(parity/training/replicas.py, through the per-step observer), the frozen check (frozen.py), and the full state the
teacher-forced check compares (`capture`: the full parameters, buffers and AdamW's moments).

What each member means is said here once; an implementation says how it reads its sharding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

class ShardedView:
    """The protocol (module docstring). Collective members are called by every rank, in one order."""

    # --- names ------------------------------------------------------------------------------------------------
    def tensor_names(self) -> list[str] | None:
        """The trainable parameters' Hugging Face names, the whole model's on every rank in one order, whose norms the
        record holds at every step; None where the pieces are not handed over. Local."""
        raise NotImplementedError

    # --- the norm -----------------------------------------------------------------------------------------------
    def parameter_norm(self) -> float:
        """The global L2 norm of the trainable parameters (the master weights the optimizer updates), each element
        once, accumulated in float64. Collective where they are sharded."""
        raise NotImplementedError

    # --- full tensors -------------------------------------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size, fp32 on the CPU, under Hugging Face names (a tied weight once, under its
        first name). Collective where they are sharded: every rank gets them."""
        raise NotImplementedError

    def full_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers a stock model's state dict holds, under its names, fp32 on the CPU."""
        raise NotImplementedError

    def full_optimizer_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], int] | None:
        """AdamW's moments as full fp32 CPU tensors, {Hugging Face name: {"exp_avg", "exp_avg_sq"}}, and its step count
        (({}, 0) before the first step); None where they cannot be exported. Collective where they are sharded."""
        raise NotImplementedError

    # --- each rank's pieces -------------------------------------------------------------------------------------
    def local_piece(self, param: torch.Tensor) -> torch.Tensor:
        """What this rank holds of `param`, a plain tensor."""
        raise NotImplementedError

    def gradient_pieces(self) -> list:
        """This rank's piece of each trainable tensor's gradient (tensor_norms.Piece, by Hugging Face name, counted on
        one of the ranks that hold it alike). Local."""
        raise NotImplementedError

    def parameter_pieces(self) -> list:
        """Like gradient_pieces, for the parameters (the master weights the optimizer updates). Local."""
        raise NotImplementedError

    def frozen_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """(Hugging Face name, local_piece) of every frozen parameter (LoRA's base), which must stay bit for bit as
        set up; [] where every parameter trains. Local."""
        raise NotImplementedError

    # --- replicas -----------------------------------------------------------------------------------------------
    def replicas(self) -> list | None:
        """Every tensor this rank holds that other ranks hold bit for bit too (replicas.Replica, with its ranks), the
        same declaration at every call; None: nothing is declared, and the record says so. Local."""
        raise NotImplementedError


@dataclass
class FullState:
    """A model and its optimizer as full fp32 CPU tensors under Hugging Face names (a tied weight once)."""

    params: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]] | None  # None: the view cannot export them
    count: int  # AdamW's step count
    buffers: dict[str, torch.Tensor]
    # a reference step's: the gradients it stepped with (clipped) and each tensor's (lr, betas, eps, step count after)
    grads: dict[str, torch.Tensor] | None = None
    hyper: dict[str, tuple] | None = None


def capture(view: ShardedView) -> FullState:
    """A view's full state, on every rank. Collective where it is sharded (the parameters, then the moments)."""
    params = view.full_parameters()
    exported = view.full_optimizer_state()
    moments, count = exported if exported is not None else (None, 0)
    return FullState(params, moments, count, view.full_buffers())


__all__ = ["FullState", "ShardedView", "capture"]
