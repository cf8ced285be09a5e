"""Your run at its real size (issue 60): verify_trainer.py --num_layers cuts the user's model in every process of the
unchanged command (parity/attaching/layer_cut.py), and the sharded trusted replay judges a record whose replica
would not fit a worker (parity/replay/replay_choice.py).

One Trainer command shared by the module: examples/hf_trainer.py loading a 4-layer qwen2-tiny folder with
from_pretrained, 2 ranks, under `--num_layers 2` and a --replay_memory below a DDP replica (and above its fully sharded
share), so that the sharded replay judges it; its record then replayed under DDP and ZeRO-3 in one local group, for
fp32 parity between the replays. Lightning's and the plain loop's examples at 4 layers run side by side as one-rank
commands under the variables. The rest is in this process: the hook on transformers' own builders (per-layer lists, a
multimodal config, TRL's builder), the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, free_port, max_rel_diff, series
from test_verify_trainer import _entry_points

BUDGET = 3 * 2**20  # bytes a worker: qwen2-tiny at 2 layers needs 4.85 MiB under DDP, 1.94 MiB fully sharded over 2
STEPS = 2


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A Hugging Face folder of qwen2-tiny at 4 layers (random weights)."""
    from parity.models.model import build_model, resolve_model_config

    folder = tmp_path_factory.mktemp("four_layers")
    build_model(resolve_model_config("qwen2-tiny", 4), 0).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cut(tmp_path_factory, four_layers):
    """{"code", "out", "others"}: the Trainer command verified cut to 2 layers under the memory budget, then its record
    replayed under DDP and ZeRO-3 at 2 workers and at 1 (verify_trainer.py's group of 2) into `others`; and the
    one-rank Lightning and plain-loop commands at 4 layers under the variables with --num_layers 2, side by side
    (their folders)."""
    from parity.commands.verify_trainer import launch_planned, verify
    from parity.driver.local_group import local_cluster
    from parity.attaching import attach
    from parity.replay.replay import plan_replay
    from parity.replay.replay_choice import REPLAYS

    root = tmp_path_factory.mktemp("real_size")
    path = os.pathsep.join([_entry_points(root / "metadata"), REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
    loops = {}
    for name in ("lightning_lm", "plain_loop"):
        env = attach.environment(str(root / name), name, {**os.environ, "PYTHONPATH": path}, num_layers=2)
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
        loops[name] = subprocess.Popen([sys.executable, os.path.join(REPO, "examples", f"{name}.py"), "--output_dir",
                                        str(root / f"{name}_own"), "--model_layers", "4", "--steps", "1"], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = root / "trainer"
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path
    try:
        code = verify(str(out), [sys.executable, os.path.join(REPO, "examples", "hf_trainer.py"), "--model_path",
                                 str(four_layers), "--output_dir", str(root / "trainer_own"), "--nproc", "2", "--steps",
                                 str(STEPS)], num_layers=2, replay_memory=BUDGET, calibrate=False)
    finally:
        os.environ["PYTHONPATH"] = saved or ""
    others = root / "replays"
    planned = [plan_replay(str(out / "loss_hf_trainer.json"), {"num_workers": workers, "loss_output_dir": str(folder),
                                                                 "storage_path": str(others / "ck")},
                           cluster=local_cluster("cpu"), strategy=REPLAYS[name][0], flags=REPLAYS[name][1])
               for name, workers, folder in (("ddp", 2, others), ("zero3", 1, others / "one"), ("zero3", 2, others))]
    launch_planned(planned)  # verify_trainer.py's: the runs of more workers first
    for name, loop in loops.items():
        output = loop.communicate(timeout=600)[0]
        assert loop.returncode == 0, output
    return {"code": code, "out": out, "others": others, "loops": {name: root / name for name in loops}}


def _record(folder, name: str) -> dict:
    return json.loads((folder / f"loss_{name}.json").read_text())


def _layers(folder, name: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / f"recorded_{name}" / "init_weights.safetensors"), "pt") as f:
        return {key.split(".")[2] for key in f.keys() if key.startswith("model.layers.")}


def test_a_trainer_cut_to_two_layers_passes_under_the_sharded_replay(cut, four_layers):
    """The record and its replay hold 2 layers, and the record says it was cut from 4; what Trainer trained from were
    the folder's first 2 layers (from_pretrained loaded them, and no other); DDP's replica would not fit the budget,
    so FSDP2 judged it: PASS, and the report says both."""
    from safetensors import safe_open

    out = cut["out"]
    assert cut["code"] == 0
    record = _record(out, "hf_trainer")
    assert record["config"]["layer_cut"] == {"num_layers": 2, "of": 4}
    assert json.loads((out / "recorded_hf_trainer" / "config.json").read_text())["num_hidden_layers"] == 2
    replay = _record(out, "fsdp")
    assert replay["config"]["model_config"]["num_hidden_layers"] == 2 and replay["config"]["tp_size"] == 1
    assert _layers(out, "hf_trainer") == {"0", "1"}
    with safe_open(str(out / "recorded_hf_trainer" / "init_weights.safetensors"), "pt") as mine, \
            safe_open(str(four_layers / "model.safetensors"), "pt") as theirs:
        shared = set(mine.keys()) & set(theirs.keys())  # the folder keeps the tied lm_head once, as the embedding
        assert {k.split(".")[2] for k in theirs.keys() if k.startswith("model.layers.")} == {"0", "1", "2", "3"}
        assert shared == set(mine.keys()) - {"lm_head.weight"}
        assert all(torch.equal(mine.get_tensor(k), theirs.get_tensor(k)) for k in shared)
    comparison = json.loads((out / "curve_comparison.json").read_text())
    assert comparison["baseline"] == "fsdp" and comparison["against_baseline"]["hf_trainer"]["verdict"] == "PASS"
    report = (out / "curve_report.md").read_text()
    assert "trained cut to its first 2 of 4 decoder layers" in report
    assert "the record's replay under the harness's FSDP2, fully sharded, no TP, over 2 workers" in report


def test_the_sharded_replays_train_as_ddps_replay(cut):
    """FSDP2's replay (the baseline) and ZeRO-3's, at 2 workers and at 1, equal DDP's replay of the same record to fp32
    parity at every step. The ZeRO-3 replay at 1 worker was planned before the one at 2 in the same group, as a
    verify_trainer.py noise reference at another worker count is: a ZeRO-3 run after one on fewer of the group's ranks
    failed on DeepSpeed's module numbering before verify_trainer.py's groups ran the runs of more workers first."""
    ddp = _record(cut["others"], "ddp")
    for replay in (_record(cut["out"], "fsdp"), _record(cut["others"], "deepspeed"),
                   _record(cut["others"] / "one", "deepspeed")):
        for key in ("loss", "grad_norm", "param_norm"):
            assert max_rel_diff(series(replay, key), series(ddp, key)) < 1e-5, (replay["strategy"], key)
    assert _record(cut["others"], "deepspeed")["config"]["options"]["zero_stage"] == 3


def test_a_replica_over_the_budget_is_refused_under_ddp_in_one_line(cut):
    """Asked for DDP under the budget its replica passes: one line naming the sharded replay; auto takes FSDP2."""
    from parity.commands.verify_trainer import plan_replays
    from parity.errors import ConfigError

    record = str(cut["out"] / "loss_hf_trainer.json")
    with pytest.raises(ConfigError) as refused:
        plan_replays(record, str(cut["others"]), None, False, "ddp", BUDGET)
    assert str(refused.value) == (
        "--replay_strategy ddp: loss_hf_trainer.json's replay would hold 4.85 MiB of model, gradients and AdamW states "
        "a worker, over the 3.00 MiB a worker (--replay_memory): replay it sharded: --replay_strategy fsdp (or leave "
        "--replay_strategy out)")
    with pytest.raises(ConfigError, match="even fully sharded over 2 workers"):
        plan_replays(record, str(cut["others"]), None, False, "auto", 2**20)


def test_the_sharded_replays_reference_under_other_kernels_clips_as_its_loop_can(cut, capsys):
    """Calibrated, the record's reference under other kernels clips as torch's clip_grad_norm_ does under FSDP2, as a
    framework's loop does (test_optimizer_noise: bit for bit an FSDP2 loop); under ZeRO-3, whose engine clips in
    DeepSpeed's arithmetic, it clips that way and one line says its bounds do not draw a loop's fp32 clip."""
    from parity.commands.verify_trainer import plan_replays

    record = str(cut["out"] / "loss_hf_trainer.json")
    for replay, strategy, arithmetic in (("fsdp", "fsdp", "torch"), ("zero3", "deepspeed", None)):
        capsys.readouterr()
        reference = plan_replays(record, str(cut["others"]), None, True, replay, BUDGET)[-1][0]
        assert (reference.strategy, reference.noise_kernels, reference.clip_arithmetic) == (
            strategy, "other_kernels", arithmetic)
        said = "does, not as torch's clip_grad_norm_: the bounds do not draw a loop's fp32 clip"
        assert (said in capsys.readouterr().err) == (arithmetic is None), replay


@pytest.mark.parametrize("name", ["lightning_lm", "plain_loop"])
def test_lightning_and_a_plain_loop_are_cut_alike(cut, name):
    """Each builds qwen2-tiny at 4 layers by its class; under the variables it trains 2, and its record says so."""
    folder = cut["loops"][name]
    assert _record(folder, name)["config"]["layer_cut"] == {"num_layers": 2, "of": 4}
    assert json.loads((folder / f"recorded_{name}" / "config.json").read_text())["num_hidden_layers"] == 2
    assert _layers(folder, name) == {"0", "1"}


@pytest.fixture
def hooked(monkeypatch):
    """transformers' PreTrainedModel.__init__ wrapped by the hook in this process (restored after), at --num_layers 8;
    returns the module."""
    from transformers.modeling_utils import PreTrainedModel

    from parity.attaching import layer_cut

    monkeypatch.setattr(PreTrainedModel, "__init__", PreTrainedModel.__init__)
    monkeypatch.setenv(layer_cut.NUM_LAYERS, "8")
    layer_cut._wrap(PreTrainedModel)
    return layer_cut


def test_per_layer_lists_and_layer_indices_are_cut_consistently(hooked):
    """Gemma3's layer_types (five sliding layers, then a full one) keep the first 8 layers' types, as each built layer
    attends; Qwen3-MoE's mlp_only_layers keep the indices below 8, whose layers are dense; a multimodal Gemma3's
    language model is cut and its vision tower keeps its 12 layers; the record's entry says what each had."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from parity.models.families import config_from_dict, family_of
    from parity.models.model import build_model
    from parity.models.presets import PRESETS

    gemma = config_from_dict(PRESETS["google/gemma-3-1b-pt"])
    types = list(gemma.layer_types)
    with torch.device("meta"):
        model = build_model(gemma, 0)
    assert len(model.model.layers) == 8 and list(gemma.layer_types) == types[:8] and "full_attention" in types[:8]
    assert [layer.self_attn.layer_type for layer in model.model.layers] == types[:8]
    assert family_of(model.config).layer_types == tuple(types[:8])
    assert hooked.recorded(model) == {"num_layers": 8, "of": 26}
    moe = Qwen3MoeConfig(num_hidden_layers=12, mlp_only_layers=[0, 5, 9], hidden_size=64, intermediate_size=64,
                         moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         vocab_size=128)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(moe)
    assert moe.mlp_only_layers == [0, 5]
    assert [i for i, layer in enumerate(model.model.layers) if "Sparse" not in type(layer.mlp).__name__] == [0, 5]
    both = Gemma3Config()
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(both)
    assert len(model.model.language_model.layers) == 8 and len(model.model.vision_tower.encoder.layers) == 12


def test_trls_builder_is_cut(hooked, four_layers, monkeypatch):
    """TRL builds a model named to its trainers (or its CLI) with from_pretrained: at --num_layers 2, 2 layers."""
    from trl.trainer.utils import create_model_from_path

    monkeypatch.setenv(hooked.NUM_LAYERS, "2")
    model = create_model_from_path(str(four_layers))
    assert len(model.model.layers) == 2 and hooked.recorded(model) == {"num_layers": 2, "of": 4}


OWN_MODEL = '''
import torch
from parity.recording.recorder import ParityRecorder

open(__file__ + ".ran", "w").close()
model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
'''


def test_a_model_the_cut_cannot_reach_is_refused(tmp_path, capsys, monkeypatch):
    """A script whose model is a module of its own: one line, exit 2, before the command runs. Where such a model
    reaches the recorder anyway (code the check cannot read), the recorder refuses it, as it does an uncut model."""
    from parity.commands.verify_trainer import main
    from parity.attaching import layer_cut
    from parity.models.model import build_model, resolve_model_config

    script = tmp_path / "own_model.py"
    script.write_text(OWN_MODEL)
    code = main(["--output_dir", str(tmp_path / "out"), "--num_layers", "2", "--", sys.executable, str(script)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --num_layers 2: {script} builds its model in no way the cut reaches")
    assert not (tmp_path / "own_model.py.ran").exists()
    monkeypatch.setenv(layer_cut.NUM_LAYERS, "2")
    with pytest.raises(layer_cut.NotCut, match="has 4 decoder layers: it was built where the hook could not cut it"):
        layer_cut.recorded(build_model(resolve_model_config("qwen2-tiny", 4), 0))  # this process: no hook
    with pytest.raises(layer_cut.NotCut, match="is not a transformers model"):
        layer_cut.recorded(torch.nn.Linear(2, 2))


def test_a_replay_sharing_the_runs_library_offers_another(cut):
    """An FSDP2 run judged by the FSDP2 replay: the report says they share FSDP2's code path and offers ZeRO-3; a DDP
    run judged by it: only which replay judged it."""
    from parity.comparing.recorded import replay_lines

    replay = _record(cut["out"], "fsdp")["config"]
    run = _record(cut["out"], "hf_trainer")["config"]
    fsdp2_run = {**run, "sharding": {**run["sharding"], "kind": "fsdp2"}}
    lines = replay_lines(replay, {"hf_trainer": run, "fsdp2_loop": fsdp2_run})
    assert len(lines) == 2 and lines[1].startswith("fsdp2_loop ran FSDP2 (torch's fully_shard) too: the baseline "
                                                   "shares that library's code path with the run it judges")
    assert lines[1].endswith("(verify_trainer.py --replay_strategy zero3)")
