"""The DPO family at work: a micro-batch's sum of its pairs' losses and its per-step quantities (docs/posttrain.md has
the formulas and their sources).

Rows come in pairs, 2k the chosen completion (c) and 2k + 1 the rejected one (r). A completion's log-probability is the
sum of its tokens' (LD-DPO: the tokens past the shorter completion of the pair weigh ld_alpha), the policy's and the
reference's alike; its log-ratio x = log π − log π_ref, its score f(x) (f-DPO: reverse_kl x, forward_kl 1 − e^{−x},
js_divergence log 2 + log σ(x), alpha_divergence (e^{(α−1)x} − 1)/(α − 1)), Δ = f(x_c) − f(x_r), Δ̄ the same of each
score ÷ its completion's tokens. Per pair, each loss type of TRL 1.16's DPOTrainer that is defined per pair:
  sigmoid −log σ(βΔ) · hinge max(0, 1 − βΔ) · ipo (Δ̄ − 1/(2β))² · exo_pair σ(βΔ)(log σ(βΔ) − log(1 − ε))
  + σ(−βΔ)(log σ(−βΔ) − log ε) · nca_pair −log σ(βx_c) − ½ log σ(−βx_c) − ½ log σ(−βx_r) · robust
  ((1 − ε)(−log σ(βΔ)) + ε log σ(−βΔ)) / (1 − 2ε) · bco_pair −log σ(βx_c) − log σ(−βx_r) · sppo_hard
  (x_c − 1/(2β))² + (x_r + 1/(2β))² · apo_zero 1 − σ(βx_c) + σ(βx_r) · apo_down σ(βx_c) + 1 − σ(β(x_c − x_r)) ·
  discopop (1 − μ)(−log σ(z)) + μ e^{−z}, z = βΔ, μ = σ(z/τ) · sigmoid_norm −log σ(βΔ̄);
the step's loss is their weighted mean over the step's pairs (divisor D = the step's pairs), plus sft's weighted
mean NLL of each micro-batch's chosen tokens, × D ÷ the step's micro-batches.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from parity.objectives import ties
from parity.objectives.causal_lm import token_log_probs

# a micro-batch's statistics, float64 sums; accuracy_ties: the pairs whose reward margin lies within its rounding
STATS = ("pairs", "reward_chosen", "reward_rejected", "margin", "accurate", "tokens", "accuracy_ties")


def step_divisor(rows) -> float:
    return float(len(rows.group) // 2)


def token_weights(mask: torch.Tensor, ld_alpha: float | None) -> torch.Tensor:
    """Each completion token's weight in its completion's log-probability: 1, or LD-DPO's ld_alpha past the pair's
    shorter completion."""
    if ld_alpha is None:
        return mask
    lengths = mask.sum(1)
    shared = torch.minimum(lengths[0::2], lengths[1::2]).repeat_interleave(2)
    position = mask.cumsum(1)
    return mask * torch.where(position <= shared[:, None], 1.0, ld_alpha)


def score(s: dict, x: torch.Tensor) -> torch.Tensor:
    kind, alpha = s["f_divergence_type"], s["f_alpha_divergence_coef"]
    if kind == "forward_kl":
        return 1 - torch.exp(-x)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(x)
    if kind == "alpha_divergence" and abs(alpha - 1) > 1e-6:
        return (torch.exp((alpha - 1) * x) - 1) / (alpha - 1)
    return x


def pair_loss(kind: str, s: dict, x_c, x_r, delta, delta_mean) -> torch.Tensor:
    """One loss type's loss of every pair of the micro-batch."""
    b, eps = s["beta"], s["label_smoothing"]
    z = b * delta
    losses = {
        "sigmoid": lambda: -F.logsigmoid(z),
        "hinge": lambda: torch.relu(1 - z),
        "ipo": lambda: (delta_mean - 1 / (2 * b)) ** 2,
        "exo_pair": lambda: (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                             + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps))),
        "nca_pair": lambda: -F.logsigmoid(b * x_c) - 0.5 * F.logsigmoid(-b * x_c) - 0.5 * F.logsigmoid(-b * x_r),
        "robust": lambda: ((1 - eps) * -F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps),
        "bco_pair": lambda: -F.logsigmoid(b * x_c) - F.logsigmoid(-b * x_r),
        "sppo_hard": lambda: (x_c - 1 / (2 * b)) ** 2 + (x_r + 1 / (2 * b)) ** 2,
        "apo_zero": lambda: 1 - torch.sigmoid(b * x_c) + torch.sigmoid(b * x_r),
        "apo_down": lambda: torch.sigmoid(b * x_c) + 1 - torch.sigmoid(b * (x_c - x_r)),
        "discopop": lambda: ((1 - torch.sigmoid(z / s["discopop_tau"])) * -F.logsigmoid(z)
                             + torch.sigmoid(z / s["discopop_tau"]) * torch.exp(-z)),
        "sigmoid_norm": lambda: -F.logsigmoid(b * delta_mean),
    }
    return losses[kind]()


def sequence_log_probs(s: dict, log_probs, rows, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(the policy's, the reference's) log-probability of each completion, [rows]."""
    weights = token_weights(mask, s["ld_alpha"])
    policy = (log_probs * weights).sum(1)
    if rows.ref_logps is not None:
        reference = (rows.ref_logps[:, 1:].float() * weights).sum(1)
    else:
        reference = rows.ref_seq_logps.float()
    return policy, reference


def micro_sum(s: dict, logits, input_ids, rows, divisor: float, micro_batches: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(what this micro-batch's pairs contribute to the step's loss × the step's divisor, its statistics)."""
    log_probs, _ = token_log_probs(logits, input_ids)
    summed, own, stats = micro_parts(s, log_probs, rows, ties.level(logits.dtype))
    return summed + own * (divisor / micro_batches), stats


def micro_parts(s: dict, log_probs, rows, level: float = ties.FP32_LEVEL
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's (sum of its pairs' weighted losses, its own mean term — sft's weighted chosen-token mean NLL, 0
    without it —, its statistics) from the policy's log-probs of its next tokens ([rows, L − 1]): it contributes sum +
    own × D ÷ the step's micro-batches to the step's loss × D. `level`: the log-probs' rounding (ties.level)."""
    mask = rows.completion_mask[:, 1:].float().to(log_probs.device)
    policy, reference = sequence_log_probs(s, log_probs, rows, mask)
    x = policy - reference
    x_c, x_r = x[0::2], x[1::2]
    f_c, f_r = score(s, x_c), score(s, x_r)
    lengths = mask.sum(1).clamp(min=1)
    delta, delta_mean = f_c - f_r, f_c / lengths[0::2] - f_r / lengths[1::2]
    summed, own = torch.zeros((), device=log_probs.device), torch.zeros((), device=log_probs.device)
    for kind, weight in zip(s["loss_type"], s["loss_weights"]):
        if kind == "sft":
            chosen = mask[0::2]
            own = own + weight * (-(log_probs[0::2] * chosen).sum() / chosen.sum().clamp(min=1))
        else:
            summed = summed + weight * pair_loss(kind, s, x_c, x_r, delta, delta_mean).sum()
    with torch.no_grad():
        reward_c, reward_r = s["beta"] * x_c, s["beta"] * x_r
        scale = policy.abs() + reference.abs() + token_weights(mask, s["ld_alpha"]).sum(1)  # (ties.py)
        noise = level * abs(s["beta"]) * (scale[0::2] + scale[1::2])
        values = (float(len(x_c)), reward_c.sum(), reward_r.sum(), (reward_c - reward_r).sum(),
                  (reward_c > reward_r).float().sum(), mask.sum(), ties.tied(reward_c - reward_r, noise).float().sum())
        stats = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=mask.device) for v in values])
    return summed, own, stats


def quantities(s: dict, stats: list[float]) -> dict:
    """The step's quantities: its pairs, the chosen and rejected implicit rewards β x, their margin, the fraction of
    pairs whose chosen reward is the higher, and how many of those decisions were ties (ties.py)."""
    t = dict(zip(STATS, stats))
    pairs = max(t["pairs"], 1.0)
    return {"pairs": t["pairs"], "rewards_chosen": t["reward_chosen"] / pairs,
            "rewards_rejected": t["reward_rejected"] / pairs,
            "margin": t["margin"] / pairs, "accuracy": t["accurate"] / pairs, "accuracy_ties": t["accuracy_ties"]}
