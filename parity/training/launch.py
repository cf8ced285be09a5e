"""Ray Train launch: a resolved run on cfg.num_workers workers, one TorchTrainer.

On CPU the workers get fractional CPUs (4 workers run on 2 cores) and talk over gloo; on GPUs each
worker gets one GPU and NCCL (`resolve` decided which, from the cluster's resources).
"""

from __future__ import annotations

from parity.errors import TrainingFailed
from parity.training.cluster import ensure_ray
from parity.training.config import RunConfig


def launch(cfg: RunConfig, worker, payload: dict) -> float:
    """Run `worker` (the training loop, or the layer check's recorded step) on cfg.num_workers Ray Train
    workers; it receives {"cfg": cfg as a dict, **payload}. Returns Ray start-up seconds (0 when Ray was
    already up); raises TrainingFailed with the worker's error line."""
    from ray.train import FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray_start_s = ensure_ray()
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_cuda else {})}
    trainer = TorchTrainer(
        worker,
        train_loop_config={"cfg": cfg.to_dict(), **payload},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_cuda,
                                     resources_per_worker=resources),
        run_config=RayRunConfig(storage_path=cfg.storage_path, name=cfg.experiment_name,
                                failure_config=FailureConfig(max_failures=0)),
        torch_config=TorchConfig(backend="nccl" if cfg.use_cuda else "gloo"),
    )
    try:
        trainer.fit()
    except Exception as exc:  # Ray wraps the worker's exception; keep its last line for the user
        raise TrainingFailed(_root_cause(exc)) from exc
    return ray_start_s


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
