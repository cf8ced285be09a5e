"""What a recorded run resumed from its framework's checkpoint continues (docs/own_trainer/techniques.md#resume): the first run's
record, checked and cut at the resumed step (`kept`), and the lr schedule as the loop declares it (`DeclaredSchedule`,
which Trainer's callback uses for its own settings' schedule too). Split from recorder.py, which calls them at its
start."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch

from parity import storage
from parity.errors import RecordError
from parity.training.data import recorded_batch_path
from parity.training.record import is_recorded, load_record

# What a resumed run must share with the record it continues: the replay takes them from the record once, for every step
CONTINUED = ("hugging_face_model", "model_type", "model_config", "lora", "optimizer", "max_grad_norm", "precision",
             "objective")


class ResumeRefused(Exception):
    """A record that a resumed run (ParityRecorder's start_step) cannot continue: one line, nothing recorded."""


class DeclaredSchedule:
    """An lr schedule as it is declared, on a scratch optimizer that never trains: `lr()` is the lr of the next update,
    then the schedule moves one update on. It moves once per recorded update whatever the loop does, so a scheduler the
    loop steps twice per update, or restarts at a resume, applies another lr than this one, and the verdict FAILs the
    first step whose lr is not the declared one (parity.comparing.run.Run.lr_off_schedule). A step an fp16 loss scaler
    skipped declares none: loops differ there, each correct — torch's AMP recipe steps its scheduler at every iteration,
    Trainer not at a skipped one —, so the next update's is the schedule moved on by the skipped steps or not, whichever
    the lr applied is."""

    def __init__(self, scheduler):
        self.scheduler, self.optimizer = scheduler, scheduler.optimizer
        self.skipped = 0  # the steps skipped since the last update

    @classmethod
    def copy_of(cls, scheduler, step: int, line: Callable[[str], Any]) -> "DeclaredSchedule | None":
        """The loop's own scheduler, copied at the recorder's start (`step`: the updates done before it) onto a scratch
        optimizer that holds the scheduler's last lrs. Copied from the scheduler's own state — its last_epoch and last
        lrs, as the loop restored them from its checkpoint at a resume — so that a restored schedule goes on where it
        was, and one that restarted (fewer epochs than `step`: said in one line) is moved on to `step` here: the lr the
        restarted one applies is then not the declared one. None, in one line, where no step count drives the schedule
        (ReduceLROnPlateau) or it is already ahead of the updates."""
        epoch = getattr(scheduler, "last_epoch", None)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or not isinstance(epoch, int):
            line(f"{type(scheduler).__name__} is not driven by a step count: no declared lr recorded")
            return None
        if epoch > step:
            line(f"the scheduler has stepped {epoch} times before update {step}: it runs ahead of the updates; no "
                 f"declared lr recorded")
            return None
        if epoch < step:
            line(f"the scheduler has stepped {epoch} times, the run {step} updates: its schedule restarted at this "
                 f"resume (restore its state_dict); the declared lr goes on from update {step}")
        user = scheduler.optimizer
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [torch.zeros(1)], "lr": lr}
                  for group, lr in zip(user.param_groups, scheduler.get_last_lr())]
        declared = cls(copy.deepcopy(scheduler, {id(user): torch.optim.Optimizer(groups, {})}))
        declared.advance(step - epoch)
        return declared

    def lr(self, applied: float | None = None, skipped: bool = False) -> float | None:
        """The declared lr of this step, which applied `applied` (None: not known) or was `skipped` (then None)."""
        if skipped:
            self.skipped += 1
            return None
        if self.skipped:
            ahead = copy.deepcopy(self)
            ahead.advance(self.skipped)
            moved = float(ahead.optimizer.param_groups[0]["lr"])
            if applied is not None and abs(moved - applied) <= 1e-12 * max(abs(moved), abs(applied)):  # the verdict's
                self.scheduler, self.optimizer = ahead.scheduler, ahead.optimizer
            self.skipped = 0
        value = float(self.optimizer.param_groups[0]["lr"])
        self.advance(1)
        return value

    def advance(self, updates: int) -> None:
        """The schedule `updates` updates on. Its optimizer never steps: torch's warning that it should have is moot."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(updates):
                self.scheduler.step()


def kept(path: str, folder: str, now: dict, k: int) -> tuple[dict, list[dict], int, list[str]]:
    """(the continued config, steps 0…k−1, the bytes of their saved batches, its tensor series' chunks) of the
    record at `path` (its recorded folder `folder`), which a run described by `now` (its record's config) resumed after
    k updates continues — or ResumeRefused naming why it cannot be continued at step k."""
    name = storage.name(path)
    refused = f"cannot continue {name} at step {k}"
    if not storage.exists(path):
        raise ResumeRefused(f"{refused}: there is none in {storage.parent(path)} (the first run was not recorded "
                            f"there)")
    try:
        data = load_record(path)
    except RecordError as exc:
        raise ResumeRefused(f"{refused}: {exc}") from None
    config, steps = data["config"], data["steps"]
    if not is_recorded(config):
        raise ResumeRefused(f"{refused}: it is not a record of parity's recorder")
    if len(steps) < k:
        stopped = config.get("stopped")
        raise ResumeRefused(f"{refused}: it holds {len(steps)} step{'s' if len(steps) != 1 else ''}"
                            + (f" (it stopped at step {stopped['step']}: {stopped['why']})" if stopped else ""))
    now = storage.json_safe(now)  # as the record reads back: tuples are lists
    for key in CONTINUED:
        differs = _first_difference(config.get(key), now.get(key), key)
        if differs:
            raise ResumeRefused(f"{refused}: this run's {differs}: it continues another run")
    # (a post-training objective's rows are in its rollout file, which RecordedObjective.restore reads)
    sizes = [] if config.get("objective") else [storage.size(recorded_batch_path(storage.join(folder, "batches"), i))
                                                for i in range(k)]
    if config["batches"]["saved_steps"] < k or None in sizes:
        missing = min(config["batches"]["saved_steps"], sizes.index(None) if None in sizes else k)
        raise ResumeRefused(f"{refused}: its batch of step {missing} is missing from "
                            f"{storage.join(folder, 'batches')}")
    return _continued(config, steps[:k]), steps[:k], sum(sizes), data.get("tensors", {}).get("chunks", [])


def _continued(config: dict, steps: list[dict]) -> dict:
    """The first run's config, continued after its `steps` (0…k−1): k appended to resumed_at, no stop and no end yet,
    the batches counted up to k and their shape that of the steps kept (the first run may have gone past its
    checkpoint)."""
    k = len(steps)
    batches = {**config["batches"], "saved_steps": k,
               "most_rows": max(n for s in steps for rank in s["micro_batches"] for n in rank)}
    if batches.get("position_ids_from") is not None and batches["position_ids_from"] >= k:
        batches["position_ids_from"] = None
    return {**config, "batches": batches, "resumed_at": [*config.get("resumed_at", []), k], "stopped": None,
            "total_steps": None}


def _first_difference(recorded, now, where: str) -> str | None:
    """'where is X, the record's Y' at the first place two descriptions differ (objects and lists walked), or None."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        keys = [*recorded, *(key for key in now if key not in recorded)]
        found = (_first_difference(recorded.get(key), now.get(key), f"{where}.{key}") for key in keys)
    elif isinstance(recorded, list) and isinstance(now, list) and len(recorded) == len(now):
        found = (_first_difference(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(recorded, now)))
    else:
        return None if recorded == now else f"{where} is {_short(now)}, the record's {_short(recorded)}"
    return next((d for d in found if d), None)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
