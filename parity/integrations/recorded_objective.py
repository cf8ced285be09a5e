"""What a recorded run's gradient is the gradient of (docs/posttrain.md#your-own-run-recorded).

A record is replayed under the objective it names. A record that names none is replayed as the causal-LM token mean,
so it must be one: at its first step the recorder holds the loss the run itself logged to the token mean it measured
from the model's outputs on the recorded batch (`causal_lm_refusal`). A GRPO or DPO loss, a label-smoothed or
DFT-weighted cross-entropy, lies far from it: the record is refused in one line, never replayed as cross-entropy and
judged (a false FAIL).
"""

from __future__ import annotations

import math

# How far (relative) a run's logged step-0 loss may lie outside the range of the causal-LM token means the recorder
# measured — the global one and each rank's own — and still be taken for one: a mean of micro-batch means (a real
# bug, which the verdict judges) lies inside that range; rounding (Trainer logs 4 decimals) and bf16 add ~1e-4.
CAUSAL_SLACK = 0.05


def causal_lm_refusal(logged_loss: float | None, rank_sums: list[float], rank_tokens: list[int],
                      scales: tuple[int, ...] = ()) -> str | None:
    """Why a record that names no objective cannot be taken for a causal-LM run, from its first step: the loss the run
    logged (`logged_loss`) against the token means of its batch (the ranks' loss sums and loss tokens, measured by the
    recorder from the model's outputs) — or those × or ÷ one of `scales` (its ranks, its micro-batches a rank, their
    product: a causal-LM loss normalised once too often or too few times, a bug the verdict judges). None where the
    logged loss lies within CAUSAL_SLACK of them, or none was logged (then nothing can be held to it)."""
    if logged_loss is None or not sum(rank_tokens) or not sum(rank_sums):
        return None
    means = [sum(rank_sums) / sum(rank_tokens)] + [s / c for s, c in zip(rank_sums, rank_tokens) if c]
    low, high = min(means), max(means)
    logged = float(logged_loss)
    factors = {1.0, *(float(k) for k in scales if k > 1), *(1.0 / k for k in scales if k > 1)}
    if math.isfinite(logged) and any(low * f * (1 - CAUSAL_SLACK) <= logged <= high * f * (1 + CAUSAL_SLACK)
                                     for f in factors):
        return None
    ranks = f"; the ranks' own {low:.6g}–{high:.6g}" if len(means) > 2 else ""
    return (f"step 0's loss as the run logged it, {logged:.6g}, is not the causal-LM token mean of its batch "
            f"({means[0]:.6g}, measured from the model's outputs{ranks}; ratio {logged / means[0]:.4g}, nor that × or "
            f"÷ its ranks or micro-batches): the run trains another objective, which this recorder does not know, and "
            f"a replay of cross-entropy would judge it falsely")


__all__ = ["CAUSAL_SLACK", "causal_lm_refusal"]
