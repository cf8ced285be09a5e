"""FSDP1 (FullyShardedDataParallel) with use_orig_params=True, under any sharding strategy: FULL_SHARD or
SHARD_GRAD_OP over every rank, HYBRID_SHARD (or its ZeRO-2 form) sharding within a group and replicating across groups,
NO_SHARD replicating over every rank. No harness strategy runs FSDP1, so its norms are written here as FSDP1's own
clip_grad_norm_ takes them (each piece counted once, on the first rank of those that hold it alike, summed over the
world); its full tensors are FSDP1's FULL_STATE_DICT and its optimizer's full state dict; the pieces a replicate group
holds alike are its replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._common_utils import clean_tensor_name

from parity.precision import NAME_OF_DTYPE, PolicyRequest
from parity.training.optimizer import ADAMW_MOMENTS, squared_norm_fp64
from parity.training.replicas import held
from parity.training.tensor_norms import Piece
from parity.views.adapters import peft_inner
from parity.views.base import View, ViewRefused
from parity.views.mixed_precision import mixed_precision_request, stored_dtype, trained_dtypes


HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
ZERO_STAGE = {ShardingStrategy.FULL_SHARD: 3, ShardingStrategy.HYBRID_SHARD: 3, ShardingStrategy.SHARD_GRAD_OP: 2,
              ShardingStrategy._HYBRID_SHARD_ZERO2: 2, ShardingStrategy.NO_SHARD: 0}


class FSDP1(View):
    """Each rank holds a flat shard of each parameter (a view of its piece, empty where it holds none; the whole
    parameter under NO_SHARD). Its norms are the sums of the counted pieces' squares over the world, as FSDP1's own
    clip_grad_norm_ takes them (float64 here); the initial weights are its FULL_STATE_DICT."""

    kind = "fsdp1"

    @classmethod
    def policy_request(cls, model) -> PolicyRequest | None:
        """The policy FSDP1's MixedPrecision trains in (views/mixed_precision.py), read from each of the model's FSDP1
        modules: FSDP1 accumulates no_sync's micro-batches in the parameters' dtype (a loop without no_sync:
        accumulated_in)."""
        if not isinstance(model, FSDP):
            return None
        policies = {(m.mixed_precision.param_dtype, m.mixed_precision.reduce_dtype) for m in FSDP.fsdp_modules(model)}
        return mixed_precision_request("FSDP1's MixedPrecision", policies, trained_dtypes(model), accumulate="param")

    @classmethod
    def read(cls, model, optimizer, device: torch.device, unwrap) -> "FSDP1 | None":
        """The root FullyShardedDataParallel; None where the module holds no FSDP1 wrapper."""
        inner, prefix = peft_inner(unwrap(model))  # a PeftModel's Hugging Face model: the harness's names
        if isinstance(model, FSDP):
            return cls(model, optimizer, inner, device, prefix)
        if any(isinstance(m, FSDP) for m in inner.modules()):
            raise ViewRefused("FSDP1 inside the module: hand the recorder the root FullyShardedDataParallel")
        return None

    def __init__(self, wrapper, optimizer, inner, device: torch.device, prefix: str = ""):
        if not getattr(wrapper, "_use_orig_params", False):
            raise ViewRefused("FSDP1 without use_orig_params=True: its optimizer steps flat parameters the recorder "
                              "cannot name; wrap with use_orig_params=True")
        super().__init__(inner, optimizer)
        self.wrapper, self.device = wrapper, device
        self.stored = NAME_OF_DTYPE.get(stored_dtype(trained_dtypes(wrapper)))  # its shards', at rest
        self.prefix = prefix  # a PeftModel's names' part before its Hugging Face model's, in the wrapper's names
        strategy = wrapper.sharding_strategy
        self.zero_stage = ZERO_STAGE[strategy]
        # the ranks holding this rank's pieces alike: the replicate group of HYBRID_SHARD (which FSDP1 turns to
        # NO_SHARD over a shard group of one rank), every rank of NO_SHARD's group
        replicate = getattr(wrapper, "_inter_node_pg", None)
        replicate = wrapper.process_group if replicate is None else replicate
        replicated = strategy in HYBRID or strategy == ShardingStrategy.NO_SHARD
        self.alike = tuple(dist.get_process_group_ranks(replicate)) if replicated else (self.rank,)
        shard = 1 if strategy == ShardingStrategy.NO_SHARD else dist.get_world_size(wrapper.process_group)
        if shard * len(self.alike) != self.world:
            raise ViewRefused(f"FSDP1 ({strategy.name}) over process groups of {shard} × {len(self.alike)} ranks, in a "
                              f"world of {self.world}: the recorder reads FSDP1 over every rank")
        self.counted = self.rank == min(self.alike)  # the copy counted in the norms
        if self.model is wrapper:
            raise ViewRefused("FSDP1 around a module the recorder cannot name (pass the FSDP wrapper of a Hugging "
                              "Face model)")

    def accumulated_in(self) -> str | None:
        """Where the first micro-batch's backward reduces (no no_sync around it), FSDP1 reduce-scatters each micro-batch
        and adds the shards in the dtype its sharded parameters are stored in (fp32 under a MixedPrecision), not in the
        computing parameters' dtype no_sync accumulates the whole gradients in: that stored dtype's name."""
        return self.stored if self.wrapper._sync_gradients else None

    def clean(self, name: str) -> str:
        return clean_tensor_name(name).removeprefix(self.prefix)

    def _norm(self, tensors) -> float:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for t in tensors if self.counted else ():
            total += squared_norm_fp64(t).to(self.device)
        dist.all_reduce(total)
        return float(total.sqrt())

    def grad_norm(self, squares=None) -> float:
        return self._norm(p.grad for p in self.model.parameters() if p.grad is not None)

    def parameter_norm(self) -> float:
        return self._norm(p.detach() for p in self.model.parameters() if p.requires_grad)

    def full_state_dict(self):
        with FSDP.state_dict_type(self.wrapper, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            return {self.clean(k): v.detach().clone() for k, v in self.wrapper.state_dict().items()}  # FSDP1's gather

    def full_optimizer_state(self):
        """FSDP1's own gather of the optimizer's state (its optim_state_dict under FULL_STATE_DICT, keyed by the
        parameters' names), as full_state_dict is its FULL_STATE_DICT."""
        with FSDP.state_dict_type(self.wrapper, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            state = FSDP.optim_state_dict(self.wrapper, self.optimizer)["state"]
        moments = {self.clean(n): {k: s[k].detach().float().cpu().clone() for k in ADAMW_MOMENTS}
                   for n, s in state.items() if s}
        return moments, next((int(s["step"]) for s in state.values() if "step" in s), 0)

    def replicas(self):
        """Each parameter's piece and its moments, held alike by the ranks of `alike` (none where it is this rank)."""
        if len(self.alike) == 1:
            return []
        names = self.names()
        return [r for p in self.model.parameters() for r in held(names[id(p)], self.alike, p, self.optimizer)]

    def gradient_pieces(self) -> list[Piece]:
        """Each rank's flat shard of each gradient (empty where it holds none), counted on the first of the ranks that
        hold it alike."""
        return [Piece(name, p.grad, self.counted) for name, p in self.trainable()]

    def parameter_pieces(self) -> list[Piece]:
        return [Piece(name, p.detach(), self.counted) for name, p in self.trainable()]


VIEW = FSDP1
__all__ = ["FSDP1", "VIEW"]
