"""Replicas that part (parity/training/replicas.py): every tensor several ranks hold — parameters as held, and their
optimizer state — is digested after every step and compared across its ranks; a difference FAILs the verdict ahead of
any tolerance, naming the tensor, the ranks, the first step and the max difference.

The digest is checked against its definition on tensors of every path through it; the clean runs are the session's
shared runs (tests/conftest.py: every strategy and layout there, through Ray Train and in local gloo groups) — their
records are read, nothing is trained here; the seeded bugs are shared runs too (LOCAL_RUNS' bug_*), judged by
plot_loss_curves.py as a user runs it. The catalogue's other two (the sequence-parallel norms, the pipeline's tied
copies) are asserted where they run (test_techniques.py, test_pipeline.py), and in bf16 in test_calibration.py.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import assert_replicas_held
from parity.calibration.bugs import SKIPPED_PARAMETER, SKIPPED_STEP
from parity.commands.compare_curves import main as plot_loss_curves
from parity.training.digest import MODULUS, PASS_ROWS, ROW, Digester, words
from parity.training.replicas import ReplicaDeclarationError, agreed_keys

# qwen2-tiny has 26 parameters (a tied embedding once), 5 of them RMSNorm weights, the only ones AutoTP and FSDP's TP
# plan leave whole besides FSDP's tied embedding (AutoTP shards it by vocabulary).
PARAMS, NORMS = 26, 5
# Clean shared runs → (replica groups declared, {ranks: groups}): each a parameter or one of its two moments.
CLEAN = {
    "ddp_tp1_dp2": (3 * PARAMS, {"0,1": 3 * PARAMS}),  # everything, on both DP ranks
    "hand_written_dp_tp1_dp2": (3 * PARAMS, {"0,1": 3 * PARAMS}),  # the base class's answer for a user's own DP
    "ddp_bf16": (3 * PARAMS, {"0,1": 3 * PARAMS}),
    "ddp_one": (0, {}),  # one rank: nothing to compare
    # ZeRO-1/2, TP 2 × DP 2: the module's parameters (TP shards over DP: 21 per TP rank; whole ones on all four), and
    # the norms' fp32 master fragments and moments on the TP group whose DP partition holds them (the second)
    "deepspeed_tp2_dp2": (62, {"0,2": PARAMS - NORMS, "1,3": PARAMS - NORMS, "0,1,2,3": NORMS, "2,3": 3 * NORMS}),
    "deepspeed_tp2_dp2_zero2": (62, {"0,2": PARAMS - NORMS, "1,3": PARAMS - NORMS, "0,1,2,3": NORMS, "2,3": 3 * NORMS}),
    "deepspeed_bf16": (62, {"0,2": PARAMS - NORMS, "1,3": PARAMS - NORMS, "0,1,2,3": NORMS, "2,3": 3 * NORMS}),
    # ZeRO-3: a norm's partition, master partition and moments on each TP group
    "deepspeed_tp2_dp2_zero3": (8 * NORMS, {"0,1": 4 * NORMS, "2,3": 4 * NORMS}),
    "deepspeed_tp1_dp2": (PARAMS, {"0,1": PARAMS}),  # pure ZeRO-1: the module's parameters; master partitions differ
    "deepspeed_tp2_dp1": (4 * NORMS, {"0,1": 4 * NORMS}),  # one DP partition: the norms and their fragments' state
    # FSDP2 + TP: the dp shard of the tied embedding and of each norm, and their moments, on each TP group
    "fsdp_tp2_dp2": (6 * (NORMS + 1), {"0,1": 3 * (NORMS + 1), "2,3": 3 * (NORMS + 1)}),
    "fsdp_bf16_autocast": (6 * (NORMS + 1), {"0,1": 3 * (NORMS + 1), "2,3": 3 * (NORMS + 1)}),
    "fsdp_bf16_policy": (6 * (NORMS + 1), {"0,1": 3 * (NORMS + 1), "2,3": 3 * (NORMS + 1)}),
    "fsdp_tp2_dp1_clip": (3 * (NORMS + 1), {"0,1": 3 * (NORMS + 1)}),
    "fsdp_tp1_dp2": (0, {}),  # pure FSDP2 shards everything: no two ranks hold the same piece
}


def reference_digest(t: torch.Tensor) -> tuple[int, int, int]:
    """The digest by its definition: the words w_i, S = Σ w_i and W = Σ (i + 1)·w_i modulo P."""
    w = words(t).numpy().astype(np.int64)
    positions = np.arange(1, w.size + 1, dtype=np.int64) % MODULUS
    return w.size, int(w.sum()), int(((positions * (w % MODULUS)) % MODULUS).sum()) % MODULUS


def test_the_digest_is_its_definition_on_every_path_and_sees_one_ulp_and_a_swap():
    """Tensors below a row, across rows, across pieces and passes of the buffer (a tensor of more than PASS_ROWS rows),
    empty, bf16 (16-bit words), float64 (two words an element), and one not there yet (None)."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, generator=g), torch.randn(ROW - 1, generator=g), torch.randn(3, ROW + 1, generator=g),
               torch.randn(PASS_ROWS * ROW + 17, generator=g), torch.empty(0),
               torch.randn(2 * ROW + 3, generator=g).bfloat16(), torch.randn(64, generator=g).double(), None]
    digester = Digester()
    for _ in range(2):  # the second time from what the first prepared (the views of the same tensors)
        digests = digester(tensors, torch.device("cpu")).tolist()
        assert digests == [list(reference_digest(t)) if t is not None else [-1, -1, -1] for t in tensors]
    x = torch.randn(3000, generator=g)
    one_ulp, swapped = x.clone(), x.clone()
    one_ulp[1234] = torch.nextafter(x[1234], 2 * x[1234])  # one ulp away from zero: the word's integer + 1
    swapped[[10, 2500]] = x[[2500, 10]]
    (n, s, w), (n1, s1, w1), (n2, s2, w2) = digester([x, one_ulp, swapped], torch.device("cpu")).tolist()
    assert (n1, s1 - s) == (n, 1) and w1 != w  # the last mantissa bit: S moves by one
    assert (n2, s2) == (n, s) and w2 != w  # the same words in other places: only the weighted sum sees it


class _Held:
    """What a recorder's layout declares for one parameter held by both ranks of a group of 2 — the parameter and its
    two moments — with a fault seeded on rank 1 at check `at`, into the parameter or into a moment alone."""

    def __init__(self, rank: int, fault: str, at: int):
        self.rank, self.fault, self.at, self.checks = rank, fault, at, 0
        self.tensors = {what: torch.full((64,), float(i)) for i, what in enumerate(("parameter", "exp_avg",
                                                                                     "exp_avg_sq"))}

    def replicas(self):
        from parity.training.replicas import Replica

        if self.rank == 1 and self.checks == self.at:
            self.tensors[self.fault][5] += 1.0
        self.checks += 1
        return [Replica("w", (0, 1), t, what) for what, t in self.tensors.items()]


def _moments_every_rank(rank: int, port: int, out: str) -> None:
    from conftest import gloo_rank
    from parity.training.replicas import ReplicaCheck

    with gloo_rank(rank, 2, port):
        found = {}
        for fault in ("parameter", "exp_avg"):
            held = _Held(rank, fault, at=4)  # the declaration at set-up is call 0: the fault comes at check 3
            check = ReplicaCheck(held, 1, torch.device("cpu"), moments_every=10)
            entries = [check.check() for _ in range(12)]
            found[fault] = [(e["checked"], e["parted"]) for e in entries]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(found, f)


def test_the_recorders_check_reads_the_parameters_every_step_and_the_moments_every_tenth(tmp_path):
    """moments_every 10 (the recorder's): a parameter that parts at check 3 is caught at check 3; a moment alone that
    parts there is caught at check 10, the next to read the moments (what the cheaper check gives up)."""
    from conftest import free_port
    from parity.driver.local_group import start_processes

    out = tmp_path / "found.json"
    start_processes(_moments_every_rank, (free_port(), str(out)), 2)
    found = json.loads(out.read_text())
    full, light = [3, 0], [1, 0]
    assert found["parameter"] == [full, light, light, [1, 1], *[[1, 1]] * 6, [3, 1], [1, 1]]
    assert found["exp_avg"] == [full, light, light, light, *[light] * 6, [3, 1], light]


def test_ranks_must_agree_on_what_they_declare():
    key = ("model.norm.weight", "parameter", "", (0, 1))
    assert agreed_keys([[key], [key]], "S") == [key]
    with pytest.raises(ReplicaDeclarationError, match=r"S declares the replica model.norm.weight for ranks \[0, 1\], "
                                                      r"but rank 1 does not declare it"):
        agreed_keys([[key], []], "S")
    with pytest.raises(ReplicaDeclarationError, match=r"on rank 2 for ranks \[0, 1\], which do not include rank 2"):
        agreed_keys([[key], [key], [key]], "S")
    with pytest.raises(ReplicaDeclarationError, match=r"declares the replica model.norm.weight \(exp_avg \[0:8\]\) twice"):
        agreed_keys([[(*key[:1], "exp_avg", "[0:8]", (0,))] * 2], "S")


@pytest.mark.parametrize("name", CLEAN)
def test_clean_runs_hold_their_replicas_bit_for_bit_at_every_step(shared_runs, name):
    groups, by_ranks = CLEAN[name]
    run = shared_runs[name]
    assert_replicas_held(run, groups)
    assert run["replicas"]["by_ranks"] == by_ranks
    assert all(s["harness_s"].get("replica_check", 0) > 0 for s in run["steps"]) == bool(groups)


def test_the_interval_thins_the_check_but_keeps_the_last_step(shared_runs):
    run = shared_runs["ddp_clip"]  # --replica_check_interval 5, 12 steps
    assert [s["step"] for s in run["steps"] if "replicas" in s] == [4, 9, 11]
    assert all(s["replicas"] == {"checked": 3 * PARAMS, "parted": 0} for s in run["steps"] if "replicas" in s)
    assert run["replicas"]["interval"] == 5


def judge(shared_runs, tmp_path, capsys, run: str, baseline: str, *flags):
    """plot_loss_curves.py on a folder of the baseline's record and the run's: (exit code, the run's verdict in
    curve_comparison.json, stdout + stderr)."""
    for name in (baseline, run):
        record = shared_runs[name]
        shutil.copy(os.path.join(record["config"]["loss_output_dir"], f"loss_{record['strategy']}.json"), tmp_path)
    code = plot_loss_curves(["--input_dir", str(tmp_path), "--output", str(tmp_path / "c.png"), *flags])
    out = capsys.readouterr()
    if code == 2:
        return code, None, out.out + out.err
    (against,) = json.loads((tmp_path / "curve_comparison.json").read_text())["against_baseline"].values()
    return code, against, out.out + out.err


# (run, its baseline, the first step, the parameter named, its ranks grouped by the bits they hold, the verdict's own
# first step outside: the fixed fp32 table's, or the teacher-forced check's where it comes first — the rank-local
# clipping at step 0, where the curves see it at step 4 (docs/teacher_forced.md); None = the curves alone PASS)
BUGS = [("bug_ddp_tied_unreduced", "ddp_tp1_dp2", 0, "model.embed_tokens.weight", [[0], [1]], 0),
        ("bug_ddp_skips_an_update", "ddp_tp1_dp2", SKIPPED_STEP, SKIPPED_PARAMETER, [[0], [1]], None),
        ("bug_deepspeed_local_clip", "ddp_clip", 0, "layernorm.weight", [[0, 2], [1, 3]], 0)]


@pytest.mark.parametrize("run,baseline,step,parameter,ranks,curves_step", BUGS, ids=[b[0] for b in BUGS])
def test_a_replica_parting_fails_at_its_first_step_naming_the_parameter_and_ranks(shared_runs, tmp_path, capsys, run,
                                                                                 baseline, step, parameter, ranks,
                                                                                 curves_step):
    """The tied embedding left out of DDP's all-reduce (each rank steps its copy with its own slice's gradient); one
    DP rank skipping one update of one parameter the loss barely feels; ZeRO clipping each rank's partition by its own
    norm (the #1801 class), which parts AutoTP's replicated norms between the TP ranks. The record says where, and
    the verdict FAILs on it in one line — the curves see the first late, and the second not at all."""
    record = shared_runs[run]
    first = next(s for s in record["steps"] if s["replicas"]["parted"])
    assert first["step"] == step and all(s["replicas"]["parted"] == 0 for s in record["steps"][:step])
    named = first["replicas"]["tensors"][0]
    assert parameter in named["name"] and named["what"] == "parameter" and named["ranks"] == ranks
    assert named["max_abs_diff"] > 0
    code, against, out = judge(shared_runs, tmp_path, capsys, run, baseline)
    parted = against["replicas_parted"]
    assert (code, against["verdict"], parted["step"], parted["name"], parted["ranks"]) == (
        1, "FAIL", step, named["name"], ranks)
    groups = " and ".join(f"rank {g[0]}" if len(g) == 1 else "ranks " + ", ".join(map(str, g)) for g in ranks)
    assert (f"replicas part at step {step}: {named['name']} differs between {groups} (max |difference| "
            f"{named['max_abs_diff']:.3e}") in out, out
    outside = against["first_outside"]
    assert (outside and outside["step"]) == curves_step, out
    if curves_step is None:
        assert "curves alone: within their bounds at every step" in out


def test_a_baseline_whose_replicas_part_is_refused(shared_runs, tmp_path, capsys):
    code, _, out = judge(shared_runs, tmp_path, capsys, "ddp_tp1_dp2", "bug_ddp_tied_unreduced",
                         "--baseline", "ddp_tied_embedding_unreduced")
    assert code == 2
    assert out.startswith("error: not comparable: loss_ddp_tied_embedding_unreduced.json (ddp_tied_embedding_unreduced, "
                          "the baseline): replicas part at step 0: model.embed_tokens.weight differs between rank 0 and "
                          "rank 1"), out
