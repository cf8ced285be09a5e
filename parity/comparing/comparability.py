"""Whether two runs are comparable, and what may explain a FAIL: the invariants every run must share with the
baseline before any number is judged (the same initial weights, model, optimizer settings, steps, and at every step the
same batch, tokens and learning rate), the code that produced each (fingerprints), the precision policy, and the
config fields that differ (the first suspects beside a FAIL). parity/comparing/curves.py asks these of each run."""

from __future__ import annotations

from parity import fingerprint, storage
from parity.comparing import objective
from parity.comparing.recorded import is_replay, replay_suspects, resumed_rows, same_rows
from parity.comparing.run import Run
from parity.precision import POLICY_FIELDS

# Optimizer settings recorded in the config that change the numbers (the lr is compared per step).
OPTIMIZER_SETTINGS = ("max_grad_norm", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                      "optimizer")  # optimizer: by parameter group, where a record names it (a recorded run, its replay)
# Config entries that differ between strategies by design: not suspects when a run FAILs. strategy_path is the
# strategy's class (a user's or a seeded bug's shows as strategy_class, which is a suspect).
LAYOUT_AND_PLACES = ("strategy", "strategy_path", "num_workers", "tp_size", "dp_size", "world_size", "batch_size",
                     "cpus_per_worker", "experiment_name", "final_checkpoint_dir", "loss_output_dir", "storage_path",
                     "noise_reference", "init_weights_path", "save_init_weights", "worker_nodes", "fingerprint", "resume",
                     "verbose", "report_to", "replica_check_interval")
# Per-step entries every run must share with the baseline: (field, what differs, in words).
STEP_INVARIANTS = (("batch_hash", "see different batches"), ("tokens", "train on different tokens per step"),
                   ("lr", "use different learning rates"))
FOLLOW_ROWS = ("batch_hash", "tokens")  # those that follow the rows fed: compared up to a resume finding's step only


def policy_differences(base: Run, run: Run) -> list[str]:
    """'field: baseline's vs run's' for each policy field in which the two runs differ (empty: the same policy)."""
    a, b = base.policy, run.policy
    return [f"{k}: {a[k]} vs {b[k]}" for k in POLICY_FIELDS if a[k] != b[k]]


def comparability_mismatches(base: Run, run: Run) -> list[str]:
    """What differs between two runs besides the strategy, each naming both runs (empty: comparable)."""
    a, b = base.name, run.name
    found = []
    sha_a, sha_b = base.config["init_weights_sha256"], run.config["init_weights_sha256"]
    if sha_a != sha_b:
        found.append(f"{a} and {b} start from different initial weights (init_weights_sha256 {sha_a[:12]}… vs "
                     f"{sha_b[:12]}…): train both from the same --init_weights_path")
    model_a, model_b = base.config["model_config"], run.config["model_config"]
    for what, differing in (("train different models", _differing(model_a, model_b, sorted(model_a | model_b))),
                            ("use different optimizer settings",
                             _differing(base.config, run.config, OPTIMIZER_SETTINGS))):
        if differing:
            found.append(f"{a} and {b} {what} ({differing})")
    if base.complete and run.complete and len(base.steps) != len(run.steps):
        found.append(f"{a} has {len(base.steps)} steps, {b} has {len(run.steps)}: train both with the same "
                     f"--debug_steps")
    resumed = resumed_rows(base.record, run.record)  # rows parting where one resumed: _result's finding, not this
    for field, what in STEP_INVARIANTS:
        until = resumed.step if resumed and field in FOLLOW_ROWS else len(base.steps)
        apart = next(((sa, sb) for sa, sb in zip(base.steps[:until], run.steps) if not _agree(field, sa, sb)), None)
        if apart:
            sa, sb = apart
            found.append(f"{a} and {b} {what} from step {sa['step']} ({field} {sa[field]} vs {sb[field]})")
    return found + objective.mismatches(base, run)


def _agree(field: str, a: dict, b: dict) -> bool:
    """Two runs' entries of one step hold the same step invariant `field` (the batch: the same rows, same_rows)."""
    return same_rows(a, b) if field == "batch_hash" else a[field] == b[field]


def code_mismatches(base: Run, run: Run) -> list[str]:
    """The run and the baseline were produced by other shared code or library versions (their fingerprints):
    one entry naming both, or none."""
    diff = fingerprint.differences(base.fingerprint, run.fingerprint, strategy=False)
    return [f"{storage.name(base.file)} and {storage.name(run.file)} ran other code ({'; '.join(diff)})"] if diff else []


def config_differences(base: Run, run: Run) -> list[str]:
    """'field: baseline's vs run's' for every config field (strategy options and library versions
    included) that differs, among those that may explain a FAIL (suspect_fields)."""
    a, b = _flat(base.config), _flat(run.config)
    suspects = suspect_fields(base, run)
    return [f"{k}: {a.get(k, '–')} vs {b.get(k, '–')}" for k in sorted(a | b)
            if k.split(".")[0] in suspects and a.get(k) != b.get(k)]


def suspect_fields(base: Run, run: Run) -> set[str]:
    """The config fields whose difference may explain a FAIL: all but the layout and the places files go, which differ
    by design; a recorded run against its replay, only those the replay takes from the record (replay_suspects)."""
    fields = set(base.config) | set(run.config)
    if run.recorded and is_replay(base.config):
        fields &= replay_suspects(base.config)
    return fields - set(LAYOUT_AND_PLACES)


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and key != "model_config":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _differing(mine: dict, theirs: dict, keys) -> str:
    """'key: a vs b, ...' over the `keys` whose values differ; empty when none do."""
    return ", ".join(f"{k}: {mine.get(k)} vs {theirs.get(k)}" for k in keys if mine.get(k) != theirs.get(k))
