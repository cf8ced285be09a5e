"""The objective: a run's fourth axis, beside layout, model and precision — what a step's gradient is the gradient of.
One room, as the model families and the precision policies are: the definitions (this table), each written from its
paper and the trainers' documentation (docs/posttrain.md has the formulas and sources), with its settings and its
invariance class; their runtime (grpo.py, dpo.py, causal_lm.py: a micro-batch's loss from its logits and rows, and
the step's quantities); the rollout file a run trains on (rollouts.py).

A run's objective is resolved once (`resolve_objective`) into the frozen RunConfig's `objective` field — {"name",
"settings"}, every setting filled — recorded with the run and named in its fingerprint. None is the causal-LM token
mean, today's loss: its records are as they were.

The invariance class of a definition says which splits of a step's batch leave the step's gradient unchanged by
definition (`Invariance`):
- RANKS_MICRO: the step's rows spread over DP ranks × micro-batches in any way (the token mean, dapo's global token
  count, grpo's mean over the step's sequences, DPO's mean over its pairs);
- GENERATION: a generation batch consumed over one or several optimizer steps (a normaliser of the step's own rows;
  not the generation batch's tokens ÷ its steps, `normalizer="generation"`).
A definition with a term of each micro-batch's own (bnpo's token mean, the entropy bonus, DPO's sft term) depends on
the split by definition: it is trained, replayed and calibrated at the record's own split only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from parity.errors import ConfigError

CAUSAL_LM = "causal_lm"
RANKS_MICRO = "ranks × micro-batches"
GENERATION = "a generation batch over several optimizer steps"

DAPO, GRPO_PAPER, DR_GRPO = ("DAPO, arXiv 2503.14476", "DeepSeekMath (GRPO), arXiv 2402.03300",
                             "Understanding R1-Zero-Like Training (Dr. GRPO), arXiv 2503.20783")
TRL_GRPO = "TRL 1.16 GRPOConfig documentation (loss_type, importance_sampling_level, use_bias_correction_kl)"
TRL_DPO = "TRL 1.16 DPOConfig documentation (loss_type, f_divergence_type, ld_alpha)"
RLOO_PAPER = "Back to Basics (RLOO), arXiv 2402.14740"
TRL_RLOO = "TRL 1.16 RLOOTrainer documentation (its loss: the sequence-level clipped surrogate; β in the rewards)"


@dataclass(frozen=True)
class Setting:
    """One setting of a definition: its name (the trainer's argument name, as users type it), its default, and its
    kind; `refused`: a setting the reference cannot compute except at its default — why, in words."""

    name: str
    default: object
    kind: type
    words: str
    refused: str | None = None
    choices: tuple = ()


@dataclass(frozen=True)
class Definition:
    """One objective: its family ("causal_lm", "grpo", "dpo"), its formula in words (docs/posttrain.md has it in
    symbols), its sources and its settings."""

    name: str
    family: str
    formula: str
    sources: tuple[str, ...]
    settings: tuple[Setting, ...] = ()


@dataclass(frozen=True)
class Invariance:
    """The splits a definition's step gradient is invariant to (RANKS_MICRO, GENERATION), and its terms of each
    micro-batch's own (why it is not invariant to RANKS_MICRO), in words."""

    splits: tuple[str, ...]
    split_terms: tuple[str, ...] = ()

    @property
    def depends_on_split(self) -> bool:
        return RANKS_MICRO not in self.splits

    def note(self, objective: str) -> str | None:
        """One line for a report, where the definition depends on the split; None where it does not."""
        if not self.depends_on_split:
            return None
        return (f"{objective} depends on the split by definition ({'; '.join(self.split_terms)}): trained and judged "
                f"at the run's own split of ranks × micro-batches only")


# --- the GRPO family: TRL 1.16's loss_type values, each a definition ----------------------------------------------
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's vllm_importance_sampling_mode
_CLIP = (Setting("epsilon", 0.2, float, "ε_low: the ratio is clipped below at 1 − ε_low"),
         Setting("epsilon_high", None, float, "ε_high: clipped above at 1 + ε_high (default ε_low); cispo: the cap "
                                             "ε_max of the importance weight itself"),
         Setting("delta", None, float, "two-sided clipping (INTELLECT-2): the unclipped ratio capped at δ"))
_COMMON = (Setting("beta", 0.0, float, "β: the weight of the k3 KL estimate to the reference, per token"),
           Setting("use_bias_correction_kl", True, bool, "the KL term × the importance ratio (DeepSeek-V3.2's unbiased "
                                                         "estimator; TRL 1.16's default)"),
           Setting("importance_sampling_level", "token", str, "token: one ratio per token; sequence: GSPO's one ratio "
                                                              "per sequence, exp of the mean token log-ratio",
                   choices=("token", "sequence")),
           Setting("mask_truncated_completions", False, bool, "rows whose completion was cut at the length limit count "
                                                              "nothing, in the loss and in every normaliser"),
           Setting("temperature", 1.0, float, "T: the policy's log-probs are its logits ÷ T's, at the temperature the "
                                              "completions were sampled at (TRL's temperature)"),
           Setting("entropy_coef", 0.0, float, "the entropy bonus: − coef × each micro-batch's mean token entropy "
                                               "(depends on the split)"),
           Setting("top_entropy_quantile", 1.0, float, "", refused="the top-entropy token mask is a quantile over the "
                                                                   "ranks' tokens"),
           Setting("use_adaptive_entropy", False, bool, "", refused="adaptive entropy control changes its coefficient "
                                                                    "from the run's own history"),
           Setting("off_policy_mask_threshold", None, float, "", refused="off-policy sequence masking needs the "
                                                                          "sampler's log-probs"),
           Setting("vllm_importance_sampling_correction", False, bool, "each token's policy loss × TRL's importance "
                   "weight of π_old to the sampler (the rollouts' sampler_logps), capped or masked by the mode"),
           Setting("vllm_importance_sampling_mode", "sequence_mask", str, "token_*: one weight per token; sequence_*: "
                   "exp of the sequence's summed log-ratio; *_truncate clamps it to [clip_min, clip_max], *_mask "
                   "zeroes it outside", choices=IS_MODES),
           Setting("vllm_importance_sampling_clip_min", None, float, "the weight's lower bound (none: unbounded)"),
           Setting("vllm_importance_sampling_clip_max", 3.0, float, "the weight's upper bound (TRL's C_max)"))
_TOKENS = Setting("normalizer", "step", str, "step: the step's own completion tokens (DAPO); generation: the "
                                             "generation batch's tokens ÷ the optimizer steps it spans (TRL ≥ PR #6024)",
                  choices=("step", "generation"))
_SAPO = (Setting("sapo_temperature_pos", 1.0, float, "τ for a positive advantage"),
         Setting("sapo_temperature_neg", 1.05, float, "τ for a zero or negative advantage"))
_VESPO = (Setting("vespo_k_pos", 2.0, float, "k for a non-negative advantage"),
          Setting("vespo_lambda_pos", 3.0, float, "λ for a non-negative advantage"),
          Setting("vespo_k_neg", 3.0, float, "k for a negative advantage"),
          Setting("vespo_lambda_neg", 2.0, float, "λ for a negative advantage"))
_LENGTH = Setting("max_completion_length", None, int, "L: the constant Dr. GRPO divides by (the completion limit)")
_RLOO = _CLIP[:2] + tuple(s for s in _COMMON if s.name in ("mask_truncated_completions", "temperature"))

GRPO_FAMILY = {
    "grpo": Definition("grpo", "grpo", "clipped surrogate + β KL per token; each sequence's token mean, averaged over "
                       "the step's sequences", (GRPO_PAPER, TRL_GRPO), _CLIP + _COMMON),
    "bnpo": Definition("bnpo", "grpo", "clipped surrogate + β KL per token; each micro-batch's token mean, averaged "
                       "over the step's micro-batches", (TRL_GRPO,), _CLIP + _COMMON),
    "dr_grpo": Definition("dr_grpo", "grpo", "clipped surrogate + β KL per token, summed over the step ÷ (sequences × "
                          "L)", (DR_GRPO, TRL_GRPO), _CLIP + _COMMON + (_LENGTH,)),
    "dapo": Definition("dapo", "grpo", "clipped surrogate (ε_low, ε_high) + β KL per token, summed over the step ÷ "
                       "its completion tokens", (DAPO, TRL_GRPO), _CLIP + _COMMON + (_TOKENS,)),
    "cispo": Definition("cispo", "grpo", "− sg(min(ratio, ε_max)) · A · log π per token + β KL, ÷ the step's "
                        "completion tokens", ("MiniMax-M1, arXiv 2506.13585", "ScaleRL, arXiv 2510.13786", TRL_GRPO),
                        _CLIP + _COMMON + (_TOKENS,)),
    "sapo": Definition("sapo", "grpo", "− σ(τ(ratio − 1)) · 4/τ · A per token + β KL; each sequence's token mean, "
                       "averaged over the step's sequences", ("SAPO, arXiv 2511.20347", TRL_GRPO),
                       _CLIP + _COMMON + _SAPO),
    "luspo": Definition("luspo", "grpo", "GSPO's sequence-level clipped surrogate × the sequence's length (+ β KL per "
                        "token), summed per sequence, averaged over the step's sequences", ("LUSPO, arXiv 2602.05261",
                        "GSPO, arXiv 2507.18071", TRL_GRPO), _CLIP + _COMMON),
    "vespo": Definition("vespo", "grpo", "− sg(φ(w)) · A · log π per token + β KL, φ(w) = w^k e^{λ(1 − w)} of the "
                        "sequence's importance weight w, ÷ the step's completion tokens", ("VESPO, arXiv 2602.10693",
                        TRL_GRPO), _CLIP + _COMMON + _VESPO + (_TOKENS,)),
    "rloo": Definition("rloo", "grpo", "− min(r A, clip(r, 1 − ε_low, 1 + ε_high) A) per sequence, r = exp of the "
                       "sequence's summed token log-ratio; averaged over the step's sequences (the KL to the reference "
                       "is in the rewards, so in A)", (RLOO_PAPER, TRL_RLOO), _RLOO),
}

# --- the DPO family: one definition, TRL 1.16's loss_type values (a list, weighted) --------------------------------
PER_PAIR = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
            "apo_down", "discopop", "sigmoid_norm")
MICRO_BATCH_TYPES = ("sft",)  # a term of each micro-batch's own: the chosen completions' token mean NLL
NOT_PER_PAIR = {"aot": "sorts the log-ratios of a micro-batch's pairs", "aot_unpaired": "sorts the log-ratios of a "
                "micro-batch's chosen and rejected completions apart"}
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
DPO = Definition("dpo", "dpo", "the mean over the step's pairs of each loss type's per-pair loss of the policy's and "
                 "reference's sequence log-ratios, weighted; sft: each micro-batch's chosen-token mean NLL",
                 ("DPO, arXiv 2305.18290", "IPO, arXiv 2310.12036", "f-DPO, arXiv 2309.16240", TRL_DPO),
                 (Setting("loss_type", ("sigmoid",), tuple, "the loss types, combined with loss_weights"),
                  Setting("loss_weights", None, tuple, "one weight per loss type (default 1 each)"),
                  Setting("beta", 0.1, float, "β (IPO's τ)"),
                  Setting("label_smoothing", 0.0, float, "robust: the flip probability ε; exo_pair: its ε"),
                  Setting("f_divergence_type", "reverse_kl", str, "f-DPO's divergence", choices=F_DIVERGENCES),
                  Setting("f_alpha_divergence_coef", 0.5, float, "α of the α-divergence"),
                  Setting("ld_alpha", None, float, "LD-DPO: the tokens past the shorter completion's length weigh α"),
                  Setting("discopop_tau", 0.05, float, "DiscoPOP's τ"),
                  Setting("use_weighting", False, bool, "", refused="WPO's weights need each position's Σ p², which "
                                                                    "the reference does not compute yet")))

CAUSAL = Definition(CAUSAL_LM, CAUSAL_LM, "next-token cross-entropy summed over the step's loss tokens ÷ their number",
                    ("the harness's own loss (parity/objectives/causal_lm.py)",))

DEFINITIONS = {CAUSAL_LM: CAUSAL, **GRPO_FAMILY, "dpo": DPO}


def _typed(definition: Definition, setting: Setting, value):
    where = f"--objective {definition.name}: {setting.name}"
    if value is None:
        return None
    try:
        if setting.kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return value.lower() in ("true", "1")
            return bool(value)
        if setting.kind is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(float(v) if setting.name == "loss_weights" else str(v) for v in items)
        typed = setting.kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={value!r} is not a {setting.kind.__name__}: give one") from None
    if isinstance(typed, float) and not math.isfinite(typed):
        raise ConfigError(f"{where} must be finite (got {value})")
    if setting.choices and typed not in setting.choices:
        raise ConfigError(f"{where}={typed} is not one of {', '.join(setting.choices)}")
    return typed


def resolve_objective(name: str | None, given: dict | None = None) -> dict | None:
    """The RunConfig's `objective` from --objective NAME and its settings (`given`, name → value, strings or typed):
    {"name", "settings"} with every setting filled in, or None for the causal-LM token mean. ConfigError in one line
    for an unknown name or setting, a value out of its range, or a setting the reference cannot compute."""
    given = dict(given or {})
    if name in (None, CAUSAL_LM):
        if given:
            raise ConfigError(f"--objective_args {', '.join(sorted(given))}: the causal-LM token mean has no settings")
        return None
    if name not in DEFINITIONS:
        raise ConfigError(f"--objective {name} is not a known objective: use one of {', '.join(DEFINITIONS)} "
                          f"(docs/posttrain.md)")
    definition = DEFINITIONS[name]
    known = {s.name: s for s in definition.settings}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"--objective {name} has no setting {unknown[0]}: its settings are {', '.join(known)}")
    settings = {}
    for s in definition.settings:
        value = _typed(definition, s, given[s.name]) if s.name in given else s.default
        if s.refused and value != s.default:
            raise ConfigError(f"--objective {name}: {s.name}={value} cannot be computed by the reference ({s.refused}): "
                              f"leave it at {s.default}")
        settings[s.name] = list(value) if isinstance(value, tuple) else value
    (_check_grpo if definition.family == "grpo" else _check_dpo)(name, settings)
    return {"name": name, "settings": settings}


def _check_grpo(name: str, s: dict) -> None:
    if s["epsilon_high"] is None:
        s["epsilon_high"] = s["epsilon"]
    for key in ("epsilon", "epsilon_high", "beta", "entropy_coef"):  # (rloo has neither β nor an entropy bonus)
        if s.get(key, 0.0) < 0:
            raise ConfigError(f"--objective {name}: {key} must be 0 or positive (got {s[key]})")
    if s["temperature"] <= 0:
        raise ConfigError(f"--objective {name}: temperature must be positive (got {s['temperature']})")
    if s.get("delta") is not None and s["delta"] <= 1:
        raise ConfigError(f"--objective {name}: delta caps the ratio and must be above 1 (got {s['delta']})")
    if name == "luspo" and s["importance_sampling_level"] != "sequence":
        raise ConfigError("--objective luspo is defined on sequence-level ratios: set importance_sampling_level=sequence")
    if name == "vespo" and s["vllm_importance_sampling_correction"]:
        raise ConfigError("--objective vespo takes TRL's vLLM importance weight into its own sequence weight, which "
                          "the reference does not compute: set vllm_importance_sampling_correction=False")
    if name == "vespo" and s["importance_sampling_level"] != "token":
        raise ConfigError("--objective vespo computes its sequence weight itself: leave importance_sampling_level=token")
    if name == "dr_grpo" and (s["max_completion_length"] is None or s["max_completion_length"] < 1):
        raise ConfigError("--objective dr_grpo divides by sequences × L: give max_completion_length=L (the completion "
                          "limit the rollouts were generated with)")
    if name in ("sapo",) and min(s["sapo_temperature_pos"], s["sapo_temperature_neg"]) <= 0:
        raise ConfigError("--objective sapo: its temperatures must be positive")


def _check_dpo(name: str, s: dict) -> None:
    types = list(s["loss_type"])
    for t in types:
        if t in NOT_PER_PAIR:
            raise ConfigError(f"--objective dpo: loss_type {t} {NOT_PER_PAIR[t]}: it is not defined per pair, and the "
                              f"reference computes only what is (use one of {', '.join(PER_PAIR)}, or sft)")
        if t not in PER_PAIR + MICRO_BATCH_TYPES:
            raise ConfigError(f"--objective dpo: loss_type {t} is not one of TRL 1.16's: use "
                              f"{', '.join(PER_PAIR + MICRO_BATCH_TYPES)}")
    weights = s["loss_weights"] if s["loss_weights"] is not None else [1.0] * len(types)
    if len(weights) != len(types):
        raise ConfigError(f"--objective dpo: {len(weights)} loss_weights for {len(types)} loss types: give one each")
    s["loss_weights"] = [float(w) for w in weights]
    if s["beta"] <= 0:
        raise ConfigError(f"--objective dpo: beta must be positive (got {s['beta']})")
    smoothing = s["label_smoothing"]
    if "robust" in types and not 0 <= smoothing < 0.5:
        raise ConfigError(f"--objective dpo: robust's label_smoothing is a flip probability in [0, 0.5) (got "
                          f"{smoothing})")
    if "exo_pair" in types and not 0 < smoothing < 1:
        raise ConfigError(f"--objective dpo: exo_pair needs label_smoothing ε in (0, 1) (got {smoothing}); EXO "
                          f"recommends 1e-3")
    if s["ld_alpha"] is not None and not 0 <= s["ld_alpha"] <= 1:
        raise ConfigError(f"--objective dpo: ld_alpha must be in [0, 1] (got {s['ld_alpha']})")
    if s["f_divergence_type"] != "reverse_kl" and any(t in ("nca_pair", "bco_pair", "sppo_hard", "apo_zero",
                                                             "apo_down") for t in types):
        raise ConfigError("--objective dpo: only the loss types of the chosen-rejected difference take an "
                          "f_divergence_type other than reverse_kl")


def definition_of(objective: dict | None) -> Definition:
    """The definition of a RunConfig's (or record's) `objective` field."""
    return DEFINITIONS[CAUSAL_LM if objective is None else objective["name"]]


def invariance_of(objective: dict | None) -> Invariance:
    """The splits `objective` (a RunConfig's field) leaves its step gradient invariant to, by definition."""
    both = (RANKS_MICRO, GENERATION)
    if objective is None:
        return Invariance(both)
    name, s = objective["name"], objective["settings"]
    terms = []
    if name == "bnpo":
        terms.append("bnpo: each micro-batch's own token mean")
    if s.get("entropy_coef"):
        terms.append("the entropy bonus: each micro-batch's mean token entropy")
    if name == "dpo" and "sft" in s["loss_type"]:
        terms.append("sft: each micro-batch's chosen-token mean")
    splits = tuple(x for x in both if not (x == RANKS_MICRO and terms)
                   and not (x == GENERATION and s.get("normalizer") == "generation"))
    return Invariance(splits, tuple(terms))


def micro_rows(config: dict) -> int:
    """The rows of each micro-batch a run's config (a record's, or RunConfig.to_dict()) splits its step into: a DP
    rank's rows ÷ its micro-batches (--grad_accum_steps, or a pipeline's --microbatches). The step's rows go to the
    micro-batches in order, so this is the partition a split-dependent definition is defined at: dp 2 × GA 2 and dp 1
    × GA 4 of one global batch are the same partition."""
    options = config.get("options") or {}
    return config["batch_size"] // (options.get("microbatches") or config.get("grad_accum_steps") or 1)


def twin_accumulation(objective: dict | None, rows_per_micro: int, twin_rows: int) -> int | None:
    """The --grad_accum_steps of a noise reference holding `twin_rows` rows a rank beside a baseline of `rows_per_micro`
    rows a micro-batch, at a split the definition allows: the baseline's micro-batches where it depends on the split,
    else one micro-batch (of whole pairs, for DPO); None where there is none."""
    if invariance_of(objective).depends_on_split:
        return twin_rows // rows_per_micro if twin_rows % rows_per_micro == 0 else None
    return None if objective is not None and objective["name"] == "dpo" and twin_rows % 2 else 1


def describe(objective: dict | None) -> str:
    """An objective in words for reports and logs: its name and the settings that differ from the defaults."""
    definition = definition_of(objective)
    if objective is None:
        return f"{CAUSAL_LM} (the token mean of next-token cross-entropy)"
    defaults = {s.name: s.default for s in definition.settings}
    changed = {k: v for k, v in objective["settings"].items()
               if v != defaults.get(k) and not (isinstance(v, list) and tuple(v) == defaults.get(k))}
    return objective["name"] + (f" ({json.dumps(changed, sort_keys=True)})" if changed else "")


def objective_flags(objective: dict | None, dataset: str) -> dict:
    """The --objective, --objective_args and --rollouts flags that resolve to a run's `objective` and rollout data (its
    config's `dataset`, "rollouts:PATH"): what a replay of the run passes on (the layer check's --replay). None."""
    flags = {"rollouts": dataset.split(":", 1)[1]} if dataset.startswith("rollouts:") else {}
    if objective is not None:
        flags.update(objective=objective["name"], objective_args=[
            f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in objective["settings"].items()
            if v is not None])
    return flags


def parse_settings(pairs) -> dict:
    """--objective_args KEY=VALUE ... → {key: value as typed}; ConfigError in one line for a pair without '='."""
    settings = {}
    for pair in pairs or ():
        key, sep, value = str(pair).partition("=")
        if not sep or not key:
            raise ConfigError(f"--objective_args {pair}: give KEY=VALUE (e.g. beta=0.04)")
        settings[key.strip()] = value.strip()
    return settings
