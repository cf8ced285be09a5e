"""How the recorded loop clips its gradients, as the recorder is told (parity/recording/recorder.py): by their global
norm (max_grad_norm, torch's clip_grad_norm_) or element by element (clip_value, torch's clip_grad_value_). The
replay clips as the record says (parity.training.optimizer.clip_gradients); a loop that clips both ways, or at another
value from one step to the next, ends the record there in one line (the replay clips every step one way at one value).
So does a step whose optimizer applied every gradient × one coefficient other than the declared clip's — a clip by norm
the recorder was not told of, or a loss scale still in the gradients it read — or, told no clip, every gradient element
clipped into [-v, v] (a clip by value it was not told of: undeclared_scale)."""

from __future__ import annotations

from parity.comparing.clip_read import UNSCALE_FIRST, loss_scale


class DeclaredClipping:
    """The recorder's clipping methods (a mixin of ParityRecorder: its record, tensors, step and broken line)."""

    def clips_at(self, max_grad_norm: float) -> None:
        """The loop's clip by norm, declared where it clips (Lightning's manual optimization, in its training_step):
        the record's max_grad_norm; another value than a recorded step's ends the record (the replay clips at one)."""
        self._declare_clip("max_grad_norm", float(max_grad_norm))
        if self.enabled and not self.broken:
            self.tensors.clipping.max_grad_norm = self.record.data["config"]["max_grad_norm"]

    def clips_by_value(self, clip_value: float) -> None:
        """The loop's clip by value (clip_grad_value_ at `clip_value`, each gradient element into [−v, v]): the
        record's clip_value, which the replay applies. The tensor record's check of the applied gradients (a clip
        multiplies every gradient by one coefficient: recorded_tensors.py) does not hold for it, and is left off."""
        self._declare_clip("clip_value", float(clip_value))
        if self.enabled and not self.broken and self.record.data["config"].get("clip_value"):
            self.tensors.checks_applied = False

    def undeclared_scale(self, found: dict | None, grad_norm: float) -> str | None:
        """Rank 0: the line that ends the record at a step whose optimizer applied every gradient × one coefficient
        below 1 other than the declared clip's (the tensor record's `clip_read` entry, `uniform`: recorded_tensors.py,
        there only where it is off the declared clip's beyond its rounding) — 2^-k, k ≥ 8: the gradients read still held
        a loss scale (GradScaler's, before its unscale_); else, where coefficient × the step's norm (torch's formula) is
        a max_grad_norm a loop sets (two significant digits, to the coefficient's bound), a clip by norm the recorder was
        not told. Before those, told no clip: every gradient element the optimizer applied clipped into [-v, v], v a
        value a loop sets (the entry's `clamped`: recorded_tensors.clamped_at), a clip by value it was not told.
        None otherwise: the FAIL that entry makes stands (a bug's scale)."""
        if value := (found or {}).get("clamped"):
            return (f"the optimizer applied every gradient element clipped into [-{value:g}, {value:g}], as "
                    f"clip_grad_value_ at {value:g} would, and the recorder was told no clip: pass ParityRecorder("
                    f"clip_value={value:g})")
        common = (found or {}).get("uniform")
        if common is None or not 0 < common < 1:
            return None
        if scale := loss_scale(1 / common, 1e-6):
            return (f"the gradients read at before_step() were {scale} × the ones the optimizer applied (a loss scale, "
                    f"{UNSCALE_FIRST})")
        at = common * (grad_norm + 1e-6)
        round_at = float(f"{at:.2g}")
        if abs(at - round_at) > found["tolerance"] * at:
            return None
        told = self.record.data["config"]["max_grad_norm"]
        return (f"the optimizer applied every gradient × {common:.6g}, as a clip by norm at {round_at:g} would, and the "
                f"recorder was told {f'max_grad_norm {told:g}' if told else 'no clip'}: pass ParityRecorder("
                f"max_grad_norm={round_at:g}) — or, where the loop does not clip there, something scaled every gradient "
                f"after before_step() read it")

    def _declare_clip(self, key: str, value: float) -> None:
        if not self.enabled or self.broken:
            return
        config = self.record.data["config"]
        other = "clip_value" if key == "max_grad_norm" else "max_grad_norm"
        if value and config.get(other):
            both = {**config, key: value}
            self.broken = (f"the loop clips by norm and by value (max_grad_norm {both['max_grad_norm']:g}, clip_value "
                           f"{both['clip_value']:g}): the replay clips one way")
        elif (config.get(key) or 0.0) == value:
            return
        elif self.record.steps:
            self.broken = (f"the loop clips {'' if key == 'max_grad_norm' else 'by value '}at {value:g} at step "
                           f"{self.step}, at {config.get(key) or 0.0:g} before (0: no clip): the replay clips every "
                           f"step at one {key}")
        else:
            config[key] = (value or None) if key == "clip_value" else value


__all__ = ["DeclaredClipping"]
