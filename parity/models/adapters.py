"""LoRA adapters on the run's model, through peft (the `lora` extra): what a fine-tune trains (docs/finetune.md).

The model axis's one place for adapters. Every strategy, the teacher-forced check's reference step and the layer
check's replay build the run's model as `build_model` + `load_init_weights` + `add_adapters` + the adapters' initial
weights; nothing else knows LoRA exists but the strategies' own choices of what they can shard.

Names. peft wraps the model in a PeftModel (`base_model.model` is the original causal LM, adapters injected in place);
the harness hands the strategies that inner model, so every name it keys by — the weights check, the optimizer,
replicas, the tensor series, dumps, checkpoints — is the name under PEFT's `base_model.model.`: a targeted projection's
weight is `model.layers.0.self_attn.q_proj.base_layer.weight`, its adapters `...q_proj.lora_A.default.weight` and
`...q_proj.lora_B.default.weight`. The final model is written in peft's own layout (adapter_config.json and
adapter_model.safetensors, `PeftModel.from_pretrained` loads it onto the base) and merged (stock transformers loads it).

The adapters' initial weights. peft draws lora_A at random (Kaiming-uniform) and sets lora_B to 0; as for the base, the
draw is made once and shared through a file beside the init-weights file (`adapters_path`), which holds the adapter
settings it was drawn for and the base's sha256: every rank of every strategy starts from the same adapters.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict

import torch

from parity import storage
from parity.errors import ConfigError

ADAPTERS_FORMAT = "parity-lora-adapters/1"
ADAPTER_NAME = "default"  # peft's name of the one adapter (in every adapter parameter's name)
SAVED_COPY = f".modules_to_save.{ADAPTER_NAME}."  # in the name of a saved module's trained copy (save_settings)
ADAPTER_FOLDER = "adapter"  # the final model folder's peft layout (the merged model is the folder itself)


def lora_settings(r: int | None, alpha: float | None, dropout: float, targets: str | None, model_config,
                  modules_to_save: str | None = None) -> dict | None:
    """The run's adapters from the --lora_* flags (None without --lora_r): {"r", "alpha", "dropout", "targets"}, the
    targets resolved (given, else peft's default for the family) and checked against the model's modules, and
    "modules_to_save" where --lora_modules_to_save names modules trained whole beside the adapters (save_settings).
    ConfigError, one line, for settings the harness cannot compare."""
    if r is None:
        if alpha is not None or targets is not None or dropout or modules_to_save is not None:
            raise ConfigError("--lora_alpha, --lora_dropout, --lora_targets and --lora_modules_to_save set up LoRA "
                              "adapters, which --lora_r turns on: pass --lora_r R (e.g. --lora_r 8)")
        return None
    _require_peft()
    if r < 1:
        raise ConfigError(f"--lora_r must be a positive integer (got {r})")
    if dropout:
        raise ConfigError(f"--lora_dropout {dropout}: each strategy draws dropout masks in its own order (and a replay "
                          f"cannot draw a recorded run's), so no two runs would train the same adapters: use "
                          f"--lora_dropout 0")
    names = _linear_names(model_config)
    if targets is None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        chosen = DEFAULTS.get(model_config.model_type)
        if not chosen:
            raise ConfigError(f"peft has no default LoRA targets for {model_config.model_type}: name them with "
                              f"--lora_targets (its linear layers: {', '.join(sorted(set(names)))})")
    else:
        chosen = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in names]
    if unknown or not chosen:
        raise ConfigError(f"--lora_targets {','.join(unknown) or repr(targets)} names no linear layer of "
                          f"{model_config.model_type} (its linear layers: {', '.join(sorted(set(names)))}): name some "
                          f"of them")
    settings = {"r": int(r), "alpha": float(alpha if alpha is not None else 2 * r), "dropout": 0.0,
                "targets": sorted(set(chosen))}
    saved = save_settings(modules_to_save, settings["targets"], model_config)
    return {**settings, "modules_to_save": saved} if saved else settings


def save_settings(modules_to_save: str | None, targets: list[str], model_config) -> list[str]:
    """--lora_modules_to_save: the modules that train whole beside the adapters — peft keeps each module's original
    frozen and trains a copy of it (`<module>.modules_to_save.default`, the original at `<module>.original_module`) —
    as peft matches them: every module whose name ends with a given key (`norm` saves input_layernorm and
    post_attention_layernorm too), resolved here to their last name parts, so that the run's settings say what trains.
    Checked against the model: a module it has, holding parameters, and not an adapter target. A tied family's
    embedding and lm_head are one weight: naming either trains one copy of it, tied in both places (peft's
    ensure_weight_tying, peft_config)."""
    if modules_to_save is None:
        return []
    from parity.models.model import meta_model

    keys = {m.strip() for m in modules_to_save.split(",") if m.strip()}
    modules = {name.rsplit(".", 1)[-1] for name, module in meta_model(model_config).named_modules()
               if name and any(True for _ in module.parameters(recurse=False))}
    unknown = sorted(k for k in keys if not any(m.endswith(k) for m in modules))
    chosen = sorted(m for m in modules if any(m.endswith(k) for k in keys))
    if unknown or not chosen:
        raise ConfigError(f"--lora_modules_to_save {','.join(unknown) or repr(modules_to_save)} names no module of "
                          f"{model_config.model_type} that holds parameters (its modules: {', '.join(sorted(modules))})"
                          f": name some of them")
    both = sorted(set(chosen) & set(targets))
    if both:
        raise ConfigError(f"--lora_modules_to_save {','.join(both)} is also a LoRA target: a module trains either "
                          f"whole or through adapters; name it in one of --lora_targets and --lora_modules_to_save")
    return chosen


def _require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError("--lora_r needs peft: pip install -e '.[lora]'") from None


def _linear_names(model_config) -> list[str]:
    """The last name part of every nn.Linear of the model (what peft's target_modules match), the lm_head left out:
    tied to the embedding in most tiny presets, it would train the embedding through the adapters' merge."""
    from parity.models.model import meta_model

    return [name.rsplit(".", 1)[-1] for name, module in meta_model(model_config).named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head"]


def peft_config(lora: dict, tied: frozenset = frozenset()):
    """peft's LoraConfig of the run's adapters; `tied`: the modules the model ties (tied_ends), so that one of them
    saved whole is one trained copy in both places (ensure_weight_tying: set only then, where peft warns otherwise)."""
    from peft import LoraConfig

    saved = list(lora.get("modules_to_save", []))
    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=list(lora["targets"]), task_type="CAUSAL_LM", modules_to_save=saved or None,
                      ensure_weight_tying=bool(tied & set(saved)))


def tied_ends(config) -> frozenset:
    """The last name parts of the embedding and lm_head where the family ties them (the seam's), as peft's
    modules_to_save names them; none where it does not."""
    from parity.models.families import family_of

    family = family_of(config)
    return frozenset({family.embedding.rsplit(".", 1)[-1], family.final[-1].rsplit(".", 1)[-1]} if family.tied else ())


def peft_model(model, lora: dict):
    """peft's PeftModel around `model` (adapters injected in place, the base frozen)."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(lora, tied_ends(model.config)))


def add_adapters(model, lora: dict | None):
    """`model` with the run's LoRA adapters injected in place and every other parameter frozen (requires_grad False);
    the model itself where the run has none. The adapters are peft's fresh draw: load_adapters gives them the shared
    initial weights."""
    if lora is None:
        return model
    return peft_model(model, lora).base_model.model


def run_parameter_names(config, lora: dict | None) -> list[str]:
    """The parameter names of a run's model: the stock model's (model.parameter_names), with LoRA its adapters' and
    wrapped projections' too (from a meta model: names and shapes without memory)."""
    from parity.models.model import meta_model

    return [name for name, _ in add_adapters(meta_model(config), lora).named_parameters()]


def trained_parameter_names(config, lora: dict | None) -> list[str]:
    """What trains in a run's model, in its parameter order (the order its optimizer holds them): every parameter of
    the stock model, or with LoRA the adapters and the saved modules' copies."""
    from parity.models.model import meta_model, parameter_names

    return adapter_names(add_adapters(meta_model(config), lora)) if lora is not None else parameter_names(config)


def lora_flags(lora: dict | None) -> dict:
    """The --lora_* flags that resolve to `lora` (a record's or a RunConfig's settings; none without LoRA): what a
    replay of a LoRA run passes on, so that it builds the run's adapters."""
    if lora is None:
        return {}
    return {"lora_r": lora["r"], "lora_alpha": lora["alpha"], "lora_targets": ",".join(lora["targets"]),
            "lora_modules_to_save": ",".join(lora["modules_to_save"]) if lora.get("modules_to_save") else None}


LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "lora_modules_to_save")


def adapter_names(model) -> list[str]:
    """The adapters' parameter names of a model add_adapters made (what trains)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def adapter_state(model) -> dict[str, torch.Tensor]:
    """{name: tensor} of the adapters of a model add_adapters made (what a strategy that rebuilds the model, as
    transformers' from_pretrained does, hands its own adapters)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def base_state_dict(state: dict[str, torch.Tensor], trained: list[str]) -> dict[str, torch.Tensor]:
    """The base of a state dict under the names add_adapters gives (a model's, or a recorder's gathered one), under a
    stock model's names (stock_name): what trains (`trained`) left out, and the trained copies of saved modules under
    every name they are tied to (lm_head's copy of a tied embedding's). What save_pretrained writes for
    from_pretrained to load the base; what a harness LoRA run's init-weights file holds."""
    left_out = set(trained)
    return {stock_name(n): t for n, t in state.items() if n not in left_out and SAVED_COPY not in n}


def stock_name(name: str) -> str:
    """A base tensor's name in a stock model: peft's `<projection>.base_layer.weight` is `<projection>.weight`, as a
    saved module's frozen original `<module>.original_module.weight` is `<module>.weight`."""
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


def assign_adapters(model, state: dict[str, torch.Tensor]) -> None:
    """Give `model`'s adapters the full tensors `state` holds, by name: where an adapter is a DTensor (peft placed it
    beside a tensor-parallel projection), each rank its own piece, sliced locally."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    mine = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            target = mine[name]
            if isinstance(target, DTensor):
                tensor = distribute_tensor(tensor.to(target.device), target.device_mesh, target.placements,
                                           src_data_rank=None)
            target.copy_(tensor)


# ---------------------------------------------------------------------------------------------------
# The adapters' initial-weights file, beside the init-weights file
# ---------------------------------------------------------------------------------------------------

def adapters_path(init_weights_path: str) -> str:
    """Where the adapters' initial weights of runs from `init_weights_path` are: beside it, its name + .lora."""
    return init_weights_path + ".lora.safetensors"


def save_adapters(model, lora: dict, base_sha256: str, path: str, state: dict | None = None) -> str:
    """Write the adapters of `model` (add_adapters') atomically, with the settings they were drawn for and the base's
    sha256; returns the file's sha256. `state`: the adapters' full tensors by name where the model holds shards (a
    recorder of a sharded loop gathers them: parity/views/adapters.py)."""
    from safetensors.torch import save

    from parity.models.model import canonical_safetensors

    state = state if state is not None else {n: p for n, p in model.named_parameters() if p.requires_grad}
    state = OrderedDict((n, t.detach().to("cpu", torch.float32).contiguous().clone()) for n, t in state.items())
    meta = {"format": ADAPTERS_FORMAT, "lora": json.dumps(lora, sort_keys=True), "base_sha256": base_sha256}
    data = canonical_safetensors(save(state, metadata=meta))
    storage.write_bytes_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def save_run_weights(model, lora: dict | None, path: str, state: dict[str, torch.Tensor] | None = None,
                     trained: list[str] | None = None) -> str:
    """A model's state (`state`, default the model's own) written as a harness run keeps its initial weights: at `path`
    (save_init_weights); with LoRA (`state` under add_adapters' names; `trained`: what trains in it, default
    adapter_names) the base under stock names at `path` and what trains in the adapters' file beside it
    (adapters_path, with the base's sha256). Returns the sha256 the run reports (prepare_model): the file's, or a LoRA
    run's base file's, "+", the adapters'."""
    from parity.models.model import save_init_weights

    if lora is None:
        return save_init_weights(model, path, state)
    state = model.state_dict() if state is None else state
    trained = adapter_names(model) if trained is None else trained
    sha = save_init_weights(model, path, base_state_dict(state, trained))
    return f"{sha}+{save_adapters(model, lora, sha, adapters_path(path), {n: state[n] for n in trained})}"


def read_adapters(path: str, lora: dict) -> tuple[OrderedDict, str]:
    """(the adapters' state dict, the file's sha256); ConfigError, one line, for a file missing, unreadable or drawn for
    other adapter settings."""
    from safetensors.torch import load

    from parity.models.model import safetensors_metadata

    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise ConfigError(f"the adapters' initial weights {path} do not exist: run train_ddp.py with the same --lora_* "
                          f"flags and --save_init_weights first") from None
    try:
        state, meta = OrderedDict(load(data)), safetensors_metadata(data)
    except Exception:
        raise ConfigError(f"the adapters' initial weights {path} are not a safetensors file, or are truncated: "
                          f"recreate them with --save_init_weights") from None
    stored = json.loads(meta.get("lora", "null"))
    if stored != lora:
        what = {k: stored.get(k) for k in lora if stored.get(k) != lora[k]} if isinstance(stored, dict) else stored
        raise ConfigError(f"the adapters' initial weights {path} were drawn for other LoRA settings ({what} against "
                          f"the run's {({k: lora[k] for k in what} if isinstance(what, dict) else lora)}): pass the "
                          f"flags they were made with, or recreate them with --save_init_weights")
    return state, hashlib.sha256(data).hexdigest()


def write_initial_adapters(init_weights_path: str, model_config, lora: dict, seed: int) -> str:
    """Draw the adapters of runs from the base in `init_weights_path` (seeded by `seed`, as a run's
    --save_init_weights draws them) and write them beside it; returns their file's path. For a driver that makes the
    weights itself (a test, the calibration study)."""
    from parity.models.model import build_model, load_init_weights

    model = build_model(model_config, seed)
    sha = load_init_weights(model, init_weights_path)
    path = adapters_path(init_weights_path)
    save_adapters(add_adapters(model, lora), lora, sha, path)
    return path


def check_adapters(init_weights_path: str, lora: dict | None) -> None:
    """The driver's check, before any worker: the adapters' file exists and fits the run's settings."""
    if lora is not None:
        read_adapters(adapters_path(init_weights_path), lora)


def load_adapters(model, path: str, lora: dict) -> str:
    """Give `model`'s adapters (add_adapters') the file's initial weights; returns the file's sha256."""
    state, sha = read_adapters(path, lora)
    trained = set(adapter_names(model))
    if set(state) != trained:
        odd = sorted(set(state) ^ trained)[0]
        raise ConfigError(f"the adapters' initial weights {path} do not fit the model's adapters ({odd}): recreate "
                          f"them with --save_init_weights")
    assign_adapters(model, state)
    return sha


# ---------------------------------------------------------------------------------------------------
# The final model: peft's layout and the merged model
# ---------------------------------------------------------------------------------------------------

def save_lora_checkpoint(params: dict[str, torch.Tensor], config, lora: dict, directory: str) -> None:
    """Write the trained model whole into `directory` (a local path or a URI; parity.storage.directory_writer
    publishes it when complete): the adapters in peft's layout under `adapter/` (PeftModel.from_pretrained loads them
    onto the base, the init-weights file's model), and the model with its adapters merged into the base as
    save_pretrained writes it (config.json + model.safetensors: stock transformers loads it)."""
    from transformers.utils import logging as transformers_logging

    from parity.models.model import hold_full_parameters, meta_model

    transformers_logging.disable_progress_bar()
    wrapped = peft_model(meta_model(config), lora)
    hold_full_parameters(wrapped.base_model.model, params)
    with storage.directory_writer(directory) as staging:
        wrapped.save_pretrained(os.path.join(staging, ADAPTER_FOLDER))
        wrapped.merge_and_unload().save_pretrained(staging, safe_serialization=True)
