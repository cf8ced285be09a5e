"""The teacher-forced check: at every checkpoint step k (--checkpoint_interval, and step 0), the strategy's own next
update is compared with a trusted update taken from the same state on the same batch — so a bug that starts late is
judged as sharply as one at step 0, whatever the curves' noise has grown to by then (docs/teacher_forced.md).

Which state: the strategy's own at k, fed to a reference step (not DDP's state at k loaded into the strategy). Every
strategy already exports its full state — full_parameters() (what the final model and the layer check gather) and
AdamW's moments (Strategy.full_optimizer_state, the inverse of set_optimizer_state that the layer check's replay loads
moments with) — while loading a foreign state into a running strategy would need every strategy's load path at every
checkpoint, and two runs' states at step k are never the same model in bf16 (they drift apart chaotically): the
comparison would measure the drift, not the step. From its own state the strategy's step and the reference's differ
by that step alone.

[1] before step k, on every rank: the strategy's full state (parameters, AdamW's moments and step count, buffers),
    gathered as full tensors under Hugging Face names (collective);
[2] rank 0 takes the reference step from it on the global batch of step k at step k's lr: one process, the whole
    batch, the shared AdamW (PolicyOptimizer) in the run's precision policy — DDP at one rank, without DDP — and, in a
    low-precision policy, the same step in fp32 as well: how far the policy's rounding moves each tensor (the layer
    check's calibration, taken at this step);
[3] after step k, on every rank: the strategy's full state again (collective); rank 0 measures each tensor against
    the reference — the updated parameters relative to the reference's update (‖p − p_ref‖ / ‖p_ref − p_k‖: a bug
    that scales the update by 3 % reads 3e-2 whatever the weights' size), each moment relative to itself, the pre-clip
    grad norm — and the record's step k holds every measurement (and the rounding's), which the verdict judges
    (parity/comparing/teacher_forced.py). Every rank gets the entry (one broadcast), so the records agree.

[4] At a checkpoint (under Ray Train) the state the next check starts from is captured before it is written, and its
    digest (each tensor's norm, AdamW's step count) goes into the record the checkpoint keeps; a run resumed there
    compares the state it loaded with it at its first step ("resumed"): a resume that loses the moments FAILs there.

A strategy that cannot export its optimizer state (full_optimizer_state returns None) is checked on the pre-clip grad
norm only, which needs its parameters alone; the entry says so in one line ("note").
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist

from parity.layout import Layout
from parity.objectives import invariance_of
from parity.training.loss_scaler import FollowedScaler
from parity.training.optimizer import ADAMW_MOMENTS, clip_coefficient, local_norm
from parity.training.policy_optimizer import PolicyOptimizer
from parity.training.routing import MEGATRON_CORE
from parity.training.strategy import Strategy, WorkerContext, lr_at
from parity.training.update_noise import step_moves
from parity.training.view import FullState, capture  # [1] / [3]: the strategy's full state, on every rank

KEY = "teacher_forced"  # the record's per-step entry
STATE_KEY = "teacher_forced_state"  # the digest of the state a checkpoint holds, in its record's last step entry


SKIPPED = {  # (the run skipped the step, the reference did): why an fp16 check compares nothing
    (True, True): "an fp16 overflow skipped the step in the run and in the reference: nothing to compare",
    (True, False): "the run skipped the step on an fp16 overflow, the reference did not: nothing to compare (the "
                   "curves judge each run's skipped steps against the baseline's)",
    (False, True): "the reference overflowed in fp16 at the run's loss scale, the run did not: nothing to compare "
                   "(the run reduces its ranks' gradients, the reference the whole batch's)",
}


def check_steps(cfg, total_steps: int) -> list[int]:
    """The steps checked: 0 and every checkpoint step before the last (--checkpoint_interval; 0: step 0 only), none
    with --no_teacher_forced. The step checked at checkpoint k is the one trained from it (index k): the step after a
    resume."""
    if getattr(cfg, "no_teacher_forced", False):
        return []
    interval = cfg.checkpoint_interval
    return sorted({0, *(range(interval, total_steps, interval) if interval > 0 else ())} & set(range(total_steps)))


class ReferenceStep(Strategy):
    """The trusted step: the whole model in one process (no DP, no sharding, no collective), the shared AdamW under the
    run's policy (PolicyOptimizer), Strategy's own forward_backward over the whole global batch."""

    name = "reference"
    tensor_parallel = False

    def setup(self, model) -> None:
        model.to(self.ctx.device)
        self.model = model
        self.policy_optimizer = PolicyOptimizer(model.parameters(), self.cfg, [n for n, _ in model.named_parameters()])
        self.optimizer = self.policy_optimizer.optimizer

    @property
    def hf_model(self):
        return self.model

    perturb = 1.0  # the perturbed twin's factor on the loss, its gradients divided by it before the step (PERTURB)

    @property
    def loss_scale(self) -> float:
        return self.policy_optimizer.loss_scale * self.perturb

    def backward(self, loss, last: bool = True) -> None:
        loss.backward()
        self.policy_optimizer.accumulate()

    def optimizer_step(self, lr: float):
        """The step; the twin clips by fp32_norm but reports the float64 norm of the same gradients (a run's grad
        norm is judged against a float64 one: the fp32 norm's rounding is noise for the moments, not for it). The
        gradients it steps with are kept (`stepped`: the optimizer's own noise, update_noise.step_moves)."""
        policy, exact = self.policy_optimizer, []
        if self.perturb != 1.0:
            policy.divide_gradients(self.perturb)

        def norm_of(grads):
            self.stepped = [g.detach().clone() for g in grads]  # the trainable parameters', in their order
            exact.append(local_norm(grads))
            exact.append(exact[0] if self.perturb == 1.0 else fp32_norm(grads))
            return exact[1]
        done = policy.step(lr, norm_of)
        if exact:  # as clip_gradients clipped them: by value (a record's clip_value) or by the norm's coefficient
            value, coef = getattr(self.cfg, "clip_value", None), clip_coefficient(exact[1], self.cfg)
            self.stepped = [g.clamp(-value, value) if value else g * coef for g in self.stepped]
        return dataclasses.replace(done, norm=exact[0]) if exact else done

    def gather_world(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t]  # one process: no collective

    stepped: list[torch.Tensor] = []

    def state(self) -> FullState:
        names = [n for n, _ in self.model.named_parameters()]
        masters = [self.policy_optimizer.master_of(p) for _, p in self.model.named_parameters()]
        moments = {n: {k: self.optimizer.state[m][k].detach().float().cpu() for k in ADAMW_MOMENTS}
                   for n, m in zip(names, masters) if m in self.optimizer.state}
        trained = [n for n, p in self.model.named_parameters() if p.requires_grad]
        grads = dict(zip(trained, (g.float().cpu() for g in self.stepped))) if len(self.stepped) == len(trained) \
            else None
        where = {id(t): (g["lr"], g["betas"], g["eps"]) for g in self.optimizer.param_groups for t in g["params"]}
        hyper = {n: (*where[id(m)], int(self.optimizer.state[m]["step"])) for n, m in zip(names, masters)
                 if m in self.optimizer.state and id(m) in where}
        return FullState({n: m.detach().float().cpu() for n, m in zip(names, masters)}, moments, 0, {}, grads, hyper)


def split_micro_batches(cfg) -> int:
    """The micro-batches the reference step splits the global batch into: 1, or — for an objective that depends on the
    split by definition (parity.objectives.invariance_of: bnpo, an entropy bonus, DPO's sft) — the run's own, every DP
    rank's micro-batches in order (a pipeline's --microbatches), so the reference computes the same definition."""
    if not invariance_of(getattr(cfg, "objective", None)).depends_on_split:
        return 1
    return cfg.dp_size * cfg.options.get("microbatches", cfg.grad_accum_steps)


PERTURB = 4 / 3
"""The perturbed twin of the reference step (the check's noise, `references`): its loss × PERTURB (not a power of two:
every backward product and sum rounds otherwise), its gradients ÷ PERTURB before the step, the global batch in twice
the micro-batches where the rows and the objective allow (another order of the sums over tokens, as another
data-parallel layout's), and the norm it clips by taken in fp32 as torch's clip_grad_norm_ takes it (fp32_norm; the
reference's is float64: where clipping binds, every moment then carries that norm's rounding, as a framework's run
does — torchtitan's FSDP exp_avg_sq of a norm weight read 6e-5..8e-5 from the float64 reference) — the same step, in
another arithmetic."""


def fp32_norm(tensors) -> float:
    """The L2 norm of plain tensors taken together as torch's clip_grad_norm_ takes it: each tensor's norm in fp32, then
    the norm of those."""
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])))


def own_split(model_config, batch, micro_rows: int | None = None) -> int | None:
    """The micro-batches of a step whose mixture of experts trains router losses of each micro-batch's own
    (megatron-core's: parity/training/routing.py): the run's — the batch's plan (micro_rows), else micro-batches of
    `micro_rows` rows (a record's, parity/replay/replay.py checks the replay keeps them); None for any other model."""
    if getattr(model_config, "router_aux_loss_scope", None) != MEGATRON_CORE:
        return None
    if batch.micro_rows is not None:
        return sum(len(rank) for rank in batch.micro_rows)
    return len(batch.input_ids) // (micro_rows or len(batch.input_ids))


def perturbed_split(cfg, batch) -> int:
    """The perturbed twin's micro-batches: two where the reference takes the batch whole and each half keeps whole
    rows and pairs (rows a multiple of 4; not fed rows, which go one at a time already); else the reference's own."""
    parts = split_micro_batches(cfg)
    whole = getattr(batch, "fed", None) is None and getattr(batch, "micro_rows", None) is None
    return 2 if whole and parts == 1 and len(batch.input_ids) % 4 == 0 else parts


def reference_cfg(cfg, batch_rows: int, precision: str | None = None, micro_batches: int | None = None):
    """The run's config for one process holding the whole global batch (`batch_rows` rows, in `micro_batches`: default
    split_micro_batches'), in `precision`'s policy (fp32: no loss scaling, fp32 reductions) or the run's own."""
    changes = dict(num_workers=1, dp_size=1, tp_size=1, pp_size=1, ep_size=1, batch_size=batch_rows,
                   grad_accum_steps=micro_batches or split_micro_batches(cfg), compile=False,
                   activation_checkpointing=False, loss_scales=None)  # fp16: its own overflow, at the step's scale
    if precision == "fp32":
        changes.update(precision="fp32", reduce_dtype="fp32", grad_accum_dtype="fp32", loss_scaling=None)
    return dataclasses.replace(cfg, **changes)


def reference_step(cfg, model_config, state: FullState, global_batch, lr: float, device,
                   precision: str | None = None, loss_scale: float = 1.0, perturbed: bool = False,
                   micro_rows: int | None = None, skipped: bool | None = None) -> tuple[FullState, float] | None:
    """[2]: one step from `state` on `global_batch` at `lr` (`perturbed`: its twin in another arithmetic, PERTURB);
    (the state after it, the pre-clip grad norm), or None where an fp16 overflow skipped it (at the strategy's
    `loss_scale`; `micro_rows`: own_split's) — or, where the run follows a record's fp16 scaler, where the record
    skipped it (`skipped`: the step then applied where the record applied it, as its replay applies it:
    loss_scaler.FollowedScaler)."""
    from parity.models.adapters import add_adapters
    from parity.models.model import build_model

    model = add_adapters(build_model(model_config, cfg.seed), cfg.lora)  # the run's model: its adapters, if any
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state.params[name])
        for name, b in model.named_buffers():
            if name in state.buffers:
                b.copy_(state.buffers[name])
    parts = own_split(model_config, global_batch, micro_rows) or (perturbed_split(cfg, global_batch) if perturbed
                                                                  else None)
    ref = ReferenceStep(reference_cfg(cfg, len(global_batch.input_ids), precision, parts),
                        WorkerContext(rank=0, device=device, layout=Layout(1, 1)))
    ref.setup(model)
    ref.perturb = PERTURB if perturbed else 1.0
    if state.moments:
        ref.policy_optimizer.set_moments([(p, state.moments[n]) for n, p in model.named_parameters()
                                          if p.requires_grad and n in state.moments], state.count)
    scaler = ref.policy_optimizer.scaler
    if scaler is not None and skipped is not None:  # the record's decision, at its scale (FollowedScaler)
        scaler = ref.policy_optimizer.scaler = FollowedScaler([(loss_scale, skipped)])
    elif scaler is not None:  # fp16: the strategy's scale at this step
        scaler.scale = loss_scale
    if scaler is not None:  # an overflow looked for in this process alone
        scaler.collective = False
    done = None
    while done is None or done.again:  # again: at half the scale, where the record applied what overflowed here
        ref.forward_backward(global_batch, global_batch.divisor)
        done = ref.optimizer_step(lr)
    return None if done.skipped else (ref.state(), float(done.norm))


def references(cfg, model_config, state: FullState, global_batch, lr: float, device, loss_scale: float = 1.0,
               micro_rows: int | None = None, skipped: bool | None = None):
    """[2] (the reference step in the run's policy, the same step in fp32 or None, its perturbed twin or None):
    reference_step's in the run's policy, again in another arithmetic (PERTURB: how far rounding alone moves each
    tensor at this step, the check's noise) and, in a low-precision policy, once more in fp32 (how far the policy's
    rounding moves it); the first None where an fp16 overflow skipped it (`skipped`: reference_step's)."""
    own = reference_step(cfg, model_config, state, global_batch, lr, device, loss_scale=loss_scale,
                         micro_rows=micro_rows, skipped=skipped)
    if own is None:
        return own, None, None
    twin = reference_step(cfg, model_config, state, global_batch, lr, device, loss_scale=loss_scale, perturbed=True,
                          micro_rows=micro_rows, skipped=skipped)
    exact = reference_step(cfg, model_config, state, global_batch, lr, device, "fp32", micro_rows=micro_rows) \
        if cfg.precision != "fp32" else None
    return own, exact, twin


def measured(after: FullState, grad_norm: float, refs, before: FullState, lr: float) -> dict:
    """[3] A check's measurements: {"tensors": each tensor of `after` against the reference step (measure)}, "noise":
    the reference's perturbed twin measured against it the same way, and, where `refs` (references') holds the fp32
    twin, "rounding": the reference in the policy measured against that."""
    (ref, ref_norm), exact, twin = refs
    entry = {"tensors": measure(after, grad_norm, ref, ref_norm, before, lr)}
    if twin is not None:
        entry["noise"] = measure(twin[0], twin[1], ref, ref_norm, before, lr)
        optimizer = optimizer_noise(ref, twin[0], before, lr)
        if optimizer:
            entry["optimizer"] = optimizer
    if exact is not None:
        entry["rounding"] = measure(ref, ref_norm, exact[0], exact[1], before, lr)
    return entry


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    """‖a − b‖ / ‖scale‖ in float64 (0 where both are equal, inf where only the scale is 0)."""
    diff = float(torch.linalg.vector_norm((a.double() - b.double()).flatten()))
    size = float(torch.linalg.vector_norm(scale.double().flatten()))
    return diff / size if size > 0 else (0.0 if diff == 0 else math.inf)


UPDATE_FLOOR = 0.1
"""The updated parameters' scale is never below UPDATE_FLOOR × lr per element: a tensor whose gradient sits near
AdamW's eps (a k_proj bias: softmax ignores a shift shared by all keys) barely moves, and against its own tiny update
the last bits of two correct reductions would read as a difference."""


def measure(after: FullState, grad_norm: float, ref: FullState, ref_norm: float,
            before: FullState, lr: float) -> dict[str, float]:
    """[3] Each tensor of `after` (a step from `before` at `lr`) against `ref` (the reference's step from it):
    "param/<name>" relative to the reference's update (UPDATE_FLOOR), "exp_avg/<name>" and "exp_avg_sq/<name>" relative
    to themselves, and "grad_norm". AdamW's first step (`before` without moments) moves each element by lr × the sign
    of its gradient: its parameters say nothing its moments do not (they hold the gradient itself), while rounding
    flips the sign of every noise-level gradient (the layer check's ADAM_SIGN_FLIP): they are compared from the
    second step on."""
    out = {"grad_norm": abs(grad_norm - ref_norm) / abs(ref_norm) if ref_norm else float(grad_norm != ref_norm)}
    if after.moments is None:
        return out
    for name, p in ref.params.items() if before.moments else ():
        update = p.double() - before.params[name].double()
        floor = UPDATE_FLOOR * lr * math.sqrt(update.numel())
        if float(torch.linalg.vector_norm(update.flatten())) < floor:
            update = torch.full((1,), floor, dtype=torch.float64)
        out[f"param/{name}"] = _rel(after.params[name], p, update)
    for name, m in ref.moments.items():
        for k in ADAMW_MOMENTS:  # a moment the run never made (its optimizer never stepped the tensor): off by all
            out[f"{k}/{name}"] = _rel(after.moments[name][k], m[k], m[k]) if name in after.moments else math.inf
    return out


def optimizer_noise(ref: FullState, twin: FullState, before: FullState, lr: float) -> dict[str, float]:
    """The reference step's own noise, per tensor, in measure's units: how far its update (from AdamW's second step
    on) and its moments move when each element of its gradient moves by the twin's (the rms over the tensor of the
    twin's gradient less the reference's: uniform within a tensor, update_noise.py) — "param/<name>":
    √Σ move² (update_noise.step_moves) over the reference's update (floored as measure's); "exp_avg/<name>":
    (1 − β1) δ √n over ‖m‖; "exp_avg_sq/<name>": ‖(1 − β2)(2 |g| δ + δ²)‖ over ‖v‖. Empty without the gradients."""
    if not ref.grads or not twin.grads or not ref.moments or not ref.hyper:
        return {}
    out = {}
    for name, g in ref.grads.items():
        if name not in twin.grads or name not in ref.moments or name not in ref.hyper:
            continue
        lr_, betas, eps, count = ref.hyper[name]
        g64, m, v = g.double(), ref.moments[name]["exp_avg"].double(), ref.moments[name]["exp_avg_sq"].double()
        delta = float((twin.grads[name].double() - g64).pow(2).mean().sqrt())
        out[f"exp_avg/{name}"] = _size((1 - betas[0]) * delta * math.sqrt(g.numel()), m)
        out[f"exp_avg_sq/{name}"] = _size(float(torch.linalg.vector_norm(
            (1 - betas[1]) * (2 * g64.abs() * delta + delta * delta))), v)
        if before.moments:
            update = ref.params[name].double() - before.params[name].double()
            floor = UPDATE_FLOOR * lr * math.sqrt(update.numel())
            size = max(float(torch.linalg.vector_norm(update.flatten())), floor)
            out[f"param/{name}"] = math.sqrt(step_moves(g64, m, v, count, lr_, betas, eps, delta)) / size
    return out


def _size(x: float, scale: torch.Tensor) -> float:
    """`x` over ‖scale‖ (0 where both are 0, inf where only the scale is)."""
    size = float(torch.linalg.vector_norm(scale.flatten()))
    return x / size if size > 0 else (0.0 if x == 0 else math.inf)


def digest(state: FullState) -> dict[str, float]:
    """Each tensor's float64 norm and AdamW's step count: what a checkpoint's state must read again once resumed."""
    out = {f"param/{n}": float(torch.linalg.vector_norm(t.double())) for n, t in state.params.items()}
    for n, m in (state.moments or {}).items():
        out.update({f"{k}/{n}": float(torch.linalg.vector_norm(m[k].double())) for k in ADAMW_MOMENTS})
    if state.moments is not None:
        out["step_count"] = float(state.count)
    return out


class TeacherForcedCheck:
    """One run's checks on this rank: `before(step, batch)` ahead of a checked step's train step and `after(step,
    grad_norm, skipped)` once it is done return the record's entry for that step (None elsewhere). Every rank calls
    both at every step (a checked step's are collective); only rank 0 computes the reference."""

    def __init__(self, worker, total_steps: int):
        self.cfg, self.ctx, self.strategy, self.model_config = worker.cfg, worker.ctx, worker.strategy, \
            worker.model_config
        self.steps = set(check_steps(self.cfg, total_steps))
        self.pending = self.captured = self.resumed_from = None
        self.seconds = 0.0

    def at_checkpoint(self, done: int, record) -> None:
        """[4] Ahead of the checkpoint after `done` steps (every rank): the state the next check starts from, captured
        now, and its digest in the record's last step entry, which the checkpoint keeps: a run resumed there checks
        that it holds the same state (`resumed`). Collective."""
        if done not in self.steps:
            return
        t0 = time.perf_counter()
        state = capture(self.strategy)
        record.steps[-1][STATE_KEY] = digest(state)
        self.captured = (done, state)
        self.seconds += time.perf_counter() - t0

    def resumed(self, start: int, record) -> None:
        """The run resumed at step `start` from a checkpoint whose record holds the digest of the state there."""
        saved = record.steps[-1].get(STATE_KEY) if start and record.steps else None
        self.resumed_from = (start, saved) if saved else None

    def before(self, step: int, global_batch) -> None:
        if step not in self.steps:
            return
        t0 = time.perf_counter()
        held = self.captured
        state = held[1] if held and held[0] == step else capture(self.strategy)
        self.captured = None
        resume = None
        if self.resumed_from and self.resumed_from[0] == step:  # [4] the state loaded against the state saved
            saved, now = self.resumed_from[1], digest(state)
            resume = {k: abs(now.get(k, 0.0) - v) / abs(v) if v else float(now.get(k, 0.0) != v)
                      for k, v in saved.items()}
        refs = None
        if self.ctx.is_logging_rank:
            followed = self.cfg.loss_scales[step][1] if self.cfg.loss_scales else None  # an fp16 record's replay
            refs = references(self.cfg, self.model_config, state, global_batch.to(self.ctx.device),
                              lr_at(step, self.cfg), self.ctx.device, self.strategy.current_loss_scale, skipped=followed)
        self.pending = (state, refs, resume, time.perf_counter() - t0)

    def after(self, step: int, grad_norm: float, skipped: bool = False) -> dict | None:
        if step not in self.steps or self.pending is None:
            return None
        t0 = time.perf_counter()
        before, refs, resume, spent = self.pending
        self.pending = None
        after = capture(self.strategy)
        entry = None
        if self.ctx.is_logging_rank:
            note = None
            if before.moments is None:
                note = (f"{self.cfg.strategy} cannot export its optimizer state (Strategy.full_optimizer_state): "
                        f"the pre-clip grad norm only")
            if skipped or refs[0] is None:
                entry = {"note": SKIPPED[skipped, refs[0] is None]}
            else:
                entry = {**measured(after, grad_norm, refs, before, lr_at(step, self.cfg)), "note": note}
            if resume is not None:
                entry["resumed"] = resume
        answer = [entry]
        dist.broadcast_object_list(answer, src=0)
        self.seconds += spent + time.perf_counter() - t0
        return {"step": step, "precision": self.cfg.precision, "seconds": spent + time.perf_counter() - t0,
                **answer[0]}
