"""A user's `deepspeed.initialize` engine, ZeRO stages 0–3, with or without AutoTP (`tensor_parallel.autotp_size`),
read with the DeepSpeed strategy's code (zero_state.py, which the strategy reads its own engine with): its norm over
each rank's master pieces, its replicas and its full master weights and moments (ZeRO-1/2's fragments in one
collective, ZeRO-3's through DeepSpeed's safe_get_full_*, AutoTP's shards gathered by each AutoTP layer). The ranks
of a TP group feed one DP rank's rows (DeepSpeed checks they are the same): its TP rank 0 hands them over. DeepSpeed
clips and steps inside `engine.step()`: the pre-clip norm is DeepSpeed's own (`engine.get_global_grad_norm()`,
per-tensor float64 sums rounded to fp32), the record's grad_norm_source says "framework" (ZeRO-0 over the loop's own
torch optimizer keeps none: the recorder's, taken where the engine clips, says "recorder"). The engine's own config
says the run's precision policy (`policy_request`: its bf16, fp16 or torch_autocast section, read as a strategy run's
--deepspeed_config is), which the recorder takes rather than being told it.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from parity.deepspeed_precision import config_policy
from parity.precision import POLICIES, PolicyRequest
from parity.training.optimizer import local_norm
from parity.training.tensor_norms import Piece
from parity.views.adapters import peft_inner
from parity.views import zero_state
from parity.views.base import View, ViewRefused, torch_optimizer
from parity.views.norm_point import watch_norm
from parity.views.zero_state import full_tensors


class ZeRO(View):
    """A DeepSpeed engine (ZeRO stages 0–3, AutoTP or not) that a user's loop steps."""

    grad_norm_visible = False  # DeepSpeed clips inside engine.step(): its own norm, after the step
    steps_once_an_update = False  # ZeRO-1/2 step the client optimizer once per parameter group, ZeRO-3 per sub-group
    pieces_at_optimizer = False
    scales_loss = True  # its fp16 mode's loss scaler

    @classmethod
    def read(cls, model, optimizer, device: torch.device, unwrap) -> "ZeRO | None":
        """A DeepSpeedEngine; None where deepspeed is not imported (None in sys.modules: a name blocked) or `model` is
        no engine."""
        if sys.modules.get("deepspeed") is None:
            return None
        from deepspeed import DeepSpeedEngine

        return cls(model, device) if isinstance(model, DeepSpeedEngine) else None

    def __init__(self, engine, device: torch.device):
        inner, self.prefix = peft_inner(engine.module)  # a PeftModel's Hugging Face model, and its names' prefix
        super().__init__(inner, torch_optimizer(engine.optimizer))
        self.engine, self.device = engine, device
        tp = max(engine.autotp_size(), 1)  # 0 where AutoTP is off
        self.tp_ranks, self.dp_ranks = zero_state.autotp_groups(engine, self.rank)
        if len(self.tp_ranks) * len(self.dp_ranks) != self.world or len(self.tp_ranks) != tp:
            raise ViewRefused(f"DeepSpeed's AutoTP groups of {len(self.tp_ranks)} × {len(self.dp_ranks)} ranks (TP × "
                              f"DP), autotp_size {tp}, in a world of {self.world}: the recorder reads them over every "
                              f"rank")
        self.tp_rank = self.tp_ranks.index(self.rank)
        self.dp_rank, self.dp_size = self.dp_ranks.index(self.rank), len(self.dp_ranks)
        self.feeds = self.tp_rank == 0
        self.zero_stage = engine.zero_optimization_stage()
        self.kind = f"deepspeed zero{self.zero_stage}"
        request = self.policy_request(engine)  # the policy its config asks for (None: fp32)
        self.masters_apart = request is not None and POLICIES[request.precision].master_copy  # not bf16_pure's
        # ZeRO-0 in bf16 or fp16: the fp32 masters its FP16_UnfusedOptimizer keeps beside the module's parameters
        apart_at_0 = self.masters_apart and self.zero_stage == 0
        if apart_at_0 and type(engine.optimizer).__name__ != "FP16_UnfusedOptimizer":
            raise ViewRefused(f"DeepSpeed's ZeRO-0 in {request.precision} over a fused optimizer "
                              f"({type(engine.optimizer).__name__}, its fp32 masters flat): the recorder reads ZeRO-0's "
                              f"masters beside a torch optimizer's parameters only; use ZeRO stage 1 or higher")
        self.unfused = zero_state.unfused_masters(engine) if apart_at_0 else None
        # ZeRO-0 over the loop's torch optimizer: DeepSpeed keeps no norm; the recorder's, taken where the engine clips
        self.measures_norm = self.zero_stage == 0 and not self.masters_apart
        self.own_norm: float | None = None

    def describe(self) -> dict:
        """The layout, and where ZeRO-Offload keeps the optimizer's states and the parameters' partitions when it moves
        them off the device ({"optimizer": "cpu", "param": "cpu"}; absent without offload): what the record says ran."""
        offload = {}
        for part, config in (("optimizer", self.engine.zero_offload_optimizer()),
                             ("param", self.engine.zero_offload_param())):
            device = "none" if config is None else str(getattr(config.device, "value", config.device))  # enum or str
            if device != "none":
                offload[part] = device
        return {**super().describe(), **({"offload": offload} if offload else {})}

    def group_params(self):
        wrapper = self.engine.optimizer
        for attribute in ("bit16_groups", "fp16_groups"):  # ZeRO-1/2's, ZeRO-3's: the module's parameters by group
            groups = getattr(wrapper, attribute, None)
            if groups is not None and len(groups) == len(self.optimizer.param_groups):
                return [list(g) for g in groups]
        return super().group_params()

    def optimizer_kind(self) -> tuple[str, str | None]:
        """DeepSpeed's FusedAdam — what its config's "optimizer": {"type": "Adam" or "AdamW"} builds — and its
        DeepSpeedCPUAdam — what the same config builds under ZeRO-Offload — are torch's AdamW (adam_w_mode) or Adam (L2
        weight decay), in one kernel or on the CPU: the same update, its rounding in another order; the replay builds
        torch's."""
        kind = type(self.optimizer)
        if kind.__module__.startswith("deepspeed.ops.adam") and hasattr(self.optimizer, "adam_w_mode"):
            return ("AdamW" if self.optimizer.adam_w_mode else "Adam"), kind.__name__
        return super().optimizer_kind()

    def grad_norm(self, squares=None) -> float:
        raise RuntimeError("DeepSpeed clips inside engine.step(): its own norm is read after the step")

    @classmethod
    def policy_request(cls, model) -> PolicyRequest | None:
        """The precision policy a DeepSpeedEngine's config asks for, with its reduce and accumulation dtypes and loss
        scaler (deepspeed_precision.config_policy over the settings the engine read: one reading for a strategy run's
        --deepspeed_config and a user's engine); None for a model that is no engine, or an engine in fp32."""
        if sys.modules.get("deepspeed") is None:
            return None
        from deepspeed import DeepSpeedEngine

        if not isinstance(model, DeepSpeedEngine):
            return None
        return config_policy(model._config._param_dict, "the DeepSpeed engine's config")

    def framework_grad_norm(self):
        """DeepSpeed's own norm; at ZeRO-0 over the loop's torch optimizer, where DeepSpeed keeps none, the one taken
        where it clips (float64 over the reduced gradients every rank holds whole)."""
        if self.measures_norm:
            return self.own_norm
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    @property
    def norm_source(self) -> str:
        return "recorder" if self.measures_norm else "framework"

    def watch_norm(self, read) -> bool:
        """Where engine.step() takes the norm it clips by (the DeepSpeed strategy's reading point: norm_point.py); at
        ZeRO-0 over the loop's torch optimizer the norm is measured there too (framework_grad_norm)."""
        if not self.measures_norm:  # its fp16 optimizers at ZeRO-0: read at their step's entry
            return watch_norm(self.engine, read, inline_at_step=True)

        def read_and_measure():
            read()
            self.own_norm = local_norm([p.grad for _, p in self.trainable() if p.grad is not None])
        return watch_norm(self.engine, read_and_measure)

    def loss_scale(self) -> float:
        return float(getattr(self.engine.optimizer, "loss_scale", 1.0)) if self.engine.fp16_enabled() else 1.0

    def _local_master(self, p):
        return zero_state.local_master(p, self.zero_stage, self.masters_apart, self.unfused)

    def parameter_norm(self) -> float:
        return zero_state.module_norm(self.engine, self._local_master, zero_stage=self.zero_stage,
                                      partitioned=self.zero_stage > 0 and self.masters_apart, device=self.device,
                                      tp_size=len(self.tp_ranks))

    def _gather(self, read) -> dict[str, torch.Tensor]:
        return full_tensors(self.model, read)  # every parameter once, under its first name, AutoTP's gathered

    def full_state_dict(self):
        """The master weights (the DeepSpeed strategy's reading: zero_state.full_masters), tied names and buffers as
        the module's state dict holds them."""
        full = zero_state.full_masters(self.engine, self.zero_stage, self._gather, self._local_master)
        first = {id(p): name for name, p in self.model.named_parameters()}
        tied = {name: full[first[id(p)]] for name, p in self.model.named_parameters(remove_duplicate=False)}
        return {k: tied.get(k, v) for k, v in self.model.state_dict().items()}  # buffers as the module holds them

    def full_optimizer_state(self):
        return zero_state.full_moments(self.engine, self.zero_stage, self._gather, self._local_master)

    def gradient_pieces(self) -> list[Piece]:
        """Each gradient's piece where DeepSpeed holds it at its norm inside engine.step() (the DeepSpeed strategy's
        reading: zero_state.local_gradient, zero_pieces; watch_norm)."""
        return zero_state.zero_pieces(self.engine, self.trainable(),
                                      lambda p: zero_state.local_gradient(p, self.zero_stage),
                                      partitioned=self.zero_stage > 0, tp_rank=self.tp_rank)

    def parameter_pieces(self) -> list[Piece]:
        return zero_state.zero_pieces(self.engine, self.trainable(), self._local_master, tp_rank=self.tp_rank,
                                      partitioned=self.zero_stage == 3 or self.zero_stage > 0 and self.masters_apart)

    @staticmethod
    def local_piece(p):
        """A ZeRO-3 parameter's partition (the module's parameter is empty between uses); the parameter below it."""
        return getattr(p, "ds_tensor", p).detach()

    def replicas(self):
        found = zero_state.zero_replicas(self.engine, self.zero_stage, everyone=tuple(range(self.world)),
                                         same_shard=self.dp_ranks, same_partition=self.tp_ranks,
                                         tp_size=len(self.tp_ranks))  # under the engine's module's names
        return [dataclasses.replace(r, name=r.name.removeprefix(self.prefix)) for r in found]


VIEW = ZeRO
__all__ = ["VIEW", "ZeRO"]
