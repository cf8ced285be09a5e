"""The teacher-forced check's verdict: each checked step of a run (the record's "teacher_forced" entries, measured by
parity/training/teacher_forced.py) judged tensor by tensor against its bound, the first failing check a FAIL at that
step whatever the curves say — the curves' bounds widen as bf16 runs drift apart, a teacher-forced step's do not.

Bounds (parity.comparing.tolerances.TEACHER_FORCED_FP32): NOISE_K × how far the reference step's perturbed twin moved
that tensor (the check's "noise"), over a floor — in fp32 a fixed one per kind of tensor (the updated parameters
against the reference's update, AdamW's two moments, the pre-clip grad norm); in a low-precision policy also
LAYER_NOISE_K × how far the policy's rounding moved that tensor in the same step (the reference in the policy against
the reference in fp32, recorded beside the measurement). A run resumed at a checked step
also compares the state it loaded with the digest of the state its checkpoint saved ("resumed <tensor>": each norm and
AdamW's step count) at RESUMED_FP32: a resume is bit-identical (docs/checkpoints.md).

The summary per run (curve_comparison.json's runs.<name>.teacher_forced, report.html's table):
{"interval", "checks": [{"step", "ok", "tensor", "rel_diff", "bound", "ratio", "bound_by", "note"}], "first_fail_step",
"replay_command"} — each check's worst tensor by rel_diff ÷ bound. A recorded run's checks are taken by its replay from
the states its recorder saved, and attached to its record when it is loaded (recorded_checks.py); one without any says
why ("none").
"""

from __future__ import annotations

import math

from parity import storage
from parity.comparing import tolerances  # OPTIMIZER_NOISE_K read at use: tools/seeded_before_after.py sets it
from parity.comparing.tolerances import (CLIP_READ, LAYER_NOISE_K, NOISE_K, RESUMED_FP32,
                                         TEACHER_FORCED_FP32, TEACHER_FORCED_GRAD_NORM_LOW, tolerance_class)
from parity.comparing.verdict import Outside

KEY = "teacher_forced"  # the record's step entry (parity.training.teacher_forced.KEY) and the JSON's key
NONE = "teacher_forced_none"  # a loaded recorded run's record: why it has no check (recorded_checks.attach)
TEST = "teacher_forced"  # Outside.test of a failing check


def bound(key: str, precision: str, rounding: dict | None, norm_source: str | None = None,
          noise: dict | None = None, optimizer: dict | None = None) -> tuple[float, str]:
    """(the bound of one measured tensor — "param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>", "grad_norm" —, what
    made it: "table", "noise", "rounding" or "optimizer"): NOISE_K × how far the reference's perturbed twin moved it
    (`noise`), never below the fixed table, nor below OPTIMIZER_NOISE_K × how far the reference step's own AdamW
    moves it when each gradient element moves by the twin's noise (`optimizer`: an element whose update's sign is
    the noise's flips in one run and not in the other, which one twin may not draw; update_noise.py); in a
    low-precision policy also at least LAYER_NOISE_K × the policy's `rounding`. A
    recorded grad norm a framework took in its own fp32 arithmetic — Trainer's clip_grad_norm_ where it clipped — has
    the fp32 norm's floor, CLIP_READ["fp32"]: measured 1.5e-5 and 1.8e-5 off the float64 norm of the same gradients."""
    fixed = TEACHER_FORCED_FP32[key.split("/", 1)[0]]
    if key == "grad_norm" and norm_source == "framework":
        fixed = max(fixed, CLIP_READ["fp32"])
    found = [(fixed, "table")]
    if tolerance_class(precision) != "fp32" and rounding is not None and key in rounding:
        found = [(TEACHER_FORCED_GRAD_NORM_LOW if key == "grad_norm" else fixed, "table"),
                 (LAYER_NOISE_K * rounding[key], "rounding")]
    if noise is not None and key in noise:
        found.append((NOISE_K * noise[key], "noise"))
    if optimizer is not None and key in optimizer:
        found.append((tolerances.OPTIMIZER_NOISE_K * optimizer[key], "optimizer"))
    return max(found, key=lambda f: f[0])


def judge_check(entry: dict) -> dict:
    """One check: its worst tensor (by rel_diff ÷ bound) and whether every tensor is within its bound (a NaN is
    not)."""
    tensors = entry.get("tensors") or {}
    result = {"step": entry["step"], "ok": True, "tensor": None, "rel_diff": None, "bound": None, "ratio": None,
              "bound_by": None, "note": entry.get("note")}
    worst = -1.0
    judged = [(key, rel, *bound(key, entry["precision"], entry.get("rounding"), entry.get("grad_norm_source"),
                                entry.get("noise"), entry.get("optimizer")))
              for key, rel in tensors.items()]
    judged += [(f"resumed {key}", rel, RESUMED_FP32, "table") for key, rel in (entry.get("resumed") or {}).items()]
    for key, rel, b, by in judged:
        ratio = rel / b if not math.isnan(rel) else math.inf
        if ratio > worst:
            worst = ratio
            result.update(tensor=key, rel_diff=rel, bound=b, ratio=ratio, bound_by=by)
    result["ok"] = worst <= 1.0
    return result


def summary(record: dict) -> dict | None:
    """The run's checks, judged (the module docstring's shape); None where the check did not run — or, for a recorded
    run that has none, the shape with no checks and why under "none" (recorded_checks.attach)."""
    entries = [s[KEY] for s in record["steps"] if KEY in s]
    if not entries:
        return None if NONE not in record else {"interval": record["config"].get("checkpoint_interval"), "checks": [],
                                                "first_fail_step": None, "replay_command": None, "none": record[NONE]}
    checks = [judge_check(storage.finite_restored(e)) for e in entries]  # a NaN or inf measured: spelled in JSON
    first = next((c["step"] for c in checks if not c["ok"]), None)
    return {"interval": record["config"].get("checkpoint_interval"), "checks": checks, "first_fail_step": first,
            "replay_command": None}


def first_fail(record: dict, num_steps: int | None = None) -> Outside | None:
    """The run's first failing check (within the `num_steps` compared) as the verdict's point outside."""
    found = summary(record)
    for c in (found or {}).get("checks", []):
        if not c["ok"] and (num_steps is None or c["step"] < num_steps):
            return Outside(quantity=KEY, rel_diff=c["rel_diff"], tolerance=c["bound"], step=c["step"],
                           module=c["tensor"], test=TEST)
    return None


def describe(found: dict) -> str:
    """One line on a run's checks (summary's): where it first FAILs, or where it ran and the largest rel_diff ÷
    bound."""
    if found.get("none"):
        return f"teacher-forced check: none ({found['none']})"
    judged = [c for c in found["checks"] if c["ratio"] is not None]
    worst = max(judged, key=lambda c: c["ratio"], default=None)
    where = ", ".join(str(c["step"]) for c in found["checks"])
    if found["first_fail_step"] is not None:
        c = next(c for c in found["checks"] if not c["ok"])
        return (f"teacher-forced check FAILS at step {c['step']}: {c['tensor']} relative diff {c['rel_diff']:.3e} > "
                f"{c['bound']:.3e} ({c['ratio']:.1f} × its bound)")
    notes = {c["note"] for c in found["checks"] if c["note"]}
    return (f"teacher-forced check: within bounds at steps {where}"
            + (f" (largest {worst['ratio']:.2f} of its bound: {worst['tensor']} at step {worst['step']})" if worst else "")
            + (f"; {'; '.join(sorted(notes))}" if notes else ""))
