"""The replay of a recorded post-training run (docs/posttrain.md#your-own-run-recorded): its record's rollout file
(recorded_objective.py wrote it) trained under the harness's DDP with the record's objective, the reference
definition — `--objective NAME --objective_args … --rollouts FILE`, as any harness run on a rollout file — at any
worker count the steps' rows go round evenly, each rank's rows in micro-batches of at most the run's largest.

A definition that depends on the split by definition (bnpo, an entropy bonus, DPO's sft: a term of each micro-batch's
own) is replayed at the record's own split only: micro-batches of the rows the run's held (objectives.micro_rows), so
a worker count whose rows cannot be cut into them is refused in one line, saying which counts can; so are its noise
references (verify_trainer.py --calibrate passes over such counts and says why)."""

from __future__ import annotations

from parity import storage
from parity.errors import ConfigError
from parity.objectives import invariance_of, micro_rows, objective_flags
from parity.objectives.rollouts import read_rollouts
from parity.training.data import ROLLOUTS


def objective_data(record_file: str, config: dict, steps: int, workers: int, dump_step: int | None = None) -> dict:
    """The replay's data flags for a record of a post-training objective (config["objective"]): its rollout file
    and objective (objectives.objective_flags) and the split of each step's rows over `workers` — the batch size and
    accumulation (`split`). ConfigError in one line where the file is not there or the workers cannot split it."""
    name, objective = storage.name(record_file), config["objective"]
    if dump_step is not None:
        raise ConfigError(f"--dump_step: {name} is a record of {objective['name']}: its step is checked module by "
                          f"module by the layer check of its rollouts (run_verification.py --objective … --rollouts "
                          f"{config.get('rollouts')}), not by a dump of the replay")
    if not config.get("rollouts"):
        raise ConfigError(f"--replay_record {name}: a record of {objective['name']} without its rollouts (its recorder "
                          f"stopped before writing them): record the run again")
    path = storage.join(storage.parent(storage.absolute(record_file)), config["rollouts"])
    if not storage.exists(path):
        raise ConfigError(f"--replay_record {name}: its rollouts {path} are missing: copy the record's whole folder "
                          f"(recorded_*/ beside it) or record the run again")
    rollouts = read_rollouts(path)
    rows = rollouts.rows_per_step()
    if rows is None or rollouts.steps < steps:
        raise ConfigError(f"--replay_record {name}: its rollouts {path} hold {rollouts.steps} steps of "
                          f"{rows or 'different numbers of'} rows, the record {steps}: record the run again")
    batch_size, accumulation = split(name, config, rows, workers)
    return {"batch_size": batch_size, "grad_accum_steps": accumulation, **objective_flags(objective, ROLLOUTS + path)}


def allowed_workers(config: dict, rows: int) -> list[int]:
    """The worker counts a record's steps of `rows` rows replay at (split)."""
    return [w for w in range(1, rows + 1) if _accumulation(config, rows, w) is not None]


def split(name: str, config: dict, rows: int, workers: int) -> tuple[int, int]:
    """(rows a worker, micro-batches a worker) of a step's `rows` over `workers`: micro-batches of at most the run's
    largest (config.batches.most_rows), whole pairs for DPO — or, for a definition that depends on the split, the
    run's own micro-batches. ConfigError in one line naming the counts that can."""
    allowed = allowed_workers(config, rows)
    accumulation = _accumulation(config, rows, workers)
    if accumulation is None:
        objective = config["objective"]
        invariance = invariance_of(objective)
        why = (f"{invariance.note(objective['name'])}: the run's micro-batches held {micro_rows(config)} rows"
               if invariance.depends_on_split else "a DPO micro-batch holds whole pairs"
               if objective["name"] == "dpo" else "its rows must go round the workers evenly")
        raise ConfigError(f"--num_workers {workers}: {name}'s steps hold {rows} rows, which {workers} workers cannot "
                          f"split so ({why}): use {', '.join(map(str, allowed))} worker"
                          f"{'s' if allowed != [1] else ''}")
    return rows // workers, accumulation


def _accumulation(config: dict, rows: int, workers: int) -> int | None:
    """The micro-batches a worker splits its rows into, or None where `workers` cannot take the step's rows."""
    if rows % workers:
        return None
    per, objective = rows // workers, config["objective"]
    if invariance_of(objective).depends_on_split:
        micro = micro_rows(config)
        return per // micro if per % micro == 0 else None
    most, pairs = max(1, config["batches"]["most_rows"]), objective["name"] == "dpo"
    return next((g for g in range(1, per + 1) if per % g == 0 and per // g <= most
                 and not (pairs and (per // g) % 2)), None)


__all__ = ["allowed_workers", "objective_data", "split"]
