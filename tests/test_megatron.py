"""megatron-core's GPTModel under Hugging Face names (issue 69, item 2; docs/megatron.md): megatron-core 0.16.1 (the
release pip finds for Python 3.11; in a folder of its own, conftest.installed_beside) trains one step at TP 2 over
gloo through tests/megatron_cpu.py, its parameters and gradients gathered and mapped (parity/frameworks/megatron/),
and transformers' Llama and Qwen2 models loaded from them strictly train the same step: the loss equal within 1e-6,
each gradient within 1e-5. The classic mapping bug — linear_fc1's gate and up split as if trained at TP 1 — moves the
loss 1e4 × beyond that. What does not map is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, free_port, installed_beside

TESTS = os.path.dirname(os.path.abspath(__file__))


def megatron_site() -> str:
    """megatron-core 0.16.1 beside the pinned set (its own dependencies, torch, numpy and packaging, are the set's)."""
    return installed_beside("megatron-core-0.16.1", "megatron-core==0.16.1")


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):
    """{"llama" | "qwen2": the job's JSON}: both jobs at TP 2, side by side (two ranks each)."""
    root = tmp_path_factory.mktemp("megatron")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [megatron_site(), REPO,
                                                                     os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    procs = {family: subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         os.path.join(TESTS, "megatron_cpu.py"), os.path.join(TESTS, "megatron_mapping_job.py"),
         str(root / f"{family}.json"), "2", family], env=env, cwd=root, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for family in ("llama", "qwen2")}
    outputs = {family: (proc.wait(timeout=600), proc.stdout.read()) for family, proc in procs.items()}
    for family, (code, output) in outputs.items():
        assert code == 0, output[-4000:]
    return {family: json.loads((root / f"{family}.json").read_text()) for family in procs}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_tp2_megatron_step_is_transformers_step_under_hugging_face_names(mapped, family):
    found = mapped[family]
    assert found["model"] == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    assert abs(found["loss"] - found["hf_loss"]) / found["loss"] < 1e-6, found
    assert len(found["grads"]) == {"llama": 21, "qwen2": 27}[family]  # every transformers tensor, none left over
    assert max(found["grads"].values()) < 1e-5, found["grads"]
    assert abs(found["fc1_as_tp1_loss"] - found["loss"]) / found["loss"] > 1e-4, found
    print(f"{family}: loss {found['loss']:.7f} vs {found['hf_loss']:.7f}, gradients within "
          f"{max(found['grads'].values()):.1e}; fc1 split as at TP 1: {found['fc1_as_tp1_loss']:.7f}")


def test_what_does_not_map_is_refused_in_one_line(mapped):
    """LayerNorm, linear biases, Q/K norms, another MLP, a parameter the mapping does not know: one line each."""
    assert mapped["llama"]["refusals"] == [
        "megatron-core model: normalization 'LayerNorm': Llama and Qwen2 use RMSNorm",
        "megatron-core model: biases on the linear layers (add_bias_linear): Llama and Qwen2 have none there",
        "megatron-core model: Q/K norms (qk_layernorm): not yet mapped",
        "megatron-core model: an MLP other than the gated SiLU one (gated_linear_unit with activation_func silu)",
        "megatron-core parameter decoder.layers.0.mlp.router.weight: the mapping to Hugging Face names does not "
        "know it"]
