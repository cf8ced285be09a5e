"""The per-step observer: what records and checks every step of a training run, for any loop that can say what its
step did.

The harness's loop (parity/training/loop.py) feeds it what its strategy's train_step returns; a recorder for another
loop (a Hugging Face Trainer's callback, Lightning's, a hand-written loop) feeds it what that loop can see. Per step
(`observe_step`) it takes the global batch, or its hash and loss-token count; the loss, or each DP rank's loss sum and
tokens; the pre-clip gradient norm, or the gradients; the parameter norm, or reads it through a callable; the lr and
the step's time. It owns:
- the loss record (parity/training/record.py): one entry per step, in the record's key order; `write` has rank 0
  rewrite the file and every rank learn whether it could;
- the replica check (parity/training/replicas.py), read through any object with `replicas()` (a Strategy is one):
  due every `replica_check_interval` steps, before every checkpoint and after the last step;
- the model-state probe (ModelStateProbe): what a rank holds during the measured step, called at the loop's hooks
  ("during_backward" as each gradient arrives, "after_backward", "after_step");
- the experiment trackers: handed each step's entry. The caller opens them (parity/tracking's open_trackers: they
  continue the tracker runs a resumed record names) and sets `trackers`; nothing here imports a tracker.

Every rank of the run's process group makes the observer and calls each method (the replica check, the writes, the
probe's report and `finish` are collectives); only rank 0 writes the record.
"""

from __future__ import annotations

import contextlib
import platform
import resource
import time
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from parity.ray_session import node_name
from parity.training.checkpoints import agree, write_problem
from parity.training.data import batch_hash as hash_of_batch
from parity.training.memory import PEAK_ORDERS, zero_bound
from parity.training.optimizer import local_norm
from parity.training.record import LossRecord
from parity.training.replicas import ReplicaCheck, parting_line
from parity.training.tensor_norms import AT_CLIP, PRE_CLIP
from parity.training.tensor_series import TensorSeriesWriter

NODE_ID_BYTES = 64  # a Ray node id is 56 hex characters


class StepObserver:
    """One run's per-step observation on this rank: `record` (a LossRecord, its config already described), the
    replicas `replicas.replicas()` declares (None: no replica check; the record says none were declared), checked
    every `replica_check_interval` steps and after step `total_steps` − 1, `parameter_norm` (a callable, collective
    if the parameters are sharded) for steps fed without one, `probe` (a ModelStateProbe, or None) on the measured
    step (`measured_step`, by default the last), and `log` (rank 0's lines: the first parted replicas). `device` is
    where the collectives' tensors go (the backend's: CUDA under NCCL). Made after the model is set up: the replica
    check gathers every rank's declaration (a collective)."""

    def __init__(self, record: LossRecord, *, device: torch.device, replicas=None, replica_check_interval: int = 1,
                 total_steps: int | None = None, parameter_norm: Callable[[], float] | None = None,
                 probe: ModelStateProbe | None = None, measured_step: int | None = None,
                 log: Callable[[str], Any] | None = None, tensor_names: list[str] | None = None,
                 tensor_grad: str = PRE_CLIP, tensors_why: str | None = None, tensors_read_at: str = AT_CLIP,
                 tensors_norm_dtype: str = "float64", replica_moments_every: int = 1):
        self.record, self.device, self.total_steps = record, device, total_steps
        self.is_logging_rank = dist.get_rank() == 0
        self.parameter_norm, self.probe, self.log = parameter_norm, probe, log or (lambda line: None)
        self.measured_step = measured_step if measured_step is not None else (
            total_steps - 1 if total_steps is not None else None)
        self.trackers = None  # rank 0's experiment trackers (parity.tracking.trackers.RunTrackers), set by the caller
        # each rank's declaration, checked against the rest
        self.replica_check = ReplicaCheck(replicas if replicas is not None else _NoReplicas(), replica_check_interval,
                                          device, replica_moments_every)
        record.declare_replicas(self.replica_check.summary)
        # every tensor's norms at every step, beside the record (tensor_series.py): `tensor_names` as observe_step's
        # tensor_grad_norms and tensor_param_norms come, `tensor_grad` which gradient read where (`tensors_read_at`)
        # against a norm taken in `tensors_norm_dtype`, or None and `tensors_why`
        self.tensors = TensorSeriesWriter(record, tensor_names, tensor_grad, tensors_why, tensors_read_at,
                                          tensors_norm_dtype)

    # --- the step ---------------------------------------------------------------------------------------
    def probe_at(self, step: int) -> ModelStateProbe | None:
        """The model-state probe if `step` is the measured one, else None: the loop calls it at its hooks during that
        step ("during_backward" with each parameter's name as its gradient arrives, "after_backward", "after_step"),
        and leaves its `seconds` out of the step's time."""
        return self.probe if self.probe is not None and step == self.measured_step else None

    def replica_digests(self, step: int) -> torch.Tensor | None:
        """Where the replica check is due after `step` (a loop without checkpoints: a recorder's), this rank's digests
        for the loop to gather over the world with a collective of its own — observe_step then takes the gathered
        table (`replica_table`): [0, 3] where there is nothing to digest — else None. Local."""
        if not self.replica_check.due(step + 1, self.total_steps, False):
            return None
        digests = self.replica_check.digests(step + 1 == self.total_steps)
        return digests if digests is not None else torch.zeros(0, 3, dtype=torch.int64)

    def observe_step(self, step: int, *, lr: float, step_time_s: float, loss: float | None = None,
                     dp_rank_losses: Sequence[float] | None = None, rank_loss_sums: Sequence[float] | None = None,
                     rank_tokens: Sequence[int] | None = None, grad_norm: float | None = None,
                     gradients: Iterable[torch.Tensor] | None = None, param_norm: float | None = None,
                     batch=None, batch_hash: str | None = None, tokens: int | None = None,
                     harness_s: dict | None = None, checkpoint: bool = False,
                     tensor_grad_norms: Sequence[float] | None = None, tensor_param_norms: Sequence[float] | None = None,
                     clip_coef: float | None = None, replica_table: torch.Tensor | None = None,
                     update_noise: Sequence[Sequence[float]] | None = None, **extras) -> dict:
        """Step `step` done (0-based; every rank calls it, in step order): the replica check when due (a collective;
        `checkpoint`: a checkpoint of this step follows), then the record's entry, then the trackers. Returns the
        entry (its "harness_s" is `harness_s` itself, with the seconds the check, the record and the trackers took
        added, where a caller adds its own: "record_write").

        What the step did, each from what the loop has:
        - the global batch `batch` (a parity.training.data.Batch: hashed, and its loss tokens), or `batch_hash` and
          `tokens` (the loss tokens of the global batch);
        - `loss` (the global batch's token-mean loss) and `dp_rank_losses` (each DP rank's mean over its slice), or
          `rank_loss_sums` and `rank_tokens` (each DP rank's loss sum and loss tokens; the loss is their sum ÷ the
          global batch's loss tokens);
        - `grad_norm` (the pre-clip global norm), or `gradients` (full, unsharded ones: their float64 norm);
        - `param_norm` (after the update), or none: the observer's `parameter_norm()`;
        - `tensor_grad_norms` and `tensor_param_norms`: each tensor's, in the observer's `tensor_names` order (and
          `clip_coef` where the gradients are the clipped ones; `update_noise`, the baseline's optimizer noise:
          parity/training/update_noise.py), for the series beside the record;
        - `lr`, `step_time_s`, and `extras`: further entries of the record's step, in order (fp16's skipped and
          loss_scale, a mixture of experts' aux_loss and expert_loads);
        - `replica_table`: where the loop gathered the replica digests itself (replica_digests), what it gathered."""
        harness_s = {} if harness_s is None else harness_s
        if loss is None or dp_rank_losses is None:
            if rank_loss_sums is None or rank_tokens is None:
                raise TypeError("observe_step needs loss and dp_rank_losses, or rank_loss_sums and rank_tokens")
            total = tokens if tokens is not None else (batch.loss_tokens if batch is not None else sum(rank_tokens))
            loss = sum(rank_loss_sums) / total if loss is None else loss
            dp_rank_losses = [s / max(c, 1) for s, c in zip(rank_loss_sums, rank_tokens)]
        if grad_norm is None:
            if gradients is None:
                raise TypeError("observe_step needs grad_norm or the gradients")
            grad_norm = local_norm(gradients)
        if param_norm is None:
            if self.parameter_norm is None:
                raise TypeError("observe_step needs param_norm, or the observer a parameter_norm to read it with")
            p0 = time.perf_counter()
            param_norm = self.parameter_norm()
            harness_s["param_norm"] = time.perf_counter() - p0
        if batch is None and (batch_hash is None or tokens is None):
            raise TypeError("observe_step needs the global batch, or its batch_hash and tokens")
        checked = {}
        if replica_table is not None or self.replica_check.due(step + 1, self.total_steps, checkpoint):  # [8]
            c0 = time.perf_counter()
            full = checkpoint or step + 1 == self.total_steps
            checked = {"replicas": self.replica_check.compare(replica_table) if replica_table is not None
                       else self.replica_check.check(full)}
            harness_s["replica_check"] = harness_s.get("replica_check", 0.0) + time.perf_counter() - c0
            self._log_first_parting(checked["replicas"], step)
        r0 = time.perf_counter()
        self.record.append(step=step, loss=loss, dp_rank_losses=dp_rank_losses, grad_norm=grad_norm,
                           param_norm=param_norm, lr=lr, tokens=batch.loss_tokens if tokens is None else tokens,
                           batch_hash=hash_of_batch(batch) if batch_hash is None else batch_hash,
                           step_time_s=step_time_s, peak_memory_bytes=peak_memory_bytes(self.device),
                           harness_s=harness_s, **checked, **extras)
        if self.is_logging_rank and tensor_grad_norms is not None and tensor_param_norms is not None:
            self.tensors.append(step, list(tensor_grad_norms), list(tensor_param_norms), clip_coef, update_noise)
        if checkpoint:  # the checkpoint keeps the record's progress, chunks listed: a resume keeps no step held back
            agree(write_problem(self.tensors.flush if self.is_logging_rank else lambda: None,
                                f"the tensor series beside {self.record.path}"))
        harness_s["record"] = time.perf_counter() - r0
        if self.trackers:
            harness_s["trackers"] = self.trackers.log_step(self.record.steps[-1])
        return self.record.steps[-1]

    def _log_first_parting(self, found: dict, step: int) -> None:
        """The run's first parted replicas, one line on the terminal (the record holds every check)."""
        if found["parted"] and not any(s.get("replicas", {}).get("parted") for s in self.record.steps):
            self.log(f"{parting_line(step, found)}: the verdict will FAIL")

    # --- the record's file and the end ------------------------------------------------------------------
    def write(self) -> float:
        """Rank 0 rewrites the record; every rank learns whether it could (a collective: RunStopped on every rank if
        not). Returns the seconds it took."""
        w0 = time.perf_counter()
        agree(write_problem(self._write if self.is_logging_rank else lambda: None,
                            f"the loss record {self.record.path}"))
        return time.perf_counter() - w0

    def _write(self) -> None:
        """The tensor series' new chunk, then the record that lists it (rank 0)."""
        self.tensors.flush()
        self.record.write()

    def report_model_state(self) -> dict | None:
        """Every rank's model-state counts of the measured step, for the record's final entry (a collective), or
        None without a probe."""
        return self.probe.report(self.measured_step) if self.probe is not None else None

    def finish(self, final: Callable[[], dict], *, before: Callable[[], None] = lambda: None,
               what: str | None = None) -> None:
        """The run's end, on every rank: rank 0 runs `before` (the harness writes its final model there), then
        completes the record with the entry `final()` returns (computed then, so that its times include `before`)
        and writes it; every rank learns whether that worked (a collective: RunStopped on every rank if not, with
        `what` named); then the trackers log what they still hold and end their runs. `before` and `final` run on rank
        0 alone: no collective in them (take report_model_state and the like on every rank first)."""
        def complete() -> None:
            if self.is_logging_rank:
                before()
                self.tensors.flush()
                self.record.finish(**final())

        agree(write_problem(complete, what or f"the loss record {self.record.path}",
                            errors=(Exception,)))  # safetensors raises its own errors
        if self.trackers is not None:
            self.trackers.finish()


class _NoReplicas:
    """What a loop without replicas to declare hands the check: nothing is checked, the record says so."""

    @staticmethod
    def replicas() -> None:
        return None


class ModelStateProbe:
    """What this rank holds during the measured step, sampled at every parameter's gradient arrival in backward
    ("during_backward"), after backward ("after_backward": gradients reduced, before clipping and the step) and
    after the step ("after_step"). Kept: the two named points and two peaks, each with where it was (the first
    of equals): "peak", the sample with the most model-state bytes (what the ZeRO paper bounds), and
    "peak_all", the one with the most bytes in all, the copies made to compute or communicate included.
    Counting time is kept in `seconds` and left out of the step time. `count` says what this rank holds now
    ({"bytes": {category: bytes}, "offloaded_bytes": n}: Strategy.model_state_bytes); `bound` what the report adds
    beside the counts (of_strategy: the ZeRO paper's bound)."""

    def __init__(self, count: Callable[[], dict], bound: Callable[[], dict] = dict):
        self.count, self.bound = count, bound
        self.points, self.peaks, self.samples, self.seconds = {}, {}, 0, 0.0

    @classmethod
    def of_strategy(cls, strategy, num_params: int, dp_size: int) -> "ModelStateProbe":
        """A harness strategy's probe: its own count, and the ZeRO paper's bound for its stage, precision and
        layout (`num_params`: Ψ, the model's parameters each once)."""
        def bound() -> dict:
            s = strategy
            return {"num_params": num_params, "zero_stage": s.zero_stage, "state_precision": s.state_precision,
                    "zero_bound_bytes": zero_bound(s.zero_stage, s.replica_params(num_params), dp_size,
                                                   s.state_precision)}
        return cls(strategy.model_state_bytes, bound)

    def __call__(self, point: str, parameter: str | None = None) -> None:
        t0 = time.perf_counter()
        counted = self.count()
        if point != "during_backward":
            self.points[point] = counted
        sample = {**counted, "point": point, "parameter": parameter}
        for peak, order in PEAK_ORDERS.items():
            if peak not in self.peaks or order(counted["bytes"]) > order(self.peaks[peak]["bytes"]):
                self.peaks[peak] = sample
        self.samples += 1
        self.seconds += time.perf_counter() - t0

    def report(self, step: int) -> dict:
        """Every rank's counts (collective) with the bound, for the record."""
        counting = {"samples": self.samples, "counting_s": self.seconds}
        mine = {**self.points, **{name: {**peak, **counting} for name, peak in self.peaks.items()}}
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        return {"step": step, **self.bound(), "per_rank": {point: [r[point] for r in per_rank] for point in mine}}


# --- where the run is, what it holds: the record's config and its steps' memory ------------------------------

def device_name(device: torch.device) -> str:
    """The accelerator's name (what its peak FLOP/s is looked up by), or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def reset_peak_memory(device: torch.device) -> str:
    """Start the run's peak-memory count here (several runs may share a process, as the benchmark's do);
    returns the metric peak_memory_bytes then is. On CPU the process's peak RSS is reset through Linux's
    /proc/self/clear_refs ("5" resets the high-water mark that getrusage reports); where that cannot be
    written the peak is the process's since it started."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_memory_allocated"
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "process_max_rss_since_run_start"
    return "process_max_rss"


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker_nodes(device: torch.device) -> list[str]:
    """The node of every rank, by rank (a collective: every rank calls it): Ray's node id in a Ray Train
    worker, the host name in a process group without Ray. Gathered as bytes on the run's `device`, which
    every backend (gloo, NCCL) can gather."""
    local = torch.tensor(list(node_name().encode()[:NODE_ID_BYTES].ljust(NODE_ID_BYTES, b"\0")), dtype=torch.uint8,
                         device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode() for t in gathered]
