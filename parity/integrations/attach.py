"""The variables through which verify_trainer.py attaches the recorder to a command it runs
(docs/own_trainer.md#one-command).

verify_trainer.py sets them in the environment of the user's command, which every process the command starts
inherits (a launcher's ranks, spawned ranks, a local Ray cluster's workers): PARITY_RECORD_DIR, the folder the
records go to, and PARITY_RECORD_NAME, the record's name (and PARITY_CHECKPOINT_INTERVAL where verify_trainer.py was
given --checkpoint_interval, PARITY_NUM_LAYERS where it was given --num_layers: layer_cut.py). Where they are set, every ParityRecorder the command makes writes there under that name
(and saves its states at that interval), whatever folder, name and interval its code passes (`attached`): a loop of
your own keeps its ParityRecorder lines, and verify_trainer.py finds the record where it replays and judges it.
Trainer and TRL's trainers get their callback from sitecustomize (trainer_hook.py), Lightning from its callbacks entry
point (lightning_factory.py), both only where the variables are set.
"""

from __future__ import annotations

import os

RECORD_DIR = "PARITY_RECORD_DIR"  # sitehook/sitecustomize.py reads this name before importing anything
RECORD_NAME = "PARITY_RECORD_NAME"
CHECKPOINT_INTERVAL = "PARITY_CHECKPOINT_INTERVAL"  # verify_trainer.py --checkpoint_interval: where states are saved
SITE_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sitehook")  # sitecustomize.py alone

_made = 0  # recorders this process has made under the variables


def active() -> bool:
    """Whether this process runs under verify_trainer.py."""
    return bool(os.environ.get(RECORD_DIR))


def attached(output_dir: str, name: str) -> tuple[str, str]:
    """(output_dir, name) for a recorder: the variables' where they are set, else the ones given. A process that makes
    several recorders (a script that records twice) names the second `<name>_2`, the third `<name>_3`: every rank
    makes them in the same order, so the ranks of one run agree on its name."""
    global _made
    if not active():
        return output_dir, name
    _made += 1
    output_dir, name = variables()
    return output_dir, name if _made == 1 else f"{name}_{_made}"


def variables() -> tuple[str, str]:
    """(folder, name) as verify_trainer.py set them."""
    return os.environ[RECORD_DIR], os.environ[RECORD_NAME]


def refused(why: str) -> None:
    """Under verify_trainer.py, a recorder that refuses to record leaves its line in the folder (refused_<name>.txt),
    which verify_trainer.py repeats as its own last line; elsewhere nothing (the recorder printed it)."""
    if active():
        from parity import storage

        folder, name = variables()
        try:
            storage.write_bytes_atomic(storage.join(folder, f"refused_{name}.txt"), why.encode())
        except OSError:
            pass


def checkpoint_interval(given: int | None) -> int | None:
    """A recorder's checkpoint_interval (parity/integrations/states.py): verify_trainer.py's --checkpoint_interval
    where it set one, else `given`: the states of a command whose code cannot be told are saved where the user asks."""
    value = os.environ.get(CHECKPOINT_INTERVAL) if active() else None
    return int(value) if value else given


def environment(output_dir: str, name: str, base: dict[str, str], interval: int | None = None,
                num_layers: int | None = None) -> dict[str, str]:
    """`base` with the variables set for a command recorded into `output_dir` under `name` (with `interval`, the
    recorders' checkpoint_interval; with `num_layers`, the depth every transformers model is cut to), and the folder of
    sitecustomize.py first on its PYTHONPATH (so that every Python process of the command imports it)."""
    from parity.integrations.layer_cut import NUM_LAYERS

    path = [SITE_FOLDER] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_FOLDER]
    env = {k: v for k, v in base.items() if k not in (CHECKPOINT_INTERVAL, NUM_LAYERS)}
    return {**env, RECORD_DIR: output_dir, RECORD_NAME: name, "PYTHONPATH": os.pathsep.join(path),
            **({CHECKPOINT_INTERVAL: str(interval)} if interval is not None else {}),
            **({NUM_LAYERS: str(num_layers)} if num_layers is not None else {})}


__all__ = ["CHECKPOINT_INTERVAL", "RECORD_DIR", "RECORD_NAME", "SITE_FOLDER", "active", "attached",
           "checkpoint_interval", "environment", "refused", "variables"]
