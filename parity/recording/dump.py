"""Localising a recorded run's FAIL to a module: one step recorded in full on both sides, in the layer check's dump
format (parity/layer_check/layer_step.py), so that compare_dumps.py names the first divergent module and phase.

- The user's side: `ParityRecorder(..., dump_step=K)` (or `ParityCallback(..., dump_step=K)`) reruns the user's script
  with the recorder hooking every submodule at step K: each module's output and its gradient (the layer check's
  ModuleRecorder: micro-batches concatenated in the order they ran), every parameter's gradient as the optimizer step
  sees it before clipping where the loop says when that is (`before_step`), else at the optimizer step, and every
  parameter after the update; gathered over the DP ranks in the harness's row order and written by rank 0 as
  `dump_<name>.{safetensors,json}` beside the record, full tensors under Hugging Face names.
- The replay's side: `train_ddp.py --replay_record OUT/loss_<name>.json --dump_step K --loss_output_dir OUT` trains
  the recorded steps 0…K−1 under DDP and records step K with the layer check's own worker (`dump_ddp.*`).

Both write the step's global batch as the folder's `inputs.safetensors`, byte for byte the same (the dumps' inputs
hash must agree). The harness feeds no attention mask, the user's loop does: on a right-padded row the positions past
its end compute other values (they attend to other keys) that nothing downstream reads (causal attention, labels
−100). Both dumps zero the module outputs and output gradients there, so that what is compared is what the loss saw.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from parity import storage
from parity.storage import atomic_path, write_json_atomic

INPUTS_FILE = "inputs.safetensors"  # parity.layer_check.inputs.INPUTS_FILE: the layer step reads it by that name


def write_step_inputs(path: str, input_ids: torch.Tensor, labels: torch.Tensor, step: int) -> None:
    """The step's global batch as the layer check's inputs file; the same bytes on the user's side and the replay's
    (canonical_safetensors: the dumps' inputs_sha256 must agree)."""
    from safetensors.torch import save

    from parity.models.model import canonical_safetensors

    data = save({"input_ids": input_ids.contiguous(), "labels": labels.contiguous()},
                metadata={"dataset": f"a recorded run's step {step}", "seed": "0"})
    storage.write_bytes_atomic(path, canonical_safetensors(data))


def zero_padding(tensors: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Module outputs and output gradients ([rows, length, ...]) zeroed where the attention mask is 0."""
    out = {}
    for key, t in tensors.items():
        if key.split("/", 1)[0] in ("output", "output_grad") and t.dim() >= 2 and tuple(t.shape[:2]) == tuple(mask.shape):
            t = t * mask.reshape(*mask.shape, *([1] * (t.dim() - 2))).to(t.dtype)
        out[key] = t
    return out


class StepDump:
    """The recorder's side (ParityRecorder's `dump_step`): hooks armed for step `step`, the dump written at its end."""

    def __init__(self, recorder, step: int):
        self.rec, self.step = recorder, int(step)
        self.modules, self.grads = None, None
        if self.step == 0:
            self._arm()

    def _arm(self) -> None:
        from parity.layer_check.layer_step import ModuleRecorder

        self.modules = ModuleRecorder(self.rec.model)

    def take_grads(self) -> None:
        """The gradients of the recorded step, the first time it is asked (before clipping where the loop calls
        before_step, else at the optimizer step)."""
        if self.modules is not None and self.grads is None:
            try:  # in the optimizer's step pre-hook: never the user's step
                self.grads = {n: p.grad.detach().float().cpu().clone() for n, p in self.rec.model.named_parameters()
                              if p.grad is not None}
            except Exception as exc:
                self.rec.broken = f"dump_step: the gradients could not be copied ({type(exc).__name__})"

    def after_step(self, done: int, micro: list) -> None:
        """After step `done` was recorded (every rank): arm the hooks for the next step, or write the dump."""
        if done == self.step - 1:
            self._arm()
        if done != self.step or self.modules is None:
            return
        records = self.modules.remove()
        self.modules = None
        rank, world = self.rec.rank, self.rec.world
        params = {n: p.detach().float().cpu().clone() for n, p in self.rec.model.named_parameters()}
        mine = {"outputs": {k: v.float().cpu() for k, v in records.outputs.items()},
                "output_grads": {k: v.float().cpu() for k, v in records.output_grads.items()},
                "micro": micro, "order": (list(records.outputs), list(records.output_grads))}
        every = [None] * world if rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        if rank == 0 and (self.rec.stop is None or self.rec.stop[0] > self.step):  # (a step the record holds)
            self._write(every, self.grads or {}, params)
        self.grads = None

    def _write(self, every: list[dict], grads: dict, params: dict) -> None:
        from safetensors.torch import save_file

        from parity.recording.rows import global_batch
        from parity.models.model import file_sha256

        batch, mask, _ = global_batch([e["micro"] for e in every])
        length = mask.shape[1]
        tensors = {}
        for kind, key in (("output", "outputs"), ("output_grad", "output_grads")):
            for name in every[0][key]:
                parts = [_pad_length(e[key][name], length) for e in every]
                tensors[f"{kind}/{name}"] = torch.cat(parts)
        tensors = zero_padding(tensors, mask)
        tensors.update({f"grad/{k}": v for k, v in grads.items()})
        tensors.update({f"param/{k}": v for k, v in params.items()})
        folder = storage.local_path(storage.parent(self.rec.record.path))
        inputs = os.path.join(folder, INPUTS_FILE)
        write_step_inputs(inputs, batch.input_ids, batch.labels, self.step)
        entry = self.rec.record.data["steps"][-1]
        config = self.rec.record.data["config"]
        stem = os.path.join(folder, f"dump_{self.rec.name}")
        with atomic_path(stem + ".safetensors") as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        write_json_atomic(stem + ".json", {
            "strategy": self.rec.name, "tp_size": 1, "dp_size": self.rec.world, "pp_size": 1, "ep_size": 1,
            "precision": config["precision"], "options": {}, "device_type": self.rec.trains_on.type,
            "model_config": config["model_config"], "init_weights_sha256": config["init_weights_sha256"],
            "inputs_sha256": file_sha256(inputs), "learning_rate": entry["lr"], "loss": entry["loss"],
            "replay": replay_start(self.step), "dp_rank_losses": entry.get("dp_rank_losses"),
            "grad_norm": entry["grad_norm"], "perturbed": None, "forward_order": every[0]["order"][0],
            "backward_order": every[0]["order"][1], "fingerprint": config["fingerprint"],
            "framework": config.get("framework")})
        self.rec._line(f"dumped step {self.step} ({len(tensors)} tensors) into {stem}.safetensors: replay it with "
                       f"train_ddp.py --replay_record {self.rec.record.path} --dump_step {self.step} --loss_output_dir "
                       f"{folder}, then compare_dumps.py --input_dir {folder}")


def replay_start(step: int) -> dict:
    """What both dumps say of where their step started (the layer check's `replay` key): the initial weights."""
    return {"run": None, "checkpoint": None, "from_step": 0, "step": step}


def _pad_length(t: torch.Tensor, length: int) -> torch.Tensor:
    """A micro-batch's [rows, l, ...] tensor right-padded with zeros to the step's longest row."""
    if t.dim() < 2 or t.shape[1] == length:
        return t
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, length - t.shape[1]))


def dump_replay(cfg, batches, step: int) -> str:
    """The replay's side: steps 0…step−1 trained under the trusted loop, step `step` recorded in full into
    cfg.loss_output_dir (dump_<strategy>.*) by the layer check's worker in a Ray Train group, its padding zeroed as the
    user's dump's. Returns the dump's path."""
    from parity.driver.cluster import ray_for_this_command
    from parity.driver.launch import launch_runs
    from parity.layer_check.layer_step import layer_steps_worker

    payload = dump_payload(cfg, batches, step)
    with ray_for_this_command():
        launch_runs([cfg], [payload], checkpoints=False, worker=layer_steps_worker)
    return finish_dump(cfg, batches, step)


def dump_payload(cfg, batches, step: int) -> dict:
    """The layer check worker's payload for the replay's step `step` (the folder's inputs written first): several go
    in one group (parity.layer_check.layer_step.layer_steps_worker)."""
    from safetensors.torch import load

    from parity.errors import ConfigError
    from parity.training.data import recorded_batch_path

    folder = storage.local_path(cfg.loss_output_dir)
    if folder is None:
        raise ConfigError(f"--loss_output_dir {cfg.loss_output_dir}: a dump is written to a folder of this machine "
                          f"(compare_dumps.py reads it back here)")
    os.makedirs(folder, exist_ok=True)
    recorded = load(storage.read_bytes(recorded_batch_path(batches.folder, step)))
    write_step_inputs(os.path.join(folder, INPUTS_FILE), recorded["input_ids"], recorded["labels"], step)
    return {"output_dir": folder, "replay": {**replay_start(step), "batches": batches}}


def finish_dump(cfg, batches, step: int) -> str:
    """The replay's dump with its padding zeroed as the user's (the module docstring); returns its path."""
    from safetensors.torch import load, save_file

    from parity.layer_check.layer_step import dump_paths
    from parity.training.data import recorded_batch_path

    mask = load(storage.read_bytes(recorded_batch_path(batches.folder, step)))["attention_mask"]
    tensor_path, _ = dump_paths(storage.local_path(cfg.loss_output_dir), cfg)
    tensors = zero_padding(load(storage.read_bytes(tensor_path)), mask)
    with atomic_path(tensor_path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
    return tensor_path
