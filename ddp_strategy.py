"""DDP: the baseline. Every rank holds the whole model; gradients are averaged by all-reduce.

Only the parts that differ between strategies are here: wrapping, the optimizer step, (trivially, since
nothing is sharded) full-size parameters and gradients, and the checkpoint: one file of state dicts.

Every precision policy, so that a strategy is always compared with DDP in its own policy: the shared PolicyOptimizer
(parity/training/policy_optimizer.py) keeps the fp32 master copies of a bf16 or fp16 model and fp16's loss scaler, and
DDP reduces the gradients in the policy's reduce dtype — its own all-reduce when that is the gradients' dtype, else a
comm hook that reduces in it (policy_optimizer.reduce_in). Under --grad_accum_dtype fp32 DDP reduces every
micro-batch and the optimizer adds each into the fp32 master gradients (the sum of averages is the average of sums);
otherwise it accumulates in the gradients' dtype under no_sync and reduces once.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.nn.parallel import DistributedDataParallel

from parity.errors import ConfigError
from parity.models.families import family_of
from parity.training.memory import GRAD_BUCKETS, StateLedger
from parity.precision import POLICIES, policy_of
from parity.training.optimizer import local_norm
from parity.training.policy_optimizer import PolicyOptimizer, reduce_in
from parity.training.strategy import Strategy

STATE_FILE = "model_optimizer.pt"  # the module's and the optimizer's state dicts (the replay reads it too)


class DDPStrategy(Strategy):
    name = "ddp"
    tensor_parallel = False
    takes_adapters = True  # LoRA: DDP reduces the gradients of what requires them, its PolicyOptimizer steps them
    replays_records = True  # the trusted loop: train_ddp.py --replay_record (parity/replay/replay.py)
    takes_perturb = True  # loss_scale and optimizer_step below
    clips_as_torch = True  # its PolicyOptimizer's step
    follows_loss_scales = True  # its PolicyOptimizer's scaler (scaler_of)
    precisions = tuple(POLICIES)
    policy_optimizer_class = PolicyOptimizer  # steps the shared AdamW under the policy (a seeded bug's copy replaces it)
    reads_at_clip = True  # its PolicyOptimizer's step hands the gradients to the tensor record where it takes the norm
    records_update_noise = True  # the baseline: its series holds its optimizer's own noise (every update bound reads it)

    @classmethod
    def validate(cls, settings, model_config) -> None:
        """The base's checks, after DDP's own refusal of --tp_size > 1, which names the scripts that shard tensors
        (the base's refusal names none)."""
        if settings.tp_size != 1:
            raise ConfigError(f"DDP does not shard tensors: --tp_size must be 1 (got {settings.tp_size}); use "
                              f"train_deepspeed.py or train_fsdp.py for tensor parallelism")
        super().validate(settings, model_config)

    def setup(self, model) -> None:
        model.to(self.ctx.device)
        if self.cfg.activation_checkpointing:  # the model's own: torch.utils.checkpoint around each decoder layer
            model.activation_checkpointing_enable()
        if self.cfg.compile:
            for layer in model.get_submodule(family_of(model.config).stack):
                layer.compile()  # in place: the module keeps its name
        # before DDP: its buckets take the dtype
        self.policy_optimizer = self.policy_optimizer_class(model.parameters(), self.cfg,
                                                            [name for name, _ in model.named_parameters()])
        self.optimizer = self.policy_optimizer.optimizer
        device_ids = [self.ctx.device] if self.ctx.device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids)
        if self.cfg.reduce_dtype != policy_of(self.cfg).params:
            self.model.register_comm_hook(None, reduce_in(self.cfg.reduce_dtype))

    def accumulating(self, last: bool):
        """DDP's own way: no all-reduce in a micro-batch's backward until the last (no_sync) — except where
        micro-batches accumulate in fp32 master gradients, which take each one reduced."""
        return contextlib.nullcontext() if last or self.policy_optimizer.accumulates_fp32 else self.model.no_sync()

    def backward(self, loss, last: bool = True) -> None:
        loss.backward()
        self.policy_optimizer.accumulate()

    @property
    def loss_scale(self) -> float:
        """The policy's (fp16's loss scale, else 1), × a perturbed noise reference's factor (RunConfig.perturb)."""
        return super().loss_scale * (self.cfg.perturb or 1.0)

    def optimizer_step(self, lr: float):
        if self.cfg.perturb:  # a perturbed noise reference's gradients back to the loss's own scale
            self.policy_optimizer.divide_gradients(self.cfg.perturb)
        return self.policy_optimizer.step(lr, local_norm, before_norm=self.record_gradients)

    def parameter_norm(self) -> float:
        return local_norm(self.policy_optimizer.master_parameters())

    def set_optimizer_state(self, moments: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        self.policy_optimizer.set_moments([(p, moments[n]) for n, p in self.model.module.named_parameters()
                                           if p.requires_grad], step)

    def model_state_bytes(self) -> dict:
        """The full parameters, their gradients and Adam's state, plus the reducer's gradient buckets: DDP
        all-reduces a flat copy of the gradients (C++ tensors no Python object reaches; the reducer reports
        their sizes), so between backward and the step a rank holds the gradients twice."""
        ledger = StateLedger(self.ctx.device)
        self.policy_optimizer.count_state(ledger, list(self.model.parameters()))
        sizes = self.model._get_ddp_logging_data().get("bucket_sizes") or ""
        ledger.add_bytes(GRAD_BUCKETS, sum(int(s) for s in str(sizes).split(",") if s.strip()))
        return ledger.result()

    @property
    def hf_model(self):
        return self.model.module

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The master weights (what the optimizer updates), under the module's names."""
        return {n: self.policy_optimizer.master_of(p).detach().float().cpu().clone()
                for n, p in self.model.module.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().float().cpu().clone()
                for n, p in self.model.module.named_parameters() if p.grad is not None}

    def save_state(self, directory: str) -> None:
        """Every rank holds the same state: rank 0 writes it, under Hugging Face names."""
        if self.ctx.rank == 0:
            torch.save({"model": self.model.module.state_dict(), **self.policy_optimizer.state_dict()},
                       os.path.join(directory, STATE_FILE))

    def load_state(self, directory: str) -> None:
        state = torch.load(os.path.join(directory, STATE_FILE), map_location=self.ctx.device, weights_only=True)
        self.model.module.load_state_dict(state["model"])
        self.policy_optimizer.load_state_dict(state)

    @staticmethod
    def read_full_state(directory: str, model_config, lora: dict | None = None) -> tuple[dict, dict, int]:
        """A DDP checkpoint as full tensors under Hugging Face names: (the model's state dict, AdamW's moments
        {name: {"exp_avg", "exp_avg_sq"}}, the optimizer's step count), for the layer check's replay. The
        optimizer's state dict numbers the parameters it steps in the model's parameter order, which names them (with
        LoRA, `lora`, the adapters alone: the state dict is the PEFT model's); a policy's fp32 master copies
        (bf16_params, fp16), in the same order, are the weights."""
        from parity.models.adapters import trained_parameter_names

        state = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=True)
        names = trained_parameter_names(model_config, lora)
        optimizer = state["optimizer"]
        order = optimizer["param_groups"][0]["params"]
        moments = {names[i]: {key: optimizer["state"][index][key] for key in ("exp_avg", "exp_avg_sq")}
                   for i, index in enumerate(order)}
        weights = {**state["model"], **dict(zip(names, state.get("masters") or ()))}
        return weights, moments, int(optimizer["state"][order[0]]["step"])
