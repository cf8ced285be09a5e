"""`parity`, the console command pip puts on PATH (pyproject.toml's [project.scripts]): one word for each thing the
root scripts do, so that an installed harness runs from any folder without its checkout. Each word runs the same
function as its script (parity/commands/), with the same flags, output and exit codes:

    parity verify --output_dir OUT -- torchrun --nproc_per_node 2 train.py ...   verify_trainer.py
    parity main --output_dir OUT                                                  run_verification_main.sh
    parity train ddp|deepspeed|fsdp|pipeline|transformers ...                     train_<strategy>.py
    parity plot --input_dir OUT/loss_curves --output OUT/curves.png               plot_loss_curves.py
    parity layers --output_dir OUT                                                run_verification.py
    parity dumps --input_dir OUT                                                  compare_dumps.py
    parity bench --output_dir OUT                                                 benchmark.py
    parity rollouts make ... | parity rollouts check ...                          make_rollouts.py, check_rollouts.py
"""

from __future__ import annotations

import importlib
import sys

from parity.commands.common import exit_now
from parity.registry import KNOWN

# word → (the module whose main(argv) runs it, the root script it stands for, what it does)
COMMANDS = {
    "verify": ("parity.commands.verify_trainer", "verify_trainer.py",
               "run your training command, record it, replay it under the harness's DDP and judge it"),
    "main": ("parity.commands.main_job", "run_verification_main.sh",
             "the main job: DDP, DeepSpeed and FSDP from the same weights on the same batches, then the verdict"),
    "train": ("parity.commands.train", "train_<strategy>.py", "one strategy's run (its name first: ddp, fsdp, ...)"),
    "plot": ("parity.commands.compare_curves", "plot_loss_curves.py", "the loss-curve comparison and its verdict"),
    "layers": ("parity.commands.layer_check", "run_verification.py", "the layer check: one step, every tensor"),
    "dumps": ("parity.commands.compare_layers", "compare_dumps.py", "compare layer dumps: the first divergent module"),
    "bench": ("parity.commands.benchmark", "benchmark.py", "every strategy's speed and memory side by side"),
    "rollouts make": ("parity.commands.make_rollouts", "make_rollouts.py", "write a rollout file from a model"),
    "rollouts check": ("parity.commands.check_rollouts", "check_rollouts.py",
                       "judge a rollout file's inputs: the sampler's log-probs, the advantages"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  parity {word:<{width}}  {what} ({script})" for word, (_, script, what) in COMMANDS.items()]
    return ("usage: parity COMMAND [ARG ...]   (parity COMMAND --help: its flags)\n\ncommands:\n" + "\n".join(lines)
            + "\n\nExit codes: 0 PASS, 1 FAIL, 2 bad input, 70 an error of the harness itself.\n")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        exit_now(0 if argv else 2)
    word = " ".join(argv[:2]) if argv[0] == "rollouts" else argv[0]
    if word not in COMMANDS:
        known = ", ".join(COMMANDS)
        print(f"error: parity {word}: no such command: use one of {known} (parity --help)", file=sys.stderr)
        exit_now(2)
    module_name, _, what = COMMANDS[word]
    rest = argv[len(word.split()):]
    sys.argv[0] = f"parity {word}"  # the usage lines name the command as typed
    module = importlib.import_module(module_name)
    if word == "train":  # train_<strategy>.py's main takes the strategy first
        if not rest or rest[0].startswith("-"):
            print(f"error: parity train: name the strategy first: one of {', '.join(KNOWN)}", file=sys.stderr)
            exit_now(2)
        exit_now(module.main(rest[0], what, rest[1:]))
    exit_now(module.main(rest))


if __name__ == "__main__":
    main()
