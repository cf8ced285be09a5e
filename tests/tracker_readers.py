"""What the experiment trackers show of a run, read back with their own readers: MLflow's client, TensorBoard's event
accumulator, and for W&B offline the run's transaction log (wandb 0.31 writes no config.yaml or wandb-summary.json
offline: `wandb sync` uploads run-<id>.wandb, records of wandb's own protobuf messages)."""

from __future__ import annotations

import glob
import json
import os
import struct

import numpy as np


def mlflow_run(record: dict):
    """(client, run) of the MLflow run the record names."""
    from mlflow import MlflowClient

    state = record["trackers"]["mlflow"]
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    return client, client.get_run(state["run_id"])


def mlflow_series(record: dict, key: str) -> list[tuple[int, float]]:
    """Every point of a metric the MLflow run holds, as (step, value), in step order."""
    client, run = mlflow_run(record)
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def tensorboard(record: dict):
    """TensorBoard's event accumulator over the run's folder, everything kept (as `tensorboard --logdir` reads it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(record["trackers"]["tensorboard"]["log_dir"],
                                   size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def tensorboard_series(accumulator, key: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in accumulator.Scalars(key)]


def tensorboard_text(accumulator, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in accumulator.Tensors(f"{tag}/text_summary")]


def as_float32(values) -> list[float]:
    """What TensorBoard keeps of a float: its float32 rounding."""
    return [float(np.float32(v)) for v in values]


def wandb_directories(record: dict) -> list[str]:
    """The offline run's directories, oldest first (a resumed or compared run has one per process that wrote it)."""
    state = record["trackers"]["wandb"]
    return sorted(glob.glob(os.path.join(state["dir"], "wandb", f"offline-run-*-{state['id']}")))


def wandb_records(directory: str):
    """The records of an offline run's transaction log, as wandb's own protobuf messages. The log is LevelDB's log
    format after a 7-byte W&B header: 32 KiB blocks of chunks, each a 7-byte header (crc32c, length, type: full,
    first, middle, last) and its bytes."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(directory, "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zeros to the block's end
            pos += (block - pos % block) % block
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_run(record: dict) -> dict:
    """What W&B's offline directories of the run hold, merged in the order they were written: its group and name,
    its config and summary (key → value), its history (step → {key: value}), its artifacts (type, name, paths)."""
    out = {"group": None, "name": None, "config": {}, "summary": {}, "history": {}, "directories": 0, "artifacts": []}
    for directory in wandb_directories(record):
        out["directories"] += 1
        for r in wandb_records(directory):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                out["group"] = out["group"] or r.run.run_group
                out["name"] = out["name"] or r.run.display_name
                out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
            elif kind == "config":
                out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
            elif kind == "summary":
                out["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in r.summary.update})
            elif kind == "artifact":
                out["artifacts"].append((r.artifact.type, r.artifact.name,
                                         sorted(c.path for c in r.artifact.manifest.contents)))
            elif kind == "history":
                out["history"][r.history.step.num] = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                                      for i in r.history.item}
    return out
