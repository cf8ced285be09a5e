"""Strategy name → the top-level module that implements it (imported lazily: each pulls its library)."""

from __future__ import annotations

import importlib

from parity.errors import ConfigError

STRATEGY_MODULES = {"ddp": "ddp_strategy", "deepspeed": "autotp_strategy", "fsdp": "fsdp_strategy"}
DISPLAY_NAMES = {"ddp": "DDP", "deepspeed": "DeepSpeed AutoTP", "fsdp": "FSDP+DTensor"}


def display_name(strategy: str) -> str:
    """How reports name a strategy; a name the harness does not know is shown as it is."""
    return DISPLAY_NAMES.get(strategy, strategy)


def strategy_class(name: str):
    if name not in STRATEGY_MODULES:
        raise ConfigError(f"unknown strategy '{name}': use one of {', '.join(STRATEGY_MODULES)}")
    try:
        module = importlib.import_module(STRATEGY_MODULES[name])
    except ImportError as exc:
        raise unavailable(name, exc) from None
    return module.STRATEGY


def unavailable(name: str, exc: ImportError) -> ConfigError:
    """The line for a strategy whose library cannot be imported: raised by strategy_class, or by a
    strategy's validate() when it imports its library only there (DeepSpeed, whose import picks a device)."""
    return ConfigError(f"strategy {name} cannot be used: {exc} (install the pinned set with "
                       f"pip install -r requirements.txt)")
