"""The causal-LM token mean, today's loss, as the objective room's first definition: the sum of next-token
cross-entropies, and the label it skips. parity/training/loss.py re-exports it for the strategies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a label the loss skips (padding): data.py's padded samples and the routing's real tokens use it


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The sum of next-token cross-entropies in fp32 (logits are upcast, whatever the compute dtype) over the
    positions with a label: position t predicts labels[t + 1], and a label of −100 (padding) counts nothing.
    A step's loss is the sum over the global batch ÷ its loss tokens (data.Batch.loss_tokens): the mean over
    tokens, whatever each rank or micro-batch holds, never a mean of their means."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def measured_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """loss_sum's value, for a reading without gradients (the recorder's): the labels shifted rather than the logits,
    whose shifted slice loss_sum copies — at Qwen2.5-0.5B's vocabulary 187 ms against 348 a micro-batch of 2 × 256 on
    one core. Equal to loss_sum to fp32 rounding (its sums grouped otherwise: 1e-7 of the value)."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # the last position predicts nothing
    return F.cross_entropy(logits.float().flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π of each next token, the log-softmax it came from): [rows, L − 1] and [rows, L − 1, vocab] in fp32, the
    logits at position t scoring the token at t + 1 (a rollout's per-token values, shifted by one: [:, 1:])."""
    log_softmax = logits[:, :-1].float().log_softmax(-1)
    return log_softmax.gather(-1, input_ids[:, 1:, None]).squeeze(-1), log_softmax


def entropies(log_softmax: torch.Tensor) -> torch.Tensor:
    """Each position's entropy of its next-token distribution, −Σ p log p, [rows, L − 1]."""
    return -(log_softmax.exp() * log_softmax).sum(-1)
