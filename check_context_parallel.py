#!/usr/bin/env python
"""Does torch's context parallelism (ring attention over --cp_size ranks) give the loss and gradients of the whole
sequence in one process? One forward and backward of the model both ways, compared.

    python check_context_parallel.py --cp_size 2            # GPUs: nccl; CPU: gloo, where torch cannot run it

Exit 0: PASS; 1: FAIL, or context parallelism did not run (the line says what torch raised); 2: bad input.
docs/context_parallel.md: what fails on CPU and why.
"""

from parity.commands.common import exit_now
from parity.commands.context_parallel import main

if __name__ == "__main__":
    exit_now(main(description=__doc__))
