"""The sampler verdict's checks (docs/sampler.md#the-sampler-verdict): the per-token gap sampler − trainer against the
noise of the trainer's own arithmetic measured on the same tokens, as distributions, so that the verdict's power grows
with the tokens judged:

- the largest |gap| within NOISE_K (20) × the noise's largest: a single token;
- each of QUANTILES of |gap| within SPREAD_K (3) × the noise's same quantile, with the binomial slack of n tokens: of
  n tokens at most n(1 − q) lie above the noise's q-quantile where the gap is as wide as the noise, so the check
  holds the k-th largest |gap| to the bound, k the count whose chance under that binomial is below ALPHA (k → n(1 − q)
  as n grows; too few tokens for any such k: the check is not made, and says so);
- the signed mean (a systematic offset) within the noise's mean |·| × (OFFSET_K + NOISE_K ÷ √n), plus OFFSET_Z
  standard errors of the gap's own mean: a single token's bound at n = 1, one noise width of offset as n grows.

Each token's noise is at least fp32's rounding of its log-prob (|log-prob| × fp32's eps): a reference that rounds alike
measures 0."""

from __future__ import annotations

import math

import torch

from parity.comparing.tolerances import NOISE_K

SPREAD_K = 3.0  # a quantile of |gap| within this × the noise's same quantile
QUANTILES = (50, 90)
ALPHA = 1e-3  # the chance, all quantile checks of a verdict together, that a gap as wide as SPREAD_K × the noise FAILs
OFFSET_K, OFFSET_Z = 1.0, 4.0
CHECKS = ("signed_mean", *(f"q{q}" for q in QUANTILES), "max_abs")


def floored(noise: torch.Tensor, trainer: torch.Tensor) -> torch.Tensor:
    """Each token's noise, at least fp32's rounding of the trainer's log-prob of it."""
    return torch.maximum(noise, trainer.abs() * torch.finfo(torch.float32).eps)


def critical_count(n: int, p: float, alpha: float) -> int | None:
    """The least k with P(Binomial(n, p) ≥ k) ≤ alpha; None where even k = n is likelier."""
    if n == 0:
        return None
    k = torch.arange(n + 1, dtype=torch.float64)
    log_pmf = (math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1) + k * math.log(p)
               + (n - k) * math.log1p(-p))
    tail = torch.logcumsumexp(log_pmf.flip(0), 0).flip(0)  # log P(X ≥ k)
    found = (tail <= math.log(alpha)).nonzero()
    return int(found[0]) if len(found) else None


def checks(gap: torch.Tensor, noise: torch.Tensor, alpha: float) -> dict:
    """{"tokens", "statistics", "bounds", "ranks" (each quantile check's k), "margins"} of one group of tokens' gap
    and (floored) noise, each quantile check at `alpha`; a check too few tokens can make is None throughout."""
    n = len(gap)
    size = gap.abs()
    ordered = size.sort(descending=True).values
    mean_noise = float(noise.mean())
    spread = float(gap.std(correction=0)) if n > 1 else 0.0
    statistics = {"signed_mean": float(gap.mean().abs()), "max_abs": float(ordered[0])}
    bounds = {"signed_mean": mean_noise * (OFFSET_K + NOISE_K / math.sqrt(n)) + OFFSET_Z * spread / math.sqrt(n),
              "max_abs": NOISE_K * float(noise.max())}
    ranks = {}
    for q in QUANTILES:
        k = critical_count(n, 1 - q / 100, alpha)
        ranks[f"q{q}"] = k
        statistics[f"q{q}"] = None if k is None else float(ordered[k - 1])
        bounds[f"q{q}"] = SPREAD_K * float(noise.quantile(q / 100))
    margins = {c: None if statistics[c] is None else statistics[c] / max(bounds[c], 1e-30) for c in CHECKS}
    return {"tokens": n, "statistics": statistics, "bounds": bounds, "ranks": ranks, "margins": margins}


def failed(result: dict) -> str | None:
    """The first check of `checks`' result whose statistic passes its bound, else None."""
    return next((c for c in CHECKS if result["margins"][c] is not None and result["margins"][c] > 1), None)


def within(gap: torch.Tensor, noise: torch.Tensor) -> bool:
    """Whether a gap passes every check against `noise` (one group's, the quantile checks at ALPHA)."""
    return len(gap) == 0 or failed(checks(gap, noise, ALPHA / len(QUANTILES))) is None


__all__ = ["ALPHA", "CHECKS", "QUANTILES", "SPREAD_K", "checks", "critical_count", "failed", "floored", "within"]
