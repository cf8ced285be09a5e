#!/usr/bin/env python
"""Compare the single-step dumps of a verification folder, tensor by tensor, and locate the first
divergence: for every pair of runs (DDP vs DeepSpeed, DDP vs FSDP, DeepSpeed vs FSDP) the norm in each,
the max absolute and relative difference per module output, output gradient, parameter gradient and
updated parameter; "bit-identical" when it is. Writes comparison.md, comparison.json and a heatmap.

    python compare_dumps.py --input_dir OUT/verify_tp

Exit 0: every pair within tolerance; 1: a pair diverges; 2: bad input.
"""

import argparse
import os
import sys



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_dir", required=True, help="the folder run_verification.py wrote")
    p.add_argument("--tolerance", type=float, default=None,
                   help="relative tolerance for every tensor (default: 1e-5 for fp32, 6e-2 when a run is bf16)")
    p.add_argument("--heatmap", default=None, help="heatmap file, .png/.svg/.pdf (default INPUT_DIR/heatmap.png)")
    return p.parse_args(argv)


def compare(input_dir: str, tolerance=None, heatmap=None) -> int:
    """Compare, print the summary, write the outputs; returns the exit code."""
    from parity.layer_compare import compare_all, load_dumps
    from parity.layer_report import console_summary, write_outputs

    dumps = load_dumps(input_dir)
    results = compare_all(dumps, tolerance)
    print(console_summary(dumps, results))
    write_outputs(input_dir, dumps, results, heatmap or os.path.join(input_dir, "heatmap.png"))
    print(f"\nwrote {os.path.join(input_dir, 'comparison.md')}, comparison.json and the heatmap")
    return 0 if all(r.passed for r in results) else 1


def main(argv=None) -> int:
    from parity.cli import exit_code

    args = parse_args(argv)
    return exit_code(lambda: compare(args.input_dir, args.tolerance, args.heatmap), "the comparison")


if __name__ == "__main__":
    sys.exit(main())
