"""A run's objective at work, the one place a strategy's micro-batch loss comes from (parity/training/strategy.py's
forward_backward and the pipeline's schedule both call it): the causal-LM token-loss sum, or a GRPO- or DPO-family
definition's sum over the micro-batch's rollout rows (grpo.py, dpo.py).

The contract, for every definition: a step's loss is Σ over its micro-batches (every DP rank's) of `micro_sum` ÷
the step's divisor D (`step_divisor`, from the whole step's rows: its loss tokens, rows, pairs …), so a micro-batch
backpropagates micro_sum × dp_size ÷ D and the DP average makes the step's gradient. A term of each micro-batch's own
(bnpo, the entropy bonus, DPO's sft) enters as its mean × D ÷ `micro_batches`, the step's micro-batches over all DP
ranks. `micro_sum` also returns the micro-batch's statistics (float64 sums, `stats_size` long; none for the causal LM),
which the strategy sums over its micro-batches and the DP ranks and `quantities` turns into the step's KL, clipped
fraction, mean ratio … (the record's "objective" entry of each step).
"""

from __future__ import annotations

import torch

from parity.objectives import definition_of, invariance_of
from parity.objectives import dpo, grpo, ties
from parity.objectives.causal_lm import IGNORE_INDEX, loss_sum


class Objective:
    """The objective of a RunConfig's (or record's) `objective` field: None is the causal-LM token mean."""

    def __init__(self, objective: dict | None):
        self.config = objective
        self.definition = definition_of(objective)
        self.name, self.family = self.definition.name, self.definition.family
        self.settings = dict(objective["settings"]) if objective else {}
        self.invariance = invariance_of(objective)

    @property
    def causal_lm(self) -> bool:
        return self.config is None

    @property
    def stats_size(self) -> int:
        return {"grpo": len(grpo.STATS), "dpo": len(dpo.STATS)}.get(self.family, 0)

    def step_divisor(self, labels: torch.Tensor, rows=None) -> float:
        """The step's divisor D from all its rows: its loss tokens (the causal LM), or the definition's (`rows`: the
        step's RolloutRows; its generation_tokens where normalizer="generation")."""
        if self.causal_lm:
            return int((labels[:, 1:] != IGNORE_INDEX).sum())
        if self.family == "dpo":
            return dpo.step_divisor(rows)
        return grpo.step_divisor(self.name, self.settings, rows, rows.generation_tokens)

    def micro_sum(self, logits: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, rows, divisor: float,
                  micro_batches: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(what this micro-batch contributes to the step's loss × D, its statistics or None): `rows` its RolloutRows
        (None for the causal LM), `divisor` the step's D, `micro_batches` the step's micro-batches over all DP ranks."""
        if self.causal_lm:
            return loss_sum(logits, labels), None
        rows = rows.to(logits.device)
        if self.family == "dpo":
            return dpo.micro_sum(self.settings, logits, input_ids, rows, divisor, micro_batches)
        return grpo.micro_sum(self.name, self.settings, logits, input_ids, rows, divisor, micro_batches)

    def micro_parts(self, log_probs: torch.Tensor, entropies: torch.Tensor | None, rows,
                    level: float = ties.FP32_LEVEL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the sum of the micro-batch's rows' terms, its own mean term, its statistics) from the policy's log-probs of
        its next tokens and their entropies ([rows, L − 1]; None: not computed, the entropy statistic NaN): micro_sum is
        sum + own × D ÷ the step's micro-batches (grpo.micro_parts, dpo.micro_parts). A recorder's, from a run's own
        forward; `level`: the log-probs' rounding (ties.level of the dtype they were computed in)."""
        rows = rows.to(log_probs.device)
        if self.family == "dpo":
            return dpo.micro_parts(self.settings, log_probs, rows, level)
        if entropies is None:
            if self.settings.get("entropy_coef"):
                raise ValueError("the entropy bonus needs each token's entropy")
            entropies = torch.full_like(log_probs, float("nan"))
        return grpo.micro_parts(self.name, self.settings, log_probs, entropies, rows, level)

    def quantities(self, stats) -> dict | None:
        """The step's quantities from its statistics summed over all its micro-batches (None for the causal LM)."""
        if self.causal_lm or stats is None:
            return None
        stats = [float(v) for v in stats]
        if self.family == "dpo":
            return dpo.quantities(self.settings, stats)
        return grpo.quantities(self.name, self.settings, stats)


def generation_tokens(rollouts, mask_truncated: bool) -> dict[int, float]:
    """normalizer="generation": each generation batch's counted completion tokens ÷ the optimizer steps it spans — the
    mean of the counted tokens of the steps whose rows it holds (a rollouts.RolloutFile), by generation id."""
    counts: dict[int, list[float]] = {}
    for step in range(rollouts.steps):
        rows = rollouts.step(step)[1]
        counts.setdefault(int(rows.generation[0]), []).append(float(rows.counted(mask_truncated)[:, 1:].sum()))
    return {g: max(sum(c) / len(c), 1.0) for g, c in counts.items()}
