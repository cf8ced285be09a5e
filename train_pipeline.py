#!/usr/bin/env python
"""Train a model with pipeline parallelism (torch.distributed.pipelining) under Ray Train, from DDP's initial weights.

Run train_ddp.py with --save_init_weights first: this loads the initial weights it wrote.

    python train_pipeline.py --model_name qwen2-tiny --num_layers 4 --num_workers 4 --pp_size 2 --dp_size 2 \
        --pp_schedule 1f1b --microbatches 2 --batch_size 2 --seq_length 128 --debug_steps 100 \
        --loss_output_dir /tmp/loss_curves --init_weights_path /tmp/shared_weights/init_weights.pt

Flags, the shared loop and the launcher live in parity/; what the pipeline does differently is pipeline_strategy.py.
"""

from parity.commands.common import exit_now
from parity.commands.train import main

if __name__ == "__main__":
    exit_now(main("pipeline", __doc__))
