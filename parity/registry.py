"""The three strategies by their one name: the flag value, the record's `strategy`, `loss_<name>.json`,
the class (`<Label>Strategy`) and the label in reports.

Each strategy lives in its top-level module (`ddp_strategy.py`, `autotp_strategy.py` — the design card's
file name for DeepSpeed — and `fsdp_strategy.py`) and is imported only when asked for, because each pulls
its library (DeepSpeed picks an accelerator when it is imported). The strategy modules import nothing from
here, so there is no cycle.
"""

from __future__ import annotations

from parity.errors import ConfigError, LibraryMissing

NAMES = ("ddp", "deepspeed", "fsdp")
LABELS = {"ddp": "DDP", "deepspeed": "DeepSpeed", "fsdp": "FSDP"}


def label(name: str) -> str:
    """How reports name a strategy; a name the harness does not know is shown as it is."""
    return LABELS.get(name, name)


def strategy_class(name: str):
    """The Strategy subclass for `name`; ConfigError for an unknown name or a library that cannot be imported."""
    if name not in NAMES:
        raise ConfigError(f"unknown strategy '{name}': use one of {', '.join(NAMES)}")
    try:
        if name == "ddp":
            from ddp_strategy import DDPStrategy as cls
        elif name == "deepspeed":
            from autotp_strategy import DeepSpeedStrategy as cls
        else:
            from fsdp_strategy import FSDPStrategy as cls
    except ImportError as exc:
        raise LibraryMissing(name, exc) from None
    return cls



def option_owners() -> dict[str, str]:
    """Every strategy's own flags: {option name: the strategy that has it}, in NAMES order."""
    return {option.name: name for name in NAMES for option in strategy_class(name).options}


def flags_for(strategy: str, given: dict) -> dict:
    """`given` without the other strategies' own flags: the run flags and `strategy`'s options."""
    owners = option_owners()
    return {k: v for k, v in given.items() if owners.get(k, strategy) == strategy}


def unrun_option(given: dict, strategies: list[str]) -> tuple[str, str] | None:
    """(flag, strategy) for the first flag in `given` that belongs to a strategy not in `strategies`."""
    return next(((k, s) for k, s in option_owners().items() if k in given and s not in strategies), None)
