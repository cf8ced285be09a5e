"""Your own strategy, without editing the harness: docs/custom_strategy.md's example (tests/my_strategy.py, data
parallelism written by hand) run with --strategy_class through train_ddp.py's path and Ray Train (its module
shipped to the workers), compared by plot_loss_curves.py and by the layer check; its copy with the classic bug
(gradients summed over DP, never averaged) FAILs."""

import json
import os
import shutil

import pytest

from conftest import CUSTOM, PARITY, TINY, assert_fp32_parity, to_argv
from parity.commands.compare_curves import main as plot_loss_curves
from parity.commands.layer_check import main as layer_check


def verdict(folder, capsys) -> dict:
    code = plot_loss_curves(["--input_dir", str(folder), "--output", str(folder / "c.png")])
    capsys.readouterr()
    return {"code": code, **json.loads((folder / "curve_comparison.json").read_text())["against_baseline"]}


def test_your_strategy_runs_end_to_end_and_passes(shared_runs, ddp_baseline, tmp_path, capsys):
    """Trained through Ray Train with checkpoints, in the shared 2-worker group (conftest's RAY_RUNS)."""
    record = shared_runs["hand_written_dp_tp1_dp2"]
    assert (record["strategy"], record["config"]["strategy_class"]) == ("hand_written_dp", CUSTOM)
    assert record["config"]["fingerprint"]["strategy_code"]["files"] == ["my_strategy.py"]
    assert_fp32_parity(record, ddp_baseline)
    folder = os.path.join(record["config"]["storage_path"], record["config"]["experiment_name"])
    assert os.path.exists(os.path.join(folder, "step_000012", "hand_written_dp.pt"))
    shutil.copy(f"{record['config']['loss_output_dir']}/loss_hand_written_dp.json", tmp_path)
    shutil.copy(f"{ddp_baseline['config']['loss_output_dir']}/loss_ddp.json", tmp_path)
    folder = tmp_path
    result = verdict(folder, capsys)
    assert (result["code"], result["hand_written_dp"]["verdict"]) == (0, "PASS")


def test_your_strategy_with_its_classic_bug_fails(ddp_baseline, tiny_weights, tmp_path, capsys):
    from parity.driver.local_group import plan, run_group

    run_group([plan("ddp", {**TINY, **PARITY, "strategy_class": "my_strategy:HandWrittenDPSummed", "num_workers": 2,
                            "batch_size": 2, "precision": "fp32", "init_weights_path": tiny_weights,
                            "loss_output_dir": tmp_path, "storage_path": tmp_path / "ray", "checkpoint_interval": 0})])
    shutil.copy(f"{ddp_baseline['config']['loss_output_dir']}/loss_ddp.json", tmp_path)
    result = verdict(tmp_path, capsys)
    first = result["hand_written_dp"]["first_outside"]
    assert (result["code"], result["hand_written_dp"]["verdict"], first["step"], first["quantity"]) == (
        1, "FAIL", 0, "grad_norm")
    assert first["value"] == pytest.approx(2 * first["reference"], rel=1e-5)  # summed over 2 ranks


def test_the_layer_check_takes_your_strategy(tmp_path, capsys):
    """Through Ray Train (your module shipped to its workers), and with --launcher local: the same dumps, bit for
    bit."""
    from safetensors.torch import load_file

    for launcher in ("ray", "local"):
        out = tmp_path / launcher
        code = layer_check(to_argv({"output_dir": out, "strategy": "ddp", "strategy_class": CUSTOM, "device": "cpu",
                                    "seq_length": 64, "dp_size": 2, "launcher": launcher}))
        text = capsys.readouterr().out
        assert code == 0, text
        (pair,) = json.loads((out / "layer_comparison.json").read_text())["pairs"]
        assert (pair["run"], pair["reference"], pair["verdict"]) == ("hand_written_dp", "ddp", "PASS")
        assert max(row["rel"] for row in pair["rows"]) < 1e-5
    for dump in ("dump_ddp.safetensors", "dump_hand_written_dp.safetensors"):
        ray, local = load_file(str(tmp_path / "ray" / dump)), load_file(str(tmp_path / "local" / dump))
        assert ray.keys() == local.keys() and all(ray[k].equal(local[k]) for k in ray)
