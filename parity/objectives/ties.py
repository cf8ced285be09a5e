"""Ties: a discrete decision (DPO's chosen reward above the rejected one, a GRPO ratio beyond its clip bound) whose
margin lies within that margin's own rounding, so that two runs computing the same step may decide it either way (at
DPO's step 0 the policy is its reference: every margin is 0 up to rounding). Each is counted beside its decision
(dpo.py, grpo.py), and parity/comparing/objective.py widens a discrete quantity's bound by the ties.

A log-prob's rounding scales with what was summed into it (the logits: of order 1 even where log π is near 0), so a
log-ratio's noise is taken as LEVEL × Σ over its tokens of (|log π| + |the other log π| + 1), the level by the dtype of
the logits. Measured here (qwen2-tiny, AMD EPYC; at init, mean |log π| 7.6, and trained to 0.14), relative to
Σ(|log π| + 1): another batch shape, thread count, padding or attention mask gave the same bits in fp32 and bf16; the
eager against the sdpa attention kernel at most 9.7e-7 a token and 5.8e-7 a sequence in fp32, and in bf16 (and autocast
against bf16 weights) 1.9e-2 a token and 4.7e-3 a sequence (bf16 against fp32: 1.7e-2, 3.6e-3). FP32_LEVEL leaves 10×
over fp32's, LOW_LEVEL 1.6× a token (the other log-prob's |·| adds more) and 6× a sequence over bf16's."""

from __future__ import annotations

import torch

FP32_LEVEL = 1e-5
LOW_LEVEL = 3e-2  # bf16, fp16
SUFFIX = "_ties"  # a discrete quantity's ties in the step's quantities: "accuracy_ties", "clipped_low_ties" …


def level(dtype: torch.dtype | None) -> float:
    """The relative rounding level of log-probs computed from logits of `dtype` (None: fp32 log-probs handed over)."""
    return LOW_LEVEL if dtype in (torch.bfloat16, torch.float16) else FP32_LEVEL


def tied(margin: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Where |margin| lies within its noise (a margin of exactly 0 always does)."""
    return margin.abs() <= noise
