"""What a comparison says of a recorded run (your own trainer: parity/recording/recorder.py, docs/own_trainer.md)
beyond what it says of a harness run: which config fields it must share with its replay (parity/replay/replay.py),
where its record stopped early, and where it resumed from its framework's checkpoint (config.resumed_at: the steps at
which it did): between two recorded runs of one script, rows that part at the step one of them resumed and the other
ran through are that resume's finding — it skipped or repeated data — where other rows anywhere else make two runs not
comparable.
"""

from __future__ import annotations

from parity.comparing.verdict import Outside
from parity.run_config import REPLAY_ONLY, REPLAY_TAKES
from parity.training.data import RECORDED, ROLLOUTS
from parity.training.record import is_recorded

RESUMED_ROWS = "resumed_rows"  # the resume finding's quantity and test (Outside; found by resumed_rows below)
# a replay (verify_trainer.py --replay_strategy) → the words for it, the recorded layout (the recorder's sharding.kind)
# whose library it shares, that library, and the replay to offer instead (parity/replay/replay_choice.py)
REPLAY_WORDS = {"ddp": ("the harness's DDP", None, None, None),
                "fsdp": ("the harness's FSDP2, fully sharded, no TP", "fsdp2", "FSDP2 (torch's fully_shard)", "zero3"),
                "zero3": ("the harness's DeepSpeed ZeRO-3, no TP", "deepspeed zero3", "DeepSpeed's ZeRO-3", "fsdp")}


def is_replay(config: dict) -> bool:
    """A replay of a recorded run (train_ddp.py --replay_record): trained on a record's batches (a post-training
    objective's: its rollouts), with the record's optimizer groups and lr at each step (the only runs that set
    REPLAY_ONLY's fields)."""
    return (all(config.get(k) is not None for k in REPLAY_ONLY)
            and str(config.get("dataset", "")).startswith((RECORDED, ROLLOUTS)))


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


def cut_words(config: dict) -> str | None:
    """A recorded run trained cut to its first N decoder layers (verify_trainer.py --num_layers: config.layer_cut,
    written by the recorder), in words; None for a run at its own depth."""
    cut = config.get("layer_cut")
    return (f"trained cut to its first {cut['num_layers']} of {cut['of']} decoder layers at its real widths "
            f"(--num_layers {cut['num_layers']}), and replayed so" if cut else None)


def replay_name(config: dict) -> str | None:
    """Which replay a baseline is (REPLAY_WORDS' key), or None for a baseline that is no replay."""
    if not is_replay(config):
        return None
    if config.get("strategy") == "deepspeed":
        return "zero3" if (config.get("options") or {}).get("zero_stage") == 3 else None
    return config.get("strategy") if config.get("strategy") in REPLAY_WORDS else None


def replay_lines(baseline: dict, runs: dict[str, dict]) -> list[str]:
    """Which replay judged the recorded runs (`runs`: label → config), and for each run whose layout the replay's
    library also ran, that the baseline shares that code path with it — a bug of that library's own would be in both,
    unseen — and the replay to judge it under instead."""
    name = replay_name(baseline)
    if name is None:
        return []
    words, kind, library, other = REPLAY_WORDS[name]
    lines = [f"the record's replay under {words}, over {baseline.get('dp_size')} workers"]
    for label, config in runs.items():
        if kind and (config.get("sharding") or {}).get("kind") == kind:
            lines.append(f"{label} ran {library} too: the baseline shares that library's code path with the run it "
                         f"judges, so a bug in {library} itself would be in both and unseen; judge it against the "
                         f"replay under {REPLAY_WORDS[other][0]} too (verify_trainer.py --replay_strategy {other})")
    return lines


def resumed_at(config: dict) -> list[int]:
    """The steps at which a recorded run resumed from its framework's checkpoint (none when the key is absent)."""
    return list(config.get("resumed_at") or [])


def resumed_note(resumed: list[int], step: int, test: str) -> str | None:
    """For a FAIL first outside at `step` (found by `test`) of a run that resumed at the steps `resumed`: that it
    resumed from its checkpoint there, the first suspect; None elsewhere, and for the resume finding (it says so)."""
    return f"the run resumed from its checkpoint at step {step}" if step in resumed and test != RESUMED_ROWS else None


def same_script(a: dict, b: dict) -> bool:
    """Two recorded runs' configs name one script: the same sha256 of it where both have one, else the same framework
    and script name."""
    fa, fb = a["fingerprint"].get("framework") or {}, b["fingerprint"].get("framework") or {}
    if fa.get("script_sha256") and fb.get("script_sha256"):
        return fa["script_sha256"] == fb["script_sha256"]
    return bool(fa.get("script")) and (fa.get("name"), fa.get("script")) == (fb.get("name"), fb.get("script"))


def same_rows(a: dict, b: dict) -> bool:
    """Two runs' entries of one step fed the same rows: the same batch hash, or — two recorded runs at other layouts feed
    them in another order — the same order-free rows_hash."""
    return a["batch_hash"] == b["batch_hash"] or bool(a.get("rows_hash")) and a.get("rows_hash") == b.get("rows_hash")


def resumed_rows(base: dict, run: dict) -> Outside | None:
    """The resume finding between two records (the baseline's and a run's): both recorded runs of one script whose
    rows are the same up to a step k at which exactly one of them resumed, and differ there. The Outside's value says
    whether the run resumed at k, its reference whether the baseline did. None for any other pair."""
    a, b = base["config"], run["config"]
    if not (is_recorded(a) and is_recorded(b) and same_script(a, b)):
        return None
    step = next((sa["step"] for sa, sb in zip(base["steps"], run["steps"]) if not same_rows(sa, sb)), None)
    if step is None or (step in resumed_at(a)) == (step in resumed_at(b)):
        return None
    return Outside(quantity=RESUMED_ROWS, rel_diff=1.0, tolerance=0.0, step=step, value=float(step in resumed_at(b)),
                   reference=float(step in resumed_at(a)), test=RESUMED_ROWS)


def resumed_rows_words(step: int, run_resumed: bool) -> str:
    """The resume finding at `step` in words, the run (this run, or the baseline) that resumed there named."""
    resumed, other = ("this run", "the baseline") if run_resumed else ("the baseline", "this run")
    return (f"{resumed} resumed from its checkpoint at step {step} and feeds other rows than {other}, which ran on "
            f"uninterrupted, from step {step} on: its resume skipped or repeated data")
