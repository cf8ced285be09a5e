"""torchtitan jobs verified (docs/torchtitan.md): recorded through the Trainer hook in Hugging Face names, replayed
under the harness's DDP on transformers' LlamaForCausalLM and judged, on the debug model as torchtitan ships it (6
layers, dim 256, 16 heads, vocab 2048, fused QKV), rows of 64 tokens of the tests' own word-level data
(examples/titan_assets.py), 2 rows a rank, 3 steps (the seeded bugs 2: each shows at step 0). torchtitan has no CPU
path: the tests' CPU changes (tests/titan_cpu.py says which and why) are installed by tests/titan_site's
sitecustomize.py, never by the recorder.

- FSDP 2 fp32 as a user types it, from another folder with relative paths: `verify_trainer.py -- torchrun
  --standalone --nproc_per_node 2 -m torchtitan.train --module llama3 --config llama3_debugmodel …`: PASS;
- TP 2, FSDP 2 × TP 2 (4 ranks), fp32: PASS against DDP, every curve within 1e-5 (measured ~1e-8) and every tensor
  within the fixed fp32 table;
- FSDP 2 in bf16 (torchtitan's default mixed precision: bf16 compute, fp32 reduction), calibrated on the replay at 1
  worker and its fp32 twin: PASS;
- bugs seeded into the launcher's copy, each FAILs at step 0 naming its tensor: a TP norm weight's gradient not
  reduced, the loss normalised by the rank's tokens, FSDP's average on top of torchtitan's division;
- the fused QKV split as the adapter's own state_dict splits it, and an adapter that drops a key refused;
- refused in one line, exit 2: a model without an adapter, and context or pipeline parallelism, before the command
  runs; a job the recorder stops itself (context parallelism, launched in a way verify_trainer.py does not read)
  with its line repeated.

Start-up is what costs here (a rank imports torch, torchtitan and the recorder for about 5 CPU-seconds, more than a
debug job trains), so the jobs other than the user's command run in the tests' runner (`titan_cpu.py JOBS`): the
ranks of each world size forked once from one process that imported all that, running that size's jobs one after
another, each recorded into its own folder; every record is replayed in one local group a world size (the bf16 job's
noise reference at 1 worker in a second), and judged once (module-scoped), while the user's command runs beside
them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, module_from

pytest.importorskip("torchtitan", reason="torchtitan: pip install --no-deps -r requirements-torchtitan.txt (the README's test set-up)")

TESTS = os.path.join(REPO, "tests")
SITE = os.path.join(TESTS, "titan_site")  # the CPU changes, in every Python process of a job
BOUND = 1e-5  # fp32 runs of different layouts agree to ~1e-7: the harness's fixed fp32 bound
MARGIN = 0.5  # a clean run's largest deviation ÷ bound, every check (docs/tolerances.md#every-machine-the-clean-matrix)
USER_SETTING = "compatible_1thread"  # the user's command's kernels (parity.calibration.kernel_settings)
TP = ["--parallelism.tensor_parallel_degree", "2"]
JOBS = {  # the runner's jobs: name: (ranks, overrides, seeded bug, steps)
    "tp": (2, TP, None, 3),
    "fsdp_default": (2, [], None, 3),  # the user's FSDP job runs under a perturbed kernel setting; this one not
    "tp_norm": (2, TP, "tp_norm", 2),
    "local_tokens": (2, [], "local_tokens", 2),
    "fsdp_average": (2, [], "fsdp_average", 2),
    "bf16": (2, ["--training.mixed_precision_param", "bfloat16"], None, 3),
    "fsdp_tp": (4, [*TP, "--parallelism.data_parallel_shard_degree", "2"], None, 3),
}
STOPPED_JOB = (2, ["--parallelism.context_parallel_degree", "2"], None, 2)  # the job the recorder stops
QKV_SPLIT_TENSORS = 57  # 6 layers × 9 (q, k, v split from wqkv) + embeddings, final norm, lm_head


def job_arguments(assets: dict, steps: int, dump: str) -> list[str]:
    """torchtitan's arguments for the debug job on the tests' assets (relative to the tests' folder)."""
    return ["--module", "llama3", "--config", "llama3_debugmodel", "--hf_assets_path", assets["tokenizer"],
            "--dataloader.dataset_path", assets["data"], "--training.seq_len", "64", "--training.local_batch_size",
            "2", "--training.steps", str(steps), "--training.mixed_precision_param", "float32", "--dump_folder", dump,
            "--validator.no-enable", "--checkpoint.no-enable"]


def environment(setting: str | None = None) -> dict[str, str]:
    """This process's environment with the tests' CPU changes and their modules on PYTHONPATH; with a kernel
    `setting` (parity.calibration.kernel_settings), that setting's variables."""
    from parity.calibration.kernel_settings import environment as with_setting

    path = [SITE, REPO, TESTS, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    base = with_setting(setting, dict(os.environ)) if setting else dict(os.environ)
    return {**base, "PYTHONPATH": os.pathsep.join(path)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tokenizer and the data, made once in the module's folder (`root`); paths relative to it."""
    module = module_from(os.path.join(REPO, "examples", "titan_assets.py"), "titan_assets")
    root = tmp_path_factory.mktemp("titan")
    tokenizer, data = module.make_assets(str(root / "assets"))
    return {"root": root, "tokenizer": os.path.relpath(tokenizer, root), "data": os.path.relpath(data, root)}


def verify_trainer(root, output_dir: str, command: list[str], *flags: str, output=None, setting: str | None = None):
    """verify_trainer.py on `command` in the module's folder `root` (under a kernel `setting`, whole): its
    CompletedProcess, or with `output` (a file its output goes to) its Popen, started."""
    argv = [sys.executable, os.path.join(REPO, "verify_trainer.py"), "--output_dir", output_dir, *flags, "--", *command]
    if output is not None:
        return subprocess.Popen(argv, env=environment(setting), stdout=output, stderr=subprocess.STDOUT, cwd=str(root))
    return subprocess.run(argv, env=environment(), capture_output=True, text=True, cwd=str(root), timeout=900)


@pytest.fixture(scope="module")
def runs(assets):
    """Every job recorded, replayed and judged: {name: the comparison (Comparison.to_dict())}, under "fsdp" the
    user's command's (exit code, output, comparison) and under "stopped" the verify_trainer.py run whose command was
    the runner itself (exit code, output, the stopped job's ranks' exit statuses) — the context-parallel job recorded
    into its folder, every other job into its own —, under "no_adapter" verify_trainer.py on a model without an
    adapter (exit code, output). The user's command, the refused one and the imports of what replays and judges run
    beside the runner (on two cores each leaves one idle while it imports and judges)."""
    from parity.commands.verify_trainer import launch_planned, plan_replays, warm_up
    from parity.comparing.curves import compare, load_references, load_runs

    root = assets["root"]
    warming = warm_up()  # verify_trainer.py's: the replays' forkserver and the verdict's modules, while the jobs run
    with open(root / "fsdp.log", "w") as log, open(root / "no_adapter.log", "w") as refused_log:
        user = verify_trainer(root, "fsdp", ["torchrun", "--standalone", "--nproc_per_node", "2", "-m",
                                             "torchtitan.train", *job_arguments(assets, 3, "fsdp/job")], output=log,
                              setting=USER_SETTING)
        refused = verify_trainer(root, "no_adapter", ["torchrun", "--nproc_per_node", "2", "-m", "torchtitan.train",
                                                      "--module", "titan_configs", "--config",
                                                      "llama3_debugmodel_without_adapter"], output=refused_log)
    try:
        jobs = [{"name": name, "ranks": ranks, "folder": str(root / name), "record": "titan", "bug": bug,
                 "args": job_arguments(assets, steps, f"{name}/job") + overrides}
                for name, (ranks, overrides, bug, steps) in JOBS.items()]
        ranks, overrides, _, steps = STOPPED_JOB
        jobs.append({"name": "stopped", "ranks": ranks, "folder": str(root / "stopped"), "record": "titan_cpu",
                     "args": job_arguments(assets, steps, "stopped/job") + overrides})
        (root / "jobs.json").write_text(json.dumps(jobs))
        done = verify_trainer(root, "stopped", [sys.executable, os.path.join(TESTS, "titan_cpu.py"), "jobs.json"])
        statuses = json.loads((root / "jobs_statuses.json").read_text())
        assert all(s == [0] * JOBS[n][0] for n, s in statuses.items() if n != "stopped"), statuses
        planned = []
        for name in JOBS:
            planned += plan_replays(str(root / name / "loss_titan.json"), str(root / name), None, name == "bf16")
        launch_planned(planned, kernel_path())
        found = {name: compare(load_runs(str(root / name)), references=load_references(str(root / name))).to_dict()
                 for name in JOBS}
        found["stopped"] = (done.returncode, done.stdout + done.stderr, statuses["stopped"])
        for process in (user, refused):
            process.wait(timeout=900)
    finally:
        warming.join()
        for process in (user, refused):
            if process.poll() is None:
                process.kill()
    found["no_adapter"] = (refused.returncode, (root / "no_adapter.log").read_text())
    report = root / "fsdp" / "curve_comparison.json"
    found["fsdp"] = (user.returncode, (root / "fsdp.log").read_text(),
                     json.loads(report.read_text()) if report.exists() else None)
    return found


def kernel_path() -> str:
    """The local groups' kernel path (local_group.KERNEL_PATHS) that this environment's jobs ran under: the replay's
    bf16 products must be theirs (ONEDNN_MAX_CPU_ISA=AVX2 runs this module on the generic path)."""
    from parity.driver.local_group import KERNEL_PATHS

    return next((k for k, env in KERNEL_PATHS.items() if env and all(os.environ.get(n) == v for n, v in env.items())),
                "default")


def record(root, name: str) -> dict:
    """The runner's job `name`'s record."""
    return json.loads((root / name / "loss_titan.json").read_text())


def test_the_users_command_passes_against_its_ddp_replay(runs, assets):
    """FSDP 2 as typed (`torchrun --standalone --nproc_per_node 2 -m torchtitan.train …`, relative paths), the whole
    command under a perturbed kernel setting (USER_SETTING: MKL's compatible fp32 path, one thread): the record named
    after the module (`-m torchtitan.train` → train), the verdict PASS, calibrated by default (the replay at 1 worker,
    and at 2 under other kernels), the curves within 1e-5 (never bit for bit: another implementation), 57 tensors (q,
    k, v split) within theirs, the teacher-forced check's bounds at least 20 × its own noise."""
    code, output, report = runs["fsdp"]
    assert code == 0, output[-3000:]
    assert "train (TP=1, DP=2): PASS" in output and (assets["root"] / "fsdp" / "report.html").exists()
    check_fp32_pass(report, "train", (1, 2))
    assert report["against_baseline"]["train"]["calibrated"]
    assert report["noise_references"] == ["noise_reference_ddp_tp1_dp1_fp32.json",
                                          "noise_reference_ddp_tp1_dp2_fp32_other_kernels.json"]


@pytest.mark.parametrize("name, mesh", [("tp", (2, 1)), ("fsdp_tp", (2, 2)), ("fsdp_default", (1, 2))])
def test_a_parallel_job_passes_against_its_ddp_replay(runs, assets, name, mesh):
    check_fp32_pass(runs[name], "titan", mesh)
    config = record(assets["root"], name)["config"]
    assert config["model_type"] == "llama" and config["framework"] == "torchtitan"
    assert (config["sharding"]["mesh"]["tp"], config["sharding"]["mesh"]["dp_shard"]) == mesh


def check_fp32_pass(report: dict, run: str, mesh: tuple[int, int]) -> None:
    """PASS against DDP in fp32, each curve within BOUND but not bit for bit, every tensor and every teacher-forced
    check within its bound, the record's layout `mesh` (tp, dp_shard)."""
    against = report["against_baseline"][run]
    assert against["verdict"] == "PASS" and report["verdict"] == "PASS", against
    diffs = against["max_rel_diff"]
    assert all(diffs[k] <= BOUND for k in ("loss", "grad_norm", "param_norm")), diffs
    assert diffs["loss"] > 0 or diffs["grad_norm"] > 0  # another implementation: never bit for bit here
    tensors = against["tensors"]
    assert tensors["taken"] and tensors["first_outside"] is None and tensors["tensors"] == QKV_SPLIT_TENSORS
    checks = report["runs"][run]["teacher_forced"]["checks"]
    assert checks and all(c["ok"] and c["ratio"] < MARGIN for c in checks), checks  # the clean matrix's goal
    assert max(against["bound_ratios"].values()) < MARGIN, against["bound_ratios"]
    described = report["runs"][run]
    assert (described["tp_size"], described["dp_size"]) == (mesh[0], mesh[1]) and described["precision"] == "fp32"


def test_a_bf16_job_calibrated_passes(runs):
    """torchtitan's default mixed precision (bf16 compute, fp32 parameters and reduction) judged as bf16_params
    reduced in fp32, on bounds calibrated from the replay at 1 worker and its fp32 twin: PASS, every curve and tensor
    within its calibrated bound."""
    report = runs["bf16"]
    against = report["against_baseline"]["titan"]
    assert against["verdict"] == "PASS" and against["calibrated"], against
    assert report["noise_references"] == [  # 1 worker, the fp32 twin, and 2 workers under other kernels
        "noise_reference_ddp_tp1_dp1_bf16_params_perturbed.json", "noise_reference_ddp_tp1_dp2_bf16_params_other_kernels.json",
        "noise_reference_ddp_tp1_dp2_fp32.json"], report["noise_references"]
    run = report["runs"]["titan"]
    assert run["precision"] == "bf16_params" and run["policy"]["reduce_dtype"] == "fp32"
    base, bounds = report["runs"][report["baseline"]]["series"], against["bounds"]
    for key in ("loss", "grad_norm", "param_norm"):
        parts = [abs(x - b) / (bound * abs(b)) for x, b, bound in zip(run["series"][key], base[key], bounds[key])]
        assert len(parts) == 3 and 0 < max(parts) <= 1, (key, parts)  # bf16 against its replay: never bit for bit
    assert against["tensors"]["calibrated"] and against["tensors"]["first_outside"] is None


@pytest.mark.parametrize("bug, tensor", [("tp_norm", "model.layers.0.post_attention_layernorm.weight"),
                                         ("local_tokens", None), ("fsdp_average", None)])
def test_a_seeded_bug_fails_at_its_step_naming_the_tensor(runs, bug, tensor):
    against = runs[bug]["against_baseline"]["titan"]
    assert against["verdict"] == "FAIL"
    first = against["tensors"]["first_outside"]
    assert first is not None and first["step"] == 0 and first["phase"] == "gradient", first
    assert first["ratio"] > 10, first  # far outside its bound, not at its edge
    if tensor is not None:
        assert first["tensor"] == tensor, first
    else:  # every gradient scaled alike (by the DP size, or its inverse): the grad norm parts at step 0 too
        scaled = {"local_tokens": 1.0, "fsdp_average": 0.5}[bug]  # 2 ×, or ½ ×
        assert against["first_outside"]["step"] == 0
        assert against["max_rel_diff"]["grad_norm"] == pytest.approx(scaled, rel=0.05)


def test_the_fused_qkv_split_is_the_adapters_own():
    """The layout's translation of the debug model's fused wqkv (its module's state-dict hook, then the adapter's
    to_hf) equals what the adapter makes of the module's own state_dict; its element indices land where the values
    do; an adapter that drops a key is refused in one line."""
    import torch
    from torchtitan.models.llama3 import model_registry

    from parity.frameworks.torchtitan.config import TitanRefused, hf_config
    from parity.frameworks.torchtitan.view import Translation
    from parity.models.model import meta_model

    spec = model_registry("debugmodel")
    with torch.device("meta"):
        module = spec.model.build()
    module.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    adapter = spec.state_dict_adapter(spec.model, None)
    translation = Translation(module, adapter)
    whole = adapter.to_hf(module.state_dict())
    name = "layers.0.attention.qkv_linear.wqkv.weight"
    wqkv = dict(module.named_parameters())[name]
    split = translation.to_hf(name, wqkv.detach())
    assert sorted(split) == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "kqv"]
    for h, t in split.items():
        assert torch.equal(t, whole[h])
    assert sum(t.numel() for t in split.values()) == wqkv.numel() and len(whole) == QKV_SPLIT_TENSORS
    targets = translation.targets(meta_model(hf_config(spec)))
    for h, index in targets[name]:
        assert torch.equal(wqkv.detach().reshape(-1)[index], split[h].reshape(-1))
    assert sorted(i for _, index in targets[name] for i in index.tolist()) == list(range(wqkv.numel()))

    class Dropping(type(adapter)):
        def to_hf(self, state_dict):
            return {k: v for k, v in super().to_hf(state_dict).items() if k != "model.norm.weight"}

    with pytest.raises(TitanRefused, match=r"drops norm\.weight: its to_hf maps it to no Hugging Face tensor"):
        Translation(module, Dropping(spec.model, None)).targets(meta_model(hf_config(spec)))


def test_what_does_not_map_or_record_is_refused_before_the_command_runs():
    """Without processes, as verify_trainer.py checks a torchtitan command before it runs it (command_refusal: the
    config with the command's overrides, its model mapped onto transformers'): the debug model changed one part at a
    time — yarn RoPE, an MLP bias, no gated MLP, RMSNorm without weights, Llama with q/k norms —, qwen3's MoE flavour,
    a family transformers has none of (deepseek_v3), a pipeline, parameters not stepped in fp32; and fp16 compute, which
    this torchtitan's own flags refuse (bfloat16 or float32), held to the config check itself. One line each, naming
    it (docs/refusals.md); the debug model as it is maps."""
    from dataclasses import replace

    from torchtitan.config import ConfigManager
    from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3
    from torchtitan.models.llama3 import model_registry as llama3
    from torchtitan.models.qwen3 import model_registry as qwen3

    from parity.frameworks.torchtitan.config import TitanRefused, hf_config
    from parity.frameworks.torchtitan.recording import command_refusal, config_refusal

    spec = llama3("debugmodel")
    layer = spec.model.layers[0]
    attention, ffn, norm = layer.attention, layer.feed_forward, layer.attention_norm

    def first_layer(**parts):
        return replace(spec, model=replace(spec.model, layers=[replace(layer, **parts), *spec.model.layers[1:]]))

    not_built = "a decoder layer without a gated MLP, or with MLP biases: not the transformers model the replay builds"
    refused = {
        "RoPE scaling 'yarn': the transformers model the replay builds computes 'none' and 'llama' (rope_type llama3) "
        "alike; record a job without it": first_layer(attention=replace(attention, rope=replace(attention.rope,
                                                                                                 scaling="yarn"))),
        not_built: first_layer(feed_forward=replace(ffn, w2=replace(ffn.w2, bias=True))),
        "RMSNorm without weights: not the transformers model the replay builds":
            first_layer(attention_norm=replace(norm, elementwise_affine=False)),
        "a llama3 model with q/k norms: not transformers' Llama": first_layer(attention=replace(attention, qk_norm=norm)),
        "a qwen3 MoE model: its experts are not mapped onto transformers' Qwen3-MoE here": qwen3("debugmodel_moe"),
        "deepseek_v3 maps to no transformers model the harness builds (it maps llama3, qwen3): a MoE model or another "
        "family is not replayed": deepseek_v3("debugmodel")}
    for line, changed in refused.items():
        with pytest.raises(TitanRefused) as exc:
            hf_config(changed)
        assert str(exc.value) == line
    with pytest.raises(TitanRefused, match=f"^{not_built}$"):
        hf_config(first_layer(feed_forward=None))
    assert type(hf_config(spec)).__name__ == "LlamaConfig"
    command = ["torchrun", "--nproc_per_node", "2", "-m", "torchtitan.train", "--module", "llama3", "--config",
               "llama3_debugmodel"]
    assert command_refusal(command) is None
    head = "torchtitan llama3 (debugmodel): "
    assert command_refusal(command + ["--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"]) \
        == head + ("pipeline parallelism (pipeline_parallel_degree 2): each rank holds model parts of its stages and "
                   "the loss lives on the last; the recorder reads one whole module a rank — record the job at "
                   "pipeline_parallel_degree 1, the harness's own pipeline strategy checks pipelines")
    assert command_refusal(command + ["--training.dtype", "bfloat16"]) == head + (
        "training.dtype bfloat16: the parameters the optimizer steps are not fp32, which no policy of the replay "
        "trains; train in float32 (with mixed_precision_param for the compute)")
    config = ConfigManager().parse_args(command[5:])
    assert config_refusal(replace(config, training=replace(config.training, mixed_precision_param="float16"))) == \
        "mixed_precision_param float16: the replay trains fp32 and bf16"


def test_a_model_without_an_adapter_is_refused_in_one_line(runs, assets):
    """Before the command runs (verify_trainer.py builds the config's model on the meta device): one line, exit 2,
    nothing written."""
    code, output = runs["no_adapter"]
    assert code == 2 and output.strip().splitlines() == [
        "error: torchtitan llama3 (debugmodel): the model has no state-dict adapter: nothing names its tensors as a "
        "transformers model's, so no replay can be built for it: nothing run"]
    assert not (assets["root"] / "no_adapter").exists() or not any((assets["root"] / "no_adapter").iterdir())


@pytest.mark.parametrize("overrides, said", [
    (["--parallelism.context_parallel_degree", "2"], "context parallelism (context_parallel_degree 2): each rank "),
    (["--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"],
     "pipeline parallelism (pipeline_parallel_degree 2): each rank holds model parts"),
    (["--training.dtype", "bfloat16"], "training.dtype bfloat16: the parameters the optimizer steps are not fp32")])
def test_a_parallelism_the_recorder_cannot_read_is_refused_before_the_command_runs(assets, overrides, said):
    """What the command's config (its overrides applied) tells is verify_trainer.py's check before anything runs."""
    from parity.frameworks.torchtitan.recording import command_refusal

    line = command_refusal(["torchrun", "--nproc_per_node", "2", "-m", "torchtitan.train",
                            *job_arguments(assets, 2, "job"), *overrides])
    assert line.startswith(f"torchtitan llama3 (debugmodel): {said}"), line
    assert command_refusal(["torchrun", "-m", "torchtitan.train", *job_arguments(assets, 2, "job")]) is None


def test_a_job_the_recorder_stops_is_one_line_and_exit_2(runs, assets):
    """A command verify_trainer.py cannot read (the tests' runner: no --module on its command line) whose
    context-parallel job the recorder stops on every rank before it trains: its ranks exit 2, the launcher says
    what it says, and verify_trainer.py repeats the job's line with exit status 2, nothing replayed."""
    code, output, statuses = runs["stopped"]
    assert statuses == [2, 2]
    line = ("torchtitan llama3 (debugmodel): context parallelism (context_parallel_degree 2): each rank consumes a "
            "slice of its rows' sequence, which the recorder does not reassemble; record the job at "
            "context_parallel_degree 1")
    assert (assets["root"] / "stopped" / "stopped.txt").read_text() == line
    assert f"parity recorder: {line}: recording nothing; the job stops (exit 2)" in (
        assets["root"] / "stopped" / "rank0.log").read_text()
    assert code == 2 and output.strip().splitlines()[-1] == (
        f"error: {line}: the job stopped before it trained: nothing replayed"), output[-2000:]
    assert not list((assets["root"] / "stopped").glob("loss_*.json"))
