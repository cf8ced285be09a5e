"""Ray Train launch: a resolved run on cfg.num_workers workers, one TorchTrainer.

On CPU the workers get fractional CPUs (4 workers run on 2 cores) and talk over gloo; on GPUs each
worker gets one GPU and NCCL (`resolve` decided which, from the cluster's resources). A worker failure
restarts the group up to --max_failures times, from the run's latest checkpoint (checkpoints.py).
"""

from __future__ import annotations

from parity import console
from parity.errors import COLLATERAL, TrainingFailed
from parity.training.checkpoints import replace_run_folder
from parity.training.cluster import ensure_ray
from parity.training.config import RunConfig





def launch(cfg: RunConfig, worker, payload: dict, announce_folder: bool = True) -> float:
    """Run `worker` (the training loop, or the layer check's recorded step) on cfg.num_workers Ray Train
    workers; it receives {"cfg": cfg as a dict, "terminal": whether the driver shows marked lines,
    **payload}. An existing run folder is replaced, or continued with --resume (replace_run_folder), which one
    line says unless not `announce_folder` (a folder of scratch runs). Returns Ray start-up seconds (0 when Ray
    was already up). Raises
    TrainingFailed with the worker's error line, or with the line all ranks stopped on."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    note = replace_run_folder(cfg)
    if note and announce_folder:
        console.say(f"[{cfg.strategy}] {note}")
    ray_start_s = ensure_ray()
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_cuda else {})}
    trainer = TorchTrainer(
        worker,
        train_loop_config={"cfg": cfg.to_dict(), "terminal": console.active(), **payload},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_cuda,
                                     resources_per_worker=resources),
        run_config=RayRunConfig(storage_path=cfg.storage_path, name=cfg.experiment_name,
                                failure_config=FailureConfig(max_failures=cfg.max_failures),
                                checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints or None)),
        torch_config=TorchConfig(backend="nccl" if cfg.use_cuda else "gloo"),
    )
    try:
        result = trainer.fit()
    except Exception as exc:  # Ray wraps the worker's exception; keep its line for the user
        raise TrainingFailed(_root_cause(exc)) from exc
    stopped = (result.return_value or {}).get("stopped")
    if stopped:
        raise TrainingFailed(stopped)
    return ray_start_s


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
