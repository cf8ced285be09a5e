"""What a comparison says of a recorded run (your own trainer: parity/integrations/recorder.py, docs/own_trainer.md)
beyond what it says of a harness run: which config fields it must share with its replay (parity/integrations/replay.py),
and where its record stopped early.
"""

from __future__ import annotations

from parity.run_config import REPLAY_ONLY, REPLAY_TAKES
from parity.training.data import RECORDED

RECORDER = "recorder"  # a recorded run's config.source (parity/integrations/recorder.py's SOURCE)


def is_recorded(config: dict) -> bool:
    return config.get("source") == RECORDER


def is_replay(config: dict) -> bool:
    """A replay of a recorded run (train_ddp.py --replay_record): trained on a record's batches, with the record's
    optimizer groups and lr at each step (the only runs that set REPLAY_ONLY's fields)."""
    return (all(config.get(k) is not None for k in REPLAY_ONLY)
            and str(config.get("dataset", "")).startswith(RECORDED))


def replay_suspects(replay: dict) -> set[str]:
    """The config fields in which a recorded run may differ from its replay `replay` (a config) other than by design:
    those the replay takes from the record (REPLAY_TAKES) and records under their own name. The rest of the record's
    config is the recorder's (its backend, its batches' folder ...) and the rest of the replay's the harness's (its
    seed, dataset, schedule ...); the batches, which the replay holds as its dataset, are compared step by step."""
    return set(REPLAY_TAKES) & set(replay)


def stopped_words(stopped: dict) -> str:
    """Where a record stopped early and why (config.stopped, written by the recorder at a step it could not record or
    replay, or where the batches passed their cap): the steps before it are all the record holds, and all judged."""
    step = stopped["step"]
    return f"recorded up to step {step}: {stopped['why']}; steps 0…{step - 1} judged"
