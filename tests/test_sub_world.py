"""Runs of several world sizes in one worker group (parity/training/sub_world.py): a run of fewer workers than the
group trains on its first ranks, in a process group of its own, while the others wait; the whole group is formed again
after it. The main job, the shared runs and the replays use it (their Ray Train path, with its checkpoint reports, is
tests/test_main_script.py's: DDP at 2 workers checkpointing in the TP runs' group of 4, killed and resumed).

One local group of 2 ranks trains DDP at 1 worker, at 2, and at 1 again; one group of 1 the same run alone: the runs
at 1 worker are the lone run bit for bit, and the run at 2 is theirs to fp32 parity. A run that stops every rank (a
loss that is not finite) stops the whole group on its line, the waiting rank too, and the next run never starts. A
local group's rank 0, whose process serves the group's store, leaves last, and no rank leaves a group formed again
before every rank has formed it."""

from __future__ import annotations

import pytest

from conftest import FP32_RTOL, max_rel_diff, series
from parity.errors import TrainingFailed

SETTING = {"model_name": "qwen2-tiny", "seq_length": 64, "debug_steps": 4, "log_interval": 4, "checkpoint_interval": 0,
           "precision": "fp32", "learning_rate": 1e-3}
ONE, TWO = {"num_workers": 1, "batch_size": 4}, {"num_workers": 2, "batch_size": 2}


def _run(root, tiny_weights, name, layout, **values):
    from parity.driver.local_group import plan

    return plan("ddp", {**SETTING, **layout, **values, "init_weights_path": tiny_weights, "experiment_name": name,
                        "loss_output_dir": root / name, "storage_path": root / "ray"})


@pytest.fixture(scope="module")
def records(tmp_path_factory, tiny_weights):
    from parity.driver.local_group import run_group

    root = tmp_path_factory.mktemp("sub_world")
    mixed = run_group([_run(root, tiny_weights, name, layout) for name, layout in
                       (("one_first", ONE), ("two", TWO), ("one_again", ONE))])
    (alone,) = run_group([_run(root, tiny_weights, "alone", ONE)])
    return dict(zip(("one_first", "two", "one_again"), mixed), alone=alone)


def test_a_run_of_fewer_workers_is_the_same_run_alone(records):
    alone = records["alone"]
    for name in ("one_first", "one_again"):
        assert records[name]["config"]["num_workers"] == 1
        for key in ("loss", "grad_norm", "param_norm"):
            assert series(records[name], key) == series(alone, key), (name, key)  # bit for bit
    for key in ("loss", "grad_norm", "param_norm"):  # the whole group's run between them: DP 2, the same batches
        assert max_rel_diff(series(records["two"], key), series(alone, key)) < FP32_RTOL, key
    assert records["two"]["config"]["num_workers"] == 2 and len(records["two"]["steps"]) == 4


def test_a_run_that_stops_stops_the_group_and_the_waiting_rank(tmp_path, tiny_weights):
    from parity.driver.local_group import run_group

    runs = [_run(tmp_path, tiny_weights, "diverges", ONE, learning_rate=1e30), _run(tmp_path, tiny_weights, "next", TWO)]
    with pytest.raises(TrainingFailed) as failed:
        run_group(runs)
    assert "loss is" in str(failed.value) and "at step" in str(failed.value), failed.value
    assert (tmp_path / "diverges" / "loss_ddp.json").exists() and not (tmp_path / "next").exists()


def _reads_the_store_late(group: dict) -> dict:
    """A rank's work in which rank 1 still uses the group's store — served from rank 0's process — a second after rank
    0 is done, as a rank forming the whole group again after a run of fewer ranks does."""
    import time

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set("parity_test/word", "late")
    else:
        time.sleep(1.0)
        assert store.get("parity_test/word") == b"late"
    return {}


def test_rank_0_leaves_the_group_last(tmp_path, tiny_weights):
    """A local group's rank 0 waits for every rank before its process — the store's server — exits: a rank still using
    the store after rank 0 finished its work (once in 12 groups of a 2-rank then a 1-rank run before, "Connection reset
    by peer" re-forming the group) reads it."""
    from parity.driver.local_group import launch_local

    cfg, _ = _run(tmp_path, tiny_weights, "late", TWO)
    launch_local([cfg], [{}], worker=_reads_the_store_late)


def test_the_group_formed_again_is_formed_on_every_rank_before_any_goes_on(tmp_path, tiny_weights):
    """Rank 1 forms the group again a second late: rank 0 goes on only once it has. A rank that went on and left at once
    (the group formed again after a last run of fewer ranks) closed the connection its peer was still setting up
    ("Connection closed by peer", twice in 5 suites' megatron-core replays)."""
    from parity.driver.local_group import launch_local

    cfg, _ = _run(tmp_path, tiny_weights, "slow", TWO)
    launch_local([cfg], [{}], worker=_forms_the_group_again_late)


def _forms_the_group_again_late(group: dict) -> dict:
    """A run of 1 worker in a group of 2, rank 1's init of the group formed again after it a second slower than it is;
    rank 0 asserts, once its own is formed, that rank 1's is."""
    import time

    import torch.distributed as dist

    from parity.training.sub_world import ranks_for

    store, init = dist.distributed_c10d._get_default_store(), dist.init_process_group

    def late(*args, **kwargs):
        init(*args, **kwargs)
        time.sleep(1.0)
        store.set("parity_test/formed_1", "1")

    if dist.get_rank() == 1:
        dist.init_process_group = late  # the waiting rank inits only the group formed again
    with ranks_for(1):
        pass
    if dist.get_rank() == 0:
        assert store.check(["parity_test/formed_1"]), "rank 0 went on before rank 1 had formed the group again"
    return {}
