"""Checkpoints through Ray Train, and resuming from them on the same curve.

Writing, every --checkpoint_interval steps and at the end, on every rank at once:
[1] each rank writes into a temporary directory of its own: the strategy's state in its native sharded
    form (Strategy.save_state), its RNG state, rank 0 also the checkpoint's meta (the step, the run's
    identity, the loss record so far), and last a manifest of its files (bytes and sha256);
[2] every rank hands its directory to ray.train.report, which copies it into one checkpoint directory,
    <storage_path>/<experiment_name>/step_<N>, and registers the checkpoint once every rank has reported;
    Ray Train keeps the last --keep_checkpoints.
[3] A rank whose copy into the storage fails tells the others (`agree`): every rank stops at the same
    point with the same line, the checkpoint is not registered (a partial copy is removed), the previous
    one stays the latest, and the run is not retried: the storage would refuse the same write again. (A
    failure in [1], in the system's temporary directory, is raised instead: it may come from a collective
    save on some ranks only, and a raise is what stops the others there.)

Resuming — after a worker failure Ray Train restarts the group; a run started again with --resume over the same
--storage_path and --experiment_name (without it the folder is replaced: prepare_run_folder) — from the latest
checkpoint:
[4] every rank checks it against the manifests (its own files by sha256, every file by size); a damaged
    checkpoint is skipped, with a line saying so, for the one before it;
[5] a checkpoint of another configuration is refused: it continues only the run that wrote it;
[7] so is one written by other code (the fingerprint's shared code, strategy code, libraries);
[6] the strategy loads its state, each rank its RNG state, every rank the loss record so far, and training
    continues at the checkpoint's step; the data is a function of the step, so the stream continues too.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

from parity import storage
from parity.errors import ConfigError, RunStopped
from parity.fingerprint import differences as fingerprint_differences
from parity.fingerprint import fingerprint, library_versions, shared_code_sha256, strategy_code
from parity.models.model import config_summary, file_sha256, model_config_from_dict
from parity.run_config import NOT_IDENTITY  # the fields a resume may change
from parity.training.sub_world import before_report

FORMAT = "parity-checkpoint/2"  # 2: the config's pp_size a layout field (not an option), the strategy's class path
META_FILE = "parity_checkpoint.json"
DIR_PREFIX = "step_"
AFTER_A_FAILED_WRITE = ("the run stopped; its previous checkpoint and the loss record up to it are kept: make room "
                        "(or make it writable) and run the same command again with --resume to continue")


def dir_name(step: int) -> str:
    """A checkpoint's directory, by the number of steps done (training resumes at that step); a step trained
    again after a damaged checkpoint of it was passed over gets a suffix (step_000012.1)."""
    return f"{DIR_PREFIX}{step:06d}"


def manifest_name(rank: int) -> str:
    return f"manifest_rank{rank}.json"


def rng_name(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def run_dir(cfg) -> str:
    """The run's folder, where Ray Train puts its checkpoints (a local path or a URI)."""
    return storage.join(cfg.storage_path, cfg.experiment_name)


def identity(cfg) -> dict:
    """What a checkpoint must share with the run that resumes from it: every setting that changes the numbers."""
    ident = {k: v for k, v in cfg.to_dict().items() if k not in NOT_IDENTITY}
    ident["model"] = config_summary(model_config_from_dict(cfg.model_config))
    return json.loads(json.dumps(ident))  # as it reads back from the checkpoint's JSON


def differences(stored: dict, current: dict) -> list[str]:
    """Each setting that differs, in words. The strategy's class path only where its name is the same (a user's class
    that moved): beside another strategy it says nothing the name does not."""
    shown = [k for k in sorted(stored.keys() | current.keys()) if stored.get(k) != current.get(k)]
    shown = [k for k in shown if not (k == "strategy_path" and "strategy" in shown)]
    return [f"{k} {stored.get(k)!r} there, {current.get(k)!r} here" for k in shown]


def replace_run_folder(cfg) -> str | None:
    """On the driver, before launch. Ray Train resumes a run from whatever its run folder holds, so a run folder
    is never reused silently: without --resume an existing folder is deleted — a finished or an unfinished run
    alike — and the line that says what was replaced is returned; with --resume it is kept for Ray Train to
    resume (check_resume, in resolve, made sure it can)."""
    folder = run_dir(cfg)
    if cfg.resume:
        path, meta = _newest(folder)
        return f"resuming {folder} from its checkpoint at step {meta['step']} of {meta['total_steps']}"
    if not storage.is_dir(folder):
        return None
    checkpoints = _newest(folder, missing=None)
    what = ("no checkpoint" if checkpoints is None else f"a finished run ({checkpoints[1]['step']} steps)"
            if _finished(checkpoints[1]) else
            f"an unfinished run (checkpoint at step {checkpoints[1]['step']}; --resume continues it)")
    storage.delete_dir(folder)
    return f"replaced {folder}: it held {what}; this run starts afresh"


def check_resume(cfg) -> None:
    """--resume, on the driver before anything starts: the run folder's newest intact checkpoint must continue
    this run ([5]: the same configuration, [7]: the same code) and not be the run's last step; else ConfigError.
    On a local folder a damaged checkpoint is passed over here as the workers will ([4]); on a remote store the
    workers check it."""
    folder = run_dir(cfg)
    path, meta = _newest(folder)
    diff = differences(meta["identity"], identity(cfg))
    if diff:
        raise ConfigError(f"--resume: {path} is a checkpoint of another run ({'; '.join(diff[:3])}): use the run's "
                          f"own flags, or drop --resume to start this one afresh")
    code = code_differences(meta.get("fingerprint", {}), driver_fingerprint(cfg))
    if code:
        raise ConfigError(f"--resume: {path} was written by other code ({'; '.join(code[:3])}): drop --resume to "
                          f"train afresh with this code")
    if _finished(meta):
        raise ConfigError(f"--resume: {folder} holds a finished run ({meta['step']} of {meta['total_steps']} steps): "
                          f"nothing to continue; drop --resume to train it again")


_NO_CHECKPOINT = object()


def _newest(folder: str, missing=_NO_CHECKPOINT):
    """(path, meta) of the run folder's newest intact checkpoint (whose meta reads, and whose files match their
    manifests where the folder is local); `missing` when there is none (ConfigError for --resume by default)."""
    damaged = None
    for path in reversed(storage.list_dirs(folder, DIR_PREFIX + "*")):
        meta = _read_meta(path)
        local = storage.local_path(path)
        problem = "its meta cannot be read" if meta is None else \
            damage(local, meta.get("world_size", 1), range(meta.get("world_size", 1))) if local else None
        if problem is None:
            return path, meta
        damaged = damaged or f"{path}: {problem}"
    if missing is _NO_CHECKPOINT:
        raise ConfigError(f"--resume: {folder} holds no intact checkpoint to continue"
                          + (f" ({damaged})" if damaged else "") + ": drop --resume to start the run afresh")
    return missing


def _read_meta(path: str) -> dict | None:
    try:
        meta = json.loads(storage.read_text(storage.join(path, META_FILE)))
        return meta if isinstance(meta, dict) and "identity" in meta and "step" in meta else None
    except (OSError, ValueError):
        return None


def _finished(meta: dict) -> bool:
    return meta["step"] >= meta.get("total_steps", float("inf"))


def driver_fingerprint(cfg) -> dict:
    """The code and library part of the fingerprint, as the driver sees it (the device is the workers')."""
    from parity.registry import load

    return {"shared_code_sha256": shared_code_sha256(),
            "strategy_code": strategy_code(load(cfg.strategy_path)),
            "versions": library_versions()}


def code_differences(stored: dict, current: dict) -> list[str]:
    """What makes a checkpoint another code's: the shared code, the strategy's code, the libraries."""
    return fingerprint_differences(stored, current, strategy=True)


def any_rank(problem: str | None) -> str | None:
    """Collective: the first rank's problem, or None when no rank has one; every rank gets the same answer."""
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def agree(problem: str | None) -> None:
    """Collective: when any rank met a problem, every rank raises RunStopped with the first one's line, so
    they stop at the same point instead of waiting for each other in a collective."""
    first = any_rank(problem)
    if first:
        raise RunStopped(first)


def write_problem(action, what: str, errors=(OSError,)) -> str | None:
    """Run `action`, which writes `what` (named with its path); the line to stop with if it raised one of
    `errors`, None if it wrote. Only for actions with no collective inside: a rank that fails must not
    leave the others waiting in one."""
    try:
        action()
    except errors as exc:
        errno = getattr(exc, "errno", None)  # pyarrow's errors carry it too, under a longer text
        reason = os.strerror(errno) if errno else str(exc).strip().splitlines()[-1]
        return f"cannot write {what} ({reason}): {AFTER_A_FAILED_WRITE}"
    return None


class RayTrainSession:
    """The Ray Train calls of one run's loop (a loop in a test's local process group runs without them). A worker
    group may train several runs one after another (launch_runs): each run's checkpoints are then reported
    under `prefix`, "<experiment_name>/", inside the group's folder, and only those are the run's. `folder` is
    the run's folder, <storage_path>/<experiment_name>: a --resume of a run Ray Train holds no record of (a
    run of a shared group, a folder copied elsewhere) finds its checkpoints there."""

    def __init__(self, folder: str, prefix: str = "", resume: bool = False):
        self.folder, self.prefix, self.resume = folder, prefix, resume

    def resuming(self) -> bool:
        """Whether Ray Train holds a checkpoint of this run (after a worker failure, or with --resume)."""
        return bool(self.checkpoints())

    def report(self, metrics: dict, directory: str, name: str) -> None:
        """Report a checkpoint's metrics with the checkpoint in `directory` (this rank's part) as `name`: Ray
        Train's own advice, a report at checkpoint frequency (every step is in the loss record and the log)."""
        import ray.train

        before_report()  # the group's ranks that wait while a run of fewer workers trains report with it
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                         checkpoint_dir_name=self.prefix + name)

    def checkpoints(self) -> list:
        """The run's registered checkpoints, the latest reported first, then by step, newest first; with --resume
        and none registered, the checkpoints in the run's folder, newest first."""
        import ray.train

        if ray.train.get_checkpoint() is None:
            return self._in_folder() if self.resume else []
        experiment = ray.train.get_context().get_storage().experiment_fs_path.rstrip("/") + "/"
        reported = [r for r in ray.train.get_all_reported_checkpoints(
            consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
            if r.checkpoint.path.startswith(experiment + self.prefix)
            and "/" not in r.checkpoint.path[len(experiment + self.prefix):].strip("/")]
        if not reported:
            return self._in_folder() if self.resume else []
        latest, older = reported[-1], reported[:-1]
        return [latest.checkpoint, *(r.checkpoint for r in sorted(older, key=lambda r: r.metrics.get("step", -1),
                                                                   reverse=True))]

    def _in_folder(self) -> list:
        import ray.train

        fs, _ = storage.filesystem(self.folder)
        paths = [storage.local_path(p) or p.split("://", 1)[-1].split("?")[0]
                 for p in reversed(storage.list_dirs(self.folder, DIR_PREFIX + "*"))]
        return [ray.train.Checkpoint(path, filesystem=fs) for path in paths]

    def remove_partial(self, name: str) -> None:
        """Delete what a failed report copied of a checkpoint Ray Train did not register."""
        import ray.train

        storage = ray.train.get_context().get_storage()
        try:
            storage.storage_filesystem.delete_dir(storage.build_checkpoint_path_from_name(self.prefix + name))
        except OSError:
            pass  # nothing was copied, or the storage refuses even this: the directory is not registered anyway


class Checkpoints:
    """One rank's view of its run's checkpoints: writing one, resuming from the newest intact one."""

    def __init__(self, worker, session, record, total_steps: int):
        self.cfg, self.ctx, self.log, self.strategy = worker.cfg, worker.ctx, worker.log, worker.strategy
        self.weights_sha, self.total_steps = worker.weights_sha, total_steps
        self.fingerprint = fingerprint(type(worker.strategy), worker.ctx.device, worker.model_config.model_type)
        self.session, self.record = session, record
        self.registered: set[str] = set()  # the run's checkpoint directories Ray Train holds (filled by resume)

    def due(self, done: int, total_steps: int) -> bool:
        interval = self.cfg.checkpoint_interval
        return done == total_steps or (interval > 0 and done % interval == 0)

    # --- writing ----------------------------------------------------------------------------------
    def write(self, done: int, metrics: dict) -> None:
        """[1]–[3]: this rank's part of the checkpoint after `done` steps, reported with `metrics`. Collective."""
        # A run that resumed past a damaged checkpoint trains its step again: the new one gets a name of its
        # own, or Ray Train, dropping the damaged one later, would delete the directory they share.
        name, again = dir_name(done), 0
        while name in self.registered:
            again += 1
            name = f"{dir_name(done)}.{again}"
        with tempfile.TemporaryDirectory(prefix=f"parity_checkpoint_rank{self.ctx.rank}_") as tmp:
            self._write_local(tmp, done)
            problem = write_problem(lambda: self.session.report(metrics, tmp, name),
                                    f"the checkpoint of step {done} to {os.path.join(run_dir(self.cfg), name)}")
            try:
                agree(problem)
            except RunStopped:
                if self.ctx.is_logging_rank:
                    self.session.remove_partial(name)
                raise

    def _write_local(self, directory: str, done: int) -> None:
        rank = self.ctx.rank
        self.strategy.save_state(directory)
        torch.save(rng_state(self.ctx.device), os.path.join(directory, rng_name(rank)))
        if self.ctx.is_logging_rank:
            meta = {"format": FORMAT, "step": done, "total_steps": self.total_steps, "strategy": self.cfg.strategy,
                    "world_size": self.ctx.world_size, "identity": identity(self.cfg),
                    "init_weights_sha256": self.weights_sha, "fingerprint": self.fingerprint,
                    "config": self.cfg.to_dict(), "record": self.record.progress()}
            with open(os.path.join(directory, META_FILE), "w") as f:
                json.dump(meta, f)
        files = {}
        for root, _, names in os.walk(directory):
            for name in names:
                path = os.path.join(root, name)
                files[os.path.relpath(path, directory)] = [os.path.getsize(path), file_sha256(path)]
        with open(os.path.join(directory, manifest_name(rank)), "w") as f:  # last: it vouches for the rest
            json.dump({"rank": rank, "files": files}, f)

    # --- resuming ---------------------------------------------------------------------------------
    def resume(self) -> int:
        """[4]–[6]: load the newest intact checkpoint of the run; the step to continue at (0 without one)."""
        skipped = []
        checkpoints = self.session.checkpoints()
        self.registered = {os.path.basename(c.path.rstrip("/")) for c in checkpoints}
        for checkpoint in checkpoints:
            t0 = time.perf_counter()
            with checkpoint.as_directory() as directory:
                problem = any_rank(damage(directory, self.ctx.world_size, [self.ctx.rank]))
                if problem is None:
                    step = self._load(directory, checkpoint.path, skipped)
                    self.log(f"resumed from {checkpoint.path} at step {step} (checked and loaded in "
                             f"{time.perf_counter() - t0:.1f} s)")
                    return step
            skipped.append(f"{checkpoint.path}: {problem}")
            self.log(f"checkpoint {checkpoint.path} is damaged ({problem}): resuming from the one before it")
        if skipped:
            raise RunStopped(f"no intact checkpoint to resume from ({skipped[0]}): run again without --resume to "
                             f"start afresh")
        return 0

    def _load(self, directory: str, where: str, skipped: list[str]) -> int:
        with open(os.path.join(directory, META_FILE)) as f:
            meta = json.load(f)
        diff = differences(meta["identity"], identity(self.cfg))
        stored_sha = meta["init_weights_sha256"]
        if stored_sha != self.weights_sha:
            diff.append(f"initial weights sha256 {stored_sha[:12]}… there, {self.weights_sha[:12]}… here")
        diff += [f"{d} (there vs here)" for d in code_differences(meta.get("fingerprint", {}), self.fingerprint)]
        if diff:
            raise RunStopped(f"checkpoint {where} was written by another run ({'; '.join(diff[:3])}): run again "
                             f"without --resume to start afresh")
        self.strategy.load_state(directory)
        set_rng_state(torch.load(os.path.join(directory, rng_name(self.ctx.rank)), weights_only=True), self.ctx.device)
        self.record.resume(meta["record"], where, skipped)
        return meta["step"]


def damage(directory: str, world_size: int, hashed_ranks) -> str | None:
    """What is wrong with a merged checkpoint directory, or None: every rank's manifest must be there and
    every file it lists present at its size; the files of `hashed_ranks` must also match their sha256 (a
    worker hashes its own, so the ranks share the reading)."""
    for r in range(world_size):
        try:
            with open(os.path.join(directory, manifest_name(r))) as f:
                files = json.load(f)["files"]
        except FileNotFoundError:
            return f"{manifest_name(r)} is missing"
        except (OSError, ValueError, KeyError, TypeError):
            return f"{manifest_name(r)} cannot be read"
        for name, (size, sha256) in sorted(files.items()):
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                return f"{name} is missing"
            if os.path.getsize(path) != size:
                return f"{name} has {os.path.getsize(path)} bytes, its manifest says {size}"
            if r in hashed_ranks and file_sha256(path) != sha256:
                return f"{name} does not match the sha256 in its manifest"
    return None


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
