"""The loss record `loss_<strategy>.json`: schema, atomic rewrite during the run, load + validate.

Rank 0 rewrites the whole file every --log_interval steps, atomically (parity.storage: on a local folder or
a URI), so a crash leaves the steps done so far and `"complete": false`; a reader never sees half a file.
"""

from __future__ import annotations

import json

from parity import storage
from parity.errors import RecordError
from parity.training.tensor_series import KEY as TENSORS, kept_chunks

SCHEMA_VERSION = 7  # 2: every step has param_norm; 3: the config has the fingerprint; 4: the replica check;
# 5: pp_size a layout field (not an option), the strategy's class path; 6: a recorder's record takes each step's batch
# shape as it comes (its rows and micro-batches per step), names its files relative to itself and may stop early;
# 7: every trainable tensor's gradient and parameter norm at every step, in chunks beside it (tensor_series.py)
STEP_FIELDS = ("step", "loss", "dp_rank_losses", "grad_norm", "param_norm", "lr", "tokens", "batch_hash", "step_time_s",
               "peak_memory_bytes")  # and harness_s: the harness's own seconds in the step, by what (not checked);
# and on a step the replicas were checked after, "replicas": what the check found (parity.training.replicas)
# and a mixture of experts' steps aux_loss and expert_loads (parity.training.routing): the load-balancing loss of the
# global batch (null where the family has none in its loss) and, per sparse layer, the real tokens routed to each
# expert
# The config entries a comparison of two records relies on (parity/comparing/curves.py); the loop always writes them.
CONFIG_FIELDS = ("tp_size", "dp_size", "precision", "total_steps", "init_weights_sha256", "model_config",
                 "max_grad_norm", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "fingerprint")


_STEPS = "\x00steps\x00"  # where the steps' list goes in LossRecord.text's head
REFERENCE_GLOB = "noise_reference_*.json"
RECORDER_SOURCE = "recorder"  # config.source of a record that parity's recorder wrote (your own trainer's run)


def is_recorded(config: dict) -> bool:
    """A record's config is the recorder's (parity/recording/recorder.py), not the harness loop's."""
    return config.get("source") == RECORDER_SOURCE


def record_path(output_dir: str, strategy: str) -> str:
    return storage.join(output_dir, f"loss_{strategy}.json")


def run_record_path(cfg) -> str:
    """Where a run writes its record: loss_<strategy>.json, or for a noise reference (a twin of the baseline: at
    another layout, in fp32 at its own, or at its own under other CPU kernels: `noise_kernels`; in another arithmetic:
    `perturb`) noise_reference_<strategy>_tp<T>_dp<D>_<precision>[_<kernels>][_perturbed].json."""
    if cfg.noise_reference:
        kernels = f"_{cfg.noise_kernels}" if getattr(cfg, "noise_kernels", None) else ""
        kernels += "_perturbed" if getattr(cfg, "perturb", None) else ""
        name = f"noise_reference_{cfg.strategy}_tp{cfg.tp_size}_dp{cfg.dp_size}_{cfg.precision}{kernels}.json"
        return storage.join(cfg.loss_output_dir, name)
    return record_path(cfg.loss_output_dir, cfg.strategy)


class LossRecord:
    def __init__(self, path: str, strategy: str, config: dict):
        self.path = path
        self.data = {"schema_version": SCHEMA_VERSION, "strategy": strategy, "complete": False,
                     "config": config, "replicas": {"declared": False}, "steps": [], "resumes": []}
        self._texts: dict[int, tuple[dict, str]] = {}  # id(step entry) → (the entry, its JSON as the file holds it)

    @property
    def steps(self) -> list[dict]:
        return self.data["steps"]

    def progress(self) -> dict:
        """What a checkpoint keeps of the record: the steps so far, the resumes that led to them, and the tracker runs
        the steps went to (--report_to: a resumed run continues them)."""
        return {"steps": self.steps, "resumes": self.data["resumes"], "trackers": self.data.get("trackers", {}),
                "tensor_chunks": self.data.get(TENSORS, {}).get("chunks", [])}

    def resume(self, progress: dict, checkpoint: str, skipped: list[str]) -> None:
        """Continue the record a checkpoint kept, noting where from and which damaged checkpoints were passed over."""
        self.data["steps"] = list(progress["steps"])
        self.data["resumes"] = [*progress["resumes"], {"checkpoint": checkpoint, "step": len(progress["steps"]),
                                                       "skipped": skipped}]
        if progress.get("trackers"):
            self.data["trackers"] = dict(progress["trackers"])
        if self.data.get(TENSORS, {}).get("names"):  # the chunks of the steps kept (tensor_series.py)
            self.data[TENSORS]["chunks"] = kept_chunks(progress.get("tensor_chunks", []), len(progress["steps"]))

    def declare_replicas(self, summary: dict) -> None:
        """What the strategy declared as replicas (ReplicaCheck.summary): how many groups, of what, over which ranks."""
        self.data["replicas"] = summary

    def append(self, **step) -> None:
        missing = set(STEP_FIELDS) - set(step)
        assert not missing, f"step entry lacks {sorted(missing)}"
        self.steps.append(step)

    def write(self) -> None:
        storage.write_text_atomic(self.path, self.text())

    def text(self) -> str:
        """The file: storage.write_json_atomic's text of the record, byte for byte, each step entry's JSON made once
        (the last two again at every write: the step's states and checks land in its entry after it is written). The
        record is rewritten every log_interval steps; whole, the pure-Python encoder at indent 1 took longer with
        every step: 3.7 ms a write at step 100 and 42 ms at step 1000 on one core, 0.5 and 2.7 ms so (the recorder's
        costliest part of a long run's step: docs/benchmark.md)."""
        steps = self.data["steps"]
        head = json.dumps(storage.json_safe({**self.data, "steps": _STEPS}), indent=1, allow_nan=False)
        kept, texts = {}, []
        for i, entry in enumerate(steps):
            made = self._texts.get(id(entry))
            if made is None or made[0] is not entry or i >= len(steps) - 2:
                made = (entry, json.dumps(storage.json_safe(entry), indent=1, allow_nan=False).replace("\n", "\n  "))
            kept[id(entry)] = made
            texts.append(made[1])
        self._texts = kept
        body = "[\n  " + ",\n  ".join(texts) + "\n ]" if texts else "[]"
        return head.replace(json.dumps(_STEPS), body, 1) + "\n"

    def finish(self, **final) -> None:
        self.data["final"] = final
        self.data["complete"] = True
        self.write()


def load_record(path: str) -> dict:
    """Read and check a loss record; RecordError names the file and the first thing wrong with it."""
    name = storage.name(path)
    try:
        data = json.loads(storage.read_text(path))
    except json.JSONDecodeError as exc:
        raise RecordError(f"{name}: not valid JSON ({exc.msg}: line {exc.lineno}, column {exc.colno}); "
                          f"the file is malformed or truncated: rerun that strategy") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(f"{name}: cannot be read ({storage.reason(exc)})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{name}: expected a JSON object with 'strategy', 'config' and 'steps'")
    for key, kind in (("strategy", str), ("config", dict), ("steps", list)):
        if not isinstance(data.get(key), kind):
            raise RecordError(f"{name}: missing or invalid '{key}' (expected {kind.__name__}); "
                              f"not a loss record written by this harness")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise RecordError(f"{name}: schema version {data.get('schema_version')}, this harness reads "
                          f"{SCHEMA_VERSION} (it records the parameter norm, the run's fingerprint, the replica check, "
                          f"pp_size among the layout's fields, the strategy's class path, a recorded run's batch "
                          f"shape per step and every tensor's norms per step too): rerun that strategy, or record the "
                          f"run again")
    if not isinstance(data.get("complete"), bool):
        raise RecordError(f"{name}: missing or invalid 'complete' (expected true or false)")
    missing = [k for k in CONFIG_FIELDS if k not in data["config"]]
    if missing:
        raise RecordError(f"{name}: config lacks {', '.join(missing)}; not a loss record written by this harness")
    if not isinstance(data["config"]["model_config"], dict):
        raise RecordError(f"{name}: config.model_config is not an object")
    if not data["steps"]:
        stopped = data["config"].get("stopped")
        if stopped:  # a recorder that would not record even its first step says why (parity/recording/recorder.py)
            raise RecordError(f"{name}: has no steps: its recorder refused step {stopped['step']}: {stopped['why']}")
        raise RecordError(f"{name}: has no steps; the run stopped before its first step: rerun it")
    for i, step in enumerate(data["steps"]):
        if not isinstance(step, dict):
            raise RecordError(f"{name}: steps[{i}] is not an object")
        missing = [k for k in STEP_FIELDS if k not in step]
        if missing:
            raise RecordError(f"{name}: steps[{i}] lacks {', '.join(missing)}")
        if step["step"] != i:
            raise RecordError(f"{name}: steps[{i}] is numbered {step['step']}; steps must be 0, 1, 2, ...")
        for k in ("loss", "grad_norm", "param_norm", "lr"):
            step[k] = storage.NON_FINITE.get(step[k], step[k]) if isinstance(step[k], str) else step[k]
            if isinstance(step[k], bool) or not isinstance(step[k], (int, float)):
                raise RecordError(f"{name}: steps[{i}].{k} is not a number")
        if not isinstance(step["tokens"], int):
            raise RecordError(f"{name}: steps[{i}].tokens is not an integer")
        if not isinstance(step["batch_hash"], str):
            raise RecordError(f"{name}: steps[{i}].batch_hash is not a string")
        found = step.get("replicas")
        if found is not None and not (isinstance(found, dict) and isinstance(found.get("checked"), int)
                                      and isinstance(found.get("parted"), int)):
            raise RecordError(f"{name}: steps[{i}].replicas is not a replica check's entry ('checked' and 'parted' "
                              f"counts)")
        if "expert_loads" in step and not (isinstance(step["expert_loads"], list) and all(
                isinstance(row, list) and all(isinstance(n, int) for n in row) for row in step["expert_loads"])):
            raise RecordError(f"{name}: steps[{i}].expert_loads is not a list of per-layer expert counts")
        if step.get("aux_loss") is not None:
            value = step["aux_loss"]
            step["aux_loss"] = storage.NON_FINITE.get(value, value) if isinstance(value, str) else value
            if isinstance(step["aux_loss"], bool) or not isinstance(step["aux_loss"], (int, float)):
                raise RecordError(f"{name}: steps[{i}].aux_loss is not a number")
    return data
