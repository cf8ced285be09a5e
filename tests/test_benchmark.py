"""benchmark.py and the offload options: the table with every default row and the documented keys, the
peak model-state bytes per rank against the ZeRO bound at dp=2, every offload variant at fp32 parity with
DDP, and bad input.

One benchmark invocation (2 steps of every default row and of your own strategy class, tests/my_strategy.py, in one
Ray worker group, qwen2-tiny with 12 layers and a small reduce bucket) feeds the table and memory tests; the offload
variants run 12 steps each in one local gloo group against the session's DDP baseline.
"""

import json
import os

import pytest

from conftest import CUSTOM, PARITY, REPO, TINY, assert_fp32_parity
from parity.commands.benchmark import ROWS, main
from parity.comparing.benchmark_report import ROW_KEYS
from parity.errors import ConfigError
from parity.comparing import teacher_forced
from parity.driver.config import DEFAULTS, resolve
from parity.training.memory import BOUND_CATEGORIES, model_state_total

TOLERANCE = 0.10  # the issue's: measured model states within 10 % of the formula
# 12 layers: the tied embedding, the largest tensor, is 15 % of Ψ (51 % at the preset's 2 layers), so each
# rank's whole-tensor gradient partition is within 2 % of Ψ/2 and the embedding's full gradient, which every
# ZeRO stage holds before reducing it, stays within the 10 % (at 8 layers it is 21 % of Ψ: ZeRO-3 10.5 % over).
NUM_LAYERS = 12
# Elements ZeRO-1/2/3 reduce at once (--reduce_bucket_size), the same for every stage so only the stage
# differs: one MLP matrix of qwen2-tiny, 1.9 % of Ψ. DeepSpeed's default, 5e8, is larger than the model:
# then ZeRO-2 and ZeRO-3 too hold every gradient until the end of backward.
BUCKET = 16384


@pytest.fixture(scope="module")
def bench(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    rc = main(["--output_dir", str(out), "--model_name", "qwen2-tiny", "--device", "cpu", "--seq_length", "64",
               "--num_layers", str(NUM_LAYERS), "--reduce_bucket_size", str(BUCKET), "--debug_steps", "2",
               "--untimed_steps", "1", "--strategy_class", CUSTOM])
    assert rc == 0
    with open(out / "benchmark.json") as f:
        return json.load(f), out


def test_table_has_every_default_row_and_the_documented_keys(bench):
    summary, out = bench
    rows = summary["rows"]
    assert [r["row"] for r in rows] == [*ROWS, "hand_written_dp"]  # every default row, then your strategy's
    with open(os.path.join(REPO, "docs", "benchmark.md")) as f:
        columns = f.read()  # the README links its column list
    for r in rows:
        assert tuple(r) == ROW_KEYS
        assert r["steps"] == 2 and r["timed_steps"] == 1 and r["median_step_time_s"] > 0
        assert r["final_loss_rel_diff_from_ddp"] < 1e-5  # fp32: every row trains DDP's model
        assert r["mfu"] is None  # CPU: no MFU
        assert r["tokens_per_s"] == pytest.approx(4 * 64 / r["median_step_time_s"])  # global batch 4 × 64 tokens
        assert r["options"].get("reduce_bucket_size", BUCKET) == BUCKET  # every DeepSpeed row got the flag
        # the harness's own cost: every part it times, and their share of the step without them
        # (the replica check where two ranks hold the same tensor: not in ZeRO-3 or FSDP2 at DP 2, which shard all)
        assert set(r["harness_s_per_step"]) == {"loss_gather", "param_norm", "tensor_norms", "record",
                                                "record_write"} | (
            set() if r["row"] in ("zero3", "fsdp", "fsdp_offload") else {"replica_check"})
        in_step = sum(r["harness_s_per_step"][k] for k in ("loss_gather", "param_norm", "tensor_norms"))
        assert r["harness_share"] == pytest.approx(sum(r["harness_s_per_step"].values()) /
                                                   (r["median_step_time_s"] - in_step))
        assert 0 < r["tensor_norms_share"] == pytest.approx(r["harness_s_per_step"]["tensor_norms"] /
                                                            r["median_step_time_s"])
        # the teacher-forced check's cost: its check of step 1 (a checkpoint mid-run: a state with AdamW's moments), as
        # a share of the training time at the default interval
        with open(r["loss_record"]) as f:
            checked = {s["step"]: s[teacher_forced.KEY] for s in json.load(f)["steps"] if teacher_forced.KEY in s}
        assert sorted(checked) == [0, 1] and r["teacher_forced_s_per_check"] == checked[1]["seconds"] > 0
        assert r["teacher_forced_share"] == pytest.approx(r["teacher_forced_s_per_check"] / (
            DEFAULTS["checkpoint_interval"] * r["median_step_time_s"]))
    assert rows[0]["step_time_ratio_to_ddp"] == 1.0
    assert {(r["tp_size"], r["pp_size"], r["dp_size"], r["batch_size"]) for r in rows} == {
        (1, 1, 2, 2), (2, 1, 1, 4), (1, 2, 1, 4)}  # DP, TP (one TP group), a pipeline of 2 stages
    assert all(f"`{key}`" in columns for key in ROW_KEYS), "docs/benchmark.md names the benchmark.json keys"
    table = (out / "benchmark.md").read_text().splitlines()
    assert [line.split(" | ")[0] for line in table if line.startswith("| ") and "---" not in line][1:] == \
        [f"| {ROWS[r['row']].label}" for r in rows[:-1]] + ["| hand_written_dp"]
    assert (out / "benchmark.png").stat().st_size > 10_000


def qwen2_tiny_sizes() -> list[int]:
    """Elements of each parameter of the benchmarked model, in the order ZeRO flattens them (the tied
    embedding first)."""
    from parity.models.model import build_model, resolve_model_config

    return [p.numel() for p in build_model(resolve_model_config("qwen2-tiny", NUM_LAYERS), 0).parameters()]


def whole_parameter_partitions(dp: int) -> list[int]:
    """Elements of gradient DeepSpeed's ZeRO-1/2 keep per DP rank once reduced: every parameter (in order,
    flattened) that overlaps the rank's Ψ/dp slice, whole."""
    sizes = qwen2_tiny_sizes()
    part = sum(sizes) // dp
    held, start = [0] * dp, 0
    for n in sizes:
        for rank in range(dp):
            if start < (rank + 1) * part and start + n > rank * part:
                held[rank] += n
        start += n
    return held


def test_peak_model_state_bytes_per_rank_against_the_zero_bound(bench):
    """At dp=2, fp32, per rank, the PEAK of the measured step: the sample (at each gradient's arrival in
    backward, after backward, after the step) holding the most model-state bytes — params, grads, optimizer
    states and master copies; copies made to compute or communicate (DDP's reducer buckets, gathered
    parameters) are counted beside them, not in them.

    The formula: 4Ψ params + 4Ψ grads + 8Ψ Adam, stage 1 dividing the optimizer states by 2, stage 2 the
    gradients too, stage 3 the parameters too. The paper's K (optimizer-state bytes per parameter) counts the
    fp32 master copy with Adam's moments (K = 12 in its mixed precision); at fp32 its bound has no master, the
    fp32 parameters being the master. DeepSpeed keeps an fp32 master partition (4Ψ/2) even at fp32, in its own
    category: so the paper's three categories are held to the bound (never below, at most 10 % over) and the
    master to exactly 4Ψ/2, which puts the whole within 10 % of the formula with K = 12 (bound + master) too.
    """
    summary, _ = bench
    psi = summary["num_params"]
    rows = {r["row"]: r for r in summary["rows"]}
    bound = {name: rows[name]["zero_bound_total_bytes"] for name in ("ddp", "zero1", "zero2", "zero3", "fsdp")}
    assert {name: b / psi for name, b in bound.items()} == {"ddp": 16, "zero1": 12, "zero2": 10, "zero3": 8,
                                                           "fsdp": 8}

    def per_rank(name, point="peak"):
        return rows[name]["model_state_bytes_per_rank"][point]

    master = 4 * psi / 2  # DeepSpeed's fp32 master partition, on top of the paper's fp32 bound
    for name in ("zero1", "zero2", "zero3"):
        for held in per_rank(name):
            assert held["master_params"] == pytest.approx(master, rel=0.01)
            assert held["optimizer_states"] == pytest.approx(8 * psi / 2, rel=0.01)
            in_bound = sum(held[c] for c in BOUND_CATEGORIES)
            assert bound[name] <= in_bound <= (1 + TOLERANCE) * bound[name], (name, in_bound / psi)
            assert model_state_total(held) == pytest.approx(bound[name] + master, rel=TOLERANCE)
    for rank in range(2):  # the paper's order, per rank, at the peak
        peak = {name: model_state_total(per_rank(name)[rank]) for name in ("ddp", "zero1", "zero2", "zero3", "fsdp")}
        assert peak["fsdp"] < peak["zero3"] < peak["zero2"] < peak["zero1"] < peak["ddp"], \
            {name: b / psi for name, b in peak.items()}

    # Where the peaks are, and why. The hooks fire before DeepSpeed's end-of-backward reduction: ZeRO-1 holds
    # every gradient (4Ψ) when the last one, the tied embedding's, arrives; after backward only its partition's.
    sizes, held = qwen2_tiny_sizes(), whole_parameter_partitions(2)
    embedding = sizes[0]
    assert [round(n / psi, 3) for n in held] == [0.504, 0.515]  # within 2 % of Ψ/2 (at 2 layers: 0.515 and 1.0)
    assert rows["zero1"]["model_state_peak_at"] == ["during_backward, model.embed_tokens.weight"] * 2
    assert [r["grads"] for r in per_rank("zero1")] == [4 * psi] * 2
    # ZeRO-2 frees the gradients outside its partition bucket by bucket: at the peak it holds its whole-tensor
    # partition's and the embedding's full gradient, waiting for its reduction; ZeRO-3 its Ψ/2 and the same.
    assert [r["grads"] for r in per_rank("zero2")] == [4 * (n + embedding) for n in held]
    assert [r["grads"] for r in per_rank("zero3")] == [4 * (psi // 2 + embedding)] * 2
    # After the reduction ZeRO-1 and ZeRO-2 hold the same gradients: on each rank the whole gradient of every
    # parameter overlapping its partition (docs/benchmark.md); none after the step.
    fullest = {name: max(model_state_total(r) for r in per_rank(name, "after_backward")) for name in rows}
    for name in ("zero1", "zero2"):
        assert [r["grads"] for r in per_rank(name, "after_backward")] == [4 * n for n in held]
        assert all("grads" not in r for r in per_rank(name, "after_step"))
    assert fullest["zero3"] < fullest["zero2"] == fullest["zero1"] < fullest["ddp"]
    assert fullest["fsdp"] == pytest.approx(bound["fsdp"], rel=0.01)
    # DDP: the bound plus the reducer's flat copy of the gradients (4Ψ), until the step.
    assert per_rank("ddp")[0]["grad_buckets"] == 4 * psi and rows["ddp"]["peak_all_bytes"] == pytest.approx(
        20 * psi, rel=0.01)
    # With DeepSpeed's stage-3 defaults (prefetch 5e7 elements, reuse distance 1e9) ZeRO-3 keeps every parameter
    # it gathered in forward until backward has used it: all of them (but the final norm's 64) at the second
    # gradient, so with these copies it holds more than ZeRO-2 (docs/benchmark.md).
    for r in per_rank("zero3", "peak_all"):
        assert r["gathered_params"] == pytest.approx(4 * psi, rel=1e-3)
    assert rows["zero3"]["peak_all_bytes"] > rows["zero2"]["peak_all_bytes"]
    # The pipeline's rows (2 stages, or 4 interleaved): each rank holds half the layers and one copy of the tied
    # embedding (the last stage's lm_head is a copy), with their gradients and Adam's states — the bound of the
    # layers ÷ 2 plus what no stage split (the embedding, the final norm's 64), exactly, on both ranks.
    unsplit = embedding + 64
    for name in ("pp_gpipe", "pp_1f1b", "pp_interleaved"):
        assert rows[name]["zero_bound_total_bytes"] == pytest.approx(16 * ((psi - unsplit) / 2 + unsplit))
        for held in per_rank(name):
            assert sum(held[c] for c in BOUND_CATEGORIES) == pytest.approx(rows[name]["zero_bound_total_bytes"],
                                                                            rel=0.001)


# ---------------------------------------------------------------------------------------------------
# Every offload variant against DDP, fp32, 12 steps: one local gloo group of two processes
# ---------------------------------------------------------------------------------------------------

OFFLOAD = {  # name: (strategy, tp_size, options)
    "zero1_offload": ("deepspeed", 1, {"zero_stage": 1, "offload_optimizer": "cpu"}),
    "zero2_offload": ("deepspeed", 1, {"zero_stage": 2, "offload_optimizer": "cpu"}),
    "zero3_offload_both": ("deepspeed", 1, {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}),
    "autotp_zero2_offload": ("deepspeed", 2, {"zero_stage": 2, "offload_optimizer": "cpu"}),
    "autotp_zero3_offload_both": ("deepspeed", 2, {"zero_stage": 3, "offload_optimizer": "cpu",
                                                   "offload_param": "cpu"}),
    "fsdp_offload": ("fsdp", 1, {"offload": "cpu"}),
    "fsdp_tp_offload": ("fsdp", 2, {"offload": "cpu"}),
}


@pytest.fixture(scope="module")
def offload_runs(tiny_weights, tmp_path_factory):
    from parity.driver.local_group import plan, run_group

    out = tmp_path_factory.mktemp("offload")
    runs = [plan(strategy, {**TINY, **PARITY, "num_workers": 2, "tp_size": tp, "batch_size": 2 * tp,
                            "init_weights_path": tiny_weights, "loss_output_dir": out / name,
                            "storage_path": out / "ray", "experiment_name": name, **options})
            for name, (strategy, tp, options) in OFFLOAD.items()]
    return dict(zip(OFFLOAD, run_group(runs)))


@pytest.mark.parametrize("name", list(OFFLOAD))
def test_offload_matches_ddp(offload_runs, ddp_baseline, name):
    run = offload_runs[name]
    assert len(run["steps"]) >= 5
    assert run["config"]["options"] == {**resolve_defaults(OFFLOAD[name][0]), **OFFLOAD[name][2]}
    assert_fp32_parity(run, ddp_baseline)


def resolve_defaults(strategy: str) -> dict:
    from parity.registry import load, path_of

    return {o.name: o.default for o in load(path_of(strategy)).options}


# ---------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, before Ray
# ---------------------------------------------------------------------------------------------------

BAD = [
    (["--rows", "zero1,zero2"], "error: --rows must include ddp: the step-time ratio and the loss difference are "
                                "against DDP's run"),
    (["--rows", "ddp,zero4"], "error: --rows: unknown row 'zero4': use " + ",".join(ROWS)),
    (["--rows", "ddp,fsdp_tp", "--num_workers", "1"],
     "error: --rows: fsdp_tp runs at tp_size 2, which does not divide --num_workers 1: use an even --num_workers "
     "or leave it out"),
    (["--rows", "ddp,pp_interleaved", "--num_layers", "6"],
     "error: --rows: pp_interleaved splits the layers into 4 stages, which do not divide --num_layers 6: use "
     "--num_layers 4 or leave it out"),
    (["--debug_steps", "2", "--untimed_steps", "2"],
     "error: --untimed_steps 2 must be at least 0 and below --debug_steps 2: at least one step must be timed"),
    (["--rows", "ddp,zero3", "--batch_size", "0"], "error: --batch_size must be a positive integer (got 0)"),
    (["--rows", "ddp,zero2", "--reduce_bucket_size", "0"],
     "error: --reduce_bucket_size must be a positive number of elements (got 0): DeepSpeed's default is 500000000"),
    (["--recorder", "--rows", "DDP,zero2"], "error: --rows zero2: with --recorder the rows are recorder layouts: "
                                           "DDP,FSDP2,FSDP1,ZeRO-1,ZeRO-2,ZeRO-3,Trainer,Lightning"),
]


@pytest.mark.parametrize("argv,line", BAD, ids=[b[1][7:40] for b in BAD])
def test_bad_input_is_one_line(tmp_path, capsys, argv, line):
    assert main(["--output_dir", str(tmp_path), "--model_name", "qwen2-tiny", "--device", "cpu", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert not (tmp_path / "benchmark.json").exists()


def test_the_recorders_cost_is_its_parts_over_the_steps_of_the_model_asked_for(tmp_path):
    """benchmark.py --recorder on the DDP layout (examples/plain_loop.py under torchrun), qwen2-tiny cut to one layer:
    the record is of a one-layer model, the figures are over the steps after the untimed one, the share is the
    recorder's mean seconds over the mean step, and the parts it times fit in its seconds (a check, not a timing)."""
    from parity.training.record import load_record

    assert main(["--output_dir", str(tmp_path), "--recorder", "--rows", "DDP", "--model_name", "qwen2-tiny",
                 "--num_layers", "1", "--debug_steps", "3", "--untimed_steps", "1", "--seq_length", "64"]) == 0
    found = json.loads((tmp_path / "recorder.json").read_text())
    assert (found["model_name"], found["num_layers"], found["seq_length"]) == ("qwen2-tiny", 1, 64)
    row = found["layouts"]["DDP"]
    assert row["steps"] == 2 and row["share_of_mean_step"] == pytest.approx(row["mean_recorder_s"] / row["mean_step_s"])
    parts = row["parts_s"]
    assert 0 < parts["recorder_before"] and sum(parts.values()) <= row["mean_recorder_s"] * (1 + 1e-9)
    record = load_record(str(tmp_path / "recorder" / "ddp" / "loss_plain_loop.json"))
    assert record["config"]["model_config"]["num_hidden_layers"] == 1 and len(record["steps"]) == 3
    assert "| DDP |" in (tmp_path / "recorder.md").read_text()


def test_offload_param_needs_zero_stage_3(tmp_path, tiny_weights):
    with pytest.raises(ConfigError, match=r"^--offload_param cpu needs --zero_stage 3 \(stages 1 and 2 do not "
                                          r"partition parameters, and DeepSpeed ignores the setting there\)"):
        resolve("deepspeed", {**TINY, "num_workers": 2, "init_weights_path": tiny_weights, "zero_stage": 2,
                              "offload_param": "cpu", "loss_output_dir": tmp_path, "storage_path": tmp_path})
