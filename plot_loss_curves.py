#!/usr/bin/env python
"""Compare the loss records of the strategies against a baseline (DDP by default): PASS or FAIL.

    python plot_loss_curves.py --input_dir OUT/loss_curves --output OUT/loss_curves/loss_curves.png

Checks first that the runs are comparable (same initial weights, model, optimizer settings, batches,
tokens and learning rate at every step), then prints the statistics block and a verdict per run, and
writes the figure (.png, .svg or .pdf), comparison.json and report.md beside it.
Exit codes: 0 every run PASSes, 1 a run FAILs, 2 bad input or runs that are not comparable.
The logic is in parity/compare.py; the words in parity/report.py; the figure in parity/plot.py.
"""

import argparse
import math
import os
import sys

from parity.compare import NotComparable, compare, load_runs
from parity.config import check_writable_dir
from parity.errors import ConfigError
from parity.plot import figure_format
from parity.record import RecordError
from parity.report import statistics_text, write_outputs


def relative_tolerance(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got {text})")
    return value


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_dir", required=True, help="folder with the loss_<strategy>.json records")
    p.add_argument("--output", required=True, help="figure path; .png, .svg or .pdf")
    p.add_argument("--baseline", default="ddp", help="strategy name of the reference run")
    p.add_argument("--tolerance", type=relative_tolerance, default=None,
                   help="relative per-step loss tolerance for every run (default: from the runs' precision)")
    p.add_argument("--grad_norm_tolerance", type=relative_tolerance, default=None,
                   help="relative per-step tolerance on the pre-clip grad norm (default: from the runs' precision)")
    p.add_argument("--allow_incomplete", action="store_true",
                   help="compare runs still in progress, over the steps every run has done")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        figure_format(args.output)
        comparison = compare(load_runs(args.input_dir), args.baseline, args.tolerance, args.allow_incomplete,
                             args.grad_norm_tolerance)
        check_writable_dir("--output's directory", os.path.dirname(os.path.abspath(args.output)))
    except NotComparable as exc:
        for mismatch in exc.mismatches:
            print(f"error: not comparable: {mismatch}", file=sys.stderr)
        return 2
    except (ConfigError, RecordError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for warning in comparison.warnings:
        print(warning, file=sys.stderr)
    print(statistics_text(comparison))
    try:
        written = write_outputs(comparison, args.output)
    except OSError as exc:
        print(f"error: cannot write the outputs beside {args.output} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    print(f"\nwrote {', '.join(written)}")
    return 0 if comparison.passed else 1


if __name__ == "__main__":
    sys.exit(main())
