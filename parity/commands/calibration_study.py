"""calibration_study.py: the calibration study of the bf16 verdict (parity/calibration/study.py) — clean runs over
many seeds and CPU kernel paths, the seeded-bug catalogue over a few, every run measured against every candidate
noise reference; writes calibration_study.{json,md,png} into --output_dir. Runs in local gloo groups on this
machine's CPU (no Ray, no GPU); a study that stopped continues where it was when run again with the same folder."""

from __future__ import annotations

import argparse
import os

from parity.calibration.study import (CATALOGUE, KERNELS, POLICIES, SHAPES, analyze, chosen_reference, plan_study,
                                      run_study, summarize, summarize_tensors, write_outputs)
from parity.commands.common import OneLineParser, run_command
from parity.driver.local_group import KERNEL_PATHS
from parity.errors import ConfigError


def seed_list(text: str) -> list[int]:
    """'42-61' or '42,45,50' (or both, comma-separated) → the seeds."""
    seeds = []
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            seeds += list(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 42-61 or 42,43 (got {text})") from None
    return seeds


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = OneLineParser(description)
    p.add_argument("--output_dir", required=True, help="the study's folder: runs/, weights/ and the results")
    p.add_argument("--seeds", type=seed_list, default=seed_list("42-61"), help="seeds of the clean runs")
    p.add_argument("--bug_seeds", type=seed_list, default=seed_list("42-46"),
                   help="seeds of the seeded-bug catalogue (among --seeds)")
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help=f"CPU kernel paths, comma-separated: {', '.join(KERNEL_PATHS)}")
    p.add_argument("--shapes", default="tiny", help=f"model shapes, comma-separated: {', '.join(SHAPES)} "
                                                    f"(wide: the clean part only)")
    p.add_argument("--policies", default="bf16", help=f"precision policies, comma-separated: {', '.join(POLICIES)} "
                                                      f"(bf16: the study; the others: their clean runs at every seed)")
    p.add_argument("--analyze_only", action="store_true", help="measure the runs already in the folder")
    return p


def study(args) -> int:
    kernels, shapes, policies = args.kernels.split(","), args.shapes.split(","), args.policies.split(",")
    for name, given, known in (("--kernels", kernels, KERNEL_PATHS), ("--shapes", shapes, SHAPES),
                               ("--policies", policies, POLICIES)):
        unknown = [k for k in given if k not in known]
        if unknown:
            raise ConfigError(f"{name} {unknown[0]}: use one of {', '.join(known)}")
    if not set(args.bug_seeds) <= set(args.seeds):
        raise ConfigError("--bug_seeds must be among --seeds: a bug is judged against its seed's baseline")
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    planned = plan_study(shapes, kernels, args.seeds, args.bug_seeds, CATALOGUE, policies)
    wall = 0.0 if args.analyze_only else run_study(out, planned)
    rows = analyze(out, planned)
    summary = summarize(rows)
    by_policy = {p: summarize(rows, policy=p).get(chosen_reference(p)) for p in policies if p != "bf16"}
    settings = {"seeds": args.seeds, "bug_seeds": args.bug_seeds, "kernels": kernels, "shapes": shapes,
                "policies": policies}
    tensors = summarize_tensors(rows)
    for path in write_outputs(out, rows, summary, wall, settings, by_policy, tensors):
        print(f"wrote {path}")
    if tensors["clean_runs"]:
        print(f"per tensor   clean runs {tensors['clean_runs']}, false alarms {tensors['false_alarms']} (max deviation "
              f"÷ bound {tensors['clean_max_ratio']:.2f}; worst {tensors['worst_clean']})")
    for policy, s in by_policy.items():
        if s:
            print(f"{policy:11s} clean runs {s['clean_runs']}, false alarms {s['false_alarms']} (max deviation ÷ noise "
                  f"{s['clean_max_ratio']:.1f}, drift {s['clean_max_drift']:.1f}; worst {s['worst_clean']})")
    for candidate, s in summary.items():
        print(f"{candidate:11s} clean runs {s['clean_runs']}, false alarms {s['false_alarms']} (max deviation ÷ noise "
              f"{s['clean_max_ratio']:.1f}, drift {s['clean_max_drift']:.1f}); bug runs {s['bug_runs']}, missed "
              f"{s['missed']}")
    return 0


def main(argv: list[str] | None = None, description: str = "") -> int:
    args = build_parser(description).parse_args(argv)
    return run_command(lambda: study(args), "the calibration study")
