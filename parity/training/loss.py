"""The loss every strategy trains on by default, defined once in the objective room (parity/objectives/causal_lm.py):
the sum of next-token cross-entropies, and the label it skips. Re-exported here, where the strategies import it."""

from __future__ import annotations

from parity.objectives.causal_lm import IGNORE_INDEX, loss_sum

__all__ = ["IGNORE_INDEX", "loss_sum"]
