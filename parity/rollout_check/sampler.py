"""The sampler verdict (docs/sampler.md): the log-probability the sampler reported for each token it sampled, against
the trainer's model rescoring the same sequence at the same weights — log softmax(logits ÷ temperature) over the whole
vocabulary, in fp32, as TRL's GRPOTrainer computes π_old and the importance ratio (with the sampler's repetition,
frequency and presence penalties applied first where it had any: the distribution it sampled from). The field's
training–inference mismatch, judged by the noise of the trainer's own arithmetic rather than a fixed threshold:

- the noise: the same rescoring decoded one position at a time over the key-value cache, as a sampler computes it
  (other products and sums) and, where the sampler ran in another dtype, the trainer's model in that dtype; per token
  the largest of their gaps to the fp32 rescoring;
- the gap's distribution against the noise's (spread.py: its quantiles, its signed mean, its largest), over all the
  tokens and over each weight version's (a step's rows: a lag of one sync shows in its rows alone);
- where it FAILs, the cause, when one explains the gap within the same checks: log-probs taken before the temperature,
  renormalised over the top-k/top-p/min-p tokens kept (each gap −log of the kept mass), another weight version than
  the one declared — the whole model's, or one tensor's (a sync that left it behind) —, or the most likely token's
  log-prob instead of the sampled one's.
"""

from __future__ import annotations

import copy

import torch

from parity.precision import DTYPES
from parity.rollout_check import spread

PENALTIES = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}  # vLLM's, and their no-op
LAG_TENSORS = 64  # the tensors tried one by one for a sync that left one behind, the most moved first


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
             pick: str = "token", penalties: dict | None = None, starts: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [rows, L]: log softmax(logits ÷ temperature) at each position t ≥ 1 of the token at t (pick "token") or of
    the most likely token there ("argmax"); 0 at position 0 and on padding; `decode` as next_token_logits'; with
    `penalties` (PENALTIES' keys) applied to the logits first, each row's completion beginning at `starts`."""
    logits = next_token_logits(model, ids, real, decode)
    if penalties:
        logits = penalised(logits, ids, real, starts, penalties)
    logps = (logits / temperature).log_softmax(-1)
    chosen = ids[:, 1:, None] if pick == "token" else logps.argmax(-1, keepdim=True)
    picked = logps.gather(-1, chosen).squeeze(-1)
    return torch.cat([torch.zeros(len(ids), 1), picked], 1) * real


def penalised(logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor, starts: torch.Tensor,
              penalties: dict) -> torch.Tensor:
    """The logits [rows, L − 1, vocab] with vLLM's penalties (v1 Sampler, before the temperature) at each position
    predicting a completion token: the repetition penalty on every token of the prompt or of the completion so far
    (a positive logit divided by it, another multiplied), then the frequency penalty × each token's count in the
    completion so far and the presence penalty on each token in it, subtracted."""
    out = logits.clone()
    rows, vocab = len(ids), logits.shape[-1]
    seen = torch.zeros(rows, vocab, dtype=torch.bool)  # the prompt's tokens, then the completion's as they come
    counts = torch.zeros(rows, vocab)
    for t in range(ids.shape[1] - 1):  # position t predicts the token at t + 1
        token = ids[:, t].clamp(0, vocab - 1)
        present = real[:, t].bool()
        completion = present & (t >= starts)
        seen[present, token[present]] = True
        counts[completion, token[completion]] += 1
        scoring = (t + 1 >= starts) & real[:, t + 1].bool()
        if not scoring.any():
            continue
        at = out[scoring, t]
        factor = torch.where(seen[scoring], torch.tensor(float(penalties["repetition_penalty"])), torch.tensor(1.0))
        at = torch.where(at > 0, at / factor, at * factor)
        at = at - penalties["frequency_penalty"] * counts[scoring] \
            - penalties["presence_penalty"] * (counts[scoring] > 0)
        out[scoring, t] = at
    return out


def penalties_of(sampler: dict) -> dict | None:
    """The sampler's penalties (PENALTIES' keys), None where it had none."""
    found = {k: float(sampler.get(k, default)) for k, default in PENALTIES.items()}
    return None if found == PENALTIES else found


def completion_starts(completion_mask: torch.Tensor) -> torch.Tensor:
    """Each row's first completion position (its length where it has none)."""
    any_ = completion_mask.bool().any(-1)
    first = completion_mask.bool().int().argmax(-1)
    return torch.where(any_, first, torch.full_like(first, completion_mask.shape[1]))


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


def judge(rollouts, models: dict, sampler: dict) -> dict:
    """The sampler verdict of a rollout file: `models` maps a weight version (the trainer step of
    sampler_weights_step) to the trainer's model at it (fp32, eval); `sampler` is the file's sampler metadata."""
    t = rollouts.tensors
    ids, real = t["input_ids"], t.get("attention_mask", torch.ones_like(t["input_ids"]))
    judged = t["completion_mask"].bool() & torch.isfinite(t["sampler_logps"])
    versions = t["sampler_weights_step"]
    temperature = float(sampler["temperature"])
    own_dtype = DTYPES[sampler["dtype"]]
    shaping = {"penalties": penalties_of(sampler), "starts": completion_starts(t["completion_mask"])}

    def by_version(score, scorers=models, **kwargs) -> torch.Tensor:  # each weight version's rows by its model
        out = torch.zeros(ids.shape, dtype=torch.float32)
        for v in versions.unique().tolist():
            rows = versions == v
            given = {k: (w[rows] if k == "starts" else w) for k, w in kwargs.items()}
            out[rows] = score(scorers[v], ids[rows], real[rows], **given)
        return out

    trainer = by_version(logps_of, temperature=temperature, **shaping)
    noise = (by_version(logps_of, temperature=temperature, decode=True, **shaping) - trainer).abs()
    if own_dtype != torch.float32:
        low = {v: copy.deepcopy(m).to(own_dtype) for v, m in models.items()}
        noise = torch.maximum(noise, (by_version(logps_of, low, temperature=temperature, **shaping) - trainer).abs())
    noise = spread.floored(noise, trainer)
    sampled = t["sampler_logps"].float()
    gap = (sampled - trainer)[judged]
    groups = judged_groups(sampled - trainer, noise, judged, versions)
    pooled = groups["all"]
    worst = {c: max((g["margins"][c] for g in groups.values() if g["margins"][c] is not None), default=None)
             for c in spread.CHECKS}
    failing = max(((name, c) for name, g in groups.items() for c in spread.CHECKS
                   if g["margins"][c] is not None and g["margins"][c] > 1),
                  key=lambda f: groups[f[0]]["margins"][f[1]], default=None)  # the check furthest outside
    outside = ((sampled - trainer).abs() > pooled["bounds"]["max_abs"]) & judged
    first = None
    if bool(outside.any()):
        row, position = (int(i) for i in outside.nonzero()[0])
        first = {"row": row, "position": position, "token": int(ids[row, position]),
                 "sampler": float(sampled[row, position]), "trainer": float(trainer[row, position])}
    sums = ((sampled - trainer) * judged).sum(-1)
    result = {"verdict": "FAIL" if failing else "PASS", "tokens": int(judged.sum()),
              "statistics": {**pooled["statistics"], "mean_abs": float(gap.abs().mean())},
              "bounds": pooled["bounds"], "ranks": pooled["ranks"], "margins": worst,
              "margin": max((m for m in worst.values() if m is not None), default=0.0),
              "groups": groups, "failed": failing and {"group": failing[0], "check": failing[1]},
              "signed_mean": float(gap.mean()),
              "quantiles": {q: float(gap.abs().quantile(q / 100)) for q in (50, 90, 99)},
              "noise_quantiles": {q: float(noise[judged].quantile(q / 100)) for q in (50, 90, 99)},
              "worst_sequence": {"row": int(sums.abs().argmax()), "sum": float(sums[sums.abs().argmax()])},
              "sequence_sums": [float(s) for s in sums],
              "first_outside": first, "cause": None}
    if failing:
        result["cause"] = cause(rollouts, models, sampler, sampled, trainer, noise, judged, by_version, shaping)
    return result


def judged_groups(gap: torch.Tensor, noise: torch.Tensor, judged: torch.Tensor, versions: torch.Tensor) -> dict:
    """spread.checks of every judged token ("all") and, where the rows come from more than one weight version, of
    each version's ("step N"), the quantile checks sharing spread.ALPHA."""
    masks = {"all": judged}
    if len(versions.unique()) > 1:
        masks.update({f"step {v}": judged & (versions == v)[:, None] for v in versions.unique().tolist()})
    masks = {name: m for name, m in masks.items() if m.any()}
    alpha = spread.ALPHA / (len(masks) * len(spread.QUANTILES))
    return {name: spread.checks(gap[m], noise[m], alpha) for name, m in masks.items()}


def cause(rollouts, models, sampler, sampled, trainer, noise, judged, by_version, shaping) -> str | None:
    """What explains the gap to the `trainer`'s rescoring within the same checks, in words; None where nothing the
    harness knows does."""
    t = rollouts.tensors
    ids, real, versions = t["input_ids"], t.get("attention_mask", torch.ones_like(t["input_ids"])), \
        t["sampler_weights_step"]
    temperature = float(sampler["temperature"])

    def explains(rescored, where=judged) -> bool:
        return spread.within((sampled - rescored)[where], noise[where])

    if temperature != 1.0 and explains(by_version(logps_of, temperature=1.0)):
        return (f"the sampler's log-probs are taken before the temperature ({temperature:g}): the raw logits' "
                f"log-softmax (vLLM: logprobs_mode='processed_logprobs' gives them after it)")
    if shaping["penalties"] and explains(by_version(logps_of, temperature=temperature)):
        named = ", ".join(f"{k} {v:g}" for k, v in shaping["penalties"].items())
        return f"the sampler's log-probs are taken without its penalties ({named}), which it sampled with"
    if sampler.get("top_k") or sampler.get("top_p", 1.0) < 1.0 or sampler.get("min_p"):
        mass = by_version(lambda m, i, r: kept_mass(m, i, r, sampler))
        if explains(trainer - mass.log()):
            return (f"the sampler renormalised its log-probs over the tokens top-k/top-p/min-p kept: each gap is −log "
                    f"of the kept mass (mean {float(-mass.log()[judged].mean()):.4f}); the trainer's ratio divides by "
                    f"the whole vocabulary's")
    apart = []  # each version whose rows fail, and how to rescore them at a model
    for declared in versions.unique().tolist():
        mine = versions == declared
        if not explains(trainer, mine[:, None] & judged):
            apart.append((declared, mine, lambda m, mine=mine: logps_of(
                m, ids[mine], real[mine], temperature, penalties=shaping["penalties"], starts=shaping["starts"][mine])))
    for declared, mine, score in apart:  # a version's rows that another version's weights explain
        for other in sorted(set(models) - {declared}, key=lambda v: (v > declared, abs(v - declared))):
            if spread.within((sampled[mine] - score(models[other]))[judged[mine]], noise[mine][judged[mine]]):
                return (f"the rows declared sampled at step {declared}'s weights were sampled at step {other}'s: a "
                        f"weight sync that did not happen")
    if explains(by_version(logps_of, temperature=temperature, pick="argmax", **shaping)):
        return "the sampler reported the most likely token's log-prob, not the sampled token's"
    for declared, mine, score in apart[:1]:  # the first version apart: one tensor the last sync left behind
        left = tensor_left_behind(models, declared, score, sampled[mine], noise[mine], judged[mine])
        if left:
            return (f"the rows declared sampled at step {declared}'s weights were sampled with {left[0]} at step "
                    f"{left[1]}'s: a weight sync that left it behind")
    if sampler.get("shaped_by"):
        return (f"none the harness computes: the sampler also applied {', '.join(sampler['shaped_by'])}, which the "
                f"rescoring does not")
    return None


@torch.no_grad()
def tensor_left_behind(models: dict, declared: int, score, sampled, noise, judged) -> tuple[str, int] | None:
    """(a tensor's name, the version before) such that the declared version's model with that one tensor at the
    version before's (the nearest earlier one held) explains the rows' gap: its LAG_TENSORS tensors that moved most
    (relative to their size) tried one at a time; None where none does."""
    model = models[declared]
    mine = dict(model.named_parameters())
    for other in sorted((v for v in models if v < declared), reverse=True)[:1]:
        theirs = dict(models[other].named_parameters())
        moved = {n: float((theirs[n] - p).norm() / p.norm().clamp_min(1e-30)) for n, p in mine.items() if n in theirs}
        for name in sorted((n for n, m in moved.items() if m > 0), key=lambda n: -moved[n])[:LAG_TENSORS]:
            held = mine[name].data
            mine[name].data = theirs[name].data
            try:
                rescored = score(model)
            finally:
                mine[name].data = held
            if spread.within((sampled - rescored)[judged], noise[judged]):
                return name, other
    return None
