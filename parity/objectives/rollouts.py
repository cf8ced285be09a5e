"""The rollout file: what each optimizer step of a post-training run consumes, fixed, so that every strategy (and a
replay) computes its update from the same data — slime's method (THUDM/slime #788): fix the data, compare the update.

One safetensors file; its metadata (strings): "format" (FORMAT), "family" ("grpo" or "dpo"), "describe" (how it was
made, in words) and "generation" (JSON: the writer's settings). Its tensors hold every step's rows one step after
another, `step_rows[s]` rows for step s, each row one sequence (a prompt and its completion) at one length L:

  input_ids        int64 [rows, L]  the prompt's tokens then the completion's, then padding (any id)
  attention_mask   int64 [rows, L]  1 on real tokens; fed to the model only where a row is left-padded
  completion_mask  int64 [rows, L]  1 at each position holding a completion token the loss counts (a tool's
                                    output: 0); never at position 0
  truncated        int64 [rows]     1 where the completion was cut at the length limit (no end-of-sequence token)
  group            int64 [rows]     the prompt group (GRPO: the completions of one prompt; DPO: the pair's prompt)
  generation       int64 [rows]     the generation batch the row was sampled in; a step's rows share one
  step_rows        int64 [steps]    rows per optimizer step
GRPO family:
  advantages       float32 [rows]   each completion's advantage, as the trainer computed it
  rewards          float32 [rows]   its reward (what the advantages were computed from; informative)
  old_logps        float32 [rows, L]  log π_old of the token at each position (0 off the completion mask); absent:
                                      on-policy, π_old is the policy itself, detached
  old_seq_logps    float32 [rows]     log π_old of the whole completion (the sum over its counted tokens), where only
                                      that was kept (TRL's RLOOTrainer); rloo reads it before old_logps
  ref_logps        float32 [rows, L]  log π_ref likewise; needed where beta > 0
DPO:
  rows in pairs, row 2k the chosen completion and row 2k + 1 the rejected one of the same prompt;
  ref_logps        float32 [rows, L]  log π_ref of each completion token (or ref_seq_logps float32 [rows]: their sum)

The sampler's side (optional; docs/sampler.md), with the metadata "sampler" (JSON: engine, version, dtype,
temperature, top_p, top_k, min_p, logprob_mode "processed" — after temperature and truncation — or "raw"):
  sampler_logps        float32 [rows, L]  the sampler's log-prob of the token at each completion position (NaN where
                                          it gave none)
  sampler_token_ids    int64 [rows, L]    the token each of those log-probs belongs to (−1 off the completion)
  sampler_weights_step int64 [rows]       the trainer step whose weights sampled the row

Per-token values sit at the position of the token they score: the logits at position t − 1 predict the token at t.
A step's rows split over DP ranks in order (rank 0 the first rows) and each rank's over its micro-batches in order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace

import torch

from parity import storage
from parity.errors import ConfigError

FORMAT = "parity-rollouts/1"
ROW_TENSORS = ("attention_mask", "completion_mask", "truncated", "group", "generation", "advantages", "rewards",
               "old_logps", "old_seq_logps", "ref_logps", "ref_seq_logps")
SAMPLER_TENSORS = ("sampler_logps", "sampler_token_ids", "sampler_weights_step")
SAMPLER_KEYS = ("engine", "version", "dtype", "temperature", "top_p", "top_k", "min_p", "logprob_mode")
LOGPROB_MODES = ("processed", "raw")
REQUIRED = {"grpo": ("input_ids", "completion_mask", "group", "generation", "step_rows", "advantages"),
            "dpo": ("input_ids", "completion_mask", "group", "generation", "step_rows")}


@dataclass(frozen=True)
class RolloutRows:
    """Some rows of a step (a rank's, a micro-batch's) as the objective reads them, beside their input ids and labels
    (data.Batch.rollout). `divisor`: the step's global normaliser (Objective.step_divisor), the same in every slice
    of the step; `generation_tokens`: the counted tokens of the step's generation batch ÷ the optimizer steps it
    spans (normalizer="generation")."""

    completion_mask: torch.Tensor
    truncated: torch.Tensor
    group: torch.Tensor
    generation: torch.Tensor
    advantages: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    old_seq_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    ref_seq_logps: torch.Tensor | None = None
    sampler_logps: torch.Tensor | None = None  # the sampler's side, where the objective weighs tokens by it
    divisor: float | None = None
    generation_tokens: float | None = None

    def rows(self, start: int, stop: int) -> "RolloutRows":
        return replace(self, **{f.name: getattr(self, f.name)[start:stop] for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def to(self, device) -> "RolloutRows":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def counted(self, mask_truncated: bool) -> torch.Tensor:
        """The completion tokens the loss counts, as a float [rows, L] mask: the completion mask, without the
        truncated rows' where `mask_truncated` (mask_truncated_completions)."""
        mask = self.completion_mask.float()
        return mask * (1 - self.truncated.float())[:, None] if mask_truncated else mask


@dataclass(frozen=True)
class RolloutFile:
    """A rollout file read whole: its family, description, steps and tensors (rows of every step, in order)."""

    path: str
    family: str
    describe: str
    generation_settings: dict
    tensors: dict
    sampler: dict  # the sampler's settings (SAMPLER_KEYS), {} where the file has no sampler side

    @property
    def steps(self) -> int:
        return len(self.tensors["step_rows"])

    @property
    def seq_length(self) -> int:
        return self.tensors["input_ids"].shape[1]

    def step_range(self, step: int) -> tuple[int, int]:
        counts = self.tensors["step_rows"].tolist()
        start = sum(counts[:step])
        return start, start + counts[step]

    def rows_per_step(self) -> int | None:
        """The rows every step holds, or None where steps differ."""
        counts = set(self.tensors["step_rows"].tolist())
        return counts.pop() if len(counts) == 1 else None

    def step(self, step: int) -> tuple[torch.Tensor, RolloutRows]:
        """Step `step`'s input ids and rows."""
        start, stop = self.step_range(step)
        t = {k: v[start:stop] for k, v in self.tensors.items() if k != "step_rows"}
        if t.get("truncated") is None:
            t["truncated"] = torch.zeros(stop - start, dtype=torch.int64)
        rows = RolloutRows(**{k: t.get(k) for k in ROW_TENSORS if k != "attention_mask"},
                           sampler_logps=t.get("sampler_logps"))
        return t["input_ids"], rows

    def attention_mask(self, step: int) -> torch.Tensor:
        start, stop = self.step_range(step)
        mask = self.tensors.get("attention_mask")
        return torch.ones_like(self.tensors["input_ids"][start:stop]) if mask is None else mask[start:stop]


def write_rollouts(path: str, family: str, tensors: dict, describe: str, generation_settings: dict,
                   sampler: dict | None = None) -> None:
    """Write a rollout file whole (atomic: the file appears complete or not at all), after checking its tensors."""
    from safetensors.torch import save

    check_tensors(path, family, tensors, sampler or {})
    data = save({k: v.contiguous() for k, v in tensors.items()},
                metadata={"format": FORMAT, "family": family, "describe": describe,
                          "generation": json.dumps(generation_settings, sort_keys=True),
                          **({"sampler": json.dumps(sampler, sort_keys=True)} if sampler else {})})
    storage.write_bytes_atomic(path, data)


def read_rollouts(path: str) -> RolloutFile:
    """A rollout file, checked; ConfigError in one line naming the file and what is wrong."""
    if not storage.exists(path):
        raise ConfigError(f"--rollouts {path}: no such file: write one with make_rollouts.py (docs/posttrain.md)")
    try:
        from safetensors.torch import load

        data = storage.read_bytes(path)
        tensors = load(data)
        size = int.from_bytes(data[:8], "little")  # safetensors' header: its length, then JSON with __metadata__
        meta = json.loads(data[8:8 + size]).get("__metadata__") or {}
    except Exception as exc:  # safetensors raises its own errors
        raise ConfigError(f"--rollouts {path} is not a safetensors file ({type(exc).__name__}): give a file "
                          f"make_rollouts.py or the recorder wrote") from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"--rollouts {path}: its format is {meta.get('format')!r}, not {FORMAT}: give a file "
                          f"make_rollouts.py or the recorder wrote")
    family = meta.get("family")
    try:
        sampler = json.loads(meta.get("sampler") or "{}")
    except json.JSONDecodeError:
        raise ConfigError(f"--rollouts {path}: its sampler metadata is not JSON: write it with json.dumps") from None
    check_tensors(path, family, tensors, sampler)
    return RolloutFile(path, family, meta.get("describe", ""), json.loads(meta.get("generation") or "{}"), tensors,
                       sampler)


def check_tensors(path: str, family: str, tensors: dict, sampler: dict) -> None:
    """ConfigError in one line where the tensors do not hold the schema (the module's docstring)."""
    where = f"--rollouts {path}"
    if family not in REQUIRED:
        raise ConfigError(f"{where}: family {family!r} is neither grpo nor dpo")
    missing = [k for k in REQUIRED[family] if k not in tensors]
    if family == "dpo" and "ref_logps" not in tensors and "ref_seq_logps" not in tensors:
        missing.append("ref_logps")
    if missing:
        raise ConfigError(f"{where} has no {missing[0]} tensor: a {family} rollout file holds "
                          f"{', '.join(REQUIRED[family])} (docs/posttrain.md)")
    ids, counts = tensors["input_ids"], tensors["step_rows"]
    rows = ids.shape[0]
    if int(counts.sum()) != rows or bool((counts < 1).any()):
        raise ConfigError(f"{where}: step_rows sums to {int(counts.sum())} but the file holds {rows} rows")
    for key, value in tensors.items():
        if key in ("input_ids", "step_rows"):
            continue
        if value.shape[0] != rows or (value.dim() == 2 and value.shape != ids.shape):
            raise ConfigError(f"{where}: {key} has shape {tuple(value.shape)}, the rows are {tuple(ids.shape)}")
    if bool(tensors["completion_mask"][:, 0].any()):
        raise ConfigError(f"{where}: a completion token at position 0 has no logits to score it: begin every row "
                          f"with its prompt")
    if family == "dpo" and any(int(c) % 2 for c in counts):
        raise ConfigError(f"{where}: a DPO step holds pairs (chosen, rejected): an odd number of rows")
    start = 0
    for s, c in enumerate(counts.tolist()):
        if len(set(tensors["generation"][start:start + c].tolist())) != 1:
            raise ConfigError(f"{where}: step {s}'s rows come from several generation batches: a step consumes one")
        start += c
    check_sampler(where, tensors, sampler)


def check_sampler(where: str, tensors: dict, sampler: dict) -> None:
    """ConfigError in one line where the sampler's side is there in part, or does not describe the rows."""
    given = [k for k in SAMPLER_TENSORS if k in tensors]
    if not given and not sampler:
        return
    missing = [k for k in SAMPLER_TENSORS if k not in tensors] + [f"the sampler metadata's {k}" for k in SAMPLER_KEYS
                                                                   if k not in sampler]
    if missing:
        raise ConfigError(f"{where} has a sampler side without {missing[0]}: it holds {', '.join(SAMPLER_TENSORS)} "
                          f"and the metadata {', '.join(SAMPLER_KEYS)} (docs/sampler.md)")
    if sampler["logprob_mode"] not in LOGPROB_MODES or sampler["dtype"] not in ("fp32", "bf16", "fp16") or \
            not float(sampler["temperature"]) > 0:
        raise ConfigError(f"{where}: the sampler's logprob_mode {sampler['logprob_mode']!r}, dtype {sampler['dtype']!r} "
                          f"and temperature {sampler['temperature']!r} must be one of {', '.join(LOGPROB_MODES)}, one "
                          f"of fp32, bf16, fp16, and positive")
    scored = tensors["completion_mask"].bool() & torch.isfinite(tensors["sampler_logps"])
    wrong = scored & (tensors["sampler_token_ids"] != tensors["input_ids"])
    if bool(wrong.any()):
        row, position = (int(i) for i in wrong.nonzero()[0])
        raise ConfigError(f"{where}: the sampler's token ids do not match the rows (row {row}, position {position}: "
                          f"{int(tensors['sampler_token_ids'][row, position])} against "
                          f"{int(tensors['input_ids'][row, position])}): its log-probs belong to other sequences")
    if not bool(scored.any()):
        raise ConfigError(f"{where}: the sampler's log-probs are NaN at every completion token: nothing to judge")

