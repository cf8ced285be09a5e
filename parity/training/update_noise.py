"""How far AdamW's update of each element can move when its gradient moves by noise: the optimizer's own noise, which
the tensor verdict's and the teacher-forced check's bounds take in (parity/comparing/update_bound.py; docs/tensors.md).

Why: Adam's update of an element whose first moment lies within its gradient's noise may take either sign, and one of
an element whose gradient history is near zero moves by up to lr whatever that noise's size; a correct run's
parameters part from the baseline's by such moves, and the noise references draw a few of them, or none, by chance (a
clean megatron-core bf16 run on CUDA read 1.004 × a 64-element norm weight's update bound: about one flip the
references did not draw). So the baseline's own optimizer says, element by element, how far each update can move.

The element noise is uniform within a tensor, not relative to each element (measured, docs/tensors.md: the gradient
differences of the elements with the smallest quarter of |g| are 0.4–1.0 of those of the largest quarter's, while
their gradients are 0.05–0.1 of them): a noise level `x` is δ = x × the tensor's rms gradient on every element — which
is what makes a near-zero element flip-prone.

`tensor_table` (the baseline, every step): per level x of GRID, Σ_i c_i², c_i how far element i's displacement moves
the tensor's norm now — the displacement's variance the sum of the moves² of the steps where the element was flip-prone
(|m̂_i| < δ: the update's sign is the noise's), carried from step to step (a flip stays in the parameter), its effect
on the norm read at the element's value now, either sign (displacement_effect). Read at the step of the move alone, a
zero-initialised bias's first update flipped moves the norm by nothing, and one step later by 2 lr |p| / ‖p‖ (a clean
TRL GRPO run's q_proj bias read 0.79 of its bound on one such flip, docs/false_alarms.md): the row is each step's whole
variance, not its increment. The other elements' moves are linear in the noise,
a sum of many small ones the references sample well (their bound, NOISE_K × what they drew, lies 6 × above those moves'
spread at the median); counted here too they would lift the bound where the seeded bugs are caught (docs/tensors.md).
The move carries over steps as the moments do: the noise δ on every gradient the moments hold shifts the
bias-corrected first moment by δ and the second's root by up to δ (√v̂' = √(v̂ ± 2δ m̂ + δ²)), and the move is the
formula's |u(m̂ ± δ, v̂') − u(m̂, v̂)| at its larger sign, u = lr · m̂ / (√v̂ + ε), capped by nothing but the formula.
(A move of this step's gradient alone, (1 − β1) δ on m, read the clean runs' deviations at up to 7.5 × its scale: the
moments keep each step's noise.)

`step_moves` (the teacher-forced check, one step from one state): the same at one step, this step's gradient alone
moved (m' = m + (1 − β1) δ, v' = v + (1 − β2)((g + δ)² − g²)), its moves' sum of squares, unprojected: the check
measures ‖p − p_ref‖.

A tensor of more than SAMPLED elements is measured on SAMPLED of them, fixed (drawn once per size: _sample), its sum
scaled by the ratio (a 0.5 B model's step would otherwise take seconds on a CPU); small tensors, where one element's
flip shows, whole.
"""

from __future__ import annotations

import functools

import torch

# the noise levels x, in rms gradients: 1e-8 … 0.32 in half decades — bf16's element noise is 0.3–10 % of a tensor's
# rms gradient, fp32's ~1e-7 (docs/tensors.md); a flip-prone table rises as x³ (elements ∝ x, each move² ∝ x²), so
# half decades (a factor 5.6 between levels) keep its reading within its own size
GRID = tuple(10 ** (e / 2) for e in range(-16, 0))
SAMPLED = 1 << 14
PERMUTED = 1 << 20  # elements up to which a tensor's sample is a permutation's first SAMPLED (_sample)
DIGITS = 3  # significant digits a table keeps in the record: the bound needs its size, not its last bits


@functools.lru_cache(maxsize=None)
def _sample(n: int, device) -> torch.Tensor | None:
    """The fixed elements a tensor of `n` elements is measured on (None: all of them), drawn once per size and device
    (seeded by `n`, so every rank and step measures the same). Up to PERMUTED elements, the first SAMPLED of a
    permutation; beyond, SAMPLED of the distinct ones among 2 × SAMPLED uniform draws (at least 32 256 of them: draws
    of 2^20 or more collide some 512 times), picked uniformly — a uniform sample without the permutation of every
    element (8 s and 1 GiB at Qwen2.5-0.5B's embedding: it had been drawn at every step)."""
    if n <= SAMPLED:
        return None
    generator = torch.Generator().manual_seed(n)
    if n <= PERMUTED:
        return torch.randperm(n, generator=generator)[:SAMPLED].to(device)
    drawn = torch.unique(torch.randint(n, (2 * SAMPLED,), generator=generator))
    return drawn[torch.randperm(len(drawn), generator=generator)[:SAMPLED]].to(device)


@functools.lru_cache(maxsize=None)
def _grid(dtype, device) -> torch.Tensor:
    """GRID as a tensor on `device`, made once (on a GPU a copy from the host at every tensor and step otherwise)."""
    return torch.tensor(GRID, dtype=dtype, device=device)


def _update(m_hat, v_hat, lr, eps):
    return lr * m_hat / (v_hat.clamp_min(0).sqrt() + eps)


def _moved(m_hat, v_hat, base, d, lr, eps):
    """|_update(m̂ + d, v̂ + 2 d m̂ + d²) − base|, operation for operation, on two buffers of its own ([element, level]):
    the same bits with a quarter of the allocations (a 0.5 B model's step measures 16 384 × 16 of each tensor)."""
    v = 2 * d * m_hat
    v += v_hat
    v += d * d
    v.clamp_min_(0).sqrt_().add_(eps)
    u = m_hat + d
    return u.mul_(lr).div_(v).sub_(base).abs_()


def noise_scale(grad: torch.Tensor) -> float:
    """One unit of element noise: the rms of the gradient's elements that are not exactly 0 (an embedding's rows no
    token reached are 0 in every arithmetic: no noise there, as the measurement says, docs/tensors.md)."""
    g = grad.detach().reshape(-1)
    active = int(torch.count_nonzero(g))
    return float(torch.linalg.vector_norm(g.double())) / active ** 0.5 if active else 0.0


def tensor_table(grad, exp_avg, exp_avg_sq, step: int, param, lr: float, betas, eps: float,
                 carried: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(One tensor's row, what it carries to the next step). The row: per x of GRID, Σ_i effect_i² (float64, on the
    tensor's device) — how far each element's displacement by the flips it was prone to so far (this step's and the
    earlier ones', `carried`) moves the tensor's norm now (displacement_effect); zeros before AdamW's first step or for
    a tensor of norm 0. What it carries: per element and level, Σ move² over the steps it was flip-prone (float32,
    [element, level], the sampled elements'). Every level at once, over the elements flip-prone at the highest (in
    fp32: a flip's move is the size of the update itself)."""
    out = torch.zeros(len(GRID), dtype=torch.float64, device=param.device)
    n, norm, rms = param.numel(), float(torch.linalg.vector_norm(param.detach().double())), noise_scale(grad)
    if step < 1 or n == 0 or norm == 0 or rms == 0:
        return out, carried
    index = _sample(n, param.device)
    g, m, v, p = (t.detach().reshape(-1).float() if index is None else t.detach().reshape(-1)[index].float()
                  for t in (grad, exp_avg, exp_avg_sq, param))
    m_hat, v_hat = m / (1 - betas[0] ** step), v / (1 - betas[1] ** step)
    deltas = _grid(m.dtype, m.device) * rms
    carried = torch.zeros(len(g), len(GRID), dtype=torch.float32, device=g.device) if carried is None else carried
    reached = (g != 0) & (m_hat.abs() < deltas[-1])  # flip-prone at some level
    m_hat, v_hat = m_hat[reached, None], v_hat[reached, None]
    base = _update(m_hat, v_hat, lr, eps)
    move = torch.maximum(*(_moved(m_hat, v_hat, base, d, lr, eps) for d in (deltas[None, :], -deltas[None, :])))
    prone = m_hat.abs() < deltas[None, :]  # [element, level]
    carried[reached] += move.mul_(move).mul_(prone)  # move² where prone, in move's own buffer
    out += displacement_effect(p[:, None].double(), carried.double(), norm).sum(0)
    return out * (n / SAMPLED if index is not None else 1.0), carried


def displacement_effect(p: torch.Tensor, d2: torch.Tensor, norm: float) -> torch.Tensor:
    """The square of how far a displacement of variance `d2` of each element, either sign, moves the tensor's norm
    (‖p‖ = `norm`): the mean over the two signs of ((p ± d)² − p²)² / (2‖p‖)², d²(p² + d²/4) / ‖p‖². Not p · d alone:
    a zero-initialised bias's first update flipped moves its norm by nothing then and by 2 lr |p| / ‖p‖ once p has
    moved on (the flip stays in the parameter; the norm's reading of it grows with the element)."""
    out = d2 / 4  # in one buffer of its own: the same bits as d2 * (p * p + d2 / 4) / (norm * norm)
    out += p * p
    out *= d2
    return out.div_(norm * norm)


def step_moves(grad, exp_avg, exp_avg_sq, step: int, lr: float, betas, eps: float, delta: float) -> float:
    """Σ_i move_i² over one step's flip-prone elements (|m_i| < (1 − β1) δ; step count `step` after it, moments after
    it) when its gradient `grad` moves by `delta` on every element it reached: the teacher-forced check's (module
    docstring)."""
    g, m, v = (t.detach().reshape(-1).double() for t in (grad, exp_avg, exp_avg_sq))
    prone = (g != 0) & (m.abs() < (1 - betas[0]) * delta)
    g, m, v = g[prone], m[prone], v[prone]
    bc1, bc2 = 1 - betas[0] ** step, 1 - betas[1] ** step
    base = _update(m / bc1, v / bc2, lr, eps)
    move = torch.maximum(*((_update((m + (1 - betas[0]) * s * delta) / bc1,
                                    (v + (1 - betas[1]) * ((g + s * delta) ** 2 - g * g)) / bc2, lr, eps) - base).abs()
                           for s in (1.0, -1.0)))
    return float((move * move).sum())


def rounded(row) -> list[float]:
    """A table's row as the record keeps it (DIGITS significant digits)."""
    return [float(f"{float(x):.{DIGITS}g}") for x in row]
