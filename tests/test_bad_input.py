"""Bad input → one line naming the problem and the fix, exit 2, before any worker (or Ray) starts."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, to_argv
from parity.errors import ConfigError
from parity.training.config import resolve


def flags(tmp_path, weights, **over):
    return {"model_name": "qwen2-tiny", "num_workers": 2, "seq_length": 64, "init_weights_path": weights,
            "loss_output_dir": tmp_path / "loss", "storage_path": tmp_path / "ray", **over}


CASES = [
    ({"num_workers": 3, "dp_size": 2}, r"--num_workers 3 ≠ --tp_size 1 × --dp_size 2: pass --num_workers 2"),
    ({"num_workers": 3, "tp_size": 2}, r"--num_workers 3 is not a multiple of --tp_size 2"),
    ({"num_workers": 3, "tp_size": 3}, r"--tp_size 3 does not divide the model's KV-head count \(2\): use a tp_size in \[1, 2\]"),
    ({"num_workers": 2, "tp_size": 2}, r"DDP does not shard tensors: --tp_size must be 1 \(got 2\)"),
    ({"batch_size": 0}, r"--batch_size must be a positive integer \(got 0\)"),
    ({"num_workers": -1}, r"--num_workers must be a positive integer \(got -1\)"),
    ({"debug_steps": 0}, r"--debug_steps must be a positive integer \(got 0\)"),
    ({"seq_length": 5000}, r"--seq_length 5000 is above the model's max_position_embeddings \(4096\)"),
    ({"model_name": "nobody/no-such-model"}, r"unknown model 'nobody/no-such-model': not a built-in preset"),
    ({"num_layers": 3}, r"has 2 layers, run asks for 3: pass --num_layers 2"),
    ({"learning_rate": -1}, r"--learning_rate must be positive \(got -1.0\)"),
    ({"precision": "fp32", "autocast": True}, r"--autocast asks for bf16 but --precision fp32"),
    ({"dataset": "text:/no/such/file.txt"}, r"no such file /no/such/file.txt"),
    ({"checkpoint_interval": -1}, r"--checkpoint_interval must be 0 or more \(got -1\)"),
    ({"keep_checkpoints": -2}, r"--keep_checkpoints must be 0 or more \(got -2\)"),
    ({"max_failures": -2}, r"--max_failures must be -1 \(no limit\), 0 or more \(got -2\)"),
]


@pytest.mark.parametrize("over,message", CASES, ids=[c[1][:40] for c in CASES])
def test_resolve_rejects(tmp_path, tiny_weights, over, message):
    with pytest.raises(ConfigError, match=message):
        resolve("ddp", flags(tmp_path, tiny_weights, **over))


def test_missing_weights_without_save(tmp_path):
    with pytest.raises(ConfigError, match=r"init weights file .*nope.pt does not exist: run train_ddp.py with "
                                          r"--save_init_weights first"):
        resolve("ddp", flags(tmp_path, tmp_path / "nope.pt"))
    cfg = resolve("ddp", flags(tmp_path, tmp_path / "new" / "w.pt", save_init_weights=True))
    assert cfg.save_init_weights and cfg.init_weights_path == str(tmp_path / "new" / "w.pt")


def test_unwritable_output_dir(tmp_path, tiny_weights):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"--loss_output_dir .*a_file/loss is not a writable directory"):
        resolve("ddp", flags(tmp_path, tiny_weights, loss_output_dir=blocker / "loss"))
    with pytest.raises(ConfigError, match=r"--storage_path .*a_file/ray is not a writable directory"):
        resolve("ddp", flags(tmp_path, tiny_weights, storage_path=blocker / "ray"))


def test_good_input_resolves_defaults(tmp_path, tiny_weights):
    cfg = resolve("ddp", flags(tmp_path, tiny_weights))
    assert (cfg.dp_size, cfg.learning_rate, cfg.tokenizer, cfg.experiment_name) == (2, 1e-3, "bytes", "ddp_tp1_dp2")
    assert cfg.final_checkpoint_dir == str(tmp_path / "ray" / "ddp_tp1_dp2" / "final_model")


def run_script(args, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ""}
    return subprocess.run([sys.executable, os.path.join(REPO, "train_ddp.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def test_script_prints_one_line_and_exits_2_before_ray(tmp_path, tiny_weights):
    proc = run_script(to_argv(flags(tmp_path, tiny_weights, num_workers=3, dp_size=2)), tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --num_workers 3 ≠ --tp_size 1 × --dp_size 2: pass --num_workers 2 or change tp/dp"]
    assert "Traceback" not in proc.stderr + proc.stdout and "Ray" not in proc.stdout + proc.stderr
    assert not (tmp_path / "loss" / "loss_ddp.json").exists()


def test_script_mismatched_weights_exit_2(tmp_path, tiny_weights):
    proc = run_script(to_argv(flags(tmp_path, tiny_weights, num_layers=4)), tmp_path)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: init weights file ") and "has 2 layers, run asks for 4" in line
