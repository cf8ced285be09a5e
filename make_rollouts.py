#!/usr/bin/env python
"""Write a rollout file from any model: what each optimizer step of a GRPO- or DPO-family run consumes, sampled from
the run's initial weights and scored by a simple verifiable reward (docs/posttrain.md). Every train_*.py then trains
it with --objective NAME --rollouts FILE:

    python make_rollouts.py --model_name qwen2-tiny --init_weights_path /tmp/w/init.pt --save_init_weights \
        --family grpo --steps 4 --prompts_per_step 2 --num_generations 4 --output /tmp/rollouts.safetensors
    python train_ddp.py --model_name qwen2-tiny --init_weights_path /tmp/w/init.pt --num_workers 2 \
        --batch_size 4 --objective dapo --objective_args beta=0.04 --rollouts /tmp/rollouts.safetensors
"""

from parity.commands.common import exit_now
from parity.commands.make_rollouts import main

if __name__ == "__main__":
    exit_now(main())
