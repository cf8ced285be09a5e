#!/usr/bin/env python
"""Compare the single-step dumps of a layer-check folder, tensor by tensor, and locate the first
divergence: for every pair of runs (DDP vs DeepSpeed, DDP vs FSDP, DeepSpeed vs FSDP) the norm in each,
the max absolute and relative difference per module output, output gradient, parameter gradient and
updated parameter; "bit-identical" when it is. Writes layer_report.md, layer_comparison.json and a heatmap.

    python compare_dumps.py --input_dir OUT/verify_tp

Exit 0: every pair within tolerance; 1: a pair diverges; 2: bad input.
"""

from parity.commands.common import exit_now
from parity.commands.compare_layers import main

if __name__ == "__main__":
    exit_now(main(description=__doc__))
