"""Every tolerance the harness judges by, defined once. docs/tolerances.md gives the reasoning and the
measurements each one rests on; nothing else in the code or the tests defines a tolerance.

All are relative unless named ATOL. A pair of runs is judged by the looser of its two precisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from parity.errors import ConfigError
from parity.precision import POLICIES


QUANTITIES = ("loss", "grad_norm", "param_norm")
"""The three curves a verdict holds, each at every step: the loss, the pre-clip gradient norm (AdamW is
nearly scale-invariant, so a gradient reduced twice barely moves the loss but moves the norm) and the
parameter norm after the step (weight decay or a scaled lr move it steadily while rounding barely does)."""

AUX_LOSS = "aux_loss"
"""A fourth curve where both runs record it: a mixture of experts' load-balancing loss over the global batch
(parity.training.routing), which statistics taken per rank or per micro-batch change while the LM loss barely moves."""


@dataclass(frozen=True)
class Tolerance:
    """A relative tolerance per curve."""

    loss: float
    grad_norm: float
    param_norm: float | None = None  # None: not judged
    aux_loss: float | None = None  # a mixture of experts' load-balancing loss (None: not judged)

    def of(self, quantity: str) -> float | None:
        return getattr(self, quantity)


CURVES = {"fp32": Tolerance(loss=1e-5, grad_norm=1e-4, param_norm=1e-5, aux_loss=1e-5),
          "bf16": Tolerance(loss=3e-2, grad_norm=1e-1, param_norm=1e-2, aux_loss=3e-2)}
"""Loss-curve verdict without a noise reference (uncalibrated), by precision: a fixed envelope per step. The fp32 grad
norm's 1e-4: a correct fp32 run's grad norm spikes where AdamW's first update of a gradient element that cancels below
its eps turns another reduction order's last bits into a parameter difference of up to lr, which each later batch
projects onto the gradient (docs/tensors_measured.md: 2.8e-5 measured on an Intel AVX512-FP16 CPU, 2.7e-6 here, 1.4e-5
injected). What the looser global bound gives up, the tensor verdict's per-tensor gradient bound (TENSORS) keeps: a
doubled 64-element norm weight reads 8.4e-5 on the global norm and 1e3 × its bound on its own tensor."""

CALIBRATION_FLOORED = ("fp32",)
"""The precisions whose fixed table (CURVES, TENSORS) stays a floor under a calibrated bound: fp32 twins do not sample
the AdamW lottery above — a twin flips other elements than the run does (qwen3-tiny seed 46, one twin: a clean TP run at
2.15 × its calibrated grad-norm bound and a tensor at 4.5 ×, docs/tensors_measured.md). bf16's noise dwarfs it."""

NOISE_K = 20
"""Calibrated verdict: a run may differ from the baseline by NOISE_K × the noise envelope at each step."""

NOISE_SMOOTHING = 5
"""The envelope at step s is the largest reference noise over steps s ± NOISE_SMOOTHING."""

NOISE_FLOOR = {"fp32": Tolerance(loss=1e-8, grad_norm=1e-8, param_norm=1e-9, aux_loss=1e-8),
               "bf16": Tolerance(loss=1e-6, grad_norm=1e-5, param_norm=1e-7, aux_loss=1e-6)}
"""The envelope never goes below this (relative), by precision: reference runs can agree exactly at a step."""

DRIFT_WINDOW, DRIFT_SAME_SIGN, DRIFT_K = 10, 9, 10
"""Calibrated drift test: over any DRIFT_WINDOW consecutive steps in which at least DRIFT_SAME_SIGN
differences from the baseline share a sign, their mean may be at most DRIFT_K × the window's mean envelope.
DRIFT_K 10: above every clean run of the calibration study (8.3) with one weight-decay run less caught than
9 (docs/tolerances.md)."""

TENSOR_FLOOR = {"gradient": 1e-3, "update": 1e-2}  # by phase (parity.training.tensor_norms.GRADIENT, UPDATE)
"""The tensor verdict (parity/comparing/tensor_verdict.py) measures a tensor's deviation at a step as
|x − baseline| / max(|baseline|, floor × the baseline's global norm at that step): its gradient norm against the global
gradient norm, its parameter norm against the global parameter norm. The floor keeps a tensor whose norm is a sliver of
the whole from reading its rounding as a difference: a k_proj bias's gradient is ~1e-4 of the global (softmax ignores a
shift shared by all keys), and a zero-initialised bias holds a few AdamW steps, each ±lr per element whatever its
gradient's last bits say. A tensor at or above the floor is measured against itself: a 64-element norm weight's gradient
(5e-3 of the global) doubled reads 1.0. Provisional (docs/tensors.md): qwen2-tiny fp32, the floors put DDP's twins,
FSDP2 + TP and transformers' TP within 1.4e-6 (gradient) and 6.2e-6 (update) of DDP over 40 steps at lr 1e-3; without
them the update read 5.4e-5 (a k_proj bias)."""

TENSORS = {"fp32": {"gradient": 1e-3, "update": 1e-5}, "bf16": {"gradient": 1e-1, "update": 1e-1}}
"""The tensor verdict without a noise reference (uncalibrated; in fp32 also a floor under a calibrated bound:
CALIBRATION_FLOORED), by precision and phase: the largest deviation (above) a correct run may show at any step. In fp32
the update's bound is also at least ADAM_SIGN_FLIP × the largest lr so far over the deviation's denominator (a tensor's
norm moves by at most 2 lr for each element whose AdamW update flips sign, docs/tensors_measured.md). Measured clean
(qwen2-tiny and mixtral-tiny, 145 runs, every strategy with a series, two kernel paths): fp32 gradients within 1.2e-5,
6.6e-5 in a spike injected at the Intel run's size; updates within 0.0024 lr. A tensor's gradient doubled reads 1.0 (1e3
× the bound), a router's gradient doubled on one of two ranks holding it 0.41, the aux loss's gradient dropped 0.08 on
the router; every fp32 catalogue bug still FAILs. bf16's 0.1: the largest clean deviation seen, 3.6e-2, with room."""

CLIP_READ = {"float64": 1e-6, "fp32": 1e-4, "bf16": 4e-3}
"""The tensor record's invariant (parity/comparing/clip_read.py): how far the root of the sum of every tensor's squared
gradient norm may be from the norm the run clipped by, relative, at a step, by how that norm was taken. "float64": by
the harness, of the gradients read at its clip — every strategy's float64 sums, DeepSpeed's float64 norm rounded to
fp32 (measured ≤ 8.4e-8, ZeRO-1), a recorder's own norm; also each tensor's applied gradient against its read one × the
clip coefficient (recorded_tensors.py), in fp32. "fp32": by a framework in its own arithmetic (torch's clip_grad_norm_
in Trainer, DeepSpeed's fp32 per-tensor norms at ZeRO-0 with bf16 weights: 1.0e-5 measured, qwen2-tiny) or of
gradients read elsewhere than at its clip — the fp32 grad-norm curve's own bound. "bf16": clipped gradients held in a
low-precision dtype (each element rounded to 8 bits after × the coefficient, ≤ 2^-9 of it)."""

CLIP_COEFFICIENT = {"fp32": 1e-4, "bf16": 2.0 ** -6}
"""How far the coefficient a recorded loop's optimizer applied (the median tensor's applied ÷ read norm: recorded_tensors.py)
may be from torch's formula on the recorded norm and the declared max_grad_norm, relative, by the gradients' dtype.
"fp32": CLIP_READ's. "bf16": torch's clip_grad_norm_ of bf16 gradients takes each tensor's norm, their total and the
coefficient in bf16 — measured up to 7.5e-3 from the float64 formula (300 random sets of 2–30 tensors, ≤ 5000 elements,
clipped to 0.5 and 0.01 of their norm; median 1.0e-3), which a clean pure-bf16 loop's step-0 check FAILed at 1e-4; a
max_grad_norm declared 1.6 % or more off still shows."""

TENSOR_NOISE_FLOOR = {"fp32": {"gradient": 1e-8, "update": 1e-8}, "bf16": {"gradient": 1e-5, "update": 1e-6}}
"""The calibrated tensor verdict's envelope never goes below this (the deviation above), by precision and phase: the
twins can agree on a tensor exactly (fp32: one tensor's norm carries ~1e-8 of rounding; transformers' TP=2 moved a
down_proj's updated norm by 1.6e-8 where DDP's twins read 0: 0.8 of a 1e-9 floor's bound). The bound is NOISE_K × the envelope, smoothed over NOISE_SMOOTHING steps as the curves'."""

OPTIMIZER_NOISE_K = 3
"""The optimizer's own noise in the update's bound (parity/comparing/update_bound.py): a tensor's parameter norm may
also part from the baseline's by OPTIMIZER_NOISE_K × the spread its AdamW makes of the measured gradient noise (each
element's move, independent signs, added over the steps). Measured (docs/tensors.md#the-optimizers-own-noise): clean
runs part by at most 3.1 × that spread (the embedding, whose references' bound is 17 × above it), 1.4 × on every other
tensor; one flipped element of a 64-element norm weight is one spread where it is flip-prone."""

ELEMENT_NOISE = 5
"""The element noise of a tensor's gradient, in rms gradients, per unit of its norm's deviation (the references'
gradient envelope, as a share of the tensor's own norm): update_bound.py reads the baseline's optimizer table there.
Measured element by element (qwen2-tiny bf16, two seeds × 60 steps, each tensor at each step, the twins' element-wise
differences against the envelope): median 2.3, 90th percentile 4.4 — the norm's deviation is mostly the part of the
noise along the gradient (the clip coefficient's), the elements' noise is uniform and larger."""

LAYERS = {"fp32": 1e-5, "bf16": 6e-2}
"""Layer check (compare_dumps.py): max |a − b| over the tensor's scale, by precision; bf16 without a noise
reference (uncalibrated)."""

LAYER_NOISE_K = 5
"""Calibrated layer check in bf16: a tensor may differ by LAYER_NOISE_K × how far bf16 rounding moves it
(DDP's bf16 step against its fp32 step), never less than the fp32 tolerance."""

ADAM_SIGN_FLIP = 2.5
"""Calibrated layer check, updated parameters: also at least ADAM_SIGN_FLIP × lr over the tensor's scale. The
first AdamW step moves every element by ±lr whatever its gradient's size, so where bf16 rounding flips the
sign of a noise-level gradient two correct runs differ by 2 lr (2.5: with room for fp32 rounding)."""

TEACHER_FORCED_FP32 = {"param": 2e-3, "exp_avg": 1e-4, "exp_avg_sq": 1e-4, "grad_norm": LAYERS["fp32"]}
"""The teacher-forced check in fp32 (parity/comparing/teacher_forced.py), by what is measured: the pre-clip grad norm
at the layer check's fixed tolerance; AdamW's moments, each relative to itself, at 1e-4: a small tensor's moments (a
norm's weight, its gradient summed over every token) carry its gradient's reduction-order rounding, squared in
exp_avg_sq (measured: 2.0e-5, DeepSpeed ZeRO-0 at step 0; a β2 of 0.99 for 0.999 moves exp_avg_sq by ~1e-2); the
updated parameters, measured against the reference's
update (‖p − p_ref‖ / ‖Δp_ref‖, floored at a tenth of lr per element; 2e-3 of a step), not the weights' size: where a
gradient element is near AdamW's eps, the last-bit differences of two correct reductions move its update (measured:
up to 6.3e-4, FSDP2 + TP=2 at lr 1e-3, and 5.3e-4, DeepSpeed ZeRO-3 TP=2 × DP=2 at lr 1e-4, both a k_proj bias). A bug
that scales the update by 3 % reads 3e-2. In a low-precision policy each
tensor may differ by LAYER_NOISE_K × how far the policy's rounding moves it at that step (the reference's step in the
policy against its step in fp32, taken at the check), never less than this."""

TEACHER_FORCED_GRAD_NORM_LOW = 1e-3
"""The teacher-forced check's pre-clip grad norm in a low-precision policy, at least: the run reduces its gradients
across ranks in the policy's dtype (DeepSpeed's bf16_params: bf16 gradients, ZeRO-1/2's reduce) where the one-process
reference sums them in another order, which the reference's own rounding (its policy step against its fp32 step) does
not see. Measured: 2.5e-4 (DeepSpeed ZeRO-1 and ZeRO-2, TP=2 × DP=2, bf16_params, step 0; 5 × the reference's rounding
was 1.96e-4). A bug that scales the gradients by 3 % reads 3e-2; the updated parameters and moments keep their bounds."""

SHORT_RUN_BF16 = Tolerance(loss=1e-4, grad_norm=3e-3)
"""The strategy tests' 12-step bf16 runs (lr 1e-4) against DDP's bf16 run."""

FINAL_PARAMETERS_ATOL_FP32 = 2e-5
"""Final parameters of two fp32 runs (12 steps at lr 1e-4), absolute: see final_parameters_atol_fp32."""


def final_parameters_atol_fp32(lrs) -> float:
    """How far the final parameters of two correct fp32 runs may part, absolute, for a run that stepped at `lrs`:
    FINAL_PARAMETERS_ATOL_FP32 where the steps' lrs add up to at most its setting's (12 × 1e-4), in proportion beyond.
    AdamW moves an element by up to its lr a step whatever its gradient's size, so where two strategies' fp32
    rounding differs in a gradient that cancels to near zero the update's direction differs: the distance grows with
    the sum of the lrs. Measured: OLMo2's q_proj (width-wide q_norm, 6 steps at lr 3e-4) 1.18e-5 from DDP in one
    element under FSDP2 + TP on an AVX2-only CPU, 1.74e-5 under transformers' TP on an AVX512/AMX one (Sapphire
    Rapids), its loss, grad norm and parameter norm within 5e-7: 1e-5 failed there."""
    return FINAL_PARAMETERS_ATOL_FP32 * max(1.0, sum(lrs) / 1.2e-3)

PRECISION_ORDER = ("fp32", "bf16")  # tighter to looser: the classes the tables above are keyed by
TOLERANCE_CLASS = {name: "fp32" if policy.compute == "fp32" else "bf16" for name, policy in POLICIES.items()}
"""Which table row a precision policy takes: a policy whose matrix products run in fp32 the fp32 one, every
low-precision policy the bf16 one. The fixed rows are uncalibrated
by design (docs/tolerances.md), and the noise floors only matter where references agree exactly; a policy's own noise
is what the calibrated verdict measures."""


def tolerance_class(precision: str) -> str:
    """The table row of a precision policy; ConfigError for a precision without tolerances."""
    if precision not in TOLERANCE_CLASS:
        raise ConfigError(f"precision '{precision}' has no default tolerance (known: {', '.join(TOLERANCE_CLASS)}): "
                          f"pass --tolerance")
    return TOLERANCE_CLASS[precision]


def looser_precision(a: str, b: str) -> str:
    """The looser of two runs' precisions, as a table row (fp32 or bf16); ConfigError for a precision without
    tolerances."""
    return max(tolerance_class(a), tolerance_class(b), key=PRECISION_ORDER.index)


RESUMED_FP32 = 1e-6
"""A run resumed from a checkpoint after a worker failure against the same run uninterrupted, per step, fp32
(the issue's bar). Measured: bit-identical for DDP (DP=2), DeepSpeed and FSDP (docs/checkpoints.md)."""
