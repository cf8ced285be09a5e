#!/usr/bin/env python
"""Train a model with DistributedDataParallel under Ray Train: the baseline the other strategies match.

Run it first with --save_init_weights: it writes the initial weights every other strategy loads.

    python train_ddp.py --model_name Qwen/Qwen2.5-0.5B --num_workers 2 --batch_size 2 --seq_length 1024 \
        --num_layers 2 --debug_steps 100 --loss_output_dir /tmp/loss_curves \
        --init_weights_path /tmp/shared_weights/init_weights.pt --save_init_weights

Flags, the shared loop and the launcher live in parity/; what DDP does differently is ddp_strategy.py.
"""

from parity.commands.common import exit_now
from parity.commands.train import main

if __name__ == "__main__":
    exit_now(main("ddp", __doc__))
