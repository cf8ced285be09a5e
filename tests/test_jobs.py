"""The Anyscale job files, read by the real Anyscale SDK (the `test` extra): each loads as its JobConfig; every
flag of every entrypoint is one its script takes, and resolves on the job's cluster to seed 000's
configuration on an explicit device; the training jobs hand each other the weights and records through
storage every job of the user mounts, and the comparison job reads them there; the one-job file runs the
main job; every job runs the image built once from the Containerfile, which pins what requirements.txt pins."""

import os
import re
import shlex

import pytest
from anyscale.job.models import JobConfig

from conftest import REPO
from parity.commands import compare_curves, main_job
from parity.commands.train import build_parser
from parity.driver.cluster import Cluster
from parity.driver.config import resolve

# Seed 000's configuration, common to the three commands.
SEED = {"model_name": "Qwen/Qwen2.5-0.5B", "num_layers": 2, "batch_size": 2, "seq_length": 1024, "num_epochs": 1,
        "debug_steps": 100, "learning_rate": 1e-5, "log_interval": 10}
# strategy → (num_workers, tp_size, dp_size, save_init_weights): seed 000's three commands.
LAYOUTS = {"ddp": (2, 1, 2, True), "deepspeed": (4, 2, 2, False), "fsdp": (4, 2, 2, False)}
TRAINING_JOBS = ("ddp", "deepspeed", "fsdp", "verification")
ALL_JOBS = (*TRAINING_JOBS, "compare")
# GPUs per instance type the job files may name (AWS).
INSTANCE_GPUS = {"m5.2xlarge": 0, "g5.12xlarge": 4}
IMAGE = "anyscale/image/parity-harness:1"  # what `anyscale image build -n parity-harness` names its first build
# Storage that a later job sees (docs/anyscale.md): the user's, or the cloud's. Not /mnt/cluster_storage.
SHARED_BETWEEN_JOBS = "/mnt/user_storage/parity/"


def job(name: str) -> JobConfig:
    return JobConfig.from_yaml(os.path.join(REPO, f"job_{name}.yaml"))


def entrypoint(name: str) -> list[str]:
    return shlex.split(job(name).entrypoint)


def train_values(strategy: str) -> dict:
    argv = entrypoint(strategy)
    assert argv[:2] == ["python", f"train_{strategy}.py"]
    return vars(build_parser(strategy).parse_args(argv[2:]))


def cluster_of(name: str) -> Cluster:
    """The job's cluster as the harness sees it once its worker nodes are up."""
    workers = job(name).compute_config.worker_nodes
    return Cluster(cpus=48, gpus=sum(INSTANCE_GPUS[w.instance_type] * w.max_nodes for w in workers),
                   nodes=1 + sum(w.max_nodes for w in workers), joined=True)


def here(values: dict, tmp_path) -> dict:
    """The entrypoint's flags with the shared storage moved under tmp_path (this machine has no /mnt)."""
    return {k: v.replace(SHARED_BETWEEN_JOBS, f"{tmp_path}/") if isinstance(v, str) else v for k, v in values.items()}


def test_every_job_file_loads_with_the_sdk_and_runs_the_built_image():
    configs = {name: job(name) for name in ALL_JOBS}
    assert sorted(c.name for c in configs.values()) == sorted(f"parity-{name}" for name in ALL_JOBS)
    for name, config in configs.items():
        assert (config.image_uri, config.containerfile, config.requirements) == (IMAGE, None, None), name
        assert (config.working_dir, config.max_retries) == (".", 0), name
        assert config.timeout_s and config.timeout_s <= 7200, name  # a hung job is stopped, with its cluster
    for name in TRAINING_JOBS:
        assert configs[name].compute_config == configs["ddp"].compute_config, name


@pytest.mark.parametrize("strategy", sorted(LAYOUTS))
def test_training_entrypoints_resolve_to_the_seed_configuration_on_cuda(strategy, tmp_path, monkeypatch):
    values = train_values(strategy)
    assert values["device"] == "cuda"  # explicit: "auto" would decide before the GPU node is up
    monkeypatch.setenv("PARITY_SHARED_PATHS", str(tmp_path))  # stands for /mnt/user_storage here
    cfg = resolve(strategy, here(values, tmp_path), cluster=cluster_of(strategy), weights_written_before_launch=True)
    assert {k: getattr(cfg, k) for k in SEED} == SEED
    assert (cfg.num_workers, cfg.tp_size, cfg.dp_size, cfg.save_init_weights) == LAYOUTS[strategy]
    assert (cfg.device, cfg.precision) == ("cuda", "bf16")  # one GPU per worker, the same precision policy


def test_jobs_hand_over_weights_and_records_through_storage_every_job_sees():
    ddp = train_values("ddp")
    handed = {k: ddp[k] for k in ("init_weights_path", "loss_output_dir", "storage_path")}
    assert all(path.startswith(SHARED_BETWEEN_JOBS) for path in handed.values())
    for strategy in ("deepspeed", "fsdp"):
        assert {k: train_values(strategy)[k] for k in handed} == handed, strategy
    argv = entrypoint("compare")
    assert argv[:2] == ["python", "plot_loss_curves.py"]
    compare = compare_curves.build_parser().parse_args(argv[2:])
    assert compare.input_dir == handed["loss_output_dir"]
    assert os.path.dirname(compare.output) == handed["loss_output_dir"] and compare.output.endswith(".png")


def test_one_job_runs_the_whole_verification(tmp_path, monkeypatch):
    """job_verification.yaml: run_verification_main.sh, whose plan on the job's 4 GPUs is seed 000's three runs
    in bf16, DDP's two twins and its fp32 twin, with every output under the user's shared storage."""
    for env, *_ in main_job.SETTINGS:
        monkeypatch.delenv(env, raising=False)
    argv = entrypoint("verification")
    assert argv[:2] == ["bash", "run_verification_main.sh"]
    args = main_job.build_parser().parse_args(argv[2:])
    assert args.device == "cuda" and args.output_dir.startswith(SHARED_BETWEEN_JOBS)
    monkeypatch.setenv("PARITY_SHARED_PATHS", str(tmp_path))
    args.output_dir = here({"out": args.output_dir}, tmp_path)["out"]
    cluster = cluster_of("verification")
    cfgs = [resolve(strategy, values, cluster=cluster, weights_written_before_launch=True)
            for strategy, values in main_job.run_plan(args, args.output_dir, cluster)]
    assert [(c.strategy, c.tp_size, c.dp_size, c.batch_size, c.noise_reference) for c in cfgs] == [
        ("ddp", 1, 2, 2, False), ("ddp", 1, 1, 4, True), ("ddp", 1, 4, 1, True), ("ddp", 1, 2, 2, True),
        ("deepspeed", 2, 2, 2, False), ("fsdp", 2, 2, 2, False)]
    seed = {k: v for k, v in SEED.items() if k != "batch_size"}  # the twins' batch is the whole global batch
    for cfg in cfgs:
        assert {k: getattr(cfg, k) for k in seed} == seed
        fp32_twin = cfg.noise_reference and cfg.dp_size == 2  # DDP at its own layout in fp32: a reference
        assert (cfg.device, cfg.precision) == ("cuda", "fp32" if fp32_twin else "bf16")
        assert cfg.loss_output_dir == os.path.join(args.output_dir, "loss_curves")


@pytest.mark.parametrize("name", TRAINING_JOBS)
def test_cluster_has_a_gpu_per_worker_and_a_cpu_head(name):
    compute = job(name).compute_config
    assert INSTANCE_GPUS[compute.head_node.instance_type] == 0
    assert cluster_of(name).gpus >= 4  # the TP=2 × DP=2 runs, one GPU each
    assert all(w.min_nodes == w.max_nodes for w in compute.worker_nodes)


def pins(text: str) -> dict[str, str]:
    return dict(re.findall(r"([A-Za-z][A-Za-z0-9_.\[\]-]*)==([0-9][^\s\"']*)", text))


def test_the_image_is_built_once_from_a_containerfile_pinning_requirements_txt():
    with open(os.path.join(REPO, "requirements.txt")) as f:
        pinned = pins(f.read())
    with open(os.path.join(REPO, "Containerfile")) as f:
        containerfile = f.read()
    base = re.search(r"^FROM anyscale/ray:(\S+?)-py\d+-cu\d+$", containerfile, re.M)
    assert base and base.group(1) == pinned["ray[train]"]
    assert pins(containerfile) == pinned
    with open(os.path.join(REPO, "docs", "anyscale.md")) as f:
        assert "anyscale image build -n parity-harness -f Containerfile" in f.read()
