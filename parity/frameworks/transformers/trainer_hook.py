"""Hugging Face's Trainer recorded without a line of the user's script changed (docs/own_trainer/one_command.md#one-command).

transformers has no entry point through which a callback can be plugged in from outside, so under verify_trainer.py
(sitecustomize.py calls `install` where its variables are set) the place where the user's Trainer is built gets it:
when `transformers.trainer` is first imported, its Trainer.__init__ is wrapped to end with
`self.add_callback(ParityCallback(...))` — the same callback a script would pass, added after the ones it passed,
for Trainer and every trainer that inherits it (TRL's). A Trainer already given a ParityCallback by its script keeps
that one alone. Nothing else of transformers is touched: the callback observes (a forward hook, an optimizer step
pre-hook, the logs) and changes nothing the framework computes.
"""

from __future__ import annotations

from parity.attaching import attach
from parity.attaching.import_hook import after_init

MODULE = "transformers.trainer"


def install() -> None:
    """Trainer.__init__ ends by adding parity's callback, once transformers' trainer module is imported (now, if it
    already is)."""
    after_init(MODULE, "Trainer", _add_callback)


def _add_callback(trainer) -> None:
    """(Where the callback cannot be added to this release's Trainer: one line, and the Trainer trains unrecorded.)"""
    try:
        from parity.frameworks.transformers.callback import ParityCallback

        if not any(isinstance(cb, ParityCallback) for cb in trainer.callback_handler.callbacks):
            output_dir, name = attach.variables()
            trainer.add_callback(ParityCallback(output_dir, name=name))
    except Exception as exc:
        from parity.errors import first_line
        from parity.frameworks import stop_record

        stop_record(trainer, f"Trainer's callback: {type(exc).__name__}: {first_line(exc)}")
