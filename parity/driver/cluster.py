"""The Ray cluster a run uses: join RAY_ADDRESS's or start a local one, and what it offers (CPUs, GPUs,
nodes).

The device is decided from what the cluster has, not the driver: on a cluster (Anyscale) the driver
often runs on a CPU-only head node. Without RAY_ADDRESS and before Ray is started, the cluster is this
machine, so the configuration can be resolved (and bad input rejected) before Ray starts. A cluster
that was joined may grow (an autoscaler adds the GPU nodes a run asks for); one started here cannot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass

from parity.errors import ConfigError
from parity.ray_session import ray_is_up


@dataclass(frozen=True)
class Cluster:
    cpus: float
    gpus: int
    nodes: int = 1  # alive nodes: with more than one, workers may run where the driver's files are not
    joined: bool = False  # a cluster someone else runs (RAY_ADDRESS, a Ray job): it may still grow


def probe_cluster() -> Cluster:
    """The running or addressed Ray cluster's resources; this machine's when no cluster is up yet."""
    import ray

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        ensure_ray()
        resources = ray.cluster_resources()
        return Cluster(cpus=float(resources.get("CPU", 1)), gpus=int(resources.get("GPU", 0)),
                       nodes=sum(1 for node in ray.nodes() if node["Alive"]), joined=joins_a_cluster())
    import torch

    return Cluster(cpus=float(len(os.sched_getaffinity(0))), gpus=torch.cuda.device_count())


def joins_a_cluster() -> bool:
    """True when Ray is (to be) joined rather than started here: RAY_ADDRESS is set, or this is a Ray job."""
    return bool(os.environ.get("RAY_ADDRESS")) or "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


@contextlib.contextmanager
def ray_for_this_command():
    """A Ray started within the block (ensure_ray) is shut down at its end. A command enters this inside its
    terminal block: the workers' last lines (Ray Train's checkpoint and report chatter) reach the driver after
    the run has ended, and once the terminal block is left they would print on the user's terminal instead of
    the log. A Ray that was up when the block began (the caller's session, a test's) is left running."""
    up = ray_is_up()
    try:
        yield
    finally:
        if not up and ray_is_up():
            sys.modules["ray"].shutdown()


def ensure_ray() -> float:
    """Start or join Ray once per process; returns the seconds it took (0 when already up)."""
    import ray

    if ray.is_initialized():
        return 0.0
    # Ray Train V2 copies worker prints into its own log as well, so every line would appear twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    t0 = time.perf_counter()
    address = os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        _check_reachable(address)
        # Something answered; if it is not a Ray cluster, give up in ~10 attempts (about 10 s) rather than
        # Ray's 20 to 120; a user who sets the variable keeps their own budget.
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "10")
    try:
        if not joins_a_cluster():
            # Set before the cluster starts: its processes (Ray Train's controller among them) inherit them.
            # Ray Train's controller handles the workers' reports once per health check (every 2 s): a report
            # with a checkpoint waits for it, and the run's end is seen up to 2 s late, seconds of a short run
            # (a 12-step run took 22 s, 13 s at 0.2 s). A poll of a few local workers costs little.
            os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
            # Its preemption watcher is one more actor process per worker group, polling for nodes being drained;
            # this machine is the whole cluster and nothing drains it.
            os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
            # Our own local cluster: "local" starts a new one even when another Ray runs on this machine
            # (a bare ray.init() would join that one and wait for its resources).
            ray.init(address="local", include_dashboard=False, log_to_driver=True,
                     runtime_env={"worker_process_setup_hook": "parity.driver.cluster.set_up_worker"})
        else:  # a cluster someone else runs; a Ray Job (Anyscale) brings its own runtime env (working_dir)
            ray.init(address=address, log_to_driver=True)
    except ConnectionError as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address} ({str(exc).strip().splitlines()[-1]}): "
                          f"start it, or unset RAY_ADDRESS to run on a local one") from None
    return time.perf_counter() - t0


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, with one line, when nothing answers at RAY_ADDRESS: ray.init would retry the cluster's
    GCS for minutes without a word. "auto" is looked up the way Ray does (the address file of the cluster
    started on this machine); a form this does not know is left to Ray."""
    import socket

    target = address
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address(address) or ""
        except Exception:  # no cluster recorded on this machine, or Ray's private helper moved: Ray will say
            return
    host, _, port = target.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address} ({host}:{port}: "
                          f"{exc.strerror or type(exc).__name__}): start it, or unset RAY_ADDRESS to run on a "
                          f"local one") from None


def set_up_worker() -> None:
    """Runs in every worker process of a local cluster (runtime_env worker_process_setup_hook), before it imports what
    it runs: fewer garbage collections while it imports (parity/gc_thresholds.py; the training loop sets the usual
    thresholds back before its first step), and Ray Train's logs quieted."""
    from parity.gc_thresholds import fewer_collections

    fewer_collections()
    quiet_ray_train_logs()


def quiet_ray_train_logs() -> None:
    """In every worker process of a local cluster (set_up_worker).

    Ray Train's placement-group cleaner asks the state API for the cluster's address "auto": with other Ray
    instances on the machine that lookup raises "Found multiple active Ray instances" and the cleaner's thread
    dies with a 20-line traceback, so the address is made explicit. Without Ray's dashboard (ray[train] does not
    install it: ray[default] does) the state API is absent and the cleaner warns about that once a second for the
    whole run — half the lines of a short run's log; it still works (it falls back to retrying). Ray offers no
    setting for this one logger (LoggingConfig's level would silence every Ray warning in the log), so its level
    is raised by name."""
    import ray

    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)
