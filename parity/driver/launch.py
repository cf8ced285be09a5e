"""Ray Train launch: resolved runs on one TorchTrainer — one run, or several one after another in the same worker
group of as many workers as the largest needs, a run of fewer on the group's first ranks
(parity/training/sub_world.py): starting a group costs 10–15 s on a 2-core machine.

On CPU the workers get fractional CPUs (4 workers run on 2 cores) and talk over gloo; on GPUs each
worker gets one GPU and NCCL (`resolve` decided which, from the cluster's resources). A worker failure
restarts the group up to --max_failures times, from the run's latest checkpoint (checkpoints.py).
"""

from __future__ import annotations

import os

from parity import console, storage
from parity.errors import COLLATERAL, TrainingFailed
from parity.registry import module_folder
from parity.tracking.trackers import worker_environment
from parity.training.checkpoints import replace_run_folder
from parity.driver.cluster import ensure_ray
from parity.run_config import RunConfig


def launch(cfg: RunConfig, worker, payload: dict, announce_folder: bool = True) -> float:
    """Run `worker` (the layer check's recorded step, or the training loop of launch_runs) on cfg.num_workers
    Ray Train workers; it receives {"cfg": cfg as a dict, "terminal": whether the driver shows marked lines,
    **payload}. The run's folder, <storage_path>/<experiment_name>, is Ray Train's; an existing one is replaced,
    or continued with --resume (replace_run_folder), which one line says unless not `announce_folder` (a folder
    of scratch runs). Returns Ray start-up seconds (0 when Ray was already up). Raises TrainingFailed with the
    worker's error line, or with the line all ranks stopped on."""
    note = replace_run_folder(cfg)
    if note and announce_folder:
        console.say(f"[{cfg.strategy}] {note}")
    ray_start_s = ensure_ray()
    _fit([cfg], worker, {"cfg": cfg.to_dict(), "terminal": console.active(), **payload}, cfg.storage_path,
         cfg.experiment_name, cfg.keep_checkpoints)
    return ray_start_s


def launch_runs(cfgs: list[RunConfig], payloads: list[dict], checkpoints: bool = True,
                titles: list[str] | None = None, worker=None) -> float:
    """Train `cfgs` (their own `payloads`, {"batches": ...}) one after another in ONE worker group of the largest
    run's workers: Ray starts the workers once, not once per run. One run is launch's (its folder is Ray Train's).
    Several share --storage_path, which becomes the group's folder: each run's checkpoints go to
    <storage_path>/<experiment_name>/ as they would alone, Ray Train keeps all of them (its --keep_checkpoints
    would count the runs together), and a worker failure restarts the group, which resumes the run it was
    training (each run keeps its own --max_failures). `worker` (default: the training loop's train_group_worker) takes {"runs": [...]}, as the layer
    check's recorded steps do. Returns Ray start-up seconds."""
    from parity.training.loop import train_group_worker

    worker = worker or train_group_worker
    runs = [{"cfg": cfg.to_dict(), "title": title, **payload}
            for cfg, payload, title in zip(cfgs, payloads, titles or [cfg.strategy for cfg in cfgs])]
    group = {"runs": runs, "checkpoints": checkpoints}
    if len(cfgs) == 1:
        return launch(cfgs[0], worker, group, announce_folder=checkpoints)
    first = cfgs[0]
    assert len({c.storage_path for c in cfgs}) == 1, "a group: one storage_path"
    for cfg in cfgs:
        assert not cfg.resume, "a group starts its runs afresh"
        replace_run_folder(cfg)
    ray_start_s = ensure_ray()
    storage.delete_dir(first.storage_path)  # Ray Train's own record of the group's checkpoints: a fresh group
    _fit(cfgs, worker, {**group, "terminal": console.active()}, storage.parent(first.storage_path),
         storage.name(first.storage_path), keep=0)
    return ray_start_s


def run_packed(config: dict):
    """Ray Train's train_loop_per_worker: the worker function and its payload, handed over as bytes. Ray Train's
    controller unpickles the train_loop_config it holds; as bytes, the payload's objects (the batches, and the
    harness's modules behind them) stay unopened there and are opened on the workers alone: the controller's imports
    went from 3.2 to 2.0 CPU-seconds per worker group."""
    import pickle

    worker, payload = pickle.loads(config["packed"])
    return worker(payload)


def _max_failures(cfgs: list[RunConfig]) -> int:
    """Restarts a group may make: each run keeps its own --max_failures (-1: no limit)."""
    budgets = [c.max_failures for c in cfgs]
    return -1 if -1 in budgets else sum(budgets)


def _fit(cfgs: list[RunConfig], worker, loop_config: dict, storage_path: str, name: str, keep: int) -> None:
    """One TorchTrainer for `cfgs`: the largest run's workers and resources, Ray Train's folder
    <storage_path>/<name>, the last `keep` checkpoints kept (0: all); the folders of users' own strategy modules
    on the workers' PYTHONPATH, and the experiment trackers' variables (WANDB_*, MLFLOW_*) in their environment."""
    from ray import cloudpickle
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg = max(cfgs, key=lambda c: c.num_workers)
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_cuda else {})}
    own = os.pathsep.join(dict.fromkeys(f for c in cfgs if c.strategy_class and (f := module_folder(c.strategy_class))))
    env = {**worker_environment(cfgs),
           **({"PYTHONPATH": os.pathsep.join(filter(None, [own, os.environ.get("PYTHONPATH")]))} if own else {})}
    trainer = TorchTrainer(
        run_packed,
        train_loop_config={"packed": cloudpickle.dumps((worker, loop_config))},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_cuda,
                                     resources_per_worker=resources),
        run_config=RayRunConfig(storage_path=storage_path, name=name,
                                failure_config=FailureConfig(max_failures=_max_failures(cfgs)),
                                checkpoint_config=CheckpointConfig(num_to_keep=keep or None),
                                worker_runtime_env={"env_vars": env} if env else None),
        torch_config=TorchConfig(backend="nccl" if cfg.use_cuda else "gloo"),
    )
    try:
        result = trainer.fit()
    except Exception as exc:  # Ray wraps the worker's exception; keep its line for the user
        raise TrainingFailed(_root_cause(exc)) from exc
    stopped = (result.return_value or {}).get("stopped")
    if stopped:
        raise TrainingFailed(stopped)


def _root_cause(exc: BaseException) -> str:
    """The line that says what failed. For a worker group, the rank whose own error it was: not the ranks that
    lost their connection to it, nor — when a rank's process died — the health check that noticed."""
    failures = getattr(exc, "worker_failures", None)
    if failures:
        def rank_order(item):
            rank, error = item
            text = str(error)
            return (any(c in text for c in COLLATERAL), type(error).__name__ == "WorkerHealthCheckFailedError", rank)

        rank, error = min(failures.items(), key=rank_order)
        return f"rank {rank}: {_last_line(error)}"
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return _last_line(exc)


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
