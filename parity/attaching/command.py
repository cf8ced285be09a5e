"""The user's launch command, parsed once: which Python code it runs (a script, `-m module`, or a program such as
`trl sft`), what launches it, and the code's own arguments. verify_trainer.py names the record and the script by it,
the layer cut's reader (model_builders.py) finds the code it reads, and a framework's room (torchtitan's) takes its
own arguments from it; no one else reads argv for these.

The rule: the entry is the first argument that names Python code — one ending in `.py`, or the module after `-m` —
skipping the launchers' own modules (`python -m torch.distributed.run … train.py`: the entry is train.py); with none,
the program itself (`trl sft …`, a console script)."""

from __future__ import annotations

import os
from dataclasses import dataclass

LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
                    "accelerate.commands.accelerate_cli", "deepspeed.launcher.runner")
"""`python -m X` launchers: their module starts the code named after it, never the code itself."""


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    kind: str  # "script" (a .py file), "module" (-m), "program" (a console script or binary)
    entry: str  # the script as typed, the module's dotted name, or the program
    at: int  # the entry's index in argv

    @property
    def launcher(self) -> tuple[str, ...]:
        """What comes before the entry (`torchrun --nproc_per_node 2`; for -m, up to the -m)."""
        return self.argv[:self.at - (1 if self.kind == "module" else 0)]

    @property
    def arguments(self) -> list[str]:
        """The code's own arguments: those after its entry."""
        return list(self.argv[self.at + 1:])

    def script_path(self) -> str | None:
        """The script's absolute path where it exists (from the current folder), else None."""
        return os.path.abspath(self.entry) if self.kind == "script" and os.path.isfile(self.entry) else None

    def words(self) -> str:
        """How the command is named in a line: the script or module as typed, or the program and its subcommand."""
        if self.kind != "program":
            return self.entry
        sub = [w for w in self.argv[1:2] if w.isidentifier()]
        return " ".join([os.path.basename(self.entry), *sub])


def parse(argv: list[str]) -> Command:
    """`argv` (a launch command, non-empty) parsed by the module docstring's rule."""
    argv = tuple(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.endswith(".py"):
            return Command(argv, "script", arg, i)
        if arg == "-m" and i + 1 < len(argv):
            if argv[i + 1] not in LAUNCHER_MODULES:
                return Command(argv, "module", argv[i + 1], i + 1)
            i += 1
        i += 1
    return Command(argv, "program", argv[0], 0)
