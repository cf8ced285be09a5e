"""The GPU check prepared on CPU (issue 42, docs/gpu.md): its CPU dry run (the same steps as on a GPU, scaled down),
bad input, the local launcher's placement on a GPU, the worker path without Ray or DeepSpeed, the fingerprint's
CUDA version, and a built bundle's size and wheels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, WITHOUT_GC_SITE, module_from

MIB = 2**20


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The whole check on CPU, once: (exit code, its JSON report, the folder, what it printed)."""
    from parity.commands.gpu_check.check import main

    out = tmp_path_factory.mktemp("gpu_check")
    code = main(["--output_dir", str(out), "--device", "cpu"])
    with open(out / "gpu_check.json") as f:
        return code, json.load(f), out


def _step(report: dict, name: str) -> dict:
    return next(s for s in report["steps"] if s["step"] == name)


def test_the_dry_run_passes_every_step_and_writes_one_report(dry_run):
    code, report, out = dry_run
    assert code == 0, [(s["step"], s["error"]) for s in report["steps"]]
    assert [s["step"] for s in report["steps"]] == ["collectives", "seed", "own_trainer", "layer_check", "posttrain",
                                                    "lora", "parity"]
    assert all(s["passed"] and s["error"] is None and s["seconds"] > 0 for s in report["steps"])
    assert report["total_seconds"] >= sum(s["seconds"] for s in report["steps"])  # each step timed, in the total
    assert report["environment"]["versions"]["torch"].startswith("2.")
    text = (out / "gpu_check.md").read_text()
    assert f"torch {report['environment']['versions']['torch']}" in text
    assert "DeepSpeed paths" in text and text.count("| passed |") == 6


def test_the_dry_run_skips_the_own_trainer_gpu_paths_in_one_line(dry_run):
    """Trainer with accelerate's FSDP2, Lightning's FSDP and ModelParallel need CUDA: on CPU the step says so."""
    from parity.commands.gpu_check.own_trainer import SKIPPED

    _, report, out = dry_run
    step = _step(report, "own_trainer")
    assert step["passed"] and step["details"] == {"skipped": SKIPPED} and step["seconds"] < 1
    text = (out / "gpu_check.md").read_text()
    assert "| own_trainer | skipped |" in text and SKIPPED in text


def test_the_dry_run_tries_every_collective_on_two_gloo_ranks(dry_run):
    from parity.commands.gpu_check.collectives import _last_begun

    _, report, out = dry_run
    # each rank notes the collective it begins, so that a crash (gloo with CUDA tensors died so) names it
    assert [_last_begun(str(out / "collectives" / "collectives.json"), r) for r in (0, 1)] == ["barrier object"] * 2
    d = _step(report, "collectives")["details"]
    assert d["backend"] == "gloo" and d["ranks"] == 2 and d["tensors_on"] == "cpu"
    tensor_ops = {"all_reduce", "all_reduce_max", "broadcast", "all_gather", "all_gather_into_tensor",
                  "reduce_scatter_tensor", "all_to_all_single", "send_recv", "batch_isend_irecv", "funcol_all_reduce",
                  "funcol_all_gather_tensor", "funcol_reduce_scatter_tensor"}
    assert tensor_ops <= set(d["results"]) and len(d["results"]) == 15
    assert all(set(d["results"][op]) == {"float32", "bfloat16"} for op in tensor_ops)
    assert sorted(d["working"]) == sorted(d["results"])  # gloo takes every one on CPU


def test_the_seed_step_measures_each_strategy_at_one_rank(dry_run):
    _, report, _ = dry_run
    d = _step(report, "seed")["details"]
    assert list(d["rows"]) == ["ddp", "fsdp", "transformers"]
    losses = []
    for name, row in d["rows"].items():
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 10 * MIB, row
        assert row["memory_metric"].startswith("process_max_rss") and row["backend"] == "gloo"
        assert row["mfu"] is None and row["flops_per_token"] > 0  # no bf16 peak on a CPU
        assert row["steps"] == 3 and os.path.exists(row["loss_record"])
        losses.append(row["final_loss"])
    assert max(losses) - min(losses) <= 1e-2 * abs(losses[0]), losses  # one rank, one model, bf16


def test_the_dry_run_judges_parity_with_the_harness_verdict(dry_run):
    from parity.comparing.tolerances import NOISE_K

    _, report, _ = dry_run
    comparisons = _step(report, "parity")["details"]["comparisons"]
    fp32 = [c for c in comparisons if c["precision"] == "fp32"]
    assert [(c["seed"], c["layout"]) for c in fp32] == [(1, "tp2dp1"), (1, "tp2dp2")]
    for c in fp32:
        assert c["exit_code"] == 0 and c["verdict"] == "PASS" and c["calibrated"] is False
        assert c["max_rel_diff"]["loss"] < 1e-5, c
    bf16 = [c for c in comparisons if c["precision"] == "bf16"]
    assert [(c["seed"], c["layout"]) for c in bf16] == [(1, "tp2dp1"), (1, "tp2dp2")] and len(comparisons) == 4
    for c in bf16:
        assert c["exit_code"] == 0 and c["verdict"] == "PASS" and c["calibrated"] is True
        assert len(c["noise_references"]) == 3  # the twins at DP=1 and DP=4, the fp32 twin
        assert 0 <= max(c["noise_ratio"].values()) < NOISE_K, c
    layers = _step(report, "layer_check")["details"]
    assert layers["exit_code"] == 0 and "--launcher local" in layers["command"]
    assert [(p["run"], p["verdict"], p["calibrated"]) for p in layers["pairs"]] == [("fsdp", "PASS", True)]


def test_the_dry_run_judges_lora_under_fsdp2_tp(dry_run):
    """The lora step: the parity step's layouts with rank-8 adapters on the attention projections, at the first seed —
    fp32 within 1e-5 of DDP's LoRA run (measured ≤ 1e-7), bf16 PASS calibrated on DDP's references."""
    from parity.comparing.tolerances import NOISE_K

    _, report, out = dry_run
    d = _step(report, "lora")["details"]
    assert d["lora"] == {"lora_r": 8, "lora_targets": "q_proj,k_proj,v_proj,o_proj"} and d["seeds"] == [1]
    assert [(c["precision"], c["layout"]) for c in d["comparisons"]] == [
        ("fp32", "tp2dp1"), ("fp32", "tp2dp2"), ("bf16", "tp2dp1"), ("bf16", "tp2dp2")]
    for c in d["comparisons"]:
        assert (c["exit_code"], c["verdict"], c["calibrated"]) == (0, "PASS", c["precision"] == "bf16"), c
        if c["precision"] == "fp32":
            assert max(c["max_rel_diff"].values()) < 1e-5, c
        else:
            assert 0 <= max(c["noise_ratio"].values()) < NOISE_K, c
    record = json.loads((out / "lora" / "fp32" / "seed_1" / "tp2dp1" / "loss_fsdp.json").read_text())
    assert record["config"]["lora"]["targets"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert "LoRA adapters (rank 8" in (out / "gpu_check.md").read_text()


def test_the_dry_run_judges_a_grpo_update_from_a_rollout_file(dry_run):
    """The posttrain step: dapo on make_rollouts.py's file, FSDP2 + TP=2 × DP=2 against DDP DP=2 — fp32 within 1e-5
    (measured 9.6e-8 on the loss), bf16 PASS calibrated on DDP's two references (measured 1.8 × noise)."""
    from parity.comparing.tolerances import NOISE_K

    _, report, out = dry_run
    d = _step(report, "posttrain")["details"]
    assert d["config"]["objective"] == "dapo"
    assert [(c["precision"], c["layout"]) for c in d["comparisons"]] == [("fp32", "tp2dp2"), ("bf16", "tp2dp2")]
    fp32, bf16 = d["comparisons"]
    assert (fp32["exit_code"], fp32["verdict"], fp32["calibrated"]) == (0, "PASS", False)
    assert max(fp32["max_rel_diff"].values()) < 1e-5, fp32
    assert (bf16["exit_code"], bf16["verdict"], bf16["calibrated"]) == (0, "PASS", True)
    assert len(bf16["noise_references"]) == 2 and 0 <= max(bf16["noise_ratio"].values()) < NOISE_K, bf16
    record = json.loads((out / "posttrain" / "fp32" / "loss_fsdp.json").read_text())
    assert record["config"]["objective"]["name"] == "dapo" and len(record["steps"]) == 2


@pytest.mark.parametrize("argv,line", [
    (["--device", "tpu"], "error: --device tpu: use cuda (the check) or cpu (the dry run)"),
    (["--device", "cpu", "--steps", "seed", "nope"], "error: --steps nope: use any of collectives, seed, own_trainer, "
                                                      "layer_check, posttrain, lora, parity"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, line):
    from parity.commands.gpu_check.check import main

    assert main(["--output_dir", str(tmp_path / "out"), *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]
    assert not (tmp_path / "out").exists()


def test_an_unwritable_output_or_no_gpu_is_one_line_and_exit_2(tmp_path, capsys):
    import torch

    from parity.commands.gpu_check.check import main

    (tmp_path / "file").write_text("x")
    assert main(["--output_dir", str(tmp_path / "file" / "out"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --output_dir {tmp_path / 'file' / 'out'} is not a writable")
    if not torch.cuda.is_available():
        assert main(["--output_dir", str(tmp_path / "out"), "--device", "cuda"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            "error: --device cuda: torch sees no GPU here: use --device cpu for the dry run"]


def test_the_local_launcher_places_ranks_on_the_runs_device(tmp_path, monkeypatch):
    """cpu: gloo; cuda: NCCL with rank r on cuda:r, or under the testing switch gloo with every rank on cuda:0, and
    resolve told as many GPUs as a group asks for (where torch sees one)."""
    import torch

    from parity.driver import local_group
    from parity.errors import ConfigError

    monkeypatch.delenv(local_group.SHARE_ONE_GPU, raising=False)
    assert local_group.placement("cpu") == ("gloo", None)
    assert local_group.placement("cuda") == ("nccl", None)
    assert local_group.local_cluster("cpu") == local_group.CLUSTER
    monkeypatch.setenv(local_group.SHARE_ONE_GPU, "1")
    assert local_group.placement("cuda") == ("gloo", "0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert local_group.local_cluster("cuda").gpus == local_group.SHARED_GPU_RANKS == 64
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert local_group.local_cluster("cuda").gpus == 0
    with pytest.raises(ConfigError, match=r"--device cuda needs 2 GPUs \(one per worker\), the Ray cluster has 0"):
        local_group.plan("ddp", {"model_name": "qwen2-tiny", "seq_length": 16, "device": "cuda",
                                 "init_weights_path": str(tmp_path / "w.pt"), "save_init_weights": True,
                                 "loss_output_dir": str(tmp_path / "l"), "storage_path": str(tmp_path / "s")})


def test_the_worker_path_imports_without_ray_or_deepspeed():
    """The device image has neither: the worker, the local launcher, the layer check, the comparison, the check and
    the strategies that run without DeepSpeed import with both blocked."""
    code = """
import sys
sys.modules['ray'] = None
sys.modules['deepspeed'] = None
import parity.training.loop, parity.driver.local_group, parity.layer_check.layer_step, parity.commands.gpu_check.check
import parity.commands.layer_check, parity.commands.compare_curves, parity.comparing.curve_report
from parity.registry import load, row
print(' '.join(load(row(n).path).__name__ for n in ('ddp', 'fsdp', 'pipeline', 'transformers')))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["DDPStrategy", "FSDPStrategy", "PipelineStrategy", "TransformersStrategy"]


def test_the_fingerprint_records_cuda_and_reports_show_it(monkeypatch):
    import importlib.metadata

    import torch

    from parity import fingerprint

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "cuda" not in fingerprint.library_versions()  # a CPU build says nothing
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    versions = fingerprint.library_versions()
    assert versions["cuda"] == "13.0" and versions["torch"] == importlib.metadata.version("torch")
    fp = {"shared_code_sha256": "a" * 64, "strategy_code": {"sha256": "b" * 64, "files": ["ddp_strategy.py"]},
          "versions": versions, "device": "NVIDIA H100 80GB HBM3 (CUDA 13.0)", "model_type": "qwen2"}
    line = fingerprint.short(fp)
    assert "cuda 13.0" in line and f"torch {versions['torch']}" in line and "NVIDIA H100 80GB HBM3 (CUDA 13.0)" in line


def test_a_built_bundle_fits_and_carries_wheels_the_device_takes():
    manifest = os.path.join(REPO, ".whl", "bundle.json")
    if not os.path.exists(manifest):
        pytest.skip("no bundle built here (python tools/build_gpu_bundle.py builds .whl/)")
    import zipfile

    with open(manifest) as f:
        m = json.load(f)
    folder = os.path.dirname(manifest)
    wheels = sorted(f for f in os.listdir(folder) if f.endswith(".whl"))
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    assert size <= 64 * MIB and m["travelling_bytes"] <= 64 * MIB, (size, m["travelling_bytes"])
    names = [w.split("-")[0].lower() for w in wheels]
    assert len(names) == len(set(names)), wheels  # one version of each
    with open(os.path.join(REPO, "requirements.txt")) as f:
        pinned = next(line.split("==")[1].strip() for line in f if line.startswith("transformers=="))
    assert f"transformers-{pinned}-py3-none-any.whl" in wheels
    assert not any(n in ("deepspeed", "ray") for n in names)
    for w in wheels:
        with zipfile.ZipFile(os.path.join(folder, w)) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
        tags = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Tag:")]
        assert tags and all(t in ("py3-none-any", "py312-none-any") or (t.startswith("cp312-") and "manylinux" in t and
                                                    t.endswith("x86_64")) for t in tags), (w, tags)


def _modules_of_rank(rank: int, out: str) -> None:
    import sys as _sys

    with open(f"{out}.{rank}", "w") as f:
        json.dump(sorted(m for m in _sys.modules if m.startswith("transformers.models.qwen2")), f)


def test_a_cuda_group_spawns_its_ranks_and_a_cpu_group_forks_them(tmp_path):
    """On cuda a local group's ranks are spawned, not forked from the forkserver: what the forkserver imports asks torch
    for the GPUs, and a process forked after that cannot use CUDA (the first GPU check: every rank failed so). A spawned
    rank has imported nothing of PRELOAD; a forked one has transformers' Qwen2 already."""
    from parity.driver.local_group import start_method, start_processes

    assert (start_method("cuda"), start_method("cpu")) == ("spawn", "forkserver")
    for device in ("cuda", "cpu"):
        start_processes(_modules_of_rank, (str(tmp_path / device),), 1, device=device)
        held = json.loads((tmp_path / f"{device}.0").read_text())
        assert (held == []) == (device == "cuda"), (device, held)


FORKSERVER_EXIT = """
import gc, multiprocessing
from parity.driver.local_group import PRELOAD

def rank():
    print("rank:", *gc.get_threshold(), gc.get_freeze_count(), flush=True)

if __name__ == "__main__":
    multiprocessing.set_forkserver_preload(PRELOAD)
    process = multiprocessing.get_context("forkserver").Process(target=rank)
    process.start()  # after the server's imports and its freeze
    process.join()
    print("the command's last line", flush=True)
"""
PYTHONS_OWN = (700, 10, 10)  # CPython's thresholds, which a process has unless it sets its own


def test_the_forkserver_leaves_nothing_after_the_commands_last_line_and_its_ranks_collect_as_usual(tmp_path):
    """The local groups' forkserver freezes its imports' objects (rank_preload.py) and unfreezes them as it exits:
    frozen, triton's bindings printed "nanobind: leaked … instances" on the terminal after verify_trainer.py's last
    line (CI: a test of that line failed so). It imports under fewer collections (parity/gc_thresholds.py) and sets
    CPython's own thresholds back before its ranks fork: a rank collects as it did, its imports' ~500 000 objects
    frozen."""
    script = tmp_path / "command.py"
    script.write_text(FORKSERVER_EXIT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "the command's last line"
    rank = [int(x) for x in next(line for line in lines if line.startswith("rank:")).split()[1:]]
    assert tuple(rank[:3]) == PYTHONS_OWN and rank[3] > 200_000, rank
    assert "leaked" not in done.stderr, done.stderr[-2000:]


def test_a_command_collects_less_often_while_it_imports_and_a_users_process_as_usual():
    """parity/gc_thresholds.py: a command's process (anything under parity.commands: the root scripts, `parity`)
    collects at IMPORTING's thresholds; a user's script that imports parity's recorder keeps CPython's own."""
    from parity.gc_thresholds import IMPORTING

    def thresholds(imports: str) -> tuple:
        code = f"import gc, {imports}; print(*gc.get_threshold())"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                              env={**os.environ, "PYTHONPATH": WITHOUT_GC_SITE})  # as a user's process starts
        assert done.returncode == 0, done.stderr[-2000:]
        return tuple(map(int, done.stdout.split()))

    assert thresholds("parity.commands.common") == IMPORTING != PYTHONS_OWN
    assert thresholds("parity.recording.recorder") == PYTHONS_OWN


def test_a_model_is_recorded_on_the_device_it_trains_on_not_its_backends():
    """The second GPU session's finding: a model on the GPU whose ranks share it over gloo was recorded as a CPU run
    (the device was read off the backend) and replayed on the CPU, where loading its CUDA states failed. The record's
    device is its parameters'."""
    import torch

    from parity.views.base import trained_device

    cuda = torch.device("cuda", 0)
    on_gpu = torch.nn.Linear(2, 2, device="meta")
    on_gpu.weight = torch.nn.Parameter(torch.empty(2, 2, device="meta"))
    on_gpu.weight.__class__ = type("OnGpu", (torch.nn.Parameter,), {"device": property(lambda self: cuda)})
    assert trained_device(on_gpu, torch.device("cpu")) == cuda  # gloo's exchanges, the GPU's training
    assert trained_device(torch.nn.Linear(2, 2, device="meta"), torch.device("cpu")) == torch.device("cpu")
    assert trained_device(torch.nn.ReLU(), torch.device("cpu")) == torch.device("cpu")  # no parameters: the backend's


def test_the_examples_and_the_matrix_go_to_the_gpu_when_told(monkeypatch):
    """tools/kernel_matrix.py --device cuda: each example at one rank with its own GPU flags (the 2-rank row at two),
    the CUDA settings, every rank on the one GPU; the examples' backend: gloo on CPU and for ranks sharing a GPU."""
    from parity.attaching.launch import backend
    from parity.calibration.kernel_settings import environment

    matrix = module_from(os.path.join(REPO, "tools", "kernel_matrix.py"), "kernel_matrix")
    lines = {c: matrix.CAPABILITIES[c][0]("CODE", "OUT", "cuda") for c in ("trainer_bf16", "trainer_bf16_2ranks",
                                                                          "lightning", "resume")}
    assert lines["trainer_bf16"][-5:] == ["--nproc", "1", "--device", "cuda", "--bf16"]
    assert lines["trainer_bf16_2ranks"][-5:] == ["--nproc", "2", "--device", "cuda", "--bf16"]
    assert lines["lightning"][-4:] == ["--nproc", "1", "--accelerator", "gpu"]
    assert "--nproc 1 --device cuda --save_at 3" in lines["resume"][-1]
    assert matrix.CAPABILITIES["trainer"][0]("CODE", "OUT", "cpu")[-2:] == ["--nproc", "2"]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = matrix.environment(REPO, "tf32", "cuda")
    assert env["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] == "1" and env["PARITY_SHARE_ONE_GPU"] == "1"
    assert env["OMP_NUM_THREADS"] == "2"  # a CPU setting's variable is left alone on a GPU
    assert environment("compatible_1thread", {"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in environment("default", {"OMP_NUM_THREADS": "2"})  # on CPU each setting sets its own
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE" not in environment(
        "default", {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}, "cuda")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("PARITY_SHARE_ONE_GPU", raising=False)
    assert (backend("cpu"), backend("cuda")) == ("gloo", "nccl")
    monkeypatch.setenv("PARITY_SHARE_ONE_GPU", "1")
    assert backend("cuda") == "gloo"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert backend("cuda") == "nccl"  # one rank alone on its GPU: what users run
