"""Ray Train launch: join RAY_ADDRESS's cluster or start a local one, pick the device, run the loop.

On CPU the workers get fractional CPUs (4 workers run on 2 cores) and talk over gloo; on GPUs each
worker gets one GPU and NCCL. The device is chosen from what the cluster has, not the driver, because
on a cluster (Anyscale) the driver often runs on a CPU-only head node.
"""

from __future__ import annotations

import os
import time

from parity.config import RunConfig
from parity.errors import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TrainingFailed(Exception):
    """A worker raised during training; the message is the worker's own error line."""


def ensure_ray() -> float:
    """Start or join Ray once per process; returns the seconds it took (0 when already up)."""
    import ray

    if ray.is_initialized():
        return 0.0
    # Ray Train V2 copies worker prints into its own log as well, so every line would appear twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    t0 = time.perf_counter()
    address = os.environ.get("RAY_ADDRESS") or None
    try:
        _init_ray(address)
    except ConnectionError as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address} ({str(exc).strip().splitlines()[-1]}): "
                          f"start it, or unset RAY_ADDRESS to run on a local one") from None
    return time.perf_counter() - t0


def _init_ray(address: str | None) -> None:
    import ray

    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ or (address and not _is_loopback(address)):
        # A Ray Job (Anyscale) or a remote cluster: the job's runtime env (working_dir) ships the code.
        ray.init(address=address, log_to_driver=True)
    else:
        # A cluster on this machine, ours or one run_verification_main.sh started: workers import the
        # strategy modules from this checkout.
        path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
        ray.init(address=address, include_dashboard=False if address is None else None, log_to_driver=True,
                 runtime_env={"env_vars": {"PYTHONPATH": path},
                              "worker_process_setup_hook": "parity.ray_setup.quiet_logs"})


def _is_loopback(address: str) -> bool:
    host = address.split("://")[-1].rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "::1")


def place_workers(cfg: RunConfig, resources: dict) -> None:
    """Resolve --device and --precision auto against the cluster, and the CPU share of each worker."""
    gpus = int(resources.get("GPU", 0))
    if cfg.device == "cuda" and gpus < cfg.num_workers:
        raise ConfigError(f"--device cuda needs {cfg.num_workers} GPUs (one per worker), the Ray cluster has "
                          f"{gpus}: use --device cpu or fewer workers")
    if cfg.device == "auto":
        cfg.device = "cuda" if gpus >= cfg.num_workers else "cpu"
    if cfg.precision == "auto":
        cfg.precision = "bf16" if cfg.device == "cuda" else "fp32"
    cfg.cpus_per_worker = min(1.0, float(resources.get("CPU", 1)) / cfg.num_workers)


def launch(cfg: RunConfig, worker=None, extra: dict | None = None) -> float:
    """Run `worker` (default: the training loop) on cfg.num_workers Ray Train workers; it receives
    {"cfg": the resolved cfg as a dict, **extra}. Returns Ray start-up seconds; raises TrainingFailed."""
    import ray
    from ray.train import FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from parity.loop import train_worker

    ray_start_s = ensure_ray()
    place_workers(cfg, ray.cluster_resources())
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_cuda else {})}
    trainer = TorchTrainer(
        worker or train_worker,
        train_loop_config={"cfg": cfg.to_dict(), **(extra or {})},
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
