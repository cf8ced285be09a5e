"""The optimizer primitives every strategy shares: the one AdamW, the learning-rate schedule, the norms (accumulated in
float64) and torch's clipping formula, and what an optimizer step reports (OptimizerStep).

Defined once here so that they cannot differ between strategies; parity.training.strategy re-exports them as part of
the documented strategy API (docs/custom_strategy.md), and the policy optimizer (policy_optimizer.py) builds on them
without importing the strategy interface.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")  # the shared AdamW's state per parameter, by torch's keys (DeepSpeed's too)


@dataclass(frozen=True)
class OptimizerStep:
    """What a strategy's optimizer step reports: the pre-clip global gradient norm (of the unscaled gradients), and
    under fp16 whether the step was skipped on an overflow and the loss scale the gradients were computed with."""

    norm: float
    skipped: bool = False
    loss_scale: float | None = None
    again: bool = False  # a replay following an fp16 record: compute the step again (loss_scaler.FollowedScaler)
    overflowed: bool | None = None  # ... and whether its own gradients overflowed at the record's scale

    @classmethod
    def of(cls, result) -> "OptimizerStep":
        """What optimizer_step returned: an OptimizerStep, or the norm alone (a strategy without loss scaling)."""
        return result if isinstance(result, cls) else cls(float(result))


OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}  # what cfg.optimizer's "type" may name


def trainable(params) -> list[torch.Tensor]:
    """The parameters that train: under LoRA (--lora_r) the adapters, the frozen base left out — of the optimizer a
    strategy builds, of its parameter norm."""
    return [p for p in params if p.requires_grad]


def build_optimizer(params, cfg, names=None) -> torch.optim.Optimizer:
    """The one optimizer every strategy uses (DeepSpeed is handed this same client optimizer): AdamW over `params`
    in one group with the flags' settings — or, where the run names its optimizer by parameter group
    (`cfg.optimizer`, a replay's: parity.replay.replay), that optimizer's type (AdamW or Adam) with one group
    per recorded group, each of the parameters it names (`names`: the name of each of `params`, in order), its weight
    decay, betas, eps and lr scale (set_lr gives each group lr × its scale)."""
    spec = getattr(cfg, "optimizer", None)
    if not spec:
        return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                 eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    params = list(params)
    if names is None or len(names) != len(params):
        raise ValueError("an optimizer by parameter group needs the name of every parameter")
    by_name = dict(zip(names, params))
    groups = []
    for group in spec["groups"]:
        missing = [n for n in group["params"] if n not in by_name]
        if missing:
            raise ValueError(f"the optimizer's group names {missing[0]}, which the model does not hold")
        groups.append({"params": [by_name.pop(n) for n in group["params"]], "lr": cfg.learning_rate * group["lr_scale"],
                       "lr_scale": group["lr_scale"], "weight_decay": group["weight_decay"],
                       "betas": tuple(group["betas"]), "eps": group["eps"]})
    if by_name:
        raise ValueError(f"no group of the optimizer holds {next(iter(by_name))}")
    return OPTIMIZERS[spec["type"]](groups, lr=cfg.learning_rate)


def build_named_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """build_optimizer over `model`'s trainable parameters, with their names (a replay's groups name them)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return build_optimizer([p for _, p in named], cfg, [n for n, _ in named])


class StepLr(float):
    """The lr of a step of a replay whose record kept a schedule of Adam's betas (cfg.betas_schedule: OneCycleLR's
    cycle_momentum), and the betas each group applies at that step: it goes wherever the step's lr goes — a strategy's
    step, the teacher-forced check's reference steps — so that set_lr applies both wherever the lr is applied."""

    def __new__(cls, lr: float, betas):
        value = super().__new__(cls, lr)
        value.betas = [tuple(b) for b in betas]
        return value

    def __reduce__(self):
        return StepLr, (float(self), self.betas)


def set_lr(optimizer, lr: float) -> None:
    """Every group's lr: `lr`, times the group's lr scale where it has one (an optimizer by parameter group); and where
    `lr` is a StepLr, each group's betas its own."""
    betas = getattr(lr, "betas", None)
    if betas is not None and len(betas) != len(optimizer.param_groups):
        raise ValueError(f"the step's betas name {len(betas)} groups; the optimizer holds "
                         f"{len(optimizer.param_groups)}")
    for i, group in enumerate(optimizer.param_groups):
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else float(lr)
        if betas is not None:
            group["betas"] = betas[i]


def step_optimizer(optimizer, lr: float) -> None:
    """Step a torch optimizer at `lr` and drop the gradients (after the strategy has clipped them)."""
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def lr_at(step: int, cfg) -> float:
    """Linear warm-up over --warmup_steps, then constant; a replay's recorded lr at each step (cfg.lr_schedule), with
    its recorded betas where a scheduler moved them (cfg.betas_schedule: a StepLr)."""
    schedule, betas = getattr(cfg, "lr_schedule", None), getattr(cfg, "betas_schedule", None)
    if schedule:
        return StepLr(schedule[step], betas[step]) if betas else schedule[step]
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    return cfg.learning_rate


# A CPU tensor of this many elements or more is summed in rows of ROW elements: each row's norm in fp32 (vectorised),
# the rows' squares added in float64. On one core a float64 reduction reads ~4 ns an element, the rows ~0.2 ns: at
# Qwen2.5-0.5B's widths (169 M parameters at two layers) 715 ms against 30 ms a pass, and the recorder makes four passes
# a step. A row's fp32 sum of 1024 squares is good to ~1e-8 (measured against float64: ≤ 8e-9 over those tensors);
# below this size, and on GPUs (whose float64 reductions read fp32 as fast), the float64 reduction itself.
ROWS_FROM, ROW = 1 << 20, 1024
TINY = 1e-30  # a sum of squares below it (elements under ~1e-19, whose fp32 squares underflow) is taken again in float64


def squared_norm_fp64(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares accumulated in float64 (a 0-d float64 tensor on t's device).

    The pre-clip norm is compared across strategies at 1e-5, and an fp32 norm over a large gradient
    (the 2048×64 tied embedding already) is itself only good to ~1e-5; in float64 the only difference
    left is which partial sums each strategy forms, far below that. Large CPU tensors in float64-summed rows (ROW).
    """
    t = t.detach()
    if not _in_rows(t):
        return torch.linalg.vector_norm(t, dtype=torch.float64).square()  # no float64 copy: ~1.6× faster
    flat = t.reshape(-1)
    whole = flat.numel() // ROW * ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, ROW), dim=1,
                                    dtype=None if t.dtype == torch.float32 else torch.float32)
    total = rows.double().square().sum()
    if whole < flat.numel():
        total = total + torch.linalg.vector_norm(flat[whole:], dtype=torch.float64).square()
    if not TINY < float(total) < math.inf:  # underflow, overflow or NaN in fp32: the float64 reduction says which
        return torch.linalg.vector_norm(t, dtype=torch.float64).square()
    return total


def _in_rows(t: torch.Tensor) -> bool:
    """Whether squared_norm_fp64 sums `t` in rows: a large CPU tensor not already float64."""
    return t.numel() >= ROWS_FROM and t.device.type == "cpu" and t.dtype != torch.float64


def squares_fp64(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """squared_norm_fp64 of each tensor: the small ones in one foreach kernel, the large CPU ones in rows."""
    rows = [_in_rows(t) for t in tensors]
    small = [t.detach() for t, r in zip(tensors, rows) if not r]
    norms = torch._foreach_norm(small, 2, dtype=torch.float64) if small else []
    if norms:
        torch._foreach_mul_(norms, norms)  # x * x: square's own arithmetic, one launch for them all
    norms = iter(norms)
    return [squared_norm_fp64(t) if r else next(norms) for t, r in zip(tensors, rows)]


def stacked_squares_fp64(tensors: list[torch.Tensor]) -> torch.Tensor:
    """squares_fp64 of one or more tensors in one tensor, stacked on the first one's device (a GPU's: what is read off
    it then takes one copy, one sync). Tensors all on one device, none summed in rows (a step's recorded gradients and
    parameters), take three ops whatever their count: the recorder's cost is its host time (docs/gpu.md)."""
    device = tensors[0].device
    if all(t.device == device and not _in_rows(t) for t in tensors):
        with torch.no_grad():
            norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64))
        return norms * norms  # x * x: squares_fp64's arithmetic, bit for bit
    squares = squares_fp64(tensors)
    return torch.stack([x.to(squares[0].device) for x in squares])


def clip_coefficient(total_norm: float, cfg) -> float:
    """torch's clip_grad_norm_ formula: max_norm / (norm + 1e-6), at most 1; --max_grad_norm 0 = off."""
    if cfg.max_grad_norm <= 0:
        return 1.0
    return min(1.0, cfg.max_grad_norm / (total_norm + 1e-6))


def clip_gradients(total_norm: float, params, grads, cfg) -> None:
    """Clip as the run says: for RunConfig.clip_arithmetic "torch" (a noise reference drawing a framework's loop),
    torch's clip_grad_norm_ itself over `params` (fp32 norms and coefficient); else torch's formula over the float64
    `total_norm`, scaling `grads` (the tensors, or a DTensor's local pieces) in place. `cfg`: anything with
    max_grad_norm (a sharded loop passes its argparse namespace). A replay of a record that clipped by value
    (RunConfig.clip_value: clip_grad_value_, never beside a clip by norm) clamps each element as torch's does."""
    if clip_value := getattr(cfg, "clip_value", None):
        torch._foreach_clamp_min_(grads, -clip_value)
        torch._foreach_clamp_max_(grads, clip_value)
    elif getattr(cfg, "clip_arithmetic", None) == "torch" and cfg.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    elif (coef := clip_coefficient(total_norm, cfg)) < 1.0:
        torch._foreach_mul_(grads, coef)


def full_moments(named_parameters, optimizer, device: torch.device, master_of=None) -> tuple[dict, int] | None:
    """AdamW's state of a torch `optimizer` over the module parameters `named_parameters` ((Hugging Face name,
    parameter), a tied weight once) as full fp32 CPU tensors — ({name: {"exp_avg", "exp_avg_sq"}}, its step count),
    ({}, 0) before the first step — where each state is whole or a DTensor (gathered, in the parameters' order on
    every rank); `master_of(p)`: the tensor the optimizer steps for p (a policy's fp32 master), p itself by default.
    None where a moment's shape is not its parameter's (a piece of a framework's own: a flat shard), alike on every
    rank. Strategy.full_optimizer_state and the recorder's views (parity/views/) read it so, once.
    Collective where the states are DTensors."""
    from torch.distributed.tensor import DTensor

    moments, count = {}, 0
    for name, p in named_parameters:
        state = optimizer.state.get(master_of(p) if master_of is not None else p)
        if not state:
            continue
        count = int(state["step"]) if "step" in state else count
        moments[name] = {}
        for key in ADAMW_MOMENTS:
            t = state[key].detach().to(device)
            moments[name][key] = (t.full_tensor() if isinstance(t, DTensor) else t).float().cpu().clone()
        if moments[name]["exp_avg"].shape != p.shape:
            return None
    return moments, count


def local_norm(tensors) -> float:
    """The L2 norm of plain (unsharded) tensors taken together, accumulated in float64: each tensor's squares, read
    off the device in one copy, added in order."""
    tensors = list(tensors)
    return math.sqrt(sum(stacked_squares_fp64(tensors).tolist())) if tensors else 0.0


def clip_local_gradients(params, cfg) -> float:
    """Clip gradients that are plain (unsharded) tensors by their global norm; return that norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = local_norm(grads)
    coef = clip_coefficient(norm, cfg)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return norm
