"""The loss record `loss_<strategy>.json`: schema, atomic rewrite during the run, load + validate.

Rank 0 rewrites the whole file every --log_interval steps (temp file + rename), so a crash leaves the
steps done so far and `"complete": false`; a reader never sees half a file.
"""

from __future__ import annotations

import json
import os

from parity.atomic import write_json_atomic

SCHEMA_VERSION = 1
STEP_FIELDS = ("step", "loss", "dp_rank_losses", "grad_norm", "lr", "tokens", "batch_hash", "step_time_s",
               "peak_memory_bytes")


class RecordError(Exception):
    """A loss record that cannot be used; the message names the file and what is wrong."""


def record_path(output_dir: str, strategy: str) -> str:
    return os.path.join(output_dir, f"loss_{strategy}.json")


class LossRecord:
    def __init__(self, path: str, strategy: str, config: dict):
        self.path = path
        self.data = {"schema_version": SCHEMA_VERSION, "strategy": strategy, "complete": False,
                     "config": config, "steps": []}

    @property
    def steps(self) -> list[dict]:
        return self.data["steps"]

    def append(self, **step) -> None:
        missing = set(STEP_FIELDS) - set(step)
        assert not missing, f"step entry lacks {sorted(missing)}"
        self.steps.append(step)

    def write(self) -> None:
        write_json_atomic(self.path, self.data)

    def finish(self, **final) -> None:
        self.data["final"] = final
        self.data["complete"] = True
        self.write()


def load_record(path: str) -> dict:
    """Read and check a loss record; RecordError names the file and the first thing wrong with it."""
    name = os.path.basename(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise RecordError(f"{name}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                          f"the file is malformed or truncated: rerun that strategy") from None
    except OSError as exc:
        raise RecordError(f"{name}: cannot be read ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{name}: expected a JSON object with 'strategy', 'config' and 'steps'")
    for key, kind in (("strategy", str), ("config", dict), ("steps", list)):
        if not isinstance(data.get(key), kind):
            raise RecordError(f"{name}: missing or invalid '{key}' (expected {kind.__name__}); "
                              f"not a loss record written by this harness")
    if not data["steps"]:
        raise RecordError(f"{name}: has no steps; the run stopped before its first step: rerun it")
    for i, step in enumerate(data["steps"]):
        if not isinstance(step, dict):
            raise RecordError(f"{name}: steps[{i}] is not an object")
        missing = [k for k in STEP_FIELDS if k not in step]
        if missing:
            raise RecordError(f"{name}: steps[{i}] lacks {', '.join(missing)}")
        if step["step"] != i:
            raise RecordError(f"{name}: steps[{i}] is numbered {step['step']}; steps must be 0, 1, 2, ...")
        for k in ("loss", "grad_norm", "lr"):
            if not isinstance(step[k], (int, float)):
                raise RecordError(f"{name}: steps[{i}].{k} is not a number")
    return data
