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

`tensor_tables` (the baseline, every step, a tensor's row): per level x of GRID, Σ_i c_i², c_i how far element i's
displacement moves the tensor's norm now — the displacement's variance the sum of the moves² of the steps where the
element was flip-prone (|m̂_i| < δ: the update's sign is the noise's), carried from step to step (a flip stays in the
parameter), its effect on the norm read at the element's value now, either sign (displacement_effect). Read at the step
of the move alone, a zero-initialised bias's first update flipped moves the norm by nothing, and one step later by 2 lr
|p| / ‖p‖ (a clean TRL GRPO run's q_proj bias read 0.79 of its bound on one such flip, docs/false_alarms.md): the row is
each step's whole variance, not its increment. The other elements' moves are linear in the noise, a sum of many small
ones the references sample well (their bound, NOISE_K × what they drew, lies 6 × above those moves' spread at the
median); counted here too they would lift the bound where the seeded bugs are caught (docs/tensors.md). The move carries
over steps as the moments do: the noise δ on every gradient the moments hold shifts the bias-corrected first moment by δ
and the second's root by up to δ (√v̂' = √(v̂ ± 2δ m̂ + δ²)), and the move is the formula's |u(m̂ ± δ, v̂') − u(m̂, v̂)|
at its larger sign, u = lr · m̂ / (√v̂ + ε), capped by nothing but the formula. (A move of this step's gradient alone,
(1 − β1) δ on m, read the clean runs' deviations at up to 7.5 × its scale: the moments keep each step's noise.)

`step_moves` (the teacher-forced check, one step from one state): the same at one step, this step's gradient alone
moved (m' = m + (1 − β1) δ, v' = v + (1 − β2)((g + δ)² − g²)), its moves' sum of squares, unprojected: the check
measures ‖p − p_ref‖.

A tensor of more than SAMPLED elements is measured on SAMPLED of them, fixed (drawn once per size: _sample), its sum
scaled by the ratio (a 0.5 B model's step would otherwise take seconds on a CPU); small tensors, where one element's
flip shows, whole.
"""

from __future__ import annotations

import functools
import itertools

import torch

# the noise levels x, in rms gradients: 1e-8 … 0.32 in half decades — bf16's element noise is 0.3–10 % of a tensor's
# rms gradient, fp32's ~1e-7 (docs/tensors.md); a flip-prone table rises as x³ (elements ∝ x, each move² ∝ x²), so
# half decades (a factor 5.6 between levels) keep its reading within its own size
GRID = tuple(10 ** (e / 2) for e in range(-16, 0))
SAMPLED = 1 << 14
# elements measured in one pass of tensor_tables: on a CPU a pass's [element, level] buffers stay in its caches (2 MB of
# float64; passes of 2^18 elements made qwen2-tiny's tables 1.9–2.2 × as slow on this AMD EPYC); on a GPU a 0.5 B model's
# 290 tensors in 19 passes, each some 100 MB of buffers
CHUNK = {"cpu": 1 << 14}
CHUNK_ELSEWHERE = 1 << 18
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


def tensor_tables(entries, lr: float, betas, eps: float) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each entry's (row, what it carries to the next step); an entry is one tensor of one AdamW param group (`lr`,
    `betas`, `eps`) on one device (a rank's): (grad, exp_avg, exp_avg_sq, step, param, carried), its state after the
    step.

    The row: per x of GRID, Σ_i effect_i² (float64, on the tensor's device) — how far each element's displacement by
    the flips it was prone to so far (this step's and the earlier ones', `carried`) moves the tensor's norm now
    (displacement_effect); zeros before AdamW's first step or for a tensor of norm 0. What it carries: per element and
    level, Σ move² over the steps it was flip-prone (float32, [element, level], the sampled elements'). Every level at
    once, over the elements flip-prone at the highest (in fp32: a flip's move is the size of the update itself).

    All the tensors at once, up to CHUNK's elements measured a pass: each tensor's own element-wise arithmetic as if it
    were alone, the same bits, in a few dozen operations a pass rather than per tensor, and one host sync for every
    tensor's norms (a tensor's table had been 94 operations and 10 host syncs, each one a GPU's stall: tensors.md)."""
    out: list = [None] * len(entries)
    norms = torch.stack([x for grad, _, _, _, param, _ in entries for x in (
        torch.linalg.vector_norm(param.detach().double()), torch.linalg.vector_norm(grad.detach().double()),
        torch.count_nonzero(grad.detach()).double())]).tolist() if entries else []  # the one host sync
    passes: dict[int, list] = {}  # step → [(position, norm, rms)]: a pass shares its bias corrections
    for k, (grad, _, _, step, param, carried) in enumerate(entries):
        norm, grad_norm, active = norms[3 * k: 3 * k + 3]
        # one unit of element noise: the rms of the gradient's elements that are not exactly 0 (an embedding's rows no
        # token reached are 0 in every arithmetic: no noise there, as the measurement says, docs/tensors.md)
        rms = grad_norm / int(active) ** 0.5 if active else 0.0
        if step < 1 or param.numel() == 0 or norm == 0 or rms == 0:
            out[k] = torch.zeros(len(GRID), dtype=torch.float64, device=param.device), carried
        else:
            passes.setdefault(step, []).append((k, norm, rms))
    most = CHUNK.get(entries[0][4].device.type, CHUNK_ELSEWHERE) if entries else 0
    for step, measured in passes.items():
        chunk, size = [], 0
        for item in measured:
            n = min(entries[item[0]][4].numel(), SAMPLED)
            if chunk and size + n > most:
                _tables_of(entries, chunk, step, lr, betas, eps, out)
                chunk, size = [], 0
            chunk.append(item)
            size += n
        _tables_of(entries, chunk, step, lr, betas, eps, out)
    return out


def _tables_of(entries, measured, step: int, lr: float, betas, eps: float, out: list) -> None:
    """tensor_tables of `measured` ([(position in entries, norm, rms)], one step count), into `out` at their
    positions: their sampled elements in one buffer, each element with its own tensor's noise levels and norm."""
    device = entries[measured[0][0]][4].device
    samples = [_sample(entries[k][4].numel(), device) for k, _, _ in measured]
    sizes = [entries[k][4].numel() if index is None else SAMPLED for (k, _, _), index in zip(measured, samples)]

    def flat(j: int) -> torch.Tensor:  # grad, exp_avg, exp_avg_sq or param of every tensor, its sample, float32
        parts = [t if index is None else t[index]
                 for t, index in zip((entries[k][j].detach().reshape(-1) for k, _, _ in measured), samples)]
        return (torch.cat(parts) if len(parts) > 1 else parts[0]).float()

    g, m, v, p = flat(0), flat(1), flat(2), flat(4)
    m_hat, v_hat = m / (1 - betas[0] ** step), v / (1 - betas[1] ** step)
    grid = _grid(m.dtype, device)
    deltas = torch.stack([grid * rms for _, _, rms in measured])  # [tensor, level]
    # each element's own tensor's levels (one tensor: its row, broadcast)
    owner = torch.repeat_interleave(torch.arange(len(sizes), device=device),
                                    torch.tensor(sizes, device=device)) if len(sizes) > 1 else None
    carried = _joined([entries[k][5] for k, _, _ in measured], sizes, device)
    reached = (g != 0) & (m_hat.abs() < (deltas[0, -1] if owner is None else deltas[owner, -1]))  # prone at some level
    m_hat, v_hat, d = m_hat[reached, None], v_hat[reached, None], deltas[0] if owner is None else deltas[owner[reached]]
    base = _update(m_hat, v_hat, lr, eps)
    move = torch.maximum(_moved(m_hat, v_hat, base, d, lr, eps), _moved(m_hat, v_hat, base, -d, lr, eps))
    carried[reached] += move.mul_(move).mul_(m_hat.abs() < d)  # move² where prone ([element, level])
    effect = displacement_effect(p[:, None].double(), carried.double())
    for (k, norm, _), index, own, kept in zip(measured, samples, effect.split(sizes), carried.split(sizes)):
        scale = entries[k][4].numel() / SAMPLED if index is not None else 1.0
        out[k] = own.div_(norm * norm).sum(0) * scale, kept


def _joined(parts: list, sizes: list[int], device) -> torch.Tensor:
    """The pass's carried rows in one [element, level] buffer: the one they are already consecutive views of, whole
    (the last step's pass over the same tensors), else a new one (zeros where a tensor carries nothing yet)."""
    base = parts[0]._base if parts[0] is not None and parts[0]._base is not None else parts[0]
    starts = itertools.accumulate([0, *sizes[:-1]])
    if base is not None and base.shape[0] == sum(sizes) and all(
            c is not None and (c is base or c._base is base)
            and c.storage_offset() == base.storage_offset() + r * len(GRID) for c, r in zip(parts, starts)):
        return base
    return torch.cat([c if c is not None else torch.zeros(n, len(GRID), dtype=torch.float32, device=device)
                      for c, n in zip(parts, sizes)])


def displacement_effect(p: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
    """The square of how far a displacement of variance `d2` of each element, either sign, moves the tensor's norm,
    times ‖p‖² (divide by it): the mean over the two signs of ((p ± d)² − p²)² / (2‖p‖)², d²(p² + d²/4) / ‖p‖². Not
    p · d alone: a zero-initialised bias's first update flipped moves its norm by nothing then and by 2 lr |p| / ‖p‖
    once p has moved on (the flip stays in the parameter; the norm's reading of it grows with the element)."""
    out = d2 * 0.25  # in one buffer of its own: the same bits as d2 * (p * p + d2 / 4), then ÷ ‖p‖² in place
    out += p * p
    return out.mul_(d2)


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
