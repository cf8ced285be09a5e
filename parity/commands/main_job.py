"""run_verification_main.sh: seed 000's main job. DDP (writes the shared initial weights) → DeepSpeed →
FSDP → the loss-curve comparison, ending with its verdict.

With as many GPUs as TP_SIZE × DP_SIZE: the seed configuration (Qwen/Qwen2.5-0.5B, 2 layers, batch 2, seq
1024, 100 steps, lr 1e-5, DDP dp=2, the others tp=2 × dp=2). Without: the same shape on qwen2-tiny, CPU
workers. Every run's configuration is resolved (and bad input rejected) before the first one starts; the
three runs share one Ray session that this job starts and stops.

Every setting is an environment variable or the flag --lower_case_name value (flags win).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time

from parity import console, storage
from parity.commands.common import OneLineParser, exit_now, report_error, run_command
from parity.comparing.html_report import RUN_PARTS, run_times
from parity.errors import ConfigError, TrainingFailed
from parity.registry import KNOWN, NAMES
from parity.driver.cluster import ray_for_this_command
from parity.driver.config import DEVICES, PRECISIONS

# (environment variable, type, default, help). Defaults that depend on GPUs are filled in later.
SETTINGS = (
    ("OUTPUT_DIR", str, "outputs/verification_main",
     "all outputs: shared_weights/, loss_curves/, ray_checkpoints/ (a local folder or a URI: s3://, gs://, …)"),
    ("MODEL_NAME", str, None, "model preset or directory [GPU: Qwen/Qwen2.5-0.5B, CPU: qwen2-tiny]"),
    ("NUM_LAYERS", int, 2, "decoder layers"),
    ("BATCH_SIZE", int, 2, "samples per DP rank"),
    ("SEQ_LENGTH", int, None, "tokens per sample [GPU: 1024, CPU: 256]"),
    ("DEBUG_STEPS", int, 100, "training steps"),
    ("LEARNING_RATE", float, None, "AdamW lr [GPU: 1e-5, CPU: the preset's (1e-3 for qwen2-tiny)]"),
    ("LOG_INTERVAL", int, 10, "log / record rewrite interval"),
    ("TP_SIZE", int, 2, "TP size of the runs that shard tensors (DDP's is 1)"),
    ("DP_SIZE", int, 2, "DP size of every run"),
    ("EP_SIZE", int, 1, "expert-parallel size of the runs that shard a mixture of experts' experts (fsdp, "
                        "transformers; DDP holds every expert); it divides TP_SIZE × DP_SIZE (docs/moe.md)"),
    ("PRECISION", str, "auto", "the precision policy of every run, DDP's included: " +
     " | ".join(p for p in PRECISIONS if p != "auto") + " | auto (bf16 on GPU, fp32 on CPU; or what a strategy's own "
     "settings ask for, e.g. a --deepspeed_config with bf16 enabled: docs/precision.md)"),
    ("DEVICE", str, "auto", "auto | cpu | cuda (auto: cuda with >= TP_SIZE*DP_SIZE GPUs)"),
    ("STRATEGIES", str, " ".join(NAMES), "which runs, in order; ddp first (it writes the weights, it is the baseline); "
                                         "pipeline runs TP_SIZE stages × DP_SIZE; module:Class runs your own Strategy "
                                         "subclass at TP_SIZE × DP_SIZE"),
    ("TOLERANCE", float, None, "override the verdict's relative loss tolerance [calibrated, or from the precision]"),
    ("NOISE_REFERENCE", str, "auto", "run DDP's twins to calibrate the verdict: on | off | auto (on; --uncalibrated "
                                     "is off: the fixed table alone, said so)"),
    ("PYTHON", str, None, "the interpreter to run under [python3]"),
    ("REPORT_TO", str, "none", "experiment trackers of every run and of the comparison: wandb mlflow tensorboard "
                              "(space-separated) or none; one group (W&B) / experiment (MLflow) holds the job's runs"),
    ("EXTRA_ARGS", str, "", "more train_*.py flags for every run (a strategy's own flags go to that strategy)"),
    ("VERBOSE", str, "off", "on: Ray's, DeepSpeed's and torch's output on the terminal, not in OUTPUT_DIR/main_job.log"),
)


def build_parser() -> OneLineParser:
    p = OneLineParser(__doc__, prog="run_verification_main.sh")
    for env, kind, default, text in SETTINGS:
        choices = {"PRECISION": PRECISIONS, "DEVICE": DEVICES, "NOISE_REFERENCE": ("on", "off", "auto"),
                   "VERBOSE": ("on", "off")}.get(env)
        p.add_argument(f"--{env.lower()}", type=kind, default=os.environ.get(env) or default, choices=choices,
                       metavar=env, help=f"{text} (environment: {env})")
    p.add_argument("--uncalibrated", dest="noise_reference", action="store_const", const="off",
                   help="no noise references: the verdict by the fixed table alone (NOISE_REFERENCE=off)")
    return p


def run_main_job(args) -> int:
    """Resolve every run, then train them on one Ray session in one worker group, then compare. Returns the exit
    code."""
    import ray

    from parity.commands.compare_curves import compare_and_report
    from parity.comparing.curve_report import JSON_NAME, REPORT_NAME
    from parity.comparing.html_report import PAGE_NAME, TIMES_NAME, write_curve_page
    from parity.driver.cluster import ensure_ray, probe_cluster
    from parity.driver.config import resolve
    from parity.training.data import training_data
    from parity.driver.launch import launch_runs
    from parity.training.record import REFERENCE_GLOB, load_record, run_record_path

    import psutil

    # from the process's own start: the interpreter and the imports are the driver's start-up too
    job_started = time.perf_counter() - (time.time() - psutil.Process().create_time())
    times, clock = [], [job_started]

    def lap(what: str, *group) -> None:  # the seconds since the last lap, as a row of the time table
        now = time.perf_counter()
        times.append((what, now - clock[0], *group))
        clock[0] = now

    out = storage.absolute(args.output_dir)
    loss_dir = storage.join(out, "loss_curves")
    cluster = probe_cluster()
    cfgs = [resolve(strategy, values, cluster=cluster, weights_written_before_launch=not values.get("save_init_weights"))
            for strategy, values in run_plan(args, out, cluster)]
    batches = {cfg.experiment_name: training_data(cfg) for cfg in cfgs}
    for pattern in ("loss_*.json", REFERENCE_GLOB):  # a verdict only on this job's runs
        for stale in storage.list_files(loss_dir, pattern):
            storage.delete_file(stale)
    storage.delete_dir(storage.join(out, "ray_checkpoints"))  # fresh runs: the job owns its run folders

    lap("driver start-up and checks")
    with console.terminal(storage.join(out, "main_job.log"), args.verbose == "on") as log, console.pointing_to(log), \
            ray_for_this_command():
        try:
            ensure_ray()
            lap("Ray start")
            where = f"{cluster.gpus} GPUs" if cfgs[0].use_cuda else "CPU workers"
            console.say(f"Ray up; model {cfgs[0].model_name} on {where}; outputs in {out}")
            workers = max(cfg.num_workers for cfg in cfgs)  # one worker group: a run of fewer on its first ranks
            console.say(f"== {workers} workers: " + ", ".join(run_title(cfg) for cfg in cfgs))
            began = time.time()
            try:
                launch_runs(cfgs, [{"batches": batches[cfg.experiment_name]} for cfg in cfgs],
                            titles=[run_title(cfg) for cfg in cfgs])
            except TrainingFailed as exc:
                console.say(f"error: a run of the {workers}-worker group failed: {exc}", err=True)
                return 1
            ended = time.time()
            runs = [(run_title(cfg), load_record(run_record_path(cfg))["final"]["timings"]) for cfg in cfgs]
            lap(f"{workers}-worker group", began, ended, runs)
        finally:
            ray.shutdown()
    lap("Ray shutdown")

    console.say("== comparing")
    # the time table so far beside the records, so that the comparison's page (and what the trackers get) has it
    storage.write_json_atomic(storage.join(loss_dir, TIMES_NAME), time_table_json(times, clock[0] - job_started))
    try:
        verdict = compare_and_report(loss_dir, storage.join(loss_dir, "loss_curves.png"), tolerance=args.tolerance)
    except ConfigError as exc:
        report_error(exc)
        verdict = 2
    lap("comparison and figure")
    table = time_table_json(times, clock[0] - job_started)
    print(time_table(table))
    storage.write_json_atomic(storage.join(loss_dir, TIMES_NAME), table)
    if verdict != 2:  # the page again, with the comparison's own time
        write_curve_page(loss_dir)
    report = storage.join(loss_dir, PAGE_NAME if storage.exists(storage.join(loss_dir, PAGE_NAME)) else REPORT_NAME)
    word = json.loads(storage.read_text(storage.join(loss_dir, JSON_NAME)))["verdict"] if verdict == 1 else None
    print({0: f"VERDICT: PASS — every strategy trains the same model as DDP within tolerance ({report})",
           1: f"VERDICT: FAIL — see the first failing step above and {report}" if word == "FAIL" else
           f"VERDICT: {word} — a run trained in another precision policy than DDP (see above and {report})"}.get(
        verdict, "VERDICT: no verdict — the runs could not be compared (see above)"),
        file=sys.stdout if verdict == 0 else sys.stderr)
    return verdict


def run_title(cfg) -> str:
    role = " (noise reference)" if cfg.noise_reference else ""
    layout = f"pp={cfg.pp_size}" if cfg.pp_size > 1 else f"tp={cfg.tp_size}"
    experts = f" ep={cfg.ep_size}" if cfg.ep_size > 1 else ""
    return f"{cfg.strategy}{role} {layout} dp={cfg.dp_size}{experts} {cfg.precision}"


def time_table(table: dict) -> str:
    """Where the job's time went, as text: main_job_times.json's rows (time_table_json)."""
    lines = ["", f"WHERE THE TIME WENT ({table['total_s']:.0f} s)"]
    for row in table["rows"]:
        lines.append(f"  {row['what']:<36} {row['seconds']:6.1f} s")
        for r in row.get("runs", []):
            lines.append(f"    {r['title']:<34} {run_times(r)}")
        for what, seconds in row.get("parts", []):
            lines.append(f"    {what:<34} {seconds:6.1f} s")
    return "\n".join(lines)


def time_table_json(times: list, total: float) -> dict:
    """The time table as main_job_times.json holds it (the comparison's report.html shows it). A worker group's row
    accounts for each of its seconds: its workers' start-up (Ray Train's actors, each worker's imports, the process
    group) until its first run began, each run by part (the rest: its record and trackers opening, its last
    writes), the hand-over between runs (a restarted group's lost attempt among it), and the teardown after the
    last run ended. The times of a run are rank 0's own clock; the group's, the driver's (one machine's, or
    the cluster's synchronised clocks)."""
    rows = []
    for what, seconds, *group in times:
        row = {"what": what, "seconds": seconds}
        if group:
            began, ended, runs = group
            row["runs"] = [{"title": title, **{k: t[k] for k in ("steps", *RUN_PARTS)},
                            "other_s": t["ended_at"] - t["began_at"] - sum(t[k] for k in RUN_PARTS)}
                           for title, t in runs]
            spans = sorted((t["began_at"], t["ended_at"]) for _, t in runs)
            row["parts"] = [("workers' start-up", spans[0][0] - began),
                            ("hand-over between runs", sum(b - a for (_, a), (b, _) in zip(spans, spans[1:]))),
                            ("teardown", ended - spans[-1][1])]
        rows.append(row)
    return {"total_s": total, "rows": rows}


def run_plan(args, out: str, cluster) -> list[tuple[str, dict]]:
    """[(strategy, flags)] in run order: the seed's three commands, with the GPU or CPU defaults, and after
    DDP its twins (noise references) when the verdict is to be calibrated. Each entry of STRATEGIES, a registry
    row's name or a class path of the user's, is planned from its class's attributes (which tensors it shards, its
    pipeline ranks, its experts), not from its name."""
    from parity.layout import job_layout
    from parity.objectives import micro_rows, parse_settings, resolve_objective, twin_accumulation
    from parity.registry import flags_for, load, path_of
    from parity.training.teacher_forced import PERTURB

    strategies = args.strategies.split()
    unknown = [s for s in strategies if s not in KNOWN and ":" not in s]
    if unknown or not strategies:
        raise ConfigError(f"unknown strategy '{unknown[0] if unknown else ''}' in STRATEGIES: use {', '.join(KNOWN)}, "
                          f"or module:Class for your own")
    if strategies[0] != "ddp":
        raise ConfigError(f"STRATEGIES '{args.strategies}' must start with ddp: the DDP run writes the initial "
                          f"weights and is the baseline")
    for name in ("tp_size", "dp_size", "ep_size"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name} must be a positive integer (got {getattr(args, name)})")
    world = args.tp_size * args.dp_size
    on_gpu = args.device == "cuda" or (args.device == "auto" and cluster.gpus >= world)
    classes = [load(path_of(s)) for s in strategies]
    extra = extra_flags(args.extra_args, [cls.name for cls in classes])
    policy = job_policy(args.precision, strategies, extra)
    objective = resolve_objective(extra.get("objective"), parse_settings(extra.get("objective_args")))
    rollouts = extra.get("rollouts")  # a rollout file's rows set the length
    common = {
        "model_name": args.model_name or ("Qwen/Qwen2.5-0.5B" if on_gpu else "qwen2-tiny"),
        "num_layers": args.num_layers, "batch_size": args.batch_size,
        "seq_length": args.seq_length or (None if rollouts else 1024 if on_gpu else 256), "debug_steps": args.debug_steps,
        "learning_rate": args.learning_rate or (1e-5 if on_gpu else None), "log_interval": args.log_interval,
        "device": args.device, "report_to": args.report_to, **policy,
        "loss_output_dir": storage.join(out, "loss_curves"),
        "init_weights_path": storage.join(out, "shared_weights", "init_weights.pt"),
    }
    plan = []
    for i, (strategy, cls) in enumerate(zip(strategies, classes)):
        # DDP's DP_SIZE replicas; TP_SIZE × DP_SIZE where it shards tensors; a pipeline in the TP runs' world, TP_SIZE
        # pipeline ranks × DP_SIZE; EP_SIZE where it shards experts
        layout = job_layout(cls, tp_size=args.tp_size, dp_size=args.dp_size, pp_size=args.tp_size, ep_size=args.ep_size)
        if i == 0:  # the baseline, DDP: it writes the initial weights
            layout["save_init_weights"] = True
        # A class path of the user's is its run's --strategy_class; its own options stay at their defaults.
        own = {} if ":" not in strategy else {"strategy_class": strategy}
        plan.append((cls.name, {**common, **layout, **flags_for(cls.name, extra), **own}))
        if i == 0 and wants_noise_reference(args):
            ddp = plan[0][1]
            # On GPUs a twin gets as many as the cluster has, or as the runs wait for (GPU nodes still to come).
            gpus = max(cluster.gpus, world) if on_gpu else None
            low = policy["precision"] not in ("fp32", "auto") or (policy["precision"] == "auto" and on_gpu)
            for n, (dp, batch) in enumerate(twin_layouts(ddp["dp_size"], ddp["batch_size"], gpus)):
                accumulation = twin_accumulation(objective, micro_rows(ddp), batch)  # a split the objective allows
                # in a low precision the first twin trains in another arithmetic too (loss × PERTURB): every backward
                # rounding moves, as TP's partial sums and other kernels move them; the layout alone moves fp32 sums
                perturb = PERTURB if low and n == 0 else None
                if accumulation is not None:
                    plan.append(("ddp", {**ddp, "num_workers": dp, "dp_size": dp, "batch_size": batch,
                                         "grad_accum_steps": accumulation, "save_init_weights": False,
                                         "perturb": perturb, **REFERENCE}))
            if low:  # and in fp32 at its own layout: how far the policy's rounding moves the curves (docs/tolerances.md)
                plan.append(("ddp", {**ddp, **{k: None for k in policy}, "precision": "fp32",
                                     "save_init_weights": False, **REFERENCE}))
    for _, values in plan:  # the runs share a worker group and its folder
        values["storage_path"] = storage.join(out, "ray_checkpoints")
    return plan


REFERENCE = {"noise_reference": True, "no_teacher_forced": True}  # a twin's flags: its curves are its use, not its own
# teacher-forced check (the verdict reads the baseline's and the runs')


def wants_noise_reference(args) -> bool:
    """Calibrate unless told not to (NOISE_REFERENCE off, --uncalibrated): DDP again at two other layouts (the twins)
    and, in a low-precision policy, in fp32 at its own; in fp32 the fixed table stays the floor under the calibrated
    bound (tolerances.CALIBRATION_FLOORED), so the twins can only say the noise is larger than the table thinks."""
    return args.noise_reference != "off"


def job_policy(precision: str, strategies: list[str], extra: dict) -> dict:
    """The precision policy every run of the job trains in — DDP, its noise references and the strategies — as flags:
    PRECISION (or --precision / --autocast in EXTRA_ARGS) with the policy flags of EXTRA_ARGS, and what a strategy's
    own settings ask for (a --deepspeed_config's bf16 or fp16 section: Strategy.precision_request), merged as `resolve`
    merges them for one run. So a config alone picks the policy, and the baseline is always DDP in the strategies'
    policy. The policy flags leave `extra` (in place)."""
    from parity.registry import flags_for, load, path_of
    from parity.driver.config import POLICY_FLAGS, precision_flags
    from parity.precision import resolve_policy

    given = extra.pop("precision", "auto")
    if "auto" not in (precision, given) and given != precision:
        raise ConfigError(f"PRECISION {precision} and EXTRA_ARGS --precision {given}: give the policy once")
    s = {"precision": precision_flags(given if precision == "auto" else precision, extra.pop("autocast", False)),
         **{k: extra.pop(k, None) for k in POLICY_FLAGS}}
    for strategy in strategies:
        cls = load(path_of(strategy))
        names = {o.name for o in cls.options}
        options = cls.with_default_options({k: v for k, v in flags_for(cls.name, extra).items() if k in names})
        resolve_policy(s, cls.precision_request(options))
    return s


def twin_layouts(dp_size: int, batch_size: int, max_workers: int | None) -> list[tuple[int, int]]:
    """(dp, batch) with the baseline's global batch and another layout: one worker with the whole batch, and
    one sample per worker when the cluster has that many workers to give (None: no limit)."""
    global_batch = dp_size * batch_size
    return [(dp, global_batch // dp) for dp in sorted({1, global_batch})
            if dp != dp_size and (max_workers is None or dp <= max_workers)]


def extra_flags(text: str, strategies: list[str]) -> dict:
    """EXTRA_ARGS → the flags given, by name. A strategy's own flag must belong to a strategy that runs."""
    from parity.registry import classes, unrun_option
    from parity.driver.config import add_run_flags, add_strategy_options

    parser = OneLineParser(prog="EXTRA_ARGS")
    add_run_flags(parser, given_only=True)
    add_strategy_options(parser, classes(), given_only=True)
    try:
        given = vars(parser.parse_args(shlex.split(text)))
    except SystemExit:
        raise ConfigError(f"EXTRA_ARGS '{text}' holds a flag that train_*.py does not take: see train_ddp.py "
                          f"--help") from None
    unrun = unrun_option(given, strategies)
    if unrun:
        raise ConfigError(f"EXTRA_ARGS --{unrun[0]} is a {unrun[1]} flag, but STRATEGIES has no {unrun[1]} run")
    return given



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.python:  # the interpreter asked for: run the whole job under it
        python = shutil.which(args.python) or args.python
        if os.path.realpath(python) != os.path.realpath(sys.executable):
            os.execv(python, [python, "-m", "parity.commands.main_job", *argv])
    try:
        return run_command(lambda: run_main_job(args), "the main job", trace_dir=args.output_dir)
    except KeyboardInterrupt:
        print("interrupted: Ray stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    exit_now(main())
