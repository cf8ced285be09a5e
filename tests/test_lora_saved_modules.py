"""--lora_modules_to_save: modules trained whole beside LoRA's adapters (peft's modules_to_save), under every strategy
that takes adapters, at fp32 parity with DDP's run — with packed rows, so that LoRA + packing runs under ZeRO-3 and
the pipeline too.

qwen2-tiny ties lm_head to its embedding: `embed_tokens` saved trains one copy of the embedding, tied in both places
(peft's ensure_weight_tying), the frozen original kept beside it; `input_layernorm` saves a module inside each decoder
layer (FSDP2's TP plan and the pipeline's stages take the wrapped module). One local gloo group of 2 ranks: DDP at DP 2
the baseline, FSDP2 at TP 2, ZeRO-3 at DP 2, the pipeline at PP 2 (whose two ends hold the tied copy twice and sum its
gradients), and the seeded bug of a pipeline that leaves that sum out. Adapters of rank 4 on q, k, v, gate and up,
seq 64, 3 steps, lr 1e-3 (the embedding visibly moves), global batch 8.
"""

import pytest
import torch

from conftest import assert_lora_parity, lora_group
from parity.calibration.lora_bugs import PipelineSavedTieUnsummed

TARGETS, SAVED = "q_proj,k_proj,v_proj,gate_proj,up_proj", "embed_tokens,input_layernorm"
SETTING = {"model_name": "qwen2-tiny", "seq_length": 64, "debug_steps": 3, "learning_rate": 1e-3, "log_interval": 3,
           "checkpoint_interval": 0, "precision": "fp32", "batch_size": 4, "lora_r": 4, "lora_targets": TARGETS,
           "lora_modules_to_save": SAVED, "packing": True}
PP2 = {"num_workers": 2, "pp_size": 2, "batch_size": 8}
RUNS = {  # name → (strategy, flags); "ddp" is the baseline
    "ddp": ("ddp", {"num_workers": 2}),
    "fsdp_tp2": ("fsdp", {"num_workers": 2, "tp_size": 2, "batch_size": 8}),
    "zero3": ("deepspeed", {"num_workers": 2, "zero_stage": 3}),
    "pipeline": ("pipeline", PP2),
    "bug_pipeline_tie_unsummed": ("pipeline", {**PP2, "strategy_class": PipelineSavedTieUnsummed}),
}
CHECKED = [name for name in RUNS if name != "ddp" and not name.startswith("bug_")]
EMBEDDING_COPY = "model.embed_tokens.modules_to_save.default.weight"


@pytest.fixture(scope="module")
def runs(tiny_weights, tmp_path_factory):
    """{name: (its folder, its record)}, from the shared tiny weights (copied: the adapters' file lies beside them)."""
    return lora_group(tmp_path_factory.mktemp("lora_saved"), tiny_weights, SETTING, RUNS)


@pytest.mark.parametrize("name", CHECKED)
def test_saved_modules_train_as_ddps_under_each_strategy(runs, name):
    """Every step's loss, grad norm and parameter norm within 1e-5 of DDP's, the final merged model's tensors within
    the fp32 bound; the replicas bit-identical and the frozen base (the saved modules' originals among it) unmoved; the
    teacher-forced step within 1e-5; the tensor series name the adapters and the saved copies — the embedding's once —
    as DDP's do."""
    ours, _ = assert_lora_parity(runs, name)
    saved = [n for n in ours.names if ".modules_to_save." in n]
    assert saved == [EMBEDDING_COPY] + [
        f"model.layers.{i}.input_layernorm.modules_to_save.default.weight" for i in range(2)]
    assert len(ours.names) == 2 * 5 * 2 + 3 and not any("original_module" in n for n in ours.names)
    assert runs[name][1]["config"]["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.0,
                                               "targets": sorted(TARGETS.split(",")),
                                               "modules_to_save": ["embed_tokens", "input_layernorm"]}


def test_the_saved_embedding_trains_tied_and_the_final_model_loads(runs):
    """DDP's final model: merged, stock transformers loads it with lm_head tied to the embedding the run trained (moved
    from the initial one); peft loads its adapters and saved copy onto the base and computes the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from parity.models.model import build_model, load_init_weights, resolve_model_config

    _, run = runs["ddp"]
    final = run["final"]["checkpoint_dir"]
    merged = AutoModelForCausalLM.from_pretrained(final)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    base = build_model(resolve_model_config("qwen2-tiny"), 0)
    load_init_weights(base, run["config"]["init_weights_path"])
    moved = (merged.model.embed_tokens.weight - base.model.embed_tokens.weight).abs().max().item()
    assert moved > 1e-4, moved
    peft = PeftModel.from_pretrained(base, f"{final}/adapter")
    ids = torch.arange(32)[None] % 2048
    with torch.no_grad():
        assert torch.allclose(peft(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)


def test_a_pipeline_that_steps_the_tied_copies_apart_fails_at_step_0(runs):
    """The seeded bug: the pipeline's two ends each step their copy of the saved embedding with their own gradient.
    The replica check finds the copies (and their moments) parted at step 0."""
    _, bug = runs["bug_pipeline_tie_unsummed"]
    first = bug["steps"][0]["replicas"]
    assert first["parted"] >= 1, first
    assert {t["name"] for t in first["tensors"]} == {EMBEDDING_COPY}, first


def test_saved_modules_are_named_as_peft_matches_them():
    """peft saves every module whose name ends with a key of modules_to_save: `norm` saves the layers' norms too. The
    run's settings list what peft saves — the same model built from them — so a record says what trains."""
    from parity.models.adapters import add_adapters, lora_settings
    from parity.models.model import meta_model, resolve_model_config

    config = resolve_model_config("qwen2-tiny")
    lora = lora_settings(4, None, 0.0, "q_proj", config, "norm")
    assert lora["modules_to_save"] == ["input_layernorm", "norm", "post_attention_layernorm"]
    saved = [n for n, p in add_adapters(meta_model(config), lora).named_parameters()
             if p.requires_grad and ".modules_to_save." in n]
    assert len(saved) == 2 * 2 + 1 and {n.split(".modules_to_save.")[0].rsplit(".", 1)[-1] for n in saved} == set(
        lora["modules_to_save"])
    assert lora_settings(4, None, 0.0, "q_proj", config, ",".join(lora["modules_to_save"])) == lora
