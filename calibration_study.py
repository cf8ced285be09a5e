#!/usr/bin/env python
"""The calibration study of the bf16 verdict: clean DeepSpeed and FSDP runs over many seeds and CPU kernel
paths, and the seeded-bug catalogue over a few, each measured against every candidate noise reference
(docs/tolerances.md has the results and what was chosen from them).

    python calibration_study.py --output_dir OUT/calibration                 # 20 seeds × 3 kernel paths, bugs × 5
    python calibration_study.py --output_dir OUT/calibration --shapes wide --seeds 42-44 --bug_seeds 42 \\
        --kernels default                                                     # the Qwen2.5-0.5B layer shape

Runs in local gloo groups on this machine's CPU; run again on the same folder to continue a study that stopped.
"""

from parity.commands.common import exit_now
from parity.commands.calibration_study import main

if __name__ == "__main__":
    exit_now(main(description=__doc__))
