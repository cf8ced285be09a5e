#!/usr/bin/env python
"""Single-step, layer-by-layer verification (seed 001), on full tensors, locating the first divergence.

    python run_verification.py --output_dir OUT/verify_tp                                  # TP=2×DP=1
    python run_verification.py --output_dir OUT/verify_tp_dp2 --tp_size 2 --dp_size 2      # 2-D
    python run_verification.py --output_dir OUT/verify_tp --strategy fsdp                  # one strategy
    python compare_dumps.py --input_dir OUT/verify_tp                                      # re-compare

The first run writes the folder's init_weights.safetensors and inputs.safetensors (input_ids and labels:
the whole global batch); every later run, of any strategy, loads them. DDP runs at TP=1 with the same DP
size. Each strategy runs one recorded step through Ray Train and writes dump_<strategy>.*; then every
pair of dumps in the folder is compared (compare_dumps.py). Strategy flags (--zero_stage,
--mixed_precision, ...) are passed on to the strategies that have them.

Defaults: with GPUs the seed configuration (Qwen/Qwen2.5-0.5B, 2 layers, batch 2, seq 1024); without,
qwen2-tiny with seq 128, so it runs on a laptop. Exit 0: all pairs agree; 1: a divergence (or a failed
run); 2: bad input.
"""

import argparse
import os
import sys

from parity.config import DEVICES, PRECISIONS, build_parser as strategy_parser, check_writable_dir, to_argv
from parity.errors import ConfigError
from parity.strategies import STRATEGY_MODULES, strategy_class
from parity.verify import INPUTS_FILE, WEIGHTS_FILE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True, help="the verification folder (shared weights, inputs, dumps)")
    p.add_argument("--strategy", choices=("all", *STRATEGY_MODULES), default="all")
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
                   help="check the verifier: add 1e-3 to TP rank 0's shard of PARAM in STRATEGY's run")
    p.add_argument("--tolerance", type=float, default=None, help="override the relative tolerance")
    return p


def main(argv=None) -> int:
    from parity.cli import exit_code

    args, extras = build_parser().parse_known_args(argv)
    return exit_code(lambda: verify(args, extras), "a verification run")


def verify(args, extras: list[str]) -> int:
    from compare_dumps import compare
    from parity.cli import prepare
    from parity.launch import launch
    from parity.layer_compare import load_dumps
    from parity.model import build_model, resolve_model_config, save_init_weights
    from parity.verify import check_inputs, verify_worker, write_inputs

    out = os.path.abspath(args.output_dir)
    check_writable_dir("--output_dir", out)
    strategies = list(STRATEGY_MODULES) if args.strategy == "all" else [args.strategy]
    perturb = _parse_perturb(args.perturb, strategies)
    weights, inputs = os.path.join(out, WEIGHTS_FILE), os.path.join(out, INPUTS_FILE)
    if os.path.exists(weights) != os.path.exists(inputs):
        have, lack = (WEIGHTS_FILE, INPUTS_FILE) if os.path.exists(weights) else (INPUTS_FILE, WEIGHTS_FILE)
        raise ConfigError(f"{out} has {have} but no {lack}: a verification folder needs both; use a fresh "
                          f"--output_dir (or delete {have})")
    fresh = not os.path.exists(weights)
    options = _strategy_options(strategies, extras)
    cfgs = {s: prepare(s, _strategy_argv(args, s, out, options[s], save=fresh)) for s in strategies}
    first = cfgs[strategies[0]]
    model_config = resolve_model_config(first.model_name, first.num_layers)
    if fresh:  # the folder's shared weights and inputs, written once, on the driver
        save_init_weights(build_model(model_config, first.seed), weights)
        write_inputs(first, model_config, inputs)
        print(f"wrote {weights} and {inputs}")
    for s in strategies:
        cfgs[s] = prepare(s, _strategy_argv(args, s, out, options[s], save=False))
        check_inputs(inputs, cfgs[s], model_config.vocab_size)
    for s in strategies:
        launch(cfgs[s], verify_worker, {"output_dir": out, "perturb_param": perturb.get(s)})
    if len(load_dumps(out)) < 2:
        print(f"{out} has one dump so far; run the other strategies into it, then compare_dumps.py")
        return 0
    return compare(out, args.tolerance)


def _strategy_argv(args, strategy: str, out: str, options: list[str], save: bool) -> list[str]:
    tp = 1 if strategy == "ddp" else args.tp_size
    on_gpu = args.device == "cuda" or (args.device == "auto" and _has_gpus(tp * args.dp_size))
    flags = {
        "model_name": args.model_name or ("Qwen/Qwen2.5-0.5B" if on_gpu else "qwen2-tiny"),
        "num_layers": args.num_layers, "batch_size": args.batch_size,
        "seq_length": args.seq_length or (1024 if on_gpu else 128),
        "tp_size": tp, "dp_size": args.dp_size, "num_workers": tp * args.dp_size, "device": args.device,
        "precision": args.precision, "learning_rate": args.learning_rate, "seed": args.seed, "debug_steps": 1,
        "init_weights_path": os.path.join(out, WEIGHTS_FILE), "save_init_weights": save,
        "loss_output_dir": out, "storage_path": os.path.join(out, "ray"), "experiment_name": f"verify_{strategy}",
    }
    return to_argv(flags) + options


def _strategy_options(strategies: list[str], extras: list[str]) -> dict[str, list[str]]:
    """Hand each strategy the extra flags its own parser accepts; an extra none accepts is an error."""
    accepted, options = set(), {}
    for s in strategies:
        parser = strategy_parser(s, "", strategy_class(s).add_arguments)
        flags = {o for a in parser._actions for o in a.option_strings}
        options[s], i = [], 0
        while i < len(extras):
            arg = extras[i]
            takes_value = i + 1 < len(extras) and not extras[i + 1].startswith("--")
            if arg.split("=")[0] in flags:
                options[s] += extras[i:i + 1 + takes_value]
                accepted.add(i)
            i += 1 + takes_value
    rejected = [extras[i] for i in range(len(extras)) if extras[i].startswith("--") and i not in accepted]
    if rejected:
        raise ConfigError(f"{rejected[0]} is not a flag of run_verification.py nor of "
                          f"{', '.join(strategies)}: see --help and the train_*.py --help")
    return options


def _parse_perturb(spec: str | None, strategies: list[str]) -> dict[str, str]:
    if not spec:
        return {}
    strategy, _, param = spec.partition(":")
    if strategy not in strategies or not param:
        raise ConfigError(f"--perturb {spec}: expected STRATEGY:PARAM with STRATEGY one of {', '.join(strategies)}")
    return {strategy: param}


def _has_gpus(n: int) -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= n


if __name__ == "__main__":
    sys.exit(main())
