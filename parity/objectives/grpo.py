"""The GRPO family at work: a micro-batch's sum of its rows' loss and its per-step quantities (docs/posttrain.md has
the formulas and their sources; parity/objectives/__init__.py the definitions and their settings).

Per completion token t of row i (the counted mask m: the completion's tokens, without a truncated row's under
mask_truncated_completions), with log π (the policy's), log π_old (the rollout's; the policy's own, detached, where
the file holds none), log π_ref and the row's advantage A:
  ratio r = exp(log π − log π_old) per token; GSPO's sequence level: exp of its mean over the row's tokens;
  grpo, bnpo, dr_grpo, dapo, luspo: l = −min(min(r, δ) A, clip(r, 1 − ε_low, 1 + ε_high) A);
  cispo: l = −sg(min(r, ε_high)) A log π;  sapo: l = −σ(τ(r − 1)) 4/τ A, τ by the sign of A;
  vespo: l = −sg(φ(w)) A log π, w = exp Σ_t (log π − log π_old), φ(w) = exp(λ + k log w − λ w), (k, λ) by A ≥ 0;
  rloo: one term per row, −min(r A, clip(r, 1 − ε_low, 1 + ε_high) A), r = exp Σ_t m (log π − log π_old) (no KL term:
  TRL's RLOOTrainer puts β KL into the rewards);
  + β k3, k3 = exp(log π_ref − log π) − (log π_ref − log π) − 1 (× r under use_bias_correction_kl).
The policy's log-probs are those of its logits ÷ the sampling temperature (TRL's `temperature`, 1 by default).
A micro-batch returns the sum its rows contribute × the step's divisor D (Objective.step_divisor): Σ l m for the
token-summed definitions (dapo, cispo, vespo: D the step's tokens; dr_grpo: D = rows × L; luspo: D = rows), Σ_i of
each row's token mean (grpo, sapo: D = rows) or of each row's term (rloo: D = rows); bnpo its own token mean × D ÷ the
step's micro-batches; the entropy bonus − coef × its own mean entropy × D ÷ the step's micro-batches (micro_parts: the
two parts apart).
"""

from __future__ import annotations

import math

import torch

from parity.objectives import ties
from parity.objectives.causal_lm import entropies, token_log_probs

CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "rloo")  # the clipped surrogate
ROW_MEANS = ("grpo", "sapo")  # each row's token mean, averaged over the step's rows
ROW_SUMS = ("luspo",)  # each row's token sum, averaged over the step's rows
ROW_TERMS = ("rloo",)  # one term per row (its summed log-ratio's), averaged over the step's rows
TOKEN_SUMS = ("dapo", "cispo", "vespo")  # summed over the step ÷ its tokens (or the generation batch's)
# a micro-batch's statistics, float64 sums (summed over the DP ranks, then `quantities`); *_ties: the clipped counts'
# ratios that lie within their rounding of the clip bound (ties.py)
STATS = ("tokens", "rows", "kl", "ratio", "ratios", "clipped_low", "clipped_high", "entropy", "phi", "advantage",
         "clipped_low_ties", "clipped_high_ties")


def step_divisor(name: str, s: dict, rows, generation_tokens: float | None = None) -> float:
    """The step's divisor D from all its rows (a RolloutRows): what the micro-batches' sums are divided by."""
    count = len(rows.group)
    if name in ROW_MEANS + ROW_SUMS + ROW_TERMS:
        return float(count)
    if name == "dr_grpo":
        return float(count * s["max_completion_length"])
    tokens = float(rows.counted(s["mask_truncated_completions"])[:, 1:].sum())
    if name in TOKEN_SUMS and s["normalizer"] == "generation":
        tokens = generation_tokens
    return max(tokens, 1.0)


def surrogate(name: str, s: dict, ratio, advantages, log_probs, log_ratio, mask):
    """Each token's policy loss l (before the KL term): [rows, L − 1], or [rows, 1] at the sequence level."""
    a = advantages
    if name in CLIPPED:
        clipped = ratio.clamp(1 - s["epsilon"], 1 + s["epsilon_high"])
        capped = ratio.clamp(max=s["delta"]) if s.get("delta") is not None else ratio
        return -torch.min(capped * a, clipped * a)
    if name == "cispo":
        return -ratio.clamp(max=s["epsilon_high"]).detach() * a * log_probs
    if name == "sapo":
        tau = torch.where(a > 0, s["sapo_temperature_pos"], s["sapo_temperature_neg"])
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
    if name == "vespo":
        return -vespo_weight(s, log_ratio, mask, a) * a * log_probs
    raise AssertionError(name)


@torch.no_grad()
def vespo_weight(s: dict, log_ratio, mask, advantages):
    """VESPO's φ(w) of each row's sequence importance weight w = exp Σ_t log r (detached), [rows, 1]."""
    log_w = (log_ratio * mask).sum(1, keepdim=True)
    nonneg = advantages >= 0
    k = torch.where(nonneg, s["vespo_k_pos"], s["vespo_k_neg"])
    lam = torch.where(nonneg, s["vespo_lambda_pos"], s["vespo_lambda_neg"])
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, 0.0, 0.0)


@torch.no_grad()
def sampler_weight(s: dict, old, sampler_logps, mask):
    """TRL 1.16's vLLM importance-sampling correction (GRPOTrainer._generate_and_score_completions): the weight of
    π_old to the sampler, exp(log π_old − the sampler's log-prob) of each counted token (a token the sampler gave no
    log-prob for: 1), or of the sequence's summed log-ratio, clamped to [clip_min, clip_max] (*_truncate) or 0 outside
    them (*_mask): [rows, L − 1] or [rows, 1]."""
    diff = torch.nan_to_num((old - sampler_logps) * mask, nan=0.0)
    mode = s["vllm_importance_sampling_mode"]
    weight = (diff.sum(1, keepdim=True) if mode.startswith("sequence") else diff).exp()
    low, high = s["vllm_importance_sampling_clip_min"], s["vllm_importance_sampling_clip_max"]
    if mode.endswith("truncate"):
        return weight.clamp(min=low, max=high)
    outside = (weight < (-math.inf if low is None else low)) | (weight > (math.inf if high is None else high))
    return weight.masked_fill(outside, 0.0)


def micro_sum(name: str, s: dict, logits, input_ids, rows, divisor: float, micro_batches: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(what this micro-batch contributes to the step's loss × the step's divisor, its statistics (STATS, float64)):
    its parts (micro_parts) of the log-probs of the logits at the sampling temperature."""
    tempered = logits if s["temperature"] == 1 else logits / s["temperature"]
    log_probs, log_softmax = token_log_probs(tempered, input_ids)
    entropy = entropies(log_softmax if s.get("entropy_coef") else log_softmax.detach())
    summed, own, stats = micro_parts(name, s, log_probs, entropy, rows, ties.level(logits.dtype))
    return summed + own * (divisor / micro_batches), stats


def micro_parts(name: str, s: dict, log_probs, entropy, rows, level: float = ties.FP32_LEVEL
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's (sum of its rows' terms, its own mean term, its statistics) from the policy's log-probs and
    entropies of its next tokens ([rows, L − 1], at the sampling temperature): the micro-batch contributes sum + own ×
    D ÷ the step's micro-batches to the step's loss × D. The own term is bnpo's token mean and the entropy bonus; 0 for
    the rest. A recorder computes them from the log-probs the run's own forward returned (a fused LM head's). `level`:
    the log-probs' rounding (ties.level)."""
    mask = rows.counted(s["mask_truncated_completions"])[:, 1:].to(log_probs.device)
    if name in ROW_TERMS:
        return row_term_parts(name, s, log_probs, entropy, rows, mask, level)
    lengths = mask.sum(1)
    old = log_probs.detach() if rows.old_logps is None else rows.old_logps[:, 1:].float()
    log_ratio = torch.where(mask > 0, log_probs - old, 0.0)
    advantages = rows.advantages.float()[:, None]
    sequence = s["importance_sampling_level"] == "sequence"
    log_weight = log_ratio.sum(1, keepdim=True) / lengths.clamp(min=1)[:, None] if sequence else log_ratio
    ratio = log_weight.exp()
    per_token = surrogate(name, s, ratio, advantages, log_probs, log_ratio, mask)
    if s.get("vllm_importance_sampling_correction"):
        per_token = per_token * sampler_weight(s, old, rows.sampler_logps[:, 1:].float().to(old.device), mask)
    kl = None
    if s["beta"]:
        gap = torch.where(mask > 0, rows.ref_logps[:, 1:].float() - log_probs, 0.0)
        kl = gap.exp() - gap - 1
        if s["use_bias_correction_kl"]:
            kl = kl * ratio
        per_token = per_token + s["beta"] * kl
    per_token = per_token * mask
    micro_tokens = mask.sum().clamp(min=1)
    own = torch.zeros((), device=log_probs.device)
    if name in ROW_MEANS:
        summed = (per_token.sum(1) / lengths.clamp(min=1)).sum()
    elif name == "bnpo":
        summed, own = torch.zeros((), device=log_probs.device), per_token.sum() / micro_tokens
    else:
        summed = per_token.sum()
    if s["entropy_coef"]:
        own = own - s["entropy_coef"] * (entropy * mask).sum() / micro_tokens
    noise = None  # on-policy the ratio is exactly 1 in every run: no ties
    if rows.old_logps is not None:
        per_token = level * torch.where(mask > 0, log_probs.detach().abs() + old.abs() + 1, 0.0)
        noise = per_token.sum(1, keepdim=True) / lengths.clamp(min=1)[:, None] if sequence else per_token
    return summed, own, statistics(name, s, mask, ratio, advantages, kl, entropy.detach(), log_ratio, sequence, noise)


def row_term_parts(name: str, s: dict, log_probs, entropy, rows, mask, level: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rloo's micro_parts: each row's one term of its sequence ratio r = exp(Σ_t m (log π − log π_old)) — π_old's sum
    as the trainer kept it (old_seq_logps), else its per-token log-probs summed, else the policy itself (r = 1). Every
    row counts, one without a counted token too (r = 1: −A, no gradient), as in TRL's mean over a micro-batch's rows."""
    logps = (log_probs * mask).sum(1, keepdim=True)
    if rows.old_seq_logps is not None:
        old = rows.old_seq_logps.float()[:, None]
    elif rows.old_logps is not None:
        old = (rows.old_logps[:, 1:].float() * mask).sum(1, keepdim=True)
    else:
        old = logps.detach()
    log_ratio, advantages = logps - old, rows.advantages.float()[:, None]
    ratio = log_ratio.exp()
    summed = surrogate(name, s, ratio, advantages, None, None, None).sum()
    noise = None  # on-policy the ratio is exactly 1 in every run: no ties
    if rows.old_seq_logps is not None or rows.old_logps is not None:  # the sum's rounding, token by token
        noise = level * (((log_probs.detach().abs() + 1) * mask).sum(1, keepdim=True) + old.abs())
    stats = statistics(name, s, mask, ratio, advantages, None, entropy.detach(), log_ratio, True, noise)
    return summed, torch.zeros((), device=log_probs.device), stats


@torch.no_grad()
def statistics(name, s, mask, ratio, advantages, kl, entropy, log_ratio, sequence, noise=None) -> torch.Tensor:
    """A micro-batch's sums for the step's quantities (STATS): its tokens and rows, the KL term's sum, the ratios'
    sum and count (tokens, or rows at the sequence level), the clipped ones below and above, the entropy's sum,
    VESPO's weights' sum, the rows' |advantage| sum, and the clipped counts' ties: ratios within `noise` (each log
    ratio's rounding, ties.py; None: none) of their bound."""
    scored = (mask.sum(1, keepdim=True) > 0).float() if sequence else mask
    ratios = (ratio * scored).sum()
    zero = torch.zeros((), device=mask.device)
    low = high = low_ties = high_ties = zero

    def counted(beyond, bound, sign):  # (the ratios beyond `bound` with an advantage of `sign`, those tied at it)
        eligible = advantages * sign > 0
        near = ties.tied(ratio - bound, ratio * noise) & eligible if noise is not None else None
        return ((beyond & eligible).float() * scored).sum(), zero if near is None else (near.float() * scored).sum()

    if name in CLIPPED:
        low, low_ties = counted(ratio < 1 - s["epsilon"], 1 - s["epsilon"], -1)
        high, high_ties = counted(ratio > 1 + s["epsilon_high"], 1 + s["epsilon_high"], 1)
    elif name == "cispo":
        high, high_ties = counted(ratio > s["epsilon_high"], s["epsilon_high"], 1)
    phi = vespo_weight(s, log_ratio, mask, advantages).sum() if name == "vespo" else zero
    kl_sum = (kl * mask).sum() if kl is not None else zero
    values = (mask.sum(), float(len(mask)), kl_sum, ratios, scored.sum(), low, high, (entropy * mask).sum(), phi,
              advantages.abs().sum(), low_ties, high_ties)
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=mask.device) for v in values])


def quantities(name: str, s: dict, stats: list[float]) -> dict:
    """The step's quantities from its statistics summed over every micro-batch: the tokens counted and the ratios
    scored (tokens, or rows at the sequence level), mean KL per token (β > 0), the mean ratio, the fraction clipped
    (below, above, either) and how many of each were ties (ties.py), the mean entropy, VESPO's mean weight, and the
    mean |advantage|: the scale of the loss, which crosses 0 where the advantages cancel (parity/comparing/objective.py
    measures it against that)."""
    t = dict(zip(STATS, stats))
    tokens, ratios = max(t["tokens"], 1.0), max(t["ratios"], 1.0)
    found = {"tokens": t["tokens"], "scored": t["ratios"], "ratio_mean": t["ratio"] / ratios,
             "advantage_scale": t["advantage"] / max(t["rows"], 1.0)}
    if t["entropy"] == t["entropy"]:  # (not NaN: a recorded forward that returned no entropies has none)
        found["entropy"] = t["entropy"] / tokens
    if s.get("beta"):
        found["kl"] = t["kl"] / tokens
    if name in CLIPPED + ("cispo",):
        found.update(clipped_fraction=(t["clipped_low"] + t["clipped_high"]) / ratios,
                     clipped_low=t["clipped_low"] / ratios, clipped_high=t["clipped_high"] / ratios,
                     clipped_fraction_ties=t["clipped_low_ties"] + t["clipped_high_ties"],
                     clipped_low_ties=t["clipped_low_ties"], clipped_high_ties=t["clipped_high_ties"])
    if name == "vespo":
        found["phi_mean"] = t["phi"] / max(t["rows"], 1.0)
    return found
