"""compare_dumps.py: compare the single-step dumps of a layer-check folder, pair by pair."""

from __future__ import annotations

import argparse
import os

from parity.commands.common import OneLineParser, non_negative_float, run_command


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = OneLineParser(description)
    p.add_argument("--input_dir", required=True, help="the folder run_verification.py wrote")
    p.add_argument("--tolerance", type=non_negative_float, default=None,
                   help="relative tolerance for every tensor (default: from the runs' precision, "
                        "parity/comparing/tolerances.py)")
    p.add_argument("--heatmap", default=None,
                   help="heatmap file, .png/.svg/.pdf (default INPUT_DIR/layer_heatmap.png)")
    return p


def compare_and_report(input_dir: str, tolerance: float | None = None, heatmap: str | None = None) -> int:
    """Compare every pair of dumps, print the summary, write the outputs; returns the exit code
    (0 every pair agrees, 1 a pair diverges)."""
    from parity.comparing.html_report import refresh_comparison_beside
    from parity.comparing.layer_report import HEATMAP_NAME, console_summary, write_outputs
    from parity.comparing.layers import compare_all, load_dumps, load_noise_reference

    dumps = load_dumps(input_dir)
    results = compare_all(dumps, tolerance, load_noise_reference(input_dir, dumps))
    print(console_summary(dumps, results))
    written = write_outputs(input_dir, dumps, results, heatmap or os.path.join(input_dir, HEATMAP_NAME))
    print(f"\nwrote {', '.join(written)}")
    refreshed = refresh_comparison_beside(input_dir)  # a replay of a FAIL's step: its comparison's page names the module
    if refreshed:
        print(f"wrote {refreshed} again: the comparison's page, with this layer check")
    return 0 if all(r.verdict.passed for r in results) else 1


def main(argv: list[str] | None = None, description: str = "") -> int:
    args = build_parser(description).parse_args(argv)
    return run_command(lambda: compare_and_report(args.input_dir, args.tolerance, args.heatmap), "the comparison")
