#!/usr/bin/env python
"""Compare the loss records of the strategies against a baseline (DDP by default): PASS or FAIL.

    python plot_loss_curves.py --input_dir OUT/loss_curves --output OUT/loss_curves/loss_curves.png

Checks first that the runs are comparable (same initial weights, model, optimizer settings, batches,
tokens and learning rate at every step), then prints the statistics block and a verdict per run, and
writes the figure (.png, .svg or .pdf), curve_comparison.json and curve_report.md beside it.
Exit codes: 0 every run PASSes, 1 a run FAILs, 2 bad input or runs that are not comparable, 70 an error of the
harness itself (its traceback in a file of --input_dir).
"""

from parity.commands.common import exit_now
from parity.commands.compare_curves import main

if __name__ == "__main__":
    exit_now(main(description=__doc__))
