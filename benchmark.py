#!/usr/bin/env python
"""Benchmark every strategy side by side, trained for N steps at one global batch in one Ray session. The 14 rows
(parity/commands/benchmark.py's ROWS): DDP; ZeRO-1/2/3, ZeRO-2 + offload and AutoTP tp2 + ZeRO-1; FSDP2, FSDP2 + TP
tp2, FSDP2 + offload and FSDP2 + TP tp2 + SP; pipelines pp2 under GPipe, 1F1B and interleaved 1F1B; transformers'
TP tp2 + FSDP2 — and for a mixture of experts FSDP2 + EP ep2, FSDP2 + TP tp2 + EP ep2 and transformers' EP ep2 +
FSDP2. By default, every row the world size and the layer count allow.

    python benchmark.py --output_dir OUT/benchmark                                   # GPUs: the seed model
    python benchmark.py --output_dir OUT/bench --num_workers 1 --rows ddp,zero1,zero2,zero3,zero2_offload,fsdp
    python benchmark.py --output_dir OUT/bench --model_name qwen2-tiny --debug_steps 30 --device cpu

Per row: median step time (the first --untimed_steps left out), its ratio to DDP's, tokens/s, MFU on GPU,
the model-state bytes of the fullest rank (parameters, gradients, optimizer states, master copies, counted
from its tensors) against the ZeRO paper's bound, peak memory, and the final loss against DDP's. Writes
benchmark.json, benchmark.md and benchmark.png (step time and memory) in --output_dir, and each row's loss
record under rows/<row>/. Defaults: with GPUs Qwen/Qwen2.5-0.5B, 2 layers, seq 1024, bf16; without,
qwen2-tiny, seq 256, fp32. Exit 0: done; 1: a row failed; 2: bad input.
"""

from parity.commands.common import exit_now
from parity.commands.benchmark import main

if __name__ == "__main__":
    exit_now(main(description=__doc__))
