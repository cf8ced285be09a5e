"""The Anyscale job files: entrypoints that resolve (with the job cluster's GPUs) into the seed
configuration, jobs that hand each other the same weights and records, a cluster with the GPUs the runs
need, and an image whose Ray is the pinned one."""

import os
import re
import shlex

import pytest
import yaml

from conftest import REPO
from parity.commands.train import build_parser
from parity.training.cluster import Cluster
from parity.training.config import resolve

# Seed 000's configuration, common to the three commands.
SEED = {"model_name": "Qwen/Qwen2.5-0.5B", "num_layers": 2, "batch_size": 2, "seq_length": 1024, "num_epochs": 1,
        "debug_steps": 100, "learning_rate": 1e-5, "log_interval": 10}
# strategy → (num_workers, tp_size, dp_size, save_init_weights): seed 000's three commands.
LAYOUTS = {"ddp": (2, 1, 2, True), "deepspeed": (4, 2, 2, False), "fsdp": (4, 2, 2, False)}
# GPUs per instance type the job files may name (AWS).
INSTANCE_GPUS = {"m5.2xlarge": 0, "g5.12xlarge": 4}
HANDED_OVER = ("init_weights_path", "loss_output_dir")  # what the DDP job writes and the others read


def load_job(strategy: str) -> dict:
    with open(os.path.join(REPO, f"job_{strategy}.yaml")) as f:
        return yaml.safe_load(f)


def entry_values(strategy: str) -> dict:
    argv = shlex.split(load_job(strategy)["entrypoint"])
    assert argv[:2] == ["python", f"train_{strategy}.py"]
    return vars(build_parser(strategy).parse_args(argv[2:]))


def cluster_gpus(job: dict) -> int:
    return sum(INSTANCE_GPUS[w["instance_type"]] * w["max_nodes"] for w in job["compute_config"]["worker_nodes"])


@pytest.mark.parametrize("strategy", sorted(LAYOUTS))
def test_entrypoint_resolves_to_the_seed_configuration_on_the_jobs_cluster(strategy, tmp_path):
    values = entry_values(strategy)
    storage = os.path.commonpath([values[k] for k in ("loss_output_dir", "storage_path", "init_weights_path")])
    here = {k: v.replace(storage, str(tmp_path)) if isinstance(v, str) else v for k, v in values.items()}
    cfg = resolve(strategy, here, cluster=Cluster(cpus=48, gpus=cluster_gpus(load_job(strategy))),
                  weights_written_before_launch=True)
    assert {k: getattr(cfg, k) for k in SEED} == SEED
    assert (cfg.num_workers, cfg.tp_size, cfg.dp_size, cfg.save_init_weights) == LAYOUTS[strategy]
    assert (cfg.device, cfg.precision) == ("cuda", "bf16")  # one GPU per worker, the same precision policy


def test_jobs_hand_over_the_same_files_on_the_same_cluster():
    ddp = entry_values("ddp")
    for strategy in ("deepspeed", "fsdp"):
        values = entry_values(strategy)
        assert {k: values[k] for k in HANDED_OVER} == {k: ddp[k] for k in HANDED_OVER}
        assert load_job(strategy)["compute_config"] == load_job("ddp")["compute_config"]
        assert load_job(strategy)["image_uri"] == load_job("ddp")["image_uri"]


@pytest.mark.parametrize("strategy", sorted(LAYOUTS))
def test_cluster_has_a_gpu_per_worker_and_a_cpu_head(strategy):
    job = load_job(strategy)
    assert INSTANCE_GPUS[job["compute_config"]["head_node"]["instance_type"]] == 0
    assert cluster_gpus(job) >= LAYOUTS[strategy][0]
    assert all(w["min_nodes"] == w["max_nodes"] for w in job["compute_config"]["worker_nodes"])


def test_image_runs_the_pinned_ray():
    with open(os.path.join(REPO, "requirements.txt")) as f:
        pinned = re.search(r"^ray\[train\]==(\S+)$", f.read(), re.M).group(1)
    for strategy in LAYOUTS:
        assert re.match(rf"anyscale/ray:{re.escape(pinned)}-py\d+", load_job(strategy)["image_uri"]), strategy
