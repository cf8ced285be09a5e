"""A recorded run's states at its checkpoints, checked on the replay's worker (docs/own_trainer/replay.md#checkpoints-the-
teacher-forced-check, docs/teacher_forced.md): the recorder of a user's loop saves the run's full state — every
parameter, AdamW's moments and step count, the buffers, as full fp32 tensors under Hugging Face names — before and
after step 0 and every `checkpoint_interval`-th step (parity/recording/states.py); the replay of the record takes
the harness's reference step from each state before (teacher_forced.references: the run's precision policy, and in a
low-precision one its fp32 twin for the rounding) on that step's recorded batch at the lr the framework declares for
it (else the one it applied), and measures the recorded state after against it (teacher_forced.measured): what the
harness's own strategies get at their checkpoints, judged by the same verdict (parity/comparing/teacher_forced.py).

Why: a recorded run's curves are judged against a replay from step 0, which in bf16 drifts from the run, so the band
that bounds them widens and a bug that starts late in the user's framework hides in it; a step taken from the run's own
state differs from the run's step by that step alone.

Here, on the lowest floor every side reads: the files' names (the recorder's folder holds the index `states.json` and
`states/updates_<N>.safetensors`, the state after N updates — before step N, after step N − 1 — each named relative to
the record's folder, as the batches are: a moved or copied folder finds them), their encoding, and the worker's side
(`check_recorded`, after the replay's training, on rank 0). The checks go to `teacher_forced_<name>.json` beside the
record, which the comparison attaches to the recorded run (parity/comparing/recorded_checks.py): apart from
`loss_<name>.json`, whose schema they leave as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parity import storage
from parity.training.optimizer import ADAMW_MOMENTS
from parity.training.teacher_forced import SKIPPED, measured, references
from parity.training.view import FullState

INDEX = "states.json"  # in the recorder's folder (recorded_<name>/): what was saved, and each file's name
KINDS = ("param", *ADAMW_MOMENTS, "buffer")  # the prefixes of a state file's tensors: "<kind>/<Hugging Face name>"


def state_file(updates: int) -> str:
    """The file of the state after `updates` updates, relative to the recorder's folder."""
    return f"states/updates_{updates:06d}.safetensors"


def weights_file(updates: int) -> str:
    """The file of a sampler's weights after `updates` updates (the parameters alone), relative to the recorder's
    folder (parity/recording/states.py)."""
    return f"states/weights_{updates:06d}.safetensors"


def checks_path(record_file: str, name: str) -> str:
    """Where the replay writes the checks of run `name`'s saved states: beside its record."""
    return storage.join(storage.parent(storage.absolute(record_file)), f"teacher_forced_{name}.json")


def encode(state: FullState) -> dict[str, torch.Tensor]:
    """A state's tensors under "<kind>/<name>" (KINDS; its step count goes in the index)."""
    out = {f"param/{n}": t for n, t in state.params.items()}
    for name, moments in (state.moments or {}).items():
        out.update({f"{key}/{name}": moments[key] for key in ADAMW_MOMENTS})
    out.update({f"buffer/{n}": t for n, t in state.buffers.items()})
    return out


def read_state(location: str, count: int) -> FullState:
    """The state a file holds (encode's), AdamW's step count `count` (from the index)."""
    from safetensors.torch import load

    by_kind: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}
    for key, t in load(storage.read_bytes(location)).items():
        kind, name = key.split("/", 1)
        by_kind[kind][name] = t
    moments = {}
    for key in ADAMW_MOMENTS:
        for name, t in by_kind[key].items():
            moments.setdefault(name, {})[key] = t
    return FullState(by_kind["param"], moments, count, by_kind["buffer"])


@dataclass(frozen=True)
class StateCheck:
    """One checked step of a recorded run: the files of its states before and after (their locations now), AdamW's
    step count in each, and what the record says of the step: its pre-clip norm, its lr (declared, else applied) and
    its batch's hash (which the comparison holds the record's to: the checks of another recording are not its)."""

    step: int
    before: str
    after: str
    counts: tuple[int, int]
    grad_norm: float
    lr: float
    batch_hash: str
    grad_norm_source: str | None = None  # "framework": the norm the framework took in its own fp32 arithmetic
    loss_scale: float | None = None  # fp16: the scale the step's gradients were computed with ...
    skipped: bool = False  # ... and whether its loss scaler skipped it, which the reference step follows


@dataclass(frozen=True)
class RecordedStates:
    """What the replay of `record` (run `name`) checks (replay.py plans it on the driver): its checks, the recorder's
    interval, and why no step is checked where none is (`none`, one line)."""

    record: str
    name: str
    interval: int | None
    checks: tuple[StateCheck, ...]
    none: str | None = None


def check_recorded(worker, batches) -> None:
    """After the replay's training (every rank, loop.train_group_worker): where `batches` (the replay's RecordedBatches)
    carries the record's states, rank 0 takes each check's reference step on the worker's device and writes every
    check's entry — the shape of a harness run's record entry (teacher_forced.KEY), with the step's batch hash — into
    checks_path; the other ranks wait for it. Nothing for a run that is not a replay, nor for a noise reference."""
    states = getattr(batches, "states", None)
    if states is None:
        return
    if worker.ctx.is_logging_rank:
        entries = [_check(worker, batches, check) for check in states.checks]
        path = checks_path(states.record, states.name)
        storage.write_json_atomic(path, {"name": states.name, "interval": states.interval, "none": states.none,
                                         "checks": entries})
        worker.log(f"the teacher-forced check of {states.name}'s saved states: "
                   + (f"steps {', '.join(str(e['step']) for e in entries)}" if entries else f"none ({states.none})")
                   + f": {path}")
    dist.barrier()


def _check(worker, batches, check: StateCheck) -> dict:
    """One check's entry: the reference step from the state before (and its fp32 twin) on the step's batch as the run
    fed it (its mask too: data.RecordedBatches.as_fed), measured against the state after."""
    t0 = time.perf_counter()
    cfg, device = worker.cfg, worker.ctx.device
    before, after = read_state(check.before, check.counts[0]), read_state(check.after, check.counts[1])
    fp16 = {} if check.loss_scale is None else {"loss_scale": check.loss_scale, "skipped": check.skipped}
    refs = references(cfg, worker.model_config, before, batches.as_fed(check.step).to(device), check.lr, device,
                      micro_rows=getattr(batches, "most_rows", None), **fp16)  # a split the objective depends on
    # (teacher_forced.own_split: the record's largest micro-batch; a rollout file's batches carry none)
    skipped = (check.skipped, refs[0] is None)  # fp16: the record's skip, the reference's (teacher_forced.SKIPPED)
    entry = {"note": SKIPPED[skipped]} if any(skipped) else measured(after, check.grad_norm, refs, before, check.lr)
    return {"step": check.step, "precision": cfg.precision, "seconds": time.perf_counter() - t0, "note": None,
            **entry, "batch_hash": check.batch_hash, "grad_norm_source": check.grad_norm_source}


__all__ = ["INDEX", "RecordedStates", "StateCheck", "check_recorded", "checks_path", "encode", "read_state",
           "state_file", "weights_file"]
