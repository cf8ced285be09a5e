"""FSDP2 (`fully_shard`) with or without a DTensor TP mesh, read with the DTensor strategies' code: their norms across
meshes (dtensor_strategy.global_norm), full tensors (full_tensor, optimizer.full_moments) and replicas
(replicated_parameters, dtensor_replicas). The data-parallel ranks are the ranks of fully_shard's own mesh, read from
its state — FSDP's shard dim, with HSDP's replicate dim before it, whatever the dims are named; the ranks of the other
dims (TP) feed the same rows, and only the group holding the root mesh's first rank hands them over.
fully_shard's MixedPrecisionPolicy is the run's precision policy (`policy_request`), which the recorder takes rather
than being told it: param_dtype bf16 is bf16_params, fp16 is fp16 (its loss scaler torch's ShardedGradScaler, read
as GradScaler is: recording/grad_scaler.py), each reducing and accumulating in its reduce dtype.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from parity.errors import ConfigError
from parity.precision import PolicyRequest
from parity.training.dtensor_strategy import (dtensor_replicas, full_tensor, global_norm, local,
                                              replicated_parameters)
from parity.training.optimizer import full_moments
from parity.training.tensor_norms import Piece, local_pieces
from parity.views.adapters import peft_inner
from parity.views.base import View, ViewRefused
from parity.views.mixed_precision import mixed_precision_request, trained_dtypes


class FullyShard(View):
    """FSDP2 (fully_shard) over a 1-D mesh, HSDP over a 2-D one, either beside DTensor TP on the other dims of the
    root mesh (named as the user names them: ("dp", "tp"), accelerate's ("dp_replicate", "dp_shard", "tp"), …); or
    DTensor TP alone (kind "dtensor")."""

    kind = "fsdp2"
    zero_stage = 3

    @classmethod
    def read(cls, model, optimizer, device: torch.device, unwrap) -> "FullyShard | None":
        """A module whose parameters are DTensors; None where none is."""
        inner, _ = peft_inner(unwrap(model))
        return cls(inner, optimizer, device) if any(isinstance(p, DTensor) for p in inner.parameters()) else None

    @classmethod
    def policy_request(cls, model) -> PolicyRequest | None:
        """The policy fully_shard's MixedPrecisionPolicy trains in (views/mixed_precision.py): FSDP2 accumulates
        micro-batches in its reduce dtype."""
        if not isinstance(model, torch.nn.Module):
            return None
        try:
            policies = {(g.mp_policy.param_dtype, g.mp_policy.reduce_dtype) for g in _param_groups(model)}
        except ViewRefused as exc:
            raise ConfigError(str(exc)) from None
        return mixed_precision_request("fully_shard's MixedPrecisionPolicy", policies, trained_dtypes(model))

    def __init__(self, model, optimizer, device: torch.device):
        super().__init__(model, optimizer)
        # every full_tensor() of a 2-D DTensor logs that it runs one collective per mesh dim (as fsdp_strategy.py)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.device = device
        meshes = {p.device_mesh._get_root_mesh() for p in model.parameters() if isinstance(p, DTensor)}
        if len(meshes) != 1:
            raise ViewRefused(f"the model's DTensors live on {len(meshes)} root meshes: the recorder reads one")
        root = meshes.pop()
        if root.size() != self.world:
            raise ViewRefused(f"the device mesh spans {root.size()} of the {self.world} ranks")
        group = data_parallel_ranks(model)
        if group is None:  # DTensor TP alone (parallelize_module, transformers' tp_plan): one DP rank
            self.kind, self.zero_stage, group = "dtensor", 0, [self.rank]
        self.dp_rank, self.dp_size = group.index(self.rank), len(group)
        self.feeds = int(root.mesh.flatten()[0]) in group  # the DP group at coordinate 0 of every other dim
        names = root.mesh_dim_names or (("dp",) if root.ndim == 1 else tuple(f"dim{i}" for i in range(root.ndim)))
        self.mesh_shape = dict(zip(names, root.shape))  # the record's form: {dim name: size}
        self._replicated = None

    def describe(self) -> dict:
        return {**super().describe(), "mesh": self.mesh_shape}

    def logits(self, logits):
        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    def grad_norm(self, squares=None) -> float:
        return global_norm([p.grad for p in self.model.parameters() if p.grad is not None])

    def parameter_norm(self) -> float:
        return global_norm([p.detach() for p in self.model.parameters() if p.requires_grad])

    def full_state_dict(self):
        return {k: full_tensor(v, self.device) for k, v in self.model.state_dict().items()}

    def full_optimizer_state(self):
        return full_moments(self.model.named_parameters(), self.optimizer, self.device)  # DTensors: full_tensor()

    @staticmethod
    def local_piece(p):
        return local(p.detach())

    def replicas(self):
        if self._replicated is None:
            self._replicated = replicated_parameters(self.model, self.world)
        return dtensor_replicas(self._replicated, self.optimizer)

    def gradient_pieces(self) -> list[Piece]:
        """Each local shard, counted on one of the ranks that hold it alike, as the DTensor strategies count it."""
        return local_pieces((name, p.grad) for name, p in self.trainable())

    def parameter_pieces(self) -> list[Piece]:
        return local_pieces((name, p.detach()) for name, p in self.trainable())


def data_parallel_ranks(model) -> list[int] | None:
    """The global ranks of this rank's data-parallel group, in their DP order: the ranks of the mesh fully_shard
    shards (and HSDP replicates) each parameter group over, as its state holds it (FSDPParamGroup.mesh_info: torch
    2.13's, the pinned release); None where no module is fully_shard'ed (DTensor TP alone)."""
    groups = {tuple(g.mesh_info.mesh.mesh.flatten().tolist()) for g in _param_groups(model)}
    if len(groups) > 1:
        raise ViewRefused(f"fully_shard over {len(groups)} different data-parallel meshes in one model: the recorder "
                          f"reads one")
    return list(groups.pop()) if groups else None


def _param_groups(model) -> list:
    """fully_shard's parameter groups of the model's modules (a module with no parameter of its own has none)."""
    try:
        states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
        return [g for state in states for g in [state._fsdp_param_group] if g is not None]
    except AttributeError as e:  # a release whose fully_shard keeps its state otherwise
        raise ViewRefused(f"fully_shard's mesh cannot be read in torch {torch.__version__} ({e}): the recorder reads "
                          f"torch 2.13's") from None


VIEW = FullyShard
__all__ = ["FullyShard", "VIEW", "data_parallel_ranks"]
