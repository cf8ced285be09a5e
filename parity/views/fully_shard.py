"""FSDP2 (`fully_shard`) with or without a DTensor TP mesh, read with the DTensor strategies' code: their norms across
meshes (dtensor_strategy.global_norm), full tensors (full_tensor, optimizer.full_moments) and replicas
(replicated_parameters, dtensor_replicas). The DP dim of a 2-D mesh is the one named "dp" (the harness's and
torchtitan's name; "data_parallel": Lightning's); the ranks of other dims feed the same rows, and only the one at
coordinate 0 of every other dim hands them over.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.distributed.tensor import DTensor

from parity.training.dtensor_strategy import (dtensor_replicas, full_tensor, global_norm, local,
                                              replicated_parameters)
from parity.training.optimizer import full_moments
from parity.training.tensor_norms import Piece, counted_by_name, local_pieces
from parity.views.adapters import peft_inner
from parity.views.base import View, ViewRefused


class FullyShard(View):
    """FSDP2 (fully_shard) over a 1-D mesh, or over the "dp" dim of a ("dp", "tp") mesh with DTensor TP."""

    kind = "fsdp2"
    zero_stage = 3

    @classmethod
    def read(cls, model, optimizer, device: torch.device, unwrap) -> "FullyShard | None":
        """A module whose parameters are DTensors; None where none is."""
        inner, _ = peft_inner(unwrap(model))
        return cls(inner, optimizer, device) if any(isinstance(p, DTensor) for p in inner.parameters()) else None

    def __init__(self, model, optimizer, device: torch.device):
        super().__init__(model, optimizer)
        # every full_tensor() of a 2-D DTensor logs that it runs one collective per mesh dim (as fsdp_strategy.py)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.device = device
        meshes = {p.device_mesh._get_root_mesh() for p in model.parameters() if isinstance(p, DTensor)}
        if len(meshes) != 1:
            raise ViewRefused(f"the model's DTensors live on {len(meshes)} root meshes: the recorder reads one")
        root = meshes.pop()
        names = list(root.mesh_dim_names or ())
        dp_name = next((n for n in ("dp", "data_parallel") if n in names), None)  # data_parallel: Lightning's name
        if root.ndim > 1 and dp_name is None:
            raise ViewRefused(f"a {root.ndim}-D device mesh without a dim named 'dp' or 'data_parallel' ({names}): "
                              f"the recorder takes the data-parallel dim by that name")
        if root.size() != self.world:
            raise ViewRefused(f"the device mesh spans {root.size()} of the {self.world} ranks")
        dp = names.index(dp_name) if root.ndim > 1 else 0
        coordinate = root.get_coordinate()
        self.dp_rank, self.dp_size = coordinate[dp], root.size(dp)
        self.feeds = all(c == 0 for i, c in enumerate(coordinate) if i != dp)
        self.mesh_shape = dict(zip(names or ["dp"], root.shape))  # the record's form: {dim name: size}
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
        return local_pieces(((name, p.grad) for name, p in self.trainable()), self._counted)

    def parameter_pieces(self) -> list[Piece]:
        return local_pieces(((name, p.detach()) for name, p in self.trainable()), self._counted)

    @functools.cached_property
    def _counted(self) -> dict[str, bool]:
        return counted_by_name(self.trainable())


VIEW = FullyShard
__all__ = ["FullyShard", "VIEW"]
