"""verify_trainer.py: your training command run as you launch it, recorded, replayed under the harness's DDP and judged,
in one command (docs/own_trainer/one_command.md#one-command).

The command runs as a child process, its output passed through, with the recorder attached by environment
(parity/attaching/attach.py): its records land in --output_dir under a name taken from the command. Each record's
replay and its noise references (plan_replays; none with --uncalibrated) train in local gloo groups of this machine's
processes (parity.driver.local_group: no Ray, whose start-up would cost more than a short replay trains), one group
per world size; then plot_loss_curves.py's comparison judges every record in the folder against the replay, and writes its
page. Exit codes as plot_loss_curves.py's (0 PASS, 1 FAIL, 2 bad input — a job the recorder stopped included, its
line repeated whatever its launcher reported); a command that fails, its own status.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

from parity.commands.common import OneLineParser, run_command
from parity.driver.local_group import NOISE_KERNELS
from parity.errors import ConfigError

FIGURE = "curves.png"  # the comparison's figure; curve_report.md and report.html beside it
WARM = ("parity.replay.replay", "parity.models.model", "transformers.modeling_utils",
        "parity.commands.compare_curves", "parity.comparing.curves", "parity.comparing.figures")


def build_parser(description: str = "") -> OneLineParser:
    p = OneLineParser(description, usage="%(prog)s --output_dir OUT [--num_workers N] [--uncalibrated] "
                                         "[--num_layers N] [--replay_strategy auto|ddp|fsdp|zero3] [--replay_memory SIZE] [--verbose] "
                                         "-- COMMAND [ARG ...]")
    p.add_argument("--output_dir", required=True, help="where the records, the replays and the page go (a folder "
                                                       "without records in it)")
    p.add_argument("--num_workers", type=whole_number(1), default=None,
                   help="the replay's worker count (None: the recorded run's data-parallel size)")
    p.add_argument("--uncalibrated", dest="calibrate", action="store_false",
                   help="judge against the fixed table alone: no noise references (by default the replay runs again "
                        "at another worker count, and in fp32 for a low-precision run, and the bounds are calibrated "
                        "on them, never below the fixed table in fp32)")
    p.add_argument("--calibrate", action="store_true", default=True, help="the default (kept for the commands that pass it)")
    p.add_argument("--verbose", action="store_true", help="the replays' torch and DeepSpeed output on the terminal "
                                                          "too (else in OUT/logs/replay.log)")
    p.add_argument("--checkpoint_interval", type=whole_number(0), default=None,
                   help="where the recorder saves the run's state for the teacher-forced check: around step 0 and "
                        "every N steps (0: step 0 alone; default: what the code passes, 50 unless it says)")
    p.add_argument("--num_layers", type=whole_number(1), default=None,
                   help="train the command's model cut to its first N decoder layers, at its real widths (every "
                        "transformers model its processes build; docs/own_trainer/replay.md#your-model-at-its-real-widths)")
    p.add_argument("--replay_strategy", default="auto", choices=("auto", "ddp", "fsdp", "zero3"),
                   help="the trusted loop that replays the record: ddp (a whole replica a worker), fsdp (FSDP2, fully "
                        "sharded, no TP), zero3 (DeepSpeed ZeRO-3); auto: ddp where a replica with its gradients and "
                        "AdamW states fits a worker, else fsdp (docs/own_trainer/replay.md#the-sharded-replay)")
    p.add_argument("--replay_memory", type=size, default=None,
                   help="what one replay worker may hold, e.g. 80GiB (default: its GPU's memory; on CPU the "
                        "machine's ÷ the workers)")
    return p


def size(text: str) -> int:
    """argparse's type of a memory size (replay_choice.parse_size)."""
    from parity.replay.replay_choice import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None, description: str = "") -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = build_parser(description).parse_args(argv[:split])
    return run_command(lambda: verify(args.output_dir, argv[split + 1:], args.num_workers, args.calibrate,
                                      args.verbose, args.checkpoint_interval, args.num_layers, args.replay_strategy,
                                      args.replay_memory), "the replay", trace_dir=args.output_dir)


def verify(output_dir: str, command: list[str], num_workers: int | None = None, calibrate: bool = True,
           verbose: bool = False, checkpoint_interval: int | None = None, num_layers: int | None = None,
           replay_strategy: str = "auto", replay_memory: int | None = None) -> int:
    """Run `command` recorded into `output_dir` (its states saved every `checkpoint_interval` steps where given; its
    models cut to `num_layers` decoder layers where given), replay it under `replay_strategy` (auto: by
    `replay_memory`, bytes a worker) and judge it; returns the exit code. Raises ConfigError (bad input: before the command runs where it can be known
    then) or TrainingFailed (a replay failed)."""
    from parity import storage
    from parity.attaching import attach

    start = time.perf_counter()
    if not command:
        raise ConfigError("no command: give your launch command after --, e.g. verify_trainer.py --output_dir OUT "
                          "-- torchrun --nproc_per_node 2 train.py")
    if shutil.which(command[0]) is None:
        raise ConfigError(f"{command[0]}: no such command: give the launch command as you would run it")
    out = storage.absolute(output_dir)
    storage.check_writable_dir("--output_dir", out)
    stale = existing_records(out)
    if stale:
        raise ConfigError(f"--output_dir {output_dir} already holds records ({', '.join(stale[:3])}): they would be "
                          f"judged with this run's; give an empty folder, or remove them")
    if num_layers is not None:
        from parity.attaching.model_builders import builds

        if builds(command) is False:
            raise ConfigError(f"--num_layers {num_layers}: {command_script(command)} builds its model in no way the cut "
                              f"reaches (from_pretrained, from_config, a transformers model class, TRL): cut it in your "
                              f"code, or leave --num_layers out")
    from parity.frameworks import registered

    for framework in registered():  # a job a framework cannot record (torchtitan's unmapped model): said before it runs
        why = framework.command_refusal(command) if framework.command_refusal else None
        if why:
            raise ConfigError(f"{why}: nothing run")
    name = record_name(command)
    cut = f", its model cut to {num_layers} decoder layers" if num_layers is not None else ""
    print(f"verify_trainer: running {' '.join(command)}, recorded as {name} into {out}{cut}", flush=True)
    env = attach.environment(out, name, dict(os.environ), checkpoint_interval, num_layers)
    if attach.stopped_command(out):  # an earlier command's, stopped by its recorder: never this one's
        storage.delete_file(storage.join(out, attach.STOPPED_FILE))
    status, command_s = run_recorded(command, env)
    stopped = attach.stopped_command(out)
    if stopped:  # the recorder stopped the job, whatever status its launcher reports for that
        raise ConfigError(f"{stopped}: the job stopped before it trained: nothing replayed")
    if status:
        code = status if status > 0 else 128 - status  # killed by signal N: 128 + N, as a shell says
        print(f"error: the command exited with status {code} after {command_s:.1f} s: nothing replayed",
              file=sys.stderr)
        return code
    records = recorded(out, name)
    planned = plan_replays(records[0], out, num_workers, calibrate, replay_strategy, replay_memory)
    replay_s, steps_s = replay(planned, out, verbose)
    drop_silent_references(planned)
    from parity.commands.compare_curves import compare_and_report

    t0 = time.perf_counter()
    code = compare_and_report(out, storage.join(out, FIGURE), baseline=planned[0][0].strategy)
    code = max(code, sampler_verdict(records[0], out))
    verdict_s = time.perf_counter() - t0
    total = time.perf_counter() - start
    print(f"verify_trainer: {total:.1f} s: the command {command_s:.1f} s, the replays {replay_s:.1f} s "
          f"({len(planned)} run{'s' if len(planned) > 1 else ''}, {steps_s:.1f} s of training steps), the verdict "
          f"{verdict_s:.1f} s; overhead {total - command_s - steps_s:.1f} s beyond the command and the replays' "
          f"training steps (its imports ran beside the command)")
    return code


def sampler_verdict(record_file: str, out: str) -> int:
    """Where the record's rollout file holds the sampler's side (vLLM's log-probs): its verdict in a few lines and in
    `out`/sampler_verdict.json (docs/sampler.md#trls-grpotrainer-with-vllm); 1 where it FAILs, else 0."""
    from parity import console, storage
    from parity.commands.check_rollouts import describe_sampler
    from parity.rollout_check.recorded import VERDICT_FILE, judge_recorded

    result = judge_recorded(record_file)
    if result is None:
        return 0
    left = (f"; not judged: the rows of step {', '.join(map(str, result['left_out_steps']))}, whose weights the "
            f"record does not hold (the recorder keeps them up to its max_state_bytes)"
            if result["left_out_steps"] else "")
    console.say(describe_sampler(result, result["settings"]) + f"\n  rows sampled with the weights of step "
                f"{', '.join(map(str, result['judged_steps']))}{left}" + layers_line(result.get("layers")))
    storage.write_bytes_atomic(storage.join(out, VERDICT_FILE), json.dumps(result, indent=1).encode())
    return 1 if result["verdict"] == "FAIL" else 0


def layers_line(layers: dict | None) -> str:
    """The line of where the in-process engine's forward first parted from the trainer's model (or why unknown)."""
    if layers is None:
        return ""
    if "error" in layers:
        return f"\n  vLLM's layers against the trainer's model: not compared ({layers['error']})"
    worst = max(layers["layers"], key=lambda d: d["gap"] / d["noise"])
    where = (f"first apart at layer {layers['first']}" if layers["first"] is not None else "no layer apart")
    return (f"\n  vLLM's layers against the trainer's model (step 0, {layers['rows']} rows, {layers['tokens']} "
            f"tokens): {where}; largest gap ÷ noise {worst['gap'] / worst['noise']:.1f} at layer {worst['layer']} "
            f"(gap {worst['gap']:.2e}, noise {worst['noise']:.2e})")


def run_recorded(command: list[str], env: dict[str, str]) -> tuple[int, float]:
    """(exit status, seconds) of `command` run with `env`, its output passed through; what follows it warms up
    meanwhile. A ^C reaches the command too (one process group): its status is then the answer."""
    t0 = time.perf_counter()
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise ConfigError(f"{command[0]}: cannot run it ({exc.strerror or exc})") from None
    warming = warm_up()
    try:
        status = child.wait()
    except KeyboardInterrupt:
        status = child.wait()
    seconds = time.perf_counter() - t0
    warming.join()  # never an import left running into the interpreter's exit
    return status, seconds


def warm_up():
    """While the command runs, what follows it starts: the forkserver the replays' ranks fork from imports what they
    import (parity.driver.local_group.PRELOAD, about 5 CPU-seconds), and a thread here what plans the replays (the
    model's classes) and judges them (WARM). Where the command leaves cores idle that is time off the wait; on a CPU
    it keeps busy, part of it is the command's (docs/benchmark.md#one-command-verify_trainerpy). Returns the thread."""
    import importlib
    import multiprocessing.forkserver
    import threading

    from parity.driver.local_group import PRELOAD

    multiprocessing.set_forkserver_preload(PRELOAD)  # as local_group.start_processes sets it
    multiprocessing.forkserver.ensure_running()  # returns at once: the server imports on its own
    thread = threading.Thread(target=lambda: [importlib.import_module(m) for m in WARM], daemon=True)
    thread.start()
    return thread


def whole_number(least: int):
    """argparse's type of a whole number >= `least`."""
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {least} (got {text})")
        return int(text)
    return parse


def command_script(command: list[str]) -> str:
    """The script or module the command runs, as the user typed it (else the program and its subcommand)."""
    from parity.attaching.command import parse

    return parse(command).words()


def record_name(command: list[str]) -> str:
    """The record's name from the command: the script's stem (`torchrun ... train.py` → train), a module's last part
    (`python -m pkg.train` → train), else the program and its subcommand (`trl sft` → trl_sft); made an identifier,
    and never a strategy's name (ddp, ...: loss_ddp.json is the replay's)."""
    from parity.attaching.command import parse
    from parity.registry import KNOWN

    parsed = parse(command)
    stem = {"script": lambda: os.path.basename(parsed.entry)[:-3], "module": lambda: parsed.entry.rsplit(".", 1)[-1],
            "program": lambda: parsed.words().replace(" ", "_")}[parsed.kind]()
    name = re.sub(r"\W", "_", stem)
    name = name if name and not name[0].isdigit() else f"run_{name}"
    return f"{name}_run" if name in KNOWN else name


def existing_records(out: str) -> list[str]:
    """The records already in `out` (loss records and noise references)."""
    from parity import storage
    from parity.training.record import REFERENCE_GLOB

    if not storage.is_dir(out):
        return []
    return [storage.name(p) for glob in ("loss_*.json", REFERENCE_GLOB, "refused_*.txt")
            for p in storage.list_files(out, glob)]


def recorded(out: str, name: str) -> list[str]:
    """The records the command wrote, the one named `name` first (the one replayed); ConfigError if none, or where
    that one holds no step (a recorder that refused its first step: why)."""
    from parity import storage

    records = sorted(storage.list_files(out, "loss_*.json"), key=lambda p: (storage.name(p) != f"loss_{name}.json", p))
    refusals = storage.list_files(out, "refused_*.txt")  # a recorder's refusal (attach.refused): its line, last
    if not records and refusals:
        raise ConfigError(f"{storage.name(refusals[0])[len('refused_'):-len('.txt')]} was not recorded: "
                          f"{storage.read_text(refusals[0]).strip()}")
    if not records:
        from parity.frameworks import registered

        frameworks = registered()
        hints = "".join(f"; {hint}" for f in frameworks if f.install_hint and (hint := f.install_hint()))
        recording = ", ".join(f.records for f in frameworks if f.records)
        raise ConfigError(f"the command ran but recorded nothing into {out}: {recording} "
                          f"are recorded by themselves (in Python processes the command starts), a loop of your own "
                          f"makes a ParityRecorder (docs/own_trainer.md); a recorder that refused says why above{hints}")
    from parity.training.record import load_record

    load_record(records[0])  # RecordError (bad input) where it holds no step: its recorder's reason, as its last line
    return records


def plan_replays(record: str, out: str, num_workers: int | None, calibrate: bool, replay: str = "auto",
                 memory: int | None = None) -> list[tuple]:
    """[(RunConfig, batches)]: the replay of `record` at `num_workers` (default the record's DP size), under the loop
    `replay` names or, for auto, the one whose states fit `memory` bytes a worker (replay_choice.choose); with
    `calibrate` the noise references too: the replay at another worker count the record's rows allow (fewer workers
    first: fewer processes on a CPU; then more, fed rows cut at document boundaries beyond the rows a step holds) whose
    arithmetic differs from the replay's (`gradient_sums`: a count that feeds the same micro-batches summed alike,
    as fed rows regrouped whole from two ranks onto one, trains the replay bit for bit and measures no noise), for a
    low-precision run in fp32 at the replay's own, and at the replay's own under other kernels (on CPU other MKL and
    oneDNN paths, on CUDA deterministic algorithms and fp32 reductions: local_group.NOISE_KERNELS), clipping as torch's
    clip_grad_norm_ does where the replay's strategy can (fp32 norms and coefficient: a framework's loop's arithmetic;
    the harness's is float64's; ZeRO-3's engine clips its own way, and a line says so)."""
    import dataclasses
    import itertools

    from parity import storage
    from parity.driver.local_group import local_cluster
    from parity.replay.replay import plan_replay
    from parity.registry import load
    from parity.replay.replay_choice import REPLAYS, choose
    from parity.training.record import load_record
    from parity.training.teacher_forced import PERTURB

    config = load_record(record)["config"]
    device = config.get("device_type") or "cpu"
    chosen = ["ddp"]

    def plan(workers: int | None, **reference):
        given = {"num_workers": workers, "device": device, "loss_output_dir": out,
                 "storage_path": storage.join(out, "checkpoints"), **reference}
        strategy, flags, _ = REPLAYS[chosen[0]]
        planned = plan_replay(record, given, cluster=local_cluster(device), strategy=strategy, flags=flags)
        if reference:  # a noise reference's states must fit a worker too
            choose(chosen[0], planned[0], memory, storage.name(record))
        return planned

    first = plan(num_workers)
    chosen[0], why = choose(replay, first[0], memory, storage.name(record))
    print(f"verify_trainer: the replay runs under {REPLAYS[chosen[0]][2]}: {why}", flush=True)
    planned = [first if chosen[0] == "ddp" else plan(num_workers)]
    if not calibrate:
        return planned
    workers = planned[0][0].num_workers
    rows = planned[0][0].global_batch_size
    split_line(config, rows)
    for other in itertools.chain(range(workers - 1, 0, -1), itertools.count(workers + 1)):
        try:
            cfg, batches = plan(other, noise_reference=True)
            # in a low precision the layout's twin trains in another arithmetic too, where its loop can (loss × PERTURB:
            # Strategy.takes_perturb): every backward rounding moves, as the user's own kernels and sums move them;
            # its layout alone may sum as the replay does
            perturbs = config["precision"] != "fp32" and load(cfg.strategy_path).takes_perturb
            reference = dataclasses.replace(cfg, perturb=PERTURB if perturbs else None), batches
        except ConfigError:
            if other > rows:  # more workers than any step's rows: a count refused here refuses every larger one
                break
            continue
        if any(a != b for a, b in zip(gradient_sums(*reference), gradient_sums(*planned[0]))):
            planned.append(reference)
            break
    if len(planned) == 1:
        print(f"verify_trainer: no other worker count splits {storage.name(record)}'s {rows} rows into other "
              f"micro-batches or sums: no noise reference at another layout", file=sys.stderr)
    if config["precision"] != "fp32":
        planned.append(plan(workers, noise_reference=True, precision="fp32"))
    kernels = NOISE_KERNELS[device]  # the noise another CPU kind or GPU brings, measured on this machine
    cfg, batches = plan(workers, noise_reference=True, experiment_name=f"ddp_dp{workers}_{kernels}_noise_reference")
    # and another loop's: it clips as torch's clip_grad_norm_ does (RunConfig.clip_arithmetic), as the user's loop does,
    # where the replay's strategy can (Strategy.clips_as_torch)
    clips = load(cfg.strategy_path).clips_as_torch
    if not clips:
        print(f"verify_trainer: the noise reference under other kernels clips as {REPLAYS[chosen[0]][2]} does, not as "
              f"torch's clip_grad_norm_: the bounds do not draw a loop's fp32 clip (docs/tolerances.md)", file=sys.stderr)
    planned.append((dataclasses.replace(cfg, noise_kernels=kernels, clip_arithmetic="torch" if clips else None), batches))
    return planned


def split_line(config: dict, rows: int) -> None:
    """Calibration of a record whose objective depends on the split by definition (bnpo, an entropy bonus, DPO's sft):
    one line saying its noise references keep the run's micro-batches, and at which worker counts they can."""
    from parity.replay.objective_replay import allowed_workers
    from parity.objectives import invariance_of, micro_rows

    objective = config.get("objective")
    note = invariance_of(objective).note(objective["name"]) if objective else None
    if note:
        print(f"verify_trainer: calibration: {note}: its noise references keep the run's micro-batches of "
              f"{micro_rows(config)} rows, so only {', '.join(map(str, allowed_workers(config, rows)))} worker(s) can "
              f"replay it; another split would measure another objective, not noise", file=sys.stderr)


def gradient_sums(cfg, batches):
    """Each step's gradient as the replay of `cfg` on `batches` computes it, yielded step by step: an expression over
    what it feeds — each DP rank's micro-batches (named by their tensors: the same tensors, the same forward)
    accumulated in order, then all-reduced: over two ranks one addition, which commutes; over more, in gloo's own
    order, taken as its own. Two layouts of the same expressions train the same bits (their loss scales, dp_size /
    tokens at 1 and 2 ranks, differ by a power of two): the replay at 1 worker of a record of one micro-batch on each
    of 2 ranks, where its micro-batches stay whole (fed rows: each row alone at any count)."""
    import functools
    import hashlib

    from parity.training.data import dp_slice

    def named(micro) -> str:
        digest = hashlib.sha256()
        for t in (micro.input_ids, micro.labels, micro.attention_mask, micro.position_ids, micro.fed):
            digest.update(b"none" if t is None else repr(tuple(t.shape)).encode() + t.numpy().tobytes())
        return digest.hexdigest()[:16]

    def plus(a, b):
        return ("+", *sorted((a, b), key=repr))

    for step in range(batches.steps_per_epoch):
        batch = batches(step)
        ranks = [functools.reduce(plus, map(named, dp_slice(batch, r, cfg.batch_size).split(cfg.grad_accum_steps)))
                 for r in range(cfg.dp_size)]
        yield functools.reduce(plus, ranks) if len(ranks) <= 2 else ("all-reduce", *ranks)


def replay(planned: list[tuple], out: str, verbose: bool = False) -> tuple[float, float]:
    """Every planned run trained in one local group (a run of fewer workers on its first ranks); returns (seconds, of
    which training steps)."""
    from parity import console, storage
    from parity.training.record import load_record, run_record_path

    t0 = time.perf_counter()
    with console.terminal(storage.join(out, "logs", "replay.log"), verbose) as log, \
            console.pointing_to(log, "[replay] "):
        launch_planned(planned, say=console.say)
    seconds = time.perf_counter() - t0
    steps = sum(s.get("step_time_s", 0.0) for cfg, _ in planned for s in load_record(run_record_path(cfg))["steps"])
    return seconds, steps


def drop_silent_references(planned: list[tuple]) -> None:
    """A noise reference at another worker count that trained the replay's curves bit for bit measured no noise — its
    micro-batches' gradients summed alike after all (`gradient_sums` cannot see that a micro-batch counting no token,
    e.g. every row truncated under mask_truncated_completions, adds exact zeros): its files are removed, saying so,
    and the bounds come from the other references (the comparison refuses an identical reference, as one its user ran
    in vain)."""
    from parity import storage
    from parity.comparing.tolerances import QUANTITIES
    from parity.training.record import load_record, run_record_path
    from parity.training.tensor_series import folder_of

    def curves(cfg) -> list:
        return [[s[q] for q in QUANTITIES] for s in load_record(run_record_path(cfg))["steps"]]

    base = planned[0][0]
    layouts = [cfg for cfg, _ in planned[1:]
               if cfg.dp_size != base.dp_size and not cfg.noise_kernels and cfg.precision == base.precision]
    replayed = curves(base) if layouts else None
    for cfg in layouts:
        if curves(cfg) == replayed:
            path = run_record_path(cfg)
            print(f"verify_trainer: {storage.name(path)} trained bit for bit as the replay (its micro-batches' "
                  f"gradients summed alike): it measured no noise, not used", file=sys.stderr)
            storage.delete_file(path)
            if storage.exists(folder_of(path)):
                storage.delete_dir(folder_of(path))


def launch_planned(planned: list[tuple], kernel: str = "default", say=lambda line: None) -> None:
    """Every planned run trained in local groups: one group (a run of fewer workers on its first ranks) under `kernel`
    (local_group.KERNEL_PATHS), and one more for the noise reference under other kernels (noise_kernels), each
    announced through `say`. In a group the runs of more workers go first, so that every rank of a run has trained
    the same runs before it: DeepSpeed's ZeRO-3 numbers each engine's modules and parameters on from the process's
    last and holds the numbers equal across ranks — a ZeRO-3 replay at 2 workers, then its noise reference at 3,
    crashed on "a disagreement on list contents between rank0 and rank2"."""
    from parity.driver.local_group import launch_local

    for kernels in dict.fromkeys(cfg.noise_kernels for cfg, _ in planned):
        group = sorted(((cfg, batches) for cfg, batches in planned if cfg.noise_kernels == kernels),
                       key=lambda run: -run[0].num_workers)  # stable: as planned among equals
        say(f"[replay] {', '.join(f'{cfg.experiment_name} ({cfg.num_workers})' for cfg, _ in group)} in a local group "
            f"of {max(cfg.num_workers for cfg, _ in group)}"
            + (f" under {kernels} ({kernel_variables(kernels)})" if kernels else ""))
        launch_local([cfg for cfg, _ in group], [{"batches": batches} for _, batches in group], kernel=kernels or kernel)


def kernel_variables(kernels: str) -> str:
    """The variables kernel path `kernels` starts a group with, in words: 'MKL_CBWR=COMPATIBLE, ONEDNN_MAX_CPU_ISA unset'."""
    from parity.driver.local_group import KERNEL_PATHS, kernel_environment

    env = kernel_environment(kernels)
    return ", ".join(f"{k}={env[k]}" if k in env else f"{k} unset" for k in KERNEL_PATHS[kernels])
