"""Hugging Face's Trainer recorded without a line of the user's script changed (docs/own_trainer.md#one-command).

transformers has no entry point through which a callback can be plugged in from outside, so under verify_trainer.py
(sitecustomize.py calls `install` where its variables are set) the place where the user's Trainer is built gets it:
when `transformers.trainer` is first imported, its Trainer.__init__ is wrapped to end with
`self.add_callback(ParityCallback(...))` — the same callback a script would pass, added after the ones it passed,
for Trainer and every trainer that inherits it (TRL's). A Trainer already given a ParityCallback by its script keeps
that one alone. Nothing else of transformers is touched: the callback observes (a forward hook, an optimizer step
pre-hook, the logs) and changes nothing the framework computes.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys

from parity.integrations import attach

MODULE = "transformers.trainer"


def install() -> None:
    """Wrap Trainer.__init__ once transformers' trainer module is imported (now, if it already is)."""
    if MODULE in sys.modules:
        _wrap(sys.modules[MODULE].Trainer)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it hands `transformers.trainer`'s own spec on with a loader that wraps Trainer once the
    module has run, then leaves the import system."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _wrap(module.Trainer)

    def __getattr__(self, name):  # the module's own loader for anything else (resources, source)
        return getattr(self.loader, name)


def _wrap(trainer_class) -> None:
    init = trainer_class.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        from parity.integrations.transformers import ParityCallback

        if not any(isinstance(cb, ParityCallback) for cb in self.callback_handler.callbacks):
            output_dir, name = attach.variables()
            self.add_callback(ParityCallback(output_dir, name=name))

    trainer_class.__init__ = __init__
