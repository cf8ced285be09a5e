"""Every trainable tensor's gradient norm and parameter norm, measured from each rank's piece of it in float64 and
summed over the ranks in one collective per step (a harness strategy's ride its loss gather: Strategy.gather_step; a
recorder's, its step exchange: parity/recording/recorded_tensors.py).

A strategy (or a recorder's layout) hands over its pieces (`Piece`): for each trainable parameter under its Hugging
Face name, the part this rank holds — a DTensor's local shard, a ZeRO partition's slice, a pipeline stage's tensor, a
whole tensor under DDP — and whether this rank's copy is the one counted. Copies several ranks hold alike (DDP's
replicas, a tensor replicated over tp, every DP rank of a pipeline stage) are counted on one of them only, so the
sum over the world is each element once: the tensor's norm over its full size, whatever the layout, and the squares
of all tensors add up to the global norm the strategy clips by (tests/test_tensor_norms.py holds every strategy to
that). Why per tensor: a bug confined to one tensor's gradient (an expert's, a norm's, a router's) moves the global
norm by its share only, and AdamW divides a constant scale away from the loss (docs/tensors.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from parity.training.optimizer import stacked_squares_fp64
from parity.training.replicas import mesh_replica_ranks

GRADIENT, UPDATE = "gradient", "update"  # the two phases a tensor is judged in: its gradient, its parameter after
PRE_CLIP, CLIPPED = "pre_clip", "clipped"  # which gradient a record holds: before clipping, or after (with the coefficient)
# Where a record's gradients were read (its series' "read_at"), in words: at the norm the run clips by — what a harness
# strategy's optimizer step takes it of (Strategy.record_gradients), what a framework's clip reads —, or elsewhere,
# which the report says beside the tensor verdict (docs/tensors.md#reading-point)
AT_CLIP, AFTER_BACKWARD, BEFORE_STEP, AT_OPTIMIZER = "clip", "after_backward", "before_step", "optimizer_step"
READ_AT = {AT_CLIP: "where the run takes the norm it clips by",
           AFTER_BACKWARD: "after backward, before the strategy's optimizer step: what its step does to a gradient is "
                           "not judged per tensor",
           BEFORE_STEP: "at the loop's before_step(), before its clipping",
           AT_OPTIMIZER: "at the optimizer's step, after the framework's clipping (× its clip coefficient)"}


@dataclass(frozen=True)
class Piece:
    """What this rank holds of the tensor `name`: `tensor` (None where it holds nothing of it), and whether its copy is
    the one counted (`counted`: False on a rank whose piece another rank holds alike and counts)."""

    name: str
    tensor: torch.Tensor | None
    counted: bool = True


def counted_here(t: torch.Tensor) -> bool:
    """Whether this rank's piece of `t` is the copy counted: a DTensor's local shard on the lowest of the ranks that
    hold that same shard (replicas.mesh_replica_ranks: along the root mesh's dims it is replicated over or does not
    live on — a norm TP leaves whole, on the "dp" sub-mesh, is the same on every "tp" rank), found once for each mesh
    and placements; a plain tensor, whole on every rank, on rank 0."""
    rank = dist.get_rank()
    if not isinstance(t, DTensor):
        return rank == 0
    key = (t.device_mesh, t.placements, rank)
    if key not in _COUNTED:
        _COUNTED[key] = rank == mesh_replica_ranks(t)[0]
    return _COUNTED[key]


_COUNTED: dict[tuple, bool] = {}  # counted_here's, by (mesh, placements, rank)


def local_pieces(named: Iterable[tuple[str, torch.Tensor | None]]) -> list[Piece]:
    """Pieces of DTensors (and plain tensors) by name: each local shard, counted by its own placements (counted_here) —
    a gradient's are not always its parameter's: transformers' vocab-parallel embedding takes a replicated gradient
    into its sharded weight."""
    return [Piece(name, None if t is None else t.to_local() if isinstance(t, DTensor) else t,
                  t is not None and counted_here(t)) for name, t in named]


def rank0_pieces(named: Iterable[tuple[str, torch.Tensor | None]]) -> list[Piece]:
    """Whole tensors every rank holds alike (DDP, a hand-written data parallelism): rank 0's copies counted."""
    counted = dist.get_rank() == 0
    return [Piece(name, t, counted and t is not None) for name, t in named]


def local_squares(pieces: list[Piece], names: list[str], device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """This rank's float64 sums of squares of its counted pieces, one per name in `names` order (the same order on
    every rank); a name this rank holds nothing of is 0. `scale` divides the tensors (a loss scale to take out).
    A handful of kernels whatever the count of tensors (on a GPU each op is a launch: docs/benchmark.md)."""
    index = {n: i for i, n in enumerate(names)}
    held = [(index[p.name], p.tensor) for p in pieces
            if p.counted and p.tensor is not None and p.name in index]
    if not held:
        out = torch.zeros(len(names), dtype=torch.float64, device=device)
    else:
        squares = stacked_squares_fp64([t for _, t in held]).to(device)  # stacked where they are, then one copy
        at = [i for i, _ in held]
        if at == list(range(len(names))):  # one piece of every name, in order: the sums are the squares
            out = squares
        else:
            out = torch.zeros(len(names), dtype=torch.float64, device=device)
            out.index_put_((torch.tensor(at, device=device),), squares, accumulate=True)
    return out / (scale * scale) if scale != 1.0 else out


def norms_of(summed: torch.Tensor) -> tuple[list[float], list[float]]:
    """The gradient and parameter norms of every tensor from the sums over the ranks of both kinds of squares, the
    gradients' then the parameters' (each in tensor_names order); read off the device in one copy."""
    values = summed.tolist()
    n = len(values) // 2
    return [math.sqrt(x) for x in values[:n]], [math.sqrt(x) for x in values[n:]]
