"""DDP: the baseline. Every rank holds the whole model; gradients are averaged by all-reduce.

Only the parts that differ between strategies are here: wrapping, the optimizer step, (trivially, since
nothing is sharded) full-size parameters and gradients, and the checkpoint: one file of state dicts.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.nn.parallel import DistributedDataParallel

from parity.errors import ConfigError
from parity.training.memory import GRAD_BUCKETS, GRADS, PARAMS, StateLedger
from parity.training.strategy import Strategy, build_optimizer, clip_local_gradients, local_norm, step_optimizer

STATE_FILE = "model_optimizer.pt"  # the module's and the optimizer's state dicts (the replay reads it too)


class DDPStrategy(Strategy):
    name = "ddp"
    tensor_parallel = False

    @classmethod
    def validate(cls, settings, model_config) -> None:
        if settings.tp_size != 1:
            raise ConfigError(f"DDP does not shard tensors: --tp_size must be 1 (got {settings.tp_size}); use "
                              f"train_deepspeed.py or train_fsdp.py for tensor parallelism")

    def setup(self, model) -> None:
        model.to(self.ctx.device)
        if self.cfg.activation_checkpointing:  # the model's own: torch.utils.checkpoint around each decoder layer
            model.activation_checkpointing_enable()
        if self.cfg.compile:
            for layer in model.model.layers:
                layer.compile()  # in place: the module keeps its name
        device_ids = [self.ctx.device] if self.ctx.device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids)
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg)

    def accumulating(self, last: bool):
        """DDP's own way: no all-reduce in a micro-batch's backward until the last (no_sync)."""
        return contextlib.nullcontext() if last else self.model.no_sync()

    def optimizer_step(self, lr: float) -> float:
        norm = clip_local_gradients(self.model.parameters(), self.cfg)
        step_optimizer(self.optimizer, lr)
        return norm

    def parameter_norm(self) -> float:
        return local_norm(self.model.parameters())

    def model_state_bytes(self) -> dict:
        """The full parameters, their gradients and Adam's state, plus the reducer's gradient buckets: DDP
        all-reduces a flat copy of the gradients (C++ tensors no Python object reaches; the reducer reports
        their sizes), so between backward and the step a rank holds the gradients twice."""
        ledger = StateLedger(self.ctx.device)
        params = list(self.model.parameters())
        ledger.add_all(PARAMS, params)
        ledger.add_all(GRADS, (p.grad for p in params))
        ledger.add_optimizer_state(self.optimizer)
        sizes = self.model._get_ddp_logging_data().get("bucket_sizes") or ""
        ledger.add_bytes(GRAD_BUCKETS, sum(int(s) for s in str(sizes).split(",") if s.strip()))
        return ledger.result()

    @property
    def hf_model(self):
        return self.model.module

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().cpu().clone() for n, p in self.model.module.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().float().cpu().clone()
                for n, p in self.model.module.named_parameters() if p.grad is not None}

    def save_state(self, directory: str) -> None:
        """Every rank holds the same state: rank 0 writes it, under Hugging Face names."""
        if self.ctx.rank == 0:
            torch.save({"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict()},
                       os.path.join(directory, STATE_FILE))

    def load_state(self, directory: str) -> None:
        state = torch.load(os.path.join(directory, STATE_FILE), map_location=self.ctx.device, weights_only=True)
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def read_full_state(directory: str, model_config) -> tuple[dict, dict, int]:
    """A DDP checkpoint as full tensors under Hugging Face names: (the model's state dict, AdamW's moments
    {name: {"exp_avg", "exp_avg_sq"}}, the optimizer's step count), for the layer check's replay. The
    optimizer's state dict numbers the parameters in the model's parameter order, which names them."""
    from parity.training.model import parameter_names

    state = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=True)
    names = parameter_names(model_config)
    optimizer = state["optimizer"]
    order = optimizer["param_groups"][0]["params"]
    moments = {names[i]: {key: optimizer["state"][index][key] for key in ("exp_avg", "exp_avg_sq")}
               for i, index in enumerate(order)}
    return state["model"], moments, int(optimizer["state"][order[0]]["step"])
