"""DDP: the baseline. Every rank holds the whole model; gradients are averaged by all-reduce.

Only the parts that differ between strategies are here: wrapping, the optimizer step, and (trivially,
since nothing is sharded) full-size parameters and gradients.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from parity.errors import ConfigError
from parity.training.memory import GRAD_BUCKETS, GRADS, PARAMS, StateLedger
from parity.training.strategy import Strategy, build_optimizer, clip_local_gradients, local_norm, step_optimizer


class DDPStrategy(Strategy):
    name = "ddp"

    @classmethod
    def validate(cls, settings, model_config) -> None:
        if settings.tp_size != 1:
            raise ConfigError(f"DDP does not shard tensors: --tp_size must be 1 (got {settings.tp_size}); use "
                              f"train_deepspeed.py or train_fsdp.py for tensor parallelism")

    def setup(self, model) -> None:
        model.to(self.ctx.device)
        device_ids = [self.ctx.device] if self.ctx.device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids)
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg)

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

