"""run_verification.py: the layer check. One recorded optimizer step per strategy (seed 001), on full
tensors, from the folder's shared weights and inputs; then every pair of dumps is compared. With --replay,
the step is step k of a training run, from the DDP baseline's checkpoint (parity/layer_check/replay.py)."""

from __future__ import annotations

import argparse
import os

from parity import console, storage
from parity.commands.common import OneLineParser, non_negative_float, run_command
from parity.errors import ConfigError
from parity.registry import KNOWN, LABELS, NAMES
from parity.driver.cluster import ray_for_this_command
from parity.driver.config import DEVICES, PRECISIONS, add_strategy_options

WEIGHTS_FILE = "init_weights.safetensors"


def build_parser(description: str = "") -> argparse.ArgumentParser:
    from parity.registry import classes

    p = OneLineParser(description)
    p.add_argument("--output_dir", required=True, help="the layer-check folder (shared weights, inputs, dumps)")
    p.add_argument("--verbose", action="store_true",
                   help="Ray's, DeepSpeed's and torch's output on the terminal, not in OUTPUT_DIR/layer_check.log")
    defaults = [LABELS[name] for name in NAMES]  # the registry's default rows
    p.add_argument("--strategy", choices=("all", *KNOWN), default=["all"], nargs="+",
                   help=f"all: {', '.join(defaults[:-1])} and {defaults[-1]}; or any of {', '.join(KNOWN)} (a "
                        f"pipeline on --pp_size stages × --dp_size), recorded into the same folder")
    p.add_argument("--strategy_class", default=None, metavar="MODULE:CLASS",
                   help="also record your own Strategy subclass's step (importable here and on the workers)")
    p.add_argument("--replay", default=None, metavar="RUN_DIR",
                   help="record step --step of a training run instead, from the DDP baseline's newest checkpoint at "
                        "or before it: its run folder <storage_path>/<experiment_name> or one checkpoint in it; the "
                        "model, data and optimizer settings are the run's (the flags marked 'not with --replay')")
    p.add_argument("--step", type=int, default=None, help="with --replay: the step to record (as the verdict names it)")
    p.add_argument("--model_name", default=None,
                   help="default: Qwen/Qwen2.5-0.5B with GPUs, qwen2-tiny without; not with --replay")
    p.add_argument("--num_layers", type=int, default=None, help="default: 2; not with --replay")
    p.add_argument("--batch_size", type=int, default=None,
                   help="samples per DP rank; default: 2, with --replay the run's global batch ÷ dp_size")
    p.add_argument("--grad_accum_steps", type=int, default=None,
                   help="split each DP rank's batch into N micro-batches, gradients accumulated over them (default 1)")
    p.add_argument("--seq_length", type=int, default=None,
                   help="default: 1024 with GPUs, 128 without; not with --replay")
    p.add_argument("--tp_size", type=int, default=2, help="TP size of DeepSpeed and FSDP (DDP runs at 1)")
    p.add_argument("--dp_size", type=int, default=None, help="default: 1, with --replay the run's")
    p.add_argument("--ep_size", type=int, default=1,
                   help="expert-parallel degree of the strategies that shard a mixture of experts' experts (DDP and "
                        "the others run at 1); it divides dp_size × tp_size")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default auto: bf16 on GPU, fp32 on CPU; not with --replay")
    p.add_argument("--learning_rate", type=float, default=None,
                   help="lr of the one optimizer step; default: 1e-5; not with --replay")
    p.add_argument("--seed", type=int, default=None, help="default: 42; not with --replay")
    p.add_argument("--packing", action="store_true",
                   help="a step of packed rows, position ids restarting per document (docs/finetune.md); not with "
                        "--replay (the run's)")
    p.add_argument("--padding_free", action="store_true",
                   help="each micro-batch fed as one row; each module's output is compared at its rows' positions; "
                        "not with --replay (the run's)")
    p.add_argument("--lora_r", type=int, default=None,
                   help="a step of LoRA adapters of rank R on the frozen base (docs/finetune.md): their modules and "
                        "gradients compared with the rest; not with --replay")
    p.add_argument("--lora_targets", default=None, help="the adapters' linear layers (default: peft's for the family)")
    p.add_argument("--lora_modules_to_save", default=None,
                   help="modules trained whole beside the adapters (peft's modules_to_save): embed_tokens,norm,...")
    p.add_argument("--objective", default=None,
                   help="a post-training objective (docs/posttrain.md), trained on --rollouts; not with --replay")
    p.add_argument("--objective_args", nargs="+", default=None, metavar="KEY=VALUE", help="the objective's settings")
    p.add_argument("--rollouts", default=None, help="the rollout file whose first step is recorded; not with --replay")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--launcher", choices=("ray", "local"), default="ray",
                   help="ray: Ray Train worker groups (a local Ray cluster, or RAY_ADDRESS's); local: processes of this "
                        "machine without Ray (gloo on CPU, NCCL on its GPUs: docs/gpu.md): the same recorded step "
                        "without Ray's start-up")
    p.add_argument("--perturb", default=None, metavar="STRATEGY:PARAM",
                   help="check the check: add 1e-3 to TP rank 0's shard of PARAM in STRATEGY's run")
    p.add_argument("--tolerance", type=non_negative_float, default=None, help="override the relative tolerance")
    p.add_argument("--noise_reference", choices=("auto", "on", "off"), default="auto",
                   help="also run DDP's step in fp32 (noise_reference_ddp.*), against which bf16 tolerances are "
                        "calibrated per tensor; auto: when the step is in a low-precision policy")
    add_strategy_options(p, classes(), given_only=True)
    return p


def check_layers(args: argparse.Namespace) -> int:
    """Resolve every strategy's run, write the folder's weights and inputs if it is new, run the recorded
    step of each strategy, compare. Returns the exit code."""
    from parity import storage
    from parity.commands.compare_layers import compare_and_report
    from parity.comparing.layers import load_dumps
    from parity.driver.config import resolve
    from parity.training.data import ROLLOUTS, training_data
    from parity.driver.launch import launch_runs
    from parity.layer_check.inputs import INPUTS_FILE, check_inputs, write_inputs
    from parity.layer_check.layer_step import layer_steps_worker
    from parity.driver.local_group import launch_local
    from parity.models.adapters import run_parameter_names, write_initial_adapters
    from parity.models.model import build_model, model_config_from_dict, save_init_weights
    from parity.layer_check.replay import check_folder, write_folder

    out = storage.local_path(args.output_dir)
    if out is None:
        raise ConfigError(f"--output_dir {args.output_dir}: the layer check's folder is a folder of this machine "
                          f"(its dumps are read back here, tensor by tensor): use a local path or a shared mount")
    storage.check_writable_dir("--output_dir", out)
    from parity.registry import load, path_of

    strategies = list(dict.fromkeys(s for name in args.strategy for s in (NAMES if name == "all" else [name])))
    paths = {s: path_of(s) for s in strategies}  # each strategy's class, by the name its dump goes under
    own = {}  # --strategy_class: the user's strategy, by its name, beside the others
    if args.strategy_class:
        own[load(args.strategy_class).name] = args.strategy_class
        strategies.append(next(iter(own)))
        paths.update(own)
    perturb = _parse_perturb(args.perturb, strategies)
    if args.ep_size > 1:
        for name in strategies:
            why = load(paths[name]).layer_check_refuses_ep
            if why:
                raise ConfigError(f"--ep_size with --strategy {name}: {why}")
    replay = _replay_start(args)
    weights, inputs = os.path.join(out, WEIGHTS_FILE), os.path.join(out, INPUTS_FILE)
    if os.path.exists(weights) != os.path.exists(inputs):
        have, lack = (WEIGHTS_FILE, INPUTS_FILE) if os.path.exists(weights) else (INPUTS_FILE, WEIGHTS_FILE)
        raise ConfigError(f"{out} has {have} but no {lack}: a layer-check folder needs both; use a fresh "
                          f"--output_dir (or delete {have})")
    fresh = not os.path.exists(weights)
    if not fresh:
        check_folder(replay, out)
    cluster = _cluster(args)
    options = _strategy_options(args, strategies)
    cfgs = {s: resolve(s, {**_run_values(args, s, out, cluster.gpus, options[s], replay, paths[s]),
                           **({"strategy_class": own[s]} if s in own else {})},
                       cluster=cluster, weights_written_before_launch=fresh) for s in strategies}
    first = cfgs[strategies[0]]
    for strategy, name in perturb.items():
        known = run_parameter_names(model_config_from_dict(first.model_config), first.lora)
        if name not in known:
            example = next((n for n in known if n.endswith("mlp.up_proj.weight")), known[0])
            raise ConfigError(f"--perturb {strategy}:{name}: the model has no parameter {name} (e.g. {example})")
    runs = [(cfgs[s], perturb.get(s)) for s in strategies]
    if "ddp" in cfgs and (args.noise_reference == "on" or
                          (args.noise_reference == "auto" and cfgs["ddp"].precision != "fp32")):
        reference = {**_run_values(args, "ddp", out, cluster.gpus, {}, replay, path_of("ddp")), "precision": "fp32",
                     "reduce_dtype": None, "grad_accum_dtype": None, "noise_reference": True,
                     "experiment_name": "layer_check_ddp_noise_reference"}
        runs.insert(1, (resolve("ddp", reference, cluster=cluster, weights_written_before_launch=fresh), None))
    if fresh and replay:  # the folder's shared weights and inputs, written once, on the driver
        write_folder(replay, out, weights, inputs, training_data(first))
        print(f"wrote {weights}, {inputs} and the optimizer state: step {replay.step} from "
              f"{replay.checkpoint or 'the initial weights'}")
    elif fresh:
        save_init_weights(build_model(model_config_from_dict(first.model_config), first.seed), weights)
        if first.lora is not None:  # the adapters' initial weights beside them, as a run's --save_init_weights
            write_initial_adapters(weights, model_config_from_dict(first.model_config), first.lora, first.seed)
        write_inputs(training_data(first), first.seed, inputs)
        print(f"wrote {weights} and {inputs}")
    for cfg, _ in runs:
        check_inputs(inputs, cfg)
    payloads = {cfg.experiment_name: {"output_dir": out, "perturb_param": perturb_param,
                                       **({"replay": {**replay.describe(), "batches": training_data(cfg)}} if replay
                                          else {"batches": training_data(cfg)} if cfg.dataset.startswith(ROLLOUTS)
                                          else {})} for cfg, perturb_param in runs}
    with console.terminal(os.path.join(out, "layer_check.log"), args.verbose) as log, console.pointing_to(log), \
            ray_for_this_command():
        group = [cfg for cfg, _ in runs]  # one worker group: a run of fewer workers on its first ranks
        group_payloads = [payloads[cfg.experiment_name] for cfg in group]
        if args.launcher == "local":
            launch_local(group, group_payloads, worker=layer_steps_worker)
        else:
            launch_runs(group, group_payloads, checkpoints=False, worker=layer_steps_worker)
    if len(load_dumps(out)) < 2:
        print(f"{out} has one dump so far; run the other strategies into it, then compare_dumps.py")
        return 0
    return compare_and_report(out, args.tolerance)


def _cluster(args):
    """What the runs are resolved for: the Ray cluster's resources, or with --launcher local this machine's CPUs."""
    from parity.driver.cluster import Cluster, probe_cluster

    if args.launcher == "ray":
        return probe_cluster()
    if args.device == "cuda":
        from parity.driver.local_group import local_cluster

        cluster = local_cluster("cuda")  # this machine's GPUs, one per rank (or the testing switch's one: docs/gpu.md)
        if not cluster.gpus:
            raise ConfigError("--launcher local --device cuda: torch sees no GPU on this machine: use --device cpu, "
                              "or --launcher ray for a cluster's GPUs")
        return cluster
    return Cluster(cpus=float(len(os.sched_getaffinity(0))), gpus=0)


def _replay_start(args):
    """--replay's start, after the flags it fixes are checked; None without --replay."""
    from parity.layer_check.replay import KEPT, find_start
    from parity.models.adapters import LORA_FLAGS

    if args.replay is None:
        if args.step is not None:
            raise ConfigError("--step is the step of a replay: add --replay RUN_DIR (the baseline's run folder)")
        return None
    if args.step is None:
        raise ConfigError("--replay needs --step: the step to record (the loss-curve verdict names it)")
    if storage.local_path(args.replay) is None:
        raise ConfigError(f"--replay {args.replay}: a replay reads the run's checkpoints from a folder of this "
                          f"machine: copy the run folder here (or use a shared mount) and pass its path")
    # the layer check's flags among them, given (a switch such as --packing: set)
    given = [name for name in (*KEPT, *LORA_FLAGS, "objective", "objective_args", "rollouts")
             if getattr(args, name, None) not in (None, False)]
    if given:
        raise ConfigError(f"--{given[0]} comes from the run in a replay: drop it")
    return find_start(args.replay, args.step)


def _run_values(args, strategy: str, out: str, gpus: int, options: dict, replay, path: str) -> dict:
    """The flags of one strategy's recorded step (its class at `path`). DDP, and any strategy that does not shard
    tensors, runs at TP=1 with the same DP size; a pipeline on pp_size × dp_size workers. A replay keeps the run's
    model, data and optimizer settings, and its global batch."""
    from parity.layer_check.replay import KEPT
    from parity.layout import given_pp_size, job_layout
    from parity.models.adapters import lora_flags
    from parity.objectives import objective_flags
    from parity.registry import load

    cls = load(path)
    dp = _given(args.dp_size, replay.config["dp_size"] if replay else 1)
    layout = job_layout(cls, tp_size=args.tp_size, dp_size=dp, pp_size=given_pp_size(cls, vars(args)),
                        ep_size=args.ep_size)  # its --tp_size, --pp_size, --ep_size where it has them
    if replay:
        batch = _given(args.batch_size, max(1, replay.global_batch_size // max(1, dp)))
        if batch * dp != replay.global_batch_size:
            raise ConfigError(f"--dp_size {dp} × --batch_size {batch} is not the run's global batch "
                              f"({replay.global_batch_size}): a replay keeps it")
        values = {**{k: replay.config.get(k) for k in KEPT}, **lora_flags(replay.config.get("lora")),
                  **objective_flags(replay.config.get("objective"), replay.config["dataset"])}
        if "rollouts" in values:  # (the rollout file is the run's data: --rollouts, not --dataset)
            values.pop("dataset")
    else:
        batch = _given(args.batch_size, 2)
        on_gpu = args.device == "cuda" or (args.device == "auto" and gpus >= layout["num_workers"])
        values = {"model_name": args.model_name or ("Qwen/Qwen2.5-0.5B" if on_gpu else "qwen2-tiny"),
                  "seq_length": _given(args.seq_length, None if args.rollouts else 1024 if on_gpu else 128),
                  "num_layers": _given(args.num_layers, 2), "precision": _given(args.precision, "auto"),
                  "learning_rate": _given(args.learning_rate, 1e-5), "seed": _given(args.seed, 42),
                  "packing": args.packing, "padding_free": args.padding_free, "lora_r": args.lora_r,
                  "lora_targets": args.lora_targets,
                  "lora_modules_to_save": args.lora_modules_to_save, "objective": args.objective,
                  "objective_args": args.objective_args, "rollouts": args.rollouts}
    return {
        **values, "batch_size": batch, **layout,
        "device": args.device,
        "debug_steps": 1, "grad_accum_steps": _given(args.grad_accum_steps, 1),
        "init_weights_path": os.path.join(out, WEIGHTS_FILE), "loss_output_dir": out,
        "storage_path": os.path.join(out, "ray"), "experiment_name": f"layer_check_{strategy}", **options,
    }


def _given(value, default):
    """A flag's value, or its default when not given (a replay's defaults come from the run)."""
    return default if value is None else value


def _strategy_options(args: argparse.Namespace, strategies: list[str]) -> dict[str, dict]:
    """The strategy flags given, handed to the strategy that has them; one for no selected strategy is an error."""
    from parity.registry import flags_for, option_owners, unrun_option

    given = {k: v for k, v in vars(args).items() if k in option_owners()}
    unrun = unrun_option(given, strategies)
    if unrun:
        raise ConfigError(f"--{unrun[0]} is a {unrun[1]} flag, but --strategy {' '.join(args.strategy)} runs no "
                          f"{unrun[1]} step: drop it or run --strategy all")
    return {s: flags_for(s, given) for s in strategies}


def _parse_perturb(spec: str | None, strategies: list[str]) -> dict[str, str]:
    if not spec:
        return {}
    strategy, _, param = spec.partition(":")
    if strategy not in strategies or not param:
        raise ConfigError(f"--perturb {spec}: expected STRATEGY:PARAM with STRATEGY one of {', '.join(strategies)}")
    return {strategy: param}


def main(argv: list[str] | None = None, description: str = "") -> int:
    args = build_parser(description).parse_args(argv)
    return run_command(lambda: check_layers(args), "a layer-check run")
