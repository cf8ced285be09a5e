#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md): gloo's collectives on CUDA tensors, the seed configuration at world
# size 1, several ranks on the one GPU (fp32 parity, the bf16 calibrated verdict), the layer check; one report,
# gpu_check.md + gpu_check.json, under --output_dir. --device cpu is the dry run. The logic is
# parity/commands/gpu_check/check.py. Exit 0 every step passed, 1 a step failed, 2 bad input.
exec "${PYTHON:-python3}" -m parity.commands.gpu_check "$@"
