#!/usr/bin/env python
"""The measurements behind the optimizer's own noise in the update's bound (docs/tensors.md#the-optimizers-own-noise;
parity/training/update_noise.py, parity/comparing/update_bound.py): in one process, qwen2-tiny in bf16 at the
calibration study's setting (seq 128, 4 rows, lr 1e-3 with 5 warm-up steps, clipped at 0.8), runs trained in lockstep
from one state on one batch each step — A, the baseline (the batch whole); B, a clean run (2 micro-batches); C and D,
its references (the loss × 4/3 in 4 micro-batches; 4 micro-batches) — and the seeded bugs beside B (weight decay 0.01,
AdamW's β2 0.99, the step counter advanced twice, the lr × 1.05, clipping skipped). It prints:

- how a tensor's element noise maps to its norm's deviation: per tensor and step, the rms over the elements of C's and
  D's gradient less A's, in A's rms gradients (x), over the references' gradient envelope taken as a share of the
  tensor's own norm (ELEMENT_NOISE's measurement); and whether it is uniform within the tensor (the rms difference of
  the elements of the smallest quarter of |g| over the largest quarter's, against the same ratio of |g|);
- how far B's parameter norms part from A's in units of the model's spread σ (variants: this step's gradient alone or
  carried by the moments; every element or the flip-prone ones; at the element noise measured, x, or mapped from the
  envelope, ELEMENT_NOISE × it), and σ's size against the references' bound (NOISE_K × their envelope);
- each bug's first step outside and its ratio under the references' bound alone and with OPTIMIZER_NOISE_K × σ
  (flip-prone, carried, mapped) for each ELEMENT_NOISE × OPTIMIZER_NOISE_K asked.

    python tools/optimizer_noise_study.py --seeds 64,65,66 --steps 40 --out OUT    # about 6 minutes a seed, 1 core"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import torch

RUNS = {"A": dict(split=1), "B": dict(split=2), "C": dict(split=4, perturb=4 / 3), "D": dict(split=4),
        "wd 0.01": dict(split=2, wd=0.01), "beta2 0.99": dict(split=2, beta2=0.99),
        "step counted twice": dict(split=2, twice=True), "lr x 1.05": dict(split=2, lr=1.05),
        "clipping skipped": dict(split=2, noclip=True)}
BUGS = [k for k in RUNS if k not in "ABCD"]
LR, WARMUP, CLIP, SEQ, ROWS, BETAS, EPS = 1e-3, 5, 0.8, 128, 4, (0.9, 0.999), 1e-8


def norm_change(p: torch.Tensor, move: torch.Tensor, norm: float) -> torch.Tensor:
    """|How far the tensor's norm moves| where each element's update moves by `move` (the parameter p − move), exact to
    the second order: |(p − move)² − p²| / 2‖p‖. Not p̂ · move alone: a zero-initialised bias's first update flipped
    (p = u, move = 2u) leaves its norm where it was. This study's per-step reading; the product carries each flip
    instead (update_noise.displacement_effect)."""
    return (move * (move - 2 * p)).abs() / (2 * norm)  # (p − move)² − p², without its cancellation


def tables(g, m, v, step, p, lr) -> dict[str, list[float]]:
    """A's table of one tensor in each variant: "carried" / "this step" × "all" / "flip-prone" elements, the product's
    own (carried, flip-prone) from update_noise.tensor_table."""
    from parity.training.update_noise import GRID, noise_scale, tensor_table

    g, m, v, p = (t.double().flatten() for t in (g, m, v, p))
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    norm, rms, reached = float(p.norm()), noise_scale(g), g != 0
    u = lambda mm, vv: lr * (mm / bc1) / (vv.clamp_min(0).sqrt() / bc2 ** 0.5 + EPS)  # noqa: E731
    out = {}
    for carried in (True, False):
        for prone in (False, True):
            row = []
            for x in GRID:
                d = x * rms * reached
                changes = []
                for s in (1.0, -1.0):
                    if carried:
                        mm, vv = m + s * d * bc1, v + (2 * s * d * (m / bc1) + d * d) * bc2
                    else:
                        mm, vv = m + (1 - BETAS[0]) * s * d, v + (1 - BETAS[1]) * ((g + s * d) ** 2 - g * g)
                    changes.append(norm_change(p, u(mm, vv) - u(m, v), norm))
                change = torch.maximum(*changes)
                if prone:
                    limit = d if carried else (1 - BETAS[0]) * d
                    change = torch.where((m / (bc1 if carried else 1)).abs() < limit, change, torch.zeros_like(change))
                row.append(float((change * change).sum()))
            out[f"{'carried' if carried else 'this step'}/{'flip-prone' if prone else 'all'}"] = row
    out["carried/flip-prone"] = tensor_table(g, m, v, step, p, lr, BETAS, EPS)[0].tolist()  # the product's own
    return out


def train(seed: int, steps: int) -> list[dict]:
    from parity.models.model import build_model, resolve_model_config
    from parity.training.data import SyntheticMarkov

    torch.set_num_threads(1)
    config = resolve_model_config("qwen2-tiny")
    data = SyntheticMarkov(config.vocab_size, SEQ + 1, 100000, seed)
    models, optimizers = {}, {}
    for k, r in RUNS.items():
        models[k] = build_model(config, seed).train()
        optimizers[k] = torch.optim.AdamW(models[k].parameters(), lr=LR, betas=(BETAS[0], r.get("beta2", BETAS[1])),
                                          eps=EPS, weight_decay=r.get("wd", 0.0))
    records = []
    for s in range(steps):
        lr = LR * min(1.0, (s + 1) / WARMUP)
        batch = torch.tensor(np.stack([data[s * ROWS + i] for i in range(ROWS)]))
        grads = {}
        for k, r in RUNS.items():
            model, split, perturb = models[k], r["split"], r.get("perturb", 1.0)
            for part in range(split):
                rows = slice(part * ROWS // split, (part + 1) * ROWS // split)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(input_ids=batch[rows, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[rows, 1:].flatten(),
                                                         reduction="sum") / batch[:, 1:].numel()
                (loss * perturb).backward()
            params = list(model.parameters())
            for p in params:
                p.grad.div_(perturb)
            torch.nn.utils.clip_grad_norm_(params, math.inf if r.get("noclip") else CLIP)
            grads[k] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            for group in optimizers[k].param_groups:
                group["lr"] = lr * r.get("lr", 1.0)
            if r.get("twice") and s >= 1:
                for state in optimizers[k].state.values():
                    state["step"] += 1
            optimizers[k].step()
            optimizers[k].zero_grad()
        row = {}
        named = {k: dict(models[k].named_parameters()) for k in RUNS}
        for n, p in named["A"].items():
            gA = grads["A"][n].flatten().double()
            state = optimizers["A"].state[p]
            order = torch.argsort(gA.abs())
            low, high = order[:len(order) // 4], order[-(len(order) // 4):]
            dB = grads["B"][n].flatten().double() - gA
            e = {"n": gA.numel(), "rms_g": float(gA.pow(2).mean().sqrt()),
                 "g": {k: float(grads[k][n].double().norm()) for k in RUNS},
                 "p": {k: float(named[k][n].detach().double().norm()) for k in RUNS},
                 "rms_d": {k: float((grads[k][n].flatten().double() - gA).pow(2).mean().sqrt()) for k in "CD"},
                 "quarters": [float(dB[low].pow(2).mean().sqrt() / dB[high].pow(2).mean().sqrt().clamp_min(1e-30)),
                              float(gA[low].pow(2).mean().sqrt() / gA[high].pow(2).mean().sqrt().clamp_min(1e-30))]
                 if len(low) else None,
                 "tables": tables(grads["A"][n], state["exp_avg"], state["exp_avg_sq"], int(state["step"]),
                                  p.detach(), lr)}
            row[n] = e
        records.append(row)
    return records


def envelope(raw: list[float], floor: float) -> list[float]:
    from parity.comparing.noise import held_envelope

    return held_envelope(raw, floor)


def analyse(records: list[dict], products: list[tuple[float, float]]) -> dict:
    from parity.comparing.tolerances import NOISE_K, TENSOR_FLOOR, TENSOR_NOISE_FLOOR
    from parity.comparing.update_bound import read

    steps, names = len(records), list(records[0])
    glob = {q: [math.sqrt(sum(records[s][n][q]["A"] ** 2 for n in names)) for s in range(steps)] for q in ("g", "p")}
    found = {"x_over_e": [], "quarters": [], "sigma": {}, "sigma_over_bound": {}, "bugs": {}}
    per = {}
    for n in names:
        rows = [records[s][n] for s in range(steps)]
        den = {q: [max(rows[s][q]["A"], TENSOR_FLOOR[ph] * glob[q][s]) for s in range(steps)]
               for q, ph in (("g", "gradient"), ("p", "update"))}
        dev = lambda k, q: [abs(rows[s][q][k] - rows[s][q]["A"]) / den[q][s] for s in range(steps)]  # noqa: E731
        genv = envelope([max(a, b) for a, b in zip(dev("C", "g"), dev("D", "g"))], TENSOR_NOISE_FLOOR["bf16"]["gradient"])
        uenv = envelope([max(a, b) for a, b in zip(dev("C", "p"), dev("D", "p"))], TENSOR_NOISE_FLOOR["bf16"]["update"])
        share = [genv[s] * den["g"][s] / rows[s]["g"]["A"] if rows[s]["g"]["A"] else math.inf for s in range(steps)]
        true = [max(rows[s]["rms_d"].values()) / rows[s]["rms_g"] if rows[s]["rms_g"] else 0.0 for s in range(steps)]
        found["x_over_e"] += [t / e for t, e in zip(true, share) if e and math.isfinite(e)]
        if rows[0]["quarters"]:
            found["quarters"].append(rows[-1]["quarters"])

        def sigma(variant: str, xs: list[float]) -> list[float]:
            total, out = 0.0, []
            for s in range(steps):
                total += read(rows[s]["tables"][variant], xs[s])
                out.append(math.sqrt(total) / den["p"][s])
            return out
        clean = dev("B", "p")
        for variant in rows[0]["tables"]:
            for how, xs in (("measured x", true), ("mapped", [5 * e for e in share])):
                sig = sigma(variant, xs)
                key = f"{variant}, {how}"
                found["sigma"].setdefault(key, []).append(max(c / x if x else 0.0 for c, x in zip(clean, sig)))
                found["sigma_over_bound"].setdefault(key, []).extend(x / (NOISE_K * u) for x, u in zip(sig, uenv))
        per[n] = {"bound": [NOISE_K * u for u in uenv], "share": share, "den": den["p"],
                  "dev": {k: dev(k, "p") for k in ["B", *BUGS]}, "rows": rows}
    for c, k in [(0.0, 0.0), *products]:
        for bug in ["B", *BUGS]:
            first = None
            for s in range(steps):
                worst = (0.0, "")
                for n in names:
                    rows = per[n]["rows"]
                    total = sum(read(rows[j]["tables"]["carried/flip-prone"], c * per[n]["share"][j])
                                for j in range(s + 1)) if k else 0.0
                    bound = max(per[n]["bound"][s], k * math.sqrt(total) / per[n]["den"][s])
                    worst = max(worst, (per[n]["dev"][bug][s] / bound, n))
                if worst[0] > 1:
                    first = (s, worst[1], round(worst[0], 3))
                    break
            found["bugs"].setdefault(bug, {})[f"{c:g} x {k:g}"] = first
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="64,65,66")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--products", default="5x3,3x5,10x3,20x3", help="ELEMENT_NOISE x OPTIMIZER_NOISE_K pairs")
    p.add_argument("--out", required=True, help="a folder: each seed's measurements (JSON), read again if there")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    products = [tuple(float(v) for v in pair.split("x")) for pair in args.products.split(",")]
    for seed in [int(s) for s in args.seeds.split(",")]:
        path = os.path.join(args.out, f"seed_{seed}.json")
        if not os.path.exists(path):
            with open(path, "w") as f:
                json.dump(train(seed, args.steps), f)
        with open(path) as f:
            found = analyse(json.load(f), products)
        q = np.quantile(found["x_over_e"], [0.5, 0.9, 0.99, 1.0])
        print(f"== seed {seed}: element noise ÷ the envelope's share: median {q[0]:.2f}, 90th percentile {q[1]:.2f}, "
              f"99th {q[2]:.2f}, largest {q[3]:.2f}")
        qs = np.array(found["quarters"])
        print(f"   smallest quarter ÷ largest quarter of |g|: differences {np.median(qs[:, 0]):.2f} (median), "
              f"gradients {np.median(qs[:, 1]):.3f}")
        for key, values in found["sigma"].items():
            over = found["sigma_over_bound"][key]
            print(f"   {key:30s}: the clean run's largest deviation ÷ σ {max(values):.2f} (median over tensors "
                  f"{np.median(values):.2f}); σ ÷ the references' bound median {np.median(over):.3f}, largest "
                  f"{max(over):.3f}")
        for bug, at in found["bugs"].items():
            print(f"   {bug:20s}: " + "; ".join(f"{pair}: {v}" for pair, v in at.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
