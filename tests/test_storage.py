"""parity.storage: local paths and the URIs Ray Train accepts, opened as Ray Train opens them; writes that
are whole or absent; the user's umask; the check of a URI before any worker runs. Then one real Ray Train
run over both stores — an S3-compatible server on this machine (moto's ThreadedMotoServer, the `test` extra) and a
local filesystem URI (file://) — that writes every output there and reads it back: on the S3 server the initial
weights (written by rank 0, read by every rank), the loss record, TensorBoard's event files (--report_to: uploaded
from rank 0's node to an object store), and plot_loss_curves.py's figure and reports from the records it reads there;
on the file:// URI Ray Train's checkpoints and the final model."""

import json
import logging
import os
import posixpath

import pytest

from conftest import PARITY, assert_fp32_parity, checkpoint_loss, train
from parity import storage
from parity.errors import ConfigError
from tracker_readers import as_float32, tensorboard, tensorboard_series, tensorboard_text

BUCKET = "parity"


@pytest.fixture(scope="module")
def s3_endpoint():
    """An S3-compatible server on 127.0.0.1 (any credentials: conftest sets dummy ones), with one bucket."""
    import pyarrow.fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    pyarrow.fs.S3FileSystem(endpoint_override=endpoint, region="us-east-1",
                            allow_bucket_creation=True).create_dir(BUCKET)
    yield endpoint
    server.stop()


def s3_uri(endpoint: str, path: str, bucket: str = BUCKET) -> str:
    return f"s3://{bucket}/{path}?endpoint_override={endpoint}&region=us-east-1"


def store_location(kind: str, endpoint: str, tmp_path) -> str:
    return f"file://{tmp_path}" if kind == "file" else s3_uri(endpoint, tmp_path.name)


def all_files(location: str) -> list[str]:
    """Every file under `location`, as paths relative to it."""
    import pyarrow.fs

    fs, root = storage.filesystem(location)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True, allow_not_found=True))
    return sorted(posixpath.relpath(i.path, root) for i in infos if i.type == pyarrow.fs.FileType.File)


def test_locations_open_as_ray_train_opens_them(s3_endpoint, tmp_path):
    from ray.train.v2._internal.execution.storage import get_fs_and_path

    for location in (str(tmp_path), f"file://{tmp_path}", s3_uri(s3_endpoint, "runs/a"),
                     "s3://bucket/runs/a?region=us-east-1", "gs://bucket/runs/a"):
        fs, path = storage.filesystem(location)
        ray_fs, ray_path = get_fs_and_path(location)
        assert (type(fs), path) == (type(ray_fs), ray_path) and fs.equals(ray_fs), location
    assert storage.local_path(f"file://{tmp_path}/x") == f"{tmp_path}/x"
    assert storage.local_path(s3_uri(s3_endpoint, "x")) is None


def test_a_uri_is_joined_on_its_path_before_its_query_string():
    uri = "s3://bucket/run?endpoint_override=http://127.0.0.1:9000&region=us-east-1"
    record = storage.join(uri, "loss_curves", "loss_ddp.json")
    assert record == "s3://bucket/run/loss_curves/loss_ddp.json?endpoint_override=http://127.0.0.1:9000&region=us-east-1"
    assert storage.name(record) == "loss_ddp.json"
    assert storage.parent(record) == "s3://bucket/run/loss_curves?endpoint_override=http://127.0.0.1:9000&region=us-east-1"
    assert storage.filesystem(record)[1] == "bucket/run/loss_curves/loss_ddp.json"
    assert storage.join("s3://bucket", "a.json") == "s3://bucket/a.json"
    assert storage.join("/tmp/run", "a.json") == "/tmp/run/a.json" and storage.name("/tmp/run/a.json") == "a.json"


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_writes_are_whole_or_absent(kind, s3_endpoint, tmp_path):
    """Serialized before anything is written: a value that cannot be written leaves the old file as it was,
    and no temporary file or key behind."""
    folder = store_location(kind, s3_endpoint, tmp_path)
    record = storage.join(folder, "loss_ddp.json")
    storage.write_json_atomic(record, {"steps": [1, 2]})
    with pytest.raises(TypeError):
        storage.write_json_atomic(record, {"steps": [1, 2, object()]})
    assert json.loads(storage.read_text(record)) == {"steps": [1, 2]}
    storage.write_json_atomic(record, {"steps": [1, 2, 3]})
    assert json.loads(storage.read_text(record)) == {"steps": [1, 2, 3]}
    assert all_files(folder) == ["loss_ddp.json"]
    assert storage.list_files(folder, "loss_*.json") == [record]


def test_a_failed_local_rename_leaves_no_temporary_file(tmp_path):
    (tmp_path / "taken").mkdir()  # a directory where the file should go: os.replace fails
    with pytest.raises(IsADirectoryError):
        storage.write_bytes_atomic(str(tmp_path / "taken"), b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"] and not any((tmp_path / "taken").iterdir())


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)])
def test_written_files_and_folders_get_the_users_umask(tmp_path, umask, file_mode, dir_mode):
    """0o022 is the usual default: files 0644, folders 0755 (not mkstemp's 0600 and mkdtemp's 0700)."""
    old = os.umask(umask)
    try:
        storage.write_bytes_atomic(str(tmp_path / "new" / "record.json"), b"{}")
        with storage.directory_writer(str(tmp_path / "final_model")) as staging:
            with open(os.path.join(staging, "config.json"), "w") as f:
                f.write("{}")
    finally:
        os.umask(old)
    modes = {p: os.stat(tmp_path / p).st_mode & 0o777
             for p in ("new", "new/record.json", "final_model", "final_model/config.json", "final_model/_COMPLETE")}
    assert modes == {"new": dir_mode, "new/record.json": file_mode, "final_model": dir_mode,
                     "final_model/config.json": file_mode, "final_model/_COMPLETE": file_mode}


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_directory_replaces_the_old_one_with_its_marker_last(kind, s3_endpoint, tmp_path):
    folder = storage.join(store_location(kind, s3_endpoint, tmp_path), "final_model")
    for files in ({"config.json": b"1", "old.bin": b"2"}, {"config.json": b"3", "model.safetensors": b"4"}):
        with storage.directory_writer(folder) as staging:
            for name, data in files.items():
                with open(os.path.join(staging, name), "wb") as f:
                    f.write(data)
    assert all_files(folder) == ["_COMPLETE", "config.json", "model.safetensors"]
    assert storage.read_bytes(storage.join(folder, "config.json")) == b"3"


def test_uris_are_checked_before_any_worker(s3_endpoint, tmp_path, tiny_weights, monkeypatch):
    missing = s3_uri(s3_endpoint, "run", bucket="no-such-bucket")
    with pytest.raises(ConfigError) as bucket:
        storage.check_writable_dir("--storage_path", missing)
    assert str(bucket.value) == (f"--storage_path {missing} is not a writable directory (Bucket 'no-such-bucket' "
                                 f"not found. To create buckets, enable the allow_bucket_creation option.): "
                                 f"choose a directory or a store you can write to")
    with pytest.raises(ConfigError) as scheme:
        storage.check_writable_dir("--loss_output_dir", "nosuch://bucket/run")
    assert str(scheme.value) == ("--loss_output_dir nosuch://bucket/run cannot be opened (Unrecognized filesystem "
                                 "type in URI: nosuch://bucket/run): use a local path or a URI that Ray Train "
                                 "accepts (s3://, gs://, abfs://, hdfs:// or file://)")
    # A URI stays a URI (the seed wrote a local folder named "s3:"), and the check leaves nothing behind.
    from parity.driver.cluster import Cluster
    from parity.driver.config import resolve

    monkeypatch.chdir(tmp_path)
    run = s3_uri(s3_endpoint, f"{tmp_path.name}/ray")
    cfg = resolve("ddp", {"model_name": "qwen2-tiny", "seq_length": 64, "init_weights_path": tiny_weights,
                          "storage_path": run, "loss_output_dir": storage.join(run, "loss")},
                  cluster=Cluster(cpus=2, gpus=0))
    assert (cfg.storage_path, cfg.final_checkpoint_dir) == (run, storage.join(run, "ddp_tp1_dp2", "final_model"))
    assert list(tmp_path.iterdir()) == [] and all_files(run) == []


@pytest.fixture(scope="module")
def store_run(ray_cluster, s3_endpoint, tmp_path_factory):
    """FSDP TP=2 × DP=1 (global batch 4, as the DDP baseline) with every path on a store, both kinds in one run: the
    initial weights (rank 0 writes them there, --save_init_weights, every rank loads them from there) and the loss
    folder (reported to TensorBoard) on the S3 server, Ray Train's checkpoints and the final model on a file:// URI.
    Returns ({what: its store}, the record)."""
    stores = {"s3": store_location("s3", s3_endpoint, tmp_path_factory.mktemp("store_s3")),
              "file": store_location("file", s3_endpoint, tmp_path_factory.mktemp("store_file"))}
    record = train("fsdp", tmp_path_factory.mktemp("unused"), num_workers=2, tp_size=2, batch_size=4,
                   precision="fp32", save_init_weights=True,
                   init_weights_path=storage.join(stores["s3"], "shared_weights", "init_weights.pt"),
                   loss_output_dir=storage.join(stores["s3"], "loss_curves"),
                   storage_path=storage.join(stores["file"], "ray_checkpoints"), report_to="tensorboard", **PARITY)
    return stores, record


def test_a_run_writes_and_reads_every_output_on_the_store(store_run, ddp_baseline, tmp_path):
    from pyarrow.fs import copy_files

    from parity.commands.compare_curves import main as plot_loss_curves
    from parity.models.model import read_init_weights

    stores, record = store_run
    store = stores["s3"]
    loss_dir, checkpoint = storage.join(store, "loss_curves"), storage.join(stores["file"], "ray_checkpoints",
                                                                            "fsdp_tp2_dp1", "final_model")
    assert (record["config"]["loss_output_dir"], record["final"]["checkpoint_dir"]) == (loss_dir, checkpoint)
    assert checkpoint.startswith("file://") and loss_dir.startswith("s3://")
    # The weights rank 0 wrote are the seed's (the baseline's file), and the run trained from them.
    assert read_init_weights(storage.join(store, "shared_weights", "init_weights.pt"))[2] == \
        record["config"]["init_weights_sha256"] == ddp_baseline["config"]["init_weights_sha256"]
    assert_fp32_parity(record, ddp_baseline)  # the final parameters read from the store's checkpoint
    assert all_files(checkpoint) == ["_COMPLETE", "config.json", "generation_config.json", "model.safetensors"]
    (tmp_path / "final_model").mkdir()
    copy_files(checkpoint, str(tmp_path / "final_model"))
    local = {**record, "final": {**record["final"], "checkpoint_dir": str(tmp_path / "final_model")}}
    assert checkpoint_loss(local) == pytest.approx(record["final"]["eval_loss_last_batch"], rel=1e-5)

    # The DDP job's record and its tensor series, as that job writes them into the same folder; then the comparison,
    # read and written there.
    storage.write_json_atomic(storage.join(loss_dir, "loss_ddp.json"), ddp_baseline)
    chunks = ddp_baseline["tensors"]["chunks"]
    for chunk in chunks:
        storage.write_bytes_atomic(storage.join(loss_dir, "loss_ddp.tensors", chunk), storage.read_bytes(
            storage.join(ddp_baseline["config"]["loss_output_dir"], "loss_ddp.tensors", chunk)))
    assert plot_loss_curves(["--input_dir", loss_dir, "--output", storage.join(loss_dir, "loss_curves.png")]) == 0
    events = [f for f in all_files(loss_dir) if f.startswith("tensorboard/")]
    assert [f for f in all_files(loss_dir) if f not in events] == [
        "curve_comparison.json", "curve_report.md", "logs/fsdp_tp2_dp1.log", "loss_curves.png", "loss_ddp.json",
        *(f"loss_ddp.tensors/{c}" for c in chunks), "loss_fsdp.json",
        *(f"loss_fsdp.tensors/{c}" for c in record["tensors"]["chunks"]), "report.html"]
    assert record["tensors"]["chunks"] == chunks == ["chunk_0000000.json", "chunk_0000004.json", "chunk_0000008.json"]
    assert 'href="loss_fsdp.json"' in storage.read_text(storage.join(loss_dir, "report.html"))  # the page, on the store
    # TensorBoard's run: the training's events and the comparison's, in the run's folder on the store
    log_dir = record["trackers"]["tensorboard"]["log_dir"]
    assert len(events) == 2 and {posixpath.dirname(f) for f in events} == {
        f"tensorboard/fsdp_tp2_dp1/{storage.name(log_dir)}"}
    (tmp_path / "tensorboard").mkdir()
    copy_files(log_dir, str(tmp_path / "tensorboard"))
    read = tensorboard({"trackers": {"tensorboard": {"log_dir": str(tmp_path / "tensorboard")}}})
    assert tensorboard_series(read, "loss") == list(zip(range(12), as_float32(s["loss"] for s in record["steps"])))
    assert "| comparison/verdict | `PASS` |" in tensorboard_text(read, "comparison/summary")[0][1]
    assert storage.read_bytes(storage.join(loss_dir, "loss_curves.png"))[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(storage.read_text(storage.join(loss_dir, "curve_comparison.json")))
    assert (summary["verdict"], summary["runs"]["fsdp"]["file"], summary["figure"]) == (
        "PASS", "loss_fsdp.json", "loss_curves.png")
    tensors = summary["against_baseline"]["fsdp"]["tensors"]  # every tensor's series read from the store
    assert tensors["taken"] and tensors["first_outside"] is None and tensors["steps"] == 12
    assert storage.read_text(storage.join(loss_dir, "curve_report.md")).startswith("# Loss curve comparison")
    assert not [f for location in stores.values() for f in all_files(location) if f.endswith(".tmp")]


def test_the_layer_check_keeps_its_folder_on_this_machine(capsys):
    from parity.commands.layer_check import main as run_verification

    assert run_verification(["--output_dir", "s3://bucket/verify?region=us-east-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --output_dir s3://bucket/verify?region=us-east-1: the layer check's folder is a folder of this "
        "machine (its dumps are read back here, tensor by tensor): use a local path or a shared mount"]


def test_the_record_is_rewritten_as_json_dumps_writes_it_each_entry_encoded_once(tmp_path):
    """LossRecord.write: the text of write_json_atomic (json.dumps at indent 1, non-finite floats spelled) byte for byte,
    at every rewrite of a growing record — also where the last entry changed after a write (a step's states land in it
    so) — while an older entry's JSON is made once: the encoder no longer reads the whole record at every write."""
    import json
    import math

    from parity.training.record import LossRecord

    record = LossRecord(str(tmp_path / "loss_x.json"), "x", {"note": "a\nb", "nan": math.nan})
    assert record.text() == json.dumps(storage.json_safe(record.data), indent=1, allow_nan=False) + "\n"
    encoded = []
    real = json.dumps

    def counted(value, **kw):
        encoded.append(value)
        return real(value, **kw)

    for step in range(12):
        record.data["steps"].append({"step": step, "loss": math.nan if step == 3 else 1.0 / (step + 1),
                                     "tensors": [step, {"inf": math.inf}], "empty": {}, "none": []})
        encoded.clear()
        json.dumps = counted
        try:
            text = record.text()
        finally:
            json.dumps = real
        assert text == json.dumps(storage.json_safe(record.data), indent=1, allow_nan=False) + "\n", step
        assert sum(isinstance(v, dict) and "step" in v for v in encoded) == min(step + 1, 2), step  # the last two
        if step % 4 == 3:  # after its write, as the step's states land in its entry: the next write holds them
            record.data["steps"][-1]["harness_s"] = {"states": 0.5}
    record.write()
    assert (tmp_path / "loss_x.json").read_text() == json.dumps(storage.json_safe(record.data), indent=1,
                                                                allow_nan=False) + "\n" != text  # step 11's change
    assert json.loads((tmp_path / "loss_x.json").read_text())["steps"][11]["harness_s"] == {
        "states": 0.5}
