"""The recorder for Hugging Face's Trainer (and what inherits it): `Trainer(..., callbacks=[ParityCallback(output_dir,
name=...)])` (docs/own_trainer.md).

What a callback cannot see, it takes from the framework's own extension points:
- the loss: a forward hook on the model (registered with its kwargs) hands the recorder each training micro-batch's
  input ids, labels, attention mask and the model's logits; the recorder measures the global token mean itself;
- the pre-clip gradient norm: Trainer's callbacks run after its clipping (on_pre_optimizer_step comes after
  `_clip_grad_norm`). Where Trainer's own norm (its logs' `grad_norm`: what clip_grad_norm_ returned, in fp32, good to
  ~1e-5 relative over a large gradient) says it did not clip at the step (norm + 1e-6 <= max_grad_norm, or no
  clipping: the gradients are unchanged), the recorder's float64 norm of the gradients the optimizer step applies is
  the pre-clip norm (`grad_norm_source: recorder`); where it clipped, Trainer's value is recorded
  (`grad_norm_source: framework`). Trainer logs it at every logging step: the callback needs `logging_steps=1` and
  says so in one line otherwise;
- the lr: the recorder's optimizer step pre-hook on the torch optimizer inside accelerate's wrapper.
"""

from __future__ import annotations

import importlib.metadata as md

import torch
from transformers import TrainerCallback

from parity.integrations.recorder import DEFAULT_MAX_BATCH_BYTES, ParityRecorder, unwrap

PRECISIONS = (("bf16", "bf16"), ("fp16", "fp16"))  # TrainingArguments flag → the harness's policy (autocast)


class ParityCallback(TrainerCallback):
    """Records a Trainer's run for the harness: `output_dir` and `name` as ParityRecorder's, `max_batch_bytes` its
    cap on the saved batches."""

    def __init__(self, output_dir: str, *, name: str, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES):
        self.output_dir, self.name, self.max_batch_bytes = output_dir, name, max_batch_bytes
        self.recorder: ParityRecorder | None = None
        self._hook, self._stepped = None, False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        precision = next((policy for flag, policy in PRECISIONS if getattr(args, flag, False)), "fp32")
        versions = {}
        for package in ("transformers", "accelerate", "trl"):
            try:
                versions[package] = md.version(package)
            except md.PackageNotFoundError:
                pass
        self.recorder = ParityRecorder(self.output_dir, name=self.name, model=model,
                                       optimizer=getattr(optimizer, "optimizer", optimizer),
                                       max_grad_norm=args.max_grad_norm or 0.0, precision=precision,
                                       max_batch_bytes=self.max_batch_bytes, framework="transformers.Trainer",
                                       framework_versions=versions)
        if not self.recorder.enabled:
            return
        if args.logging_steps != 1:
            self.recorder._disable(f"Trainer logs its pre-clip grad norm every logging step: pass logging_steps=1 "
                                   f"(got {args.logging_steps})")
            return
        self._hook = unwrap(model).register_forward_hook(self._forward, with_kwargs=True)
        self.recorder.norm_at_optimizer_step = float("nan")  # measured by the recorder's optimizer step pre-hook

    def _forward(self, module, args, kwargs, output) -> None:
        """A training micro-batch's forward: its rows and the logits the model made of them."""
        if not (module.training and torch.is_grad_enabled()) or self.recorder is None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        labels = kwargs.get("labels")
        if labels is None or ids is None:
            self.recorder.broken = "a training forward without input_ids and labels (the recorder needs both)"
            return
        self.recorder.micro_batch(ids, labels, output.logits, attention_mask=kwargs.get("attention_mask"))

    def on_step_end(self, args, state, control, **kwargs):
        self._stepped = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._stepped and self.recorder is not None and logs and "grad_norm" in logs:
            self._stepped = False
            theirs, own = float(logs["grad_norm"]), self.recorder.norm_at_optimizer_step
            clipping = args.max_grad_norm or 0.0
            unclipped = clipping <= 0 or theirs + 1e-6 <= clipping  # torch's coefficient max / (norm + 1e-6) >= 1
            if own is not None and unclipped and own == own:  # (own == own: not NaN)
                self.recorder.before_step(grad_norm=own, source="recorder")
            else:
                self.recorder.before_step(grad_norm=theirs, source="framework")
            self.recorder.after_step(logged_loss=logs.get("loss"), logged_grad_norm=theirs)
            self.recorder.norm_at_optimizer_step = float("nan")

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.recorder is not None:
            self.recorder.close()
