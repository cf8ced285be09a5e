"""The model every strategy trains: presets, config resolution, and the shared initial-weights file.

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

# Published values of Qwen/Qwen2.5-0.5B's config.json, so no hub is needed.
QWEN25_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768,
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    use_sliding_window=False, sliding_window=32768, max_window_layers=24, attention_dropout=0.0,
    bos_token_id=151643, eos_token_id=151643,
)
# Same family and shape rules (2 KV heads so TP=2 works, tied embeddings), small enough for CPU CI.
QWEN2_TINY = dict(
    vocab_size=2048, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=4096,
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    use_sliding_window=False, sliding_window=4096, max_window_layers=2, attention_dropout=0.0,
    bos_token_id=0, eos_token_id=0,
)
PRESETS = {"Qwen/Qwen2.5-0.5B": QWEN25_05B, "qwen2-tiny": QWEN2_TINY}
# The learning rate a preset trains well with when --learning_rate is not given. 1e-5 is the seed's;
# the tiny model needs a larger one for its loss to move within 100 steps.
PRESET_LEARNING_RATES = {"Qwen/Qwen2.5-0.5B": 1e-5, "qwen2-tiny": 1e-3}
DEFAULT_LEARNING_RATE = 1e-5
DEFAULT_TOKENIZERS = {"qwen2-tiny": "bytes"}

# The config fields that decide whether a weights file fits a model, with a human name for errors.
SHAPE_FIELDS = {
    "num_hidden_layers": "layers", "hidden_size": "hidden size", "intermediate_size": "intermediate size",
    "vocab_size": "vocab size", "num_attention_heads": "attention heads",
    "num_key_value_heads": "KV heads", "tie_word_embeddings": "tie_word_embeddings",
}
FILE_FORMAT = "parity-init-weights/1"


def resolve_model_config(model_name: str, num_layers: int | None = None):
    """A Qwen2Config for a preset, a local directory with config.json, or a hub name."""
    from transformers import AutoConfig, Qwen2Config

    if model_name in PRESETS:
        config = Qwen2Config(**PRESETS[model_name])
    elif os.path.isdir(model_name):
        if not os.path.isfile(os.path.join(model_name, "config.json")):
            raise ConfigError(f"--model_name {model_name} is a directory without config.json: "
                              f"point it at a Hugging Face model directory")
        config = AutoConfig.from_pretrained(model_name)
    else:
        from parity.training.hub import hub_unreachable

        why = hub_unreachable()
        try:
            if why:
                raise ConnectionError(why)
            config = AutoConfig.from_pretrained(model_name)
        except Exception as exc:  # offline, unknown repo, gated ...: all mean "cannot use this name"
            raise ConfigError(f"unknown model '{model_name}': not a built-in preset ({', '.join(PRESETS)}), "
                              f"not a local directory, and the hub could not provide it "
                              f"({why or type(exc).__name__}): use a preset or a local directory") from None
    if config.model_type != "qwen2":
        raise ConfigError(f"--model_name {model_name} is a '{config.model_type}' model; this harness trains "
                          f"Qwen2ForCausalLM: use a qwen2 model")
    if num_layers is not None and num_layers != config.num_hidden_layers:
        config = with_num_layers(config, num_layers)
    return config


def model_config_from_dict(data: dict):
    """The Qwen2Config that `resolve_model_config(...).to_dict()` described (RunConfig.model_config): workers
    rebuild the driver's resolved config instead of resolving the name again (no hub, no files)."""
    from transformers import Qwen2Config

    return Qwen2Config.from_dict(data)


def with_num_layers(config, num_layers: int):
    """Rebuild the config with another depth; derived per-layer lists are recomputed, not truncated."""
    from transformers import Qwen2Config

    data = config.to_dict()
    data.pop("layer_types", None)
    data["num_hidden_layers"] = num_layers
    data["max_window_layers"] = min(data.get("max_window_layers", num_layers), num_layers)
    return Qwen2Config.from_dict(data)


def default_learning_rate(model_name: str) -> float:
    return PRESET_LEARNING_RATES.get(model_name, DEFAULT_LEARNING_RATE)


def default_tokenizer(model_name: str) -> str:
    return DEFAULT_TOKENIZERS.get(model_name, model_name)


def build_model(config, seed: int):
    """A freshly initialised fp32 Qwen2ForCausalLM on the CPU (weights are replaced by the shared file)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    return model.float()


def config_summary(config) -> dict:
    """The fields that make two models the same model, as stored in files and loss records."""
    d = config.to_dict()
    keep = list(SHAPE_FIELDS) + ["rms_norm_eps", "rope_parameters", "max_position_embeddings", "hidden_act"]
    return {k: d.get(k) for k in keep}


# ---------------------------------------------------------------------------------------------------
# The initial-weights file
# ---------------------------------------------------------------------------------------------------

def save_init_weights(model, path: str) -> str:
    """Write the full state dict atomically (a local path or a URI); returns the file's sha256.

    `.safetensors` keeps the config in its string metadata; `.pt` keeps it in the state dict's own
    `_metadata` (what `load_state_dict` reads versions from), so the file still loads with
    `weights_only=True` and `strict=True` into a stock model.
    """
    state = OrderedDict((k, v.detach().to("cpu", torch.float32).contiguous().clone())
                        for k, v in model.state_dict().items())
    meta = {"format": FILE_FORMAT, "model_config": json.dumps(model.config.to_dict(), sort_keys=True)}
    if _is_safetensors(path):
        from safetensors.torch import save

        data = save(state, metadata=meta)
    else:
        state._metadata = OrderedDict({"": {"version": 1, **meta}})
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
    storage.write_bytes_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


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
            meta = _safetensors_metadata(data)
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


def _safetensors_metadata(data: bytes) -> dict:
    """The string metadata of a safetensors file held in memory: its header is an 8-byte little-endian
    length, then that much JSON, whose "__metadata__" entry holds it."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]).get("__metadata__") or {}


def parameter_names(config) -> list[str]:
    """A stock model's named_parameters() names (a tied lm_head once, as model.embed_tokens.weight)."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        return [name for name, _ in Qwen2ForCausalLM(config).named_parameters()]


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def save_hf_checkpoint(params: dict[str, torch.Tensor], config, directory: str) -> None:
    """Write full parameters in `save_pretrained` layout (config.json + model.safetensors) to `directory`
    (a local path or a URI), whole: parity.storage.directory_writer publishes it when complete."""
    from transformers import Qwen2ForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a "Writing model shards" bar per run is noise in the logs
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    missing, unexpected = model.load_state_dict(params, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"full parameters do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    with storage.directory_writer(directory) as staging:
        model.save_pretrained(staging, safe_serialization=True)
