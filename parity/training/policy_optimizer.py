"""The precision policy carried out, for a strategy whose parameters are plain tensors (DDP, the pipeline, your own data
parallelism): the shared AdamW over fp32 master copies, with fp16's loss scaling (`PolicyOptimizer`), the parameters'
cast and DDP's reduction in the policy's reduce dtype. The policy table it carries out (what each policy holds in
which dtype, and how a run's flags resolve to one) is parity/precision.py; fp16's scaler is loss_scaler.py.

Only the parameters are cast, not the buffers (the rotary embedding's inv_freq stays fp32), as FSDP2's policy and
DeepSpeed ≥ 0.19 do: `model.to(bfloat16)` — and DeepSpeed 0.18's `module.bfloat16()` — also rounds the rotary
frequencies, another model.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from parity.precision import DTYPES, policy_of
from parity.training.loss_scaler import applied, scaler_of, unscaled_or_skipped
from parity.training.memory import GRADS, MASTER, PARAMS
from parity.training.optimizer import ADAMW_MOMENTS, OptimizerStep, build_optimizer, clip_gradients, set_lr
from parity.training.update_noise import tensor_tables


def cast_parameters(module: torch.nn.Module, cfg) -> None:
    """The policy's parameter dtype on the module's parameters (in place: the same Parameter objects); buffers keep
    theirs (module docstring)."""
    dtype = DTYPES[policy_of(cfg).params]
    for p in module.parameters():
        p.data = p.data.to(dtype)


class PolicyOptimizer:
    """The shared AdamW, stepped as the run's policy says, over parameters that are plain tensors (whole, or a rank's
    own pieces): DDP, the pipeline, a hand-written data parallelism. Give it the module's parameters in fp32 (the
    shared initial weights, loaded); it keeps fp32 master copies where the policy has them (bf16_params, fp16) and
    casts the parameters to the policy's dtype, so build it before wrapping the module in what buckets gradients by
    dtype (DistributedDataParallel).

    Per step, after the strategy has reduced the gradients over DP: `step(lr, norm_of)` moves them into the master
    copies (fp32), and under fp16 checks every rank for an overflow (then the step is skipped and the scale lowered,
    DeepSpeed's rules: parity/training/loss_scaler.py) and unscales them; then clips by `norm_of`'s global norm
    (torch's formula over a float64 norm, --max_grad_norm; a noise reference of RunConfig.clip_arithmetic "torch":
    torch's clip_grad_norm_ itself, in fp32), steps, copies the masters back into the parameters and drops every
    gradient.
    Under --grad_accum_dtype fp32, `accumulate()` after each micro-batch's backward adds its (reduced) gradients into
    the fp32 master gradients.

    What a strategy does with it: `loss_scale` multiplies every micro-batch's loss (Strategy.loss_scale), `accumulate`
    after each backward where micro-batches accumulate in fp32, `step` in optimizer_step, `master_parameters()` for
    the parameter norm and the full parameters, `gradient_of` and `master_of` for each tensor's norms
    (Strategy.gradient_pieces), `state_dict` / `load_state_dict` in checkpoints."""

    def __init__(self, params, cfg, names=None):
        self.policy, self.cfg = policy_of(cfg), cfg
        params = list(params)
        kept = [i for i, p in enumerate(params) if p.requires_grad]
        self.params = [params[i] for i in kept]
        names = [names[i] for i in kept] if names is not None else None  # build_optimizer's, for groups by name
        self.masters = [p.detach().float().clone() for p in self.params] if self.policy.master_copy else None
        self._master = {id(p): m for p, m in zip(self.params, self.masters or self.params)}
        for p in params:  # a frozen parameter (LoRA's base) in the policy's dtype for it (bf16_base's bf16)
            p.data = p.data.to(DTYPES[self.policy.params if p.requires_grad else self.policy.frozen_dtype])
        self.optimizer = build_optimizer(self.masters or self.params, cfg, names)
        self.scaler = scaler_of(cfg) if self.policy.loss_scaling or getattr(cfg, "loss_scales", None) else None
        self.accumulates_fp32 = self.policy.master_copy and cfg.grad_accum_dtype == "fp32"
        # the optimizer's own noise of each step (parity/training/update_noise.py), by id of the tensor it steps, of the
        # tensors the strategy asks for (measure_update_noise: the baseline's series); else None
        self._noise_of: frozenset[int] = frozenset()
        self.update_noise = None
        self._carried: dict[int, torch.Tensor] = {}  # by id of the tensor stepped: what its table carries (tensor_tables)

    def measure_update_noise(self, tensors) -> None:
        """From the next step on, measure the optimizer's own noise of each of `tensors` (stepped ones: masters where
        the policy keeps them) — the baseline's, each tensor on the rank that counts it: a replica's table is the same
        on every rank holding it, and the others' went unread (three quarters of a 4-rank DDP baseline's tables)."""
        self._noise_of = frozenset(id(t) for t in tensors)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def master_parameters(self) -> list[torch.Tensor]:
        """The weights the optimizer updates (fp32 masters, or the parameters themselves), in the parameters' order."""
        return self.masters or self.params

    def master_of(self, param) -> torch.Tensor:
        """The master weight of `param` (itself where the policy keeps none, or where it is frozen: no optimizer
        steps it)."""
        return self._master.get(id(param), param)

    def gradient_of(self, param) -> torch.Tensor | None:
        """The gradient the next step applies to `param`, where it is now: its fp32 master's once there (inside step,
        unscaled, where the norm is taken; or where micro-batches accumulate in fp32, --grad_accum_dtype fp32), else
        the parameter's own (after backward, as reduced)."""
        master = self._master[id(param)]
        return master.grad if master.grad is not None else param.grad

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add each parameter's gradient (a micro-batch's, reduced over DP) into its fp32 master's and drop it: the
        micro-batches accumulate in fp32 (--grad_accum_dtype fp32)."""
        if not self.accumulates_fp32:
            return
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None

    @torch.no_grad()
    def divide_gradients(self, factor: float) -> None:
        """Every gradient held now (the parameters', the masters') divided by `factor`: a perturbed noise reference's
        loss was multiplied by it (parity.training.perturbed)."""
        held = [t.grad for t in self.params + (self.masters or []) if t.grad is not None]
        torch._foreach_div_(held, factor)

    @torch.no_grad()
    def step(self, lr: float, norm_of: Callable[[list[torch.Tensor]], float], counted=None,
             before_norm: Callable[[], None] | None = None) -> OptimizerStep:
        """Clip, step at `lr` and drop the gradients (class docstring); `norm_of(grads)` is the global L2 norm of this
        rank's gradients (the masters', fp32) of the `counted` parameters (default: all; the pipeline counts a tied
        weight's copy once) in the strategy's own way (a collective where ranks hold pieces). `before_norm()` is called
        just before it, on the gradients it is taken of (gradient_of: the masters', unscaled): where the strategy hands
        them to the tensor record (Strategy.record_gradients)."""
        self.accumulate()
        self.update_noise = None
        targets = self.master_parameters()
        if self.masters is not None:
            for p, m in zip(self.params, self.masters):
                if p.grad is not None:
                    m.grad = p.grad.float()
        grads = [t.grad for t in targets if t.grad is not None]
        scale = self.loss_scale
        skipped = unscaled_or_skipped(self.scaler, grads, targets[0].device, self.zero_grad)
        if skipped is not None:
            return skipped
        counted = self.params if counted is None else [p for p in counted if id(p) in self._master]
        if before_norm is not None:
            before_norm()
        norm = norm_of([g for g in (self.master_of(p).grad for p in counted) if g is not None])
        clip_gradients(norm, [self.master_of(p) for p in counted], grads, self.cfg)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        if self._noise_of:
            self.update_noise = self._noise_tables()
        if self.masters is not None:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        self.zero_grad()
        return applied(self.scaler, norm, scale)

    def _noise_tables(self) -> dict:
        """{id(tensor stepped): its update_noise.tensor_tables row} of this step, of each tensor measured
        (measure_update_noise), from its gradient (clipped) and AdamW state after the step: a param group's at once."""
        tables = {}
        for group in self.optimizer.param_groups:
            measured = [t for t in group["params"] if id(t) in self._noise_of and t.grad is not None
                        and "exp_avg" in self.optimizer.state.get(t, {})]
            states = [self.optimizer.state[t] for t in measured]
            rows = tensor_tables([(t.grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"]), t,
                                   self._carried.get(id(t))) for t, state in zip(measured, states)],
                                 group["lr"], group["betas"], group["eps"])
            for t, (row, carried) in zip(measured, rows):
                tables[id(t)] = row
                if carried is not None:
                    self._carried[id(t)] = carried
        return tables

    def set_moments(self, params_and_moments, step: int) -> None:
        """AdamW's state of another run — [(parameter, {"exp_avg", "exp_avg_sq"})] for this rank's parameters — on
        their masters (the layer check's replay)."""
        for p, moments in params_and_moments:
            target = self.master_of(p)
            self.optimizer.state[target] = {"step": torch.tensor(float(step)), **{
                k: moments[k].to(target.device, target.dtype).clone() for k in ADAMW_MOMENTS}}

    def zero_grad(self) -> None:
        for t in self.params + (self.masters or []):
            t.grad = None

    def count_state(self, ledger, params: list[torch.Tensor]) -> None:
        """A rank's model state into `ledger` (a memory.StateLedger): `params` (the module's), the masters, the
        gradients of both, and AdamW's state."""
        ledger.add_all(PARAMS, params)
        ledger.add_all(MASTER, self.masters or ())
        ledger.add_all(GRADS, (p.grad for p in params + (self.masters or [])))
        ledger.add_optimizer_state(self.optimizer)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "masters": self.masters,
                "scaler": self.scaler.state_dict() if self.scaler else None,
                # the bound needs the variances' size, not their last bits: bf16 halves a checkpoint's share of them
                "update_noise_carried": [None if (c := self._carried.get(id(t))) is None else c.to(torch.bfloat16)
                                         for t in self.master_parameters()]}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.masters is not None:
            for p, m, saved in zip(self.params, self.masters, state["masters"]):
                m.copy_(saved)
                p.data.copy_(saved)
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._carried = {id(t): c.float() for t, c in zip(self.master_parameters(),
                                                            state.get("update_noise_carried") or []) if c is not None}
        # (a baseline resumed: its flips so far; a checkpoint written before them: none)


def reduce_in(dtype: str):
    """A DistributedDataParallel comm hook that averages each gradient bucket in `dtype` (the policy's reduce dtype where
    it is not the gradients' own: bf16 gradients reduced in fp32, or autocast's fp32 ones in bf16), then writes the
    average back into the bucket in the gradients' dtype. As DDP's own hook, each rank divides by the world size first."""
    wanted = DTYPES[dtype]

    def hook(state, bucket):
        group = state if state is not None else dist.group.WORLD
        buffer = bucket.buffer()
        tensor = buffer.to(wanted).div_(dist.get_world_size(group))
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def written(fut):
            buffer.copy_(fut.value()[0])
            return buffer
        return future.then(written)
    return hook
