"""Imported at start-up by every Python process of a command verify_trainer.py runs: this folder is first on the
command's PYTHONPATH (parity/attaching/attach.py). It first runs the sitecustomize it shadows, if there is one, as
that one would have run; then, only where the command runs under verify_trainer.py (PARITY_RECORD_DIR set), it
installs every framework room's hook (parity/frameworks: `install` — the one that gives Hugging Face's Trainer
parity's callback once transformers' trainer module is imported, the one that records torchtitan's Trainer) and, under
--num_layers, the one that cuts every transformers model built (parity/attaching/layer_cut.py) — or, in a Python that cannot import parity (the command runs another
interpreter than the one the harness is installed in), says so in one line and exits 2: nothing would be recorded.
Nothing is imported eagerly: a process that never imports transformers pays for a path lookup."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain() -> None:
    """The sitecustomize this one shadows (the next one on sys.path), run as `sitecustomize`."""
    import importlib.util
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE])
    if spec is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


def _attach() -> None:
    if not os.environ.get("PARITY_RECORD_DIR"):  # attach.RECORD_DIR: not under verify_trainer.py
        return
    import importlib.util

    if importlib.util.find_spec("parity") is None:  # a Python the harness is not installed in: nothing would record
        sys.stderr.write(f"error: verify_trainer.py's command runs {sys.executable}, which cannot import parity: install "
                         f"the harness into it (pip install -e {os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))}"
                         f") and run again\n")
        raise SystemExit(2)
    from parity.attaching import layer_cut
    from parity.frameworks import registered

    for framework in registered():
        if framework.install is not None:
            try:
                framework.install()
            except Exception as exc:  # never the command's start: that room records nothing
                sys.stderr.write(f"parity recorder: {framework.name}'s hook not installed ({type(exc).__name__}: "
                                 f"{exc}): recording nothing of it\n")
    layer_cut.install()


try:
    _chain()
finally:
    _attach()
