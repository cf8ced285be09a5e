"""Where DeepSpeed takes the norm it clips by, inside engine.step(): the tensor record reads the gradients there (the
DeepSpeed strategy's record_gradients, the recorder's ZeRO view, zero.py), after everything the engine does to them before
its clip — the partitions as its clip reads them, still at fp16's loss scale, which the reader takes out.

DeepSpeed 0.19.8 takes it in one method of its optimizer for ZeRO-1/2 (scaled_global_norm, over the averaged gradient
partitions), ZeRO-3 (_get_norm_groups) and the BF16 optimizer (get_grads_for_norm, its first call of the step); a
ZeRO-0 engine over the client's own torch optimizer clips in clip_fp32_gradients (when gradient_clipping is set; else
nothing clips, and the gradients are read at the optimizer's step pre-hook, as it applies them). Its fp16 optimizers at
ZeRO-0 take the norm inline in their step: there the reading point stays before engine.step(), said by the record.
"""

from __future__ import annotations

from typing import Callable

import torch

NORM_METHODS = {"DeepSpeedZeroOptimizer": "scaled_global_norm", "DeepSpeedZeroOptimizer_Stage3": "_get_norm_groups",
                "BF16_Optimizer": "get_grads_for_norm"}  # the engine optimizer's class → its method that takes the norm
# the optimizers that take each tensor's norm in fp32 (.float().norm(): 1.0e-5 from the float64 sum on qwen2-tiny's
# embedding); the others sum float64 norms (ZeRO-1/2 round the total to fp32; ZeRO-3 and the client's: the harness's)
FP32_NORMS = ("BF16_Optimizer", "FP16_UnfusedOptimizer", "FP16_Optimizer")


def norm_dtype(engine) -> str:
    """The arithmetic the engine's pre-clip norm is accumulated in: "fp32" or "float64" (Strategy.clip_norm_dtype)."""
    return "fp32" if type(engine.optimizer).__name__ in FP32_NORMS else "float64"


def watch_norm(engine, read: Callable[[], None], inline_at_step: bool = False) -> bool:
    """Have `read()` called where `engine.step()` takes its pre-clip norm (module docstring), each step; False where
    this engine's optimizer takes it inline (its fp16 optimizers at ZeRO-0), nothing watched: the caller reads before
    engine.step() — or, `inline_at_step`, at the entry of that optimizer's step, where nothing has touched the
    gradients since (for a loop whose before_step never comes: Trainer's DeepSpeed path steps inside backward)."""
    optimizer = engine.optimizer
    method = NORM_METHODS.get(type(optimizer).__name__)
    if method is None and inline_at_step and type(optimizer).__name__ in FP32_NORMS:
        method = "step"
    if method is not None:
        _before(optimizer, method, read)
    elif isinstance(optimizer, torch.optim.Optimizer) and engine.gradient_clipping() > 0:
        _before(engine, "clip_fp32_gradients", read)
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizer.register_step_pre_hook(lambda *_: read())
    else:
        return False
    return True


def _before(owner, method: str, read: Callable[[], None]) -> None:
    """`owner.method` (an instance's bound method) replaced on that instance by one that calls read() first — not for
    the BF16 optimizer's second call of its step, which gathers the gradients it clips (for_clipping=True)."""
    original = getattr(owner, method)

    def at_norm(*args, **kwargs):
        if not kwargs.get("for_clipping"):
            read()
        return original(*args, **kwargs)

    setattr(owner, method, at_norm)
