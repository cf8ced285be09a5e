"""The variables through which verify_trainer.py attaches the recorder to a command it runs
(docs/own_trainer/one_command.md#one-command).

verify_trainer.py sets them in the environment of the user's command, which every process the command starts
inherits (a launcher's ranks, spawned ranks, a local Ray cluster's workers): PARITY_RECORD_DIR, the folder the
records go to, and PARITY_RECORD_NAME, the record's name (and PARITY_CHECKPOINT_INTERVAL where verify_trainer.py was
given --checkpoint_interval, PARITY_NUM_LAYERS where it was given --num_layers: layer_cut.py). Where they are set, every ParityRecorder the command makes writes there under that name
(and saves its states at that interval), whatever folder, name and interval its code passes (`attached`): a loop of
your own keeps its ParityRecorder lines, and verify_trainer.py finds the record where it replays and judges it.
Trainer and TRL's trainers get their callback from sitecustomize (frameworks/transformers/trainer_hook.py), Lightning from its callbacks entry
point (frameworks/lightning/factory.py), both only where the variables are set. A recorder that stops the command (a torchtitan
job it cannot record) leaves its line in the folder (`stop_command`), which verify_trainer.py repeats, exit status 2.
"""

from __future__ import annotations

import os
import sys

from parity import storage

RECORD_DIR = "PARITY_RECORD_DIR"  # sitehook/sitecustomize.py reads this name before importing anything
RECORD_NAME = "PARITY_RECORD_NAME"
CHECKPOINT_INTERVAL = "PARITY_CHECKPOINT_INTERVAL"  # verify_trainer.py --checkpoint_interval: where states are saved
STOPPED_FILE = "stopped.txt"  # a recorder that stopped the command (frameworks/torchtitan/recording.py): its line, for verify_trainer.py
# sitecustomize.py alone: the framework rooms' hooks (a path, not an import: the rooms sit above this one)
SITE_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "frameworks", "sitehook")

_made: dict[tuple[str, str], int] = {}  # recorders this process has made, by the variables they were made under


def active() -> bool:
    """Whether this process runs under verify_trainer.py."""
    return bool(os.environ.get(RECORD_DIR))


def attached(output_dir: str, name: str) -> tuple[str, str]:
    """(output_dir, name) for a recorder: the variables' where they are set (read when it is made), else the ones
    given. A process that makes several recorders under the same variables (a script that records twice) names the
    second `<name>_2`, the third `<name>_3`: every rank makes them in the same order, so the ranks of one run agree on
    its name. One that records into another folder or name (the variables changed between its runs, as the tests'
    torchtitan runner changes them between jobs) names that one's first record plainly."""
    if not active():
        return output_dir, name
    where = variables()
    _made[where] = made = _made.get(where, 0) + 1
    return where[0], where[1] if made == 1 else f"{where[1]}_{made}"


def variables() -> tuple[str, str]:
    """(folder, name) as verify_trainer.py set them."""
    return os.environ[RECORD_DIR], os.environ[RECORD_NAME]


def refused(why: str) -> None:
    """Under verify_trainer.py, a recorder that refuses to record leaves its line in the folder (refused_<name>.txt),
    which verify_trainer.py repeats as its own last line; elsewhere nothing (the recorder printed it)."""
    if active():
        _leave(f"refused_{variables()[1]}.txt", why)


def stop_command(line: str) -> None:
    """Where a recorder stops the command it records (a job it cannot record, on every rank, before it trains): its
    one line said on rank 0 and left in the records' folder, for verify_trainer.py to repeat with exit status 2 — a
    launcher reports its own status for a worker that stopped (torchrun: 1) —, then this process exits with status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"parity recorder: {line}: recording nothing; the job stops (exit 2)", file=sys.stderr, flush=True)
        if active():
            _leave(STOPPED_FILE, line)
    raise SystemExit(2)


def _leave(file: str, line: str) -> None:
    """A line for verify_trainer.py in the records' folder, written atomically (a folder it cannot write: nothing)."""
    try:
        storage.write_text_atomic(storage.join(os.environ[RECORD_DIR], file), line)
    except OSError:
        pass


def stopped_command(output_dir: str) -> str | None:
    """The line a recorder left where it stopped the command recorded into `output_dir` (None: it did not)."""
    path = storage.join(output_dir, STOPPED_FILE)
    return storage.read_text(path).strip() if storage.exists(path) else None


def checkpoint_interval(given: int | None) -> int | None:
    """A recorder's checkpoint_interval (parity/recording/states.py): verify_trainer.py's --checkpoint_interval
    where it set one, else `given`: the states of a command whose code cannot be told are saved where the user asks."""
    value = os.environ.get(CHECKPOINT_INTERVAL) if active() else None
    return int(value) if value else given


def environment(output_dir: str, name: str, base: dict[str, str], interval: int | None = None,
                num_layers: int | None = None) -> dict[str, str]:
    """`base` with the variables set for a command recorded into `output_dir` under `name` (with `interval`, the
    recorders' checkpoint_interval; with `num_layers`, the depth every transformers model is cut to), and the folder of
    sitecustomize.py first on its PYTHONPATH (so that every Python process of the command imports it)."""
    from parity.attaching.layer_cut import NUM_LAYERS

    path = [SITE_FOLDER] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_FOLDER]
    env = {k: v for k, v in base.items() if k not in (CHECKPOINT_INTERVAL, NUM_LAYERS)}
    return {**env, RECORD_DIR: output_dir, RECORD_NAME: name, "PYTHONPATH": os.pathsep.join(path),
            **({CHECKPOINT_INTERVAL: str(interval)} if interval is not None else {}),
            **({NUM_LAYERS: str(num_layers)} if num_layers is not None else {})}


__all__ = ["CHECKPOINT_INTERVAL", "RECORD_DIR", "RECORD_NAME", "SITE_FOLDER", "STOPPED_FILE", "active",
           "attached", "checkpoint_interval", "environment", "refused", "stop_command", "stopped_command", "variables"]
