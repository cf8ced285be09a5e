#!/usr/bin/env python
"""Train a model with FSDP2 + DTensor tensor parallelism under Ray Train, from DDP's initial weights.

Run train_ddp.py with --save_init_weights first: this loads the initial weights it wrote.

    python train_fsdp.py --model_name Qwen/Qwen2.5-0.5B --tp_size 2 --dp_size 2 --num_workers 4 \
        --batch_size 2 --seq_length 1024 --num_layers 2 --debug_steps 100 --precision bf16 \
        --loss_output_dir /tmp/loss_curves --init_weights_path /tmp/shared_weights/init_weights.pt

Flags, the shared loop and the launcher live in parity/; what FSDP2 + TP does differently is fsdp_strategy.py.
"""

from parity.commands.common import exit_now
from parity.commands.train import main

if __name__ == "__main__":
    exit_now(main("fsdp", __doc__))
