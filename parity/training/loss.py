"""The loss every strategy trains on, defined once: the sum of next-token cross-entropies, and the label it skips."""

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
