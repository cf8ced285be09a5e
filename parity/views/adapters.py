"""A user's LoRA run, read for its record (docs/own_trainer/techniques.md#lora): the adapters' settings as the harness's own
(RunConfig.lora: parity/models/adapters.py), and the initial weights split as a harness LoRA run keeps them — the base
under a stock model's names in the init-weights file, the adapters in their file beside it — so that the replay builds
the same PEFT model from them (`add_adapters` on the base, then the recorded adapters) and trains the adapters alone.

peft injects its adapters in place: a PeftModel's `base_model.model` is the Hugging Face model, which carries the
settings (`peft_config`, also where `inject_adapter_in_model` put adapters without a PeftModel). The recorder reads
that inner model, so every name it records is the harness's: `model.layers.0.self_attn.q_proj.base_layer.weight`,
`...q_proj.lora_A.default.weight`.

What the replay cannot build is refused in one line (AdaptersRefused, which the view raises as its ViewRefused:
the recorder records nothing, the training goes on): dropout above 0 (the replay cannot draw the run's masks), any
setting that changes the adapters beyond r, alpha, the targeted modules and the modules saved whole (DoRA, rsLoRA,
rank or alpha patterns, biases ...), adapters on only some of the targeted modules, a parameter trained beside the
adapters, several adapters or one not named "default", a tied embedding saved without ensure_weight_tying.
"""

from __future__ import annotations

import sys

from parity.errors import ConfigError

# LoraConfig fields that do not change what trains: the recorded settings themselves (r, alpha, dropout: compared on
# their own; the targets: through the modules that hold adapters), the initialisation (the recorded initial weights
# are what trains, whatever drew them) and bookkeeping.
SETTLED = frozenset({"r", "lora_alpha", "lora_dropout", "target_modules", "init_lora_weights", "loftq_config",
                     "eva_config", "corda_config", "lora_ga_config", "task_type", "peft_type", "auto_mapping",
                     "peft_version", "base_model_name_or_path", "revision", "inference_mode", "modules_to_save",
                     "ensure_weight_tying"})  # the saved modules: read off the modules, their tying checked (lora_of)


class AdaptersRefused(ValueError):
    """LoRA adapters the replay cannot build: one line (table.view_of refuses the view with it)."""


def peft_inner(module) -> tuple:
    """(the Hugging Face model inside peft's PeftModel — `base_model.model`, the adapters injected in place — and
    the prefix of that model's names among the PeftModel's, "base_model.model."); (`module`, "") for any other
    module."""
    if "peft" not in sys.modules:  # a PeftModel's process has imported peft: no import for a run without one
        return module, ""
    from peft import PeftModel

    return (module.base_model.model, "base_model.model.") if isinstance(module, PeftModel) else (module, "")


def lora_of(model, names: dict[int, str]) -> dict | None:
    """The run's adapters as RunConfig.lora's settings ({"r", "alpha", "dropout": 0.0, "targets"}), read from the
    settings peft left on `model` (the Hugging Face model a view reads; `names`: its parameters' harness names by id)
    and checked to be what the harness builds from them; None for a model without adapters. AdaptersRefused, one line,
    for adapters the replay cannot build."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    if len(configs) != 1:
        raise AdaptersRefused(f"the model holds {len(configs)} PEFT adapters ({', '.join(configs)}): the recorder "
                              f"follows one")
    (adapter, config), = configs.items()
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind != "LORA":
        raise AdaptersRefused(f"a PEFT model of type {kind}: the harness builds LoRA adapters only")
    if config.lora_dropout:
        raise AdaptersRefused(f"LoRA dropout {config.lora_dropout} (lora_dropout): the replay cannot draw the dropout "
                              f"masks your run drew, so it would train other adapters; train with lora_dropout=0")
    from parity.models.adapters import ADAPTER_NAME, SAVED_COPY, lora_settings, peft_config

    if adapter != ADAPTER_NAME:
        raise AdaptersRefused(f"the adapter is named {adapter!r}: the harness names its one adapter {ADAPTER_NAME!r} "
                              f"(get_peft_model's default), and every adapter tensor's name holds it")
    ours = peft_config({"r": 1, "alpha": 1.0, "dropout": 0.0, "targets": ["q_proj"]}).to_dict()
    theirs = config.to_dict()
    odd = next((k for k in sorted(set(ours) | set(theirs)) if k not in SETTLED and theirs.get(k) != ours.get(k)), None)
    if odd is not None:
        raise AdaptersRefused(f"the LoRA adapters set {odd}={theirs.get(odd)!r}, which the harness's adapters do not "
                              f"(they are peft's defaults but for r, lora_alpha and target_modules): the replay cannot "
                              f"build them")
    lora_a = f".lora_A.{ADAPTER_NAME}."  # in the name of each adapted module's first adapter: its module's last part
    targets = sorted({name.split(lora_a)[0].rsplit(".", 1)[-1] for name in names.values() if lora_a in name})
    saved = sorted({name.split(SAVED_COPY)[0].rsplit(".", 1)[-1] for name in names.values() if SAVED_COPY in name})
    _check_tying(model, config, saved)
    try:
        lora = lora_settings(int(config.r), float(config.lora_alpha), 0.0, ",".join(targets), model.config,
                             ",".join(saved) or None)
    except ConfigError as exc:
        raise AdaptersRefused(f"LoRA adapters the harness cannot build ({str(exc).split(': ', 1)[-1]})") from None
    _check_built(model, names, lora)
    return lora


def _check_tying(model, config, saved: list[str]) -> None:
    """A tied model's embedding (or lm_head) saved whole without peft's ensure_weight_tying — peft's default — trains
    the embedding's copy while lm_head keeps the frozen original (peft warns, and goes on): the harness trains the tied
    pair as one copy. AdaptersRefused, one line."""
    from parity.models.adapters import tied_ends

    ends = tied_ends(model.config) & set(saved)
    if ends and not getattr(config, "ensure_weight_tying", False):
        raise AdaptersRefused(f"modules_to_save {','.join(sorted(ends))} of a model with tied embeddings, without "
                              f"ensure_weight_tying: peft trains a copy of the embedding and leaves lm_head the frozen "
                              f"original, so the tie is broken; the harness trains them as one weight: pass "
                              f"ensure_weight_tying=True to LoraConfig (TRL's --lora_modules_to_save builds one "
                              f"without it: build the LoraConfig in your script and pass it as peft_config)")


def _check_built(model, names: dict[int, str], lora: dict) -> None:
    """The harness's adapters for `lora` on the model's config (a meta copy) hold the same tensors under the same names
    and train the same ones as the user's model: else the replay would train another model. AdaptersRefused, one
    line."""
    from parity.models.adapters import add_adapters
    from parity.models.model import meta_model

    built = {n: p.requires_grad for n, p in add_adapters(meta_model(model.config), lora).named_parameters()}
    mine = {names[id(p)]: p.requires_grad for p in model.parameters()}
    trained = sorted(n for n, grad in mine.items() if grad and not built.get(n))
    if trained:
        raise AdaptersRefused(f"the run trains {trained[0]} beside its LoRA adapters ({len(trained)} such tensor"
                              f"{'s' if len(trained) > 1 else ''}): the replay trains the adapters alone; freeze it")
    differ = sorted(set(built) ^ set(mine))
    if differ:
        raise AdaptersRefused(f"the LoRA adapters sit on other modules than {','.join(lora['targets'])} in every "
                              f"layer ({differ[0]}): the harness puts them on every module of those names")
    frozen = sorted(n for n, grad in built.items() if grad and not mine[n])
    if frozen:
        raise AdaptersRefused(f"the run freezes the adapter {frozen[0]}: the replay trains every adapter")


def save_initial_weights(view, path: str, state: dict | None) -> str:
    """Rank 0: the recorded model's initial weights written to `path` (its full `state` under the harness's names, or
    the module's own where it is whole: the view's, parity/views/) and, for a LoRA run, its adapters beside it
    (adapters.adapters_path, with the settings they are and the base's sha256); returns the init-weights file's
    sha256 — a LoRA run's as the harness's worker makes it (prepare_model): the base file's, "+", the adapters'."""
    from parity.models.adapters import save_run_weights

    return save_run_weights(view.model, view.lora, path, state, view.tensor_names())


__all__ = ["AdaptersRefused", "lora_of", "peft_inner", "save_initial_weights"]
