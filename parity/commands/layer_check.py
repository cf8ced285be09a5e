"""run_verification.py: the layer check. One recorded optimizer step per strategy (seed 001), on full
tensors, from the folder's shared weights and inputs; then every pair of dumps is compared."""

from __future__ import annotations

import argparse
import os

from parity.commands.common import OneLineParser, non_negative_float, run_command
from parity.errors import ConfigError
from parity.registry import NAMES
from parity.training.config import DEVICES, PRECISIONS, add_strategy_options

WEIGHTS_FILE = "init_weights.safetensors"


def build_parser(description: str = "") -> argparse.ArgumentParser:
    from parity.registry import strategy_class

    p = OneLineParser(description)
    p.add_argument("--output_dir", required=True, help="the layer-check folder (shared weights, inputs, dumps)")
    p.add_argument("--strategy", choices=("all", *NAMES), default="all")
    p.add_argument("--model_name", default=None, help="default: Qwen/Qwen2.5-0.5B with GPUs, qwen2-tiny without")
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=2, help="samples per DP rank")
    p.add_argument("--seq_length", type=int, default=None, help="default: 1024 with GPUs, 128 without")
    p.add_argument("--tp_size", type=int, default=2, help="TP size of DeepSpeed and FSDP (DDP runs at 1)")
    p.add_argument("--dp_size", type=int, default=1)
    p.add_argument("--precision", choices=PRECISIONS, default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--learning_rate", type=float, default=1e-5, help="lr of the one optimizer step")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--perturb", default=None, metavar="STRATEGY:PARAM",
                   help="check the check: add 1e-3 to TP rank 0's shard of PARAM in STRATEGY's run")
    p.add_argument("--tolerance", type=non_negative_float, default=None, help="override the relative tolerance")
    p.add_argument("--noise_reference", choices=("auto", "on", "off"), default="auto",
                   help="also run DDP's step in fp32 (noise_reference_ddp.*), against which bf16 tolerances are "
                        "calibrated per tensor; auto: when the step is bf16")
    add_strategy_options(p, [strategy_class(name) for name in NAMES], given_only=True)
    return p


def check_layers(args: argparse.Namespace) -> int:
    """Resolve every strategy's run, write the folder's weights and inputs if it is new, run the recorded
    step of each strategy, compare. Returns the exit code."""
    from parity import storage
    from parity.commands.compare_layers import compare_and_report
    from parity.comparing.layers import load_dumps
    from parity.training.cluster import probe_cluster
    from parity.training.config import resolve
    from parity.training.data import training_data
    from parity.training.launch import launch
    from parity.training.layer_step import INPUTS_FILE, check_inputs, layer_step_worker, write_inputs
    from parity.training.model import build_model, model_config_from_dict, parameter_names, save_init_weights

    out = storage.local_path(args.output_dir)
    if out is None:
        raise ConfigError(f"--output_dir {args.output_dir}: the layer check's folder is a folder of this machine "
                          f"(its dumps are read back here, tensor by tensor): use a local path or a shared mount")
    storage.check_writable_dir("--output_dir", out)
    strategies = list(NAMES) if args.strategy == "all" else [args.strategy]
    perturb = _parse_perturb(args.perturb, strategies)
    weights, inputs = os.path.join(out, WEIGHTS_FILE), os.path.join(out, INPUTS_FILE)
    if os.path.exists(weights) != os.path.exists(inputs):
        have, lack = (WEIGHTS_FILE, INPUTS_FILE) if os.path.exists(weights) else (INPUTS_FILE, WEIGHTS_FILE)
        raise ConfigError(f"{out} has {have} but no {lack}: a layer-check folder needs both; use a fresh "
                          f"--output_dir (or delete {have})")
    fresh = not os.path.exists(weights)
    cluster = probe_cluster()
    options = _strategy_options(args, strategies)
    cfgs = {s: resolve(s, _run_values(args, s, out, cluster.gpus, options[s]), cluster=cluster,
                       weights_written_before_launch=fresh) for s in strategies}
    first = cfgs[strategies[0]]
    for strategy, name in perturb.items():
        known = parameter_names(model_config_from_dict(first.model_config))
        if name not in known:
            example = next((n for n in known if n.endswith("mlp.up_proj.weight")), known[0])
            raise ConfigError(f"--perturb {strategy}:{name}: the model has no parameter {name} (e.g. {example})")
    runs = [(cfgs[s], perturb.get(s)) for s in strategies]
    if "ddp" in cfgs and (args.noise_reference == "on" or
                          (args.noise_reference == "auto" and cfgs["ddp"].precision == "bf16")):
        reference = {**_run_values(args, "ddp", out, cluster.gpus, {}), "precision": "fp32", "noise_reference": True,
                     "experiment_name": "layer_check_ddp_noise_reference"}
        runs.insert(1, (resolve("ddp", reference, cluster=cluster, weights_written_before_launch=fresh), None))
    if fresh:  # the folder's shared weights and inputs, written once, on the driver
        save_init_weights(build_model(model_config_from_dict(first.model_config), first.seed), weights)
        write_inputs(training_data(first), first.seed, inputs)
        print(f"wrote {weights} and {inputs}")
    for cfg, _ in runs:
        check_inputs(inputs, cfg)
    for cfg, perturb_param in runs:
        launch(cfg, layer_step_worker, {"output_dir": out, "perturb_param": perturb_param})
    if len(load_dumps(out)) < 2:
        print(f"{out} has one dump so far; run the other strategies into it, then compare_dumps.py")
        return 0
    return compare_and_report(out, args.tolerance)


def _run_values(args, strategy: str, out: str, gpus: int, options: dict) -> dict:
    """The flags of one strategy's recorded step. DDP runs at TP=1 with the same DP size."""
    tp = 1 if strategy == "ddp" else args.tp_size
    on_gpu = args.device == "cuda" or (args.device == "auto" and gpus >= tp * args.dp_size)
    return {
        "model_name": args.model_name or ("Qwen/Qwen2.5-0.5B" if on_gpu else "qwen2-tiny"),
        "num_layers": args.num_layers, "batch_size": args.batch_size,
        "seq_length": args.seq_length or (1024 if on_gpu else 128),
        "tp_size": tp, "dp_size": args.dp_size, "num_workers": tp * args.dp_size, "device": args.device,
        "precision": args.precision, "learning_rate": args.learning_rate, "seed": args.seed, "debug_steps": 1,
        "init_weights_path": os.path.join(out, WEIGHTS_FILE), "loss_output_dir": out,
        "storage_path": os.path.join(out, "ray"), "experiment_name": f"layer_check_{strategy}", **options,
    }


def _strategy_options(args: argparse.Namespace, strategies: list[str]) -> dict[str, dict]:
    """The strategy flags given, handed to the strategy that has them; one for no selected strategy is an error."""
    from parity.registry import strategy_class

    given = vars(args)
    chosen = {s: {o.name: given[o.name] for o in strategy_class(s).options if o.name in given} for s in strategies}
    for name in NAMES:
        for option in strategy_class(name).options:
            if option.name in given and name not in strategies:
                raise ConfigError(f"--{option.name} is a {name} flag, but --strategy {args.strategy} runs no {name} "
                                  f"step: drop it or run --strategy all")
    return chosen


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
