"""plot_loss_curves.py: the loss-curve comparison of the records in a folder, PASS or FAIL."""

from __future__ import annotations

import argparse
import sys

from parity.commands.common import OneLineParser, non_negative_float, run_command


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = OneLineParser(description)
    p.add_argument("--input_dir", required=True, help="folder with the loss_<strategy>.json records (a local "
                                                      "folder or a URI: s3://, gs://, …)")
    p.add_argument("--output", required=True, help="figure path or URI; .png, .svg or .pdf")
    p.add_argument("--baseline", default="ddp", help="strategy name of the reference run")
    p.add_argument("--tolerance", type=non_negative_float, default=None,
                   help="relative per-step loss tolerance for every run (default: from the runs' precision)")
    p.add_argument("--grad_norm_tolerance", type=non_negative_float, default=None,
                   help="relative per-step tolerance on the pre-clip grad norm (default: from the runs' precision)")
    p.add_argument("--allow_incomplete", action="store_true",
                   help="compare runs still in progress, over the steps every run has done")
    p.add_argument("--allow_fingerprint_mismatch", action="store_true",
                   help="compare runs whose shared code or library versions differ (refused by default: a difference "
                        "could then come from either)")
    return p


def compare_and_report(input_dir: str, output: str, baseline: str = "ddp", tolerance: float | None = None,
                       grad_norm_tolerance: float | None = None, allow_incomplete: bool = False,
                       allow_fingerprint_mismatch: bool = False) -> int:
    """Compare, print the statistics block and the verdicts, write the outputs and add them to the experiment
    trackers the records name (--report_to; a tracker that fails is a warning); returns the exit code (0 PASS, 1
    FAIL). Raises ConfigError (NotComparable, RecordError) before anything is written."""
    from parity import storage
    from parity.comparing.curve_report import statistics_text, write_outputs
    from parity.comparing.curves import compare, load_references, load_runs
    from parity.comparing.figures import curve_png, figure_format
    from parity.tracking.trackers import report_comparison

    figure_format(output)
    comparison = compare(load_runs(input_dir), baseline, tolerance, allow_incomplete, grad_norm_tolerance,
                         references=load_references(input_dir), allow_fingerprint_mismatch=allow_fingerprint_mismatch)
    storage.check_writable_dir("--output's directory", storage.parent(storage.absolute(output)))
    for warning in comparison.warnings:
        print(warning, file=sys.stderr)
    print(statistics_text(comparison))
    try:
        written = write_outputs(comparison, output)
    except OSError as exc:
        print(f"error: cannot write the outputs beside {output} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    print(f"\nwrote {', '.join(written)}")
    for line in report_comparison(comparison, written, curve_png(comparison, written[0])):
        print(line, file=sys.stderr if line.startswith("warning") else sys.stdout)
    return 0 if comparison.passed else 1


def main(argv: list[str] | None = None, description: str = "") -> int:
    args = build_parser(description).parse_args(argv)
    return run_command(lambda: compare_and_report(args.input_dir, args.output, args.baseline, args.tolerance,
                                                  args.grad_norm_tolerance, args.allow_incomplete,
                                                  args.allow_fingerprint_mismatch),
                       "the comparison", trace_dir=args.input_dir)
