#!/usr/bin/env python
"""The layer check: single-step, layer-by-layer verification (seed 001) on full tensors, locating the first
divergence.

    python run_verification.py --output_dir OUT/verify_tp                                  # TP=2×DP=1
    python run_verification.py --output_dir OUT/verify_tp_dp2 --tp_size 2 --dp_size 2      # 2-D
    python run_verification.py --output_dir OUT/verify_tp --strategy fsdp                  # one strategy
    python compare_dumps.py --input_dir OUT/verify_tp                                      # re-compare

The first run writes the folder's init_weights.safetensors and inputs.safetensors (input_ids and labels:
the whole global batch); every later run, of any strategy, loads them. DDP runs at TP=1 with the same DP
size. Each strategy runs one recorded step through Ray Train and writes dump_<strategy>.*; then every
pair of dumps in the folder is compared (compare_dumps.py). Strategy flags (--zero_stage,
--mixed_precision, ...) go to the strategy that has them.

Defaults: with GPUs the seed configuration (Qwen/Qwen2.5-0.5B, 2 layers, batch 2, seq 1024); without,
qwen2-tiny with seq 128, so it runs on a laptop. Exit 0: all pairs agree; 1: a divergence (or a failed
run); 2: bad input.
"""

from parity.commands.common import exit_now
from parity.commands.layer_check import main

if __name__ == "__main__":
    exit_now(main(description=__doc__))
