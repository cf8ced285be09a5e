#!/usr/bin/env python
"""Run your training command, record it, replay it under the harness's DDP and judge it: one command.

    python verify_trainer.py --output_dir OUT -- torchrun --nproc_per_node 2 train.py --your_flags
    python verify_trainer.py --output_dir OUT --calibrate -- trl sft --model_name_or_path ...

Trainer, TRL's trainers and Lightning are recorded without a line of your script changed; a loop of your own keeps its
ParityRecorder lines. The replay runs in local process groups (no Ray); the verdict and its page (report.html) are
plot_loss_curves.py's, written into OUT. Exit codes: 0 PASS, 1 FAIL, 2 bad input, 70 an error of the harness itself (its traceback in a file of OUT); a
command that fails, its own status.
"""

from parity.commands.common import exit_now
from parity.commands.verify_trainer import main

if __name__ == "__main__":
    exit_now(main(description=__doc__))
