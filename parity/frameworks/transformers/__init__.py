"""Hugging Face's Trainer (and every trainer built on it): its callback (callback.py) and the hook that gives it to a
Trainer under verify_trainer.py (trainer_hook.py); and transformers' generate, the harness's own engine on the sampler
seam (sampler.py: make_rollouts.py's default --sampler)."""

from parity.frameworks import Framework


def _install() -> None:
    from parity.frameworks.transformers import trainer_hook

    trainer_hook.install()


def _sampler():
    from parity.frameworks.transformers.sampler import ENGINE

    return ENGINE


FRAMEWORK = Framework("transformers", "Hugging Face's Trainer", "transformers", "5.18.0", install=_install,
                      sampler=_sampler)
