"""Lightning's Trainer recorded without a line of the user's script changed (docs/own_trainer/one_command.md#one-command).

Lightning loads callbacks from outside through its entry point group `lightning.pytorch.callbacks_factory` (lightning
2.6's CallbackConnector calls every factory registered there when a Trainer is built, and appends what it returns to
the Trainer's callbacks). pyproject.toml registers `callbacks` there: outside verify_trainer.py it returns nothing
and imports nothing (every Lightning Trainer of an environment with parity installed calls it); under it, parity's
Lightning callback, which stands aside where the script passed a ParityCallback of its own.
"""

from __future__ import annotations

from parity.attaching import attach


def callbacks() -> list:
    """[] outside verify_trainer.py; under it, the recorder's callback for this Trainer ([] where it cannot be made
    against this Lightning: said in one line, the training goes on)."""
    if not attach.active():
        return []
    try:
        return _attached()
    except Exception as exc:
        from parity.errors import first_line
        from parity.frameworks import stop_record

        stop_record(callbacks, f"Lightning's callback: {type(exc).__name__}: {first_line(exc)}")
        return []


def _attached() -> list:
    from parity.frameworks import guarded
    from parity.frameworks.lightning.callback import ParityCallback

    class Attached(ParityCallback):
        """ParityCallback, unless the Trainer already has one of the script's own."""

        @guarded
        def on_train_start(self, trainer, pl_module):
            if not any(isinstance(cb, ParityCallback) and cb is not self for cb in trainer.callbacks):
                super().on_train_start(trainer, pl_module)

    output_dir, name = attach.variables()
    return [Attached(output_dir, name=name)]
