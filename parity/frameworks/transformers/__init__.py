"""Hugging Face's Trainer (and every trainer built on it): its callback (callback.py) and the hook that gives it to a
Trainer under verify_trainer.py (trainer_hook.py)."""

from parity.frameworks import Framework


def _install() -> None:
    from parity.frameworks.transformers import trainer_hook

    trainer_hook.install()


FRAMEWORK = Framework("transformers", "Hugging Face's Trainer", "transformers", "5.18.0", install=_install)
