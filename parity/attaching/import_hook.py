"""Something done to a library's module the moment it is first imported, in a command verify_trainer.py runs
(sitehook/sitecustomize.py installs the hooks before the command's own code runs): frameworks/transformers/trainer_hook.py adds parity's
callback to Hugging Face's Trainer, layer_cut.py cuts every transformers model to --num_layers decoder layers.

A finder at the head of sys.meta_path finds nothing itself: it hands the module's own spec on with a loader that runs
the module, then `then(module)`; it leaves the import system once the module is found. Where the module is already
imported, `then` runs now."""

from __future__ import annotations

import functools
import importlib.abc
import sys
from typing import Callable


def when_imported(name: str, then: Callable) -> None:
    """`then(module)` once module `name` is imported (now, if it already is)."""
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(f, _Finder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name, then))


def after_init(name: str, class_name: str, then: Callable) -> None:
    """`then(instance)` at the end of every `class_name.__init__` of module `name` (and of its subclasses' through
    theirs), from the moment the module is imported (now, if it already is): frameworks/transformers/trainer_hook.py's Trainer and
    frameworks/torchtitan/recording.py's Trainer."""
    def wrap(module) -> None:
        cls = getattr(module, class_name)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            then(self)

        cls.__init__ = __init__

    when_imported(name, wrap)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                spec.loader = _Loader(spec.loader, self.then)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, then: Callable):
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name):  # the module's own loader for anything else (resources, source)
        return getattr(self.loader, name)
