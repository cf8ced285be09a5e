"""The house refactor's checks (issue 39), each cheap: what the tables, the layout and the fingerprint promise."""

import os

import pytest


def test_fingerprint_classifies_strategy_code_by_place():
    """A strategy's code is its module, its helper package (parity/strategies/<stem>/) and the modules of the bases
    it inherits: FSDP's holds the DTensor base and parity/strategies/fsdp/, DDP's its module alone; shared code holds
    neither (editing FSDP's base does not make a DDP record "other code")."""
    import glob

    from ddp_strategy import DDPStrategy
    from fsdp_strategy import FSDPStrategy
    from parity import fingerprint

    home = os.path.dirname(os.path.dirname(os.path.abspath(fingerprint.__file__)))
    helpers = {os.path.relpath(path, home).replace(os.sep, "/")
               for path in glob.glob(os.path.join(home, "parity", "strategies", "fsdp", "*.py"))}
    fsdp = fingerprint.strategy_code(FSDPStrategy)["files"]
    assert helpers and helpers | {"fsdp_strategy.py", "parity/training/dtensor_strategy.py"} <= set(fsdp), fsdp
    assert fingerprint.strategy_code(DDPStrategy)["files"] == ["ddp_strategy.py"]
    shared = fingerprint.shared_files()
    assert os.path.join("training", "dtensor_strategy.py") not in shared
    assert not [rel for rel in shared if rel.split(os.sep)[0] == "strategies"], shared
    assert os.path.join("training", "strategy.py") in shared  # the interface every strategy inherits is shared


# --- the registry: a table of rows, classes loaded by path (item 1) -------------------------------------------------

def test_the_registry_imports_no_strategy_module_and_every_row_loads_its_class():
    """parity/registry.py names its strategies by class path and loads them with importlib: no import of a strategy
    module (a top-level *_strategy.py, a row's module, a helper package under parity/strategies/) anywhere in it. Each
    row's path loads a Strategy subclass whose `name` is the row's."""
    import ast
    import glob

    from parity import registry
    from parity.training.strategy import Strategy

    home = os.path.dirname(os.path.dirname(os.path.abspath(registry.__file__)))
    strategy_modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(home, "*_strategy.py"))}
    strategy_modules |= {row.path.partition(":")[0] for row in registry.ROWS}
    with open(registry.__file__) as f:
        tree = ast.parse(f.read())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    wrong = [m for m in imported if m.split(".")[0] in strategy_modules or m.endswith("_strategy")
             or m.startswith("parity.strategies")]
    assert not wrong, f"parity/registry.py imports strategy modules: {wrong}"
    assert strategy_modules >= {"ddp_strategy", "autotp_strategy", "fsdp_strategy", "pipeline_strategy",
                                "transformers_strategy"}
    assert registry.NAMES == ("ddp", "deepspeed", "fsdp") and registry.KNOWN[:3] == registry.NAMES
    for row in registry.ROWS:
        cls = registry.load(row.path)
        assert issubclass(cls, Strategy) and cls is not Strategy and cls.name == row.name, row
        assert registry.class_path(cls) == row.path and registry.label(row.name) == row.label


def _resolve(tmp_path, strategy: str, **values):
    from parity.driver.cluster import Cluster
    from parity.driver.config import resolve

    return resolve(strategy, {"model_name": "qwen2-tiny", "seq_length": 64, "device": "cpu",
                              "init_weights_path": str(tmp_path / "w.pt"), "loss_output_dir": str(tmp_path / "loss"),
                              "storage_path": str(tmp_path / "ray"), **values},
                   cluster=Cluster(cpus=2, gpus=0), weights_written_before_launch=True)


def test_a_run_loads_its_class_from_the_configs_path(tmp_path):
    """`resolve` turns the name, a --strategy_class path or a class handed in by code into one class path,
    strategy_path; the worker loads that path, whatever the name says (here a config named ddp whose path is the
    user's class: the loop fingerprints the user's module, and so does a checkpoint's check)."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from my_strategy import HandWrittenDP
    from parity.training.checkpoints import driver_fingerprint
    from parity.training.loop import run_fingerprint

    ddp = _resolve(tmp_path, "ddp")
    assert (ddp.strategy, ddp.strategy_class, ddp.strategy_path) == ("ddp", None, "ddp_strategy:DDPStrategy")
    assert ddp.to_dict()["strategy_path"] == "ddp_strategy:DDPStrategy"  # the record's config carries it
    for given in ("my_strategy:HandWrittenDP", HandWrittenDP):
        own = _resolve(tmp_path, "ddp", strategy_class=given)
        assert (own.strategy, own.strategy_class, own.strategy_path) == (
            "hand_written_dp", "my_strategy:HandWrittenDP", "my_strategy:HandWrittenDP")
    mine = dataclasses.replace(ddp, strategy_path="my_strategy:HandWrittenDP")
    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert run_fingerprint(mine, cpu)["strategy_code"]["files"] == ["my_strategy.py"]
    assert driver_fingerprint(mine)["strategy_code"]["files"] == ["my_strategy.py"]
    assert run_fingerprint(ddp, cpu)["strategy_code"]["files"] == ["ddp_strategy.py"]


def test_the_main_job_plans_your_class_by_its_path(tmp_path, monkeypatch):
    """STRATEGIES="ddp my_strategy:HandWrittenDP": the main job plans the user's class from its attributes (it
    shards no tensors: DP_SIZE workers at TP 1) and resolves it as its own run, loaded by its path. (The class's
    training through Ray and the verdict are tests/test_custom_strategy.py's; this is the main job's part.)"""
    from parity.commands import main_job
    from parity.driver.cluster import Cluster

    for env, *_ in main_job.SETTINGS:
        monkeypatch.delenv(env, raising=False)
    args = main_job.build_parser().parse_args(["--strategies", "ddp my_strategy:HandWrittenDP", "--device", "cpu",
                                               "--seq_length", "64", "--noise_reference", "off"])
    cluster = Cluster(cpus=2, gpus=0)
    cfgs = [_resolve(tmp_path, strategy, **values) for strategy, values in
            main_job.run_plan(args, str(tmp_path / "job"), cluster)]
    assert [(c.strategy, c.strategy_class, c.strategy_path, c.num_workers, c.tp_size, c.dp_size) for c in cfgs] == [
        ("ddp", None, "ddp_strategy:DDPStrategy", 2, 1, 2),
        ("hand_written_dp", "my_strategy:HandWrittenDP", "my_strategy:HandWrittenDP", 2, 1, 2)]
    assert cfgs[0].save_init_weights and not cfgs[1].save_init_weights
    assert main_job.run_title(cfgs[1]) == "hand_written_dp tp=1 dp=2 fp32"


def test_a_perturbed_reference_is_planned_only_for_a_loop_that_trains_it(tmp_path):
    """RunConfig.perturb (a noise reference's loss × the factor, its gradients ÷ it) reaches DDP, whose class says it
    trains it (takes_perturb); a strategy that would ignore it is refused in one line, not left to train unperturbed."""
    from parity.errors import ConfigError

    assert _resolve(tmp_path, "ddp", perturb=4 / 3, noise_reference=True).perturb == 4 / 3
    with pytest.raises(ConfigError, match=r"^fsdp does not train a perturbed noise reference"):
        _resolve(tmp_path, "fsdp", perturb=4 / 3, tp_size=1, noise_reference=True)


# --- the precision policy: every table keyed by policy follows POLICIES (item 3) -----------------------------------

def test_every_table_keyed_by_policy_covers_exactly_the_policies():
    """parity/precision.py's POLICIES is the one list of policies: --precision's choices (the run flags', the main
    job's PRECISION, the benchmark's and the layer check's) are exactly the policies plus auto, and memory's bytes per
    parameter and the tolerances' table rows exactly the policies — with the values they had when written by hand."""
    import argparse
    from dataclasses import fields

    from parity.commands import benchmark, layer_check, main_job
    from parity.comparing.tolerances import TOLERANCE_CLASS
    from parity.driver.config import DTYPE_NAMES, FLAGS, PRECISIONS, add_run_flags
    from parity.precision import DTYPES, LOSS_SCALING_DEFAULTS, POLICIES
    from parity.deepspeed_precision import FP16_SCALER_KEYS
    from parity.training.loss_scaler import LossScaler
    from parity.training.memory import BYTES_PER_PARAM

    policies = set(POLICIES)
    assert set(PRECISIONS) == policies | {"auto"} and len(PRECISIONS) == len(policies) + 1
    assert set(BYTES_PER_PARAM) == policies and set(TOLERANCE_CLASS) == policies
    assert BYTES_PER_PARAM == {"fp32": (4, 4, 8), "bf16": (4, 4, 8), "bf16_params": (2, 2, 12), "fp16": (2, 2, 12),
                               "bf16_pure": (2, 2, 4), "fp16_autocast": (4, 4, 8), "bf16_base": (4, 4, 8),
                               "bf16_base_autocast": (4, 4, 8)}
    assert TOLERANCE_CLASS == {"fp32": "fp32", "bf16": "bf16", "bf16_params": "bf16", "bf16_pure": "bf16",
                               "fp16": "bf16", "fp16_autocast": "bf16", "bf16_base": "bf16",
                               "bf16_base_autocast": "bf16"}
    assert DTYPE_NAMES == tuple(DTYPES) and {d for p in POLICIES.values() for d in (p.params, p.master)} <= set(DTYPES)
    assert FP16_SCALER_KEYS == tuple(f.name for f in fields(LossScaler)) == tuple(LOSS_SCALING_DEFAULTS)

    def precision_choices(parser) -> set:
        (action,) = [a for a in parser._actions if "--precision" in a.option_strings]
        return set(action.choices)

    run_flags = argparse.ArgumentParser()
    add_run_flags(run_flags)
    (flag,) = [keywords for group, name, default, keywords in FLAGS if name == "precision"]
    assert all(name in flag["help"] for name in POLICIES)  # the help text names every policy
    for parser in (run_flags, benchmark.build_parser(), layer_check.build_parser()):
        assert precision_choices(parser) == policies | {"auto"}
    main_job_parser = main_job.build_parser()
    (action,) = [a for a in main_job_parser._actions if "--precision" in a.option_strings]
    assert set(action.choices) == policies | {"auto"} and all(name in action.help for name in POLICIES)


# --- the per-step observer: any loop can feed it (item 4) ------------------------------------------------------------

class _Trackers:
    """What the observer hands each step's entry to (parity.tracking's RunTrackers): here, a list."""

    def __init__(self):
        self.steps, self.finished = [], False

    def __bool__(self):
        return True

    def log_step(self, entry):
        self.steps.append(entry["step"])
        return 0.25

    def finish(self):
        self.finished = True


def _observed_rank(rank: int, port: int, folder: str):
    """A hand-written data-parallel loop of three steps on a torch Linear, on rank `rank` of a gloo group of two: it
    feeds the observer each step's loss sums, its gradients and what it fed, and rank 1's bias is nudged after the last
    step (the replica check must say by how much). Writes what it fed to fed_<rank>.json."""
    import json
    import math

    import torch
    import torch.distributed as dist

    from conftest import gloo_rank
    from parity.training.observer import ModelStateProbe, StepObserver
    from parity.training.record import LossRecord
    from parity.training.replicas import whole_model

    with gloo_rank(rank, 2, port):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

        class Replicas:  # what the loop declares: both ranks hold the whole model and its AdamW moments
            @staticmethod
            def replicas():
                return whole_model(model, optimizer, (0, 1))

        lines, trackers = [], _Trackers()
        counts = iter(range(100, 1000, 100))
        probe = ModelStateProbe(lambda: {"bytes": {"params": next(counts)}, "offloaded_bytes": 0},
                                lambda: {"num_params": 15})
        observer = StepObserver(LossRecord(os.path.join(folder, "loss_by_hand.json"), "by_hand", {"loop": "by hand"}),
                                device=torch.device("cpu"), replicas=Replicas(), replica_check_interval=2,
                                total_steps=3, probe=probe, log=lines.append,
                                parameter_norm=lambda: math.sqrt(sum(float(p.detach().double().square().sum())
                                                                     for p in model.parameters())))
        observer.trackers = trackers
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(3, 2, 5, 4, generator=g), torch.randn(3, 2, 5, 3, generator=g)  # step × rank × rows
        fed = []
        for step in range(3):
            measuring = observer.probe_at(step)
            loss_sum = ((model(x[step, rank]) - y[step, rank]) ** 2).sum()
            loss_sum.backward()
            if measuring is not None:
                measuring("after_backward")
            for p in model.parameters():
                dist.all_reduce(p.grad)
            grads = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            if measuring is not None:
                measuring("after_step")
            moved = None
            if step == 2 and rank == 1:
                with torch.no_grad():
                    before = model.bias[0].item()
                    model.bias[0] += 1e-3
                moved = abs(model.bias[0].double().item() - before)
            sums = [torch.zeros((), dtype=torch.float64) for _ in range(2)]
            dist.all_gather(sums, loss_sum.detach().double())
            sums = [float(s) for s in sums]
            entry = observer.observe_step(step, rank_loss_sums=sums, rank_tokens=[15, 15], gradients=grads, lr=0.1,
                                          step_time_s=0.5 + step, batch_hash=f"batch{step}", tokens=30,
                                          checkpoint=False, note=step)
            fed.append({"loss": sum(sums) / 30, "dp_rank_losses": [s / 15 for s in sums], "moved": moved,
                        "grad_norm": math.sqrt(sum(float(t.double().square().sum()) for t in grads)),
                        "param_norm": math.sqrt(sum(float(p.detach().double().square().sum())
                                                    for p in model.parameters()))})
            if step == 2:
                entry["harness_s"]["record_write"] = observer.write()
        model_state = observer.report_model_state()  # a collective: on every rank, before finish
        observer.finish(lambda: {"model_state": model_state})
        with open(os.path.join(folder, f"fed_{rank}.json"), "w") as f:
            json.dump({"steps": fed, "lines": lines, "tracked": trackers.steps, "finished": trackers.finished}, f)


def test_the_observer_records_and_checks_a_loop_fed_by_hand(tmp_path):
    """parity/training/observer.py without the harness's loop: a hand-written DDP of a torch Linear on two gloo ranks
    feeds it loss sums, gradients and its own batch hashes; the record holds what was fed, the replica check ran at
    its interval and at the end (6 groups: weight and bias, each with two moments), and found rank 1's nudged bias
    parted by the nudge itself."""
    import json

    import torch.multiprocessing as mp

    from conftest import free_port

    mp.spawn(_observed_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    record = json.loads((tmp_path / "loss_by_hand.json").read_text())
    fed = [json.loads((tmp_path / f"fed_{r}.json").read_text()) for r in range(2)]
    assert record["complete"] and record["strategy"] == "by_hand" and record["config"] == {"loop": "by hand"}
    assert record["replicas"] == {"declared": True, "interval": 2, "groups": 6, "tensors_per_rank": [6, 6],
                                  "by_what": {"parameter": 2, "exp_avg": 2, "exp_avg_sq": 2}, "by_ranks": {"0,1": 6}}
    steps = record["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    for k, (s, mine) in enumerate(zip(steps, fed[0]["steps"])):
        assert list(s)[:11] == ["step", "loss", "dp_rank_losses", "grad_norm", "param_norm", "lr", "tokens",
                                "batch_hash", "step_time_s", "peak_memory_bytes", "harness_s"]
        assert (s["loss"], s["dp_rank_losses"], s["param_norm"]) == (mine["loss"], mine["dp_rank_losses"],
                                                                      mine["param_norm"])
        assert abs(s["grad_norm"] - mine["grad_norm"]) <= 1e-12 * mine["grad_norm"]  # float64 norm of the gradients
        assert (s["lr"], s["tokens"], s["batch_hash"], s["step_time_s"], s["note"]) == (0.1, 30, f"batch{k}", 0.5 + k, k)
        assert s["peak_memory_bytes"] > 0 and s["harness_s"]["trackers"] == 0.25
        assert fed[1]["steps"][k]["loss"] == mine["loss"]  # every rank fed the same gathered loss
    assert "replicas" not in steps[0]  # interval 2: after step 1 (2 done), then after the last
    assert sorted(steps[0]["harness_s"]) == ["param_norm", "record", "trackers"]
    assert sorted(steps[2]["harness_s"]) == ["param_norm", "record", "record_write", "replica_check", "trackers"]
    assert steps[1]["replicas"] == {"checked": 6, "parted": 0}
    moved = fed[1]["steps"][2]["moved"]
    assert 0.9e-3 < moved < 1.1e-3
    assert steps[2]["replicas"] == {"checked": 6, "parted": 1, "tensors": [
        {"name": "bias", "what": "parameter", "piece": "", "ranks": [[0], [1]], "max_abs_diff": moved}]}
    assert fed[0]["lines"] == [f"replicas part at step 2: bias differs between rank 0 and rank 1 (max |difference| "
                               f"{moved:.3e}): the verdict will FAIL"]
    assert fed[0]["tracked"] == [0, 1, 2] and fed[0]["finished"]
    state = record["final"]["model_state"]
    assert state["step"] == 2 and state["num_params"] == 15
    assert state["per_rank"]["after_backward"] == [{"bytes": {"params": 100}, "offloaded_bytes": 0}] * 2
    assert state["per_rank"]["after_step"] == [{"bytes": {"params": 200}, "offloaded_bytes": 0}] * 2
    assert [r["point"] for r in state["per_rank"]["peak"]] == ["after_step"] * 2
    assert all(r["samples"] == 2 for r in state["per_rank"]["peak_all"])


# --- the layout: one object (item 2); a record of the previous layout refused (item 5) -----------------------------

def test_layout_rank_coordinates_round_trip_and_its_groups():
    """parity/layout.py at dp 2 × pp 2 × tp 2: every rank's (dp, pp, tp) and back (rank = (dp × pp_size + pp) ×
    tp_size + tp); its TP group, pipeline and DP group; the groups of each kind partition the ranks; a WorkerContext
    reads its coordinates from the layout."""
    import torch

    from parity.layout import Layout
    from parity.training.strategy import WorkerContext

    layout = Layout.from_flags(8, tp_size=2, pp_size=2, pipeline=True)
    assert (layout.world_size, layout.dp_size, layout.pp_size, layout.tp_size) == (8, 2, 2, 2)
    coords = [layout.coords(rank) for rank in range(8)]
    assert sorted(coords) == [(d, p, t) for d in range(2) for p in range(2) for t in range(2)]
    assert [layout.rank(*c) for c in coords] == list(range(8))
    assert coords[5] == (1, 0, 1) and layout.rank(dp=1, pp=1, tp=0) == 6
    assert (layout.tp_group(5), layout.pp_group(5), layout.dp_group(5)) == ([4, 5], [5, 7], [1, 5])
    for groups in (layout.tp_groups(), layout.pp_groups(), layout.dp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))
    ctx = WorkerContext(rank=5, device=torch.device("cpu"), layout=layout)
    assert (ctx.world_size, ctx.dp_rank, ctx.pp_rank, ctx.tp_rank, ctx.dp_size, ctx.pp_size, ctx.tp_size) == (
        8, 1, 0, 1, 2, 2, 2)
    experts = Layout.from_flags(4, tp_size=1, ep_size=2)
    assert experts.ep_group(3) == [2, 3] and experts.expert_mesh_shape == (2, 2) and experts.mesh_shape == (4, 1)


@pytest.mark.parametrize("flags,line", [
    ({"num_workers": 3, "tp_size": 2}, "--num_workers 3 is not a multiple of --tp_size 2: num_workers must equal "
                                       "tp_size × dp_size"),
    ({"num_workers": 4, "dp_size": 3, "pp_size": 2, "pipeline": True},
     "--pp_size 2 × --dp_size 3 ≠ --num_workers 4: pass --num_workers 6 or --dp_size 2"),
])
def test_a_bad_layout_is_one_line(flags, line):
    from parity.errors import ConfigError
    from parity.layout import Layout

    with pytest.raises(ConfigError) as raised:
        Layout.from_flags(**flags)
    assert str(raised.value) == line


def test_pp_size_is_a_layout_field_taken_only_with_pipeline_stages(tmp_path, capsys):
    """--pp_size is a layout flag: a pipeline's run carries it as cfg.pp_size (its layout's), not among its options;
    a strategy without pipeline stages refuses it in one line, as before (its parser, and resolve)."""
    from parity.commands.train import main
    from parity.errors import ConfigError

    pipeline = _resolve(tmp_path, "pipeline", num_layers=2)
    assert (pipeline.pp_size, pipeline.dp_size, pipeline.layout.pp_size) == (2, 1, 2)
    assert "pp_size" not in pipeline.options and pipeline.to_dict()["pp_size"] == 2
    assert _resolve(tmp_path, "ddp").pp_size == 1
    with pytest.raises(ConfigError) as raised:
        _resolve(tmp_path, "ddp", pp_size=2)
    assert str(raised.value) == "--pp_size is not a flag of train_ddp.py: see its --help"
    with pytest.raises(SystemExit) as exited:
        main("ddp", argv=["--pp_size", "2"])
    assert exited.value.code == 2 and capsys.readouterr().err == "error: unrecognized arguments: --pp_size 2 (see --help)\n"


def test_a_record_of_the_previous_schema_is_refused_in_one_line(tmp_path, capsys):
    """A loss record of schema 6 (one global grad norm per step, no tensor's series) beside this harness's records:
    the comparison refuses it in one line naming both schema versions (exit 2), before comparing anything."""
    import json

    from parity.commands.compare_curves import main
    from parity.training.record import SCHEMA_VERSION
    from test_compare import DDP_LOSS, hand_example, write_record

    assert SCHEMA_VERSION == 7
    hand_example(tmp_path)
    path = write_record(tmp_path, "pipeline", DDP_LOSS)
    with open(path) as f:
        data = json.load(f)
    data["schema_version"] = 6
    with open(path, "w") as f:
        json.dump(data, f)
    code = main(["--input_dir", str(tmp_path), "--output", str(tmp_path / "c.png")])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("error: loss_pipeline.json: schema version 6, this harness reads 7 (") and \
        err.endswith("and every tensor's norms per step too): rerun that strategy, or record the run again\n")
    assert err.count("\n") == 1


def test_the_final_parameter_bound_grows_with_the_steps_lrs_never_below_its_setting():
    from parity.comparing.tolerances import FINAL_PARAMETERS_ATOL_FP32, final_parameters_atol_fp32

    assert abs(final_parameters_atol_fp32([1e-4] * 12) - FINAL_PARAMETERS_ATOL_FP32) < 1e-12  # its own setting
    assert final_parameters_atol_fp32([3e-4] * 3) == FINAL_PARAMETERS_ATOL_FP32  # a shorter run keeps it
    assert abs(final_parameters_atol_fp32([3e-4] * 6) - 1.5 * FINAL_PARAMETERS_ATOL_FP32) < 1e-12  # test_families'
    assert FINAL_PARAMETERS_ATOL_FP32 <= 2e-5  # 20 × below what a missed clip moves them by (4e-4)
