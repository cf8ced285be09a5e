"""The recorder for Lightning's Trainer: `lightning.Trainer(..., callbacks=[ParityCallback(output_dir, name=...)])`
(docs/own_trainer.md).

What a callback cannot see, it takes from the framework's own extension points, never from a patched library:
- the loss: a forward hook on the Hugging Face model inside the LightningModule (registered with its kwargs, handing
  over as Trainer's callback does: parity/recording/forward_hook.py) hands the recorder each training micro-batch's
  input ids, labels, attention mask and the logits; the recorder measures the global token mean itself. The model
  must be called with `labels=` (Hugging Face's convention) for the hook to see them;
- the pre-clip gradient norm: Lightning calls `on_before_optimizer_step` after the window's last backward (DDP's
  gradients reduced) and before its own clipping (Precision._after_closure, lightning 2.6), so the recorder measures it
  in float64 from the gradients (`grad_norm_source: recorder`), and every tensor's pre-clip norm there;
- under manual optimization (`automatic_optimization = False`: the module's own manual_backward, clip_gradients and
  opt.step()), where that hook comes after the module's own clipping: where the module calls `self.clip_gradients`
  (the instance's method observed, then called as it was: its clip is the record's max_grad_norm), else at
  `on_before_optimizer_step`; the gradients' norm once the last manual_backward returned (the instance's method
  observed: after every reduction Lightning's backward runs — DDP's first iteration under static_graph reduces in the
  strategy's post_backward, after `on_after_backward`) must be the one read there — gradients changed in between any
  other way (a clip by hand) end the record, saying so;
- the lr: the recorder's optimizer step pre-hook on the torch optimizer Lightning steps;
- the framework's own loss: what `training_step` returned over the window (Lightning divides each by
  `accumulate_grad_batches`), summed, then averaged over the ranks: `logged_loss`.

One process without a process group (Lightning's single-device strategy): the callback starts a gloo group of one for
the recorder and ends it after training.

A run resumed with `trainer.fit(..., ckpt_path=...)` continues its first run's record from the checkpoint's step
(trainer.global_step at on_train_start: ParityRecorder's start_step); each checkpoint Lightning saves writes the record
(on_save_checkpoint: ModelCheckpoint saves after the other callbacks' on_train_batch_end, where the step was recorded),
so that it holds the steps up to the checkpoint.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from parity.fingerprint import installed_versions
from parity.frameworks import guarded, stop_record
from parity.models.families import hf_config
from parity.recording.forward_hook import hand_over
from parity.recording.recorder import DEFAULT_MAX_BATCH_BYTES, ParityRecorder
from parity.recording.states import DEFAULT_CHECKPOINT_INTERVAL, DEFAULT_MAX_STATE_BYTES

_OBSERVED = ("clip_gradients", "manual_backward")  # the module's methods observed under manual optimization
# Lightning's precision → the harness's policy (32: none told, the module's own — bf16 parameters are bf16_pure —
# else fp32, as recording/precision_seen.py reads it)
PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": "bf16", "16-mixed": "fp16_autocast"}


def hugging_face_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a LightningModule (the first submodule with a config that holds every one of its
    parameters): its parameter names are the ones the replay builds; the LightningModule itself otherwise (the record
    then says it is not replayable)."""
    everything = {id(p) for p in module.parameters()}
    for sub in module.modules():
        if hf_config(sub) is not None and {id(p) for p in sub.parameters()} == everything:
            return sub
    return module


def _algorithm(algorithm) -> str:
    """Lightning's gradient clip algorithm by name ("norm", its default for None, or "value"): a string or its enum."""
    return getattr(algorithm, "value", algorithm) or "norm"


class ParityCallback(pl.Callback):
    """Records a Lightning run for the harness: `output_dir` and `name` as ParityRecorder's, `max_batch_bytes` its cap
    on the saved batches, `checkpoint_interval` and `max_state_bytes` where and how much of the run's state it saves
    for the teacher-forced check (parity/recording/states.py). One optimizer, automatic or manual optimization,
    clipping by norm (or none)."""

    def __init__(self, output_dir: str, *, name: str, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
                 checkpoint_interval: int | None = DEFAULT_CHECKPOINT_INTERVAL,
                 max_state_bytes: int = DEFAULT_MAX_STATE_BYTES):
        self.output_dir, self.name, self.max_batch_bytes = output_dir, name, max_batch_bytes
        self.state_saving = {"checkpoint_interval": checkpoint_interval, "max_state_bytes": max_state_bytes}
        self.recorder: ParityRecorder | None = None
        self._hook, self._stepped, self._logged = None, False, 0.0
        # manual optimization; its step read at clip_gradients; the gradients' norm after the last manual_backward
        self._manual, self._clipped, self._backward_norm, self._observed = False, False, None, None

    @guarded
    def _forward(self, module, args, kwargs, output) -> None:
        """A training micro-batch's rows and logits, as Trainer's callback hands them over (parity/recording/
        forward_hook.py)."""
        if self.recorder is not None:
            hand_over(self.recorder, module, args, kwargs, output)

    @guarded
    def on_train_start(self, trainer, pl_module):
        refusal = self._refusal(trainer, pl_module)
        if refusal:  # before the recorder starts: nothing written
            stop_record(self, refusal)
            return
        model = hugging_face_model(pl_module)
        optimizers = trainer.optimizers
        clip = float(trainer.gradient_clip_val or 0.0)
        by_value = _algorithm(trainer.gradient_clip_algorithm) == "value"  # clip_grad_value_, replayed as it is
        self.recorder = ParityRecorder(self.output_dir, name=self.name, model=model,
                                       optimizer=optimizers[0] if optimizers else None,
                                       max_grad_norm=0.0 if by_value else clip, clip_value=clip if by_value else None,
                                       precision=PRECISIONS[str(trainer.precision)],
                                       max_batch_bytes=self.max_batch_bytes, framework="lightning.Trainer",
                                       framework_versions=installed_versions(("lightning", "transformers", "torch")),
                                       **self.state_saving,
                                       start_step=trainer.global_step)  # > 0: resumed from ckpt_path
        if not self.recorder.enabled:
            return
        self._hook = model.register_forward_hook(self._forward, with_kwargs=True)
        self._manual = not pl_module.automatic_optimization
        if self._manual:  # the instance's own entries kept, to put back at the end
            self._observed = (pl_module, {m: pl_module.__dict__[m] for m in _OBSERVED if m in pl_module.__dict__})
            pl_module.clip_gradients = self._observed_clip(pl_module.clip_gradients)
            pl_module.manual_backward = self._observed_backward(pl_module.manual_backward)

    def _observed_backward(self, backward):
        """The module's manual_backward, called as it was, the gradients' norm read once it returns: the gradients it
        left, reduced wherever the strategy reduces them (manual optimization)."""
        def manual_backward(loss, *args, **kwargs):
            backward(loss, *args, **kwargs)
            self._read_backward()

        return manual_backward

    @guarded
    def _read_backward(self) -> None:
        if self.recorder is not None and self.recorder.enabled:
            self._backward_norm = self.recorder.view.grad_norm()  # float64, of the reduced gradients so far

    def _observed_clip(self, clip):
        """The module's clip_gradients, called as it was, its clip read first (manual optimization)."""
        def clip_gradients(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self._read_clip(gradient_clip_val, gradient_clip_algorithm)
            return clip(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

        return clip_gradients

    @guarded
    def _read_clip(self, gradient_clip_val, gradient_clip_algorithm) -> None:
        if self.recorder is not None and self.recorder.enabled and gradient_clip_val:
            self._read_manual()
            if _algorithm(gradient_clip_algorithm) == "value":
                self.recorder.clips_by_value(float(gradient_clip_val))
            else:
                self.recorder.clips_at(float(gradient_clip_val))
            self._clipped = True

    @staticmethod
    def _refusal(trainer, pl_module) -> str | None:
        """What this adapter cannot record, in one line."""
        if len(trainer.optimizers) != 1:
            return f"{len(trainer.optimizers)} optimizers: the recorder follows one"
        if str(trainer.precision) not in PRECISIONS:
            return f"precision {trainer.precision!r}: the harness replays {', '.join(sorted(PRECISIONS))}"
        return None

    @guarded
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.recorder is not None:
            if not self._manual:
                self.recorder.before_step()  # before Lightning's clipping: the recorder's own float64 pre-clip norm
            elif not self._clipped:
                self._read_manual()
            self._stepped = True

    def _read_manual(self) -> None:
        """Manual optimization: the pre-clip gradients read (before_step), which must be those the last
        manual_backward left; else the module changed them by hand, which the replay cannot repeat."""
        self.recorder.before_step()
        pre, seen = self.recorder.grad_norm, self._backward_norm
        if pre is not None and seen is not None and abs(pre - seen) > 1e-6 * abs(seen):
            self.recorder.broken = (f"manual optimization: the gradients changed after manual_backward (norm {seen:.6g} "
                                    f"→ {pre:.6g}), not by self.clip_gradients, the clip the recorder reads")

    @guarded
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.recorder is None or not self.recorder.enabled:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._logged += float(loss.detach())
        if self._stepped:  # the window's optimizer step ran in this batch
            self._stepped = False
            self._clipped, self._backward_norm = False, None
            logged = trainer.strategy.reduce(torch.tensor(self._logged, dtype=torch.float64, device=pl_module.device),
                                             reduce_op="mean")  # on the module's device: NCCL has no CPU tensors
            self._logged = 0.0
            self.recorder.after_step(logged_loss=float(logged))

    @guarded
    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.recorder is not None:
            self.recorder.save()  # every rank dumps the checkpoint: a collective is safe here

    @guarded
    def on_train_end(self, trainer, pl_module):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._observed is not None:  # the module's own methods back (another fit of it is recorded afresh)
            module, own = self._observed
            for method in _OBSERVED:
                module.__dict__.pop(method, None)
            module.__dict__.update(own)
            self._observed = None
        if self.recorder is not None:
            self.recorder.close()


__all__ = ["ParityCallback", "hugging_face_model"]
