"""The FSDP2 strategy's mixture-of-experts parallelism, PyTorch-native (torchtitan's way), on transformers' own
experts modules: their fused 3-D weights sharded as DTensors, their own forward run on this rank's experts.

Expert parallelism (--ep_size E > 1): each rank of an EP group (E consecutive ranks, whole TP groups) holds
num_experts / E whole experts (Shard(0) on the "ep" mesh dim). The router runs on every token of the rank as in a
stock model; the ranks of a TP group, which hold the same tokens, each take a slice of them; each (token, expert)
pair is sent to the expert's rank by an all-to-all, the experts run on what arrived (top-1, unit weights), a second
all-to-all brings the outputs back, the sender weights and sums them per token and the TP group gathers its slices.
The ranks holding the same experts ("efsdp": world ÷ E of them) shard them further with FSDP2, and their gradients
are summed over efsdp and divided by dp_size: every token of the global batch reached exactly one copy of its
experts, and each rank's loss is × dp_size (the shared loss), so the sum ÷ dp_size is DDP's gradient. FSDP2's own
average over efsdp would leave it × E ÷ tp_size: the bug parity.calibration.bugs:FSDPExpertGradientsScaledByEP.

Expert tensor parallelism (--ep_size 1, --tp_size > 1): every rank holds every expert, each TP rank a slice of each
expert's hidden width, as a Megatron MLP — the fused gate_up part by part (gate's slice and up's slice: a
_StridedShard, as the family's packed plan says), down_proj by its input; the inputs' gradients and the output are
summed over TP. Split as one block, rank 0 would hold every expert's gate and rank 1 every up: the bug
parity.calibration.bugs:FSDPFusedExpertGateUpSplitInHalves.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from parity.models.packing import per_rank_placement


@contextlib.contextmanager
def local_parameters(module: torch.nn.Module):
    """The module's DTensor parameters replaced by their local shards (differentiably) for the block: transformers'
    experts forward indexes and multiplies plain tensors."""
    originals = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    module._parameters.update({n: p.to_local() for n, p in originals.items()})
    try:
        yield
    finally:
        module._parameters.update(originals)


class _AllToAll(torch.autograd.Function):
    """Rows exchanged within `group`: `send_sizes[r]` rows to rank r, `recv_sizes[r]` from it; backward the reverse."""

    @staticmethod
    def forward(ctx, x, recv_sizes, send_sizes, group):
        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        out = x.new_empty((sum(recv_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv_sizes, send_sizes = ctx.sizes
        return _AllToAll.apply(grad, send_sizes, recv_sizes, ctx.group), None, None, None


def _row_slices(rows: int, parts: int) -> list[int]:
    return [len(c) for c in torch.arange(rows).tensor_split(parts)]


def _gather_rows(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows (`sizes` of them each) concatenated in rank order; gloo gathers equal sizes, so padded."""
    padded = x.new_zeros((max(sizes), *x.shape[1:]))
    padded[: x.shape[0]] = x
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(pieces, sizes)])


class _TakeRows(torch.autograd.Function):
    """This TP rank's slice of rows every rank of the group holds; backward gathers the slices' gradients, so that
    every rank has the whole gradient of the shared rows (as for any replicated activation under TP)."""

    @staticmethod
    def forward(ctx, x, group, rank, sizes):
        ctx.group, ctx.sizes = group, sizes
        start = sum(sizes[:rank])
        return x[start:start + sizes[rank]].clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group, ctx.sizes), None, None, None


class _GatherRows(torch.autograd.Function):
    """The TP group's slices of rows gathered; backward keeps this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, group, rank, sizes):
        ctx.start, ctx.size = sum(sizes[:rank]), sizes[rank]
        return _gather_rows(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start:ctx.start + ctx.size], None, None, None


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (an input every rank shares, whose gradient each rank
    computes from its slice of the weights only: Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOutputs(torch.autograd.Function):
    """Sum over `group` forward (each rank's partial output); identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def apply_ep(experts: torch.nn.Module, ep_mesh, tp_mesh) -> None:
    """Expert parallelism on one experts module: whole experts per rank of `ep_mesh`, tokens dispatched by all-to-all;
    the ranks of `tp_mesh` (a sub-group of each EP group) split their shared tokens."""
    for name, param in list(experts.named_parameters(recurse=False)):
        experts.register_parameter(name, torch.nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]),
                                                            requires_grad=param.requires_grad))
    num_experts, ep = experts.num_experts, ep_mesh.size()
    experts.num_experts = num_experts // ep  # its forward numbers the experts it holds from 0
    own_forward = experts.forward
    ep_group = ep_mesh.get_group()
    tp_group, tp_rank, tp = tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size()

    def forward(hidden_states, top_k_index, top_k_weights):
        rows, width = hidden_states.shape
        if tp > 1:
            sizes = _row_slices(rows, tp)
            hidden_states = _TakeRows.apply(hidden_states, tp_group, tp_rank, sizes)
            top_k_weights = _TakeRows.apply(top_k_weights, tp_group, tp_rank, sizes)
            start = sum(sizes[:tp_rank])
            top_k_index = top_k_index[start:start + sizes[tp_rank]]
        tokens, top_k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)  # by expert, so by the rank holding it
        send_counts = torch.bincount(ids, minlength=num_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=ep_group)
        send_sizes = send_counts.view(ep, -1).sum(1).tolist()
        recv_sizes = recv_counts.view(ep, -1).sum(1).tolist()
        received = _AllToAll.apply(hidden_states[order // top_k], recv_sizes, send_sizes, ep_group)
        local_ids = torch.arange(experts.num_experts, device=ids.device).repeat(ep)
        local_ids = local_ids.repeat_interleave(recv_counts.view(-1)).unsqueeze(-1)
        with local_parameters(experts):
            if received.shape[0]:
                out = own_forward(received, local_ids, received.new_ones(local_ids.shape))
            else:  # nothing arrived: keep the experts in the graph, so their (zero) gradients are reduced as the rest
                out = own_forward(received.new_zeros(1, width) + received.sum(), local_ids.new_zeros(1, 1),
                                  received.new_ones(1, 1))[:0]
        returned = _AllToAll.apply(out, send_sizes, recv_sizes, ep_group)
        pairs = returned[torch.argsort(order)].view(tokens, top_k, width)  # back in (token, slot) order
        combined = (pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(1)
        if tp > 1:
            combined = _GatherRows.apply(combined, tp_group, tp_rank, sizes)
        return combined.to(hidden_states.dtype)

    experts.forward = forward


def expert_tp_placement(dim: int, parts: int):
    """How one fused expert weight is split over TP: part by part when it packs several (parity/models/packing.py)."""
    return per_rank_placement(parts, dim)


def apply_etp(experts: torch.nn.Module, tp_mesh, weights: dict[str, tuple[int, int]], placement=expert_tp_placement):
    """Expert tensor parallelism on one experts module: each expert's weights split over `tp_mesh` as `weights` says
    ({name: (dim, parts)}, the family's), the experts' own forward on the slices, their partial outputs summed."""
    for name, (dim, parts) in weights.items():
        param = getattr(experts, name)
        experts.register_parameter(name, torch.nn.Parameter(
            distribute_tensor(param.data, tp_mesh, [placement(dim, parts)]), requires_grad=param.requires_grad))
    own_forward, group = experts.forward, tp_mesh.get_group()

    def forward(hidden_states, top_k_index, top_k_weights):
        hidden_states = _SumGradients.apply(hidden_states, group)
        top_k_weights = _SumGradients.apply(top_k_weights, group)
        with local_parameters(experts):
            partial = own_forward(hidden_states, top_k_index, top_k_weights)
        return _SumOutputs.apply(partial, group)

    experts.forward = forward
