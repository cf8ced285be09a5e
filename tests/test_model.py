"""Presets, the shared initial-weights file (both formats), and its mismatch errors."""

import torch
import pytest
from transformers import Qwen2ForCausalLM

from parity.errors import ConfigError
from parity.models.model import (build_model, check_init_weights, file_sha256, load_init_weights, resolve_model_config,
                          save_init_weights)


def test_qwen25_preset_has_the_published_values():
    c = resolve_model_config("Qwen/Qwen2.5-0.5B")
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (151936, 896, 4864, 24)
    assert (c.num_attention_heads, c.num_key_value_heads, c.tie_word_embeddings) == (14, 2, True)
    assert (c.rope_parameters["rope_theta"], c.rms_norm_eps, c.max_position_embeddings) == (1e6, 1e-6, 32768)
    two = resolve_model_config("Qwen/Qwen2.5-0.5B", num_layers=2)
    assert two.num_hidden_layers == 2 and len(two.layer_types) == 2 and two.hidden_size == 896


def test_tiny_preset_builds_a_tied_qwen2():
    c = resolve_model_config("qwen2-tiny")
    model = build_model(c, seed=0)
    assert isinstance(model, Qwen2ForCausalLM)
    assert (c.num_key_value_heads, c.num_attention_heads % 2) == (2, 0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 2048 * 64 + 2 * (
        64 * 64 * 2 + 64 * 32 * 2 + 64 + 32 * 2 + 3 * 64 * 256 + 2 * 64) + 64


def test_unknown_and_local_model_names(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown model 'no-such/model'.*not a built-in model"):
        resolve_model_config("no-such/model")
    resolve_model_config("qwen2-tiny").save_pretrained(tmp_path)
    assert resolve_model_config(str(tmp_path)).hidden_size == 64
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"is a directory without config.json"):
        resolve_model_config(str(empty))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_init_weights_round_trip_and_strict_stock_load(tmp_path, suffix):
    config = resolve_model_config("qwen2-tiny")
    model = build_model(config, seed=3)
    path = str(tmp_path / f"init{suffix}")
    sha = save_init_weights(model, path)
    assert sha == file_sha256(path) and len(sha) == 64
    other = build_model(config, seed=4)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert load_init_weights(other, path) == sha
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert other.lm_head.weight is other.model.embed_tokens.weight  # the tie survives loading
    # A stock model of that config takes the file with strict=True.
    if suffix == ".pt":
        state = torch.load(path, weights_only=True)
    else:
        from safetensors.torch import load_file
        state = load_file(path)
    Qwen2ForCausalLM(config).load_state_dict(state, strict=True)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_init_weights_mismatch_is_one_line(tmp_path, suffix):
    path = str(tmp_path / f"init{suffix}")
    save_init_weights(build_model(resolve_model_config("qwen2-tiny"), seed=0), path)
    with pytest.raises(ConfigError, match=r"has 2 layers, run asks for 4: pass --num_layers 2"):
        check_init_weights(path, resolve_model_config("qwen2-tiny", num_layers=4))
    with pytest.raises(ConfigError, match=r"has 64 hidden size, run asks for 896"):
        check_init_weights(path, resolve_model_config("Qwen/Qwen2.5-0.5B", num_layers=2))


def test_plain_state_dict_without_config_is_checked_by_shape(tmp_path):
    config = resolve_model_config("qwen2-tiny")
    state = build_model(config, seed=0).state_dict()
    state["model.norm.weight"] = torch.ones(32)
    path = str(tmp_path / "plain.pt")
    torch.save(dict(state), path)
    with pytest.raises(ConfigError, match=r"model.norm.weight has shape \(32,\), model expects \(64,\)"):
        check_init_weights(path, config)
    del state["model.norm.weight"]
    torch.save(dict(state), path)
    with pytest.raises(ConfigError, match=r"it lacks model.norm.weight"):
        check_init_weights(path, config)


def test_missing_and_garbage_files(tmp_path):
    config = resolve_model_config("qwen2-tiny")
    with pytest.raises(ConfigError, match=r"does not exist: run train_ddp.py with --save_init_weights"):
        check_init_weights(str(tmp_path / "nope.pt"), config)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a tensor file")
    with pytest.raises(ConfigError, match=r"garbage.safetensors is not a safetensors file, or is truncated"):
        check_init_weights(str(garbage), config)
