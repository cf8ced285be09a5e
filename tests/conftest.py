"""Shared fixtures: one local Ray cluster per test process (Ray start-up dominates a CPU run), tiny shared
initial weights and shared strategy runs, made once per session, and a helper that runs a strategy exactly as
its entry script would. The project is installed (`pip install -e .`): nothing here edits sys.path.

The suite runs in several processes (pytest-xdist, pyproject.toml's addopts): a test module stays in one process
(its module-scoped runs are made once), and what the session shares (`once_per_session`) is made by the first
process that needs it, under a file lock, and read by the others from the session's common folder.
Much of a test's time is fixed cost where one core idles (Ray's start-up, imports): two processes fill it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

import pytest

from parity.gc_thresholds import fewer_collections

fewer_collections()  # a test process imports most of what the harness imports (parity/gc_thresholds.py)

# Every Python process the suite starts imports tests/gc_site/sitecustomize.py first: the examples' and scripts' processes
# too, a user's, which the harness leaves as they are, import under fewer collections (~1 CPU-s each). A test of what a
# user's process keeps runs it without (WITHOUT_GC_SITE).
GC_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gc_site")
WITHOUT_GC_SITE = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != GC_SITE)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [GC_SITE, WITHOUT_GC_SITE]))

# The S3 tests' server (moto, tests/test_storage.py) takes any credentials; Ray workers inherit the
# environment of the process that starts the session cluster, so they are set here, before it starts —
# and no test can reach a real account with the developer's own.
os.environ.update(AWS_ACCESS_KEY_ID="parity-test", AWS_SECRET_ACCESS_KEY="parity-test", AWS_EC2_METADATA_DISABLED="true")
for _name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
    os.environ.pop(_name, None)

from parity.comparing.tolerances import RESUMED_FP32, SHORT_RUN_BF16, final_parameters_atol_fp32
from parity.training.record import load_record

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the top-level scripts are

# Whether this CPU has fp16 kernels (AVX512-FP16 or AMX-FP16): DeepSpeed's fp16 mode runs on CPU workers only there, and
# the harness refuses it elsewhere (DeepSpeedStrategy.validate).
CPU_HAS_FP16 = bool({"avx512_fp16", "amx_fp16"} & set(
    next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])))

# Small enough that a Ray Train run is dominated by start-up, big enough that TP has work to split.
TINY = {"model_name": "qwen2-tiny", "seq_length": 64, "log_interval": 5}


# The order the test processes take the modules in (pytest-xdist hands them out in the collection's order,
# --no-loadscope-reorder in pyproject.toml): first a module that reads the session's shared runs, so that one process
# makes them while the other runs the longest module that needs none (before, the second process to reach a module of
# them waited on their lock, 75 s); then the longest first (--durations=0, docs/benchmark.md), so that neither process
# is left alone with a long module at the end. The modules not listed, each under 40 s, follow in collection order.
MODULE_ORDER = ("test_checkpoints", "test_families", "test_calibration", "test_main_script", "test_benchmark",
                "test_megatron", "test_replicas", "test_precision", "test_own_trainer", "test_posttrain_recorder", "test_verify_trainer",
                "test_moe", "test_teacher_forced", "test_storage", "test_lora", "test_torchtitan", "test_techniques",
                "test_own_trainer_frameworks", "test_multinode", "test_verification", "test_gpu_check",
                "test_posttrain", "test_custom_strategy", "test_real_size", "test_own_trainer_states", "test_compare",
                "test_packing", "test_own_trainer_sharded")


# `pytest -m quick` (README): the core verdict while working on one part — the strategies at fp32 parity on the session's
# shared runs (DDP, DeepSpeed AutoTP + ZeRO, FSDP2 + TP), the replicas, the tensor verdict, the curve verdict and its
# report, a recorded loop of your own, bad input line by line, the house's rules and the docs' links.
QUICK = ("test_ddp_ray", "test_deepspeed", "test_fsdp", "test_replicas", "test_tensor_verdict", "test_tensor_norms",
         "test_compare", "test_recorded_report", "test_own_trainer", "test_bad_input", "test_model", "test_data",
         "test_house", "test_architecture", "test_docs")


def pytest_configure(config):
    """The project's bytecode, compiled once, before any test process starts (xdist's controller, or the one process):
    where the environment sets PYTHONDONTWRITEBYTECODE, as this machine's and its CI's do, no import writes it, and every
    process the suite starts — Ray's workers, the commands, megatron-core's ranks, each about 100 of the package's
    modules — compiled them from source again (~0.1 CPU-s each; the whole project compiles in 0.4 s)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        import compileall

        for folder in ("parity", "examples", "tests"):
            compileall.compile_dir(os.path.join(REPO, folder), quiet=1)
        compileall.compile_dir(REPO, maxlevels=0, quiet=1)  # the strategies and scripts at the root


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the tests' ids
def pytest_collection_modifyitems(items):
    """One xdist group per test module: the module's tests run in one process, after its fixtures are made once; the
    modules in MODULE_ORDER's order, then the others. The modules of QUICK carry the `quick` mark."""
    modules = list(dict.fromkeys(item.module.__name__ for item in items))
    rank = {name: (MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER), i)
            for i, name in enumerate(modules)}
    items.sort(key=lambda item: rank[item.module.__name__])
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        if item.module.__name__ in QUICK:
            item.add_marker(pytest.mark.quick)


@contextlib.contextmanager
def once_per_session(tmp_path_factory, name: str):
    """Yield (folder, made): `folder` is `name`'s folder for this pytest session, `made` whether another test
    process already made what goes in it (then read it, do not make it again). Without xdist, a new folder."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield tmp_path_factory.mktemp(name), False
        return
    from filelock import FileLock

    folder = tmp_path_factory.getbasetemp().parent / name  # the session's folder, common to its worker processes
    folder.mkdir(exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        made = (folder / ".made").exists()
        yield folder, made
        (folder / ".made").touch()


NETWORK_TROUBLE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
                   "Could not fetch URL", "ProxyError", "Max retries exceeded", "No matching distribution found")


def installed_beside(name: str, *requirements: str) -> str:
    """`requirements` (pip install's arguments) installed beside the pinned set — pip --target, no dependencies: the
    pinned set's serve them — into a cache folder kept between sessions (PARITY_RELEASES_DIR, default
    ~/.cache/parity/releases/`name`), whole or not at all; its path, to put first on PYTHONPATH. Skipped, with the
    reason, only where the package index cannot be reached."""
    import shutil
    import sys

    cache = os.environ.get("PARITY_RELEASES_DIR", os.path.expanduser("~/.cache/parity/releases"))
    target = os.path.join(cache, name)
    if not os.path.isdir(target):
        os.makedirs(cache, exist_ok=True)
        partial = f"{target}.partial{os.getpid()}"
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", partial,
                               *requirements], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            if any(s in proc.stdout + proc.stderr for s in NETWORK_TROUBLE):
                pytest.skip(f"{name} cannot be installed: the package index is unreachable from here")
            raise AssertionError(f"pip could not install {name}: {proc.stderr[-2000:]}")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(partial, target)
    return target


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from parity.driver.cluster import ensure_ray

    ensure_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    """The qwen2-tiny initial weights every parity test starts from (what train_ddp.py would save)."""
    from parity.models.model import build_model, resolve_model_config, save_init_weights

    with once_per_session(tmp_path_factory, "weights") as (folder, made):
        path = str(folder / "init_weights.pt")
        if not made:
            save_init_weights(build_model(resolve_model_config("qwen2-tiny"), seed=42), path)
    return path


@pytest.fixture(scope="session")
def posttrain_rollouts(tiny_weights, tmp_path_factory) -> dict:
    """make_rollouts.py's files from the tiny weights, {"grpo": path, "dpo": path} (tests/test_posttrain.py,
    tests/test_objective_invariance.py): 3 GRPO steps of 4 prompts × 2 completions (one generation batch over the 3
    steps), 2 DPO steps of 4 pairs; completions stop at 1 id in 16, so lengths vary and some are cut at 16 tokens; the
    reference a model of another seed, so the KL term and DPO's log-ratios are not 0 at step 0."""
    from parity.commands.make_rollouts import main as make_rollouts

    shapes = {"grpo": ["--steps", "3", "--prompts_per_step", "4", "--num_generations", "2", "--steps_per_generation", "3"],
              "dpo": ["--steps", "2", "--prompts_per_step", "4"]}
    with once_per_session(tmp_path_factory, "rollouts") as (folder, made):
        paths = {family: str(folder / f"{family}.safetensors") for family in shapes}
        for family, shape in shapes.items():
            if not made:
                assert make_rollouts(["--family", family, "--init_weights_path", tiny_weights, "--output", paths[family],
                                      "--reference_seed", "7", "--stop_token_ids", "0:2048:16", "--threads", "1",
                                      *shape]) == 0
    return paths


def seeded_weights(tmp_path_factory, seed: int) -> str:
    """qwen2-tiny's initial weights from `seed` (what train_ddp.py --save_init_weights --seed writes), for a test module
    that runs at a seed of its own."""
    from parity.models.model import build_model, resolve_model_config, save_init_weights

    path = str(tmp_path_factory.mktemp("weights") / f"init_{seed}.pt")
    save_init_weights(build_model(resolve_model_config("qwen2-tiny"), seed), path)
    return path


def to_argv(flags: dict) -> list[str]:
    """{"tp_size": 2, "autocast": True} → ["--tp_size", "2", "--autocast"], as a user types it (False/None left out)."""
    argv: list[str] = []
    for key, value in flags.items():
        if value is True:
            argv.append(f"--{key}")
        elif value is not False and value is not None:
            argv += [f"--{key}", str(value)]
    return argv


def train(strategy: str, out_dir, **flags) -> dict:
    """Run one strategy through the same path as its train_*.py script; return the loss record."""
    from parity.commands.train import run

    flags = {**TINY, "loss_output_dir": out_dir / "loss", "storage_path": out_dir / "ray", **flags}
    return load_record(run(strategy, flags))


def run_main(out, **env_vars):
    """run_verification_main.sh as a user runs it, shortened: 12 steps of 64 tokens on CPU workers. A PYTHONPATH
    given goes first, before the one this session has."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if "PYTHONPATH" in env_vars and env.get("PYTHONPATH"):
        env_vars["PYTHONPATH"] += os.pathsep + env["PYTHONPATH"]
    env.update({"OUTPUT_DIR": str(out), "DEBUG_STEPS": "12", "SEQ_LENGTH": "64", "LOG_INTERVAL": "4",
                "DEVICE": "cpu", **env_vars})
    return subprocess.run(["bash", os.path.join(REPO, "run_verification_main.sh")], env=env, capture_output=True,
                          text=True, timeout=1200, cwd=out.parent)


PERTURBED = "compatible_1thread"
"""The kernel setting (parity.calibration.kernel_settings) each capability's clean run is tested under once, beside the
default elsewhere: MKL's compatible fp32 path (other fp32 bits on AMD and Intel alike), oneDNN's AVX512_CORE bf16
kernels, one thread (docs/tolerances.md#every-machine-the-clean-matrix)."""


@contextlib.contextmanager
def kernel_setting(name: str = PERTURBED):
    """This process's environment under kernel setting `name` for what it starts meanwhile — commands, local groups,
    their replays (this process's own kernels were chosen when it started)."""
    from parity.calibration.kernel_settings import environment

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environment(name, saved))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def output_to(path):
    """This process's output appended to the file `path` (console.redirected: descriptors 1 and 2, which a local
    group's ranks and the commands it starts write to, and Python's streams, which pytest captures apart from them)."""
    from parity.console import redirected

    with open(path, "a", buffering=1) as f, redirected(f):  # appended: Python's writes and the processes' never collide
        yield


def module_from(path, name: str):
    """The Python file at `path` as a module named `name`, loaded by its path (an example or a tool: no sys.path edit)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def multimodal_gemma3(folder) -> None:
    """A Gemma 3 4B-style image-text config.json (Gemma3ForConditionalGeneration) whose language model is gemma3-tiny:
    what a user's checkpoint folder of google/gemma-3-4b-pt holds, at the harness's tiny widths."""
    from parity.models.presets import PRESETS

    text = {**PRESETS["gemma3-tiny"], "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                    "vision_config": vision, "mm_tokens_per_image": 4}))


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"{len(a)} steps vs {len(b)}"
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def series(record: dict, key: str) -> list[float]:
    return [s[key] for s in record["steps"]]


def tensor_series(record: dict, folder=None):
    """The record's every-tensor series (parity/training/tensor_series.py), read from beside it: in `folder`, by
    default the run's loss_output_dir."""
    from parity.training.tensor_series import load_series

    folder = folder if folder is not None else record["config"]["loss_output_dir"]
    return load_series(os.path.join(str(folder), "record.json"), record)


def assert_same_tensors_at_step_0(run: dict, baseline: dict, folder=None, baseline_folder=None) -> None:
    """Two runs of one model from the same weights and batch: their series name the same tensors in the same order, and
    at step 0 each tensor's gradient norm agrees within the fp32 tolerance. Not the parameters': a gradient that is
    rounding alone (a k_proj bias's, which softmax cancels) takes AdamW's first step, ±lr an element, by its sign, so
    that bias's norm already parts by ~1e-5 after it (the parameter series is held by tensor_norms_off instead)."""
    ours, theirs = tensor_series(run, folder), tensor_series(baseline, baseline_folder)
    assert ours.names == theirs.names
    assert max_rel_diff(ours.grad_norm[0], theirs.grad_norm[0]) < FP32_RTOL


def tensor_norms_off(record: dict, folder=None) -> tuple[float, float]:
    """How far each step's tensors' squares are from the step's own norms, at most (relative): the gradients' from its
    pre-clip grad norm (their sum ÷ the clip coefficient where the series holds the clipped gradients), the
    parameters' from its parameter norm; a step an fp16 overflow skipped is left out. The series must name tensors."""
    import math

    found = tensor_series(record, folder)
    assert found is not None and found.names, record.get("tensors")
    grad, param = [], []
    for k, step in enumerate(record["steps"]):
        if step.get("skipped"):
            continue
        coef = found.clip_coef[k] if found.grad == "clipped" else 1.0
        grads = math.sqrt(sum(x * x for x in found.grad_norm[k])) / coef
        params = math.sqrt(sum(x * x for x in found.param_norm[k]))
        grad.append(abs(grads - step["grad_norm"]) / step["grad_norm"])
        param.append(abs(params - step["param_norm"]) / step["param_norm"])
    return tuple(max(off) if not any(math.isnan(x) for x in off) else math.inf for off in (grad, param))


# Strategy parity runs: global batch 4 in every layout (DP=2×2, TP=2×DP=1×4, TP=2×DP=2×2), so one DDP
# run is the baseline for all of them. lr 1e-4 rather than the tiny preset's 1e-3: AdamW moves a weight
# whose gradient is a near-cancellation by ~lr per step whatever the gradient's last bits say, so final
# parameters of two exact runs differ by O(lr·1e-2), and a 1e-5 check of parameters is meaningful only
# when the lr leaves room for it (docs/tolerances.md).
# A checkpoint every 4 steps: the runs keep the last two (steps 8 and 12), which the checkpoint tests resume
# from, damage and replay.
PARITY = {"debug_steps": 12, "learning_rate": 1e-4, "device": "cpu", "log_interval": 4, "checkpoint_interval": 4}


CUSTOM = "my_strategy:HandWrittenDP"  # docs/custom_strategy.md's example, tests/my_strategy.py
BUGS = "parity.calibration.bugs"  # the seeded-bug copies, by import path
FP32, BF16 = {"precision": "fp32"}, {"precision": "bf16"}
DDP_DP2 = {"num_workers": 2, "batch_size": 2}
TP2_DP2 = {"num_workers": 4, "tp_size": 2, "batch_size": 2}
CLIP = 0.05  # far below the ~1.0–1.2 pre-clip norms of the parity runs: every step clips
DDP_LEARNS = {"debug_steps": 50, "learning_rate": 1e-3, "checkpoint_interval": 25}  # test_ddp_ray: the preset's lr

# The strategy runs several test modules share, name → (strategy, flags beyond **PARITY). RAY_RUNS go through Ray
# Train, in one worker group (launch_runs, as the main job does), with their checkpoints: the
# baselines the checkpoint tests copy, damage, kill and replay, DDP's learning and rerun checks (test_ddp_ray, 50
# steps), a user's own strategy module shipped to the workers, and a LoRA run whose step the layer check replays. LOCAL_RUNS are the other parity runs, in local
# gloo groups: what they check is the strategies' arithmetic (DDP's other layout among them), to which Ray adds
# nothing.
RAY_RUNS = {
    "ddp_tp1_dp2": ("ddp", {**DDP_DP2, **FP32}),  # the fp32 baseline of every parity test
    "deepspeed_tp2_dp2": ("deepspeed", {**TP2_DP2, **FP32, "zero_stage": 1}),
    "fsdp_tp2_dp2": ("fsdp", {**TP2_DP2, **FP32}),
    "hand_written_dp_tp1_dp2": ("ddp", {**DDP_DP2, **FP32, "strategy_class": CUSTOM}),
    "ddp_two": ("ddp", {**DDP_DP2, **FP32, **DDP_LEARNS}),
    "ddp_rerun": ("ddp", {**DDP_DP2, **FP32, **DDP_LEARNS}),
    # tests/test_lora.py's run to replay: adapters on packed rows, its own initial weights (the base and the adapters
    # beside it, written by rank 0 into its folder), a checkpoint at steps 2 and 4 (in this group: no Ray launch of its
    # own, ~25 s of a 2-core machine)
    "lora_ddp_packed": ("ddp", {**DDP_DP2, **FP32, "packing": True, "lora_r": 4,
                                "lora_targets": "q_proj,v_proj,o_proj,down_proj", "lora_modules_to_save": "input_layernorm",
                                "debug_steps": 4, "learning_rate": 1e-3, "checkpoint_interval": 2, "log_interval": 2,
                                "batch_size": 4, "save_init_weights": True}),
}
LOCAL_RUNS = {
    "ddp_one": ("ddp", {"num_workers": 1, "batch_size": 4, **FP32, **DDP_LEARNS}),
    "ddp_bf16": ("ddp", {**DDP_DP2, **BF16}),  # the bf16 reference
    # FSDP's --mixed_precision policy's baseline: bf16_params reducing in fp32
    "ddp_bf16_params_fp32_reduce": ("ddp", {**DDP_DP2, "precision": "bf16_params", "reduce_dtype": "fp32"}),
    "ddp_clip": ("ddp", {**DDP_DP2, **FP32, "max_grad_norm": CLIP}),
    "deepspeed_tp2_dp1": ("deepspeed", {"num_workers": 2, "tp_size": 2, "batch_size": 4, **FP32}),
    "deepspeed_tp1_dp2": ("deepspeed", {**DDP_DP2, **FP32}),
    "deepspeed_tp2_dp2_zero2": ("deepspeed", {**TP2_DP2, **FP32, "zero_stage": 2}),
    "deepspeed_tp2_dp2_zero3": ("deepspeed", {**TP2_DP2, **FP32, "zero_stage": 3}),
    "deepspeed_bf16": ("deepspeed", {**TP2_DP2, **BF16}),
    "fsdp_tp1_dp2": ("fsdp", {**DDP_DP2, **FP32}),
    "fsdp_tp2_dp1_clip": ("fsdp", {"num_workers": 2, "tp_size": 2, "batch_size": 4, **FP32, "max_grad_norm": CLIP}),
    "fsdp_bf16_autocast": ("fsdp", {**TP2_DP2, **BF16, "mixed_precision": "autocast"}),
    "fsdp_bf16_policy": ("fsdp", {**TP2_DP2, **BF16, "mixed_precision": "policy"}),
    # transformers' own TP (tests/test_tensor_verdict.py: its every tensor against DDP's)
    "transformers_tp2_dp1": ("transformers", {"num_workers": 2, "tp_size": 2, "batch_size": 4, **FP32}),
    # replicas that part (tests/test_replicas.py): the catalogue's DDP copy, and two of the issue's, in test copies;
    # ddp_clip checks its replicas every 5 steps (and at the end) instead of every step
    "bug_ddp_tied_unreduced": ("ddp", {**DDP_DP2, **FP32, "strategy_class": f"{BUGS}:DDPTiedEmbeddingUnreduced"}),
    "bug_ddp_skips_an_update": ("ddp", {**DDP_DP2, **FP32, "strategy_class": f"{BUGS}:DDPReplicaSkipsAnUpdate"}),
    "bug_deepspeed_local_clip": ("deepspeed", {**TP2_DP2, **FP32, "max_grad_norm": CLIP,
                                               "strategy_class": f"{BUGS}:DeepSpeedClippedWithRankLocalNorm"}),
}
LOCAL_RUNS["ddp_clip"][1]["replica_check_interval"] = 5


@pytest.fixture(scope="session")
def shared_runs(ray_cluster, tiny_weights, tmp_path_factory) -> dict:
    """Every run of RAY_RUNS and LOCAL_RUNS, by name: its loss record (made once in the session)."""
    with once_per_session(tmp_path_factory, "shared_runs") as (root, made):
        if not made:
            paths = make_shared_runs(root, tiny_weights)
            (root / "records.json").write_text(json.dumps(paths))
        paths = json.loads((root / "records.json").read_text())
    return {name: load_record(path) for name, path in paths.items()}


def make_shared_runs(root, tiny_weights) -> dict:
    """Run RAY_RUNS and LOCAL_RUNS under `root`; return their loss records' paths by name."""
    from parity.driver.cluster import Cluster
    from parity.driver.config import resolve
    from parity.training.data import training_data
    from parity.driver.launch import launch_runs
    from parity.driver.local_group import plan, run_group
    from parity.training.record import run_record_path

    def values(name, strategy, flags, storage):
        weights = root / name / "init_weights.pt" if flags.get("save_init_weights") else tiny_weights  # its own
        return {**TINY, **PARITY, "init_weights_path": weights, "loss_output_dir": root / name / "loss",
                "storage_path": storage, "experiment_name": name, **flags}

    cfgs = [resolve(strategy, values(name, strategy, flags, root / "ray"),
                    cluster=Cluster(cpus=2, gpus=0)) for name, (strategy, flags) in RAY_RUNS.items()]
    launch_runs(cfgs, [{"batches": training_data(cfg)} for cfg in cfgs])  # one worker group
    planned = [plan(strategy, {**values(name, strategy, flags, root / "local"), "checkpoint_interval": 0})
               for name, (strategy, flags) in LOCAL_RUNS.items()]
    run_group(planned)  # one local group: a run of fewer workers on its first ranks
    return {cfg.experiment_name: str(run_record_path(cfg)) for cfg in [*cfgs, *(c for c, _ in planned)]}


def lora_group(root, tiny_weights, setting: dict, runs: dict) -> dict:
    """LoRA runs in one local gloo group: the shared tiny weights copied into `root` (the adapters' file lies beside
    them), the adapters drawn once for `setting`'s --lora_* flags, then every run of `runs` — {name: (strategy,
    flags)} — into root/<name>/. Returns {name: (its folder, its record)}."""
    import shutil

    from parity.driver.local_group import plan, run_group
    from parity.models.adapters import lora_settings, write_initial_adapters
    from parity.models.model import resolve_model_config

    weights = str(root / "init_weights.pt")
    shutil.copy(tiny_weights, weights)
    config = resolve_model_config(setting["model_name"])
    lora = lora_settings(setting["lora_r"], None, 0.0, setting["lora_targets"], config,
                         setting.get("lora_modules_to_save"))
    write_initial_adapters(weights, config, lora, seed=42)
    planned = {name: plan(strategy, {**setting, **flags, "loss_output_dir": root / name, "storage_path": root / "ray",
                                     "experiment_name": name, "init_weights_path": weights})
               for name, (strategy, flags) in runs.items()}
    records = run_group(list(planned.values()))
    return {name: (root / name, record) for name, record in zip(planned, records)}


def assert_lora_parity(runs: dict, name: str, baseline: str = "ddp"):
    """A LoRA run of lora_group's against its baseline's: the same batches; every step's loss, pre-clip grad norm and
    parameter norm (what trains) within 1e-5 and the final merged model's tensors within the fp32 bound
    (assert_fp32_parity); the replicas bit-identical (the frozen base checked unmoved among them); the teacher-forced
    step from the run's state within 1e-5 at step 0; the same adapter settings, and the tensor series under the same
    names, within 1e-5 at step 0. Returns the two series (the run's, the baseline's)."""
    folder, run = runs[name]
    base_folder, base = runs[baseline]
    assert_fp32_parity(run, base)
    assert_replicas_held(run)
    checked = run["steps"][0]["teacher_forced"]["tensors"]
    assert max(checked.values()) < FP32_RTOL, max(checked.items(), key=lambda kv: kv[1])
    ours, theirs = tensor_series(run, folder), tensor_series(base, base_folder)
    assert ours.names == theirs.names
    assert max(abs(a / b - 1) for a, b in zip(ours.grad_norm[0], theirs.grad_norm[0]) if b) < FP32_RTOL
    assert run["config"]["lora"] == base["config"]["lora"]
    return ours, theirs


def copy_record(record: dict | str, folder) -> str:
    """A loss record (a record's data, or its path) copied into `folder` with its tensor series
    (loss_<name>.tensors, parity/training/tensor_series.py), as a user copies a run's outputs; returns the copy's
    path."""
    import shutil

    from parity.training.tensor_series import folder_of

    path = record if isinstance(record, str) else os.path.join(record["config"]["loss_output_dir"],
                                                                f"loss_{record['strategy']}.json")
    shutil.copy(path, folder)
    if os.path.isdir(folder_of(path)):
        shutil.copytree(folder_of(path), os.path.join(folder, os.path.basename(folder_of(path))))
    return os.path.join(folder, os.path.basename(path))


@pytest.fixture(scope="session")
def ddp_baseline(shared_runs):
    """DDP, DP=2 × batch 2, fp32: the reference every fp32 strategy test compares against."""
    return shared_runs["ddp_tp1_dp2"]


@pytest.fixture(scope="session")
def deepspeed_tp2_dp2(shared_runs):
    """DeepSpeed AutoTP=2 × ZeRO-1 DP=2, fp32: its parity test's run, and the uninterrupted run a resumed one
    must equal."""
    return shared_runs["deepspeed_tp2_dp2"]


@pytest.fixture(scope="session")
def fsdp_tp2_dp2(shared_runs):
    """FSDP2 + TP=2 × DP=2, fp32: its parity test's run, and the uninterrupted run a resumed one must equal."""
    return shared_runs["fsdp_tp2_dp2"]


@pytest.fixture(scope="session")
def ddp_baseline_bf16(shared_runs):
    """DDP, DP=2 × batch 2, bf16 autocast with fp32 master weights: the bf16 reference."""
    return shared_runs["ddp_bf16"]


def final_parameters(record: dict) -> dict:
    """The run's final Hugging Face checkpoint (a local folder or a URI), as {name: tensor}."""
    from safetensors.torch import load

    from parity import storage

    return load(storage.read_bytes(storage.join(record["final"]["checkpoint_dir"], "model.safetensors")))


def max_abs_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def record_batches(record: dict):
    """The GlobalBatches a run trained on, rebuilt from its record's config."""
    from parity.training.data import GlobalBatches, open_dataset

    cfg = record["config"]
    dataset = open_dataset(cfg["dataset"], cfg["tokenizer"], cfg["model_config"]["vocab_size"], cfg["seq_length"],
                           cfg["num_samples"], cfg["seed"])
    return GlobalBatches(dataset, cfg["global_batch_size"], cfg["seed"])


def mean_loss(logits, labels):
    """The harness's loss of a whole batch by itself: its token-loss sum over its loss tokens."""
    from parity.training.strategy import IGNORE_INDEX, loss_sum

    return loss_sum(logits, labels) / (labels[:, 1:] != IGNORE_INDEX).sum()


def stock_loss(model, batch) -> float:
    """A plain model's mean next-token loss on `batch` (a data.Batch), as the harness defines it."""
    import torch

    with torch.no_grad():
        return mean_loss(model(input_ids=batch.input_ids).logits, batch.labels).item()


def checkpoint_loss(record: dict) -> float:
    """A stock Qwen2ForCausalLM's loss, loaded from the run's final checkpoint, on the batch the run
    evaluated last (after checking it is the batch the run trained on at that step)."""
    from transformers import Qwen2ForCausalLM

    from parity.training.data import batch_hash

    model = Qwen2ForCausalLM.from_pretrained(record["final"]["checkpoint_dir"]).float().eval()
    step = record["final"]["eval_batch_step"]
    batch = record_batches(record)(step)
    assert record["steps"][step]["batch_hash"] == batch_hash(batch)
    return stock_loss(model, batch)


# The strategy tests' tolerances (parity/comparing/tolerances.py; docs/tolerances.md says why).
FP32_RTOL = 1e-5


def assert_same_run_inputs(run: dict, baseline: dict) -> None:
    """Comparable at all: same initial weights, and the same global batch, tokens and lr at every step."""
    assert run["config"]["init_weights_sha256"] == baseline["config"]["init_weights_sha256"]
    for key in ("batch_hash", "tokens", "lr"):
        assert series(run, key) == series(baseline, key), key


def assert_fp32_parity(run: dict, baseline: dict) -> None:
    assert_same_run_inputs(run, baseline)
    assert max_rel_diff(series(run, "loss"), series(baseline, "loss")) < FP32_RTOL
    assert abs(run["steps"][0]["grad_norm"] / baseline["steps"][0]["grad_norm"] - 1) < FP32_RTOL
    assert max_rel_diff(series(run, "grad_norm"), series(baseline, "grad_norm")) < FP32_RTOL
    assert max_rel_diff(series(run, "param_norm"), series(baseline, "param_norm")) < FP32_RTOL
    bound = final_parameters_atol_fp32(series(baseline, "lr"))
    assert max_abs_param_diff(final_parameters(run), final_parameters(baseline)) < bound


def assert_replicas_held(run: dict, groups: int | None = None) -> None:
    """The replica check ran after every step and found every tensor several ranks hold bit-identical on each (and,
    given `groups`, that many replica groups declared)."""
    assert run["replicas"]["declared"] and run["replicas"]["interval"] == 1, run["replicas"]
    if run["replicas"]["groups"] == 0:  # no two ranks hold the same tensor: nothing to check but frozen tensors (LoRA)
        frozen = run["config"].get("lora") is not None
        assert groups in (None, 0) and all(("replicas" in s) == frozen for s in run["steps"])
        assert all(s["replicas"] == {"checked": 0, "parted": 0} for s in run["steps"] if frozen)
        return
    assert [s["replicas"]["parted"] for s in run["steps"]] == [0] * len(run["steps"])
    if groups is not None:
        assert {s["replicas"]["checked"] for s in run["steps"]} == {groups} == {run["replicas"]["groups"]}


def assert_same_curve(run: dict, uninterrupted: dict) -> None:
    """A resumed run: one entry per step, the same batches, and the uninterrupted run's numbers at every step."""
    assert [s["step"] for s in run["steps"]] == list(range(len(uninterrupted["steps"])))
    assert series(run, "batch_hash") == series(uninterrupted, "batch_hash")
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(run, key), series(uninterrupted, key)) <= RESUMED_FP32, key


def assert_bf16_parity(run: dict, baseline_bf16: dict, baseline_fp32: dict) -> None:
    """Within the short-run bf16 tolerances of DDP's bf16 run, and really computed in bf16: its grad norms
    are off the fp32 baseline's by far more than fp32 layouts differ (docs/tolerances.md)."""
    assert_same_run_inputs(run, baseline_bf16)
    assert max_rel_diff(series(run, "loss"), series(baseline_bf16, "loss")) < SHORT_RUN_BF16.loss
    assert max_rel_diff(series(run, "grad_norm"), series(baseline_bf16, "grad_norm")) < SHORT_RUN_BF16.grad_norm
    assert max_rel_diff(series(run, "grad_norm"), series(baseline_fp32, "grad_norm")) > 10 * FP32_RTOL


def side_by_side(commands: dict, cwd, ranks_at_once: int = 6, timeout: float = 1800) -> dict:
    """{name: (exit code, output)} of `commands` ({name: (argv, env, ranks)}) run in `cwd`, started in their order
    while the ranks running stay within `ranks_at_once` (a run of more starts alone): every launch of a module at once
    held ~30 ranks and their replays, ~20 GiB of this machine's 24, and its processes' scheduling, not the work, set
    the module's time. Each run's output goes to a file (a pipe no one reads blocks a chatty run)."""
    import tempfile
    import time

    waiting, running, done = list(commands.items()), {}, {}
    deadline = time.monotonic() + timeout
    while waiting or running:
        while waiting and (not running or sum(r for _, _, r in running.values()) + waiting[0][1][2] <= ranks_at_once):
            name, (argv, env, ranks) = waiting.pop(0)
            log = tempfile.TemporaryFile(mode="w+")
            running[name] = (subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True),
                             log, ranks)
        time.sleep(0.5)
        for name, (proc, log, _) in list(running.items()):
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:
                proc.kill()
            log.seek(0)
            done[name] = (proc.wait(), log.read())
            log.close()
            del running[name]
    return {name: done[name] for name in commands}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int):
    """This process as `rank` of a gloo group of `world` processes on this machine (a test's start_processes rank),
    for the block."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def train_step_at(strategy, batches, k: int):
    """Step k of a run on this rank's DP slice, as the loop trains it (its StepStats)."""
    from parity.training.data import dp_slice
    from parity.training.strategy import lr_at

    b = batches(k)
    return strategy.train_step(dp_slice(b, strategy.ctx.dp_rank, strategy.cfg.batch_size), b.loss_tokens,
                               lr_at(k, strategy.cfg))


def assert_checkpoint_resumes_bitwise(strategy, cfg_dict: dict, batches, directory: str, k: int) -> dict:
    """On every rank of a gloo_rank group: save the strategy's state, take step k, then load the checkpoint into a fresh
    strategy of the run and take step k again — the same loss, grad norm, parameter norm and full parameters, bit for
    bit. Returns the full parameters."""
    import torch
    import torch.distributed as dist

    from parity.training.loop import start_worker

    strategy.save_state(directory)
    dist.barrier()
    first = train_step_at(strategy, batches, k)
    params = strategy.full_parameters()
    fresh = start_worker({"cfg": cfg_dict}).strategy
    fresh.load_state(directory)
    again = train_step_at(fresh, batches, k)
    assert (again.loss, again.grad_norm, again.param_norm) == (first.loss, first.grad_norm, first.param_norm)
    params_again = fresh.full_parameters()
    assert params.keys() == params_again.keys() and all(torch.equal(params[n], params_again[n]) for n in params)
    return params


@contextlib.contextmanager
def tp2_strategy(name: str, rank: int, port: int, weights: str, options: dict):
    """Strategy `name` set up at TP=2×DP=1 (fp32, qwen2-tiny from `weights`) on this rank of a gloo group
    of two processes on this machine, without Ray: for checks of its shards in a test's mp.spawn worker.
    The process group lasts as long as the `with` block."""
    import tempfile

    import torch
    import torch.distributed as dist

    from parity.registry import load
    from parity.driver.cluster import Cluster
    from parity.driver.config import resolve
    from parity.models.model import build_model, load_init_weights, resolve_model_config
    from parity.training.strategy import WorkerContext

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))  # as Ray Train sets them
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out = tempfile.mkdtemp()
        cfg = resolve(name, {"model_name": "qwen2-tiny", "num_workers": 2, "tp_size": 2, "precision": "fp32",
                             "device": "cpu", "learning_rate": 1e-4, "init_weights_path": weights,
                             "loss_output_dir": out, "storage_path": out, **options}, cluster=Cluster(cpus=2, gpus=0))
        strategy = load(cfg.strategy_path)(cfg, WorkerContext(rank=rank, device=torch.device("cpu"), layout=cfg.layout))
        model = build_model(resolve_model_config("qwen2-tiny"), seed=0)
        load_init_weights(model, weights)
        strategy.setup(model)
        yield strategy
    finally:
        dist.destroy_process_group()


def tp_flags(tmp_path, weights, **over) -> dict:
    """The flags of a TP=2 × DP=2 qwen2-tiny run writing under tmp_path, with `over` changed (bad-input tests)."""
    return {"model_name": "qwen2-tiny", "num_workers": 4, "tp_size": 2, "seq_length": 64, "init_weights_path": weights,
            "loss_output_dir": tmp_path / "loss", "storage_path": tmp_path / "ray", **over}


# Layout errors every TP strategy reports the same way (the shared checks), for its own resolve() tests.
TP_LAYOUT_ERRORS = [
    ({"num_workers": 3, "tp_size": 3},
     r"--tp_size 3 does not divide the model's KV-head count \(2\): use a tp_size in \[1, 2\]"),
    ({"num_workers": 3, "dp_size": 2}, r"--num_workers 3 ≠ --tp_size 2 × --dp_size 2: pass --num_workers 4"),
]
