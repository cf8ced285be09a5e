"""The harness's own sampler, an engine on the sampler seam (parity/frameworks/sampling.py, docs/sampler.md):
transformers' `generate` on the model at the run's initial weights, in the dtype asked (fp32: the model itself; bf16:
a copy of it), its log-probs its scores after the logits processors (`processed`: the penalty, temperature and
truncation, renormalised over the kept tokens) or its raw logits' (`raw`). make_rollouts.py's default --sampler."""

from __future__ import annotations

import copy

import torch

from parity.frameworks.sampling import Engine, Session


def sample_group(model, prompt: torch.Tensor, count: int, s, seed: int) -> list[tuple]:
    """`count` completions of `prompt`, each (tokens, truncated, the sampler's log-prob of each token): sampled at the
    Sampling `s`'s temperature with its top_k/top_p/min_p (its repetition_penalty before them), cut after its first
    stop token (truncated where none came within max_tokens)."""
    stops = list(s.stops)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt[None].repeat(count, 1), do_sample=True, temperature=s.temperature,
                             top_k=s.top_k, top_p=s.top_p, min_p=s.min_p or None,
                             repetition_penalty=s.repetition_penalty,
                             max_new_tokens=s.max_tokens, eos_token_id=stops, pad_token_id=stops[0],
                             attention_mask=torch.ones(count, len(prompt), dtype=torch.long),
                             return_dict_in_generate=True, output_scores=True, output_logits=True)
    steps = out.scores if s.logprob_mode == "processed" else out.logits
    tokens = out.sequences[:, len(prompt):]
    logps = torch.stack([step.float().log_softmax(-1).gather(-1, tokens[:, i, None]).squeeze(-1)
                         for i, step in enumerate(steps)], 1)
    completions = []
    for row, row_logps in zip(tokens, logps):
        hits = [i for i, t in enumerate(row.tolist()) if t in stops]
        end = hits[0] + 1 if hits else len(row)
        completions.append((row[:end], not hits, row_logps[:end]))
    return completions


class GenerateEngine(Engine):
    name, describe = "transformers", "transformers' generate"

    def version(self) -> str:
        import transformers

        return transformers.__version__

    def start(self, model, config, s) -> Session:
        sampler = model if s.dtype == "fp32" else copy.deepcopy(model).to(torch.bfloat16)
        return Session(self, sampler, s, self.version(),
                       lambda prompt, count, seed: sample_group(sampler, prompt, count, s, seed))

    def reload(self, model, weights) -> None:
        """Into the sampling model's tensors in place, in its dtype."""
        state = model.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                state[name].copy_(tensor)


ENGINE = GenerateEngine()
