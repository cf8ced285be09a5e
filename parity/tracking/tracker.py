"""The one interface every experiment tracker implements, and what they all record of a run.

A tracker writes through its own library's public API (parity/tracking/<library>_tracker.py); nothing here
imports a tracker's library. What a tracker records of a run comes from the run's loss record, which stays
the source of truth: its config (the parameters that a resume keeps as parameters, those it may change and the
fingerprint as tags), every numeric field of every step, and later the comparison's verdict and files.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import NamedTuple

from parity import storage
from parity.run_config import NOT_IDENTITY

# Record config fields that a resumed run may change (a checkpoint's identity leaves them out; the record's
# model_config is the model's summary, which a resume keeps), and those the loop fills per attempt: MLflow's
# parameters cannot change once logged, so these are tags.
CHANGING = tuple(sorted({*NOT_IDENTITY, "worker_nodes", "report_to"} - {"model_config"}))
WANDB_GROUP_CHARS = 128  # W&B's limit on a group's name


class Step(NamedTuple):
    """One step as the trackers log it: its number, when it was recorded, and its record entry's numbers."""

    step: int
    time: float  # seconds since the epoch
    metrics: dict[str, float]


@dataclass(frozen=True)
class TrackedRun:
    """One training run as every tracker names and describes it, made from its loss record."""

    name: str  # the run's experiment_name: the tracker run's name
    group: str  # the folder of records compared together: W&B's group, MLflow's experiment, TensorBoard's root
    config: dict  # the record's config as it is (nested): W&B's config
    params: dict[str, str]  # flattened config fields a resume keeps
    tags: dict[str, str]  # flattened fields a resume may change (CHANGING), and the fingerprint
    loss_output_dir: str
    log_interval: int

    @classmethod
    def of(cls, record: dict) -> "TrackedRun":
        config = record["config"]
        flat = flatten(config)
        changing = {k: v for k, v in flat.items() if k.split(".")[0] in (*CHANGING, "fingerprint")}
        return cls(name=config["experiment_name"], group=default_group(config["loss_output_dir"]), config=config,
                   params={k: v for k, v in flat.items() if k not in changing}, tags=changing,
                   loss_output_dir=config["loss_output_dir"], log_interval=config["log_interval"])


class Tracker:
    """One tracker's run. The loop's rank 0 starts it (a new tracker run) or resumes it (the tracker run `state`
    names, which the loss record and its checkpoints keep), logs the steps (in a thread of their own: one call at a
    time) and finishes it; the comparison, on the driver, adds its summary and files to a finished one. Errors are
    the caller's to contain (RunTrackers): a tracker raises as its library does."""

    name = ""  # the word --report_to takes
    extra = ""  # the pyproject.toml extra that installs its library

    @classmethod
    def check(cls, loss_output_dir: str, spread: bool) -> None:
        """On the driver before any worker starts: ConfigError for a setting with which it cannot work; ImportError
        for a library it needs that is missing (`spread`: rank 0 may run on another node than the driver)."""

    def __init__(self, run: TrackedRun):
        self.run = run
        self.state: dict = {}  # what names the tracker run: kept in the record (and so in its checkpoints)

    def start(self) -> None:
        """A new tracker run: its parameters, tags and config."""
        raise NotImplementedError

    def resume(self, state: dict, step: int) -> None:
        """Continue the tracker run `state` names at `step` (a checkpoint's): the steps from `step` on, which a
        restarted worker group trains again, must appear once each."""
        raise NotImplementedError

    def log(self, steps: list[Step]) -> None:
        """Steps in order: one, or several at once (a tracker that fell behind, a checkpoint's)."""
        raise NotImplementedError

    def flush(self) -> None:
        """What is logged so far made durable (the step before a checkpoint), where the library buffers it."""

    def where(self) -> str:
        """Where the run is, in words, for the run's log line."""
        raise NotImplementedError

    def finish(self, failed: bool = False) -> None:
        raise NotImplementedError

    @classmethod
    def add_comparison(cls, state: dict, run: TrackedRun, summary: dict, files: list[str], figure_png) -> None:
        """The comparison's summary (flat: name → number or string), its files (local paths: the figure and the
        reports) and the figure as PNG bytes (`figure_png()` renders them) added to the finished run `state`
        names."""
        raise NotImplementedError


def flatten(data, prefix: str = "", sep: str = ".") -> dict[str, str]:
    """Nested config → {"options.zero_stage": "1", "worker_nodes": "[...]"}: scalars as text, lists as JSON."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}{sep}", sep))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return out


def numeric_fields(entry, prefix: str = "") -> dict[str, float]:
    """Every number of a record's step entry by its path ("loss", "dp_rank_losses/1", "harness_s/record"), whatever
    fields the record holds (an MoE's aux loss and expert loads too); the step itself and text are left out."""
    items = entry.items() if isinstance(entry, dict) else enumerate(entry)
    out = {}
    for key, value in items:
        name = f"{prefix}{key}"
        if name == "step" or isinstance(value, (bool, str)) or value is None:
            continue
        if isinstance(value, (int, float)):
            out[name] = float(value)
        elif name == "teacher_forced" and isinstance(value, dict):  # hundreds of tensors: their largest difference
            tensors = [v for v in (value.get("tensors") or {}).values() if isinstance(v, (int, float))]
            if tensors:
                out[f"{name}/max_rel_diff"] = float(max(tensors))
        elif isinstance(value, (dict, list, tuple)):
            out.update(numeric_fields(value, f"{name}/"))
    return out


def default_group(loss_output_dir: str) -> str:
    """The runs a comparison compares are the records of one folder (a main job's runs, the seed's three commands):
    that folder, without a URI's query, names their group (W&B keeps the last 128 characters)."""
    return loss_output_dir.split("?", 1)[0].rstrip("/")


def local_place(location: str) -> tuple[str, str | None]:
    """(a local directory to write in, the location to upload it to afterwards or None): a local location is its
    own directory; for a URI the tracker writes in a scratch directory on this node and `upload` copies it there."""
    local = storage.local_path(location)
    if local is not None:
        os.makedirs(local, exist_ok=True)
        return local, None
    return tempfile.mkdtemp(prefix="parity_tracker_"), location


def upload(local: str, remote: str | None) -> None:
    """Every file under `local` (links left out) written, whole, at the same relative path under `remote`."""
    if remote is None:
        return
    for root, _, files in os.walk(local):
        for name in sorted(files):
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            with open(path, "rb") as f:
                storage.write_bytes_atomic(storage.join(remote, *os.path.relpath(path, local).split(os.sep)), f.read())
