"""torchtitan's own entry point on a CPU with gloo, for the tests: torchtitan 0.3.0 has no CPU path, so `install()`
makes the changes below, each the moment the torchtitan module it concerns is first imported, and the job then runs
exactly as `-m torchtitan.train` runs it, with the same arguments (`--module M --config C` and overrides). None of it
is in the recorder: on GPUs the job runs as its users run it (docs/torchtitan.md). Two ways in:

- `torchrun … -m torchtitan.train …` as a user types it, with tests/titan_site first on PYTHONPATH: its
  sitecustomize.py calls install() in every process (parity's own sitecustomize runs the one it shadows);
- `python titan_cpu.py JOBS.json`: several jobs (`run_jobs`), the ranks of each world size forked once from this one
  process, which imported torch, torchtitan and the recorder once — a torchrun's ranks import them each, about 5
  CPU-seconds a rank, more than a debug job trains — and running that size's jobs one after another (DTensor's
  sharding rules, found once a process, serve the later jobs too), each in a process group of its own, recorded into
  its own folder (the recorder reads verify_trainer.py's variables when each Trainer starts), with its own seeded bug.

Each change, and why it is needed:
- `device_type` "cpu" and a device-module proxy: torchtitan picks its device once, when tools/utils.py is imported
  (`_get_available_device_type() or "cuda"`), so on a machine without an accelerator it asks for CUDA, and calls the
  device module's set_device, synchronize, memory statistics and properties; the proxy answers with torch.cpu's
  functions where it has them and neutral values elsewhere. The backend follows the device: gloo.
- `parallelism.spmd_backend partial_dtensor` where the command gives none: under the default spmd_types backend
  torchtitan always calls fully_shard with `dp_mesh_dims` (even at an FSDP degree of 1, for its mixed-precision
  policy), and torch 2.13's fully_shard then wants every parameter a DTensor on the full SPMD mesh, which that backend
  does not make them: every job stops at set-up ("When dp_mesh_dims is provided, all parameters must be DTensors on
  the full SPMD mesh", measured at FSDP 2 and TP 2). partial_dtensor makes the model-parallel axes DTensors and
  leaves FSDP to fully_shard over its own mesh.
- SDPA in place of FlexAttention: FlexAttention has no CPU backward in torch 2.13 (it compiles with Triton, a GPU
  compiler). SDPA is causal over the whole row with torchtitan's per-document RoPE positions; the recorder reads the
  attention the job was built with and records its rows so (documents attend to each other), and the replay feeds them
  so.
- sum reduction forced in FSDP2 (`set_force_sum_reduction_for_comms(True)`): torchtitan turns FSDP's gradient division
  off (it divides by the global token count itself), which FSDP2 carries out as a reduce-scatter with ReduceOp
  PREMUL_SUM; gloo has no PREMUL_SUM. A divide factor of 1 makes the sum the same reduction.
- `torch.distributed.set_timeout` as a no-op: torchtitan calls it after the first step to shorten the groups'
  timeouts; torch 2.13 has no such function (torchtitan 0.3.0 expects a newer torch).

TITAN_BUG (a job's "bug") seeds one bug into this copy (tests/test_torchtitan.py), never into the recorder:
- `tp_norm`: layers.0.ffn_norm computed on each TP rank's local sequence shard with its local weight, so its weight's
  gradient is that rank's partial sum, never reduced over TP (a sequence-parallel plan that misses the norm);
- `local_tokens`: the loss normalised by the rank's own tokens instead of the global batch's;
- `fsdp_average`: FSDP2's gradient division left on (an average over the FSDP ranks) on top of torchtitan's division
  by the global batch's tokens: the gradients averaged twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time

BUG = "TITAN_BUG"
PORT_FILE = "master_port"  # a job's MASTER_PORT, written by its rank 0 (_job_port)
BUGS = ("tp_norm", "local_tokens", "fsdp_average")
# What every job's ranks import beyond torchtitan's entry point: the debug model's module, the recorder, its
# torchtitan layout and the transformers model that layout maps onto (about 5 CPU-seconds a rank where each imports
# them).
PRELOAD = ("torchtitan.train", "torchtitan.models.llama3", "parity.frameworks.torchtitan.recording",
           "parity.frameworks.torchtitan.view", "parity.recording.recorder", "parity.models.model",
           "transformers.models.llama.modeling_llama")


class DeviceModule:
    """torch.cpu where it has the call; elsewhere a function that does nothing and returns a neutral value."""

    NEUTRAL = {"device_count": 1, "current_device": 0, "get_device_name": "cpu", "memory_stats": {},
               "max_memory_allocated": 0, "max_memory_reserved": 0, "memory_allocated": 0, "memory_reserved": 0}

    def __getattr__(self, name):
        import torch

        if name in self.NEUTRAL:
            return lambda *a, **k: self.NEUTRAL[name]
        if name == "get_device_properties":
            return lambda *a, **k: _Properties()
        if name == "mem_get_info":
            return lambda *a, **k: (1 << 34, 1 << 34)
        return getattr(torch.cpu, name, lambda *a, **k: None)


class _Properties:
    name, total_memory = "cpu", 1 << 34


def install() -> None:
    """The CPU changes, each when its module is first imported (now, where it already is)."""
    from parity.attaching.import_hook import when_imported

    when_imported("torchtitan.tools.utils", cpu_device)
    when_imported("torchtitan.distributed.fsdp", sum_reduction)
    when_imported("torchtitan.config.manager", config_changes)


def cpu_device(utils) -> None:
    """The device every module reads from tools/utils.py (imported after it), and set_timeout."""
    import torch.distributed as dist

    utils.device_type, utils.device_module = "cpu", DeviceModule()
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None


def sum_reduction(fsdp) -> None:
    """FSDP2's division off, as torchtitan's own function does, and its reduction a sum (under `fsdp_average`, the
    division left on)."""
    from torch.distributed.fsdp import FSDPModule

    def division_off(model) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                if os.environ.get(BUG) != "fsdp_average":
                    module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = division_off


def config_changes(manager) -> None:
    """SDPA for FlexAttention and varlen, and the partial_dtensor backend where the command names none."""
    parse = manager.ConfigManager.parse_args

    def parse_args(self, args=None):
        config = parse(self, args)
        given = sys.argv[1:] if args is None else args
        sdpa_attention(config)
        if not any(a.split("=", 1)[0] == "--parallelism.spmd_backend" for a in given):
            config.parallelism.spmd_backend = "partial_dtensor"
        return config

    manager.ConfigManager.parse_args = parse_args


def sdpa_attention(config) -> None:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    for layer in getattr(config.model_spec.model, "layers", []):
        if isinstance(layer.attention.inner_attention, (FlexAttention.Config, VarlenAttention.Config)):
            layer.attention.inner_attention = ScaledDotProductAttention.Config()


@contextlib.contextmanager
def seeded_bug(bug: str | None):
    """`bug` (BUGS) seeded into this process's torchtitan while the block runs (fsdp_average acts through
    sum_reduction, by the variable)."""
    import torch
    import torchtitan.trainer as trainer

    if bug not in (None, "", *BUGS):
        raise SystemExit(f"{BUG}={bug}: not a seeded bug of this launcher")
    saved = {"dist_utils": trainer.dist_utils, "__init__": trainer.Trainer.__init__}
    if bug == "local_tokens":
        class Local:  # dist_utils as the trainer sees it, its global token sum the rank's own
            def __getattr__(self, name):
                utils = saved["dist_utils"]
                return (lambda tokens, mesh: tokens) if name == "dist_sum_tensor" else getattr(utils, name)

        trainer.dist_utils = Local()
    elif bug == "tp_norm":
        from torch.distributed.tensor import DTensor

        def __init__(self, config):
            saved["__init__"](self, config)
            norm = self.model_parts[0].layers["0"].ffn_norm
            plain = type(norm).forward

            def local(x):
                if not isinstance(x, DTensor):
                    return plain(norm, x)
                out = torch.nn.functional.rms_norm(x.to_local(), (x.shape[-1],), norm.weight.to_local(), norm.eps)
                return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)

            norm.forward = local

        trainer.Trainer.__init__ = __init__
    try:
        yield
    finally:
        trainer.dist_utils, trainer.Trainer.__init__ = saved["dist_utils"], saved["__init__"]


def run_jobs(jobs: list[dict]) -> dict[str, list[int | None]]:
    """Each job — {"name", "ranks", "args" (torchtitan's), "folder" (its record's and its ranks' logs), "record"
    (the record's name), "bug" (optional)} — in order within its world size: the ranks of a world size forked once
    from this process, each running that size's jobs one after another, each job in a process group of its own.
    Returns each job's ranks' exit statuses (what `torchtitan.train`'s process would have exited with; None: the rank
    never finished it)."""
    import importlib
    import multiprocessing

    install()
    for module in PRELOAD:  # imported once, here: every rank forked from this process has them
        importlib.import_module(module)
    context = multiprocessing.get_context("fork")
    sizes = {}
    for job in jobs:
        os.makedirs(job["folder"], exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # an earlier run's
            os.remove(os.path.join(job["folder"], PORT_FILE))
        sizes.setdefault(job["ranks"], []).append(job)
    for world, group in sizes.items():
        ranks = [context.Process(target=_rank, args=(group, world, rank)) for rank in range(world)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=900)
            if process.exitcode is None:  # a rank left waiting on one that failed
                process.kill()
                process.join()
    return {job["name"]: [_status(job, rank) for rank in range(job["ranks"])] for job in jobs}


def _job_port(job: dict, rank: int) -> int:
    """The job's MASTER_PORT: rank 0 takes a free one as the job starts and hands it to the others through the job's
    folder. Taken for every job up front, a later job's port was often another process's by its turn (EADDRINUSE:
    the suite's other test process forms groups of its own meanwhile)."""
    path = os.path.join(job["folder"], PORT_FILE)
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(path + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(path + ".tmp", path)
        return port
    deadline = time.monotonic() + 600
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(open(path).read())


def _status(job: dict, rank: int) -> int | None:
    path = os.path.join(job["folder"], f"rank{rank}.status")
    return int(open(path).read()) if os.path.exists(path) else None


def _rank(jobs: list[dict], world: int, rank: int) -> None:
    """One rank of every job in `jobs` (one world size), as torchrun would start it (its variables, OMP_NUM_THREADS
    1), each job's output in its own log and its exit status in its own file."""
    import torch
    import torchtitan.trainer as trainer

    from parity.attaching import attach

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    trainer.time = _NoClosingSleep()
    for job in jobs:
        os.environ.update({"MASTER_PORT": str(_job_port(job, rank)), attach.RECORD_DIR: job["folder"],
                           attach.RECORD_NAME: job["record"], BUG: job.get("bug") or ""})
        sys.stdout.flush(), sys.stderr.flush()
        log = os.open(os.path.join(job["folder"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for fd in (1, 2):
            os.dup2(log, fd)
        os.close(log)
        with seeded_bug(job.get("bug")):
            status = _train(job["args"])
        with open(os.path.join(job["folder"], f"rank{rank}.status"), "w") as f:
            f.write(str(status))


def _train(args: list[str]) -> int:
    """torchtitan's entry point on `args`: the status its process would exit with; its process group ended."""
    import traceback

    import torch.distributed as dist
    import torchtitan.train as train

    sys.argv = ["torchtitan.train", *args]
    try:
        train.main()
        return 0
    except SystemExit as exc:  # a refusal: torchtitan's own (its config), or the recorder's
        return exc.code if isinstance(exc.code, int) else 1
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        if dist.is_initialized():
            dist.destroy_process_group()


class _NoClosingSleep:
    """The time module as torchtitan's trainer reads it, but for the 2 s rank 0 sleeps after the last step ("for
    other ranks to complete"): the runner waits for every rank itself."""

    def __getattr__(self, name):
        import time

        return (lambda seconds: None) if name == "sleep" else getattr(time, name)


if __name__ == "__main__":
    jobs_file = sys.argv[1]
    with open(jobs_file) as f:
        done = run_jobs(json.load(f))
    statuses = jobs_file.removesuffix(".json") + "_statuses.json"
    with open(statuses + ".tmp", "w") as f:
        json.dump(done, f)
    os.replace(statuses + ".tmp", statuses)
