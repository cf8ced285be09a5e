"""The model every strategy trains: config resolution (built-in models: parity.models.presets; what a family
decides: parity.models.families), building it, and the shared initial-weights file.

Initial weights are always loaded from one file, on every rank, before any wrapping: random init is
not coordinated across processes (DTensor init on CPU even depends on the TP size), so the file is the
only way "same initial weights" can be true. The file carries the model config it was made for.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections import OrderedDict

import torch

from parity import storage
from parity.errors import ConfigError

# The config fields that decide whether a weights file fits a model, with a human name for errors.
SHAPE_FIELDS = {
    "model_type": "model type", "num_hidden_layers": "layers", "hidden_size": "hidden size",
    "intermediate_size": "intermediate size", "vocab_size": "vocab size", "num_attention_heads": "attention heads",
    "num_key_value_heads": "KV heads", "head_dim": "head_dim", "tie_word_embeddings": "tie_word_embeddings",
}
# Besides the shapes, what makes two models compute the same function (the records' model_config).
NUMERIC_FIELDS = ("rms_norm_eps", "rope_parameters", "max_position_embeddings", "hidden_act", "hidden_activation",
                  "layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping")
FILE_FORMAT = "parity-init-weights/1"


def resolve_model_config(model_name: str, num_layers: int | None = None):
    """The transformers config of a built-in model (parity.models.presets), a local directory with config.json, or
    a hub name — of a multimodal config, its language model (families.language_model); cut to `num_layers` layers.
    ConfigError, before any worker starts, for a model the harness cannot train (not a decoder-only causal LM)."""
    from transformers import AutoConfig

    from parity.models.families import causal_lm_class, config_from_dict, language_model, with_num_layers
    from parity.models.presets import PRESETS

    if model_name in PRESETS:
        config = config_from_dict(PRESETS[model_name])
    elif os.path.isdir(model_name):
        if not os.path.isfile(os.path.join(model_name, "config.json")):
            raise ConfigError(f"--model_name {model_name} is a directory without config.json: "
                              f"point it at a Hugging Face model directory")
        try:
            config = AutoConfig.from_pretrained(model_name)
        except (ValueError, KeyError, OSError) as exc:
            raise ConfigError(f"--model_name {model_name}: transformers cannot read its config.json "
                              f"({str(exc).splitlines()[0][:120]}): give a Hugging Face model directory") from None
    else:
        from parity.models.hub import hub_unreachable

        why = hub_unreachable()
        try:
            if why:
                raise ConnectionError(why)
            config = AutoConfig.from_pretrained(model_name)
        except Exception as exc:  # offline, unknown repo, gated ...: all mean "cannot use this name"
            raise ConfigError(f"unknown model '{model_name}': not a built-in model ({', '.join(PRESETS)}), "
                              f"not a local directory, and the hub could not provide it "
                              f"({why or type(exc).__name__}): use a built-in model or a local directory") from None
    whole, config = config, language_model(config)
    if config is not whole:
        print(f"note: --model_name {model_name} is a multimodal '{whole.model_type}' model: the harness trains its "
              f"language model ('{config.model_type}', {causal_lm_class(config).__name__}) on text")
    try:
        causal_lm_class(config)
    except ConfigError as exc:
        raise ConfigError(f"--model_name {model_name}: {exc}") from None
    if num_layers is not None and num_layers != config.num_hidden_layers:
        config = with_num_layers(config, num_layers)
    return config


def model_config_from_dict(data: dict):
    """The config that `resolve_model_config(...).to_dict()` described (RunConfig.model_config): workers rebuild the
    driver's resolved config instead of resolving the name again (no hub, no files)."""
    from parity.models.families import config_from_dict

    return config_from_dict(data)


def build_model(config, seed: int):
    """A freshly initialised fp32 causal LM of the config's family on the CPU (weights are replaced by the shared
    file)."""
    from parity.models.families import causal_lm_class

    torch.manual_seed(seed)
    model = causal_lm_class(config)(config)
    return model.float()


def config_summary(config) -> dict:
    """The fields that make two models the same model, as stored in files and loss records."""
    d = config.to_dict()
    return {k: d[k] for k in (*SHAPE_FIELDS, *NUMERIC_FIELDS) if k in d}


def config_as_built(model):
    """A copy of `model`'s config that builds the model as it is: its pad_token_id the input embedding's padding_idx,
    the row whose gradient the embedding leaves out. A trainer may set config.pad_token_id after the model was built
    (TRL's DPOTrainer sets it to the tokenizer's): a model built from that config would drop the gradient of a row the
    run trained wherever that id is an input whose output the loss counts."""
    import copy

    config = copy.deepcopy(model.config)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embedding, torch.nn.Embedding):
        config.get_text_config().pad_token_id = embedding.padding_idx
    return config


def meta_model(config):
    """The config's causal LM on the meta device: names and shapes without memory."""
    from parity.models.families import causal_lm_class

    with torch.device("meta"):
        return causal_lm_class(config)(config)


# ---------------------------------------------------------------------------------------------------
# The initial-weights file
# ---------------------------------------------------------------------------------------------------

def save_init_weights(model, path: str, state: dict | None = None) -> str:
    """Write the full state dict atomically (a local path or a URI); returns the file's sha256. `state`: the full
    state dict where the model's own holds shards (a recorder of a sharded loop gathers it: parity.recording).

    `.safetensors` keeps the config in its string metadata; `.pt` keeps it in the state dict's own
    `_metadata` (what `load_state_dict` reads versions from), so the file still loads with
    `weights_only=True` and `strict=True` into a stock model.
    """
    state = OrderedDict((k, v.detach().to("cpu", torch.float32).contiguous().clone())
                        for k, v in (model.state_dict() if state is None else state).items())
    meta = {"format": FILE_FORMAT, "model_config": json.dumps(model.config.to_dict(), sort_keys=True)}
    if _is_safetensors(path):
        from safetensors.torch import save

        data = canonical_safetensors(save(state, metadata=meta))
    else:
        state._metadata = OrderedDict({"": {"version": 1, **meta}})
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
    storage.write_bytes_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def canonical_safetensors(data: bytes) -> bytes:
    """The same safetensors file with its header's keys sorted. safetensors writes its metadata from a Rust HashMap,
    whose order is random per process: two processes saving the same tensors and metadata would write files of other
    bytes, hence other sha256s (init_weights_sha256, a dump's inputs_sha256), and two runs from one model would not
    compare. The data section and its offsets are untouched; the header is padded to 8 bytes as safetensors pads it."""
    n = int.from_bytes(data[:8], "little")
    text = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n:]


def read_init_weights(path: str) -> tuple[OrderedDict, dict | None, str]:
    """(state dict, stored model config or None, the file's sha256), from one read of the file (a local
    path or a URI). Raises ConfigError for a missing or unreadable file."""
    if storage.is_dir(path):
        raise ConfigError(f"init weights file {path} is a directory: give the weights file's path "
                          f"(e.g. {storage.join(path, 'init_weights.pt')})")
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise ConfigError(f"init weights file {path} does not exist: run train_ddp.py with --save_init_weights "
                          f"first, or pass --save_init_weights to create it") from None
    except OSError as exc:
        raise ConfigError(f"init weights file {path} cannot be read ({storage.reason(exc)})") from None
    try:
        if _is_safetensors(path):
            from safetensors.torch import load

            state = OrderedDict(load(data))
            meta = safetensors_metadata(data)
        else:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            meta = (getattr(state, "_metadata", None) or {}).get("", {})
    except Exception as exc:
        raise ConfigError(f"init weights file {path} {_unreadable(path, data, exc)}: recreate it with "
                          f"--save_init_weights") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"init weights file {path} is not a state dict of tensors: "
                          f"recreate it with --save_init_weights")
    stored = json.loads(meta["model_config"]) if "model_config" in meta else None
    return state, stored, hashlib.sha256(data).hexdigest()


def _unreadable(path: str, data: bytes, exc: Exception) -> str:
    """Why a weights file cannot be read, in words rather than the loader's own message."""
    import zipfile

    if not data:
        return "is empty"
    if _is_safetensors(path):
        return f"is not a safetensors file, or is truncated ({str(exc).splitlines()[0][:80]})"
    if not data.startswith(b"PK"):
        return "is not a PyTorch weights file (torch.save writes a zip archive; this is not one)"
    if not zipfile.is_zipfile(io.BytesIO(data)):
        return "is truncated or corrupt (its torch.save archive is incomplete)"
    return f"cannot be read as a state dict ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"


def check_init_weights(path: str, config) -> None:
    """Fail with one line when the file was made for another model than the run's."""
    state, stored, _ = read_init_weights(path)
    _check_fits(path, state, stored, config)


def load_init_weights(model, path: str) -> str:
    """Load the file into `model` (strict) and return its sha256."""
    state, stored, sha = read_init_weights(path)
    _check_fits(path, state, stored, model.config)
    model.load_state_dict(state, strict=True)
    return sha


def file_sha256(path: str) -> str:
    return hashlib.sha256(storage.read_bytes(path)).hexdigest()


def _check_fits(path: str, state: dict, stored: dict | None, config) -> None:
    want = config.to_dict()
    if stored is not None:
        for key, label in SHAPE_FIELDS.items():
            if stored.get(key) != want.get(key):
                hint = (f"pass --num_layers {stored[key]}" if key == "num_hidden_layers"
                        else "use the model the file was made for")
                raise ConfigError(f"init weights file {path} has {stored.get(key)} {label}, run asks for "
                                  f"{want.get(key)}: {hint}, or recreate the file with --save_init_weights")
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has unexpected {extra[0]}"
        raise ConfigError(f"init weights file {path} does not fit the model: it {what} "
                          f"({len(missing)} missing, {len(extra)} unexpected): recreate it with --save_init_weights")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ConfigError(f"init weights file {path} does not fit the model: {name} has shape "
                              f"{tuple(state[name].shape)}, model expects {shape}: recreate it with --save_init_weights")


def _is_safetensors(path: str) -> bool:
    return storage.name(path).endswith(".safetensors")


def safetensors_metadata(data: bytes) -> dict:
    """The string metadata of a safetensors file held in memory: its header is an 8-byte little-endian
    length, then that much JSON, whose "__metadata__" entry holds it."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]).get("__metadata__") or {}


def parameter_names(config) -> list[str]:
    """A stock model's named_parameters() names (a tied lm_head once, as model.embed_tokens.weight)."""
    return [name for name, _ in meta_model(config).named_parameters()]


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in meta_model(config).state_dict().items()}


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (DeepSeek-V3's routing-correction bias; not the rotary tables), on the CPU in
    fp32: no strategy shards a buffer, so every rank holds them whole."""
    found = {}
    for name, owner in module.named_modules():
        for key, buffer in owner.named_buffers(recurse=False):
            if buffer is not None and not buffer.is_meta and key not in owner._non_persistent_buffers_set:
                found[f"{name}.{key}" if name else key] = buffer.detach().float().cpu().clone()
    return found


def save_hf_checkpoint(params: dict[str, torch.Tensor], config, directory: str) -> None:
    """Write full parameters (and persistent buffers) in `save_pretrained` layout (config.json + model.safetensors) to `directory`
    (a local path or a URI), whole: parity.storage.directory_writer publishes it when complete."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a "Writing model shards" bar per run is noise in the logs
    model = meta_model(config)
    hold_full_parameters(model, params)
    with storage.directory_writer(directory) as staging:
        model.save_pretrained(staging, safe_serialization=True)


def hold_full_parameters(model, params: dict[str, torch.Tensor]) -> None:
    """Make `model` (the config's causal LM on the meta device, LoRA's adapters added or not) hold `params` — full
    tensors under its names, a tied weight once — assigned, not copied, and keep its ties. ValueError where they do
    not fit: a writer of the final model never writes another model's. The ties are read off the model itself (a
    parameter reached under two names): the stock lm_head, and with --lora_modules_to_save peft's tied copies."""
    aliases = tied_aliases(model)
    missing, unexpected = model.load_state_dict(params, strict=False, assign=True)
    if set(missing) - set(aliases) or unexpected:
        raise ValueError(f"full parameters do not match the model: missing {missing}, unexpected {unexpected}")
    for alias, source in aliases.items():
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(source))


def tied_aliases(model) -> dict[str, str]:
    """{name: the name it is tied to} of each parameter `model` reaches under more than one name (the later names:
    named_parameters gives each parameter once, under its first)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases
