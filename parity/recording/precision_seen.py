"""The precision a run is seen to train in, beside the one its recorder was told: a record told "fp32" whose forward
ran under torch.autocast(bfloat16) is replayed without it and FAILs at many times its bound — a false alarm of the
recorder's making, not the run's (found by the false-alarm campaign: docs/false_alarms.md).
- At the start, a run whose own settings say its precision — a DeepSpeed engine's config (its bf16, fp16 or
  torch_autocast section, with its reduce and accumulation dtypes and loss scaler), a framework's (accelerate's
  mixed_precision: the registry's `precision_of`) — gives it to a recorder told none, and refuses one told another.
- At the first training forward, where the record's policy keeps fp32 parameters (fp32, bf16), the autocast (enabled,
  dtype) is read inside the model — a pre-hook on its first module holding parameters, under any wrapper that enters
  autocast around the model's forward (accelerate's, Lightning's, the loop's own) — and a mismatch ends the record in
  one line naming the precision to pass. A frozen bf16 base under fp32 adapters (bf16_base, read from the parameters)
  takes the autocast seen instead: under torch.autocast(bfloat16) — Trainer's bf16=True over it — it is
  bf16_base_autocast (`sibling`). FSDP1 accumulating without no_sync adds its shards in fp32, which its wrapper's
  state says at that forward too (View.accumulated_in). The hook removes itself after that one forward."""

from __future__ import annotations

import torch

from parity.errors import ConfigError
from parity.precision import LOSS_SCALING_DEFAULTS, NAME_OF_DTYPE, POLICIES, PolicyRequest
from parity.views.table import policy_request


def told(precision: str | None, model) -> tuple[dict, str | None]:
    """The record's policy settings (POLICY_FIELDS: its name, reduce and accumulation dtypes, loss scaler) and a
    refusal (None: none). The policy is `precision` as told; where told none, the one the run's own settings say — a
    DeepSpeed engine's config (a view's: views/table.policy_request), else the framework's (accelerate's) — else
    fp32; where they say another, refused in one line ("bf16" told of a DeepSpeed engine's bf16 mode names its family,
    as --precision bf16 does of a strategy's: the engine's refinement is taken). The refinements are the engine's
    config's, else the policy's defaults."""
    from parity.frameworks import precision_of

    try:
        request = policy_request(model)
    except ConfigError as exc:
        return settings_of(precision or "fp32", None), str(exc)
    said = (request.source, request.precision) if request is not None and request.precision else precision_of(model)
    if precision is None or (said is not None and precision == "bf16" and said[1].startswith("bf16") and
                             request is not None and request.refines_bf16):
        return reduced(settings_of(said[1] if said else "fp32", request), request)
    if said is not None and said[1] != precision:
        return settings_of(precision, None), (f"precision {precision!r} told, but {said[0]} trains the model in "
                                              f"{said[1]!r}: pass precision={said[1]!r}, or leave it out")
    return reduced(settings_of(precision, request), request)


def reduced(settings: dict, request: PolicyRequest | None) -> tuple[dict, str | None]:
    """`settings` and the refusal of a reduce dtype the run's own settings ask for (a DDP hook's: views/data_parallel)
    that its policy does not reduce in (None: it does)."""
    policy = POLICIES.get(settings["precision"])
    if request is None or policy is None or settings["reduce_dtype"] in policy.reduce_dtypes:
        return settings, None
    return settings, (f"{request.source} reduces the gradients in {settings['reduce_dtype']}, which the "
                      f"{policy.name} policy ({policy.holds}) does not: the replay reduces it in "
                      f"{' or '.join(policy.reduce_dtypes)}; record the run without it")


def settings_of(precision: str, request: PolicyRequest | None) -> dict:
    """The record's POLICY_FIELDS for policy `precision`: a request's reduce and accumulation dtypes and loss scaler
    where it sets them, else the policy's defaults (an unknown name is kept, for the recorder's own refusal)."""
    policy = POLICIES.get(precision)
    request = request or PolicyRequest("")
    return {"precision": precision,
            "reduce_dtype": request.reduce_dtype or (policy.reduce_dtypes[0] if policy else None),
            "grad_accum_dtype": request.grad_accum_dtype or (policy.grad_accum_dtypes[0] if policy else None),
            "loss_scaling": {**LOSS_SCALING_DEFAULTS, **request.loss_scaling} if policy and policy.loss_scaling
            else None}


def mismatch(policy: str, enabled: bool, dtype: torch.dtype) -> str | None:
    """The line where an fp32-parameter policy's autocast is not the one seen (None: it is, or the policy holds
    low-precision parameters, whose forward may autocast or not alike)."""
    wanted = POLICIES[policy]
    if wanted.params != "fp32":
        return None
    seen = NAME_OF_DTYPE.get(dtype, str(dtype)) if enabled else None
    if seen == (wanted.compute if wanted.autocast else None):
        return None
    fits = next((p.name for p in POLICIES.values() if p.params == "fp32" and p.autocast == seen and
                 p.frozen_apart == wanted.frozen_apart), None)
    fix = f"pass precision={fits!r}" if fits else \
        "the harness replays a frozen bf16 base under fp32 adapters without autocast or under " \
        "torch.autocast(bfloat16) only" if wanted.frozen_apart else \
        "the harness replays autocast in bfloat16 and float16 only"
    return (f"the forward ran {f'under torch.autocast({seen})' if seen else 'without autocast'}, but the recorder was "
            f"told precision={policy!r}: {fix}")


def sibling(policy: str, enabled: bool, dtype: torch.dtype) -> str | None:
    """Where `policy` holds a frozen base apart from what trains (bf16_base: read from the parameters, which say nothing
    of autocast), the policy holding the same under the autocast seen (None: none, or `policy` is not such)."""
    wanted = POLICIES[policy]
    seen = NAME_OF_DTYPE.get(dtype) if enabled else None
    return next((p.name for p in POLICIES.values() if wanted.frozen_apart and p.autocast == seen and
                 (p.params, p.master, p.frozen_dtype) == (wanted.params, wanted.master, wanted.frozen_dtype)), None)


def watch(view, config: dict, on_mismatch) -> torch.utils.hooks.RemovableHandle | None:
    """A forward pre-hook on the first module holding parameters of `view`'s model: at the first training forward, sets
    the record's `config` accumulation dtype to the one the view sees (View.accumulated_in: FSDP1 without no_sync) and,
    where the policy keeps fp32 parameters, its precision to the policy that takes the autocast seen (`sibling`), else
    calls `on_mismatch(line)` where the autocast seen is not its policy's; then removes itself. None where nothing can
    be watched (not a torch module, no parameters)."""
    model, policy = view.model, config["precision"]
    if not isinstance(model, torch.nn.Module):
        return None
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if first is None:
        return None
    kind = next(first.parameters(recurse=False)).device.type

    def seen(module, args):
        if not (module.training and torch.is_grad_enabled()):
            return
        handle.remove()
        config["grad_accum_dtype"] = view.accumulated_in() or config["grad_accum_dtype"]
        if POLICIES[policy].params != "fp32":  # low-precision parameters: their forward may autocast or not alike
            return
        enabled, dtype = torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)
        taken = sibling(policy, enabled, dtype)
        line = None if taken else mismatch(policy, enabled, dtype)
        if taken:
            config["precision"] = taken
        elif line:
            on_mismatch(line)

    handle = first.register_forward_pre_hook(seen)
    return handle
