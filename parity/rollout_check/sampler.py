"""The sampler verdict (docs/sampler.md): the log-probability the sampler reported for each token it sampled, against
the trainer's model rescoring the same sequence at the same weights — log softmax(logits ÷ temperature) over the whole
vocabulary, in fp32, as TRL's GRPOTrainer computes π_old and the importance ratio. The field's training–inference
mismatch, judged by the noise of the trainer's own arithmetic rather than a fixed threshold:

- the noise: the same rescoring decoded one position at a time over the key-value cache, as a sampler computes it
  (other products and sums) and, where the sampler ran in another dtype, the trainer's model in that dtype; per token
  the largest of their gaps to the fp32 rescoring;
- three checks, each within NOISE_K × the noise's same statistic (at least NOISE_K × fp32's rounding of the log-probs):
  the signed mean of sampler − trainer (a systematic offset), its mean |·| and its largest |·|;
- where it FAILs, the cause, when one explains the gap within the same bounds: log-probs taken before the temperature,
  renormalised over the top-k/top-p/min-p tokens kept (each gap −log of the kept mass), another weight version than
  the one declared, or the most likely token's log-prob instead of the sampled one's.
"""

from __future__ import annotations

import copy

import torch

from parity.comparing.tolerances import NOISE_K
from parity.precision import DTYPES

CHECKS = ("signed_mean", "mean_abs", "max_abs")


def next_token_logits(model, ids: torch.Tensor, real: torch.Tensor, decode: bool = False) -> torch.Tensor:
    """fp32 [rows, L − 1, vocab]: the logits at each position t < L − 1 (predicting the token at t + 1), position ids
    counted over the real tokens. `decode`: the rows scored one position at a time over the model's key-value cache,
    as a sampler decodes them (other products and sums than one forward of the whole rows)."""
    positions = (real.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        if not decode:
            return model(input_ids=ids, attention_mask=real, position_ids=positions).logits.float()[:, :-1]
        steps, cache = [], None
        for t in range(ids.shape[1] - 1):
            out = model(input_ids=ids[:, t:t + 1], attention_mask=real[:, :t + 1], position_ids=positions[:, t:t + 1],
                        past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1:].float())
        return torch.cat(steps, 1)


def logps_of(model, ids: torch.Tensor, real: torch.Tensor, temperature: float, decode: bool = False,
             pick: str = "token") -> torch.Tensor:
    """fp32 [rows, L]: log softmax(logits ÷ temperature) at each position t ≥ 1 of the token at t (pick "token") or of
    the most likely token there ("argmax"); 0 at position 0 and on padding; `decode` as next_token_logits'."""
    logps = (next_token_logits(model, ids, real, decode) / temperature).log_softmax(-1)
    chosen = ids[:, 1:, None] if pick == "token" else logps.argmax(-1, keepdim=True)
    picked = logps.gather(-1, chosen).squeeze(-1)
    return torch.cat([torch.zeros(len(ids), 1), picked], 1) * real


def kept_mass(model, ids: torch.Tensor, real: torch.Tensor, sampler: dict) -> torch.Tensor:
    """fp32 [rows, L]: the probability mass (at the sampler's temperature) of the tokens its top-k, top-p and min-p
    keep, at the position of the token each distribution sampled; 1 where none truncates."""
    probs = (next_token_logits(model, ids, real) / sampler["temperature"]).softmax(-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    ordered, order = probs.sort(-1, descending=True)
    if sampler.get("top_k"):
        ranks = torch.arange(probs.shape[-1]).expand_as(probs)
        keep &= torch.zeros_like(keep).scatter(-1, order, ranks < sampler["top_k"])
    if sampler.get("top_p", 1.0) < 1.0:
        before = ordered.cumsum(-1) - ordered  # the mass of the tokens ranked above: kept while it is below top_p
        keep &= torch.zeros_like(keep).scatter(-1, order, before < sampler["top_p"])
    if sampler.get("min_p"):
        keep &= probs >= sampler["min_p"] * ordered[..., :1]
    mass = (probs * keep).sum(-1)
    return torch.cat([torch.ones(len(ids), 1), mass], 1)


def statistics(gap: torch.Tensor) -> dict:
    """The checks' statistics of a per-token gap (over the judged tokens)."""
    return {"signed_mean": float(gap.mean().abs()), "mean_abs": float(gap.abs().mean()),
            "max_abs": float(gap.abs().max())}


def bounds_of(noise: torch.Tensor, trainer: torch.Tensor) -> dict:
    """Each check's bound: NOISE_K × the noise's statistic (the signed mean's: its mean |·|), at least NOISE_K × fp32's
    rounding of the log-probs themselves (a noise reference that happens to round alike measures 0)."""
    eps = torch.finfo(torch.float32).eps
    floors = {"mean_abs": float(trainer.abs().mean()) * eps, "max_abs": float(trainer.abs().max()) * eps}
    floors["signed_mean"] = floors["mean_abs"]
    measured = statistics(noise) | {"signed_mean": float(noise.abs().mean())}
    return {k: NOISE_K * max(measured[k], floors[k]) for k in CHECKS}


def within(gap: torch.Tensor, bounds: dict) -> bool:
    return all(v <= bounds[k] for k, v in statistics(gap).items())


def judge(rollouts, models: dict, sampler: dict) -> dict:
    """The sampler verdict of a rollout file: `models` maps a weight version (the trainer step of
    sampler_weights_step) to the trainer's model at it (fp32, eval); `sampler` is the file's sampler metadata."""
    t = rollouts.tensors
    ids, real = t["input_ids"], t.get("attention_mask", torch.ones_like(t["input_ids"]))
    judged = t["completion_mask"].bool() & torch.isfinite(t["sampler_logps"])
    versions = t["sampler_weights_step"]
    temperature = float(sampler["temperature"])
    own_dtype = DTYPES[sampler["dtype"]]

    def by_version(score, scorers=models, **kwargs) -> torch.Tensor:  # each weight version's rows by its model
        out = torch.zeros(ids.shape, dtype=torch.float32)
        for v in versions.unique().tolist():
            rows = versions == v
            out[rows] = score(scorers[v], ids[rows], real[rows], **kwargs)
        return out

    trainer = by_version(logps_of, temperature=temperature)
    noise = (by_version(logps_of, temperature=temperature, decode=True) - trainer).abs()
    if own_dtype != torch.float32:
        low = {v: copy.deepcopy(m).to(own_dtype) for v, m in models.items()}
        noise = torch.maximum(noise, (by_version(logps_of, low, temperature=temperature) - trainer).abs())
    sampled = t["sampler_logps"].float()
    gap = (sampled - trainer)[judged]
    bounds = bounds_of(noise[judged], trainer[judged])
    stats = statistics(gap)
    outside = ((sampled - trainer).abs() > bounds["max_abs"]) & judged
    first = None
    if bool(outside.any()):
        row, position = (int(i) for i in outside.nonzero()[0])
        first = {"row": row, "position": position, "token": int(ids[row, position]),
                 "sampler": float(sampled[row, position]), "trainer": float(trainer[row, position])}
    sums = ((sampled - trainer) * judged).sum(-1)
    result = {"verdict": "PASS" if all(stats[k] <= bounds[k] for k in CHECKS) else "FAIL", "tokens": int(judged.sum()),
              "statistics": stats, "bounds": bounds, "margins": {k: stats[k] / bounds[k] for k in CHECKS},
              "signed_mean": float(gap.mean()),
              "quantiles": {q: float(gap.abs().quantile(q / 100)) for q in (50, 90, 99)},
              "noise_quantiles": {q: float(noise[judged].quantile(q / 100)) for q in (50, 90, 99)},
              "worst_sequence": {"row": int(sums.abs().argmax()), "sum": float(sums[sums.abs().argmax()])},
              "sequence_sums": [float(s) for s in sums],
              "first_outside": first, "cause": None}
    if result["verdict"] == "FAIL":
        result["cause"] = cause(rollouts, models, sampler, sampled, trainer, judged, bounds, by_version)
    return result


def cause(rollouts, models, sampler, sampled, trainer, judged, bounds, by_version) -> str | None:
    """What explains the gap to the `trainer`'s rescoring within the same bounds, in words; None where nothing the
    harness knows does."""
    t = rollouts.tensors
    ids, real, versions = t["input_ids"], t.get("attention_mask", torch.ones_like(t["input_ids"])), \
        t["sampler_weights_step"]
    temperature = float(sampler["temperature"])
    if temperature != 1.0 and within((sampled - by_version(logps_of, temperature=1.0))[judged], bounds):
        return (f"the sampler's log-probs are taken before the temperature ({temperature:g}): the raw logits' "
                f"log-softmax (vLLM: logprobs_mode='processed_logprobs' gives them after it)")
    if sampler.get("top_k") or sampler.get("top_p", 1.0) < 1.0 or sampler.get("min_p"):
        mass = by_version(lambda m, i, r: kept_mass(m, i, r, sampler))
        if within((sampled - (trainer - mass.log()))[judged], bounds):
            return (f"the sampler renormalised its log-probs over the tokens top-k/top-p/min-p kept: each gap is −log "
                    f"of the kept mass (mean {float(-mass.log()[judged].mean()):.4f}); the trainer's ratio divides by "
                    f"the whole vocabulary's")
    for declared in versions.unique().tolist():  # a version's rows that another version's weights explain
        mine = versions == declared
        if within((sampled - trainer)[mine[:, None] & judged], bounds):
            continue
        for other in sorted(set(models) - {declared}):
            rescored = logps_of(models[other], ids[mine], real[mine], temperature)
            if within((sampled[mine] - rescored)[judged[mine]], bounds):
                return (f"the rows declared sampled at step {declared}'s weights were sampled at step {other}'s: a "
                        f"weight sync that did not happen")
    if within((sampled - by_version(logps_of, temperature=temperature, pick="argmax"))[judged], bounds):
        return "the sampler reported the most likely token's log-prob, not the sampled token's"
    return None
