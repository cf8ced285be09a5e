"""benchmark.py and the offload options: the table with every default row and the documented keys, the
model-state bytes per rank against the ZeRO bound at dp=2, every offload variant at fp32 parity with DDP,
and bad input.

One benchmark invocation (2 steps of every default row in one Ray worker group) feeds the table and
memory tests; the offload variants run 12 steps each in one local gloo group against the session's DDP
baseline.
"""

import json
import os

import pytest

from conftest import PARITY, REPO, TINY, assert_fp32_parity
from parity.commands.benchmark import ROWS, main
from parity.comparing.benchmark_report import ROW_KEYS
from parity.errors import ConfigError
from parity.training.config import resolve

TOLERANCE = 0.10  # the issue's: measured model states within 10 % of the formula


@pytest.fixture(scope="module")
def bench(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    rc = main(["--output_dir", str(out), "--model_name", "qwen2-tiny", "--device", "cpu", "--seq_length", "64",
               "--debug_steps", "2", "--untimed_steps", "1"])
    assert rc == 0
    with open(out / "benchmark.json") as f:
        return json.load(f), out


def test_table_has_every_default_row_and_the_documented_keys(bench):
    summary, out = bench
    rows = summary["rows"]
    assert [r["row"] for r in rows] == list(ROWS)
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    for r in rows:
        assert tuple(r) == ROW_KEYS
        assert r["steps"] == 2 and r["timed_steps"] == 1 and r["median_step_time_s"] > 0
        assert r["final_loss_rel_diff_from_ddp"] < 1e-5  # fp32: every row trains DDP's model
        assert r["mfu"] is None  # CPU: no MFU
        assert r["tokens_per_s"] == pytest.approx(4 * 64 / r["median_step_time_s"])  # global batch 4 × 64 tokens
    assert rows[0]["step_time_ratio_to_ddp"] == 1.0
    assert {(r["tp_size"], r["dp_size"], r["batch_size"]) for r in rows} == {(1, 2, 2), (2, 1, 4)}
    assert all(f"`{key}`" in readme for key in ROW_KEYS), "README names the benchmark.json keys"
    table = (out / "benchmark.md").read_text().splitlines()
    assert [line.split(" | ")[0] for line in table if line.startswith("| ") and "---" not in line][1:] == \
        [f"| {ROWS[r['row']].label}" for r in rows]
    assert (out / "benchmark.png").stat().st_size > 10_000


def whole_parameter_partitions(dp: int) -> list[int]:
    """Elements of gradient DeepSpeed's ZeRO-1/2 keep per DP rank: every parameter (in order, flattened) that
    overlaps the rank's Ψ/dp slice, whole."""
    from parity.training.model import build_model, resolve_model_config

    sizes = [p.numel() for p in build_model(resolve_model_config("qwen2-tiny"), 0).parameters()]
    part = sum(sizes) // dp
    held, start = [0] * dp, 0
    for n in sizes:
        for rank in range(dp):
            if start < (rank + 1) * part and start + n > rank * part:
                held[rank] += n
        start += n
    return held


def test_model_state_bytes_per_rank_against_the_zero_bound(bench):
    """At dp=2 after backward (gradients reduced, before the step), fp32: the ZeRO bound is 4Ψ params +
    4Ψ grads + 8Ψ Adam, divided by stage; DeepSpeed keeps an fp32 master partition (4Ψ/2) on top."""
    summary, _ = bench
    psi = summary["num_params"]
    rows = {r["row"]: r for r in summary["rows"]}
    bound = {name: rows[name]["zero_bound_total_bytes"] / psi for name in ("ddp", "zero1", "zero2", "zero3", "fsdp")}
    assert bound == {"ddp": 16, "zero1": 12, "zero2": 10, "zero3": 8, "fsdp": 8}

    def per_rank(name, point="after_backward"):
        return rows[name]["model_state_bytes_per_rank"][point]

    master = 4 * psi / 2  # DeepSpeed's fp32 master partition, on top of the paper's fp32 bound
    for name in ("zero1", "zero2", "zero3"):
        for held in per_rank(name):
            assert held["master_params"] == pytest.approx(master, rel=0.01)
            assert held["optimizer_states"] == pytest.approx(8 * psi / 2, rel=0.01)
    for held in per_rank("zero3"):  # every rank within 10 % of the formula
        assert sum(held.values()) - held["master_params"] == pytest.approx(8 * psi, rel=TOLERANCE)
    fullest = {name: rows[name]["model_state_total_bytes"] for name in rows}
    assert fullest["zero1"] - master == pytest.approx(12 * psi, rel=TOLERANCE)
    # ZeRO-1 and ZeRO-2 hold the same gradients once they are reduced: both keep, on each rank, the whole
    # gradient of every parameter overlapping its partition. qwen2-tiny's tied embedding is 51 % of Ψ and
    # straddles the partition boundary, so rank 1 keeps the full gradient (docs/benchmark.md).
    held = whole_parameter_partitions(2)
    assert held == [131072, psi]
    for name in ("zero1", "zero2"):
        assert [r["grads"] for r in per_rank(name)] == [4 * n for n in held]
        assert all("grads" not in r for r in per_rank(name, "after_step"))
    assert fullest["zero3"] < fullest["zero2"] == fullest["zero1"] < fullest["ddp"]
    assert fullest["fsdp"] == pytest.approx(rows["fsdp"]["zero_bound_total_bytes"], rel=0.01)
    # DDP: the bound plus the reducer's flat copy of the gradients (4Ψ), until the step.
    assert per_rank("ddp")[0]["grad_buckets"] == 4 * psi and fullest["ddp"] == pytest.approx(20 * psi, rel=0.01)


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
    from local_group import plan, run_group

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
    from parity.registry import strategy_class

    return {o.name: o.default for o in strategy_class(strategy).options}


# ---------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, before Ray
# ---------------------------------------------------------------------------------------------------

BAD = [
    (["--rows", "zero1,zero2"], "error: --rows must include ddp: the step-time ratio and the loss difference are "
                                "against DDP's run"),
    (["--rows", "ddp,zero4"], "error: --rows: unknown row 'zero4': use " + ",".join(ROWS)),
    (["--rows", "ddp,fsdp_tp", "--num_workers", "1"],
     "error: --rows: fsdp_tp runs at tp_size 2, which does not divide --num_workers 1: use an even --num_workers "
     "or leave fsdp_tp out"),
    (["--debug_steps", "2", "--untimed_steps", "2"],
     "error: --untimed_steps 2 must be at least 0 and below --debug_steps 2: at least one step must be timed"),
    (["--rows", "ddp,zero3", "--batch_size", "0"], "error: --batch_size must be a positive integer (got 0)"),
]


@pytest.mark.parametrize("argv,line", BAD, ids=[b[1][7:40] for b in BAD])
def test_bad_input_is_one_line(tmp_path, capsys, argv, line):
    assert main(["--output_dir", str(tmp_path), "--model_name", "qwen2-tiny", "--device", "cpu", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert not (tmp_path / "benchmark.json").exists()


def test_offload_param_needs_zero_stage_3(tmp_path, tiny_weights):
    with pytest.raises(ConfigError, match=r"^--offload_param cpu needs --zero_stage 3 \(stages 1 and 2 do not "
                                          r"partition parameters, and DeepSpeed ignores the setting there\)"):
        resolve("deepspeed", {**TINY, "num_workers": 2, "init_weights_path": tiny_weights, "zero_stage": 2,
                              "offload_param": "cpu", "loss_output_dir": tmp_path, "storage_path": tmp_path})
