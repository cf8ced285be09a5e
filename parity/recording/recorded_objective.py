"""What a recorded run's gradient is the gradient of (docs/posttrain.md#your-own-run-recorded).

A record names its objective, or is replayed as the causal-LM token mean. One that names none must be one: at its
first step the recorder holds the loss the run itself logged to the token mean it measured from the model's outputs
on the recorded batch (`causal_lm_refusal`). A GRPO or DPO loss, a label-smoothed or DFT-weighted cross-entropy, lies
far from it: the record is refused in one line, never replayed as cross-entropy and judged (a false FAIL).

A record of a post-training objective (`RecordedObjective`: a ParityRecorder(objective=...) — a loop of your own that
names its objective, or TRL's GRPO, RLOO and DPO trainers through frameworks/trl/objectives.py) holds what each optimizer step
consumed on each rank, as consumed, in the rollout file's schema (parity/objectives/rollouts.py) the harness trains
on: each micro-batch's ids, attention mask as fed, completion mask, truncation, group and generation batch,
advantages, π_old's and π_ref's per-token log-probs where used. Each rank hands its micro-batches' rows with the
step's exchange (rows.py: `encode`d as int64 words beside the ids), and the partial sums of the reference definition
computed from the run's own log-probs (Objective.micro_parts), so that rank 0 measures the step's loss under the
reference objective and its quantities (KL, clipped fraction, mean ratio …) as the harness's loop records them. At the
end rank 0 writes `recorded_<name>/rollouts.safetensors` (atomic) — every step's rows one after another, padded to
one length — and sets each step's batch hash, tokens and (normalizer="generation": the generation batch's tokens
÷ the steps it spans) loss to those its replay computes from that file (RolloutBatches).
"""

from __future__ import annotations

import math

import torch

from parity import storage
from parity.objectives import describe, invariance_of, ties
from parity.objectives.causal_lm import IGNORE_INDEX, token_log_probs, entropies
from parity.objectives.micro_batch import Objective
from parity.objectives.rollouts import RolloutRows, write_rollouts

# How far (relative) a run's logged step-0 loss may lie outside the range of the causal-LM token means the recorder
# measured — the global one and each rank's own — and still be taken for one: a mean of micro-batch means (a real
# bug, which the verdict judges) lies inside that range; a loss logged rounded, or from bf16 logits, ~1e-4 off it.
CAUSAL_SLACK = 0.05
ROLLOUT_FILE = "rollouts.safetensors"  # in recorded_<name>/
PAD_ID = 0  # a row shorter than the file's length is padded with it (mask 0, nothing counted)
# What a micro-batch hands over, in order: (name, per token (2) or per row (1), dtype in the file)
PAYLOAD = (("attention_mask", 2, torch.int64), ("completion_mask", 2, torch.int64), ("truncated", 1, torch.int64),
           ("group", 1, torch.int64), ("generation", 1, torch.int64), ("advantages", 1, torch.float32),
           ("old_logps", 2, torch.float32), ("old_seq_logps", 1, torch.float32), ("ref_logps", 2, torch.float32),
           ("ref_seq_logps", 1, torch.float32),
           ("sampler_logps", 2, torch.float32), ("sampler_token_ids", 2, torch.int64),
           ("sampler_weights_step", 1, torch.int64))


def causal_lm_refusal(logged_loss: float | None, rank_sums: list[float], rank_tokens: list[int],
                      scales: tuple[int, ...] = ()) -> str | None:
    """Why a record that names no objective cannot be taken for a causal-LM run, from its first step: the loss the run
    logged (`logged_loss`) against the token means of its batch (the ranks' loss sums and loss tokens, measured by the
    recorder from the model's outputs) — or those × or ÷ one of `scales` (its ranks, its micro-batches a rank, their
    product: a causal-LM loss normalised once too often or too few times, a bug the verdict judges). None where the
    logged loss lies within CAUSAL_SLACK of them, or none was logged (then nothing can be held to it)."""
    if logged_loss is None or not sum(rank_tokens) or not sum(rank_sums):
        return None
    means = [sum(rank_sums) / sum(rank_tokens)] + [s / c for s, c in zip(rank_sums, rank_tokens) if c]
    low, high = min(means), max(means)
    logged = float(logged_loss)
    factors = {1.0, *(float(k) for k in scales if k > 1), *(1.0 / k for k in scales if k > 1)}
    if math.isfinite(logged) and any(low * f * (1 - CAUSAL_SLACK) <= logged <= high * f * (1 + CAUSAL_SLACK)
                                     for f in factors):
        return None
    ranks = f"; the ranks' own {low:.6g}–{high:.6g}" if len(means) > 2 else ""
    return (f"step 0's loss as the run logged it, {logged:.6g}, is not the causal-LM token mean of its batch "
            f"({means[0]:.6g}, measured from the model's outputs{ranks}; ratio {logged / means[0]:.4g}, nor that × or "
            f"÷ its ranks or micro-batches): the run trains another objective, which this recorder does not know, and "
            f"a replay of cross-entropy would judge it falsely — name it: ParityRecorder(objective=...) and "
            f"objective_batch() per micro-batch (docs/posttrain.md#your-own-run-recorded)")


def named_objective(objective, settings: dict | None, declared: dict | None) -> "RecordedObjective | None":
    """A recorder's objective from its `objective=` (a name, with `settings` by TRL's argument names, or a resolved
    {"name", "settings"}) and what its framework `declared`; None for the causal-LM token mean. ConfigError in one line
    for an objective the reference cannot compute (resolve_objective's)."""
    from parity.objectives import resolve_objective

    if objective is None or objective == "causal_lm":
        return None
    return RecordedObjective(objective if isinstance(objective, dict) else resolve_objective(objective, settings),
                             declared)


def encode(tensors: dict, summed: float, own: float, stats) -> torch.Tensor:
    """A micro-batch's rollout rows and partial sums as int64 words (float64 bits): which of PAYLOAD it holds (a
    bitmask), each of them, then its sum, own term and statistics."""
    present = [name for name, _, _ in PAYLOAD if tensors.get(name) is not None]
    values = [torch.tensor([float(sum(1 << i for i, (n, _, _) in enumerate(PAYLOAD) if n in present))],
                           dtype=torch.float64)]
    values += [tensors[name].detach().to("cpu", torch.float64).reshape(-1) for name in present]
    values += [torch.tensor([summed, own], dtype=torch.float64), stats.detach().to("cpu", torch.float64).reshape(-1)]
    return torch.cat(values).view(torch.int64)


def decode(words: torch.Tensor, rows: int, length: int) -> tuple[dict, float, float, torch.Tensor]:
    """encode's (tensors, sum, own term, statistics) of a micro-batch of `rows` rows of `length`."""
    values = words.contiguous().view(torch.float64)
    bits, at, tensors = int(values[0]), 1, {}
    for i, (name, dims, dtype) in enumerate(PAYLOAD):
        if bits >> i & 1:
            size = rows * length if dims == 2 else rows
            tensors[name] = values[at:at + size].to(dtype).reshape((rows, length) if dims == 2 else (rows,))
            at += size
    return tensors, float(values[at]), float(values[at + 1]), values[at + 2:].clone()


class RecordedObjective:
    """One recorder's objective (a RunConfig's `objective` field, resolved): each micro-batch's rows and partial sums
    on its rank (`micro`), each step's loss, tokens and quantities on rank 0 (`step`), the rollout file at the end
    (`finish`). `declared`: what the run's framework declared (its own settings, kept in the record)."""

    def __init__(self, objective: dict, declared: dict | None = None):
        self.config, self.declared = objective, declared or {}
        self.objective = Objective(objective)
        self.steps: list[dict] = []  # rank 0: each recorded step's rows and partial sums (step, rows, parts, bytes)
        self.generation_offset = 0  # a resumed run's: its rows' generation ids go on after the first run's (restore)

    @property
    def family(self) -> str:
        return self.objective.family

    def describe_record(self) -> dict:
        """The record's config entries: the objective (compared with the replay's), what the framework declared, and
        the invariance note of a definition that depends on the split."""
        return {"objective": self.config, "objective_declared": self.declared,
                "objective_note": invariance_of(self.config).note(self.config["name"])}

    # --- on each rank, per micro-batch ------------------------------------------------------------------------
    def micro(self, input_ids, logits=None, *, completion_mask, attention_mask=None, log_probs=None,
              entropies_=None, **given) -> tuple[torch.Tensor, torch.Tensor]:
        """(the labels — the ids where the objective counts the token, −100 elsewhere — and the encoded rows and
        partial sums) of one micro-batch: its ids [rows, L], the model's logits on it or its log-probs of each next
        token (and entropies) [rows, L − 1], and its rows in the rollout schema (`given`: truncated, group,
        generation, advantages, old_logps, ref_logps [rows, L] at each token's position, old_seq_logps, ref_seq_logps;
        the sampler's side: sampler_logps, sampler_token_ids [rows, L], sampler_weights_step). ValueError in one line
        for what does not fit the schema or the objective."""
        ids = input_ids.detach().to("cpu", torch.int64)
        rows, length = ids.shape
        tensors = {"attention_mask": torch.ones_like(ids) if attention_mask is None else attention_mask,
                   "completion_mask": completion_mask, **given}
        if tensors.get("truncated") is None:
            tensors["truncated"] = torch.zeros(rows, dtype=torch.int64)
        for key in ("group", "generation"):
            if tensors.get(key) is None:
                tensors[key] = torch.zeros(rows, dtype=torch.int64)
        for name, dims, dtype in PAYLOAD:
            value = tensors.get(name)
            if value is None:
                continue
            value = torch.as_tensor(value).detach().to("cpu", dtype)
            shape = (rows, length) if dims == 2 else (rows,)
            if tuple(value.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, the micro-batch's rows {shape}")
            tensors[name] = value
        # no logits score a row's first token, so nothing trains on it where it is a completion's (TRL's DPO rows whose
        # prompt merged into its completion when tokenised together begin with one)
        tensors["completion_mask"] = torch.cat([torch.zeros(rows, 1, dtype=torch.int64),
                                                tensors["completion_mask"][:, 1:]], 1)
        self._check(tensors, rows)
        settings = self.objective.settings
        rollout = RolloutRows(**{k: tensors.get(k) for k in
                                 ("completion_mask", "truncated", "group", "generation", "advantages", "old_logps",
                                  "old_seq_logps", "ref_logps", "ref_seq_logps", "sampler_logps")})
        counted = rollout.counted(bool(settings.get("mask_truncated_completions")))
        labels = ids.masked_fill(counted == 0, IGNORE_INDEX)
        with torch.no_grad():
            level = ties.level(logits.dtype if log_probs is None else log_probs.dtype)  # (the rounding they carry)
            if log_probs is None:
                tempered = logits.detach() / settings.get("temperature", 1.0)
                log_probs, log_softmax = token_log_probs(tempered, input_ids.to(logits.device))
                entropies_ = entropies(log_softmax)
            log_probs = log_probs.detach().float()
            summed, own, stats = self.objective.micro_parts(
                log_probs, None if entropies_ is None else entropies_.detach().float(), rollout, level)
        return labels, encode(tensors, float(summed), float(own), stats)

    def _check(self, t: dict, rows: int) -> None:
        if self.family == "grpo":
            if t.get("advantages") is None:
                raise ValueError(f"{self.config['name']} needs each row's advantage (advantages=)")
            if self.objective.settings.get("beta") and t.get("ref_logps") is None:
                raise ValueError(f"{self.config['name']} with beta {self.objective.settings['beta']} needs the "
                                 f"reference's per-token log-probs (ref_logps=)")
            if self.objective.settings.get("vllm_importance_sampling_correction") and (
                    t.get("sampler_logps") is None or t.get("old_logps") is None):
                raise ValueError(f"{self.config['name']} with vllm_importance_sampling_correction needs the sampler's "
                                 f"and π_old's per-token log-probs (sampler_logps=, old_logps=)")
        elif rows % 2:
            raise ValueError("a DPO micro-batch holds pairs, row 2k chosen and 2k + 1 rejected: an odd number of rows")
        elif t.get("ref_logps") is None and t.get("ref_seq_logps") is None:
            raise ValueError("DPO needs the reference's log-probs (ref_logps= per token, or ref_seq_logps= their sums)")

    # --- rank 0, per step ---------------------------------------------------------------------------------------
    def step(self, step: int, per_dp_rank: list[list]) -> dict:
        """Step `step` from every DP rank's micro-batches (rows.MicroBatch with their rollout words): its loss under
        the reference objective (D from the step's rows, as the replay computes it; normalizer="generation" fixed at
        `finish`), each DP rank's, its tokens and quantities — observe_step's arguments — its rows kept for the
        file. ValueError, one line, for rows the replay cannot take."""
        length = max(m.ids.shape[1] for micro in per_dp_rank for m in micro)
        columns: dict[str, list[torch.Tensor]] = {}
        parts, stats = [], None
        for rank, micro in enumerate(per_dp_rank):
            for m in micro:
                tensors, summed, own, s = decode(m.rollout, *m.ids.shape)
                for name, value in (("input_ids", m.ids), *tensors.items()):
                    columns.setdefault(name, []).append(_padded(value, length, PAD_ID if name == "input_ids" else 0))
                parts.append((rank, summed, own, int((m.labels[:, 1:] != IGNORE_INDEX).sum())))
                stats = s if stats is None else stats + s
        counts = {name: len(c) for name, c in columns.items()}
        mixed = [name for name, n in counts.items() if n != counts["input_ids"]]
        if mixed:
            raise ValueError(f"step {step}: some micro-batches came with {mixed[0]} and others without: give it at "
                             f"every micro-batch")
        rows = {name: torch.cat(c) for name, c in columns.items()}
        rows["generation"] = rows["generation"] + self.generation_offset
        if self.steps and set(rows) != set(self.steps[0]["rows"]):
            other = sorted(set(rows) ^ set(self.steps[0]["rows"]))[0]
            raise ValueError(f"step {step} came {'with' if other in rows else 'without'} {other}, step "
                             f"{self.steps[0]['step']} the other way: give it at every step or none")
        entry = {"step": step, "rows": rows, "parts": parts, "bytes": sum(t.numel() * 8 for t in rows.values())}
        self.steps.append(entry)
        found = self._loss(entry, self._divisor(rows))
        return {**found, "objective": self.objective.quantities(stats)}

    def _divisor(self, rows: dict, generation_tokens: float | None = None) -> float:
        labels = rows["input_ids"].masked_fill(self._counted(rows) == 0, IGNORE_INDEX)
        rollout = RolloutRows(**{k: rows.get(k) for k in ("completion_mask", "truncated", "group", "generation",
                                                          "advantages", "old_logps", "old_seq_logps", "ref_logps",
                                                          "ref_seq_logps")})
        if self.family == "grpo" and generation_tokens is None:
            generation_tokens = float(self._counted(rows)[:, 1:].sum())
        if self.family == "grpo":
            from dataclasses import replace

            rollout = replace(rollout, generation_tokens=max(generation_tokens, 1.0))
        return self.objective.step_divisor(labels, rollout)

    def _counted(self, rows: dict) -> torch.Tensor:
        mask = rows["completion_mask"].float()
        if self.objective.settings.get("mask_truncated_completions"):
            mask = mask * (1 - rows["truncated"].float())[:, None]
        return mask

    @staticmethod
    def _loss(entry: dict, divisor: float) -> dict:
        """The step's loss and each DP rank's, as the harness's loop records them (Strategy.train_step): Σ (sum + own
        × D ÷ micro-batches) ÷ D, and each rank's that over its loss tokens."""
        micro_batches = len(entry["parts"])
        ranks = sorted({p[0] for p in entry["parts"]})
        sums = [sum(s + own * divisor / micro_batches for r, s, own, _ in entry["parts"] if r == rank) for rank in ranks]
        tokens = [sum(t for r, _, _, t in entry["parts"] if r == rank) for rank in ranks]
        return {"loss": sum(sums) / divisor, "dp_rank_losses": [s / max(t, 1) for s, t in zip(sums, tokens)],
                "tokens": sum(tokens)}

    @property
    def saved_bytes(self) -> int:
        return sum(e["bytes"] for e in self.steps)

    def restore(self, path: str, k: int) -> str | None:
        """A run resumed after k updates (rank 0): its first run's steps 0…k−1 as that run's rollout file at `path`
        holds their rows (the record keeps their losses), so that the file written at the end holds every step; why
        not, in words, where the file holds fewer, or where step k − 1 ends inside a generation batch the objective
        divides by (normalizer="generation": its tokens past k are not the file's). The resumed run's rows are a
        generation batch of their own (TRL's buffers are not in its checkpoint): their ids go on after these."""
        from parity.errors import ConfigError
        from parity.objectives.rollouts import read_rollouts

        try:
            rollouts = read_rollouts(path)
        except ConfigError as exc:
            return str(exc).replace("--rollouts ", "its rollout file ")
        if rollouts.steps < k:
            return f"its rollout file {storage.name(path)} holds {rollouts.steps} steps"
        for step in range(k):
            start, stop = rollouts.step_range(step)
            rows = {name: t[start:stop] for name, t in rollouts.tensors.items() if name != "step_rows"}
            self.steps.append({"step": step, "rows": rows, "parts": None,
                               "bytes": sum(t.numel() * 8 for t in rows.values())})
        self.generation_offset = int(rollouts.tensors["generation"].max()) + 1
        whole, why = self.whole_generations(k)
        return None if whole == k else f"{why}: resume at a step that begins a generation batch"

    # --- rank 0, at the end -------------------------------------------------------------------------------------
    def whole_generations(self, steps: int) -> tuple[int, str | None]:
        """(the steps to keep of the record's first `steps`, why fewer): where the objective divides by its generation
        batch's tokens (normalizer="generation"), a last generation batch the record does not hold whole — the run
        stopped inside it — was divided by tokens the file cannot give its replay; its steps are left out."""
        if self.objective.settings.get("normalizer") != "generation" or not steps:
            return steps, None
        generation = {e["step"]: int(e["rows"]["generation"][0]) for e in self.steps if e["step"] < steps}
        counts: dict[int, int] = {}
        for g in generation.values():
            counts[g] = counts.get(g, 0) + 1
        d = self.declared
        spans = (d["steps_per_generation"] // d["gradient_accumulation_steps"]
                 if d.get("steps_per_generation") and d.get("gradient_accumulation_steps") else max(counts.values()))
        last = generation[steps - 1]
        if counts[last] >= spans:
            return steps, None
        first = min(k for k, g in generation.items() if g == last)
        return first, (f"step {first} begins a generation batch of {spans} optimizer steps the record holds "
                       f"{counts[last]} of, and {self.config['name']} divides by its tokens (normalizer=generation)")


    def finish(self, folder: str, entries: list[dict], describe_run: str) -> str | None:
        """Write the rollout file of the recorded steps (`entries`, the record's steps, which it updates: each step's
        batch hash, tokens and loss as its replay computes them from the file) into `folder` (atomic); returns its
        path relative to the record's folder, or None where no step was recorded."""
        from parity.training.data import RolloutBatches, batch_hash

        kept = [e for e in self.steps if e["step"] < len(entries)]
        if not kept:
            return None
        length = max(e["rows"]["input_ids"].shape[1] for e in kept)
        tensors = {name: torch.cat([_padded(e["rows"][name], length, PAD_ID if name == "input_ids" else 0)
                                    for e in kept]).to(dtype)
                   for name, dtype in (("input_ids", torch.int64), *((n, d) for n, _, d in PAYLOAD))
                   if name in kept[0]["rows"]}
        tensors["step_rows"] = torch.tensor([len(e["rows"]["input_ids"]) for e in kept], dtype=torch.int64)
        path = storage.join(folder, ROLLOUT_FILE)
        sampler = self.declared.get("sampler") if "sampler_logps" in tensors else None  # its settings, where declared
        write_rollouts(path, self.family, tensors, f"recorded: {describe_run}; objective {describe(self.config)}",
                       {"declared": self.declared, "recorded_steps": len(kept)}, sampler)
        batches = RolloutBatches(path, self.config, len(kept), "")
        for e in kept:
            batch = batches(e["step"])
            entry = entries[e["step"]]
            entry.update(batch_hash=batch_hash(batch), tokens=batch.loss_tokens)
            if e["parts"] is not None:  # (a step restored at a resume keeps the loss its first run recorded)
                entry.update({k: v for k, v in self._loss(e, batch.divisor).items() if k != "tokens"})
        return path


def _padded(t: torch.Tensor, length: int, fill) -> torch.Tensor:
    """A micro-batch's per-token tensor right-padded to `length` (a per-row one as it is)."""
    return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=fill) if t.dim() == 2 else t


__all__ = ["CAUSAL_SLACK", "PAYLOAD", "ROLLOUT_FILE", "RecordedObjective", "causal_lm_refusal", "decode", "encode",
           "named_objective"]
