"""docs/custom_strategy.md's example: data parallelism written by hand, as a user brings their own strategy to the
harness — a Strategy subclass in their own file, run with --strategy_class my_strategy:HandWrittenDP. Every rank
holds the whole model; after the last micro-batch's backward each gradient is all-reduced and averaged over the
DP ranks (the interface's contract: after backward every rank holds the global batch's gradients), then
clipped and stepped with the shared AdamW. (tests/test_custom_strategy.py runs it, and a copy
that forgets to average.)"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from parity.training.memory import GRADS, PARAMS, StateLedger
from parity.training.strategy import Strategy, build_optimizer, clip_local_gradients, local_norm, step_optimizer

STATE_FILE = "hand_written_dp.pt"


class HandWrittenDP(Strategy):
    name = "hand_written_dp"  # names the record: loss_hand_written_dp.json
    tensor_parallel = False  # every rank holds whole tensors: --tp_size 1

    def setup(self, model) -> None:
        self.model = model.to(self.ctx.device)
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg)

    @property
    def hf_model(self):
        return self.model

    def backward(self, loss, last: bool = True) -> None:
        loss.backward()
        if last:  # the DP average, once the micro-batches have accumulated their gradients
            for grad in self.gradients():
                dist.all_reduce(grad)
                grad.div_(self.ctx.dp_size)

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def optimizer_step(self, lr: float) -> float:
        norm = clip_local_gradients(self.model.parameters(), self.cfg)
        step_optimizer(self.optimizer, lr)
        return norm

    def parameter_norm(self) -> float:
        return local_norm(self.model.parameters())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().cpu().clone() for n, p in self.model.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().float().cpu().clone() for n, p in self.model.named_parameters()
                if p.grad is not None}

    def model_state_bytes(self) -> dict:
        ledger = StateLedger(self.ctx.device)
        params = list(self.model.parameters())
        ledger.add_all(PARAMS, params)
        ledger.add_all(GRADS, (p.grad for p in params))
        ledger.add_optimizer_state(self.optimizer)
        return ledger.result()

    def save_state(self, directory: str) -> None:
        if self.ctx.rank == 0:  # every rank holds the same state
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                       os.path.join(directory, STATE_FILE))

    def load_state(self, directory: str) -> None:
        state = torch.load(os.path.join(directory, STATE_FILE), map_location=self.ctx.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class HandWrittenDPSummed(HandWrittenDP):
    """The example with its classic bug: gradients summed over the DP ranks, never averaged."""

    def backward(self, loss, last: bool = True) -> None:
        loss.backward()
        if last:
            for grad in self.gradients():
                dist.all_reduce(grad)
