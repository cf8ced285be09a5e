"""torch's GradScaler, read where a run scales its loss: under torch's AMP recipe (the fp16_autocast policy:
Trainer's and accelerate's fp16, Lightning's 16-mixed, a loop of your own with torch.amp.GradScaler), or in fp16
parameters under fully_shard's MixedPrecisionPolicy with torch's ShardedGradScaler (a GradScaler that all-reduces
its infs). Each step's loss scale and whether the scaler skips the step (an inf or a NaN in the gradients it
unscaled), which the replay follows (training/loss_scaler.FollowedScaler) and the verdict judges by GradScaler's
rules (comparing/loss_scales.py).

No loop passes its scaler: it is the GradScaler that unscaled the loop's optimizer, found among the process's objects
at the first step read (before_step, after `scaler.unscale_(optimizer)` as the docs have it). None found — the loop
scales no loss, or its scaler is disabled — is a static scale of 1, but where the view's model scales its own."""

from __future__ import annotations

import gc
import math
import warnings

import torch

from parity.precision import LOSS_SCALING_DEFAULTS, POLICIES

RULES = "GradScaler"  # comparing/loss_scales.py's name of its rules


def reading(record, optimizer, precision: str, view):
    """A ScalerReading for a record in a policy that scales its loss, else None. Where the view's model scales its
    own loss (View.scales_loss: a DeepSpeed engine's fp16, megatron-core's), only a GradScaler is read: none found, the
    reading keeps nothing and the other's scaler is recorded by its own room or not at all (the replay refuses it);
    elsewhere none found is a static scale of 1."""
    policy = POLICIES.get(precision)
    return ScalerReading(record, optimizer, required=view.scales_loss) if policy and policy.loss_scaling else None


class ScalerReading:
    """Each step's `loss_scale` and `skipped` (the step entry's keys, megatron-core's recorder's too), read from the
    GradScaler that unscaled `optimizer` (or an optimizer it wraps); its settings written into the record's
    loss_scaling at the first read."""

    def __init__(self, record, optimizer, required: bool):
        self.record, self.ids, self.required = record, set(), required
        while optimizer is not None and id(optimizer) not in self.ids:  # accelerate's wrapper and the one it wraps
            self.ids.add(id(optimizer))
            optimizer = getattr(optimizer, "optimizer", None)
        self.scaler, self.found = None, False

    def read(self) -> dict:
        """Before the step (the gradients unscaled): the scale they were computed with and whether the scaler found
        an inf or a NaN in them (so skips the step)."""
        if not self.found:
            self.scaler, self.found = self._find(), True
            if self.scaler is not None or not self.required:
                self.record.data["config"]["loss_scaling"] = settings(self.scaler)
        if self.scaler is None and self.required:  # another's scaler: no scales kept
            return {}
        if self.scaler is None or not self.scaler.is_enabled():
            return {"loss_scale": 1.0, "skipped": False}
        states = self.scaler._per_optimizer_states  # a defaultdict: looked up by membership only
        state = next((states[i] for i in self.ids if i in states), {})
        found_inf = sum(float(v.item()) for v in state.get("found_inf_per_device", {}).values())
        return {"loss_scale": float(self.scaler.get_scale()), "skipped": found_inf > 0}

    def _find(self):
        """The GradScaler whose per-optimizer state holds the loop's optimizer (unscale_ made it), else None."""
        with warnings.catch_warnings():  # isinstance on every object touches deprecated ones (torch's reduce_op)
            warnings.simplefilter("ignore")
            scalers = [o for o in gc.get_objects() if isinstance(o, torch.amp.GradScaler)]
        # (a disabled one holds no states: ShardedGradScaler on a device it cannot scale on disables itself)
        return next((s for s in scalers if any(i in getattr(s, "_per_optimizer_states", ()) for i in self.ids)), None)


def settings(scaler) -> dict:
    """A GradScaler's settings in the record's loss_scaling (the harness's keys, parity.precision.LossScaling's, with
    its growth and backoff factors) and its `rules`; a disabled scaler, or none, a static scale of 1."""
    if scaler is None or not scaler.is_enabled():
        return {**LOSS_SCALING_DEFAULTS, "loss_scale": 1.0, "hysteresis": 1, "rules": RULES}
    power = math.log2(scaler._init_scale)  # (no public getter: get_scale() is the current one, lazily made)
    return {**LOSS_SCALING_DEFAULTS, "initial_scale_power": int(power) if power.is_integer() else power,
            "loss_scale_window": scaler.get_growth_interval(), "hysteresis": 1, "min_loss_scale": 0.0,
            "growth_factor": scaler.get_growth_factor(), "backoff_factor": scaler.get_backoff_factor(),
            "rules": RULES}


__all__ = ["RULES", "ScalerReading", "reading", "settings"]
