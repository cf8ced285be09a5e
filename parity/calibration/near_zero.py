"""Initial weights with near-zero gradient elements: the clean run a bf16 verdict called FAIL by one AdamW sign flip,
rebuilt on CPU (issue 81; docs/tensors.md#the-optimizers-own-noise). Its CUDA records are gone; what it read — the
update of a 64-element norm weight at 1.004 × its bound, one element's flip the references did not draw — is AdamW's
update of an element whose gradient lies within its rounding: lr × a sign each run's arithmetic draws.

Here the chosen elements of one norm weight are set, in the model of the run's seed, to the root of their gradient at
step 0 (the run's first global batch, in fp32, a few Newton steps per element): at step 0 their gradient is rounding
alone, so each run's first update moves each of them by ±lr, and the parameters keep it. A noise reference flips a
few of them, or none."""

from __future__ import annotations

import torch

from parity.models.model import build_model, model_config_from_dict, save_init_weights
from parity.objectives.causal_lm import loss_sum

REACH = (0.02, 0.05, 0.1, 0.2, 0.4)  # how far from its initial value an element's root is looked for, both ways
PROBE = 0.01  # the step of the elements' slopes (finite differences, all elements at once)
BISECTIONS, NEWTON = 16, 3  # per element alone, then Newton steps on them together


def near_zero_weights(cfg, batches, tensor: str, count: int, path: str) -> tuple[list[int], float]:
    """Write the initial weights of `cfg`'s model (its seed) to `path` with `count` elements of the parameter `tensor`
    at the root of their step-0 gradient on `batches(0)` (a resolved run's, whole: the global batch) — those whose
    root lies nearest (|gradient ÷ slope|), each found by bisection within REACH of its value; return (the elements,
    flat indices; the largest |gradient| left on them over the tensor's rms gradient)."""
    model = build_model(model_config_from_dict(cfg.model_config), cfg.seed).float()
    param = dict(model.named_parameters())[tensor]
    flat, batch = param.data.view(-1), batches(0)

    def gradient() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        (loss_sum(model(input_ids=batch.input_ids).logits, batch.labels) / batch.loss_tokens).backward()
        return param.grad.detach().flatten().clone()

    def at(i: int, value: float) -> float:
        flat[i] = value
        return float(gradient()[i])

    g = gradient()
    flat += PROBE
    slope = (gradient() - g) / PROBE
    flat -= PROBE
    nearest = [int(i) for i in torch.argsort((g / slope).abs())]
    elements = []
    for i in nearest:
        w0, g0 = float(flat[i]), float(g[i])
        other = next((w0 + d for r in REACH for d in (r, -r) if at(i, w0 + d) * g0 <= 0), None)
        flat[i] = w0
        if other is not None:
            elements.append((i, w0, other))
        if len(elements) == count:
            break
    for i, a, b in elements:
        ga = at(i, a)
        for _ in range(BISECTIONS):
            mid = (a + b) / 2
            if (gm := at(i, mid)) * ga > 0:
                a, ga = mid, gm
            else:
                b = mid
        flat[i] = a
    chosen = torch.tensor([i for i, _, _ in elements])
    for _ in range(NEWTON):  # together: each element's gradient moves with the others'
        g = gradient()[chosen].double()
        jacobian = torch.empty(len(chosen), len(chosen), dtype=torch.float64)
        for k, i in enumerate(chosen):
            flat[i] += PROBE / 10
            jacobian[:, k] = (gradient()[chosen].double() - g) / (PROBE / 10)
            flat[i] -= PROBE / 10
        flat[chosen] -= torch.linalg.solve(jacobian, g).float()
    g = gradient()
    save_init_weights(model, path)
    return chosen.tolist(), float(g[chosen].abs().max() / g.pow(2).mean().sqrt())
