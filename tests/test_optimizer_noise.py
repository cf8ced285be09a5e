"""The optimizer's own noise in the update's bound, and the false-alarm campaign's slice (issue 81; docs/tensors.md#the-
optimizers-own-noise, docs/false_alarms.md).

The rebuilt case of a clean bf16 run once called FAIL on CUDA by one AdamW sign flip of a 64-element norm weight
(parity/calibration/near_zero.py): qwen2-tiny (seed 42, seq 32), four elements of
`layers.0.post_attention_layernorm.weight` at the root of their step-0 gradient, so that each run's first update moves
each of them by ±lr, its sign the run's arithmetic's. DDP's bf16 baseline records its AdamW's table, beside its two
references (one rank; two ranks in another arithmetic); a clean FSDP2 + TP run, under the default kernels and under
oneDNN's AVX2 ones, PASSes 100 steps against it within half of every bound, the root tensor's update bound at step 0
at least one flip; AdamW's step counter advanced twice still FAILs at step 1. Then the campaign tool
(tools/false_alarms.py) runs its slice at a seed no other test uses — a hand-written loop and Trainer, two families of
the recorded runs (the harness's strategies' is the FSDP2 + TP run above) — and writes its page: two clean verdicts, no
FAIL, no refusal. Beside them, unit tests of what the campaign found: a zero-initialised element's flip carried into
later steps' bounds, a resumed baseline's tables, and the reference that clips as torch's clip_grad_norm_ does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, free_port, gloo_rank
from ddp_strategy import DDPStrategy
from parity.comparing import tensor_verdict
from parity.comparing.curves import compare, load_references, load_runs
from parity.comparing.margins import bound_ratios
from parity.comparing.tolerances import OPTIMIZER_NOISE_K

SEED = 81  # the campaign's slice: no other test's
REBUILT_SEED = 42  # the rebuilt case's (its root elements found on this seed's first batch)
ROOTED = "model.layers.0.post_attention_layernorm.weight"
ROOTS = 4
STEPS = 100
SETTING = {"model_name": "qwen2-tiny", "seq_length": 32, "debug_steps": STEPS, "learning_rate": 1e-3,
           "warmup_steps": 0, "max_grad_norm": 1.0, "log_interval": STEPS, "checkpoint_interval": 0,
           "seed": REBUILT_SEED, "precision": "bf16"}
REFERENCES = ("noise_reference_ddp_tp1_dp1_bf16", "noise_reference_ddp_tp1_dp2_bf16_perturbed")
MARGIN = 0.5


class DDPStepCountedTwice(DDPStrategy):
    """AdamW's step counter advanced once more before each step from step 1 on: each step's bias correction is a later
    step's (tests/megatron_train_job.py seeds the same in megatron-core)."""

    name = "ddp_step_twice"

    def optimizer_step(self, lr: float):
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] += 1
        return super().optimizer_step(lr)


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> dict:
    """{"default" | "avx2": the folder of DDP's baseline, its references (one rank; two ranks in another arithmetic),
    the clean FSDP2 + TP run under that kernel path (and, in "default", the seeded bug)}, and the root elements."""
    from parity.calibration.near_zero import near_zero_weights
    from parity.driver.local_group import plan, run_group

    root = tmp_path_factory.mktemp("optimizer_noise")
    weights = str(root / "near_zero.pt")
    values = {**SETTING, "loss_output_dir": root / "default", "storage_path": root / "ray", "init_weights_path": weights}
    cfg, batches = plan("ddp", {**values, "precision": "fp32", "num_workers": 1, "batch_size": 4,
                                "save_init_weights": True})
    elements, left = near_zero_weights(cfg, batches, ROOTED, ROOTS, weights)
    run_group([plan("ddp", {**values, "num_workers": 1, "batch_size": 4, "noise_reference": True})])
    run_group([plan("ddp", {**values, "num_workers": 2, "batch_size": 2}),
               plan("ddp", {**values, "num_workers": 2, "batch_size": 2, "noise_reference": True, "perturb": 4 / 3}),
               plan("fsdp", {**values, "num_workers": 2, "batch_size": 4, "tp_size": 2}),
               plan("ddp", {**values, "num_workers": 2, "batch_size": 2, "strategy_class": DDPStepCountedTwice})])
    avx2 = root / "avx2"
    avx2.mkdir()
    for name in ("loss_ddp", *REFERENCES):
        shutil.copy(root / "default" / f"{name}.json", avx2)
        shutil.copytree(root / "default" / f"{name}.tensors", avx2 / f"{name}.tensors")
    run_group([plan("fsdp", {**values, "loss_output_dir": avx2, "num_workers": 2, "batch_size": 4, "tp_size": 2})],
              kernel="avx2")
    return {"default": root / "default", "avx2": avx2, "elements": elements, "left": left}


def _judged(folder):
    c = compare(load_runs(str(folder)), references=load_references(str(folder)))
    return c, {r.run.name: r for r in c.results}


@pytest.mark.parametrize("kernels", ["default", "avx2"])
def test_the_rebuilt_near_zero_gradient_case_passes_100_bf16_steps(rebuilt, kernels):
    """Its root elements' step-0 gradients are rounding alone (≤ 1e-5 of the tensor's rms gradient in fp32); the clean
    FSDP2 + TP run PASSes every check within half its bound; the root tensor's update bound at step 0 holds at least
    one flipped root element (2 lr |w_j| / ‖w‖, over ‖w‖), from the baseline's own AdamW table."""
    assert len(rebuilt["elements"]) == ROOTS and rebuilt["left"] < 1e-5, rebuilt
    c, results = _judged(rebuilt[kernels])
    fsdp = results["fsdp"]
    ratios = bound_ratios(c, fsdp)
    assert fsdp.verdict.passed and max(ratios.values()) < MARGIN, ratios
    assert "optimizer's own noise" in fsdp.tensors.source
    base = next(r for r in c.runs if r.name == "ddp")
    theirs = tensor_verdict.read(base)
    envelopes = tensor_verdict.envelopes_of(theirs, [tensor_verdict.read(r) for r in c.references], "gradient",
                                            STEPS, base.skipped(STEPS), "bf16")
    sigma = tensor_verdict.optimizer_sigmas(theirs, envelopes, STEPS)
    i = theirs.names.index(ROOTED)
    norm = theirs.param_norm[0][i]
    flip = 2 * SETTING["learning_rate"] * min(map(abs, _root_weights(rebuilt))) / norm
    assert OPTIMIZER_NOISE_K * sigma[0][i] >= flip, (sigma[0][i], flip)


def _root_weights(rebuilt) -> list[float]:
    import torch

    state = torch.load(str(rebuilt["default"].parent / "near_zero.pt"), weights_only=True)
    return [float(state[ROOTED].flatten()[i]) for i in rebuilt["elements"]]


def test_a_step_counter_advanced_twice_still_fails_at_step_1(rebuilt):
    """AdamW's bias correction a later step's from step 1: FAILs at step 1, as before the optimizer's noise entered
    the bounds (the parameter norm's curve and the tensor verdict both see it there)."""
    _, results = _judged(rebuilt["default"])
    first = results["ddp_step_twice"].verdict.first_outside
    assert first is not None and first.step == 1, first


def test_the_campaigns_slice_passes_at_a_seed_no_test_used(tmp_path):
    """tools/false_alarms.py --plan slice on a hand-written loop and Trainer at seed 81, two cells side by side: each
    verified clean run PASSes, none refused; the page it writes counts them, margins below half the bound."""
    out = tmp_path / "campaign"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "false_alarms.py"), "--output_dir", str(out),
                           "--plan", "slice", "--only", "own_loop,trainer", "--seeds", str(SEED), "--jobs", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get(
                              "PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = json.loads((out / "campaign.json").read_text())["cells"]
    assert sorted(c["capability"] for c in cells) == ["own_loop", "trainer"]
    assert all(c["verdict"] == "PASS" and not c["refused"] and c["margin"] < MARGIN for c in cells), cells
    page = (out / "false_alarms.md").read_text()
    assert "**2 clean verdicts, 0 FAIL, 0 refused.**" in page, page
    # the page again from the cells' folders, nothing run (a campaign run in parts); a pattern no cell has runs none
    tool = [sys.executable, os.path.join(REPO, "tools", "false_alarms.py"), "--output_dir", str(out), "--plan", "slice",
            "--seeds", str(SEED)]
    again = subprocess.run([*tool, "--page_only"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "**2 clean verdicts, 0 FAIL, 0 refused.**" in again.stdout, again.stdout
    assert "; 2 of its 23 cells run so far; the cells' seconds summed " in again.stdout and "\n| trainer | 1 | 1 | 0 | 0 |" in again.stdout
    none = subprocess.run([*tool, "--cells", "*_long", "--dry_run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert none.stdout.splitlines() == ["0 cells"], none.stdout


def test_a_zero_initialised_elements_flip_is_carried_into_the_bound_of_the_steps_after():
    """A 64-element bias from zero, AdamW at lr 1e-3: one element's first gradient at 1e-6 of the rms, so its first
    update's sign is the noise's. Flipped, it leaves the norm where it was at that step and parts it by 2 lr |p| / ‖p‖
    from the next one on (the flip stays in the parameter): the baseline's table, which carries each element's flips,
    holds that at every step after — 3 σ above the two runs' measured parting; at that noise level no other element
    carries a flip."""
    import torch

    from parity.comparing.update_bound import read
    from parity.training.update_noise import GRID, tensor_tables

    lr, level = 1e-3, 1e-4  # the element noise the bound is read at, in rms gradients: above the element's 1e-6
    grads = torch.randn(3, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    grads[1:, 0] = grads[1:, 0].abs() + 0.5  # after it, the element's gradient is a steady one's
    runs = {}
    for sign in (1.0, -1.0):
        p = torch.nn.Parameter(torch.zeros(64))
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
        carried, norms, rows = None, [], []
        for s, g in enumerate(grads):
            p.grad = g.clone()
            if s == 0:
                p.grad[0] = sign * 1e-6 * float(g.pow(2).mean().sqrt())
            opt.step()
            state = opt.state[p]
            ((row, carried),) = tensor_tables([(p.grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"]), p,
                                                 carried)], lr, (0.9, 0.999), 1e-8)
            norms.append(float(p.detach().double().norm()))
            rows.append(row.tolist())
        runs[sign] = (norms, rows, carried)
    (plus, rows, carried), (minus, _, _) = runs[1.0], runs[-1.0]
    parted = [abs(a - b) for a, b in zip(plus, minus)]
    assert parted[0] < 1e-9 and parted[1] > 1e-6, parted  # nothing at the flip's step; a lr-sized part after it
    for s in (1, 2):
        assert OPTIMIZER_NOISE_K * read(rows[s], level) ** 0.5 >= parted[s], (s, rows[s], parted[s])
    at = min(range(len(GRID)), key=lambda j: abs(GRID[j] - level))
    assert (carried[:, at] > 0).nonzero().flatten().tolist() == [0]  # at that level, element 0 alone carries a flip


def test_a_groups_tables_measured_together_are_each_tensors_own_bit_for_bit(monkeypatch):
    """tensor_tables measures a param group's tensors in passes of one buffer (CHUNK's elements: here 5 000, so that
    tensors share passes and a pass ends mid-list): every row and carried buffer is the one its tensor gets measured
    alone, bit for bit, at every step — a sampled tensor (past 16 384 elements), an embedding's unreached rows, a bias
    from zero whose first update is a flip, a tensor whose gradient is 0 (no row, nothing carried) and one of norm 0 — and
    a step's carried buffers are the next step's pass buffer, not a copy of it."""
    import torch

    from parity.training import update_noise

    monkeypatch.setitem(update_noise.CHUNK, "cpu", 5000)
    gen = torch.Generator().manual_seed(3)
    shapes = [(40, 64), (64,), (20000,), (16, 32), (64,), (64,), (48, 48)]
    params = [torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.02) for shape in shapes]
    params[1].data.zero_()  # the bias from zero
    params[5].data.zero_()  # norm 0 throughout: its gradient is 0 too
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    together, alone = [None] * len(params), [None] * len(params)
    for step in range(4):
        for k, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen) * (0.0 if k in (4, 5) else 0.01)
        params[0].grad[:25] = 0  # rows no token reached
        params[1].grad[0] = 1e-6 * float(params[1].grad.pow(2).mean().sqrt()) if step == 0 else params[1].grad[0]
        opt.step()
        entry = [(p.grad, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], int(opt.state[p]["step"]), p)
                 for p in params]
        rows = update_noise.tensor_tables([(*e, c) for e, c in zip(entry, together)], 1e-3, (0.9, 0.999), 1e-8)
        one = [update_noise.tensor_tables([(*e, c)], 1e-3, (0.9, 0.999), 1e-8)[0] for e, c in zip(entry, alone)]
        if step > 0:  # the pass of tensors 0–1 kept its buffer: the views carried in are the ones carried out
            assert rows[0][1].data_ptr() == together[0].data_ptr() and rows[1][1]._base is rows[0][1]._base
        for k, ((row, carried), (row_alone, carried_alone)) in enumerate(zip(rows, one)):
            assert torch.equal(row, row_alone), (step, k)
            assert (carried is None) == (carried_alone is None) == (k in (4, 5)), (step, k)
            assert carried is None or torch.equal(carried, carried_alone), (step, k)
        together, alone = [c for _, c in rows], [c for _, c in one]
        assert [float(r[-1]) > 0 for r, _ in rows] == [True, True, True, True, False, False, True], step
    assert together[2].shape == (update_noise.SAMPLED, len(update_noise.GRID))  # sampled, scaled
    assert int((together[1][:, 8] > 0).sum()) >= 1  # the bias's flip carried


def test_a_tensors_sample_is_drawn_once_uniform_and_without_permuting_a_large_one():
    """The elements a large tensor's table is measured on: drawn once per size (every step and rank the same — it had
    been drawn at every step, a permutation of all 136 M elements of Qwen2.5-0.5B's embedding, 8 s of a CPU each
    step), up to 2^20 elements a permutation's first 2^14 (as always: every tiny model's tables unchanged); beyond, 2^14
    distinct elements spread as uniformly: the sample's mean and quartiles within 4 standard errors of the uniform's,
    at Qwen2.5-0.5B's embedding, an MLP matrix and just past the permutation's limit."""
    import torch

    from parity.training.update_noise import PERMUTED, SAMPLED, _sample

    cpu = torch.device("cpu")
    assert _sample(SAMPLED, cpu) is None
    assert torch.equal(_sample(131072, cpu), torch.randperm(131072, generator=torch.Generator().manual_seed(131072))[
        :SAMPLED])
    for n in (PERMUTED + 1, 896 * 4864, 151936 * 896):
        drawn = _sample(n, cpu)
        assert _sample(n, cpu) is drawn  # once
        assert len(drawn) == len(torch.unique(drawn)) == SAMPLED and 0 <= int(drawn.min()) and int(drawn.max()) < n
        u = drawn.double() / n  # uniform on [0, 1): mean 1/2, sd 1/√12; a quantile q's sd √(q(1 − q)/N)
        assert abs(float(u.mean()) - 0.5) < 4 / (12 * SAMPLED) ** 0.5, n
        for q in (0.25, 0.5, 0.75):
            assert abs(float((u < q).double().mean()) - q) < 4 * (q * (1 - q) / SAMPLED) ** 0.5, (n, q)


def test_a_resumed_baselines_tables_are_the_uninterrupted_ones(tmp_path):
    """DDP's bf16 baseline checkpoints the flips its table carries (PolicyOptimizer.state_dict, in bf16): stopped after
    step 3 of 6 and resumed from the saved state, its tables of steps 4–6 are the uninterrupted run's to bf16's
    rounding; a checkpoint without them (an older one) resumes with none carried, and the weight's tables fall short.
    A tensor not asked for (another rank counts it) has no table, and the others' are unchanged."""
    import io

    import torch

    from parity.training.policy_optimizer import PolicyOptimizer

    cfg = ddp_config(tmp_path, "bf16")
    grads = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(3))
    grads[:, :, :4] *= 1e-4  # elements whose updates take the noise's sign: flip-prone from the lowest levels

    def model():
        torch.manual_seed(0)
        layer = torch.nn.Linear(32, 1)
        torch.nn.init.zeros_(layer.bias)
        return layer

    def steps(opt, params, which) -> list[list]:
        tables = []
        for s in which:
            for p, g in zip(params, (grads[s, 0].view(1, 32), grads[s, 1, :1])):
                p.grad = g.to(p.dtype, copy=True)  # a copy: the step clips it in place
            opt.step(1e-3, lambda gs: float(torch.stack([g.norm() for g in gs]).norm()))
            tables.append([opt.update_noise.get(id(m)) for m in opt.master_parameters()])
        return tables

    def optimizer(measured=slice(None)):
        params = list(model().parameters())
        opt = PolicyOptimizer(params, cfg, ["weight", "bias"])
        opt.measure_update_noise(opt.master_parameters()[measured])
        return opt, params

    whole = steps(*optimizer(), range(6))
    alone = steps(*optimizer(slice(0, 1)), range(6))  # the weight alone: as a rank that counts only it measures
    assert all(torch.equal(a[0], w[0]) and a[1] is None for a, w in zip(alone, whole))
    first, params = optimizer()
    steps(first, params, range(3))
    saved = io.BytesIO()
    torch.save({"model": [p.detach() for p in params], "optimizer": first.state_dict()}, saved)  # as DDP's checkpoint
    resumed = {}
    for kept in (True, False):
        state = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
        if not kept:
            state["optimizer"].pop("update_noise_carried")
        opt, params = optimizer()
        with torch.no_grad():
            for p, value in zip(params, state["model"]):
                p.copy_(value)
        opt.load_state_dict(state["optimizer"])
        resumed[kept] = steps(opt, params, range(3, 6))
    for s, (a, b) in enumerate(zip(whole[3:], resumed[True])):
        for x, y in zip(a, b):
            assert x.abs().max() > 0 and torch.allclose(x, y, rtol=2e-2, atol=0), (s + 3, x, y)  # bf16 halves: 2^-8
    short = [float((a[0] - b[0]).max() / a[0].max()) for a, b in zip(whole[3:], resumed[False])]
    assert min(short) > 0.5, short  # without the carried flips the weight's table (its 4 flip-prone elements) lost half


def ddp_config(folder, precision: str):
    """DDP's resolved configuration at one worker, lr 1e-3, clipped at 1.0: what a PolicyOptimizer reads."""
    from parity.driver.config import resolve
    from parity.driver.local_group import CLUSTER

    return resolve("ddp", {"precision": precision, "num_workers": 1, "learning_rate": 1e-3, "max_grad_norm": 1.0,
                           "loss_output_dir": folder, "init_weights_path": folder / "init.pt",
                           "save_init_weights": True}, cluster=CLUSTER)


def test_the_reference_clipping_as_torch_does_steps_as_a_torch_loop(tmp_path):
    """Why clean fp32 loops drifted from their replays over 100 steps (Lightning 2.8 × the drift bound,
    docs/false_alarms.md): a framework's loop clips by torch's clip_grad_norm_ — the norm and its coefficient in fp32 —
    where the harness clips by a float64 norm, and every reference clipped the harness's way, so none drew the
    difference. The other-kernels reference now clips as torch does (RunConfig.clip_arithmetic "torch"): over 20
    clipped fp32 steps its optimizer steps as a torch loop does, bit for bit; the harness's own clip parts from it by
    rounding alone."""
    import dataclasses

    import torch

    from parity.training.optimizer import build_optimizer, set_lr
    from parity.training.policy_optimizer import PolicyOptimizer

    cfg = ddp_config(tmp_path, "fp32")
    grads = torch.randn(20, 8, 32, generator=torch.Generator().manual_seed(5)) * 0.3  # norms about 4.8: all clipped
    start = torch.randn(8, 32, generator=torch.Generator().manual_seed(6))

    def trained(step) -> torch.Tensor:
        weight = torch.nn.Parameter(start.clone())
        stepper = step(weight)
        for g in grads:
            weight.grad = g.clone()
            stepper()
        return weight.detach()

    def torch_loop(weight):
        optimizer = build_optimizer([weight], cfg)

        def step():
            torch.nn.utils.clip_grad_norm_([weight], cfg.max_grad_norm)
            set_lr(optimizer, 1e-3)
            optimizer.step()
        return step

    def policy(arithmetic):
        def build(weight):
            opt = PolicyOptimizer([weight], dataclasses.replace(cfg, clip_arithmetic=arithmetic), ["weight"])
            return lambda: opt.step(1e-3, lambda gs: float(torch.stack([g.double().norm() for g in gs]).norm()))
        return build

    assert min(float(g.norm()) for g in grads) > 1.0
    loop = trained(torch_loop)
    assert torch.equal(trained(policy("torch")), loop)
    harness = trained(policy(None))
    parted = float((harness - loop).abs().max() / loop.abs().max())
    assert 0 < parted < 1e-6, parted


def test_the_sharded_replays_reference_clips_as_an_fsdp2_loop_does():
    """Where verify_trainer's replay is FSDP2 (a model too large for a DDP replica: replay_choice), its reference under
    other kernels clips by torch's clip_grad_norm_ over the DTensors too, as an FSDP2 loop does: over 20 clipped fp32
    AdamW steps of a one-rank mesh, bit for bit such a loop; the harness's own clip (a float64 norm) parts from it by
    rounding alone. ZeRO-3's engine clips in DeepSpeed's arithmetic: its reference says so (plan_replays)."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from autotp_strategy import DeepSpeedStrategy
    from fsdp_strategy import FSDPStrategy
    from parity.training.dtensor_strategy import clip_sharded_gradients

    assert FSDPStrategy.clips_as_torch and DDPStrategy.clips_as_torch and not DeepSpeedStrategy.clips_as_torch
    grads = torch.randn(20, 8, 32, generator=torch.Generator().manual_seed(5)) * 0.3  # norms about 4.8: all clipped
    start = torch.randn(8, 32, generator=torch.Generator().manual_seed(6))
    with gloo_rank(0, 1, free_port()):
        mesh = init_device_mesh("cpu", (1,))

        def trained(clip) -> torch.Tensor:
            weight = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(0)]))
            optimizer = torch.optim.AdamW([weight], lr=1e-3)
            for g in grads:
                weight.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
                clip([weight])
                optimizer.step()
            return weight.detach().full_tensor()

        loop = trained(lambda params: torch.nn.utils.clip_grad_norm_(params, 1.0))
        reference = trained(lambda params: clip_sharded_gradients(params, SimpleNamespace(max_grad_norm=1.0,
                                                                                         clip_arithmetic="torch")))
        harness = trained(lambda params: clip_sharded_gradients(params, SimpleNamespace(max_grad_norm=1.0)))
    assert torch.equal(reference, loop)
    parted = float((harness - loop).abs().max() / loop.abs().max())
    assert 0 < parted < 1e-6, parted
