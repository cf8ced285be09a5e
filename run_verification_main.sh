#!/usr/bin/env bash
# Seed 000's main job: DDP (writes the shared initial weights) → DeepSpeed → FSDP → plot_loss_curves's
# verdict, on one Ray session. The logic is parity/commands/main_job.py; --help lists every setting (an
# environment variable, or the flag --lower_case_name value). Exit 0 PASS, 1 FAIL or a failed run, 2 bad input, 70 an error of the harness.
exec "${PYTHON:-python3}" -m parity.commands.main_job "$@"
