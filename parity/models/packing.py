"""The packed tensor layout, named once: a fused projection whose rows are `parts` equal blocks one after another —
[gate; up] (Phi3's gate_up_proj, an MoE's experts' gate_up_proj, megatron-core's linear_fc1) — and the same sharded
part by part over TP: rank r holds the r-th slice of every part, one after another ([gate_r; up_r]), so that each
rank's local output pairs every gate column with its up column. A full tensor gathered rank after rank is then packed
per rank ([gate_0; up_0; gate_1; up_1 …]): `unpacked_per_rank` gives its parts whole. What reads or shards one asks
here: the FSDP2 + TP plan and its experts (strategies/fsdp/plans.py, expert_parallel.py), the DTensor strategies'
gather of a packed output (training/dtensor_strategy.py), AutoEP's experts fused back (strategies/autotp/gathers.py),
megatron-core's names (frameworks/megatron/names.py).
"""

from __future__ import annotations

import torch

GATE_UP = 2  # the parts of a fused gate/up projection: gate, then up


def packed(parts, dim: int = 0) -> torch.Tensor:
    """The parts' whole tensors packed one after another along `dim` ([gate; up])."""
    return torch.cat(list(parts), dim=dim)


def unpacked_per_rank(tensor: torch.Tensor, tp_size: int, parts: int = GATE_UP, dim: int = 0) -> tuple:
    """The `parts` whole tensors of a full tensor whose TP rank r's slice (along `dim`) packs its slice of each part."""
    shards = [s.chunk(parts, dim=dim) for s in tensor.chunk(tp_size, dim=dim)]
    return tuple(torch.cat([s[i] for s in shards], dim=dim) for i in range(parts))


def per_rank_placement(parts: int, dim: int = 0):
    """The DTensor placement of a tensor packing `parts` parts sharded part by part along `dim` (TP rank r: the r-th
    slice of every part, a _StridedShard); of a plain one (1 part), its slice of `dim`."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=parts) if parts > 1 else Shard(dim)


__all__ = ["GATE_UP", "packed", "per_rank_placement", "unpacked_per_rank"]
