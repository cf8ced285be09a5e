"""Multi-node: train_ddp.py joined to a Ray cluster of two nodes (RAY_ADDRESS; ray.cluster_utils.Cluster,
two nodes on this machine) runs one worker on each node and trains exactly as the single-node DDP baseline
does; and a run whose outputs are local paths other nodes need not see stops before training, with one line.
"""

import contextlib
import json
import os
import subprocess
import sys

import pytest

from conftest import PARITY, REPO, TINY, max_rel_diff, series, to_argv
from parity.training.record import load_record


@contextlib.contextmanager
def two_node_cluster():
    """{"address", "nodes"} of a two-node cluster run by tests/two_nodes.py in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "two_nodes.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        yield json.loads(proc.stdout.readline())
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


def train_ddp(argv: list[str], **env_vars) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "train_ddp.py"), *argv], capture_output=True, text=True,
                          env={**os.environ, **env_vars}, timeout=900)


def test_two_nodes_train_as_one_and_local_paths_are_refused(ddp_baseline, tiny_weights, tmp_path):
    flags = {**TINY, **PARITY, "num_workers": 2, "batch_size": 2, "precision": "fp32", "init_weights_path": tiny_weights,
             "loss_output_dir": tmp_path / "loss", "storage_path": tmp_path / "ray"}
    with two_node_cluster() as cluster:
        refused = train_ddp(to_argv(flags), RAY_ADDRESS=cluster["address"])
        # Both nodes are on this machine, so these folders really are shared: say so, as a user would.
        shared = os.pathsep.join([str(tmp_path), os.path.dirname(tiny_weights)])
        ran = train_ddp(to_argv(flags), RAY_ADDRESS=cluster["address"], PARITY_SHARED_PATHS=shared)

    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: --loss_output_dir {tmp_path}/loss is a local path, and this run's workers may run on other nodes "
        f"than this driver (the Ray cluster has 2 nodes): use a URI (s3://, gs://, …), a mount every node shares "
        f"(/mnt/cluster_storage, /mnt/user_storage, /mnt/shared_storage), or name a folder every node shares in "
        f"PARITY_SHARED_PATHS")
    assert ran.returncode == 0, ran.stderr[-3000:]
    record = load_record(str(tmp_path / "loss" / "loss_ddp.json"))
    assert sorted(record["config"]["worker_nodes"]) == cluster["nodes"]  # rank 0 on one node, rank 1 on the other
    assert ddp_baseline["config"]["worker_nodes"][0] == ddp_baseline["config"]["worker_nodes"][1]
    for key in ("batch_hash", "tokens", "lr"):
        assert series(record, key) == series(ddp_baseline, key)
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(record, key), series(ddp_baseline, key)) < 1e-6, key


def local_flags(tmp_path, weights, **over) -> dict:
    return {"model_name": "qwen2-tiny", "seq_length": 64, "init_weights_path": weights,
            "loss_output_dir": tmp_path / "loss", "storage_path": tmp_path / "ray", **over}


def test_what_every_node_sees(tmp_path, monkeypatch):
    from parity.storage import visible_to_every_node

    monkeypatch.setenv("PARITY_SHARED_PATHS", os.pathsep.join([str(tmp_path / "nfs"), "/data/shared/"]))
    seen = {path: visible_to_every_node(path) for path in (
        "s3://bucket/run?region=us-east-1", "gs://bucket/run", "/mnt/user_storage/parity", "/mnt/cluster_storage",
        str(tmp_path / "nfs" / "run"), "/data/shared/run", "/data/shared_not", str(tmp_path / "run"),
        f"file://{tmp_path}/nfs/run", f"file://{tmp_path}/run", "/mnt/user_storage_copy")}
    assert [path for path, visible in seen.items() if not visible] == [
        "/data/shared_not", str(tmp_path / "run"), f"file://{tmp_path}/run", "/mnt/user_storage_copy"]


def test_gpus_still_to_come_on_a_joined_cluster(tmp_path, tiny_weights, capsys, monkeypatch):
    """--device cuda on a cluster that was joined and has no GPU yet (an autoscaler adds the GPU nodes): the
    run is resolved for CUDA and waits, with a note; its workers will be on nodes other than the driver's,
    so its paths must be ones they see. On a cluster started here, no GPU is to come: one line, exit 2."""
    from parity.errors import ConfigError
    from parity.driver.cluster import Cluster
    from parity.driver.config import resolve

    head_only = Cluster(cpus=8, gpus=0, nodes=1, joined=True)
    with pytest.raises(ConfigError, match=r"--loss_output_dir .* is a local path, and this run's workers may run on "
                                          r"other nodes than this driver \(its GPUs are on nodes still to come\)"):
        resolve("ddp", local_flags(tmp_path, tiny_weights, device="cuda"), cluster=head_only)
    monkeypatch.setenv("PARITY_SHARED_PATHS", os.pathsep.join([str(tmp_path), os.path.dirname(tiny_weights)]))
    cfg = resolve("ddp", local_flags(tmp_path, tiny_weights, device="cuda"), cluster=head_only)
    assert (cfg.device, cfg.precision, cfg.cpus_per_worker) == ("cuda", "bf16", 1.0)
    assert capsys.readouterr().err.splitlines()[-1] == (
        "note: --device cuda: the Ray cluster has 0 of the 2 GPUs this run needs now; the run waits until its "
        "autoscaler adds them")
    with pytest.raises(ConfigError, match=r"^--device cuda needs 2 GPUs \(one per worker\), the Ray cluster has 0: "):
        resolve("ddp", local_flags(tmp_path, tiny_weights, device="cuda"), cluster=Cluster(cpus=8, gpus=0))
    auto = resolve("ddp", local_flags(tmp_path, tiny_weights), cluster=head_only)  # auto decides from what is up
    assert (auto.device, auto.precision) == ("cpu", "fp32")
