"""FSDP1 (FullyShardedDataParallel) with use_orig_params=True, FULL_SHARD or SHARD_GRAD_OP over every rank. No
harness strategy runs FSDP1, so its norms are written here as FSDP1's own clip_grad_norm_ takes them (each rank's
pieces, summed over the group); its full tensors are FSDP1's FULL_STATE_DICT and its optimizer's full state dict.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._common_utils import clean_tensor_name

from parity.training.optimizer import ADAMW_MOMENTS, squared_norm_fp64
from parity.training.tensor_norms import Piece
from parity.views.adapters import peft_inner
from parity.views.base import View, ViewRefused


class FSDP1(View):
    """Each rank holds a flat shard of each parameter (a view of its piece, empty where it holds none). Its norms are
    the sums of the local pieces' squares over the process group, as FSDP1's own clip_grad_norm_ takes them (float64
    here); the initial weights are its FULL_STATE_DICT; no two ranks hold a piece alike."""

    kind = "fsdp1"
    zero_stage = 3

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
        whole = wrapper.sharding_strategy == ShardingStrategy.NO_SHARD and dist.get_world_size() == 1  # (below)
        if wrapper.sharding_strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) and not whole:
            raise ViewRefused(f"FSDP1 with {wrapper.sharding_strategy.name}: the recorder reads FULL_SHARD and "
                              f"SHARD_GRAD_OP")
        super().__init__(inner, optimizer)
        self.wrapper, self.device = wrapper, device
        self.prefix = prefix  # a PeftModel's names' part before its Hugging Face model's, in the wrapper's names
        if dist.get_world_size(wrapper.process_group) != self.world:
            raise ViewRefused("FSDP1 over a process group other than the world's")
        if self.model is wrapper:
            raise ViewRefused("FSDP1 around a module the recorder cannot name (pass the FSDP wrapper of a Hugging "
                              "Face model)")

    def clean(self, name: str) -> str:
        return clean_tensor_name(name).removeprefix(self.prefix)

    def _norm(self, tensors) -> float:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for t in tensors:
            total += squared_norm_fp64(t).to(self.device)
        dist.all_reduce(total, group=self.wrapper.process_group)
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
        return []

    def gradient_pieces(self) -> list[Piece]:
        """Each rank's flat shard of each gradient (empty where it holds none): no two ranks hold one alike."""
        return [Piece(name, p.grad) for name, p in self.trainable()]

    def parameter_pieces(self) -> list[Piece]:
        return [Piece(name, p.detach()) for name, p in self.trainable()]


VIEW = FSDP1
__all__ = ["FSDP1", "VIEW"]
