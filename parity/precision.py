"""The precision policy's table: one axis, --precision, resolved once into the RunConfig and read by every strategy.
Pure data and the rules that resolve a run's policy from its flags; what carries a policy out (the policy optimizer,
casts, fp16's loss scaler) is the worker's: parity/training/policy_optimizer.py and parity/training/loss_scaler.py.
Every table keyed by policy elsewhere (the --precision choices and help, memory's bytes per parameter, the tolerance
rows) is derived from POLICIES: a new policy is one row here.

A policy says what a run holds and reduces in which dtype (docs/precision.md has the table per strategy):

  fp32         everything fp32
  bf16         torch.autocast(bfloat16) over fp32 parameters: fp32 gradients, master weights and Adam state
  bf16_params  bf16 parameters and gradients (the forward and backward in bf16); fp32 master weights and Adam state
               in the optimizer — DeepSpeed's `bf16.enabled`, FSDP2's MixedPrecisionPolicy(param_dtype=bf16)
  bf16_pure    bf16 parameters, gradients, master weights and Adam state — DeepSpeed's bf16_master_weights_and_grads
               + bf16_optimizer_states (seed 001's setting)
  fp16         fp16 parameters and gradients, fp32 master weights and Adam state, dynamic loss scaling with
               DeepSpeed's rules
  fp16_autocast  torch.autocast(float16) over fp32 parameters, with dynamic loss scaling — torch's AMP recipe
               (GradScaler): Trainer's and accelerate's fp16, Lightning's 16-mixed
  bf16_base    a frozen base in bf16 under fp32 trained parameters, gradients and Adam state, without autocast — peft's
               LoRA adapters over a model loaded in bf16 (its autocast_adapter_dtype default)
  bf16_base_autocast  the same under torch.autocast(bfloat16): the adapters' matrix products in bf16 too — Trainer's
               bf16=True over that model

and three refinements, each recorded: the dtype gradients are reduced over DP in (--reduce_dtype: by default the
gradients' own — bf16 under bf16_params, as DeepSpeed's bf16 mode and FSDP2's policy reduce), the dtype micro-batch
gradients accumulate in under --grad_accum_steps (--grad_accum_dtype, DeepSpeed's data_types.grad_accum_dtype: by
default the gradients' own, or fp32 where they are reduced in fp32 into fp32 masters, as FSDP2 accumulates; fp32 is
possible wherever a master copy exists), and fp16's loss scaler (DeepSpeed's fp16 keys: LossScaling).
The baseline of a comparison runs in the same policy; a run in another policy than its baseline is reported as a
policy difference, not judged as a strategy (parity/comparing/curves.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields

import torch

from parity.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPES.items()}  # torch.bfloat16: "bf16"


@dataclass(frozen=True)
class Policy:
    """What a run holds in which dtype. `params`: the parameters the forward and backward use, and their gradients'
    dtype (autocast's fp32 parameters give fp32 gradients); `master`: the weights the optimizer updates and Adam's
    state."""

    name: str
    params: str
    master: str
    autocast: str | None  # the dtype torch.autocast computes the matrix products in over fp32 parameters (DTYPES)
    reduce_dtypes: tuple[str, ...]  # the dtypes gradients may be reduced over DP in; the first is the default
    loss_scaling: bool
    holds: str  # in words, for notes, reports and the --precision help
    frozen: str | None = None  # the dtype of the parameters no optimizer steps (LoRA's base); None: `params`

    @property
    def frozen_dtype(self) -> str:
        """The dtype the frozen parameters are held and computed with in, by name (DTYPES)."""
        return self.frozen or self.params

    @property
    def frozen_apart(self) -> bool:
        """Whether the frozen parameters are in another dtype than the trained ones (bf16_base): a strategy that casts
        every parameter alike, or sends activations in the parameters' dtype, does not run it."""
        return self.frozen_dtype != self.params

    @property
    def master_copy(self) -> bool:
        """Whether the optimizer steps a copy of the parameters in another dtype (fp32 masters of bf16/fp16 ones)."""
        return self.params != self.master

    @property
    def fp32_twin_measures_noise(self) -> bool:
        """Whether the policy's distance from fp32 is rounding, which the verdict may take as noise (its fp32 twin is a
        noise reference): where the master weights are fp32. bf16 master weights lose every update below 2⁻⁸ of a
        weight, a systematic distance from fp32 that every bf16_pure run shares — 100 × its runs' noise (measured:
        docs/tolerances.md) — so there the twins alone calibrate."""
        return self.master == "fp32"

    @property
    def grad_accum_dtypes(self) -> tuple[str, ...]:
        """The dtypes micro-batch gradients may accumulate in, the first the default: the gradients' own, or fp32 where
        an fp32 master copy holds them."""
        return (self.params, "fp32") if self.master_copy else (self.params,)

    @property
    def compute(self) -> str:
        """The dtype the matrix products run in, by name (DTYPES): a frozen bf16 base's, where the trained parameters
        are only adapters beside it."""
        return self.autocast or self.frozen_dtype

    def compute_dtype(self) -> torch.dtype:
        """The dtype the matrix products run in."""
        return DTYPES[self.compute]


POLICIES = {
    "fp32": Policy("fp32", "fp32", "fp32", None, ("fp32",), False, "fp32 everything"),
    "bf16": Policy("bf16", "fp32", "fp32", "bf16", ("fp32", "bf16"), False,
                   "torch.autocast(bfloat16) over fp32 parameters, gradients, master weights and Adam state"),
    "bf16_params": Policy("bf16_params", "bf16", "fp32", None, ("bf16", "fp32"), False,
                          "bf16 parameters and gradients, fp32 master weights and Adam state"),
    "bf16_pure": Policy("bf16_pure", "bf16", "bf16", None, ("bf16",), False,
                        "bf16 parameters, gradients, master weights and Adam state"),
    "fp16": Policy("fp16", "fp16", "fp32", None, ("fp16", "fp32"), True,
                   "fp16 parameters and gradients, fp32 master weights and Adam state, dynamic loss scaling"),
    "fp16_autocast": Policy("fp16_autocast", "fp32", "fp32", "fp16", ("fp32",), True,
                            "torch.autocast(float16) over fp32 parameters, gradients, master weights and Adam state, "
                            "dynamic loss scaling"),
    "bf16_base": Policy("bf16_base", "fp32", "fp32", None, ("fp32",), False,
                        "a frozen bf16 base under fp32 trained parameters (LoRA's adapters), gradients, master weights "
                        "and Adam state", frozen="bf16"),
    "bf16_base_autocast": Policy("bf16_base_autocast", "fp32", "fp32", "bf16", ("fp32",), False,
                                 "torch.autocast(bfloat16) over a frozen bf16 base and fp32 trained parameters (LoRA's "
                                 "adapters), gradients, master weights and Adam state", frozen="bf16"),
}


@dataclass
class LossScaling:
    """fp16's loss scaler settings: DeepSpeed's fp16 config keys and defaults (deepspeed/runtime/precision_config.py).
    loss_scale > 0: a static scale; 0: dynamic, starting at 2**initial_scale_power. What carries them out is
    parity.training.loss_scaler.LossScaler, whose fields these are."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


LOSS_SCALING_DEFAULTS = {f.name: f.default for f in fields(LossScaling)}
# The settings of a run that make up its policy (the RunConfig's fields): what a comparison requires to be equal.
POLICY_FIELDS = ("precision", "reduce_dtype", "grad_accum_dtype", "loss_scaling")


def policy_of(cfg) -> Policy:
    """The policy of a RunConfig (or anything with .precision resolved)."""
    return POLICIES[cfg.precision]


def describe(settings: dict) -> str:
    """A run's policy in words, from its config (a record's, or a RunConfig's dict): name, what it holds, refinements."""
    name = settings.get("precision")
    if name not in POLICIES:
        return str(name)
    policy = POLICIES[name]
    text = f"{name} ({policy.holds}; reduced over DP in {settings.get('reduce_dtype') or policy.reduce_dtypes[0]}"
    accum = settings.get("grad_accum_dtype")
    if accum and accum != policy.grad_accum_dtypes[0]:
        text += f", micro-batches accumulated in {accum}"
    scaling = settings.get("loss_scaling")
    if scaling and scaling.get("rules") == "GradScaler" and not scaling["loss_scale"]:  # recording/grad_scaler.py's
        text += (f", GradScaler's loss scale from 2^{scaling['initial_scale_power']:g}, × {scaling['growth_factor']:g} "
                 f"after {scaling['loss_scale_window']} good steps, × {scaling['backoff_factor']:g} at an overflow")
    elif scaling:
        text += (f", static loss scale {scaling['loss_scale']:g}" if scaling["loss_scale"] else
                 f", loss scale 2^{scaling['initial_scale_power']} window {scaling['loss_scale_window']} hysteresis "
                 f"{scaling['hysteresis']} min {scaling['min_loss_scale']:g}")
    return text + ")"


@dataclass(frozen=True)
class PolicyRequest:
    """A policy a strategy's own settings ask for: a user's DeepSpeed config (`bf16.enabled`, `fp16`'s keys,
    `communication_data_type`, `data_types.grad_accum_dtype`), or a flag kept from before the axis
    (--mixed_precision policy, --bf16_master_weights). `refines_bf16`: it names one of the bf16 policies, and
    --precision bf16 (the family's name) takes it rather than contradicting it."""

    source: str  # the setting, as the user wrote it: "--deepspeed_config my.json"
    precision: str | None = None
    reduce_dtype: str | None = None
    grad_accum_dtype: str | None = None
    loss_scaling: dict = field(default_factory=dict)  # only the keys it sets
    refines_bf16: bool = True
    soft: bool = False  # its reduce and accumulation dtypes only fill in the flags the user left out


def resolve_policy(s: dict, request: PolicyRequest | None) -> None:
    """Merge a strategy's `request` into the run's flags `s` (precision, reduce_dtype, grad_accum_dtype and the loss
    scaler's keys), in place: a flag the user gave and the request agree, or ConfigError in one line. --precision
    auto stays auto here (the device decides it later: `complete_policy`)."""
    if request is None:
        return
    wanted = request.precision
    if wanted is not None and s["precision"] != wanted:
        if s["precision"] == "auto":
            s["precision"] = wanted
        elif s["precision"] == "bf16" and wanted.startswith("bf16") and request.refines_bf16:
            print(f"note: {request.source}: the run's policy is {wanted} ({POLICIES[wanted].holds}), one of the bf16 "
                  f"policies --precision bf16 names (bf16 alone is autocast over fp32 parameters); its baseline runs in "
                  f"{wanted} too", file=sys.stderr, flush=True)
            s["precision"] = wanted
        else:
            raise ConfigError(f"{request.source} asks for the {wanted} policy ({POLICIES[wanted].holds}) but --precision "
                              f"is {s['precision']}: pass --precision {wanted} (or drop --precision), or change the "
                              f"setting")
    for key in ("reduce_dtype", "grad_accum_dtype"):
        value = getattr(request, key)
        if request.soft and s[key] is not None:
            continue
        if value is not None and s[key] not in (None, value):
            raise ConfigError(f"{request.source} sets the {key.replace('_', ' ')} {value} but --{key} is {s[key]}: "
                              f"give one of them")
        if value is not None:
            s[key] = value
    for key, value in request.loss_scaling.items():
        if s[key] is not None and s[key] != value:
            raise ConfigError(f"{request.source} sets fp16's {key} {value} but --{key} is {s[key]}: give one of them")
        s[key] = value


def complete_policy(s: dict) -> None:
    """The run's policy fields from its flags `s`, in place, once --precision is no longer auto: reduce_dtype and
    grad_accum_dtype get the policy's defaults, the loss scaler's keys become one `loss_scaling` dict (fp16 only; None
    otherwise). ConfigError in one line for a refinement the policy does not have."""
    policy = POLICIES[s["precision"]]
    s["reduce_dtype"] = s["reduce_dtype"] or policy.reduce_dtypes[0]
    if s["reduce_dtype"] not in policy.reduce_dtypes:
        raise ConfigError(f"--reduce_dtype {s['reduce_dtype']} is not a reduction of the {policy.name} policy "
                          f"({policy.holds}): use {' or '.join(policy.reduce_dtypes)}")
    # By default micro-batches accumulate in the gradients' dtype, or in fp32 where they are reduced in fp32 into fp32
    # masters (as FSDP2 accumulates in its reduce dtype).
    wider = "fp32" if policy.master_copy and s["reduce_dtype"] == "fp32" else policy.grad_accum_dtypes[0]
    s["grad_accum_dtype"] = s["grad_accum_dtype"] or wider
    if s["grad_accum_dtype"] not in policy.grad_accum_dtypes:
        raise ConfigError(f"--grad_accum_dtype {s['grad_accum_dtype']}: the {policy.name} policy accumulates gradients "
                          f"in {' or '.join(policy.grad_accum_dtypes)}")
    given = {k: s.pop(k) for k in LOSS_SCALING_DEFAULTS}
    if not policy.loss_scaling:
        named = [k for k, v in given.items() if v is not None]
        if named:
            raise ConfigError(f"--{named[0]} sets fp16's loss scaler but the policy is {policy.name}: pass --precision "
                              f"fp16, or drop it")
        s["loss_scaling"] = None
        return
    scaling = {k: LOSS_SCALING_DEFAULTS[k] if v is None else v for k, v in given.items()}
    if scaling["loss_scale"] < 0 or scaling["min_loss_scale"] <= 0 or scaling["loss_scale_window"] < 1 or \
            scaling["hysteresis"] < 1:
        raise ConfigError("fp16's loss scaler: --loss_scale must be 0 (dynamic) or positive, --min_loss_scale positive, "
                          "--loss_scale_window and --hysteresis at least 1")
    s["loss_scaling"] = scaling
