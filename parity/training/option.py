"""A flag only one strategy has (--zero_stage, --mixed_precision), as the strategy module declares it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Option:
    """A flag only one strategy has (--zero_stage, --mixed_precision): declared by the strategy module in
    its `options`, stored in `RunConfig.options`. Defined below the interface the strategies implement
    (parity.training.strategy re-exports it), so that a strategy module imports nothing above it (no import cycle)."""

    name: str
    default: Any
    help: str
    type: Callable | None = None
    choices: tuple | None = None

    def add_to(self, group, given_only: bool = False) -> None:
        """Add --<name>. `given_only`: no default, so only a flag the user gave appears in the result."""
        kwargs: dict[str, Any] = {"help": self.help, "default": argparse.SUPPRESS if given_only else self.default}
        if isinstance(self.default, bool):
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=self.type or type(self.default), choices=self.choices)
        group.add_argument(f"--{self.name}", **kwargs)
