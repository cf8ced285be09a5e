#!/usr/bin/env python
"""Train a model with transformers' own distributed training under Ray Train, from DDP's initial weights: the
model's tensor-parallel plan and transformers' FSDP2, as from_pretrained(..., distributed_config=...) applies them.

Run train_ddp.py with --save_init_weights first: this loads the initial weights it wrote.

    python train_transformers.py --model_name qwen3-tiny --tp_size 2 --dp_size 2 --num_workers 4 \
        --batch_size 2 --seq_length 128 --debug_steps 100 \
        --loss_output_dir /tmp/loss_curves --init_weights_path /tmp/shared_weights/init_weights.pt

Flags, the shared loop and the launcher live in parity/; what transformers does differently is
transformers_strategy.py.
"""

from parity.commands.common import exit_now
from parity.commands.train import main

if __name__ == "__main__":
    exit_now(main("transformers", __doc__))
