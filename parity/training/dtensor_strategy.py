"""What every strategy whose parameters are DTensors shares (FSDP2 + TP, and transformers' own TP + FSDP2): norms
and clipping across meshes, fp16's loss scaler, full tensors, the model states a rank holds, FSDP2's gradient-sync
switch and checkpoints through torch.distributed.checkpoint. The strategies differ in how the DTensors are made (fsdp_strategy.py: the
harness's own plan; transformers_strategy.py: transformers' plan and FSDP2), not in how they are read.

Parameters may also be plain tensors: a module no plan shards (the norms under a TP plan without FSDP) keeps its
parameter whole on every rank, which counts once.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Partial, Replicate

from parity.models.packing import per_rank_placement
from parity.training.loss_scaler import applied, unscaled_or_skipped
from parity.training.memory import GATHERED, GRADS, PARAMS, StateLedger
from parity.training.optimizer import (OptimizerStep, clip_gradients, squared_norm_fp64, step_optimizer,
                                       trainable)
from parity.training.replicas import Replica, held, mesh_replica_ranks
from parity.training.strategy import Strategy
from parity.training.tensor_norms import Piece, local_pieces

DCP_DIR = "dcp"  # the checkpoint's torch.distributed.checkpoint folder: a shard file per rank, rank 0's .metadata
SCALER_FILE = "loss_scaler.pt"  # fp16: the loss scaler's state (rank 0's)


def global_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of DTensors (and plain tensors, whole on every rank) taken together — the gradients, or the
    parameters — whatever mesh and placements each one has.

    torch's clip_grad_norm_ stacks per-tensor norms, which DTensor refuses across meshes ("All operands
    in aten.stack.default must have the same mesh"): TP'd tensors live on ("dp", "tp"), the others on
    "dp". So each rank sums the squares of its local shards in float64 (the shared helper), and the sums
    are added across exactly the mesh dims a tensor is sharded over — a Partial placement there — and
    not across the ones it is replicated over, so a tensor replicated over tp is counted once.
    Tensors with the same mesh and sharded dims share one reduction; with --offload cpu the shards are in
    host memory and each sum goes to the mesh's device for it.
    """
    local_sums, whole = defaultdict(float), 0.0
    for g in tensors:
        if not isinstance(g, DTensor):
            whole = whole + squared_norm_fp64(g)
            continue
        assert not any(p.is_partial() for p in g.placements), f"unreduced gradient: {g.placements}"
        key = (g.device_mesh, tuple(Replicate() if p.is_replicate() else Partial() for p in g.placements))
        local_sums[key] = local_sums[key] + squared_norm_fp64(g.to_local())
    return math.sqrt(float(whole) + sum(
        float(DTensor.from_local(total.to(mesh.device_type), mesh, placements).full_tensor())
        for (mesh, placements), total in local_sums.items()))


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharing its storage); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A DTensor (or a plain tensor, whole on every rank) in full, as an fp32 CPU copy: gathered on `device`, the one
    its mesh communicates on (offloaded shards are in host memory). Collective for a DTensor."""
    t = t.detach().to(device)
    return (t.full_tensor() if isinstance(t, DTensor) else t).float().cpu().clone()


def replicated_parameters(model, world_size: int) -> list[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """(name, parameter, ranks) of every parameter whose local piece other ranks hold too: a DTensor's along the root
    mesh's dims it is replicated over or does not live on, a plain tensor (a module a TP plan leaves whole, without
    FSDP) on every rank of the world. A parameter's placements do not change: found once, read at every check."""
    everyone = tuple(range(world_size))
    return [(name, p, ranks) for name, p in model.named_parameters()
            for ranks in [mesh_replica_ranks(p) if isinstance(p, DTensor) else everyone] if len(ranks) > 1]


def dtensor_replicas(replicated, optimizer) -> list[Replica]:
    """The local pieces of `replicated` (replicated_parameters) and their moments, as Replicas."""
    return [r for name, p, ranks in replicated for r in held(name, ranks, p, optimizer, local=local)]


@torch.no_grad()
def clip_sharded_gradients(params, cfg) -> float:
    """Clip DTensor gradients by their global norm (torch's formula, --max_grad_norm); return that norm (float64).
    Scaling each rank's local shards scales the whole tensors: no communication. A run of RunConfig.clip_arithmetic
    "torch" clips by torch's clip_grad_norm_ itself, as an FSDP2 loop does (its tensors on one mesh: clip_gradients)."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    norm = global_norm(grads)
    clip_gradients(norm, params, [local(g) for g in grads], cfg)
    return norm


def gather_local_output(output: torch.Tensor, tp_mesh, dim: int, parts: int = 1) -> torch.Tensor:
    """A module output (or its gradient) each TP rank holds only its piece of, at full size: its slice of `dim`, or —
    for an output packing `parts` parts — its slice of every part (parity/models/packing.py)."""
    dim %= output.dim()
    return DTensor.from_local(output.detach(), tp_mesh, [per_rank_placement(parts, dim)]).full_tensor()


class DTensorStrategy(Strategy):
    """A strategy whose model holds DTensor parameters (`self.model`, HF module names kept) on the sub-meshes of one
    device mesh with named dims (`self.mesh`), stepped by the shared AdamW (`self.optimizer`)."""

    mesh = None  # the root DeviceMesh; None for a single rank
    tp_mesh = None  # its "tp" sub-mesh, where local outputs are gathered
    scaler = None  # fp16: the harness's loss scaler (parity.training.loss_scaler), set up by a strategy that runs it
    reads_at_clip = True  # optimizer_step hands the unscaled shards to the tensor record where it takes the norm

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def replicas(self) -> list[Replica]:
        """Each parameter's local piece that other ranks hold too, and its moments: a DTensor's along the root mesh's
        dims it is replicated over or does not live on (a parameter TP leaves whole — the embedding, the norms — has
        the same dp shard on every rank of a TP group), a plain tensor (a module a TP plan leaves whole, without FSDP)
        on every rank. TP-sharded pieces are on no two ranks alike, and FSDP2 alone shards everything over dp. The TP
        ranks compute these copies' gradients each from the same replicated activations: the same bits where the
        kernels are deterministic (docs/fsdp.md#replicas)."""
        if not hasattr(self, "_replicated"):  # a parameter's placements do not change: its ranks are found once
            self._replicated = replicated_parameters(self.model, self.ctx.world_size)
        return dtensor_replicas(self._replicated, self.optimizer)

    def tensor_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def frozen_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """Each frozen parameter's local shard (LoRA's base), read from the sharded parameters found once."""
        return [(n, local(p)) for n, p in self._frozen]

    @property
    def _frozen(self) -> list[tuple[str, torch.Tensor]]:
        """(name, sharded parameter) of every frozen parameter, found at the first call — the replica check's set-up,
        before any forward: in forward and backward FSDP2 registers a group's gathered parameters on the modules in
        place of its shards, and the optimizer, which holds the trainable ones' shards, holds no frozen one."""
        if not hasattr(self, "_frozen_params"):
            self._frozen_params = [(n, p) for n, p in self.model.named_parameters() if not p.requires_grad]
        return self._frozen_params

    def gradient_pieces(self) -> list[Piece]:
        """Each gradient's local shard, counted on one of the ranks that hold it alike (tensor_norms.counted_here)."""
        return local_pieces((n, p.grad) for n, p in self.model.named_parameters() if p.requires_grad)

    def parameter_pieces(self) -> list[Piece]:
        return local_pieces((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    def local_output(self, module_name: str) -> tuple[int, int] | None:
        """Where the module `module_name` leaves each TP rank its piece of its output: (dim, parts) for
        gather_local_output; None where its output is whole (or a DTensor). The strategy's TP plan says."""
        return None

    def full_module_output(self, module_name: str, output: torch.Tensor) -> torch.Tensor:
        """A DTensor output in full; a local output (local_output) gathered over tp."""
        if isinstance(output, DTensor):
            return output.full_tensor()
        piece = self.local_output(module_name)
        return output if piece is None else gather_local_output(output, self.tp_mesh, *piece)

    def local_piece(self, param):
        """A DTensor parameter's local shard (its dp × tp piece), sharing its storage."""
        return local(param)

    def accumulating(self, last: bool):
        """FSDP2's own way: gradients are reduce-scattered only in the last micro-batch's backward; before it they
        accumulate unsharded (set_requires_gradient_sync). Without FSDP2 there is nothing to hold back."""
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(last)
        return super().accumulating(last)

    def optimizer_step(self, lr: float) -> OptimizerStep:
        """Clip across the meshes and step; under fp16 first the harness's loss scaler (DeepSpeed's rules): an overflow
        on any rank skips the step, else the gradient shards are unscaled."""
        scale = self.loss_scale
        shards = (local(p.grad) for p in self.model.parameters() if p.grad is not None)
        skipped = unscaled_or_skipped(self.scaler, shards, self.ctx.device,
                                      lambda: self.optimizer.zero_grad(set_to_none=True))
        if skipped is not None:
            return skipped
        self.record_gradients()  # the shards the norm below is taken of, unscaled
        norm = clip_sharded_gradients(self.model.parameters(), self.cfg)
        step_optimizer(self.optimizer, lr)
        return applied(self.scaler, norm, scale)

    def parameter_norm(self) -> float:
        return global_norm(trainable(self.model.parameters()))  # LoRA's: the adapters

    def model_state_bytes(self) -> dict:
        """Each parameter's local shard (its dp × tp piece: the optimizer's parameters), its gradient's, and
        Adam's state of it. In forward and backward FSDP2 registers a group's all-gathered parameters on the
        modules in place of the shards: copies, counted as gathered_params; a gradient they accumulate before
        FSDP2 reduce-scatters it is this rank's gradient, counted as one."""
        ledger = StateLedger(self.ctx.device)
        shards = [p for group in self.optimizer.param_groups for p in group["params"]]
        ledger.add_all(PARAMS, shards)
        ledger.add_all(PARAMS, (p for _, p in self._frozen))  # LoRA's frozen base: its shards
        ledger.add_all(GRADS, (p.grad for p in shards))
        ledger.add_optimizer_state(self.optimizer)
        registered = list(self.model.parameters())  # the shards again, or a group's gathered parameters
        ledger.add_all(GATHERED, registered)
        ledger.add_all(GRADS, (p.grad for p in registered))
        return ledger.result()

    @property
    def hf_model(self):
        return self.model  # fully_shard and TP plans change modules in place: HF names hold

    def full_parameters(self) -> dict[str, torch.Tensor]:
        if hasattr(self.model, "reshard"):
            self.model.reshard()  # a forward without backward (the final evaluation) leaves FSDP2's root unsharded
        return {n: self._full(p) for n, p in self.model.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {n: self._full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None}

    def _full(self, t: torch.Tensor) -> torch.Tensor:
        return full_tensor(t, self.ctx.device)

    def save_state(self, directory: str) -> None:
        """torch.distributed.checkpoint: each rank writes its own shards (__<rank>_0.distcp), rank 0 the
        .metadata that maps them to the full tensors."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(directory, DCP_DIR))
        if self.scaler is not None and self.ctx.rank == 0:  # every rank's scaler is the same
            torch.save(self.scaler.state_dict(), os.path.join(directory, SCALER_FILE))

    def load_state(self, directory: str) -> None:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)  # the shapes to load into
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=os.path.join(directory, DCP_DIR))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(torch.load(os.path.join(directory, SCALER_FILE), weights_only=True))
