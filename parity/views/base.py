"""What every recorder's view holds beside the protocol (parity/training/view.py): the model under Hugging Face
names and the torch optimizer that steps it, where this rank sits (its DP rank, whether it hands its rows over), and
what the recorder asks of a loop it does not drive — the pre-clip norm where the loop's gradients can be read, the
framework's own where it clips inside its step, the full logits, the optimizer's groups, the record's description.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parity.models.model import persistent_buffers
from parity.precision import PolicyRequest
from parity.training.view import ShardedView


class View(ShardedView):
    """A model a user's loop trains, read under Hugging Face names. `model`: the user's module, unwrapped (the
    transformers model where a framework's module is translated: on the meta device will do); `optimizer`: the torch
    optimizer that steps it."""

    kind = "view"  # what the record's description and the recorder's first line call it
    zero_stage = 0
    whole = False  # whether every rank holds the whole model and its optimizer's state: rank 0 reads its own alone
    grad_norm_visible = True  # whether the recorder sees the full gradients before clipping (before_step)
    steps_once_an_update = True  # whether the torch optimizer steps (fires its step hooks) once in each update
    # whether gradient_pieces still reads the gradients the optimizer applies at its step pre-hook (not ZeRO's, whose
    # optimizer steps flat partitions its step built): the recorder's applied check (recorded_tensors.py)
    pieces_at_optimizer = True
    scales_loss = False  # whether what the view reads scales an fp16 loss itself (DeepSpeed's engine, megatron-core's
    # optimizer), where the recorder reads no GradScaler (recording/grad_scaler.py)

    @classmethod
    def policy_request(cls, model) -> PolicyRequest | None:
        """The precision policy `model`'s own settings ask for, where this view reads a model that says one (a
        DeepSpeed engine's config: zero.py); None: it says none. ConfigError in one line for one no policy holds."""
        return None

    def accumulated_in(self) -> str | None:
        """At the first training forward (recording/precision_seen.watch): the dtype the run accumulates its
        micro-batches' gradients in where the wrapper's state then says one its policy request could not (None: as
        requested)."""
        return None

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = self.rank, self.world
        self.feeds = True  # whether this rank hands over its DP rank's rows (one rank of each DP rank does)
        self.lora: dict | None = None  # the run's LoRA adapters, as RunConfig.lora (view_of: adapters.py)
        self.towers: list = []  # a multimodal model's towers beside the language model read (language_model.py)
        self.outside: set[int] = set()  # their parameters' ids: in the optimizer's groups, never in the record's
        self.walked: dict = {}  # what walks of the module found this step (trainable, checkpointing): step_done()

    @property
    def tp_size(self) -> int:
        return self.world // self.dp_size

    def describe(self) -> dict:
        return {"kind": self.kind, "zero_stage": self.zero_stage, "dp_size": self.dp_size, "tp_size": self.tp_size}

    # --- names ------------------------------------------------------------------------------------------------
    def names(self) -> dict[int, str]:
        """Each parameter's Hugging Face name, by its id (a tied weight under its first name)."""
        return {id(p): self.clean(n) for n, p in self.model.named_parameters()}

    @staticmethod
    def clean(name: str) -> str:
        """A name of the module's as Hugging Face names it (FSDP1's wrappers add parts of their own)."""
        return name

    def trainable(self) -> list[tuple[str, torch.Tensor]]:
        """(Hugging Face name, parameter) of every parameter the loop trains (requires_grad: a frozen one has no
        gradient and no update to judge), in the module's order: names()'s names, in one walk of the module, once a
        step (a 24-layer model's walk is 0.3 ms of host time, and the recorder reads the pieces three times a step)."""
        if "trainable" not in self.walked:
            self.walked["trainable"] = [(self.clean(n), p) for n, p in self.model.named_parameters() if p.requires_grad]
        return self.walked["trainable"]

    def checkpointing(self) -> bool:
        """Whether the model checkpoints its activations, as transformers says — is_activation_checkpointing, or before
        5.23 is_gradient_checkpointing (5.23's deprecated alias of it, which warns at every read) — once a step: it
        walks every module (0.4 ms at 24 layers), and the recorder asks at each micro-batch."""
        if "checkpointing" not in self.walked:
            name = next((n for n in ("is_activation_checkpointing", "is_gradient_checkpointing")
                         if hasattr(type(self.model), n)), None)
            self.walked["checkpointing"] = bool(name and getattr(self.model, name))
        return self.walked["checkpointing"]

    def step_done(self) -> None:
        """The recorder's step has ended: what the walks found may change before the next (a loop freezing a layer)."""
        self.walked.clear()

    def tensor_names(self) -> list[str]:
        return [name for name, _ in self.trainable()]

    def group_params(self) -> list[list]:
        """The parameters of each of the optimizer's groups (the module's: named in the record), frozen ones left out:
        they have no gradient, so torch's optimizers never step them (an optimizer over a LoRA model's every
        parameter trains its adapters alone)."""
        return [[p for p in g["params"] if p.requires_grad and id(p) not in self.outside]
                for g in self.optimizer.param_groups]

    def optimizer_kind(self) -> tuple[str, str | None]:
        """(the torch optimizer this view's optimizer's update equals, the implementation where it is not torch's):
        torch's, under its own name; a framework's view names its own kernels' (zero.py: DeepSpeed's FusedAdam)."""
        return type(self.optimizer).__name__, None

    # --- what the recorder reads of a step it does not drive --------------------------------------------------
    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The full logits of a micro-batch, as the loss sees them."""
        return logits

    def grad_norm(self, squares: torch.Tensor | None = None) -> float:
        """The global norm of the full gradients, float64 (after backward, before clipping). Collective where the
        gradients are sharded: every rank calls it. `squares`: this step's gradient squares as the recorder just read
        them (local_squares of gradient_pieces), where a view can take the norm from them (DataParallel)."""
        raise NotImplementedError

    def framework_grad_norm(self) -> float | None:
        """The framework's own pre-clip norm of the step just taken, where it keeps one (DeepSpeed) — or, where it keeps
        none, the view's own taken where it clips (`norm_source` says which)."""
        return None

    @property
    def norm_source(self) -> str:
        """framework_grad_norm's: "framework" (its own value) or "recorder" (measured where it clips)."""
        return "framework"

    def watch_norm(self, read) -> bool:
        """Have `read()` called where the framework takes the norm it clips by, inside its own step, where it can be
        watched (DeepSpeed's engine); False: the loop's before_step() is where the gradients are read."""
        return False

    def loss_scale(self) -> float:
        """What the gradients are still multiplied by where they are read (fp16's scale inside DeepSpeed's step)."""
        return 1.0

    # --- full tensors -----------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The model's full state dict under Hugging Face names, as the initial-weights file holds it (a tied weight
        under each of its names, the buffers); None: the module's own state_dict is full (`whole`). Collective where
        it is sharded: every rank calls it, rank 0 saves it."""
        return None

    def buffer_names(self) -> list[str]:
        """The module's buffers' Hugging Face names (a state dict holds the persistent ones)."""
        return [self.clean(n) for n, _ in self.model.named_buffers()]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The protocol's (parity/training/view.py), read from full_state_dict (the module's own where it is whole)."""
        state = self.full_state_dict()
        state = self.model.state_dict() if state is None else state
        return {name: state[name].detach().float().cpu().clone() for name in dict.fromkeys(self.names().values())}

    def full_buffers(self) -> dict[str, torch.Tensor]:
        """The module's persistent buffers (no wrapper shards a buffer: each rank reads its own); none of a meta
        model's (a translated view's transformers model holds none of the job's)."""
        return {self.clean(n): t for n, t in persistent_buffers(self.model).items()}

    @staticmethod
    def local_piece(p: torch.Tensor) -> torch.Tensor:
        """What this rank holds of parameter `p`: the parameter itself (FSDP1's flat shard, megatron-core's TP
        shard)."""
        return p.detach()

    def frozen_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """(Hugging Face name, this rank's piece) of every frozen parameter (LoRA's base), which the replica check
        holds to its bits at set-up (parity/training/frozen.py): a loop that moves its base trains another model than
        the adapters' replay. Local: no collective."""
        names = self.names()
        return [(names[id(p)], self.local_piece(p)) for p in self.model.parameters() if not p.requires_grad]


class ViewRefused(ValueError):
    """A process group or wrapper the recorder cannot read: one line, and it records nothing."""


def torch_optimizer(optimizer):
    """The torch optimizer that steps inside a framework's wrapper, the one the recorder hooks and describes:
    accelerate's AcceleratedOptimizer (a torch Optimizer subclass that never ran Optimizer.__init__, so it has no step
    hooks of its own, and steps the inner one only when accelerate syncs the gradients) and DeepSpeed's ZeRO
    optimizers hold it in `.optimizer`."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def trained_device(model, default: torch.device) -> torch.device:
    """The record's device, which the replay trains on: the GPU where `model`'s parameters are on one, else `default`
    (the backend's: where the recorder exchanges). Not always the backend's: ranks sharing one GPU over gloo train on it
    (docs/gpu.md); a model still on the meta device when the recorder starts (torchtitan's) trains on the backend's."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None and first.device.type == "cuda" else default


__all__ = ["View", "ViewRefused", "torch_optimizer", "trained_device"]
