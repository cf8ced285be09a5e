"""The recorder's states: a user's run at its checkpoints, saved for the teacher-forced check its replay takes from
them (parity/training/recorded_states.py, docs/own_trainer/replay.md#checkpoints-the-teacher-forced-check).

What: the run's full state before and after step 0 and every `checkpoint_interval`-th step (the harness's flag's name
and default; 0: step 0 alone; None: none) — every parameter (the master weights, what the optimizer steps) under its
Hugging Face name (a tied weight once), AdamW's exp_avg and exp_avg_sq and its step count, the persistent buffers — as
full fp32 tensors, read with the view's own code (parity/views/: full_state_dict, full_optimizer_state: the harness's
gathers). Under data parallelism every rank holds them whole and rank 0 reads its own; a sharded view gathers them on
every rank (collective) and rank 0 writes.

When: the state before step k is the state after k updates, taken at the end of step k − 1's after_step (or at the
recorder's start, for its first step): nothing the loop does moves the weights or the optimizer's state between a
step's after_step and the next optimizer step, while later in a step it may already have moved — DeepSpeed steps
inside engine.step(), before the boundary's micro_batch call. The state after N updates is after step N − 1 and before
step N alike: one file (interval 1 saves each state once).

Where: `recorded_<name>/states/updates_<N>.safetensors`, written atomically on a thread of rank 0's (the batches'
writer: rows.BatchWriter), and the index `recorded_<name>/states.json` (at the recorder's save() and close()), each
file named relative to the record's folder.

A sampler's weights: where a framework's room says at which update counts an in-process sampler syncs to the weights
and samples with them (`sampled_at`: TRL's GRPOTrainer with vLLM), the parameters alone (fp32, 4 bytes a parameter a
sync) after those updates, `states/weights_<N>.safetensors` (index: `sampler_weights`), for the sampler verdict of
every step's rows (parity/rollout_check/recorded.py) — none where a state of the check holds them, counted against
the same `max_state_bytes`. Up to `max_state_bytes` on disk: a check is saved whole (its two states)
or not; past the cap no more, said in one line, and the checks before it are kept. A state that cannot be read or
written ends the states in one line; the recording and the user's training go on.
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from parity import storage
from parity.attaching import attach
from parity.recording.rows import BatchWriter
from parity.training.optimizer import ADAMW_MOMENTS
from parity.training.recorded_states import INDEX, encode, state_file, weights_file
from parity.training.view import FullState

DEFAULT_CHECKPOINT_INTERVAL = 50  # the harness's --checkpoint_interval default (parity/driver/config.py)
DEFAULT_MAX_STATE_BYTES = 32 << 30  # 32 GiB: 24 bytes a parameter a check (fp32 weights and two moments, twice)


def checked(step: int, interval: int | None) -> bool:
    """Whether the recorder saves the states around `step`: step 0 and every `interval`-th (0: step 0 alone; None:
    none), as the harness checks its own runs (teacher_forced.check_steps)."""
    return interval is not None and (step == 0 or (interval > 0 and step > 0 and step % interval == 0))


def refusal(interval, max_bytes) -> str | None:
    """Why these settings cannot be recorded, in one line (None: they can)."""
    if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool) or interval < 0):
        return (f"checkpoint_interval {interval!r} is not a step count (0: the state around step 0 alone; None: no "
                f"state saved)")
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
        return f"max_state_bytes {max_bytes!r} is not a number of bytes"
    return None


def gathered(view, names) -> FullState:
    """The state now, as full fp32 CPU tensors of their own under Hugging Face names `names` (the writer's thread
    writes them while the loop trains on). Collective in a sharded view."""
    full = full_state_dict(view)
    exported = view.full_optimizer_state()
    if exported is None:
        raise ValueError("the optimizer holds its moments in pieces the recorder cannot name")
    moments = {name: {key: own(t) for key, t in states.items()} for name, states in exported[0].items()}
    buffers = {name: own(full[name]) for name in view.buffer_names() if name in full}
    return FullState({name: own(full[name]) for name in names}, moments, exported[1], buffers)


def full_state_dict(view) -> dict[str, torch.Tensor]:
    """The view's full state dict: its gathered one, or the module's own where that is full (the view returns None).
    Collective in a sharded view."""
    full = view.full_state_dict()
    return full if full is not None else view.model.state_dict()


def own(t: torch.Tensor) -> torch.Tensor:
    """`t` as fp32 on the CPU in a tensor of its own: a view's full tensor may be the loop's, which its next update
    changes in place before the writer's thread has written it — megatron-core's fp32 masters and AdamW moments of a
    tensor no TP rank splits, on the CPU (its clean fp16 job's state after step 0 once saved with step 3's moments:
    a teacher-forced FAIL at 114 × its bound). One converted or moved to the CPU is that copy; one already fp32 on
    the CPU is copied, whether gathered or the loop's own (which cannot be told apart)."""
    out = t.detach().float().cpu()
    return out.clone() if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else out


class StateSaver:
    """One recorder's states (module docstring), on every rank of its group. `take(updates)` after each update (and at
    the start) saves the state where a check needs it; `save()` and `close()` write the index (rank 0); `seconds` is
    the time every take took on this rank."""

    def __init__(self, recorder, interval: int | None, max_bytes: int, start: int):
        interval = attach.checkpoint_interval(interval)  # verify_trainer.py's, where it runs the loop
        self.rec, self.interval, self.max_bytes, self.start = recorder, interval, max_bytes, start
        self.seconds, self.enabled = 0.0, interval is not None
        self.index = {"interval": interval, "max_bytes": max_bytes, "saved_bytes": 0, "states": {}, "checks": [],
                      "stopped": None, "sampler_weights": {}}
        self.sampled_at = None  # a room's rule: the update counts whose weights its sampler samples with
        self.open: set[int] = set()  # rank 0: the checks whose state before is saved and whose state after is due
        self.committed = 0  # rank 0: the bytes on disk and those an open check's state after will take
        self.writer = BatchWriter() if self.enabled and recorder.rank == 0 else None
        if start and self.writer is not None:
            self._continue(start)
        self.take(start)

    @property
    def path(self) -> str:
        return storage.join(self.rec.folder, INDEX)

    def _continue(self, start: int) -> None:
        """Rank 0, a run resumed after `start` updates: the first run's index, its states up to `start` and its checks
        whose two states are among them kept (their bytes counted against the cap), its stop where it came before;
        the states it saved past `start` (a run that went on past its checkpoint) deleted: this run saves its own."""
        if not storage.exists(self.path):
            return
        first = json.loads(storage.read_text(self.path))
        states = {u: s for u, s in first["states"].items() if int(u) <= start}
        for u in set(first["states"]) - set(states):
            storage.delete_file(storage.join(self.rec.folder, state_file(int(u))))
        stopped = first["stopped"] if first["stopped"] and first["stopped"]["step"] <= start else None
        weights = {u: s for u, s in first.get("sampler_weights", {}).items() if int(u) <= start}
        for u in set(first.get("sampler_weights", {})) - set(weights):
            storage.delete_file(storage.join(self.rec.folder, weights_file(int(u))))
        self.index.update(states=states, checks=[k for k in first["checks"] if k + 1 <= start], stopped=stopped,
                          sampler_weights=weights)
        self.committed = sum(s["bytes"] for s in [*states.values(), *weights.values()])

    def take(self, updates: int) -> None:
        """After `updates` updates (every rank): the state, where a check wants it — before step `updates`, after step
        `updates` − 1. Collective in a sharded view, at the steps it wants alike on every rank. Then a sampler's
        weights, where it samples with these."""
        self._take_state(updates)
        if self.enabled and updates > 0 and self.sampled_at is not None and self.sampled_at(updates):
            self._take_weights(updates)

    def _take_state(self, updates: int) -> None:
        if not (self.enabled and (checked(updates, self.interval) or checked(updates - 1, self.interval))):
            return
        t0 = time.perf_counter()
        try:
            closes = updates - 1 in self.open
            go = [closes or (checked(updates, self.interval) and self._room())]  # rank 0's answer
            if not self.rec.view.whole:  # rank 0 decides; every rank gathers
                dist.broadcast_object_list(go, src=0, device=self.rec.device)
            if go[0] and (self.rec.rank == 0 or not self.rec.view.whole):
                state = self._gather()
                if self.writer is not None:
                    self._save(updates, state, closes)
        except Exception as exc:  # never the user's training
            self._stop(updates, f"the state after {updates} updates could not be saved ({type(exc).__name__}: "
                                f"{(str(exc).strip().splitlines() or [''])[0][:200]})")
            self.enabled = False
        spent = time.perf_counter() - t0
        self.seconds += spent
        steps = self.rec.record.steps
        if updates > self.start and steps and steps[-1]["step"] == updates - 1:  # the step just recorded holds it
            steps[-1].setdefault("harness_s", {})["states"] = spent

    def _take_weights(self, updates: int) -> None:
        """The parameters after `updates` updates, for the rows a sampler samples with them (every rank; collective in
        a sharded view), within the cap; past it, or where they cannot be read, no more (one line)."""
        t0 = time.perf_counter()
        try:
            go = [str(updates) not in self.index["states"] and self._room() and self.sampled_at is not None]
            if not self.rec.view.whole:
                dist.broadcast_object_list(go, src=0, device=self.rec.device)
            if go[0] and (self.rec.rank == 0 or not self.rec.view.whole):
                full = full_state_dict(self.rec.view)
                params = {f"param/{name}": own(full[name]) for name in self.rec.names.values()}
                size = sum(t.numel() * 4 for t in params.values())
                if self.writer is not None and self.committed + size > self.max_bytes:
                    self._weights_stop(f"the sampler's weights passed max_state_bytes ({self.max_bytes} bytes) at "
                                       f"step {updates}: no more are kept")
                elif self.writer is not None:
                    self.committed += size
                    self.writer.submit(-updates, storage.join(self.rec.folder, weights_file(updates)), params)
                    self.index["sampler_weights"][str(updates)] = {
                        "file": f"recorded_{self.rec.name}/{weights_file(updates)}", "bytes": size}
        except Exception as exc:  # never the user's training
            self._weights_stop(f"the sampler's weights after {updates} updates could not be saved "
                               f"({type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]})")
        spent = time.perf_counter() - t0
        self.seconds += spent
        steps = self.rec.record.steps
        if steps and steps[-1]["step"] == updates - 1:
            steps[-1].setdefault("harness_s", {})["sampler_weights"] = spent

    def _weights_stop(self, why: str) -> None:
        """No more of the sampler's weights, said once: the sampler verdict leaves the later steps' rows out."""
        self.sampled_at = None
        self.rec._line(f"{why}; the sampler verdict judges the rows of the steps whose weights are kept")

    def _room(self) -> bool:
        """Rank 0: whether states are still saved (neither the cap passed nor the record stopped)."""
        return self.index["stopped"] is None and self.rec.stop is None

    def _gather(self) -> FullState:
        return gathered(self.rec.view, self.rec.names.values())

    def _save(self, updates: int, state: FullState, closes: bool) -> None:
        """Rank 0: the state after `updates` updates written, where it closes a check or opens one within the cap."""
        tensors = encode(state)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        opens = checked(updates, self.interval) and self._room()
        if opens:  # room for this state and the one after the step, which holds AdamW's moments too
            after = (sum(t.numel() * 4 for t in state.params.values()) * (1 + len(ADAMW_MOMENTS))
                     + sum(t.numel() * 4 for t in state.buffers.values()))
            opens = self.committed + (0 if closes else size) + after <= self.max_bytes
            if not opens:
                self._stop(updates, f"the states passed max_state_bytes ({self.max_bytes} bytes) at step {updates}: "
                                    f"no more are saved")
            else:
                self.committed += after
        if not (opens or closes):
            return
        self.committed += 0 if closes else size
        self.writer.submit(updates, storage.join(self.rec.folder, state_file(updates)), tensors)
        self.index["states"][str(updates)] = {"file": f"recorded_{self.rec.name}/{state_file(updates)}",
                                              "bytes": size, "step_count": state.count}
        if closes:
            self.open.discard(updates - 1)
            self.index["checks"].append(updates - 1)
        if opens:
            self.open.add(updates)

    def _stop(self, step: int, why: str) -> None:
        """Rank 0: no more states from `step` on, in one line; the checks saved so far, and those open, are kept."""
        if self.rec.rank != 0 or self.index["stopped"] is not None:
            return
        self.index["stopped"] = {"step": step, "why": why}
        kept = sorted({*self.index["checks"], *self.open})
        self.rec._line(f"{why}; the teacher-forced check takes "
                       + (f"step{'s' if len(kept) > 1 else ''} {', '.join(map(str, kept))}" if kept else "none")
                       + " (docs/own_trainer.md)")

    def _settle(self) -> None:
        """Rank 0: every state submitted on disk; one the writer could not write drops the checks that use it and ends
        the states (one line)."""
        failed = {u: why for u, why in self.writer.flush() if why}
        for u in [u for u in failed if u < 0]:  # a sampler's weights (submitted as −updates)
            self.index["sampler_weights"].pop(str(-u), None)
            self._weights_stop(f"the sampler's weights after {-u} updates could not be written ({failed.pop(u)})")
        for u, why in sorted(failed.items()):
            self._stop(u, f"the state after {u} updates could not be written ({why})")
            self.enabled = False
            self.index["states"].pop(str(u), None)
        self.index["checks"] = [k for k in self.index["checks"] if not {k, k + 1} & set(failed)]

    def save(self) -> None:
        """The index written, every state submitted so far on disk (rank 0; the record's save and close)."""
        if self.writer is None:
            return
        self._settle()
        self.index["saved_bytes"] = sum(s["bytes"] for s in self.index["states"].values())
        storage.write_json_atomic(self.path, self.index)

    def close(self, keep: bool = True) -> None:
        """Rank 0, at the record's end: a state no check uses (the one before a step that never came) deleted, and a
        sampler's weights of a step that never came, the index written, the writer's thread ended; `keep` False (the
        recording failed): the thread ended alone."""
        if self.writer is None:
            return
        if keep:
            self._settle()
            used = {u for k in self.index["checks"] for u in (k, k + 1)}
            for u in [u for u in self.index["states"] if int(u) not in used]:
                storage.delete_file(storage.join(self.rec.folder, state_file(int(u))))
                del self.index["states"][u]
            steps = self.rec.record.steps
            for u in [u for u in self.index["sampler_weights"] if not steps or int(u) > steps[-1]["step"]]:
                storage.delete_file(storage.join(self.rec.folder, weights_file(int(u))))
                del self.index["sampler_weights"][u]
            self.open.clear()
            self.save()
        self.writer.close()
        self.writer = None


__all__ = ["DEFAULT_CHECKPOINT_INTERVAL", "DEFAULT_MAX_STATE_BYTES", "StateSaver", "checked", "refusal"]
