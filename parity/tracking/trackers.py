"""Which experiment trackers a run reports to (--report_to), decided in this one place: the driver's check before any
worker starts, rank 0's trackers of a run, the comparison's summary added to the tracker runs its records name, and
the trackers' environment the workers get.

A tracker never fails or stops the training: one that raises is dropped for the rest of the run with one warning
line, and the loss record, which has every step, stays the source of truth.
"""

from __future__ import annotations

import importlib
import os
import queue
import tempfile
import threading
import time

from parity import storage
from parity.errors import ConfigError
from parity.tracking.tracker import Step, TrackedRun, numeric_fields

# --report_to's words → (module, class); each module imports its library, and the extra of that name installs it.
TRACKERS = {"wandb": ("parity.tracking.wandb_tracker", "WandbTracker"),
            "mlflow": ("parity.tracking.mlflow_tracker", "MLflowTracker"),
            "tensorboard": ("parity.tracking.tensorboard_tracker", "TensorBoardTracker")}
NONE = "none"
ENVIRONMENT = ("WANDB_", "MLFLOW_")  # the trackers' own variables, as their libraries read them
FINISH_WAIT_S = 120  # the longest a finished run waits for its trackers to log what is queued
CATCH_UP_WAIT_S = 10  # the longest a step before a checkpoint waits for them (a slow tracker: then it goes on)


def parse(report_to) -> tuple[str, ...]:
    """--report_to's words, in order, once each: the flag's list, or one string ("wandb mlflow" or "wandb,mlflow":
    the main job's REPORT_TO); "none" or nothing is none. ConfigError for another word."""
    words = report_to.replace(",", " ").split() if isinstance(report_to, str) else list(report_to or ())
    words = [w for w in dict.fromkeys(words) if w != NONE]
    unknown = [w for w in words if w not in TRACKERS]
    if unknown:
        raise ConfigError(f"--report_to {unknown[0]}: use {', '.join(TRACKERS)} (one or several) or {NONE}")
    return tuple(words)


def tracker_class(name: str):
    module, cls = TRACKERS[name]
    return getattr(importlib.import_module(module), cls)


def check(report_to, loss_output_dir: str, spread: bool) -> tuple[str, ...]:
    """On the driver, before any worker starts: the trackers named, each importable and set up so that it can work;
    else ConfigError with one line (a missing library: the extra that installs it)."""
    names = parse(report_to)
    for name in names:
        try:
            tracker_class(name).check(loss_output_dir, spread)
        except ConfigError:
            raise
        except Exception as exc:  # ImportError, or a broken install failing its own way while imported
            raise ConfigError(f"--report_to {name}: its library cannot be imported ({storage.reason(exc)}): "
                              f"pip install -e '.[{name}]'") from None
    return names


def worker_environment(cfgs) -> dict[str, str]:
    """The trackers' variables (WANDB_*, MLFLOW_*) as the driver has them, for Ray's workers, which may not inherit
    its environment (rank 0 on another node; a Ray cluster started before they were set); none without trackers."""
    if not any(cfg.report_to for cfg in cfgs):
        return {}
    return {k: v for k, v in os.environ.items() if k.startswith(ENVIRONMENT)}


class RunTrackers:
    """Rank 0's trackers of one run (false when there are none). Training only hands each step's numbers over: the
    trackers log them in a thread of their own, several steps at once when they fall behind, so that a slow
    database, server or disk never slows a step. Only the step before a checkpoint waits for them to catch up and
    flush (CATCH_UP_WAIT_S at most): a resumed run then finds in its tracker runs every step its checkpoint has.
    Every call to a tracker is contained: one that raises is dropped with one warning line."""

    def __init__(self, log=None, record_path: str = "", checkpoint_interval: int = 0):
        self.trackers: list = []
        self.log, self.record_path, self.checkpoint_interval = log, record_path, checkpoint_interval
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def add(self, tracker, begin) -> None:
        self.trackers.append(tracker)
        self._contained(tracker, "starting", begin)

    def log_step(self, entry: dict) -> float:
        """Every number of a step's record entry, handed to the trackers' thread; returns the seconds it took."""
        t0 = time.perf_counter()
        if self.thread is None:
            self.thread = threading.Thread(target=self._log_queued, name="parity-trackers", daemon=True)
            self.thread.start()
        self.queue.put(Step(entry["step"], time.time(), numeric_fields(entry)))
        if self.checkpoint_interval and (entry["step"] + 1) % self.checkpoint_interval == 0:
            caught_up = threading.Event()
            self.queue.put(caught_up)
            caught_up.wait(CATCH_UP_WAIT_S)
        return time.perf_counter() - t0

    def finish(self, failed: bool = False) -> None:
        """Log what is queued, then end every tracker run (as failed: the run stopped); nothing is left open after
        it. A tracker still busy after FINISH_WAIT_S is left behind, with a line saying so."""
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(FINISH_WAIT_S)
            if self.thread.is_alive():
                self.log(f"warning: {', '.join(t.name for t in self.trackers)} still busy after {FINISH_WAIT_S} s: "
                         f"not waited for; the loss record {self.record_path} has every step")
                self.trackers = []
        for tracker in list(self.trackers):
            self._contained(tracker, "finishing", lambda: tracker.finish(failed))
        self.trackers, self.thread = [], None

    def close(self) -> None:
        """After the run, whatever happened: tracker runs still open (the run stopped before it finished) end as
        failed."""
        if self.trackers:
            self.finish(failed=True)

    def _log_queued(self) -> None:
        """The trackers' thread: the steps queued, as many at once as there are; at a catch-up mark, a flush."""
        while True:
            items = [self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get())
            steps = [s for s in items if isinstance(s, Step)]
            for tracker in list(self.trackers):
                if steps:
                    self._contained(tracker, f"logging step {steps[0].step}", lambda: tracker.log(steps))
                if any(isinstance(i, threading.Event) for i in items) and tracker in self.trackers:
                    self._contained(tracker, "flushing", tracker.flush)
            for mark in items:
                if isinstance(mark, threading.Event):
                    mark.set()
            if None in items:
                return

    def _contained(self, tracker, what: str, call) -> None:
        try:
            call()
        except Exception as exc:
            if tracker in self.trackers:
                self.trackers.remove(tracker)
            self.log(f"warning: {tracker.name} failed while {what} ({type(exc).__name__}: {storage.reason(exc)}): it "
                     f"records nothing more of this run; the loss record {self.record_path} has every step")


def open_trackers(cfg, ctx, record, start: int, log, checkpointing: bool) -> RunTrackers:
    """The run's trackers on rank 0 (none elsewhere, or without --report_to): each continues the tracker run the
    record names (it came back with a checkpoint) at `start`, or starts a new one, given the steps the record
    already holds; the record keeps what names each run, from its next write on (and so its checkpoints)."""
    trackers = RunTrackers(log, record.path, cfg.checkpoint_interval if checkpointing else 0)
    if not cfg.report_to or not ctx.is_logging_rank:
        return trackers
    run = TrackedRun.of(record.data)
    states = record.data.setdefault("trackers", {})
    for name in cfg.report_to:
        try:
            tracker = tracker_class(name)(run)
        except Exception as exc:  # its library is missing here, on rank 0's node
            log(f"warning: {name} cannot be imported here ({storage.reason(exc)}): this run is not tracked there; "
                f"pip install -e '.[{name}]' on every node")
            continue
        trackers.add(tracker, lambda tracker=tracker: _begin(tracker, states, record, start, log))
    return trackers


def _begin(tracker, states: dict, record, start: int, log) -> None:
    if tracker.name in states:
        tracker.resume(states[tracker.name], start)
    else:
        tracker.start()
        if start:  # the steps of a checkpoint, in a new tracker run (--resume with another --report_to)
            tracker.log([Step(e["step"], time.time(), numeric_fields(e)) for e in record.steps[:start]])
    states[tracker.name] = tracker.state
    log(tracker.where())


def report_comparison(comparison, files: list[str], figure_png) -> list[str]:
    """The comparison's summary (verdicts, deviation ÷ noise, first step outside) and its files (the figure, the
    reports) added to the tracker runs that every compared run's record names; returns the lines to print (which
    tracker runs got it; a warning per one that could not). `figure_png()` gives the figure as PNG bytes, asked once
    at most (parity.comparing.figures.curve_png: the comparison draws it, the trackers only carry it)."""
    runs = [r for r in [*comparison.runs, *comparison.references] if r.record.get("trackers")]
    if not runs:
        return []
    verdicts = comparison.to_dict()
    added: dict[str, int] = {}
    lines = []
    with tempfile.TemporaryDirectory(prefix="parity_comparison_") as scratch:
        local_files = [_local_copy(path, scratch) for path in files]
        pages = [path for path in files if storage.name(path) == "report.html"]
        for run in runs:
            # the page's location too: W&B and MLflow keep the page among the files, TensorBoard (no files) its path
            summary = {**run_summary(comparison, verdicts, run), **({"comparison/page": pages[0]} if pages else {})}
            for name, state in run.record["trackers"].items():
                try:
                    tracker_class(name).add_comparison(state, TrackedRun.of(run.record), summary, local_files, figure_png)
                except Exception as exc:
                    lines.append(f"warning: the comparison could not be added to {run.label}'s {name} run "
                                 f"({type(exc).__name__}: {storage.reason(exc)}); it is in {', '.join(files)}")
                else:
                    added[name] = added.get(name, 0) + 1
    if added:
        lines.insert(0, "trackers: the verdict, the figure and the reports added to "
                     + ", ".join(f"{n} {name} run{'s' if n > 1 else ''}" for name, n in added.items()))
    return lines


def run_summary(comparison, verdicts: dict, run) -> dict:
    """What the comparison says of `run`, flat ("comparison/noise_ratio/loss"): the verdict of the whole comparison,
    the run's role, and for a compared run its own verdict, its deviation ÷ noise (calibrated) or largest relative
    difference, and the first step outside its bounds."""
    role = ("baseline" if run is comparison.baseline else
            "noise reference" if any(run is r for r in comparison.references) else "compared")
    summary = {"verdict": verdicts["verdict"], "baseline": verdicts["baseline"], "num_steps": verdicts["num_steps"],
               "role": role}
    against = verdicts["against_baseline"].get(run.name) if role == "compared" else None
    if against:
        summary.update({"run_verdict": against["verdict"], "calibrated": against["calibrated"],
                        "tolerance_source": against["tolerance_source"]})
        for group in ("noise_ratio", "max_rel_diff", "first_outside"):
            summary.update({f"{group}/{k}": v for k, v in (against[group] or {}).items()})
    return {f"comparison/{k}": v for k, v in summary.items() if v is not None}


def _local_copy(location: str, scratch: str) -> str:
    """A file a tracker's library can open: the file itself when local, else a copy in `scratch`."""
    local = storage.local_path(location)
    if local is not None:
        return local
    path = os.path.join(scratch, storage.name(location))
    with open(path, "wb") as f:
        f.write(storage.read_bytes(location))
    return path
