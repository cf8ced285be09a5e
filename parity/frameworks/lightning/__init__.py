"""Lightning's Trainer: its callback (callback.py) and the factory its callbacks entry point calls (factory.py)."""

from parity.frameworks import Framework


def _install_hint() -> str:
    """Where Lightning is installed but parity's callbacks entry point is not (an install older than it)."""
    import importlib.metadata as md
    import importlib.util

    if importlib.util.find_spec("lightning") is None:
        return ""
    if any(e.value.startswith("parity.") for e in md.entry_points(group="lightning.pytorch.callbacks_factory")):
        return ""
    return "Lightning finds parity's callback through an entry point this install lacks: pip install -e the project"


FRAMEWORK = Framework("lightning", "Lightning", "lightning", "2.6.0", install_hint=_install_hint)
