"""Presets, the shared initial-weights file (both formats), and its mismatch errors."""

import torch
import pytest
from transformers import Qwen2ForCausalLM

from conftest import multimodal_gemma3
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


def test_a_multimodal_config_trains_its_language_model(tmp_path, capsys):
    """--model_name of an image-text checkpoint (Gemma 3 4B's config) resolves to its language model, cut to
    --num_layers, with a note saying so: the strategies train on text, where the vision tower takes no part (it was a
    crash, exit 70: the multimodal config names no num_hidden_layers or attention heads of its own)."""
    from transformers import Gemma3ForCausalLM

    from parity.models.families import family_of, multimodal_refusal

    multimodal_gemma3(tmp_path / "gemma3")
    config = resolve_model_config(str(tmp_path / "gemma3"), num_layers=2)
    assert (config.model_type, config.num_hidden_layers, config.layer_types) == (
        "gemma3_text", 2, ["sliding_attention", "sliding_attention"])
    assert capsys.readouterr().out == (f"note: --model_name {tmp_path / 'gemma3'} is a multimodal 'gemma3' model: the "
                                       f"harness trains its language model ('gemma3_text', Gemma3ForCausalLM) on text\n")
    assert isinstance(build_model(config, 0), Gemma3ForCausalLM)
    family = family_of(config)
    assert (family.stack, family.outside, family.why_no_tp) == ("model.layers", (), None)
    assert multimodal_refusal(config) is None


def test_gemma4s_per_layer_config_follows_its_layer_types_when_cut_or_grown():
    """Gemma 4's per_layer_config (a full-attention layer's own head_dim, keyed by layer index) keeps the entries of
    the layers kept, and a layer transformers makes full attention (a stack's last always is) takes theirs; grown, the
    entries repeat with the types. It was a crash at --num_layers: keys beyond the cut stack."""
    from transformers import AutoConfig

    from parity.models.families import family_of, with_num_layers

    config = AutoConfig.for_model("gemma4_text", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, global_head_dim=32, vocab_size=512,
                                  hidden_size_per_layer_input=16, vocab_size_per_layer_input=512, num_hidden_layers=12,
                                  layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
                                  per_layer_config={"05": {"head_dim": 32}, "11": {"head_dim": 32}})
    for layers, full in ((2, [1]), (6, [5]), (8, [5, 7]), (18, [5, 11, 17]), (24, [5, 11, 17, 23])):
        cut = with_num_layers(config, layers)
        assert [i for i, kind in enumerate(cut.layer_types) if kind == "full_attention"] == full
        assert sorted(int(i) for i in cut.to_dict()["per_layer_config"]) == full
        assert all(entry == {"head_dim": 32} for entry in cut.to_dict()["per_layer_config"].values())
        assert len(build_model(cut, 0).model.layers) == layers
    assert family_of(with_num_layers(config, 6)).outside == (
        "model.embed_tokens_per_layer", "model.per_layer_model_projection", "model.per_layer_projection_norm")


def test_configs_the_family_seam_cannot_read_are_one_line():
    """A mixture of experts whose config names no experts per token (DeepSeek-V2's default), a model whose layers are
    not one decoder stack (HRM's): one line each, not exit 70."""
    from transformers import AutoConfig

    from parity.models.families import family_of, with_num_layers

    deepseek = AutoConfig.for_model("deepseek_v2", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, vocab_size=256,
                                    q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                    v_head_dim=16, num_hidden_layers=2)
    with pytest.raises(ConfigError, match=r"^the 'deepseek_v2' config names no num_experts_per_tok \(the experts each "
                                          r"token is routed to\): fix its config.json$"):
        family_of(deepseek)
    hrm = with_num_layers(AutoConfig.for_model("hrm_text", hidden_size=64, intermediate_size=128, vocab_size=256,
                                               num_attention_heads=4), 2)
    with pytest.raises(ConfigError, match=r"^the harness cannot read the decoder stack of HrmTextForCausalLM "
                                          r"\(AttributeError: HrmTextModel has no attribute `layers`\): it trains "
                                          r"decoder-only causal language models whose layers form one stack"):
        family_of(hrm)
