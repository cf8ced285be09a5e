"""The Anyscale job files: valid YAML with the keys a job needs, and entrypoints the scripts' own parser
accepts with the seed configuration (writing under /mnt/cluster_storage)."""

import importlib.util
import os
import shlex

import pytest
import yaml

from conftest import REPO
from parity.config import build_parser, check_heads, check_layout, config_from_args
from parity.model import resolve_model_config
from parity.strategies import STRATEGY_MODULES, strategy_class

STORAGE = "/mnt/cluster_storage"
SEED = {"model_name": "Qwen/Qwen2.5-0.5B", "num_layers": 2, "batch_size": 2, "seq_length": 1024, "num_epochs": 1,
        "debug_steps": 100, "learning_rate": 1e-5, "log_interval": 10,
        "loss_output_dir": f"{STORAGE}/loss_curves", "storage_path": f"{STORAGE}/ray_checkpoints",
        "init_weights_path": f"{STORAGE}/shared_weights/init_weights.pt"}
# strategy → (num_workers, tp_size, dp_size, save_init_weights, precision): the seed's three commands.
LAYOUTS = {"ddp": (2, 1, 2, True, "auto"), "deepspeed": (4, 2, 2, False, "auto"), "fsdp": (4, 2, 2, False, "bf16")}
# GPUs per instance type the job files may name (AWS).
INSTANCE_GPUS = {"m5.2xlarge": 0, "g5.12xlarge": 4}
REQUIRED_KEYS = {"name", "entrypoint", "image_uri", "compute_config", "working_dir", "requirements", "env_vars",
                 "max_retries"}


def load_job(strategy: str) -> dict:
    with open(os.path.join(REPO, f"job_{strategy}.yaml")) as f:
        return yaml.safe_load(f)


def entry_parser(strategy: str):
    """The script's own parser: with the strategy's flags once its module exists (it may not be written yet)."""
    if importlib.util.find_spec(STRATEGY_MODULES[strategy]) is None:
        return build_parser(strategy, "", None)
    return build_parser(strategy, "", strategy_class(strategy).add_arguments)


@pytest.mark.parametrize("strategy", sorted(LAYOUTS))
def test_job_file_has_the_keys_and_a_4_gpu_cluster(strategy):
    job = load_job(strategy)
    assert REQUIRED_KEYS <= set(job)
    assert job["name"] == f"parity-{strategy}"
    assert job["image_uri"] == "anyscale/ray:2.60.0-py311-cu128"
    assert (job["working_dir"], job["requirements"], job["max_retries"]) == (".", "requirements.txt", 0)
    assert job["env_vars"] == {"PYTHONUNBUFFERED": "1", "RAY_TRAIN_V2_ENABLED": "1"}
    compute = job["compute_config"]
    assert INSTANCE_GPUS[compute["head_node"]["instance_type"]] == 0
    assert sum(INSTANCE_GPUS[w["instance_type"]] * w["max_nodes"] for w in compute["worker_nodes"]) == 4
    assert all(w["min_nodes"] == w["max_nodes"] for w in compute["worker_nodes"])


@pytest.mark.parametrize("strategy", sorted(LAYOUTS))
def test_entrypoint_parses_to_the_seed_configuration(strategy):
    argv = shlex.split(load_job(strategy)["entrypoint"])
    assert argv[:2] == ["python", f"train_{strategy}.py"]
    cfg = config_from_args(strategy, entry_parser(strategy).parse_args(argv[2:]))
    check_layout(cfg)
    model = resolve_model_config(cfg.model_name, cfg.num_layers)
    check_heads(cfg, model.num_attention_heads, model.num_key_value_heads)
    assert {k: getattr(cfg, k) for k in SEED} == SEED
    assert (cfg.num_workers, cfg.tp_size, cfg.dp_size, cfg.save_init_weights, cfg.precision) == LAYOUTS[strategy]
