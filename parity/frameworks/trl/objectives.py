"""TRL's GRPOTrainer, RLOOTrainer and DPOTrainer (0.29.0 to 1.16, docs/own_trainer/one_command.md#the-releases-recorded)
recorded with their objective, no line of the user's script changed
(docs/posttrain.md#your-own-run-recorded): Trainer's ParityCallback asks the registry what its trainer trains
(parity.frameworks.objective_of: `trained` here, from `plan`), then hands each training micro-batch to the
recorder's objective_batch through the `GRPOFeed` (GRPO, RLOO) or `DPOFeed` it gives.

The objective: the trainer's own arguments resolved into the harness's definitions (parity/objectives: TRL's argument
names are the settings' names) — loss_type, beta, epsilon/epsilon_high, delta, importance_sampling_level,
mask_truncated_completions, temperature, the entropy bonus …; dapo, cispo and vespo divide by the generation batch's
tokens ÷ the optimizer steps it spans (TRL 1.16, after PR #6024: `normalizer="generation"`, the step's own tokens
where a generation batch is one step). What TRL declares besides (scale_rewards, num_generations,
steps_per_generation …) is kept in the record as declared; the advantages are recorded as TRL computed them.

What each micro-batch consumed, as consumed — after TRL's shuffle and split of its generation batch:
- GRPO: the forward hook's ids and attention mask as fed and the policy's log-probs and entropies the fused LM head
  returned; from the dict _compute_loss received (GRPOTrainer._prepare_inputs returns
  `_buffered_inputs[_step % steps_per_generation]`, read here as it is, never changed): the completion mask (× a
  tool mask), the advantages, π_old's and π_ref's per-token log-probs where TRL computed them;
- RLOO (TRL's RLOOTrainer: GRPO's sampling and buffers, its loss one clipped term a sequence, β's KL inside the
  advantages): as GRPO, π_old's sequence sums (its `old_logps`) as old_seq_logps; each row's truncation by
  TRL's own rule (its last completion token is neither an end nor padding) — with mask_truncated_completions TRL
  zeroes a truncated row's completion mask, which the record keeps as the completion's tokens and `truncated` (the
  definition masks them); the generation batch: the pass over the buffered batch (`_step // steps_per_generation`).
- DPO: the policy's forward (its rows [chosen…, rejected…], the completion the labels' tokens) and the reference's
  forward on the same rows (the ref_model's, or the policy's own under no_grad with its adapters off): per-token
  log-probs, the rows interleaved into pairs (2k chosen, 2k + 1 rejected).

With vLLM (use_vllm), the rows' sampler side (docs/sampler.md): TRL's sampling_per_token_logps, the tokens and the
weights' step; the engine's dtype, version and log-prob mode read off the colocated engine (`sampler_of`), so that TRL's
importance-sampling correction enters the reference objective with TRL's mode and caps; the temperature, top-p/k,
min-p and penalties from the SamplingParams the engine was given (`SamplerWatch`: TRL's generation_kwargs override its
own arguments there; their other keys — logprobs, seed, stop and length keys — are kept as declared). The recorder
keeps the weights of every step whose rows vLLM sampled (parity/recording/states.py), for the sampler verdict.

Refused in one line (`plan`), nothing recorded, the training untouched: a loss type the reference does not define,
vLLM importance sampling from a server (its sampler's settings live in another process), a reward model trained in
the same run (its parameters in the optimizer), the precomputed reference log-probs of DPO's dataset, a MoE router's
auxiliary loss, images, and what the definitions themselves refuse (resolve_objective).
"""

from __future__ import annotations

import hashlib

import torch

from parity.frameworks import Refused, Trained, engine, guarded
from parity.objectives import DEFINITIONS, GRPO_FAMILY, PER_PAIR, resolve_objective

PROBE_ROWS = 4  # rows of the first micro-batch through vLLM and the trainer's model, layer by layer
RLOO_DECLARED = ("beta", "epsilon", "epsilon_high", "mask_truncated_completions", "normalize_advantages",
                 "reward_clip_range", "num_generations", "steps_per_generation", "gradient_accumulation_steps",
                 "num_iterations", "max_completion_length", "temperature", "top_p", "top_k", "min_p",
                 "repetition_penalty", "generation_kwargs", "reward_weights", "use_vllm", "bf16")
GRPO_DECLARED = ("loss_type", "beta", "epsilon", "epsilon_high", "delta", "importance_sampling_level",
                 "mask_truncated_completions", "scale_rewards", "num_generations", "steps_per_generation",
                 "gradient_accumulation_steps", "num_iterations", "max_completion_length", "temperature", "top_p",
                 "top_k", "min_p", "repetition_penalty", "generation_kwargs", "reward_weights",
                 "multi_objective_aggregation", "use_vllm", "entropy_coef", "bf16")
DPO_DECLARED = ("loss_type", "loss_weights", "beta", "label_smoothing", "f_divergence_type", "f_alpha_divergence_coef",
                "ld_alpha", "discopop_tau", "precompute_ref_log_probs", "max_length", "truncation_mode",
                "sync_ref_model", "gradient_accumulation_steps", "bf16")

# GRPOConfig's settings that older TRL releases lack (docs/own_trainer/one_command.md#the-releases-recorded): what their absence
# means — the feature is not there
ABSENT = {"delta": None, "use_bias_correction_kl": False, "entropy_coef": 0.0, "top_entropy_quantile": 1.0,
          "use_adaptive_entropy": False, "off_policy_mask_threshold": None}


KINDS = {"GRPOTrainer": "grpo", "RLOOTrainer": "rloo", "DPOTrainer": "dpo"}
LOSS_TYPES = tuple(n for n in GRPO_FAMILY if n != "rloo")  # GRPOConfig's loss_type values (rloo: RLOOTrainer's own)


def trl_trainers(trainer) -> list[str]:
    """The names of TRL's trainer classes `trainer` is an instance of, its own class's first."""
    return [c.__name__ for c in type(trainer).__mro__ if c.__module__.split(".")[0] == "trl"
            and c.__name__.endswith("Trainer") and not c.__name__.startswith("_")]


def kind_of(trainer) -> str | None:
    """"grpo", "rloo" or "dpo" for TRL's GRPOTrainer, RLOOTrainer and DPOTrainer (and what inherits them), None for
    any other trainer."""
    return next((KINDS[name] for name in trl_trainers(trainer) if name in KINDS), None)


def trained(trainer, optimizer) -> Trained | None:
    """What a GRPOTrainer, RLOOTrainer or DPOTrainer trains, resolved, and the feed of its micro-batches (the
    registry's `objective_of`, which Trainer's callback asks); None for another trainer. Refused in one line."""
    planned = plan(trainer, optimizer)
    if planned is None:
        return None
    feed = DPOFeed if kind_of(trainer) == "dpo" else GRPOFeed
    return Trained(resolved(*planned[:2]), planned[2], lambda recorder: feed(trainer, recorder))


def plan(trainer, optimizer) -> tuple[str, dict, dict] | None:
    """(objective name, its settings by TRL's argument names, what TRL declared) of a GRPO, RLOO or DPO trainer; None for
    another trainer (a causal-LM one: recorded as such, its first step's loss held to it). Refused for what the
    reference cannot compute, and for TRL's other trainers but SFT (KTO, the reward model's, distillation …)."""
    kind = kind_of(trainer)
    if kind is None:
        other = trl_trainers(trainer)
        if other and other[0] != "SFTTrainer":  # (SFT trains the causal-LM token mean)
            raise Refused(f"TRL's {other[0]} trains an objective of its own, which the reference does not define: the "
                          f"harness records TRL's SFTTrainer, GRPOTrainer, RLOOTrainer and DPOTrainer")
        return None
    args = trainer.args
    declared = {k: _plain(getattr(args, k, None))
                for k in {"grpo": GRPO_DECLARED, "rloo": RLOO_DECLARED, "dpo": DPO_DECLARED}[kind]}
    if getattr(trainer, "aux_loss_enabled", False):
        raise Refused("the model's router adds its auxiliary loss to the objective (router_aux_loss_coef), which the "
                      "reference objective does not: set router_aux_loss_coef=0")
    if kind == "grpo":
        found = _grpo(trainer, args, optimizer)
        sampler = sampler_of(trainer)
        return found + ({**declared, "sampler": sampler} if sampler else declared,)
    if kind == "rloo":
        _reward_models_frozen(trainer, optimizer)
        return "rloo", {"epsilon": args.epsilon, "epsilon_high": args.epsilon_high, "temperature": args.temperature,
                        "mask_truncated_completions": args.mask_truncated_completions}, declared
    if getattr(args, "precompute_ref_log_probs", False):
        raise Refused("precompute_ref_log_probs=True: the reference's log-probs are computed into the dataset before "
                      "training and never reach a hook the recorder sees: record with precompute_ref_log_probs=False")
    types = list(args.loss_type if isinstance(args.loss_type, (list, tuple)) else [args.loss_type])
    unknown = [t for t in types if t not in PER_PAIR + ("sft", "aot", "aot_unpaired")]
    if unknown:
        raise Refused(f"DPO's loss_type {unknown[0]!r} is not one the reference defines ({', '.join(PER_PAIR)}, sft)")
    settings = {"loss_type": types, "beta": args.beta, "label_smoothing": args.label_smoothing,
                "f_divergence_type": args.f_divergence_type, "f_alpha_divergence_coef": args.f_alpha_divergence_coef,
                "ld_alpha": args.ld_alpha, "discopop_tau": args.discopop_tau, "use_weighting": args.use_weighting}
    if args.loss_weights is not None:
        settings["loss_weights"] = list(args.loss_weights)
    return "dpo", settings, declared


def _grpo(trainer, args, optimizer) -> tuple[str, dict]:
    name = args.loss_type
    if name not in LOSS_TYPES:
        raise Refused(f"GRPO's loss_type {name!r} is not one the reference defines ({', '.join(LOSS_TYPES)})")
    corrected = bool(getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False))
    if corrected and args.vllm_mode != "colocate":
        raise Refused(f"vLLM importance sampling with vllm_mode={args.vllm_mode!r}: the sampler's dtype, version and "
                      f"log-prob mode live in the server's process, and the recorder reads them off a colocated "
                      f"engine: record with vllm_mode='colocate', or vllm_importance_sampling_correction=False")
    _reward_models_frozen(trainer, optimizer)
    settings = {k: getattr(args, k, ABSENT.get(k)) for k in (  # a setting a release lacks: the feature is off
        "epsilon", "epsilon_high", "delta", "beta", "use_bias_correction_kl", "importance_sampling_level",
        "mask_truncated_completions", "temperature", "entropy_coef", "top_entropy_quantile", "use_adaptive_entropy",
        "off_policy_mask_threshold")}
    settings["vllm_importance_sampling_correction"] = corrected  # TRL applies it with vLLM only
    if corrected:
        settings.update({k: getattr(args, k) for k in ("vllm_importance_sampling_mode",
                                                       "vllm_importance_sampling_clip_min",
                                                       "vllm_importance_sampling_clip_max")})
    known = {s.name for s in DEFINITIONS[name].settings}
    for extra in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                  "vespo_lambda_neg", "max_completion_length"):
        if extra in known:
            settings[extra] = getattr(args, extra)
    if "normalizer" in known:  # TRL divides by the generation batch's tokens ÷ the optimizer steps it spans
        settings["normalizer"] = "step" if args.steps_per_generation == args.gradient_accumulation_steps else \
            "generation"
    return name, settings


def _reward_models_frozen(trainer, optimizer) -> None:
    """Refused where a reward model is trained in the same run (GRPO, RLOO)."""
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for func in getattr(trainer, "reward_funcs", []):
        if isinstance(func, torch.nn.Module) and any(id(p) in trained for p in func.parameters()):
            raise Refused(f"the reward model {type(func).__name__} is trained in the same run (its parameters are in "
                          f"the optimizer): its rewards, and the advantages, move with each step, and the replay "
                          f"trains the policy alone")


def sampler_of(trainer) -> dict | None:
    """The rollout file's sampler metadata (docs/sampler.md) of a GRPOTrainer sampling with a colocated vLLM engine:
    the engine's side read off it, the sampling side from what TRL gives its SamplingParams (its arguments, then its
    generation_kwargs over them; SamplerWatch then reads what the engine was given); None without one. Refused in one
    line for what the file cannot describe: a log-prob mode other than vLLM's processed or raw log-probs, a dtype
    other than fp32, bf16 or fp16."""
    args, generation = trainer.args, getattr(trainer, "vllm_generation", None)
    llm = getattr(generation, "llm", None)
    if not getattr(args, "use_vllm", False) or llm is None:
        return None
    vllm = engine("vllm")  # the sampler seam (parity/frameworks/sampling.py)
    side, why = vllm.engine_side(llm)
    if why:
        raise Refused(f"vLLM's sampler {why}: the rollout file describes an fp32, bf16 or fp16 sampler of processed or "
                      f"raw log-probs")
    given = {key: getattr(generation, key, getattr(args, key, None))
             for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    return {**side, **vllm.sampling_side({**given, **(getattr(generation, "generation_kwargs", None) or {})})}


class SamplerWatch:
    """The SamplingParams TRL hands its colocated engine, read as they go by (the engine's generate, wrapped for the
    run: it calls vLLM's own, unchanged): the first sets the sampling side of the record's sampler metadata (`side`,
    updated in place), a later one that samples from another distribution ends the record in one line. `paused`
    while the recorder's own probe generates."""

    def __init__(self, llm, side: dict, recorder):
        self.engine, self.side, self.recorder, self.seen, self.paused = llm, side, recorder, None, False
        original, read = llm.generate, engine("vllm").sampling_side

        def generate(*args, **kwargs):
            if not self.paused:
                try:
                    self.saw(read, kwargs.get("sampling_params", args[1] if len(args) > 1 else None))
                except Exception as exc:  # a reading of the recorder's, never the run's end
                    self.recorder.broken = f"vLLM's sampling parameters: {type(exc).__name__}: {exc}"
            return original(*args, **kwargs)

        llm.generate = generate

    def saw(self, read, params) -> None:
        for one in params if isinstance(params, (list, tuple)) else [params]:
            if one is None:
                continue
            found = read(one)
            if self.seen is None:
                self.seen = found
                self.side.pop("shaped_by", None)
                self.side.update(found)
            elif found != self.seen:
                key = next(k for k in sorted(set(found) | set(self.seen)) if found.get(k) != self.seen.get(k))
                self.recorder.broken = (f"vLLM sampled with {key} {self.seen.get(key)!r}, then {found.get(key)!r}: a "
                                        f"rollout file describes one sampler")

    def close(self) -> None:
        self.engine.__dict__.pop("generate", None)  # vLLM's own again


def resolved(name: str, settings: dict) -> dict:
    """The objective as the harness resolves it (Refused in resolve_objective's one line)."""
    from parity.errors import ConfigError

    try:
        return resolve_objective(name, settings)
    except ConfigError as exc:
        raise Refused(str(exc).replace("--objective ", "TRL's ").replace("--objective_args ", "")) from None


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """Each row's prompt group: an id of its prompt's tokens (rows of one prompt share it; TRL's shuffle of the
    generation batch loses the order that grouped them)."""
    groups = []
    for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu()):
        digest = hashlib.sha256(ids[mask.bool()].numpy().tobytes()).digest()
        groups.append(int.from_bytes(digest[:6], "little"))  # 48 bits: exact in float64
    return torch.tensor(groups, dtype=torch.int64)


def on_positions(per_completion: torch.Tensor | None, prompt_length: int) -> torch.Tensor | None:
    """A per-completion-token tensor [rows, C] at its tokens' positions [rows, P + C] (the rollout file's)."""
    if per_completion is None:
        return None
    values = per_completion.detach().float().cpu()
    return torch.cat([torch.zeros(values.shape[0], prompt_length), values], 1)


def end_ids(trainer) -> list[int]:
    """The ids that end a completion by TRL's truncation rule (a row whose last token is none of them was cut): its
    end ids and the padding; before TRL kept `eos_token_ids` (1.16), the tokenizer's end and padding (as its
    clipped-ratio metric counts them)."""
    tokenizer = getattr(trainer, "_tokenizer", None) or getattr(trainer.processing_class, "tokenizer",
                                                                trainer.processing_class)
    ends = getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id]
    return [*ends, tokenizer.pad_token_id]


def policy_log_probs(output, ids: torch.Tensor, trainer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The policy's log-prob of each next token [rows, L − 1] and its entropies, as TRL computed them: its fused LM
    head's (TRL 1.15 on); before it, from the logits of the completion's positions (logits_to_keep + 1 of them, the
    last dropped), tempered, as TRL's _get_per_token_logps_and_entropies — zero at the prompt's positions, which no
    loss counts."""
    if getattr(output, "log_probs", None) is not None:
        return output.log_probs, getattr(output, "entropy", None)
    from parity.objectives.causal_lm import entropies, token_log_probs

    logits = output.logits
    kept = logits.shape[1]  # logits_to_keep + 1, or every position
    with torch.no_grad():
        log_probs, log_softmax = token_log_probs(logits.detach() / trainer.temperature, ids[:, ids.shape[1] - kept:])
        pad = ids.shape[1] - kept
        return (torch.nn.functional.pad(log_probs, (pad, 0)),
                torch.nn.functional.pad(entropies(log_softmax), (pad, 0)))


class GRPOFeed:
    """A GRPOTrainer's or RLOOTrainer's training micro-batches to the recorder (module docstring)."""

    def __init__(self, trainer, recorder):
        self.trainer, self.recorder, self.probed, self.watch = trainer, recorder, False, None
        side = (getattr(recorder.objective_rows, "declared", None) or {}).get("sampler")
        if side is not None:  # vLLM samples: what it was given read as it goes, its weights kept at each sync
            self.watch = SamplerWatch(trainer.vllm_generation.llm, side, recorder)
            recorder.states.sampled_at = self.samples_at

    def samples_at(self, updates: int) -> bool:
        """Whether TRL syncs its engine to the weights after `updates` updates and samples with them: a generation
        begins at each (steps_per_generation × num_iterations)-th micro-batch, with the weights of the optimizer step
        it falls in."""
        every = self.trainer.args.steps_per_generation * self.trainer.num_iterations
        accumulation = self.trainer.args.gradient_accumulation_steps
        return any(m % every == 0 for m in range(updates * accumulation, (updates + 1) * accumulation))

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()

    def forward(self, module, args, kwargs, output, grad: bool) -> None:
        if not grad:
            return  # generation, π_old's and the reference's forwards
        t, rec = self.trainer, self.recorder
        spg = t.args.steps_per_generation
        inputs = t._buffered_inputs[t._step % spg]
        ids, attention = kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask")
        prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
        if ids is None or not torch.equal(ids.cpu(), torch.cat([prompt, completion], 1).cpu()):
            rec.broken = "a GRPO training forward whose rows are not the micro-batch TRL buffered"
            return
        if any(k in inputs for k in ("pixel_values", "num_images")):
            rec.broken = "images in a GRPO micro-batch: the harness trains causal LMs on token rows"
            return
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            rec.broken = "advantages of one value per token: the reference takes one per row"
            return
        p, c = prompt.shape[1], completion.shape[1]
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        limit = min(c, t.max_completion_length)
        ends = torch.tensor(end_ids(t), device=completion.device)
        truncated = ~torch.isin(completion[:, limit - 1], ends)
        if t.mask_truncated_completions:  # TRL zeroed them: the record keeps the completion and its truncation
            cut = truncated[:, None] & (torch.arange(c, device=completion.device) < limit)[None]
            mask = torch.where(cut, torch.ones_like(mask), mask)
        rows = len(ids)
        log_probs, entropies_ = policy_log_probs(output, ids, t)
        rec.objective_batch(
            ids, completion_mask=torch.cat([torch.zeros(rows, p, dtype=torch.int64), mask.long().cpu()], 1),
            attention_mask=attention, log_probs=log_probs, entropies=entropies_,
            advantages=advantages.float().cpu(), truncated=truncated.long().cpu(),
            group=prompt_groups(prompt, inputs["prompt_mask"]),
            generation=torch.full((rows,), t._step // spg, dtype=torch.int64),
            old_logps=on_positions(inputs.get("old_per_token_logps"), p),
            old_seq_logps=None if inputs.get("old_logps") is None else inputs["old_logps"].detach().float().cpu(),
            ref_logps=on_positions(inputs.get("ref_per_token_logps"), p), **self.sampler_side(inputs, mask, p))
        if not self.probed and "sampling_per_token_logps" in inputs:
            self.probed = True
            self.probe_layers(module, ids, attention)

    def probe_layers(self, model, ids: torch.Tensor, attention) -> None:
        """At the first training micro-batch — the engine synced to the trainer's weights of step 0 — where vLLM's
        forward first parts from the trainer's model, layer by layer, on up to PROBE_ROWS of its rows
        (the vLLM engine's first_layer_apart), into the recorder's folder beside the rollout file (rank 0)."""
        import json

        from parity import storage
        from parity.errors import first_line
        from parity.frameworks.sampling import NotCompared
        from parity.rollout_check.recorded import LAYERS_FILE

        rec, llm = self.recorder, getattr(getattr(self.trainer, "vllm_generation", None), "llm", None)
        if llm is None or rec.rank != 0:
            return
        real = torch.ones_like(ids) if attention is None else attention
        rows = [row[mask.bool()].tolist() for row, mask in zip(ids.cpu(), real.cpu())][:PROBE_ROWS]
        if self.watch is not None:
            self.watch.paused = True  # the probe's own requests are not the run's sampling
        try:
            vllm = engine("vllm")
            found = vllm.first_layer_apart(llm, model, rows, vllm.engine_side(llm)[0]["dtype"] or "fp32")
        except Exception as exc:  # a diagnosis, never the run's end: said where it would have been
            found = {"error": str(exc) if isinstance(exc, NotCompared) else
                     f"{type(exc).__name__}: {first_line(exc)}"}
        finally:
            if self.watch is not None:
                self.watch.paused = False
        storage.write_bytes_atomic(storage.join(rec.folder, LAYERS_FILE), json.dumps(found, indent=1).encode())

    def sampler_side(self, inputs: dict, mask: torch.Tensor, p: int) -> dict:
        """The rows' sampler side where vLLM sampled them (TRL's sampling_per_token_logps): its log-prob of each
        completion token, the token (the row's own: TRL keeps vLLM's tokens), and the optimizer step whose weights it
        sampled with — the steps completed when TRL generated this buffer (it syncs the weights before generating)."""
        logps = inputs.get("sampling_per_token_logps")
        if logps is None:
            return {}
        t, completion = self.trainer, inputs["completion_ids"].cpu()
        rows = len(completion)
        every = t.args.steps_per_generation * t.num_iterations
        weights_step = (t._step // every) * every // t.args.gradient_accumulation_steps
        ids = torch.where(mask.cpu() > 0, completion, -1)
        return {"sampler_logps": on_positions(logps, p),
                "sampler_token_ids": torch.cat([torch.full((rows, p), -1, dtype=torch.int64), ids.long()], 1),
                "sampler_weights_step": torch.full((rows,), weights_step, dtype=torch.int64)}


class DPOFeed:
    """A DPOTrainer's training micro-batches to the recorder: the policy's forward, completed by the reference's on the
    same rows (module docstring)."""

    def __init__(self, trainer, recorder):
        self.trainer, self.recorder, self.pending, self.completion = trainer, recorder, None, None
        self.hook = (trainer.ref_model.register_forward_hook(self.reference, with_kwargs=True)
                     if getattr(trainer, "ref_model", None) is not None else None)
        compute = trainer._compute_loss  # before TRL 1.15 the completion mask reaches no forward: read where it goes

        def _compute_loss(model, inputs, *args, **kwargs):
            self.completion = inputs.get("completion_mask") if isinstance(inputs, dict) else None
            return compute(model, inputs, *args, **kwargs)

        trainer._compute_loss = _compute_loss

    def forward(self, module, args, kwargs, output, grad: bool) -> None:
        if grad:
            if self.pending is not None:
                self.recorder.broken = "a DPO micro-batch whose reference forward the recorder did not see"
            ids, labels = kwargs.get("input_ids"), kwargs.get("labels")
            if labels is None and self.completion is not None:  # before TRL 1.15: no labels, its completion mask
                labels = ids.masked_fill(self.completion == 0, -100)
            self.pending = (ids, kwargs.get("attention_mask"), labels, token_log_probs_of(output, ids, labels))
        elif self.pending is not None and self.hook is None:  # PEFT: the reference is the policy with adapters off
            self.reference(module, args, kwargs, output)

    @guarded
    def reference(self, module, args, kwargs, output) -> None:
        if self.pending is None:
            return
        ids, attention, labels, log_probs = self.pending
        self.pending = None
        if not torch.equal(kwargs.get("input_ids"), ids):
            self.recorder.broken = "a DPO reference forward on other rows than its policy forward's"
            return
        pairs = len(ids) // 2
        order = torch.stack([torch.arange(pairs), torch.arange(pairs) + pairs], 1).reshape(-1)
        completion = (labels != -100).long().cpu()
        reference = torch.cat([torch.zeros(len(ids), 1), token_log_probs_of(output, ids, labels).detach().float().cpu()],
                              1)
        pair = torch.arange(pairs, dtype=torch.int64).repeat_interleave(2)
        self.recorder.objective_batch(
            ids[order], completion_mask=completion[order],
            attention_mask=None if attention is None else attention[order], log_probs=log_probs[order],
            ref_logps=reference[order], group=pair)

    def close(self) -> None:
        if self.hook is not None:
            self.hook.remove()
        self.trainer.__dict__.pop("_compute_loss", None)


def token_log_probs_of(output, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A DPO forward's log-prob of each next token [rows, L − 1], zero where no loss is taken: its fused LM head's (TRL
    1.15 on), else its logits' (as TRL's _compute_loss: selective_log_softmax of the shifted logits)."""
    if getattr(output, "log_probs", None) is not None:
        return output.log_probs
    from parity.objectives.causal_lm import token_log_probs

    with torch.no_grad():
        log_probs = token_log_probs(output.logits.detach(), ids)[0]
        return log_probs.masked_fill(labels[:, 1:].to(log_probs.device) == -100, 0.0)


__all__ = ["DPOFeed", "GRPOFeed", "Refused", "SamplerWatch", "kind_of", "plan", "resolved", "trained"]
