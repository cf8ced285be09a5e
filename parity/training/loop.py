"""The training loop, written once. Runs on every Ray Train worker; the strategy is the only variable.

[1] model built from the config, the shared initial weights loaded on every rank before wrapping
[2] the strategy wraps it and builds the optimizer
[3] under Ray Train: resume from the run's latest checkpoint when it has one (parity/training/checkpoints.py)
[4] each step: the global batch of that step, this DP rank's slice, one train step
[5] rank 0 records loss, grad norm, lr, tokens, batch hash, time, memory (fp16: whether an overflow skipped the step,
    and the loss scale; a mixture of experts: its load-balancing loss and expert loads) through the step observer
    (parity/training/observer.py, which any training loop can feed); rewrites the JSON every log_interval; under Ray
    Train a checkpoint every checkpoint_interval and at the end, reported with that step's metrics; with
    --report_to, rank 0 logs each step's record entry to the experiment trackers (parity/tracking)
[6] on the last step every rank counts the model states it holds as each gradient arrives in backward, after
    backward and after the step, and keeps the peak
[8] after a step, every --replica_check_interval, at every checkpoint and at the end: every tensor several ranks hold
    (the strategy's replicas) digested and compared across them (parity/training/replicas.py); the record holds it
[9] at step 0 and every checkpoint step: the teacher-forced check (parity/training/teacher_forced.py): the strategy's
    next update against a reference step from its own state; the record's step holds the measurements
[7] at the end: full parameters gathered, a Hugging Face-format checkpoint, and the final model's loss on
    the last batch (which that checkpoint must reproduce)
[10] a replay of a recorded run (train_ddp.py --replay_record), once trained: the teacher-forced check from each state
    the run's recorder saved (parity/training/recorded_states.py), on rank 0 while the others wait
A failure every rank meets at once (a write that fails, a loss that is not finite) stops all ranks together
(RunStopped); the Ray Train worker returns it rather than raising it, so Ray does not retry it.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from parity.console import marked
from parity.deepspeed_import import import_deepspeed
from parity.errors import COLLATERAL, RunStopped
from parity.fingerprint import fingerprint
from parity.gc_thresholds import usual_collections
from parity.objectives import describe as describe_objective
from parity.ray_session import ray_is_up
from parity.registry import load
from parity.tracking.trackers import RunTrackers, open_trackers
from parity.training.checkpoints import Checkpoints, RayTrainSession, run_dir
from parity.run_config import RunConfig
from parity.training.data import dp_slice
from parity.models.adapters import (adapters_path, add_adapters, load_adapters, save_adapters,
                                    save_lora_checkpoint)
from parity.models.model import (build_model, config_summary, load_init_weights, model_config_from_dict,
                                   save_hf_checkpoint, save_init_weights)
from parity.training.observer import (ModelStateProbe, StepObserver, device_name, reset_peak_memory,
                                      worker_nodes)
from parity.training.record import LossRecord, run_record_path
from parity.training.recorded_states import check_recorded
from parity.training.strategy import WorkerContext, loss_sum, lr_at
from parity.training.sub_world import ranks_for
from parity.training.teacher_forced import KEY as TEACHER_FORCED, TeacherForcedCheck
from parity.training.tensor_norms import AFTER_BACKWARD, AT_CLIP, PRE_CLIP


@dataclass
class Worker:
    """A worker ready to run: where it sits, its model set up by its strategy, from the shared weights."""

    cfg: RunConfig
    ctx: WorkerContext
    log: Callable[[str], None]
    model_config: Any
    strategy: Any
    weights_sha: str
    num_params: int  # Ψ: the model's parameters, each once (a tied weight once)
    setup_s: float  # building the model, loading the weights, the strategy's setup
    began_at: float  # when its setup began (time.time(), comparable across processes: the main job's time table)
    trackers: RunTrackers = field(default_factory=RunTrackers)  # rank 0's, once train() opens them


def start_worker(payload: dict, resuming: bool = False) -> Worker:
    """What every worker does first, training or recording one step: [1] the model from the shared initial
    weights, [2] wrapped by the strategy (the class at the run's strategy_path). A run `resuming` from a checkpoint
    does not write the weights again, even with --save_init_weights: its checkpoint, and every run started from the
    file, name the file it wrote first (torch.save writes a new serialization id each time: the same weights, another
    sha256). The process group (gloo or NCCL) is already up."""
    t0, began_at = time.perf_counter(), time.time()
    cfg = RunConfig.from_dict(payload["cfg"])
    ctx = worker_context(cfg)
    log = rank0_logger(cfg, ctx, payload.get("terminal", False))
    model_config = model_config_from_dict(cfg.model_config)
    model, weights_sha = prepare_model(cfg, model_config, ctx, log,  # [1]
                                       write=cfg.save_init_weights and not resuming)
    num_params = sum(p.numel() for p in model.parameters())
    strategy = load(cfg.strategy_path)(cfg, ctx)
    strategy.setup(model)  # [2]
    return Worker(cfg, ctx, log, model_config, strategy, weights_sha, num_params, time.perf_counter() - t0, began_at)


@contextlib.contextmanager
def torch_functions_kept():
    """torch's functions as they were before a run, after it: DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear by
    its memory-efficient linear for the life of the process ("This will persist unless manually reset"), and a later
    run in the same worker — FSDP2 after ZeRO-3 in one group: the benchmark's, the main job's, the layer check's —
    computed its every linear layer with DeepSpeed's kernels (other last bits: a pipeline's bf16 grad norm 1.7103 after
    a ZeRO-3 run in its group, 1.7096 alone)."""
    linear = torch.nn.functional.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = linear


def train_group_worker(payload: dict) -> dict | None:
    """Ray Train's train_loop_per_worker: the runs of payload["runs"] (each {"cfg", "batches", "title"}) one after
    another in this worker group — Ray starts the workers once, not once per run — each run with its own model,
    strategy, record and checkpoints, a run of fewer workers than the group on its first ranks (sub_world.py). With payload["checkpoints"] (the default)
    every run checkpoints and resumes through Ray Train: a run is its group's only one (its folder is the
    group's) or its checkpoints go under "<experiment_name>/" in the group's folder; after a worker failure
    the restarted group passes over the runs already finished and resumes the one that was training. Returns
    {"stopped": line} when every rank of a run stopped on the same failure (the later runs do not start)."""
    runs, to_terminal = payload["runs"], payload.get("terminal", False)
    shared = len(runs) > 1
    usual_collections()  # a Ray worker's imports are done (parity.driver.cluster.set_up_worker)
    gc.freeze()  # what the worker imported so far, out of the collections' walks (a local rank's forkserver did it)
    try:
        for i, run in enumerate(runs):
            cfg = RunConfig.from_dict(run["cfg"])
            try:
                session = None
                if payload.get("checkpoints", True):
                    session = RayTrainSession(run_dir(cfg), f"{cfg.experiment_name}/" if shared else "", cfg.resume)
                    if shared and finished(cfg):
                        continue
                if shared and dist.get_rank() == 0:
                    line = f"== [{i + 1}/{len(runs)}] {run['title']}"
                    print(marked(line) if to_terminal else line, flush=True)
                with ranks_for(cfg.num_workers) as part:  # a run of fewer workers: the group's first ranks
                    if part.trains:
                        try:
                            train_one(run, session, to_terminal)
                        except RunStopped as exc:
                            part.stopped = str(exc)
                if part.stopped:
                    return {"stopped": part.stopped}
            except Exception as exc:  # the user sees it now, before Ray Train restarts the group or gives up
                report_failure(exc, to_terminal)
                raise
            gc.collect()  # the run's cycles (its model, its engine) freed before the next run allocates its own
            gc.freeze()  # what is left is the process's — the libraries the run imported (DeepSpeed, a model
            # family's modules: 240 000 objects, 0.15 s a collection) — out of the next runs' walks; a cycle among
            # them that dies later waits for the group's end
    finally:  # frozen at the process's exit, triton's bindings print "nanobind: leaked …" (rank_preload.py)
        gc.unfreeze()
    return None


def train_one(run: dict, session: RayTrainSession | None, to_terminal: bool) -> None:
    """One run of a group, on the ranks that train it: from its checkpoint when Ray Train holds one."""
    resuming = session.resuming() if session else False
    with torch_functions_kept():
        worker = start_worker({"terminal": to_terminal, **run}, resuming=resuming)
        try:
            train(worker, run["batches"], session)
            check_recorded(worker, run["batches"])  # [10] a recorded run's replay: the states it saved
        finally:
            worker.trackers.close()  # a run that stopped: its tracker runs end as failed


def finished(cfg: RunConfig) -> bool:
    """Whether a run of a shared group finished before a worker failure restarted the group: its final model is
    whole (the loop writes it before the record's last rewrite). The same answer on every rank (rank 0's)."""
    from parity import storage

    answer = [storage.exists(storage.join(cfg.final_checkpoint_dir, storage.COMPLETE_MARKER))
              if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(answer, src=0)
    return bool(answer[0])


def report_failure(exc: Exception, to_terminal: bool) -> None:
    """A rank's own error, one line on the user's terminal (not when it only lost a rank that failed first)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    if any(c in str(exc) for c in COLLATERAL):
        return
    rank = dist.get_rank() if dist.is_initialized() else "?"
    line = f"rank {rank} failed: {type(exc).__name__}: {text}"
    print(marked(line) if to_terminal else line, flush=True)


def train(w: Worker, batches, session: RayTrainSession | None = None) -> None:
    """The loop, on every rank of the run's process group: Ray Train's (with its `session`: metrics reports,
    checkpoints, resume), or a test's local gloo group (without)."""
    cfg, ctx, log, strategy = w.cfg, w.ctx, w.log, w.strategy
    total_steps = cfg.debug_steps or cfg.num_epochs * batches.steps_per_epoch
    memory_metric = reset_peak_memory(ctx.device)
    record = LossRecord(run_record_path(cfg), cfg.strategy,
                        run_description(cfg, ctx, w.model_config, w.weights_sha, batches, total_steps, memory_metric,
                                        worker_nodes(ctx.device)))
    log(f"training {total_steps} steps: {batches.dataset.describe()}, global batch {cfg.global_batch_size} × "
        f"{cfg.seq_length} tokens, tp={cfg.tp_size} dp={cfg.dp_size}, {cfg.precision} on {ctx.device.type}")
    observer = StepObserver(record, device=ctx.device, replicas=strategy,  # what [5], [6] and [8] go through
                            replica_check_interval=cfg.replica_check_interval, total_steps=total_steps,
                            probe=ModelStateProbe.of_strategy(strategy, w.num_params, ctx.dp_size), log=log,
                            tensor_names=strategy.tensor_names(), tensor_grad=cfg.tensor_grad or PRE_CLIP,
                            tensors_why=f"{cfg.strategy} does not hand over its tensors' pieces (Strategy.tensor_names)",
                            tensors_read_at=AT_CLIP if strategy.reads_at_clip else AFTER_BACKWARD,
                            tensors_norm_dtype=strategy.clip_norm_dtype)
    checkpoints = Checkpoints(w, session, record, total_steps) if session else None
    start = checkpoints.resume() if checkpoints else 0  # [3]
    w.trackers = observer.trackers = open_trackers(cfg, ctx, record, start, log, checkpoints is not None)
    if start:
        observer.write()  # the record of the run resumed, not of the attempt that failed

    started, checkpoint_s = time.perf_counter(), 0.0
    teacher = TeacherForcedCheck(w, total_steps)  # [9]
    teacher.resumed(start, record)
    for step in range(start, total_steps):  # [4]
        global_batch = batches(step)
        lr = lr_at(step, cfg)
        teacher.before(step, global_batch)  # [9] at a checked step: the state, and rank 0's reference step
        t0 = time.perf_counter()
        probe = observer.probe_at(step)  # [6] on the last step
        stats = strategy.train_step(dp_slice(global_batch, ctx.dp_rank, cfg.batch_size), global_batch.divisor, lr,
                                    probe)
        _synchronize(ctx.device)
        step_time = time.perf_counter() - t0 - (probe.seconds if probe is not None else 0.0)
        if not math.isfinite(stats.loss):  # the same on every rank: the loss is gathered
            observer.write()  # the steps before it, for the comparison (--allow_incomplete)
            raise RunStopped(f"loss is {stats.loss} at step {step}: lower --learning_rate or check the data")
        done = step + 1
        checkpoint = bool(checkpoints and checkpoints.due(done, total_steps))
        scaling = {"skipped": stats.skipped, "loss_scale": stats.loss_scale} if cfg.loss_scaling or cfg.loss_scales \
            else {}  # (loss_scales: a replay of an fp16 record, its fp32 twin too, follows its skips: FollowedScaler)
        scaling.update({} if stats.overflowed is None else {"overflowed": stats.overflowed})
        checked = teacher.after(step, stats.grad_norm, stats.skipped)  # [9]
        if checked is not None:
            scaling[TEACHER_FORCED] = checked
        observer.observe_step(step, batch=global_batch, loss=stats.loss, dp_rank_losses=stats.dp_rank_losses,  # [8] [5]
                              grad_norm=stats.grad_norm, param_norm=stats.param_norm, lr=lr, step_time_s=step_time,
                              harness_s=stats.harness_s, checkpoint=checkpoint, tensor_grad_norms=stats.tensor_grad_norms,
                              tensor_param_norms=stats.tensor_param_norms, clip_coef=stats.clip_coef,
                              update_noise=stats.update_noise, **scaling,
                              **(stats.routing or {}), **({"objective": stats.objective} if stats.objective else {}))
        if checkpoint:
            teacher.at_checkpoint(done, record)  # [9] the state the next check starts from, its digest in the record
            c0 = time.perf_counter()
            checkpoints.write(done, {"step": step, "loss": stats.loss, "grad_norm": stats.grad_norm,
                                     "param_norm": stats.param_norm, "lr": lr, "step_time_s": step_time})
            checkpoint_s += time.perf_counter() - c0
        if done % cfg.log_interval == 0 or done == total_steps:
            stats.harness_s["record_write"] = observer.write()
            elapsed = time.perf_counter() - started
            per_step = elapsed / (done - start)
            log(f"step {done}/{total_steps} ({100 * done // total_steps}%) loss {stats.loss:.6f} "
                f"grad_norm {stats.grad_norm:.4f} lr {lr:.3g} | {1 / per_step:.1f} steps/s, "
                f"{per_step * (total_steps - done):.0f} s left")

    steps_s = time.perf_counter() - started - checkpoint_s - teacher.seconds
    finishing = time.perf_counter()
    model_state = observer.report_model_state()  # [6]
    last_batch = batches(total_steps - 1)
    final_loss = evaluate(strategy, dp_slice(last_batch, ctx.dp_rank, cfg.batch_size), last_batch.loss_tokens)  # [7]
    params = {**strategy.full_parameters(), **strategy.full_buffers()}

    def final() -> dict:  # rank 0's, once it has written the final model
        timings = {"setup_s": w.setup_s, "steps_s": steps_s, "steps": total_steps - start,
                   "checkpoints_s": checkpoint_s, "teacher_forced_s": teacher.seconds,
                   "teacher_forced_checks": len(teacher.steps & set(range(start, total_steps))),
                   "finish_s": time.perf_counter() - finishing, "began_at": w.began_at, "ended_at": time.time()}
        return {"eval_loss_last_batch": final_loss, "eval_batch_step": total_steps - 1,
                "checkpoint_dir": cfg.final_checkpoint_dir, "train_time_s": time.perf_counter() - started,
                "model_state": model_state, "timings": timings}

    def write_model() -> None:
        # transformers' save_pretrained imports DeepSpeed (accelerate's unwrap_model): imported first as a DeepSpeed
        # run imports it, for this worker's device and without its autotuner's mlflow (2.0 s → 0.4 s here), where it
        # is installed (transformers imports it only there: the GPU image has none)
        with contextlib.suppress(ImportError):
            import_deepspeed(ctx.device)
        if cfg.lora is None:
            save_hf_checkpoint(params, w.model_config, cfg.final_checkpoint_dir)
        else:
            save_lora_checkpoint(params, w.model_config, cfg.lora, cfg.final_checkpoint_dir)

    observer.finish(final, before=write_model,
                    what=f"the final model {cfg.final_checkpoint_dir} or the loss record {record.path}")
    log(f"done: loss record {record.path}, final model {cfg.final_checkpoint_dir}")


def worker_context(cfg: RunConfig) -> WorkerContext:
    """This process's place in the run, read from the process group (Ray Train's, or a local one)."""
    if cfg.cpus_per_worker:
        # Workers share the cores: one intra-op thread per whole CPU granted, never more than the grant.
        torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    if cfg.use_cuda and ray_is_up():
        import ray.train.torch

        device = ray.train.torch.get_device()  # the GPU Ray Train gave this worker
    elif cfg.use_cuda:  # a local group's rank (parity.driver.local_group), which set its GPU
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    assert dist.get_world_size() == cfg.num_workers, (dist.get_world_size(), cfg.layout)  # the group is the layout's
    return WorkerContext(rank=dist.get_rank(), device=device, layout=cfg.layout)


def prepare_model(cfg: RunConfig, model_config, ctx: WorkerContext, log, write: bool):
    """Every rank loads the same file; when it is to `write` it (--save_init_weights), rank 0 writes it first. With
    LoRA (--lora_r) the adapters are added to the loaded base and take their initial weights from their own file beside
    it, written alike (parity/models/adapters.py); the sha256 is then the base's and the adapters' together."""
    model = build_model(model_config, cfg.seed)
    if write and ctx.is_logging_rank:
        sha = save_init_weights(model, cfg.init_weights_path)
        log(f"Saved initial weights to {cfg.init_weights_path} (sha256 {sha})", terminal=False)
    if write:
        dist.barrier()
    sha = load_init_weights(model, cfg.init_weights_path)
    log(f"Loaded initial weights from {cfg.init_weights_path} (sha256 {sha})", terminal=False)
    if cfg.lora is None:
        return model, sha
    model = add_adapters(model, cfg.lora)
    path = adapters_path(cfg.init_weights_path)
    if write and ctx.is_logging_rank:
        save_adapters(model, cfg.lora, sha, path)
    if write:
        dist.barrier()
    adapters_sha = load_adapters(model, path, cfg.lora)
    log(f"Loaded the LoRA adapters' initial weights from {path} (sha256 {adapters_sha})", terminal=False)
    return model, f"{sha}+{adapters_sha}"


@torch.no_grad()
def evaluate(strategy, batch, global_tokens: int) -> float:
    """The current model's mean token loss over a global batch (each DP rank its slice `batch`), without
    training. Eager also under --compile, as the stock model that loads the final checkpoint computes it (a compiled
    module would compile its whole forward once more for this one call without gradients). A recorded run's fed rows
    each alone, as it fed them (data.Batch.fed)."""
    batch = batch.to(strategy.ctx.device)
    with strategy.autocast(), torch.compiler.set_stance("force_eager"):
        summed = sum(loss_sum(strategy.logits_of(part), part.labels).double()
                     for part in (batch.split(1) if batch.fed is not None else [batch]))
    sums, _ = strategy.gather_dp_sums(summed, batch.loss_tokens)
    return sum(sums) / global_tokens


def run_description(cfg: RunConfig, ctx: WorkerContext, model_config, weights_sha: str, batches, total_steps,
                    memory_metric: str, nodes: list[str]):
    """The record's "config": every resolved flag plus what a comparison must know to trust the numbers.
    Its model_config is the summary that makes two models the same model, not the whole HF config."""
    return {**cfg.to_dict(), "world_size": ctx.world_size, "global_batch_size": cfg.global_batch_size,
            "worker_nodes": nodes,
            "total_steps": total_steps, "steps_per_epoch": batches.steps_per_epoch,
            "dataset_description": batches.dataset.describe(), "device_type": ctx.device.type,
            "backend": dist.get_backend(), "init_weights_sha256": weights_sha,
            "model_config": config_summary(model_config), "memory_metric": memory_metric,
            "device_name": device_name(ctx.device), "fingerprint": run_fingerprint(cfg, ctx)}


def run_fingerprint(cfg: RunConfig, ctx: WorkerContext) -> dict:
    """The fingerprint of this run's code, libraries and device (parity.fingerprint), as this worker runs it."""
    return fingerprint(load(cfg.strategy_path), ctx.device, cfg.model_config["model_type"],
                       None if cfg.objective is None else describe_objective(cfg.objective))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank0_logger(cfg: RunConfig, ctx: WorkerContext, to_terminal: bool):
    """Rank 0's lines. Under a quiet driver (`to_terminal`: parity.console.terminal) a line meant for the user
    is marked, so that the driver shows it while the rest of the workers' output stays in the log file; a
    line with terminal=False goes to the log only. One write per line, its newline in it: the trackers' thread logs
    too, and print's separate write of the newline let its line land after another's text."""
    def log(message: str, terminal: bool = True) -> None:
        if ctx.is_logging_rank:
            line = f"[{cfg.strategy}] {message}"
            print((marked(line) if to_terminal and terminal else line) + "\n", end="", flush=True)
    return log
