"""Every trainable tensor's gradient and parameter norm at every recorded step, for the series beside the record
(parity/training/tensor_series.py): read from the loop's view (parity/views/: each view's pieces, with the harness's
own code for that sharding), summed over the ranks as a harness run sums them (parity/training/tensor_norms.py).

Which gradient a record holds, and where it was read (the series' read_at), follows from where the loop lets the
recorder see it, declared once for the run:
- PRE_CLIP, before the loop's clipping: read at before_step() — a hand-written loop calls it there, Lightning's
  on_before_optimizer_step comes before its clipping — or, in a DeepSpeed loop, inside engine.step() where DeepSpeed
  takes the norm it clips by (the view's watch_norm: norm_point.py), after all the engine does before its clip;
- CLIPPED, after the framework clipped: read at the optimizer's step pre-hook (Trainer's callbacks all come after its
  clipping), with the step's clip coefficient beside it — torch's formula on the step's recorded pre-clip norm and the
  loop's max_grad_norm: the clipped gradient is the pre-clip one × it.
A PRE_CLIP record read at before_step() is also held to what the optimizer applies: at the optimizer's step pre-hook,
after the loop's clipping, each tensor's gradient must be the one read × the clip coefficient (to rounding); the first
tensor that is not is written into its step (`clip_read`), which FAILs the run there (parity/comparing/clip_read.py).
A step whose gradients were not seen there (before_step() not called, or only after the optimizer's step applied them,
when they are gone or ZeRO's partitions stale: a step post-hook says when) holds NaN for every gradient norm and its
parameter norms as measured; one line names the first such step. A read that fails leaves its step so too: a recorder
failure never stops the user's training. Not the step pre-hook's count: Lightning's optimizer step runs its closure —
forward, backward, on_before_optimizer_step — inside the step, after that hook (no applied check there).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist

from parity.comparing.tolerances import CLIP_COEFFICIENT, CLIP_READ, TENSOR_FLOOR
from parity.precision import POLICIES
from parity.training.optimizer import clip_coefficient
from parity.training.tensor_norms import (AT_CLIP, AT_OPTIMIZER, BEFORE_STEP, CLIPPED, PRE_CLIP, local_squares,
                                          norms_of)

__all__ = ["AT_OPTIMIZER", "BEFORE_STEP", "CLIPPED", "PRE_CLIP", "RecordedTensors"]


class RecordedTensors:
    """One recorded run's per-tensor norms, on every rank: `view` (parity/views/) hands over the pieces, `grad` says
    which gradient the record holds (PRE_CLIP or CLIPPED), `max_grad_norm` is what the loop clips to (0: it does not),
    `log` takes rank 0's lines."""

    def __init__(self, view, device: torch.device, grad: str, max_grad_norm: float, log: Callable[[str], object],
                 precision: str = "fp32"):
        if grad not in (PRE_CLIP, CLIPPED):
            raise ValueError(f"tensor_grad {grad!r}: {PRE_CLIP!r} or {CLIPPED!r}")
        self.view, self.device, self.grad, self.log = view, device, grad, log
        self.clipping = SimpleNamespace(max_grad_norm=max_grad_norm)  # what clip_coefficient reads
        self.names = view.tensor_names()
        self.squares: torch.Tensor | None = None  # this step's gradient squares, once read
        self.applied_squares: torch.Tensor | None = None  # and as the optimizer applies them (PRE_CLIP: the applied check)
        self.applied = False  # whether the optimizer's step has applied this step's gradients (its post-hook)
        self.peak: tuple | None = None  # each applied gradient's largest |element|, by name, and their eps (_peak)
        self.missed = False  # whether a step's gradients went unseen already (its line said so)
        low = precision in POLICIES and POLICIES[precision].params != "fp32"  # the gradients' own dtype, clipped in it
        self.bound = CLIP_READ["bf16" if low else "float64"]
        self.coef_bound = CLIP_COEFFICIENT["bf16" if low else "fp32"]  # the applied coefficient's (_applied_check)
        # where the gradients are read: where the engine takes its norm where the view can watch it, else the loop's
        self.read_at = AT_OPTIMIZER if grad == CLIPPED else BEFORE_STEP
        if grad == PRE_CLIP and view.watch_norm(lambda: self.read(AT_CLIP)):
            self.read_at = AT_CLIP
        self.checks_applied = self.read_at == BEFORE_STEP and view.pieces_at_optimizer  # (module docstring)

    def observer_arguments(self) -> dict:
        """What the StepObserver takes of the series: the names, which gradient and where it was read."""
        return {"tensor_names": self.names, "tensor_grad": self.grad, "tensors_read_at": self.read_at}

    def watch(self, optimizer, pre_hook) -> "Hooks":
        """The recorder's step `pre_hook` on `optimizer` and a post-hook that marks this step's gradients applied, as
        one handle the recorder removes."""
        return Hooks(optimizer.register_step_pre_hook(pre_hook),
                     optimizer.register_step_post_hook(lambda *_: setattr(self, "applied", True)))

    def read(self, where: str) -> None:
        """The gradients' squares of this rank's pieces, where the loop stands at `where` (BEFORE_STEP: before_step;
        AT_CLIP: inside the engine's step, at its norm; AT_OPTIMIZER: the optimizer's step pre-hook) if that is the
        record's place, this step's are not read yet and the optimizer has not applied them; at the step pre-hook of a
        record read at before_step(), the applied gradients' too (the module docstring's check). Local."""
        if where == AT_OPTIMIZER and self.checks_applied and self.squares is not None and not self.applied:
            self.applied_squares = self._squares()
            self.peak = self._peak()
        if where != self.read_at or self.squares is not None or self.applied:
            return
        self.squares = self._squares()

    def _squares(self) -> torch.Tensor | None:
        try:
            return local_squares(self.view.gradient_pieces(), self.names, self.device, self.view.loss_scale())
        except Exception:  # the step's gradients are NaN (module docstring): never the user's training
            return None

    def _peak(self) -> tuple | None:
        """Rank 0 of a view whole on every rank (plain, DDP) told of no clip: (the names, each gradient's largest
        |element| as the optimizer applies it — left on the device —, their dtype's eps): where a clip by value the
        recorder was not told of leaves its value (clamped_at). None elsewhere."""
        if self.clipping.max_grad_norm or not self.view.whole or dist.get_rank() != 0:
            return None
        pieces = [p for p in self.view.gradient_pieces() if p.counted and p.tensor is not None]
        if not pieces:
            return None
        with torch.no_grad():
            peaks = torch.stack(torch._foreach_norm([p.tensor for p in pieces], math.inf))
        return [p.name for p in pieces], peaks, torch.finfo(pieces[0].tensor.dtype).eps

    def local(self, step: int, quiet: bool = False) -> torch.Tensor:
        """This rank's float64 sums of squares of step `step` (after the optimizer's step): every tensor's gradient's
        (NaN where unseen), then its parameter's, and where the applied check runs the applied gradients' and whether
        this rank read them — summed over the world in rank order (the recorder's step exchange carries them, as a
        harness strategy's ride its loss gather: Strategy.gather_step), they are `norms`' `summed`. Local. `quiet`: a
        step the record stops at, whose own line says why, says nothing of gradients unseen."""
        squares = self.squares
        if squares is None:
            squares = torch.full((len(self.names),), math.nan, dtype=torch.float64, device=self.device)
            if not (self.missed or quiet):
                self.missed = True
                place = {BEFORE_STEP: "before_step() before clipping", AT_CLIP: "the engine's norm in its step",
                         AT_OPTIMIZER: "the optimizer's step"}[self.read_at]
                self.log(f"step {step}: the gradients were not seen at {place}: its tensors' gradient norms are NaN, "
                         f"and so are any later step's that are not seen either")
        applied = self.applied_squares
        self.squares, self.applied_squares, self.applied = None, None, False
        params = local_squares(self.view.parameter_pieces(), self.names, self.device)
        rows = [squares, params]
        if self.checks_applied:  # the applied gradients ride along, with a count of who read them
            seen = applied is not None
            rows += [applied if seen else torch.zeros_like(squares), torch.tensor([float(seen)], dtype=torch.float64,
                                                                                  device=self.device)]
        return torch.cat(rows)

    def norms(self, summed: torch.Tensor, grad_norm: float) -> dict:
        """Every tensor's gradient and parameter norm from `summed` (local's, summed over the world), under CLIPPED the
        step's clip coefficient from its pre-clip `grad_norm`, and the applied check's finding where it has one:
        observe_step's arguments."""
        n = len(self.names)
        grads, params = norms_of(summed[:2 * n])
        found = {}
        if self.checks_applied and int(summed[-1]) == dist.get_world_size():  # every rank saw them applied
            found = self._applied_check(grads, [math.sqrt(x) for x in summed[2 * n:3 * n].tolist()], grad_norm)
        peak, self.peak = self.peak, None
        if found and peak is not None:  # the entry says so where the applied gradients look clipped by value
            names, peaks, eps = peak
            by_name = dict(zip(names, peaks.tolist()))
            value = clamped_at([by_name.get(name, 0.0) for name in self.names], eps, grads,
                               summed[2 * n:3 * n].tolist(), self.bound)
            if value is not None:
                found["clip_read"]["clamped"] = value
        coef = clip_coefficient(grad_norm, self.clipping) if self.grad == CLIPPED else None
        return {"tensor_grad_norms": grads, "tensor_param_norms": params, "clip_coef": coef, **found}

    def _applied_check(self, read: list[float], applied: list[float], grad_norm: float) -> dict:
        """The first tensor the optimizer applied otherwise than read, as the step's `clip_read` entry; {} where none.
        Each tensor's ratio applied ÷ read is held to the median one (to the clip's rounding, `bound`; a tensor below
        TENSOR_FLOOR of the global norm measured against that floor) — a framework's clip multiplies every gradient by
        one coefficient, which it takes of its own norm in its own arithmetic (torch's fp32 total: 1e-5 from the
        recorder's float64 one) — and the median to the clip coefficient of the step's norm at a framework's bound
        (CLIP_COEFFICIENT, by the gradients' dtype), naming the largest tensor then, with that `uniform` coefficient
        where every tensor took it (a clip or a loss scale the recorder was not told of: clipping.undeclared_scale)."""
        coef = clip_coefficient(grad_norm, self.clipping)
        floor = TENSOR_FLOOR["gradient"] * math.sqrt(sum(x * x for x in read))
        seen = [(name, r, a) for name, r, a in zip(self.names, read, applied) if not (math.isnan(r) or math.isnan(a))]
        ratios = sorted(a / r for _, r, a in seen if r > floor)
        if not ratios:
            return {}
        common = ratios[len(ratios) // 2]
        gaps = [(abs(a - common * r) / (common * max(r, floor)), name, r, a) for name, r, a in seen]
        if abs(common - coef) > self.coef_bound * coef:
            name, r, a = max(seen, key=lambda t: t[1])
            found = {"tensor": name, "read": r, "applied": a, "coef": coef, "gap": abs(common - coef) / coef,
                     "tolerance": self.coef_bound}
            if max(gaps)[0] <= self.bound:  # every tensor × one coefficient, not the declared clip's (clipping.py)
                found["uniform"] = common
            return {"clip_read": found}
        gap, name, r, a = max(gaps)
        if not gap <= self.bound:
            return {"clip_read": {"tensor": name, "read": r, "applied": a, "coef": common, "gap": gap,
                                  "tolerance": self.bound}}
        return {}


def clamped_at(peaks: list[float], eps: float, read: list[float], applied_squares: list[float],
               bound: float) -> float | None:
    """The value v a step's gradients look clipped at element by element (torch's clip_grad_value_), or None. Each
    tensor's applied gradient (its norm's square in `applied_squares`, its largest |element| in `peaks`) against the
    one read (its norm in `read`): v, the largest element, is a value a loop sets — two significant digits, to the
    dtype's rounding (`eps`); no tensor grew (beyond `bound`), and each that shrank holds v (a tensor scaled by a bug
    would hold a smaller one)."""
    value = float(f"{max(peaks):.2g}")
    if not value > 0:
        return None
    for r, a, peak in zip(read, applied_squares, peaks):
        if math.isnan(r) or math.isnan(a):
            continue
        if math.sqrt(a) > r * (1 + bound) or (math.sqrt(a) < r * (1 - bound) and abs(peak - value) > 2 * eps * value):
            return None
    return value if abs(max(peaks) - value) <= 2 * eps * value else None


class Hooks:
    """Hook handles removed together."""

    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
