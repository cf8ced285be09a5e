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
- `install_hint()`: what this install lacks for the framework to find parity (e.g. an entry point), or "";
- `module` and `oldest`: the framework's import name and the oldest release of it the room records (found by
  recording it beside the pinned set: docs/own_trainer/one_command.md#the-releases-recorded). An older one imported
  in a recorded process is refused in one line (`release_refusal`); a newer one than the pinned set's is recorded;
- `sampler`: its sampling engine (sampling.py, the sampler seam: how it samples, reports its sampler side and reloads
  weights), loaded when asked — `engine(name)`; make_rollouts.py's --sampler names one of `engines()`;
- `trains(trainer, optimizer)`: what a trainer built on Hugging Face's Trainer trains where it is this framework's
  (TRL's GRPOTrainer, RLOOTrainer and DPOTrainer), and the feed of its micro-batches (`Trained`), or None; Trainer's callback asks
  `objective_of`, never a room by name;
- `precision(model)`: the harness's policy the framework trains `model` in, where it says so (accelerate's
  mixed_precision), or None; a recorder told no precision takes it, one told another refuses (`precision_of`).
A room reaches another only through this registry (tests/test_architecture.py): what two rooms share lives on a floor
below (parity/recording/) or in a module here that is not a room (sampling.py).
The recorder never stops a user's run: a room's code the framework calls (a callback's hook, a forward hook, a
wrapped method) is `guarded` — what it raises (an attribute another release does not have) ends the record in one
line, and the training goes on to its end with the user's own exit code.
How the model, optimizer and batches are found is the room's recorder's: its callback or recording observes them where
the framework hands them over, and a model that is not a transformers one is read under Hugging Face names by a
view of the room's (parity/training/view.py's protocol: torchtitan's view.py).
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from parity.errors import first_line

if TYPE_CHECKING:
    from parity.frameworks.sampling import Engine

FRAMEWORKS = ("transformers", "lightning", "trl", "torchtitan", "vllm", "megatron", "accelerate")  # the registry:
# each a room under parity/frameworks/


@dataclass(frozen=True)
class Framework:
    name: str
    records: str | None
    module: str
    oldest: str
    install: Callable[[], None] | None = None
    command_refusal: Callable[[list[str]], str | None] | None = None
    install_hint: Callable[[], str] | None = None
    sampler: Callable[[], Engine] | None = None
    trains: Callable[[object, object], Trained | None] | None = None
    precision: Callable[[object], str | None] | None = None


@dataclass(frozen=True)
class Trained:
    """What a trainer built on Hugging Face's Trainer trains, as its room knows it: the objective resolved
    (parity.objectives.resolve_objective's), what the framework declared besides, and `feed(recorder)`, what hands the
    recorder each training micro-batch (`forward(module, args, kwargs, output, grad)`, `close()`)."""
    objective: dict
    declared: dict
    feed: Callable[[object], object]


class Refused(Exception):
    """What a room's framework trains that the harness cannot record, in one line (nothing is recorded)."""


def registered() -> list[Framework]:
    """Every room's Framework, in FRAMEWORKS' order (importing a room's package imports nothing of its framework)."""
    return [importlib.import_module(f"parity.frameworks.{name}").FRAMEWORK for name in FRAMEWORKS]


def engines() -> list[str]:
    """The rooms that declare a sampling engine, in FRAMEWORKS' order (make_rollouts.py's --sampler choices)."""
    return [framework.name for framework in registered() if framework.sampler is not None]


def engine(name: str) -> Engine:
    """Room `name`'s sampling engine (parity/frameworks/sampling.py)."""
    return importlib.import_module(f"parity.frameworks.{name}").FRAMEWORK.sampler()


def objective_of(trainer, optimizer) -> Trained | None:
    """What `trainer` (built on Hugging Face's Trainer) trains, where a room knows its kind (TRL's GRPO and DPO
    trainers); None: the causal-LM token mean. Refused in one line for what the reference cannot compute."""
    for framework in registered():
        found = framework.trains(trainer, optimizer) if framework.trains is not None else None
        if found is not None:
            return found
    return None


def precision_of(model) -> tuple[str, str] | None:
    """(framework, policy): the first room that says which precision it trains `model` in; None: none says."""
    for framework in registered():
        said = framework.precision(model) if framework.precision is not None else None
        if said is not None:
            return framework.name, said
    return None


def release_refusal() -> str | None:
    """The first framework this process imported whose release is older than the oldest its room records, in one line
    (None: every one imported is in range)."""
    from packaging.version import Version

    for framework in registered():
        version = getattr(sys.modules.get(framework.module), "__version__", None)
        if isinstance(version, str) and Version(version) < Version(framework.oldest):
            return (f"{framework.module} {version} is older than {framework.oldest}, the oldest release of it parity "
                    f"records (docs/own_trainer/one_command.md#the-releases-recorded)")
    return None


def guarded(hook: Callable) -> Callable:
    """A room's method the framework calls (a callback's hook, a forward hook): whatever it raises ends the record in
    one line, never the user's training (`stop_record`); it then returns None."""
    @functools.wraps(hook)
    def run(owner, *args, **kwargs):
        try:
            return hook(owner, *args, **kwargs)
        except Exception as exc:
            stop_record(owner, f"{hook.__name__}: {type(exc).__name__}: {first_line(exc)}")
            return None

    return run


def stop_record(owner, why: str) -> None:
    """`owner`'s record ended by `why`: where its recorder records, the step's exchange ends it on every rank (it is
    broken); before it records, nothing is recorded — said once, on rank 0, and left for verify_trainer.py."""
    recorder = getattr(owner, "recorder", None)
    if recorder is not None and recorder.enabled:
        recorder.broken = recorder.broken or why
        return
    if getattr(owner, "_parity_stopped", False):
        return
    owner._parity_stopped = True
    from parity.attaching import attach
    from parity.recording.world import first_process

    if first_process():
        print(f"parity recorder: {why}: recording nothing; the training goes on", file=sys.stderr, flush=True)
        attach.refused(why)
