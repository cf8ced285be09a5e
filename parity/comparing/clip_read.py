"""The tensor record's invariant, at every step: the gradients the tensor record read are the gradients the run clipped.
The root of the sum of every tensor's squared gradient norm must equal the norm the run clipped by — its recorded
pre-clip grad norm (× the step's clip coefficient where the series holds the clipped gradients) — to the rounding of
that norm's arithmetic (tolerances.CLIP_READ). A step where they part FAILs the run there, ahead of any tolerance, as
the replica check does: between the read and the clip something changed the gradients (a strategy's own step, a
framework's hook), or the norm counts a tensor otherwise than its pieces say (a Partial gradient summed locally), and
what the optimizer applied is not what the tensor verdict judged (docs/tensors.md#reading-point).

Not judged: a step an fp16 overflow skipped (no clip), and a recorded step whose gradients the recorder did not see (NaN,
its line says so). A series read elsewhere than at the clip (tensor_norms.READ_AT) is held to it all the same: the
norm is the run's, and the two part exactly where something acted between them.
"""

from __future__ import annotations

import math

from parity import storage
from parity.comparing.tolerances import CLIP_READ
from parity.comparing.verdict import Outside
from parity.precision import POLICIES
from parity.training.tensor_norms import AT_CLIP, BEFORE_STEP, CLIPPED

TEST = "clip_read"  # Outside.test of its FAIL


def tolerance(run, series) -> float:
    """The bound on a run's gap (tolerances.CLIP_READ): clipped gradients held in a low-precision dtype; a norm a
    framework took in its own arithmetic (a recorded framework's, a library's accumulated in fp32: the series'
    norm_dtype), or gradients read elsewhere than at the clip; else the harness's float64 norm of the gradients it read
    there."""
    policy = POLICIES.get(run.precision)
    if series.grad == CLIPPED and policy is not None and policy.params != "fp32":
        return CLIP_READ["bf16"]
    if run.config.get("grad_norm_source") in ("framework", "mixed") or series.norm_dtype != "float64" or \
            series.read_at not in (AT_CLIP, BEFORE_STEP):
        return CLIP_READ["fp32"]
    return CLIP_READ["float64"]


def first_gap(run, series) -> Outside | None:
    """The first step of `run` (a run.Run) whose tensors' squares do not add up to the norm it clipped by — or, in a
    recorded run read at before_step(), whose optimizer applied another gradient to a tensor than the one read × the
    clip coefficient (the recorder's `clip_read` entry: parity/recording/recorded_tensors.py) —, or None; `series`
    its TensorSeries (anything else — a run with none — has no invariant to hold)."""
    if not hasattr(series, "grad_norm"):
        return None
    bound = tolerance(run, series)
    for k, (step, grads) in enumerate(zip(run.steps, series.grad_norm)):
        applied = step.get(TEST)
        if applied:
            return Outside(quantity="grad_norm", rel_diff=applied["gap"], tolerance=applied["tolerance"], step=k,
                           module=applied["tensor"], value=applied["applied"],
                           reference=applied["read"] * applied["coef"], test=TEST)
        norm, coef = step.get("grad_norm"), series.clip_coef[k] if series.grad == CLIPPED else 1.0
        if step.get("skipped") or norm is None or coef is None or not math.isfinite(norm) or \
                any(math.isnan(g) for g in grads):
            continue
        read = math.sqrt(sum(g * g for g in grads))
        clipped_by = norm * coef
        gap = abs(read - clipped_by) / clipped_by if clipped_by else (0.0 if read == 0 else math.inf)
        if not gap <= bound:
            return Outside(quantity="grad_norm", rel_diff=gap, tolerance=bound, step=k, value=read,
                           reference=clipped_by, test=TEST)
    return None


def line(gap: Outside) -> str:
    """The FAIL in words."""
    if gap.module is not None:  # a tensor the optimizer applied otherwise than read
        return (f"step {gap.step}: the gradients the optimizer applied are not the gradients the tensor record read "
                f"({gap.module}: {gap.reference:.9g} read × the clip coefficient, {gap.value:.9g} applied; relative gap "
                f"{gap.rel_diff:.3e} > {gap.tolerance:.0e}): something changed it after before_step() read it — a clip "
                f"by value the recorder was not told of (ParityRecorder(clip_value=...)), or a bug")
    return (f"step {gap.step}: the gradients the optimizer clipped are not the gradients the tensor record read (√Σ = "
            f"{gap.value:.9g}, clipped by {gap.reference:.9g}; relative gap {gap.rel_diff:.3e} > {gap.tolerance:.0e})")


UNSCALE_FIRST = "GradScaler's: call before_step() after scaler.unscale_(optimizer)"  # the fix a loss scale's line names


def loss_scale(ratio: float, rtol: float) -> int | None:
    """2^k where `ratio` is that within `rtol`, k ≥ 8 (a GradScaler's scale: 2^16 at first, halved at each overflow):
    the factor a loss scale left in the gradients the recorder read puts between them and the unscaled ones; else
    None."""
    if not (ratio > 0 and math.isfinite(ratio)):
        return None
    k = round(math.log2(ratio))
    return 2 ** k if k >= 8 and abs(ratio / 2 ** k - 1) <= rtol else None


def scale_left_in(run, base) -> str | None:
    """Where a recorded run's step-0 grad norm is a loss scale × its baseline's, to 1 %: the gradients the recorder read
    still held it (GradScaler's: before_step() called before unscale_). The recorder stops the record at a step the
    loop's clip leaves alone (its applied check: clipping.undeclared_scale); where the clip takes the gradients to
    max_grad_norm, the scale cancels in what the optimizer applies and only the norm read shows it
    (docs/own_trainer/plain_loop.md). None otherwise."""
    if not run.recorded or not run.steps or not base.steps:
        return None
    read, replayed = run.steps[0].get("grad_norm"), base.steps[0].get("grad_norm")
    scale = loss_scale(read / replayed, 0.01) if read and replayed else None
    return (f"step 0's grad norm as read is {scale} × the replay's: the gradients before_step() read still held a loss "
            f"scale ({UNSCALE_FIRST})") if scale else None


def no_reference(base, series) -> list[str]:
    """Why the baseline (a run.Run) is no reference, where its own record parts from its clip: one line, or none."""
    gap = first_gap(base, series)
    return [] if gap is None else [f"{storage.name(base.file)} ({base.name}, the baseline): {line(gap)}: a baseline "
                                   f"whose optimizer applies other gradients than it records is no reference"]
