"""make_rollouts.py: a rollout file from any model (parity/objectives/rollouts.py has the schema) — real generation with
the model from the run's initial weights, rewards from a simple verifiable function, GRPO groups (advantages per
group) or DPO pairs (the better-rewarded completion chosen), the generating model's per-token log-probs as π_old and
the reference's (the same weights, or a fresh model of --reference_seed) as π_ref. Every train_*.py then trains the
same steps with --objective NAME --rollouts FILE (docs/posttrain.md).

The whole file is sampled from the initial weights: a step after the first trains on completions an earlier policy
generated (π_old ≠ π), as a generation batch spread over several optimizer steps does (--steps_per_generation).
"""

from __future__ import annotations

import argparse

import torch

from parity import console, storage
from parity.commands.common import OneLineParser, run_command
from parity.errors import ConfigError
from parity.frameworks import engine, engines
from parity.frameworks.sampling import Sampling

REWARDS = {
    "even_fraction": "the fraction of the completion's tokens whose id is even",
    "stops_early": "1 − the completion's length ÷ --max_completion_length",
}


def stop_ids(text: str, vocab: int) -> list[int]:
    """--stop_token_ids: ids and ranges (start:stop:step), comma-separated."""
    ids = []
    for part in text.split(","):
        try:
            ids += list(range(*map(int, part.split(":")))) if ":" in part else [int(part)]
        except ValueError:
            raise ConfigError(f"--stop_token_ids {text}: give ids or ranges start:stop:step, comma-separated") from None
    if not ids or min(ids) < 0 or max(ids) >= vocab:
        raise ConfigError(f"--stop_token_ids {text}: ids must lie in the model's vocabulary [0, {vocab})")
    return sorted(set(ids))


def reward_of(name: str, completion: torch.Tensor, limit: int) -> float:
    if name == "even_fraction":
        return float((completion % 2 == 0).float().mean()) if len(completion) else 0.0
    return 1.0 - len(completion) / limit


def build_rows(sample, a, stops, vocab: int) -> tuple[list, list]:
    """Every step's rows: (prompt, completion, truncated, sampler log-probs, reward, group, generation) each, GRPO
    groups or DPO pairs; `sample(prompt, count, seed)` gives a group's completions."""
    rng = torch.Generator().manual_seed(a.seed)
    allowed = torch.tensor([t for t in range(vocab) if t not in set(stops)])
    steps, group = [], 0
    for step in range(a.steps):
        rows = []
        for _ in range(a.prompts_per_step):
            length = int(torch.randint(a.prompt_length // 2, a.prompt_length + 1, (1,), generator=rng))
            prompt = allowed[torch.randint(len(allowed), (max(length, 1),), generator=rng)]
            count = a.num_generations if a.family == "grpo" else 2
            sampled = sample(prompt, count, a.seed * 1_000_003 + group)
            rewards = [reward_of(a.reward, c, a.max_completion_length) for c, *_ in sampled]
            order = range(count) if a.family == "grpo" else sorted(range(2), key=lambda i: -rewards[i])
            rows += [(prompt, *sampled[i], rewards[i], group, step // a.steps_per_generation) for i in order]
            group += 1
        steps.append(rows)
    return steps, [len(r) for r in steps]


def tensors_of(model, reference, steps: list, a) -> dict:
    """The file's tensors (the schema) from the sampled rows."""
    from parity.rollout_check.advantages import recompute
    from parity.rollout_check.sampler import logps_of

    flat = [r for rows in steps for r in rows]
    width = max(len(p) + len(c) for p, c, *_ in flat)
    ids = torch.full((len(flat), width), 0, dtype=torch.long)
    real, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    sampled = torch.zeros(ids.shape, dtype=torch.float32)
    for i, (prompt, tokens, _, logps, *_) in enumerate(flat):
        n = len(prompt) + len(tokens)
        ids[i, :n] = torch.cat([prompt, tokens])
        real[i, :n] = 1
        completion[i, len(prompt):n] = 1
        sampled[i, len(prompt):n] = logps
    tensors = {"input_ids": ids, "attention_mask": real, "completion_mask": completion,
               "truncated": torch.tensor([int(r[2]) for r in flat]), "group": torch.tensor([r[5] for r in flat]),
               "generation": torch.tensor([r[6] for r in flat]),
               "step_rows": torch.tensor([len(rows) for rows in steps]),
               "ref_logps": logps_of(reference, ids, real, 1.0) * completion,
               "sampler_logps": sampled, "sampler_token_ids": torch.where(completion.bool(), ids, -1),
               "sampler_weights_step": torch.zeros(len(flat), dtype=torch.long)}  # every row from the initial weights
    if a.family == "grpo":
        tensors["rewards"] = torch.tensor([r[4] for r in flat], dtype=torch.float32)
        tensors["advantages"] = recompute(estimator(a), tensors["rewards"], tensors["group"],
                                          tensors["generation"]).float()
        tensors["old_logps"] = logps_of(model, ids, real, 1.0) * completion
    return tensors


def estimator(a: argparse.Namespace) -> str:
    """The advantage estimator the flags name: --advantage_estimator, else GRPO's --scale_rewards."""
    return a.advantage_estimator or a.scale_rewards


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(__doc__)
    p.add_argument("--output", required=True, help="the rollout file to write (.safetensors)")
    p.add_argument("--family", choices=("grpo", "dpo"), default="grpo",
                   help="grpo: groups of --num_generations completions per prompt; dpo: pairs")
    p.add_argument("--model_name", default="qwen2-tiny", help="a built-in model or a local model directory")
    p.add_argument("--num_layers", type=int, default=None)
    p.add_argument("--init_weights_path", required=True, help="the run's initial weights (written with "
                                                               "--save_init_weights)")
    p.add_argument("--save_init_weights", action="store_true", help="initialise fresh weights (--seed) and write them")
    p.add_argument("--reference_seed", type=int, default=None,
                   help="π_ref: a fresh model of this seed (default: the initial weights themselves)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts_per_step", type=int, default=2)
    p.add_argument("--num_generations", type=int, default=4, help="GRPO: completions per prompt")
    p.add_argument("--steps_per_generation", type=int, default=1,
                   help="optimizer steps one generation batch spans (the generation ids)")
    p.add_argument("--prompt_length", type=int, default=8, help="prompts hold between half this and this many tokens")
    p.add_argument("--max_completion_length", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--stop_token_ids", default=None,
                   help="ids that end a completion (and ranges start:stop:step); default the model's eos")
    p.add_argument("--reward", choices=tuple(REWARDS), default="even_fraction",
                   help="; ".join(f"{k}: {v}" for k, v in REWARDS.items()))
    p.add_argument("--scale_rewards", choices=("group", "batch", "none"), default="group",
                   help="GRPO's advantages (TRL's names): ÷ the group's std, the generation batch's, or none")
    p.add_argument("--advantage_estimator", choices=("rloo", "reinforce_plus_plus"), default=None,
                   help="another estimator than GRPO's (docs/sampler.md#the-advantages)")
    p.add_argument("--top_k", type=int, default=0, help="the sampler keeps this many most likely tokens (0: all)")
    p.add_argument("--top_p", type=float, default=1.0, help="... the most likely tokens holding this mass")
    p.add_argument("--min_p", type=float, default=0.0, help="... the tokens at least this × the most likely's "
                                                            "probability")
    p.add_argument("--repetition_penalty", type=float, default=1.0,
                   help="each token of the prompt or the completion so far: its logit ÷ this where positive, × where "
                        "negative, before the temperature (transformers' and vLLM's)")
    names = engines()  # the rooms that declare a sampling engine (parity/frameworks/sampling.py)
    p.add_argument("--sampler", choices=names, default="transformers",
                   help="what samples the completions: " + ", or ".join(engine(n).describe for n in names))
    p.add_argument("--sampler_dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the sampler's weights and arithmetic (the file's π_old and π_ref stay fp32)")
    p.add_argument("--sampler_logprobs", choices=("processed", "raw"), default="processed",
                   help="the sampler's log-probs: after temperature and truncation (as vLLM's processed_logprobs), or "
                        "the raw logits' (docs/sampler.md)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's own; 1 is "
                                                              "fastest for a tiny model on shared cores)")
    return p


def sampling_of(a: argparse.Namespace, stops: list[int]) -> Sampling:
    """What the flags ask the engine to sample with."""
    return Sampling(dtype=a.sampler_dtype, logprob_mode=a.sampler_logprobs, temperature=a.temperature, top_p=a.top_p,
                    top_k=a.top_k, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                    max_tokens=a.max_completion_length, stops=tuple(stops),
                    max_len=a.prompt_length + a.max_completion_length, seed=a.seed)


def make(a: argparse.Namespace) -> str:
    """Sample, score and write the file; returns its path. ConfigError for what cannot work."""
    from parity.models.model import build_model, load_init_weights, resolve_model_config, save_init_weights
    from parity.objectives.rollouts import write_rollouts

    for name in ("steps", "prompts_per_step", "num_generations", "steps_per_generation", "prompt_length",
                 "max_completion_length"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name} must be a positive integer (got {getattr(a, name)})")
    if a.family == "grpo" and a.num_generations < 2:
        raise ConfigError("--num_generations must be at least 2: a group's advantages compare its completions")
    storage.check_writable_dir("--output", storage.parent(storage.absolute(a.output)))
    sampler = engine(a.sampler)
    sampler.version()  # one line where it cannot be imported, before anything is written
    if a.threads is not None:
        torch.set_num_threads(max(1, a.threads))
    if not a.temperature > 0:
        raise ConfigError(f"--temperature must be positive (got {a.temperature})")
    config = resolve_model_config(a.model_name, a.num_layers)
    model = build_model(config, a.seed)
    if a.save_init_weights:
        save_init_weights(model, a.init_weights_path)
    elif not storage.exists(a.init_weights_path):
        raise ConfigError(f"--init_weights_path {a.init_weights_path}: no such file: pass --save_init_weights to "
                          f"write fresh weights, or a train_ddp.py --save_init_weights run's file")
    load_init_weights(model, a.init_weights_path)
    model.eval()
    reference = model if a.reference_seed is None else build_model(config, a.reference_seed).eval()
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else (config.eos_token_id or [0])[0]
    stops = stop_ids(a.stop_token_ids, config.vocab_size) if a.stop_token_ids else [eos]
    if not a.repetition_penalty > 0:
        raise ConfigError(f"--repetition_penalty must be positive (got {a.repetition_penalty}; 1: none)")
    if not 0 < a.top_p <= 1 or a.top_k < 0 or not 0 <= a.min_p < 1:
        raise ConfigError(f"--top_p {a.top_p}, --top_k {a.top_k}, --min_p {a.min_p}: top_p in (0, 1], top_k ≥ 0 "
                          f"(0: off), min_p in [0, 1)")
    session = sampler.start(model, config, sampling_of(a, stops))
    steps, _ = build_rows(session.sample, a, stops, config.vocab_size)
    tensors = tensors_of(model, reference, steps, a)
    rows = tensors["step_rows"].tolist()
    describe = (f"{a.family} rollouts of {a.model_name} ({len(rows)} steps × {rows[0]} rows, completions up to "
                f"{a.max_completion_length} tokens, reward {a.reward}, seed {a.seed})")
    write_rollouts(a.output, a.family, tensors, describe, {k: v for k, v in vars(a).items() if k != "output"},
                   session.side())
    truncated = int(tensors["truncated"].sum())
    console.say(f"wrote {a.output}: {describe}; {truncated} of {len(tensors['truncated'])} completions truncated")
    return a.output


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: make(build_parser().parse_args(argv)) and 0, "make_rollouts.py")
