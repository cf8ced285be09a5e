"""One room per framework (docs/architecture.md#a-framework-is-one-seam): parity/frameworks/<name>/ holds everything
that knows that framework's classes, and is the only code of the house that imports it (tests/test_architecture.py).

A framework enters as a room plus one line of FRAMEWORKS. Its package's `FRAMEWORK` says what the harness asks of
every framework, and imports nothing of it until asked:
- `records`: what it records by itself under verify_trainer.py, in words (the line of a command that recorded nothing),
  or None for what records nothing by itself (vLLM, a sampler);
- `install`: the hook that attaches its recorder where the framework builds its trainer, installed in every Python
  process of a command verify_trainer.py runs (sitehook/sitecustomize.py), or None where the framework loads the
  recorder itself (Lightning's callbacks entry point);
- `command_refusal(argv)`: what it cannot record, said before the command starts (None: it can, or the command is not
  one of its);
- `install_hint()`: what this install lacks for the framework to find parity (e.g. an entry point), or "".
How the model, optimizer and batches are found is the room's recorder's: its callback or recording observes them where
the framework hands them over, and a model that is not a transformers one is read under Hugging Face names by a
layout of the room's (parity.recording.sharded's interface: torchtitan's layout.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

FRAMEWORKS = ("transformers", "lightning", "trl", "torchtitan", "vllm", "megatron")  # the registry: each a room under
# parity/frameworks/


@dataclass(frozen=True)
class Framework:
    name: str
    records: str | None
    install: Callable[[], None] | None = None
    command_refusal: Callable[[list[str]], str | None] | None = None
    install_hint: Callable[[], str] | None = None


def registered() -> list[Framework]:
    """Every room's Framework, in FRAMEWORKS' order (importing a room's package imports nothing of its framework)."""
    return [importlib.import_module(f"parity.frameworks.{name}").FRAMEWORK for name in FRAMEWORKS]
