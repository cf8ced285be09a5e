"""A Hugging Face model's training forward handed to the recorder: what Trainer's and Lightning's callbacks share
(parity/frameworks/transformers/callback.py, parity/frameworks/lightning/callback.py). Each registers a forward hook
with its kwargs on the model, which sees each micro-batch's input ids, labels, attention mask, position ids and
use_cache as passed (packed rows are replayed as they were fed: parity/training/fed_rows.py) and the logits the model
made of them; the recorder measures the global token mean itself. The hook is the room's own, `guarded`: what this
raises ends the record, never the user's run."""

from __future__ import annotations

import torch


def hand_over(recorder, module, args, kwargs, output) -> None:
    """`module`'s forward to `recorder` where it is a training micro-batch's (training mode, gradients on); any other
    forward (evaluation, generation) is none of the recorder's."""
    if not (module.training and torch.is_grad_enabled()):
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    labels = kwargs.get("labels")
    if labels is None or ids is None:
        recorder.broken = "a training forward without input_ids and labels (the recorder needs both)"
        return
    logits = getattr(output, "logits", None)
    fused = getattr(output, "log_probs", None) if logits is None else None  # TRL's fused LM head: no logits
    recorder.micro_batch(ids, labels, logits, attention_mask=kwargs.get("attention_mask"), log_probs=fused,
                         position_ids=kwargs.get("position_ids"), use_cache=kwargs.get("use_cache"))
