#!/usr/bin/env python
"""Judge the inputs of an RL update from a rollout file written by any framework: the sampler's log-probs against the
trainer's model rescoring each sequence at the same weights, and the advantages against the estimator named
(docs/sampler.md):

    python check_rollouts.py --rollouts rollouts.safetensors --model_name qwen2-tiny --init_weights_path init.pt

Exit 0: every judged part PASSes; 1: one FAILs; 2: bad input.
"""

from parity.commands.common import exit_now
from parity.commands.check_rollouts import main

if __name__ == "__main__":
    exit_now(main())
