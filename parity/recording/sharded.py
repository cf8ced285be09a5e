"""Where the recorder (recorder.py) reads a model in the process group a user's loop trains it in: which rank feeds
which data-parallel rank's rows, the pre-clip gradient norm and the parameter norm over full tensors (float64), the
full initial weights and the full state at a checkpoint (parameters and AdamW's moments: states.py) under Hugging Face
names, and the replicas (what several ranks hold alike).

Each layout reads the model with the harness's own code for that sharding, never a copy of it:
- `DataParallel` — plain or DDP, every rank a DP rank holding the whole model: the float64 norms of plain tensors
  (parity.training.optimizer.local_norm), every parameter and its moments on every rank (replicas.whole_model), the
  moments as the harness's strategies export theirs (optimizer.full_moments);
- `FullyShard` — FSDP2 (`fully_shard`) with or without a DTensor TP mesh: the DTensor strategies' norms across meshes
  (dtensor_strategy.global_norm), full tensors (full_tensor, optimizer.full_moments) and replicas
  (replicated_parameters, dtensor_replicas). The DP dim of a 2-D mesh is the one named "dp" (the harness's and
  torchtitan's name); the ranks of other dims feed the same rows, and only the one at coordinate 0 of every other dim
  hands them over;
- `ZeRO` — a user's `deepspeed.initialize` engine, ZeRO stages 0–3, TP 1: the DeepSpeed strategy's norm over each
  rank's master pieces, its replicas and its full master weights and moments (parity/strategies/autotp/zero_state.py:
  ZeRO-1/2's fragments in one collective, ZeRO-3's through DeepSpeed's safe_get_full_*). DeepSpeed clips and steps
  inside `engine.step()`: the pre-clip norm is DeepSpeed's own (`engine.get_global_grad_norm()`, per-tensor float64
  sums rounded to fp32), the record's grad_norm_source says "framework".

- `FSDP1` — FullyShardedDataParallel with use_orig_params=True (FULL_SHARD, SHARD_GRAD_OP): no harness strategy runs
  FSDP1, so its norms are written here as FSDP1's own clip_grad_norm_ takes them (each rank's pieces, summed over the
  group), its full tensors are FSDP1's FULL_STATE_DICT and its optimizer's full state dict.

Every layout also hands over each trainable tensor's pieces (tensor_names, gradient_pieces, parameter_pieces: the
strategy interface's three methods, read with the same code) for every tensor's series beside the record
(recorded_tensors.py), and each frozen one's (frozen_pieces) for the replica check's frozen check.

A peft PeftModel (wrapped or sharded as any model) is read through the Hugging Face model inside it, so that its names
are the harness's LoRA names; its adapters' settings are the layout's `lora` (adapters_record.py). What trains is what
requires gradients: the parameter norm, the series and the optimizer's groups take those alone, as the harness's
strategies do under LoRA (the base frozen).

Refused in one line (layout_of): FSDP1 without use_orig_params or in another sharding strategy, DeepSpeed's AutoTP,
a 2-D mesh without a "dp" dim, LoRA adapters the replay cannot build.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys

import torch
import torch.distributed as dist

from parity.recording.adapters_record import AdaptersRefused, lora_of, peft_inner
from parity.training.optimizer import ADAMW_MOMENTS, full_moments, local_norm
from parity.training.replicas import whole_model
from parity.training.tensor_norms import Piece, counted_by_name, local_pieces, rank0_pieces


class DataParallel:
    """Every rank of the world a DP rank holding the whole model (plain PyTorch, DDP). `model`: the user's module,
    unwrapped; `optimizer`: the torch optimizer that steps it."""

    kind = "data parallel"
    zero_stage = 0
    whole = True  # every rank holds the whole model and its optimizer's state: rank 0 reads its own (no collective)
    grad_norm_visible = True  # whether the recorder sees the full gradients before clipping (before_step)
    steps_once_an_update = True  # whether the torch optimizer steps (fires its step hooks) once in each update
    # whether gradient_pieces still reads the gradients the optimizer applies at its step pre-hook (not ZeRO's, whose
    # optimizer steps flat partitions its step built): the recorder's applied check (recorded_tensors.py)
    pieces_at_optimizer = True

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = self.rank, self.world
        self.feeds = True  # whether this rank hands over its DP rank's rows (one rank of each DP rank does)
        self.lora: dict | None = None  # the run's LoRA adapters, as RunConfig.lora (layout_of: adapters_record.py)

    @property
    def tp_size(self) -> int:
        return self.world // self.dp_size

    def describe(self) -> dict:
        return {"kind": self.kind, "zero_stage": self.zero_stage, "dp_size": self.dp_size, "tp_size": self.tp_size}

    def names(self) -> dict[int, str]:
        """Each parameter's Hugging Face name, by its id (a tied weight under its first name)."""
        return {id(p): self.clean(n) for n, p in self.model.named_parameters()}

    def buffer_names(self) -> list[str]:
        """The module's buffers' Hugging Face names (a state dict holds the persistent ones)."""
        return [self.clean(n) for n, _ in self.model.named_buffers()]

    @staticmethod
    def clean(name: str) -> str:
        """A name of the module's as Hugging Face names it (FSDP1's wrappers add parts of their own)."""
        return name

    def group_params(self) -> list[list]:
        """The parameters of each of the optimizer's groups (the module's: named in the record), frozen ones left out:
        they have no gradient, so torch's optimizers never step them (an optimizer over a LoRA model's every
        parameter trains its adapters alone)."""
        return [[p for p in g["params"] if p.requires_grad] for g in self.optimizer.param_groups]

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The full logits of a micro-batch, as the loss sees them."""
        return logits

    def grad_norm(self) -> float:
        """The global norm of the full gradients, float64 (after backward, before clipping). Collective where the
        gradients are sharded: every rank calls it."""
        return local_norm([p.grad for p in self.model.parameters() if p.grad is not None])

    def framework_grad_norm(self) -> float | None:
        """The framework's own pre-clip norm of the step just taken, where it keeps one (DeepSpeed)."""
        return None

    def watch_norm(self, read) -> bool:
        """Have `read()` called where the framework takes the norm it clips by, inside its own step, where it can be
        watched (DeepSpeed's engine); False: the loop's before_step() is where the gradients are read."""
        return False

    def loss_scale(self) -> float:
        """What the gradients are still multiplied by where they are read (fp16's scale inside DeepSpeed's step)."""
        return 1.0

    def param_norm(self) -> float:
        """The global norm of the full trainable parameters (LoRA's adapters, not its frozen base: as the harness's
        strategies take it), float64. Collective where they are sharded."""
        return local_norm([p.detach() for p in self.model.parameters() if p.requires_grad])

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The model's full state dict under Hugging Face names, for the initial weights; None: the module's own
        state_dict is full. Collective where it is sharded: every rank calls it, rank 0 saves it."""
        return None

    def full_optimizer_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], int] | None:
        """AdamW's moments as full fp32 CPU tensors under Hugging Face names and its step count, as the harness's
        strategies export theirs (Strategy.full_optimizer_state's shape and, for a torch optimizer over the module's
        parameters, its code: parity.training.optimizer.full_moments); None where the optimizer holds them in pieces of
        its own. Collective where they are sharded: every rank calls it (whole: rank 0 alone needs to)."""
        return full_moments(self.model.named_parameters(), self.optimizer, torch.device("cpu"))

    def replicas(self):
        """What every rank holds alike under data parallelism: every parameter and its Adam moments."""
        return whole_model(self.model, self.optimizer, tuple(range(self.world)))

    def frozen_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """(Hugging Face name, this rank's piece) of every frozen parameter (LoRA's base), which the replica check
        holds to its bits at set-up (parity/training/frozen.py, as the harness's strategies' Strategy.frozen_pieces):
        a loop that moves its base trains another model than the adapters' replay. Local: no collective."""
        names = self.names()
        return [(names[id(p)], self.local_piece(p)) for p in self.model.parameters() if not p.requires_grad]

    @staticmethod
    def local_piece(p: torch.Tensor) -> torch.Tensor:
        """What this rank holds of parameter `p` (whole here; FSDP1's flat shard is `p` itself too)."""
        return p.detach()

    # --- every tensor's norms (parity/training/tensor_norms.py): the strategy interface's three methods ------------
    def trainable(self) -> list[tuple[str, torch.Tensor]]:
        """(Hugging Face name, parameter) of every parameter the loop trains (requires_grad: a frozen one has no
        gradient and no update to judge), in the module's order."""
        names = self.names()
        return [(names[id(p)], p) for p in self.model.parameters() if p.requires_grad]

    def tensor_names(self) -> list[str]:
        return [name for name, _ in self.trainable()]

    def gradient_pieces(self) -> list[Piece]:
        """This rank's piece of each trainable tensor's gradient (local): here whole, rank 0's counted."""
        return rank0_pieces((name, p.grad) for name, p in self.trainable())

    def parameter_pieces(self) -> list[Piece]:
        return rank0_pieces((name, p.detach()) for name, p in self.trainable())


class FullyShard(DataParallel):
    """FSDP2 (fully_shard) over a 1-D mesh, or over the "dp" dim of a ("dp", "tp") mesh with DTensor TP: the norms,
    full tensors and replicas of the DTensor strategies (parity/training/dtensor_strategy.py)."""

    kind = "fsdp2"
    zero_stage = 3
    whole = False

    def __init__(self, model, optimizer, device: torch.device):
        super().__init__(model, optimizer)
        from torch.distributed.tensor import DTensor

        # every full_tensor() of a 2-D DTensor logs that it runs one collective per mesh dim (as fsdp_strategy.py)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.device = device
        meshes = {p.device_mesh._get_root_mesh() for p in model.parameters() if isinstance(p, DTensor)}
        if len(meshes) != 1:
            raise LayoutRefused(f"the model's DTensors live on {len(meshes)} root meshes: the recorder reads one")
        root = meshes.pop()
        names = list(root.mesh_dim_names or ())
        dp_name = next((n for n in ("dp", "data_parallel") if n in names), None)  # data_parallel: Lightning's name
        if root.ndim > 1 and dp_name is None:
            raise LayoutRefused(f"a {root.ndim}-D device mesh without a dim named 'dp' or 'data_parallel' ({names}): "
                                f"the recorder takes the data-parallel dim by that name")
        if root.size() != self.world:
            raise LayoutRefused(f"the device mesh spans {root.size()} of the {self.world} ranks")
        dp = names.index(dp_name) if root.ndim > 1 else 0
        coordinate = root.get_coordinate()
        self.dp_rank, self.dp_size = coordinate[dp], root.size(dp)
        self.feeds = all(c == 0 for i, c in enumerate(coordinate) if i != dp)
        self.mesh_shape = dict(zip(names or ["dp"], root.shape))  # the record's form: {dim name: size}
        self._replicated = None

    def describe(self) -> dict:
        return {**super().describe(), "mesh": self.mesh_shape}

    def logits(self, logits):
        from torch.distributed.tensor import DTensor

        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    def grad_norm(self) -> float:
        from parity.training.dtensor_strategy import global_norm

        return global_norm([p.grad for p in self.model.parameters() if p.grad is not None])

    def param_norm(self) -> float:
        from parity.training.dtensor_strategy import global_norm

        return global_norm([p.detach() for p in self.model.parameters() if p.requires_grad])

    def full_state(self):
        from parity.training.dtensor_strategy import full_tensor

        return {k: full_tensor(v, self.device) for k, v in self.model.state_dict().items()}

    def full_optimizer_state(self):
        return full_moments(self.model.named_parameters(), self.optimizer, self.device)  # DTensors: full_tensor()

    @staticmethod
    def local_piece(p):
        from parity.training.dtensor_strategy import local

        return local(p.detach())

    def replicas(self):
        from parity.training.dtensor_strategy import dtensor_replicas, replicated_parameters

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


class FSDP1(DataParallel):
    """FSDP1 (FullyShardedDataParallel) with use_orig_params=True, FULL_SHARD or SHARD_GRAD_OP over every rank: each
    rank holds a flat shard of each parameter (a view of its piece, empty where it holds none). Its norms are the sums
    of the local pieces' squares over the process group, as FSDP1's own clip_grad_norm_ takes them (float64 here); the
    initial weights are its FULL_STATE_DICT; no two ranks hold a piece alike."""

    kind = "fsdp1"
    zero_stage = 3
    whole = False

    def __init__(self, wrapper, optimizer, inner, device: torch.device, prefix: str = ""):
        from torch.distributed.fsdp import ShardingStrategy

        if not getattr(wrapper, "_use_orig_params", False):
            raise LayoutRefused("FSDP1 without use_orig_params=True: its optimizer steps flat parameters the recorder "
                                "cannot name; wrap with use_orig_params=True")
        if wrapper.sharding_strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            raise LayoutRefused(f"FSDP1 with {wrapper.sharding_strategy.name}: the recorder reads FULL_SHARD and "
                                f"SHARD_GRAD_OP")
        super().__init__(inner, optimizer)
        self.wrapper, self.device = wrapper, device
        self.prefix = prefix  # a PeftModel's names' part before its Hugging Face model's, in the wrapper's names
        if dist.get_world_size(wrapper.process_group) != self.world:
            raise LayoutRefused("FSDP1 over a process group other than the world's")
        if self.model is wrapper:
            raise LayoutRefused("FSDP1 around a module the recorder cannot name (pass the FSDP wrapper of a Hugging "
                                "Face model)")

    def clean(self, name: str) -> str:
        from torch.distributed.fsdp._common_utils import clean_tensor_name

        return clean_tensor_name(name).removeprefix(self.prefix)

    def _norm(self, tensors) -> float:
        from parity.training.optimizer import squared_norm_fp64

        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for t in tensors:
            total += squared_norm_fp64(t).to(self.device)
        dist.all_reduce(total, group=self.wrapper.process_group)
        return float(total.sqrt())

    def grad_norm(self) -> float:
        return self._norm(p.grad for p in self.model.parameters() if p.grad is not None)

    def param_norm(self) -> float:
        return self._norm(p.detach() for p in self.model.parameters() if p.requires_grad)

    def full_state(self):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(self.wrapper, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            return {self.clean(k): v.detach().clone() for k, v in self.wrapper.state_dict().items()}  # FSDP1's gather

    def full_optimizer_state(self):
        """FSDP1's own gather of the optimizer's state (its optim_state_dict under FULL_STATE_DICT, keyed by the
        parameters' names), as full_state is its FULL_STATE_DICT: no harness strategy runs FSDP1."""
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

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


class ZeRO(DataParallel):
    """A DeepSpeed engine (ZeRO stages 0–3, TP 1) that a user's loop steps: the DeepSpeed strategy's norms, replicas
    and full tensors (parity/strategies/autotp/zero_state.py), DeepSpeed's own pre-clip norm."""

    grad_norm_visible = False  # DeepSpeed clips inside engine.step(): its own norm, after the step
    whole = False
    steps_once_an_update = False  # ZeRO-1/2 step the client optimizer once per parameter group, ZeRO-3 per sub-group
    pieces_at_optimizer = False

    def __init__(self, engine, device: torch.device):
        if engine.autotp_size() > 1:
            raise LayoutRefused(f"DeepSpeed's AutoTP (autotp_size {engine.autotp_size()}): the recorder reads ZeRO at "
                                f"TP 1 only so far")
        inner, self.prefix = peft_inner(engine.module)  # a PeftModel's Hugging Face model, and its names' prefix
        super().__init__(inner, torch_optimizer(engine.optimizer))
        self.engine, self.device = engine, device
        self.zero_stage = engine.zero_optimization_stage()
        self.kind = f"deepspeed zero{self.zero_stage}"
        self.masters_apart = engine.bfloat16_enabled() or engine.fp16_enabled()
        if self.masters_apart and self.zero_stage == 0:
            raise LayoutRefused("DeepSpeed at ZeRO stage 0 with bf16 or fp16 weights: the recorder reads its masters at "
                                "stages 1–3 only")

    def group_params(self):
        wrapper = self.engine.optimizer
        for attribute in ("bit16_groups", "fp16_groups"):  # ZeRO-1/2's, ZeRO-3's: the module's parameters by group
            groups = getattr(wrapper, attribute, None)
            if groups is not None and len(groups) == len(self.optimizer.param_groups):
                return [list(g) for g in groups]
        return super().group_params()

    def grad_norm(self) -> float:
        raise RuntimeError("DeepSpeed clips inside engine.step(): its own norm is read after the step")

    def framework_grad_norm(self):
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def watch_norm(self, read) -> bool:
        """Where engine.step() takes the norm it clips by (the DeepSpeed strategy's reading point: norm_point.py)."""
        from parity.strategies.autotp.norm_point import watch_norm

        return watch_norm(self.engine, read)

    def loss_scale(self) -> float:
        return float(getattr(self.engine.optimizer, "loss_scale", 1.0)) if self.engine.fp16_enabled() else 1.0

    def _local_master(self, p):
        from parity.strategies.autotp.zero_state import local_master

        return local_master(p, self.zero_stage, self.masters_apart)

    def param_norm(self) -> float:
        from parity.strategies.autotp.zero_state import module_norm

        return module_norm(self.engine, self._local_master, zero_stage=self.zero_stage,
                           partitioned=self.zero_stage > 0 and self.masters_apart, device=self.device, tp_size=1)

    def _gather(self, read) -> dict[str, torch.Tensor]:
        from parity.strategies.autotp.gathers import full_tensors

        return full_tensors(self.model, read)  # every parameter once, under its first name (TP 1: as read)

    def full_state(self):
        """The master weights (the DeepSpeed strategy's reading: zero_state.full_masters), tied names and buffers as
        the module's state dict holds them."""
        from parity.strategies.autotp.zero_state import full_masters

        full = full_masters(self.engine, self.zero_stage, self._gather, self._local_master)
        first = {id(p): name for name, p in self.model.named_parameters()}
        tied = {name: full[first[id(p)]] for name, p in self.model.named_parameters(remove_duplicate=False)}
        return {k: tied.get(k, v) for k, v in self.model.state_dict().items()}  # buffers as the module holds them

    def full_optimizer_state(self):
        from parity.strategies.autotp.zero_state import full_moments as zero_moments

        return zero_moments(self.engine, self.zero_stage, self._gather, self._local_master)

    def gradient_pieces(self) -> list[Piece]:
        """Each gradient's piece where DeepSpeed holds it at its norm inside engine.step() (the DeepSpeed strategy's
        reading: zero_state.local_gradient, zero_pieces; watch_norm)."""
        from parity.strategies.autotp.zero_state import local_gradient, zero_pieces

        return zero_pieces(self.engine, self.trainable(), lambda p: local_gradient(p, self.zero_stage),
                           partitioned=self.zero_stage > 0, tp_rank=0)

    def parameter_pieces(self) -> list[Piece]:
        from parity.strategies.autotp.zero_state import zero_pieces

        return zero_pieces(self.engine, self.trainable(), self._local_master, tp_rank=0,
                           partitioned=self.zero_stage == 3 or self.zero_stage > 0 and self.masters_apart)

    @staticmethod
    def local_piece(p):
        """A ZeRO-3 parameter's partition (the module's parameter is empty between uses); the parameter below it."""
        return getattr(p, "ds_tensor", p).detach()

    def replicas(self):
        from parity.strategies.autotp.zero_state import zero_replicas

        everyone = tuple(range(self.world))
        found = zero_replicas(self.engine, self.zero_stage, everyone=everyone, same_shard=everyone,
                              same_partition=(self.rank,), tp_size=1)  # under the engine's module's names
        return [dataclasses.replace(r, name=r.name.removeprefix(self.prefix)) for r in found]


class LayoutRefused(ValueError):
    """A process group or wrapper the recorder cannot read: one line, and it records nothing."""


def torch_optimizer(optimizer):
    """The torch optimizer that steps inside a framework's wrapper, the one the recorder hooks and describes:
    accelerate's AcceleratedOptimizer (a torch Optimizer subclass that never ran Optimizer.__init__, so it has no step
    hooks of its own, and steps the inner one only when accelerate syncs the gradients) and DeepSpeed's ZeRO
    optimizers hold it in `.optimizer`."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def layout_of(model, optimizer, device: torch.device, unwrap) -> DataParallel:
    """The layout the user's `model` (as handed to the recorder: wrapped or not, accelerate's prepared model: DDP or
    the bare module) trains in, stepped by `optimizer` (or the torch optimizer inside its wrapper). LayoutRefused, one
    line, for one the recorder cannot read, and for LoRA adapters the replay cannot build."""
    if isinstance(model, DataParallel):  # a layout a framework adapter read itself (torchtitan's: frameworks/torchtitan/layout.py)
        return model
    optimizer = torch_optimizer(optimizer)
    layout = _layout(model, optimizer, device, unwrap)
    try:
        layout.lora = lora_of(layout.model, layout.names())  # a PEFT model's adapters, as the harness builds them
    except AdaptersRefused as exc:
        raise LayoutRefused(str(exc)) from None
    return layout


def trained_device(model, default: torch.device) -> torch.device:
    """The record's device, which the replay trains on: the GPU where `model`'s parameters are on one, else `default`
    (the backend's: where the recorder exchanges). Not always the backend's: ranks sharing one GPU over gloo train on it
    (docs/gpu.md); a model still on the meta device when the recorder starts (torchtitan's) trains on the backend's."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None and first.device.type == "cuda" else default


def _layout(model, optimizer, device: torch.device, unwrap) -> DataParallel:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if sys.modules.get("deepspeed") is not None:  # imported (None: a name blocked)
        from deepspeed import DeepSpeedEngine

        if isinstance(model, DeepSpeedEngine):
            return ZeRO(model, device)
    inner, prefix = peft_inner(unwrap(model))  # a PeftModel's Hugging Face model: the harness's names
    if isinstance(model, FullyShardedDataParallel):
        return FSDP1(model, optimizer, inner, device, prefix)
    if any(isinstance(m, FullyShardedDataParallel) for m in inner.modules()):
        raise LayoutRefused("FSDP1 inside the module: hand the recorder the root FullyShardedDataParallel")
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in inner.parameters()):
        return FullyShard(inner, optimizer, device)
    return DataParallel(inner, optimizer)


__all__ = ["DataParallel", "FSDP1", "FullyShard", "LayoutRefused", "ZeRO", "layout_of", "torch_optimizer",
           "trained_device"]
