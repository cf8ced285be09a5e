"""A recorded run's teacher-forced checks, attached to it for the verdict (docs/own_trainer/replay.md#checkpoints-the-
teacher-forced-check): the replay of the record takes a reference step from each state the run's recorder saved and
writes every check's entry beside the record (`teacher_forced_<name>.json`, parity/training/recorded_states.py), apart
from loss_<name>.json; here they go into the loaded record's steps as a harness run's own checks are recorded, so
that the one verdict (parity/comparing/teacher_forced.py: judge_check, summary, first_fail) judges both alike — a
failing check is a FAIL at that step whatever the curves say. A recorded run without checks says why in one line
(teacher_forced.NONE): its recorder saved no states, or its states were not replayed, or the checks beside it are of
another recording (a step's batch hash differs from the record's).
"""

from __future__ import annotations

import json

from parity import storage
from parity.comparing import teacher_forced
from parity.training.record import is_recorded
from parity.training.recorded_states import checks_path


def attach(record_file: str, record: dict) -> dict:
    """`record` (loaded from `record_file`) with its recorded run's checks in its steps and the recorder's interval in
    its config — or, where it has none, why, under teacher_forced.NONE. A harness run's record is returned as it is."""
    if not is_recorded(record["config"]):
        return record
    path = checks_path(record_file, record["strategy"])
    if not storage.exists(path):
        record[teacher_forced.NONE] = (f"no {storage.name(path)} beside the record: its replay (train_ddp.py "
                                       f"--replay_record, verify_trainer.py) writes it from the states the recorder "
                                       f"saved")
        return record
    found = json.loads(storage.read_text(path))
    steps = record["steps"]
    other = next((e["step"] for e in found["checks"]
                  if e["step"] >= len(steps) or steps[e["step"]]["batch_hash"] != e["batch_hash"]), None)
    if other is not None:
        record[teacher_forced.NONE] = (f"{storage.name(path)} is of another recording (its step {other} fed other rows "
                                       f"than the record's): replay the record again")
        return record
    for entry in found["checks"]:
        steps[entry["step"]][teacher_forced.KEY] = {k: v for k, v in entry.items() if k != "batch_hash"}
    record["config"]["checkpoint_interval"] = found["interval"]
    if not found["checks"]:
        record[teacher_forced.NONE] = found["none"]
    return record
