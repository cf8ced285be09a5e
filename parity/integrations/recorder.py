"""A recorder for a training loop of your own: it writes the harness's loss record (`loss_<name>.json`) of a run the
harness never trained, so that the run can be replayed under the harness's DDP (parity/integrations/replay.py) and
judged by plot_loss_curves.py (docs/own_trainer.md).

It is one more loop feeding the per-step observer (parity/training/observer.py), which keeps the record, the replica
check and the experiment trackers. What the recorder adds is what a foreign loop does not hand over by itself:

- the loss it measures itself, from the model's outputs: each micro-batch's logits and labels (`micro_batch`) give a
  token-loss sum (parity.training.loss.loss_sum, float64); the sums of every DP rank ÷ the global batch's loss tokens
  are the step's loss — the global token mean, whatever the loop backpropagated. The loop's own logged loss is kept
  beside it (`logged_loss`);
- the pre-clip global gradient norm in float64, from the gradients (`before_step`, after backward and before
  clipping), or the framework's own value where the recorder cannot see the gradients before clipping: the record's
  `grad_norm_source` says which;
- the parameter norm after the update, the lr the optimizer applied (read by an optimizer step pre-hook), the loss
  tokens, the global batch's hash over its rows in the harness's order (DP rank r's rows at [r·b, (r+1)·b),
  micro-batches in order: parity.training.data.batch_hash of that Batch, which is what the replay hashes), and a check
  that no two DP ranks fed the same rows (`rows_check`: the verdict FAILs a run whose ranks did, at that step);
- the replica check over what the ranks hold alike (under DDP every parameter and its Adam moments; FSDP2's and
  ZeRO's replicated pieces: the layout's replicas()), bit for bit;
- the optimizer whole (its type; per parameter group the parameter names, lr scale, weight decay, betas, eps);
- the initial weights at construction (safetensors with the model's config, as --save_init_weights writes them, and
  config.json) and every step's global batch (input ids, labels, attention mask; the micro-batch structure in the
  record), up to `max_batch_bytes`; past it no more batches are saved, one line says so and the record is marked not
  replayable.

The process group the loop trains in is read by its layout (sharded.py): plain or DDP (every rank a DP rank holding
the whole model), FSDP2 with or without DTensor TP, a DeepSpeed ZeRO 0–3 engine — each with the harness's own gather
and norm code for that sharding. A step's rows, sums and health travel in one all_gather (rows.py); rank 0 alone
hashes, checks and saves the batch, the saving on a thread of its own. A recorder failure never stops the user's
training: it logs one line and records nothing more (every rank together: the ranks' health travels with each
step's exchange).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from parity import storage
from parity.fingerprint import fingerprint
from parity.integrations.attach import attached
from parity.integrations.rows import BatchWriter, RowExchange, duplicate_rows, global_batch, rows_hash
from parity.integrations.sharded import LayoutRefused, layout_of
from parity.models.model import config_summary, save_init_weights
from parity.precision import POLICIES
from parity.registry import KNOWN
from parity.training.data import Batch, batch_hash, recorded_batch_path
from parity.training.loss import IGNORE_INDEX, loss_sum
from parity.training.observer import StepObserver, device_name
from parity.training.record import LossRecord, record_path

DEFAULT_MAX_BATCH_BYTES = 1 << 30  # 1 GiB of saved global batches (int64 ids, labels and mask: 24 bytes a token)
SOURCE = "recorder"  # the record's config.source: written by this recorder, not by the harness's loop
OPTIMIZER_FLAGS = ("amsgrad", "maximize", "decoupled_weight_decay", "nesterov")  # what changes the update, if set


def recorded_folder(output_dir: str, name: str) -> str:
    """Where a recorder keeps the initial weights, the model's config.json and the batches of run `name`."""
    return storage.join(output_dir, f"recorded_{name}")


def unwrap(model):
    """The user's module inside DDP (`.module`) or torch.compile (`._orig_mod`): the one whose names are Hugging
    Face's."""
    while True:
        inner = next((m for m in (getattr(model, "module", None), getattr(model, "_orig_mod", None))
                      if isinstance(m, torch.nn.Module)), None)
        if inner is None:
            return model
        model = inner


def describe_optimizer(optimizer, names: dict[int, str], group_params: list[list] | None = None) -> dict:
    """The optimizer whole: its type and per parameter group the parameters' names, the lr scale (the group's lr ÷ the
    first group's: each group's lr is scale × the step's lr), weight decay, betas, eps, and the flags that change the
    update where set (amsgrad, maximize ...). `group_params`: each group's module parameters, where the optimizer's
    groups hold others (ZeRO's flat partitions)."""
    groups = optimizer.param_groups
    group_params = group_params or [g["params"] for g in groups]
    firsts = [g.get("initial_lr", g.get("lr", 0.0)) for g in groups]
    described = []
    for group, first, params in zip(groups, firsts, group_params):
        entry = {"params": [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in params],
                 "lr_scale": float(first / firsts[0]) if firsts[0] else 1.0,
                 "weight_decay": float(group.get("weight_decay", 0.0))}
        if "betas" in group:
            entry["betas"] = [float(b) for b in group["betas"]]
        if "momentum" in group:
            entry["momentum"] = float(group["momentum"])
        if "eps" in group:
            entry["eps"] = float(group["eps"])
        flags = {k: group[k] for k in OPTIMIZER_FLAGS if group.get(k)
                 and not (k == "decoupled_weight_decay" and isinstance(optimizer, torch.optim.AdamW))}  # AdamW's own
        if flags:
            entry["flags"] = flags
        described.append(entry)
    return {"type": type(optimizer).__name__, "groups": described}


class ParityRecorder:
    """Records a training run of your own loop, on every rank of its process group (docs/own_trainer.md):

        rec = ParityRecorder(output_dir, name="my_run", model=model, optimizer=optimizer, max_grad_norm=1.0)
        for step ...:
            for micro-batch ...:
                logits = model(input_ids=ids, attention_mask=mask).logits
                ... loss.backward()
                rec.micro_batch(ids, labels, logits, attention_mask=mask)
            rec.before_step()               # after backward, before clipping: the pre-clip norm
            clip_grad_norm_(...); optimizer.step(); scheduler.step(); optimizer.zero_grad()
            rec.after_step(logged_loss=...)  # the step's entry; every `log_interval` steps the file
        rec.close()                          # the record complete

    Made before the first optimizer step (it saves the initial weights then) and after the process group is up
    (torch.distributed initialised: one rank is a group of one). `model` may be wrapped (DDP, torch.compile),
    sharded by FSDP2's fully_shard (with or without DTensor TP), or a DeepSpeed engine (then
    `optimizer=engine.optimizer`, after_step after the boundary's engine.step(): sharded.py);
    `max_grad_norm` is what the loop clips to (0: it does not clip); `precision` the harness's name of what the loop
    computes in (fp32, bf16 for autocast over fp32 weights ...); `max_batch_bytes` caps the batches saved (default
    DEFAULT_MAX_BATCH_BYTES); `framework` names the loop (shown in the fingerprint, not compared); `log` takes rank
    0's lines (default: stderr)."""

    def __init__(self, output_dir: str, *, name: str, model, optimizer, max_grad_norm: float = 0.0,
                 precision: str = "fp32", max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, log_interval: int = 10,
                 framework: str = "plain PyTorch", framework_versions: dict | None = None,
                 log: Callable[[str], Any] | None = None, dump_step: int | None = None):
        output_dir, name = attached(output_dir, name)  # verify_trainer.py's folder and name, where it runs the loop
        self.enabled, self.name, self.dump = False, name, None
        self._print = log or (lambda line: print(line, file=sys.stderr, flush=True))
        refusal = self._refusal(name, precision)
        if refusal:
            self._print(f"parity recorder: {refusal}: recording nothing")
            return
        try:
            self._start(output_dir, model, optimizer, max_grad_norm, precision, max_batch_bytes, log_interval,
                        framework, framework_versions or {})
            self.enabled = True
            if dump_step is not None:  # step K in full, for compare_dumps.py (parity/integrations/dump.py)
                from parity.integrations.dump import StepDump

                self.dump = StepDump(self, dump_step)
        except LayoutRefused as exc:  # a process group or wrapper it cannot read (sharded.py)
            self._print(f"parity recorder: {exc}: recording nothing")
        except Exception as exc:  # never the user's training
            self._print(f"parity recorder: could not start ({type(exc).__name__}: {_first_line(exc)}): recording "
                        f"nothing")

    @staticmethod
    def _refusal(name: str, precision: str) -> str | None:
        if not isinstance(name, str) or not name.isidentifier():
            return f"name {name!r} is not an identifier (it names loss_<name>.json)"
        if name in KNOWN:
            return (f"name {name!r} is a strategy of the harness ({', '.join(KNOWN)}): its record would be taken for "
                    f"the harness's own run; choose another")
        if not dist.is_available() or not dist.is_initialized():
            return ("torch.distributed is not initialised: call init_process_group first (one process: "
                    "init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:29500'))")
        if precision not in POLICIES:
            return f"precision {precision!r} is not one of the harness's policies ({', '.join(POLICIES)})"
        return None

    # --- set-up -------------------------------------------------------------------------------------
    def _start(self, output_dir, model, optimizer, max_grad_norm, precision, max_batch_bytes, log_interval,
               framework, framework_versions) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                       else torch.device("cpu"))
        self.layout = layout_of(model, optimizer, self.device, unwrap)  # plain/DDP, FSDP2, ZeRO (sharded.py)
        self.model, self.optimizer = self.layout.model, self.layout.optimizer
        optimizer = self.optimizer  # the torch optimizer that steps (ZeRO's wraps the user's client one)
        self.folder = recorded_folder(output_dir, self.name)
        self.max_batch_bytes, self.saved_bytes, self.log_interval = max_batch_bytes, 0, log_interval
        self.names = self.layout.names()  # Hugging Face names (FSDP1's cleaned of its wrappers)
        self.optimizer_description = describe_optimizer(optimizer, self.names, self.layout.group_params())
        self.not_replayable: str | None = None
        config = getattr(self.model, "config", None)
        hf = config is not None and hasattr(config, "to_json_string")
        weights_sha = None
        state = self.layout.full_state() if hf else None  # full tensors where sharded: every rank (collective)
        if self.rank == 0:
            if hf:
                storage.write_bytes_atomic(storage.join(self.folder, "config.json"),
                                           config.to_json_string().encode())
                weights_sha = save_init_weights(self.model, storage.join(self.folder, "init_weights.safetensors"),
                                                state)
            else:
                self.not_replayable = f"the model ({type(self.model).__name__}) is not a Hugging Face model"
        self.writer = BatchWriter() if self.rank == 0 else None
        self.exchange = RowExchange()
        group0 = optimizer.param_groups[0]
        betas = group0.get("betas", (0.0, 0.0))
        script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else None
        framework_part = {"name": framework, "versions": framework_versions,
                          "script": os.path.basename(script) if script else None,
                          "script_sha256": _file_sha256(script) if script and os.path.isfile(script) else None}
        policy = POLICIES[precision]
        description = {
            "source": SOURCE, "framework": framework, "strategy": self.name, "strategy_path": None,
            "model_name": self.folder, "model_type": getattr(config, "model_type", None),
            "hugging_face_model": hf, "tp_size": self.layout.tp_size, "pp_size": 1, "ep_size": 1,
            "dp_size": self.layout.dp_size, "sharding": self.layout.describe(),
            "num_workers": self.world, "world_size": self.world, "batch_size": None, "global_batch_size": None,
            "grad_accum_steps": None, "seq_length": None, "precision": precision,
            "reduce_dtype": policy.reduce_dtypes[0], "grad_accum_dtype": policy.grad_accum_dtypes[0],
            "loss_scaling": None, "total_steps": None, "init_weights_sha256": weights_sha,
            "init_weights_path": storage.join(self.folder, "init_weights.safetensors") if hf else None,
            "model_config": config_summary(config) if hf else {},
            "learning_rate": float(group0.get("initial_lr", group0.get("lr", 0.0))),
            "max_grad_norm": float(max_grad_norm), "weight_decay": float(group0.get("weight_decay", 0.0)),
            "adam_beta1": float(betas[0]), "adam_beta2": float(betas[1]), "adam_epsilon": float(group0.get("eps", 0.0)),
            "optimizer": self.optimizer_description, "grad_norm_source": None, "loss_source": "recorder",
            "batches": {"folder": storage.join(self.folder, "batches"), "max_bytes": max_batch_bytes,
                        "saved_steps": 0, "replayable": True, "not_replayable": None, "micro_batches": None},
            "device_type": self.device.type, "device_name": device_name(self.device), "backend": dist.get_backend(),
            "fingerprint": {**fingerprint(type(self), self.device, getattr(config, "model_type", None)),
                            "framework": framework_part},
        }
        self.record = LossRecord(record_path(output_dir, self.name), self.name, description)
        self.observer = StepObserver(self.record, device=self.device, replicas=self, replica_check_interval=1,
                                     log=self._line)
        self.step, self.grad_norm_source = 0, None
        self._reset_step()
        if self.not_replayable:
            self._not_replayable(self.not_replayable)
        self._lrs: list[float] | None = None
        self.norm_at_optimizer_step: float | None = None  # an adapter sets it to nan to have the pre-hook measure it
        self.step_extras: dict = {}  # an adapter's fields for the next step's entry
        self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._last = time.perf_counter()
        self._line(f"recording {self.name} ({framework}, {self.layout.kind}, {self.world} rank"
                   f"{'s' if self.world > 1 else ''}) into "
                   f"{self.record.path}")

    def replicas(self):
        """What ranks hold alike in the loop's layout (sharded.py): under data parallelism every parameter and its Adam
        moments on every rank; FSDP2's and ZeRO's replicated pieces."""
        return self.layout.replicas()

    def _reset_step(self) -> None:
        self.micro: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.loss_sum, self.tokens = 0.0, 0
        self.grad_norm: float | None = None
        self.broken: str | None = None
        self.recorder_s = 0.0

    # --- per micro-batch, per step --------------------------------------------------------------------
    def micro_batch(self, input_ids, labels, logits, attention_mask=None, *, log_probs=None) -> None:
        """One micro-batch this rank fed the model: its input ids and labels ([rows, length]; labels as Hugging Face
        takes them: the ids, −100 where no loss is taken), the model's logits on it, the attention mask if any. A model
        that returns no logits (TRL's fused LM head) gives `log_probs` instead: each position's log-probability of its
        next token, zero where no loss is taken ([rows, length − 1])."""
        if not self.enabled or self.broken:
            return
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                if log_probs is not None:
                    summed = float(-log_probs.detach().double().sum())
                else:
                    logits = self.layout.logits(logits.detach())  # a DTensor's in full
                    summed = float(loss_sum(logits, labels.to(logits.device)).double())
            ids, lab = input_ids.detach().to("cpu", torch.int64), labels.detach().to("cpu", torch.int64)
            mask = (torch.ones_like(ids) if attention_mask is None
                    else attention_mask.detach().to("cpu", torch.int64))
            self.micro.append((ids, lab, mask))
            self.loss_sum += summed
            self.tokens += int((lab[:, 1:] != IGNORE_INDEX).sum())
        except Exception as exc:
            self.broken = f"micro_batch: {type(exc).__name__}: {_first_line(exc)}"
        self.recorder_s += time.perf_counter() - t0

    def before_step(self, grad_norm: float | None = None, source: str = "framework") -> None:
        """After the step's backward, before clipping: the pre-clip global gradient norm, measured here in float64 from
        the gradients (under DDP every rank holds the reduced ones) — or `grad_norm`, the framework's own value (an
        adapter that measured it itself says `source="recorder"`)."""
        if not self.enabled or self.broken:
            return
        t0 = time.perf_counter()
        try:
            if self.dump is not None and grad_norm is None:
                self.dump.take_grads()
            if grad_norm is not None:
                self.grad_norm, self.grad_norm_source = float(grad_norm), source
            elif self.layout.grad_norm_visible:  # full gradients, float64 (collective where they are sharded)
                self.grad_norm = self.layout.grad_norm()
                self.grad_norm_source = "recorder"
        except Exception as exc:
            self.broken = f"before_step: {type(exc).__name__}: {_first_line(exc)}"
        self.recorder_s += time.perf_counter() - t0

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """The optimizer's step pre-hook: the lr of every group as the step applies it; for an adapter that asks
        (`norm_at_optimizer_step`), the float64 norm of the gradients the step applies (after any clipping)."""
        self._lrs = [float(g["lr"]) for g in optimizer.param_groups]
        if self.dump is not None:
            self.dump.take_grads()
        if self.norm_at_optimizer_step is not None:
            try:
                self.norm_at_optimizer_step = self.layout.grad_norm()
            except Exception:
                self.norm_at_optimizer_step = math.nan

    def after_step(self, lr: float | None = None, logged_loss: float | None = None,
                   grad_norm: float | None = None, logged_grad_norm: float | None = None) -> None:
        """After the optimizer's step (every rank; a collective): the step's record entry. `lr`: the lr applied (by
        default what the optimizer's first group applied); `logged_loss`: the framework's own loss of the step, kept
        beside the measured one; `grad_norm`: the framework's pre-clip norm where before_step was not called;
        `logged_grad_norm`: the framework's own norm, kept beside the recorded one."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        step_time = t0 - self._last - self.recorder_s
        try:
            self._record_step(lr, logged_loss, grad_norm, step_time, t0, logged_grad_norm)
            if self.dump is not None:
                self.dump.after_step(self.step - 1, self.micro)
        except Exception as exc:
            self._disable(f"{type(exc).__name__}: {_first_line(exc)}")
        self._reset_step()
        self._lrs = None
        self._last = time.perf_counter()

    def _record_step(self, lr, logged_loss, grad_norm, step_time, t0, logged_grad_norm=None) -> None:
        if grad_norm is not None and self.grad_norm is None:
            self.grad_norm, self.grad_norm_source = float(grad_norm), "framework"
        if self.grad_norm is None and not self.layout.grad_norm_visible:  # DeepSpeed's own, of the step it took
            self.grad_norm, self.grad_norm_source = self.layout.framework_grad_norm(), "framework"
        if not self.broken and self.grad_norm is None:
            self.broken = "no pre-clip grad norm: call before_step() before clipping, or give after_step(grad_norm=)"
        if not self.broken and not self.micro:
            self.broken = "no micro-batch: call micro_batch() for each one the step fed"
        # the step's exchange (rows.py): every rank's health, loss sum and tokens to all, the rows to rank 0 alone
        got = self.exchange(self.broken, self.loss_sum, self.tokens, self.micro, feeds=self.layout.feeds,
                       dp_rank=self.layout.dp_rank, dp_size=self.layout.dp_size, device=self.device)
        exchanged = time.perf_counter()
        lrs = self._lrs or [float(g["lr"]) for g in self.optimizer.param_groups]
        lr = float(lr) if lr is not None else lrs[0]
        self._check_scales(lrs)
        param_norm = self.layout.param_norm()  # full parameters, float64 (collective where they are sharded)
        normed = time.perf_counter()
        sums, counts = got.rank_loss_sums, got.rank_tokens
        tokens = sum(counts)
        hash_, rows_check, order_free, saving = "", None, None, 0.0
        if self.rank == 0:  # rank 0 alone: what fails here must not leave the other ranks in a collective
            s0 = time.perf_counter()
            try:
                self._harvest(self.writer.finished())
                batch, mask, structure = global_batch(got.per_dp_rank)
                hash_, rows_check = batch_hash(batch), duplicate_rows(got.per_dp_rank)
                order_free = rows_hash(got.per_dp_rank)
                self._describe_layout(structure, batch)
                self._save_batch(batch, mask)
            except Exception as exc:
                self._not_replayable(f"step {self.step}'s batch could not be hashed or saved ({type(exc).__name__}: "
                                     f"{_first_line(exc)})")
            saving = time.perf_counter() - s0
        if self.record.data["config"]["grad_norm_source"] not in (None, self.grad_norm_source):
            self.record.data["config"]["grad_norm_source"] = "mixed"
        elif self.record.data["config"]["grad_norm_source"] is None:
            self.record.data["config"]["grad_norm_source"] = self.grad_norm_source
        extras = {"grad_norm_source": self.grad_norm_source}
        if logged_loss is not None:
            extras["logged_loss"] = float(logged_loss)
        if logged_grad_norm is not None:
            extras["logged_grad_norm"] = float(logged_grad_norm)
        if rows_check is not None:
            extras["rows_check"], extras["rows_hash"] = rows_check, order_free
        extras.update(self.step_extras)  # an adapter's per-step fields (Trainer's: declared_lr)
        harness_s = {"recorder_before": self.recorder_s, "exchange": exchanged - t0, "param_norm": normed - exchanged,
                     "batch": saving}
        self.observer.observe_step(self.step, rank_loss_sums=sums, rank_tokens=counts, tokens=tokens,
                                   grad_norm=self.grad_norm, param_norm=param_norm, lr=lr, batch_hash=hash_,
                                   step_time_s=step_time, harness_s=harness_s, **extras)
        if rows_check and rows_check["duplicates"] and self.rank == 0:
            first = rows_check["pairs"][0]
            self._line(f"step {self.step}: ranks {first[0]} and {first[1]} fed {first[2]} identical row"
                       f"{'s' if first[2] > 1 else ''}: the verdict will FAIL")
        self.step += 1
        if self.step % self.log_interval == 0:
            self.observer.write()

    def _check_scales(self, lrs: list[float]) -> None:
        """Each group's lr must stay its recorded scale × the first group's, as the replay applies it."""
        if lrs[0] and self.not_replayable is None:
            for group, applied in zip(self.optimizer_description["groups"], lrs):
                if abs(applied - group["lr_scale"] * lrs[0]) > 1e-12 * abs(applied):
                    self._not_replayable(f"at step {self.step} the groups' lrs are not in their recorded ratios")
                    return

    def _describe_layout(self, structure: list[list[int]], batch: Batch) -> None:
        """The run's micro-batch structure (rows of each micro-batch, per rank), which the replay repeats: the same at
        every step, the same on every rank."""
        config = self.record.data["config"]
        layout = config["batches"]
        if layout["micro_batches"] is None:
            layout["micro_batches"] = structure
            config["batch_size"] = sum(structure[0])
            config["global_batch_size"] = sum(map(sum, structure))
            config["grad_accum_steps"] = len(structure[0])
        elif layout["micro_batches"] != structure:
            self._not_replayable(f"step {self.step}'s micro-batches ({structure}) differ from step 0's "
                                 f"({layout['micro_batches']})")
        if any(s != structure[0] for s in structure) or len(set(structure[0])) > 1:
            self._not_replayable(f"step {self.step}'s micro-batches are not alike on every rank ({structure}): the "
                                 f"harness gives each DP rank equal micro-batches")
        config["seq_length"] = max(config["seq_length"] or 0, batch.input_ids.shape[1])

    def _save_batch(self, batch: Batch, mask: torch.Tensor) -> None:
        layout = self.record.data["config"]["batches"]
        if not layout["replayable"]:
            return
        size = 3 * batch.input_ids.numel() * 8
        if self.saved_bytes + size > self.max_batch_bytes:
            self._not_replayable(f"the batches passed max_batch_bytes ({self.max_batch_bytes} bytes) at step "
                                 f"{self.step}: no more batches are saved")
            return
        self.writer.submit(self.step, recorded_batch_path(layout["folder"], self.step),  # written on its own thread
                           {"input_ids": batch.input_ids, "labels": batch.labels, "attention_mask": mask})
        self.saved_bytes += size

    def _harvest(self, finished: list[tuple[int, str | None]]) -> None:
        """The batches the writer has finished: saved_steps counts those on disk, in order; a failed one makes the
        record not replayable."""
        layout = self.record.data["config"]["batches"]
        for step, failed in finished:
            if failed:
                self._not_replayable(f"step {step}'s batch could not be saved ({failed})")
            elif layout["replayable"] and step == layout["saved_steps"]:
                layout["saved_steps"] = step + 1

    def _not_replayable(self, why: str) -> None:
        layout = self.record.data["config"]["batches"]
        if layout["replayable"]:
            layout["replayable"], layout["not_replayable"] = False, why
            self._line(f"{why}: the record is not replayable")

    # --- the end ----------------------------------------------------------------------------------
    def close(self) -> str | None:
        """The record complete (every rank; a collective). Returns its path on rank 0 (None if nothing recorded)."""
        if not self.enabled:
            return None
        try:
            self._hook.remove()
            if self.writer is not None:
                self._harvest(self.writer.close())
            config = self.record.data["config"]
            config["total_steps"] = self.step
            self.observer.finish(lambda: {"steps": self.step, "source": SOURCE})
            self._line(f"recorded {self.step} steps: {self.record.path}")
            return self.record.path if self.rank == 0 else None
        except Exception as exc:
            self._disable(f"{type(exc).__name__}: {_first_line(exc)}")
            return None
        finally:
            self.enabled = False

    def _disable(self, why: str) -> None:
        self.enabled = False
        self._line(f"failed ({why}): recording nothing more; the training goes on")
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
        if getattr(self, "writer", None) is not None:
            self.writer.close()

    def _line(self, text: str) -> None:
        if getattr(self, "rank", 0) == 0:
            self._print(f"parity recorder [{self.name}]: {text}")


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


__all__ = ["DEFAULT_MAX_BATCH_BYTES", "ParityRecorder", "describe_optimizer", "recorded_folder", "unwrap"]
