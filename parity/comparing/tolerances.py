"""Every tolerance the harness judges by, defined once. docs/tolerances.md gives the reasoning and the
measurements each one rests on; nothing else in the code or the tests defines a tolerance.

All are relative unless named ATOL. A pair of runs is judged by the looser of its two precisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from parity.errors import ConfigError


@dataclass(frozen=True)
class Tolerance:
    """Per-step relative tolerances on the two curves a verdict holds: the loss and the pre-clip grad norm."""

    loss: float
    grad_norm: float

    def of(self, quantity: str) -> float:
        return self.loss if quantity == "loss" else self.grad_norm


CURVES = {"fp32": Tolerance(loss=1e-5, grad_norm=1e-5), "bf16": Tolerance(loss=3e-2, grad_norm=1e-1)}
"""Loss-curve verdict (plot_loss_curves.py), by precision."""

LAYERS = {"fp32": 1e-5, "bf16": 6e-2}
"""Layer check (compare_dumps.py): max |a − b| over the tensor's scale, by precision."""

SHORT_RUN_BF16 = Tolerance(loss=1e-4, grad_norm=3e-3)
"""The strategy tests' 12-step bf16 runs (lr 1e-4) against DDP's bf16 run."""

FINAL_PARAMETERS_ATOL_FP32 = 1e-5
"""Final parameters of two fp32 runs (12 steps at lr 1e-4), absolute."""

PRECISION_ORDER = ("fp32", "bf16")  # tighter to looser


def looser_precision(a: str, b: str, known=PRECISION_ORDER) -> str:
    """The looser of two runs' precisions; ConfigError for a precision without tolerances."""
    for precision in (a, b):
        if precision not in known:
            raise ConfigError(f"precision '{precision}' has no default tolerance (known: {', '.join(known)}): "
                              f"pass --tolerance")
    return max(a, b, key=PRECISION_ORDER.index)
