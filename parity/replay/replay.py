"""The replay of a recorded run (parity/recording/recorder.py) under the harness's DDP: `train_ddp.py
--replay_record OUT/loss_<name>.json --num_workers N --loss_output_dir OUT --storage_path CK` trains the trusted loop on
what the record supplies and writes OUT/loss_ddp.json, the baseline plot_loss_curves.py judges the recorded run
against (docs/own_trainer.md).

The record supplies the model (its config.json) and the initial weights, the data (each step's saved global batch,
whatever its shape, its rows split over the N workers by parity.training.data.row_plan), the optimizer (type and
parameter groups by name: build_optimizer with RunConfig.optimizer), the lr of each step (RunConfig.lr_schedule) and the
betas where a scheduler moved them (RunConfig.betas_schedule), the precision, the step count (up to where the record
stopped, if it did) and which gradient every tensor's series holds (RunConfig.tensor_grad: where the recorded
framework's hooks came after its clipping, the clipped ones). It names them relative to its own folder, which may have
moved since. Beside it only --num_workers, --device, the output and checkpoint flags and --noise_reference may be given
(with --noise_reference also --precision: the fp32 twin, which reduces and accumulates in its own policy's dtypes, not
the record's); anything else contradicts the record and is refused in one line. A LoRA run's record (config.lora: a
PeftModel recorded, parity/views/adapters.py) sets the replay's --lora_* flags, so that its worker builds the same PEFT
model from the recorded base and the adapters' initial weights beside it, and trains the adapters alone. The harness
feeds no attention mask where every row is right-padded (a causal model's right padding needs none: labels −100 on it)
and the recorded mask where a row is left-padded (its real tokens sit at shifted positions); a mask with holes is
refused. A step whose rows came with position ids of their own (packed or padding-free) is fed as the run fed it — each
row alone, its position ids, its mask or none, its cache or none (parity/training/fed_rows.py) — and its rows go round
the workers at document boundaries; the model computes attention with the run's implementation (refused where it cannot
run here: flash attention off CUDA). The states the recorder saved at the run's checkpoints go with the batches
(recorded_states): once trained, the replay — not its noise references — takes the teacher-forced check from each
(parity/training/recorded_states.py). Everything is checked on the driver, before any worker starts.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping

from parity import storage
from parity.driver.config import resolve
from parity.errors import ConfigError, RecordError
from parity.precision import POLICIES, POLICY_FIELDS
from parity.replay.objective_replay import objective_data
from parity.recording.optimizer_description import recorded_betas, unreplayable
from parity.recording.rows import padding_problem
from parity.run_config import REPLAY_ONLY, REPLAY_TAKES
from parity.training.data import RECORDED, ROLLOUTS, RecordedBatches, RecordedRollouts, recorded_batch_path
from parity.training.fed_rows import units
from parity.training.optimizer import StepLr
from parity.training.recorded_states import INDEX as STATES_INDEX, RecordedStates, StateCheck
from parity.training.record import is_recorded, load_record
from parity.training.tensor_norms import PRE_CLIP
from parity.training.tensor_series import KEY as TENSORS

# The flags a replay takes beside --replay_record: where it runs and where its outputs go.
ALLOWED = ("num_workers", "device", "loss_output_dir", "storage_path", "experiment_name", "final_checkpoint_dir",
           "log_interval", "replica_check_interval", "verbose", "report_to", "checkpoint_interval",
           "keep_checkpoints", "resume", "max_failures", "noise_reference")


def plan_replay(record_file: str, given: Mapping[str, Any], cluster=None, strategy: str = "ddp",
                dump_step: int | None = None, flags: Mapping[str, Any] | None = None):
    """(RunConfig, RecordedBatches) of the replay of `record_file` under `strategy` (a trusted loop: one whose class
    replays records; `flags`, what makes it the replay: replay_choice.REPLAYS) with the flags the user `given` (only
    those given); `dump_step`, the step to record fully instead of training. ConfigError, one line, for anything that
    cannot be replayed."""
    record = read_recorded(record_file)
    config = record["config"]
    given = {k: v for k, v in given.items() if v is not None}
    allowed = set(ALLOWED) | ({"precision"} if given.get("noise_reference") else set())
    extra = sorted(set(given) - allowed)
    if extra:
        raise ConfigError(f"--{extra[0]} contradicts --replay_record: the record supplies the model, weights, data, "
                          f"optimizer, lr, micro-batches, precision and steps; beside it give only --num_workers, "
                          f"--device, the output and checkpoint flags and --noise_reference")
    optimizer = replayable_optimizer(record_file, config["optimizer"])  # set below: not a flag
    steps = len(record["steps"])
    if dump_step is not None and not 0 <= dump_step < steps:
        raise ConfigError(f"--dump_step {dump_step} is not a step of {storage.name(record_file)} (0 to {steps - 1})")
    folder, model_folder, weights = (recorded_path(record_file, named) for named in
                                     (config["batches"]["folder"], config["model_name"], config["init_weights_path"]))
    rows = [int(s["rows"]) for s in record["steps"]]
    workers = int(given.get("num_workers", config["dp_size"]))
    if config.get("objective") is not None:  # a post-training objective's: its rollout file (objective_replay.py)
        data = objective_data(record_file, config, steps, workers, dump_step)
    else:
        data = _recorded_data(record_file, config, folder, rows, workers)
    _check_model(record_file, model_folder)
    _check_router_split(record_file, config, model_folder, rows, workers)
    _check_weights(record_file, weights, model_folder)
    lora = _recorded_adapters(record_file, weights, config.get("lora"))  # a LoRA run's: {} for any other
    lrs = tuple(float(s["lr"]) for s in record["steps"])
    taken = {k: config[k] for k in REPLAY_TAKES if k not in REPLAY_ONLY}
    if given.get("precision", taken["precision"]) != taken["precision"]:  # the fp32 twin: in its own policy's dtypes
        taken.update({k: None for k in POLICY_FIELDS if k in taken and k != "precision"})
    taken.pop("loss_scaling")  # fp16's: the record's scaler, which the replay follows (below)
    values = {"model_name": model_folder, "init_weights_path": weights, "num_workers": workers, **data,
              "debug_steps": steps, "learning_rate": max(lrs) if max(lrs) > 0 else 1.0, **taken,
              "checkpoint_interval": 0, **lora, **(flags or {}), **given}
    cfg = resolve(strategy, values, cluster=cluster)
    if POLICIES[taken["precision"]].loss_scaling:
        cfg = _followed_scaler(record_file, record, cfg)
    attention = config.get("attn_implementation")  # the run's (a record from before it was kept: the default)
    model_config = {**cfg.model_config, **({"attn_implementation": attention} if attention else {})}
    if attention:
        _check_attention(record_file, model_config, cfg.device)
    cfg = dataclasses.replace(cfg, optimizer=optimizer, lr_schedule=lrs, betas_schedule=recorded_betas(record),
                              clip_value=_clip_value(record_file, config, cfg),
                              tensor_grad=record.get(TENSORS, {}).get("grad") or PRE_CLIP, model_config=model_config)
    _check_groups(record_file, cfg)
    stopped = f", stopped before step {steps}" if config.get("stopped") else ""
    states = None if given.get("noise_reference") or dump_step is not None else recorded_states(record_file, record)
    if cfg.objective is not None:
        return cfg, RecordedRollouts(cfg.dataset[len(ROLLOUTS):], cfg.objective, steps, f"the rollouts of "
                                     f"{storage.name(record_file)} ({steps} steps of {rows[0]} rows{stopped})", states)
    return cfg, RecordedBatches(folder, steps, f"the global batches of {storage.name(record_file)} ({steps} steps of "
                                               f"{min(rows)}–{max(rows)} rows{stopped})",
                                workers, max(1, config["batches"]["most_rows"]), states)


def _recorded_data(record_file: str, config: dict, folder: str, rows: list[int], workers: int) -> dict:
    """The replay's data flags for a record of the causal LM: its saved batches (checked), split over `workers`."""
    length, fed = check_batches(record_file, folder, len(rows), workers, config["batches"].get("position_ids_from"))
    plain = [n for step, n in enumerate(rows) if step not in fed]  # fed rows go round at document boundaries
    if plain and workers > min(plain):
        fewest = min(plain)
        raise ConfigError(f"--num_workers {workers}: step {rows.index(fewest)} of {storage.name(record_file)} holds "
                          f"{fewest} row{'s' if fewest > 1 else ''}, fewer than {workers} workers: use at most "
                          f"{fewest} worker{'s' if fewest > 1 else ''}")
    return {"batch_size": -(-max(rows) // workers), "grad_accum_steps": 1, "seq_length": max(length, 2),
            "dataset": RECORDED + folder}


def recorded_path(record_file: str, named: str) -> str:
    """Where a file or folder the record names (relative to the record's own folder) is now."""
    return storage.join(storage.parent(storage.absolute(record_file)), named)


def recorded_states(record_file: str, record: dict) -> RecordedStates:
    """The checks the replay takes from the states the recorder saved (parity/recording/states.py): each step whose
    states before and after are both saved and which the record holds, its files found relative to the record's folder
    (where it has moved), its pre-clip norm, its lr — declared where the framework declares one, else applied; with its
    betas where a scheduler moved them (a StepLr) — and its batch's hash; where there is none, why. ConfigError, one
    line, for an index that names a file that is not there."""
    name, config, steps = record["strategy"], record["config"], record["steps"]
    index_file = recorded_path(record_file, f"{config['model_name']}/{STATES_INDEX}")
    if not storage.exists(index_file):
        return RecordedStates(record_file, name, None, (), "the recorder saved no states (recorded with "
                                                           "checkpoint_interval=None, or by a recorder before them)")
    try:
        index = json.loads(storage.read_text(index_file))
        wanted = sorted(k for k in index["checks"] if k < len(steps))
        saved = {k: [index["states"][str(u)] for u in (k, k + 1)] for k in wanted}
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--replay_record {storage.name(record_file)}: its states' index {index_file} cannot be read "
                          f"({type(exc).__name__}): copy the record's whole folder or record again") from None
    checks, betas = [], recorded_betas(record)
    for k in wanted:
        files = [recorded_path(record_file, s["file"]) for s in saved[k]]
        for step, path in zip((k, k + 1), files):
            if not storage.exists(path):
                raise ConfigError(f"--replay_record {storage.name(record_file)}: its state after {step} updates {path} "
                                  f"is missing: copy the record's whole folder (recorded_*/ beside it) or record again")
        entry = steps[k]
        lr = entry["declared_lr"] if entry.get("declared_lr") is not None else entry["lr"]
        lr = StepLr(lr, betas[k]) if betas else lr  # the step's betas too, where a scheduler moved them
        checks.append(StateCheck(k, *files, (saved[k][0]["step_count"], saved[k][1]["step_count"]), entry["grad_norm"],
                                 lr, entry["batch_hash"], entry.get("grad_norm_source"), entry.get("loss_scale"),
                                 bool(entry.get("skipped"))))
    stopped = index.get("stopped")
    none = None if checks else (f"no state was saved: {stopped['why']}" if stopped else
                                "no step's states before and after were both saved")
    return RecordedStates(record_file, name, index["interval"], tuple(checks), none)


def read_recorded(record_file: str) -> dict:
    """The record, checked as every record is (load_record), then as a recorder's that can be replayed."""
    name = storage.name(record_file)
    try:
        record = load_record(record_file)
    except RecordError as exc:
        raise ConfigError(f"--replay_record: {exc}") from None
    config = record["config"]
    if not is_recorded(config):
        raise ConfigError(f"--replay_record {name}: not a record of parity's recorder (a harness run's record is "
                          f"compared with plot_loss_curves.py, not replayed)")
    if not config.get("hugging_face_model"):
        raise ConfigError(f"--replay_record {name}: the recorded model is not a Hugging Face model (no config to "
                          f"build it from): the harness trains Hugging Face causal LMs only")
    batches = config["batches"]
    if batches["saved_steps"] < len(record["steps"]):
        raise ConfigError(f"--replay_record {name}: its batches are missing (saved {batches['saved_steps']} of "
                          f"{len(record['steps'])} steps): record again with the batches saved")
    scaled = config["precision"] in POLICIES and POLICIES[config["precision"]].loss_scaling
    if scaled and not (config.get("loss_scaling") and all("loss_scale" in s for s in record["steps"])):
        raise ConfigError(f"--replay_record {name}: an fp16 run is replayed where its recorder records its loss "
                          f"scaler (each step's scale and whether it was skipped: megatron-core's, GradScaler's), and "
                          f"this one's does not: record it again with this release's recorder, or in bf16 or fp32")
    return record


def _clip_value(record_file: str, config: dict, cfg) -> float | None:
    """The record's clip by value (clip_grad_value_: RunConfig.clip_value), which the replay's clip applies
    (optimizer.clip_gradients), where its strategy clips through it (Strategy.clips_as_torch: DeepSpeed's engine clips
    by norm inside its own step)."""
    from parity.registry import load

    value = config.get("clip_value")
    if value and not load(cfg.strategy_path).clips_as_torch:
        raise ConfigError(f"--replay_record {storage.name(record_file)}: the run clips by value (clip_value "
                          f"{value:g}), which the {cfg.strategy} replay's step does not (it clips by norm in a step of "
                          f"its own): replay it under DDP or FSDP2 (--replay_strategy ddp or fsdp)")
    return value or None


def _followed_scaler(record_file: str, record: dict, cfg):
    """The replay of an fp16 record: the record's loss scaler followed step by step (RunConfig.loss_scales: each step's
    scale and skip, loss_scaler.FollowedScaler), its settings the record's (its policy's; the verdict judges the
    record's scales by their `rules`); its fp32 twin skips the steps the record skipped, at scale 1, so that its
    distance is the policy's rounding alone, where the replay's strategy follows one (Strategy.follows_loss_scales:
    DeepSpeed's engine scales and skips by itself)."""
    from parity.registry import load

    if not load(cfg.strategy_path).follows_loss_scales:
        raise ConfigError(f"--replay_record {storage.name(record_file)}: an fp16 run, whose replay follows its loss "
                          f"scaler's scales and skipped steps, which the {cfg.strategy} replay's step decides itself: "
                          f"replay it under DDP or FSDP2 (--replay_strategy ddp or fsdp)")
    scaled = POLICIES[cfg.precision].loss_scaling  # the record's policy, not its fp32 twin's
    steps = tuple((float(s["loss_scale"]) if scaled else 1.0, bool(s.get("skipped"))) for s in record["steps"])
    return dataclasses.replace(cfg, loss_scales=steps, **({"loss_scaling": record["config"]["loss_scaling"]}
                                                          if scaled else {}))


def replayable_optimizer(record_file: str, optimizer: dict) -> dict:
    """The recorded optimizer if the harness can build it (AdamW or Adam, without amsgrad and the like)."""
    why = unreplayable(optimizer, recorded=True)
    if why:
        raise ConfigError(f"--replay_record {storage.name(record_file)}: {why}")
    return optimizer


def check_batches(record_file: str, folder: str, steps: int, workers: int,
                  positions_from: int | None = None) -> tuple[int, set[int]]:
    """Every step's saved batch is there, readable and padded as the replay feeds it (each row's mask one run of ones,
    labels −100 where it is 0); a step whose rows came with position ids of their own goes round `workers` at
    document boundaries (fed_rows.units), and holds them (`positions_from`: the first such step, whose batch a recorder
    before they were kept saved without them). Returns the longest row and the steps of fed rows."""
    from safetensors.torch import load

    name, longest, fed = storage.name(record_file), 0, set()
    for step in range(steps):
        path = recorded_batch_path(folder, step)
        try:
            tensors = load(storage.read_bytes(path))
            mask, labels = tensors["attention_mask"], tensors["labels"]
        except FileNotFoundError:
            raise ConfigError(f"--replay_record {name}: step {step}'s batch {path} is missing: copy the record's "
                              f"whole folder (recorded_*/ beside it) or record again") from None
        except Exception as exc:
            raise ConfigError(f"--replay_record {name}: step {step}'s batch {path} cannot be read "
                              f"({type(exc).__name__}): record again") from None
        problem = padding_problem(mask, labels, f"step {step}")
        if problem:
            raise ConfigError(f"--replay_record {name}: {problem}")
        if step == positions_from and "fed" not in tensors:
            raise ConfigError(f"--replay_record {name}: step {step} fed position ids of its own, which its batch does "
                              f"not hold (recorded before the recorder kept them): record the run again")
        if "fed" in tensors:
            fed.add(step)
            try:
                units(tensors["input_ids"], labels, mask, tensors["position_ids"], tensors["fed"], workers,
                      f"step {step}")
            except ValueError as exc:
                raise ConfigError(f"--replay_record {name}: --num_workers {workers}: {exc}") from None
        longest = max(longest, mask.shape[1])
    return longest, fed


def _check_attention(record_file: str, model_config: dict, device: str) -> None:
    """The run's attention implementation (config._attn_implementation, in `model_config`) runs here: flash attention
    needs a CUDA device, and every implementation what transformers' own check asks of the recorded model (its package,
    the model's support: built on the meta device)."""
    from parity.models.model import meta_model, model_config_from_dict

    attention, why = model_config["attn_implementation"], None
    if attention.startswith("flash_attention") and device != "cuda":
        why = f"it needs a CUDA device, and the replay runs on {device}"
    else:
        try:
            meta_model(model_config_from_dict(model_config))
        except (ImportError, ValueError) as exc:
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    if why:
        raise ConfigError(f"--replay_record {storage.name(record_file)}: the run computed attention with {attention}, "
                          f"which the replay cannot run here ({why}): replay it where it runs, or record the run "
                          f"with attn_implementation='sdpa'")


def _check_model(record_file: str, folder: str) -> None:
    """The harness can build the recorded model (a decoder-only causal LM transformers knows)."""
    from transformers import AutoConfig

    from parity.models.families import multimodal_refusal
    from parity.models.model import resolve_model_config

    try:
        multimodal = multimodal_refusal(AutoConfig.from_pretrained(folder))
    except (ValueError, KeyError, OSError):  # resolve_model_config names what is wrong with it
        multimodal = None
    if multimodal:
        raise ConfigError(f"--replay_record {storage.name(record_file)}: {multimodal}")
    try:
        resolve_model_config(folder)
    except ConfigError as exc:
        why = re.sub(r"^--model_name \S+: ", "", str(exc))  # the folder is the record's own: named once, above
        raise ConfigError(f"--replay_record {storage.name(record_file)}: the recorded model cannot be built by the "
                          f"harness: {why}") from None


def _check_router_split(record_file: str, config: dict, folder: str, rows: list[int], workers: int) -> None:
    """A record whose router losses are each micro-batch's own (megatron-core's: parity/training/routing.py) replays
    its micro-batches as they were: every micro-batch of the replay's split (row_plan) one of the record's, whole."""
    from parity.models.model import resolve_model_config
    from parity.training.data import row_plan
    from parity.training.routing import MEGATRON_CORE

    if getattr(resolve_model_config(folder), "router_aux_loss_scope", None) != MEGATRON_CORE:
        return
    most = max(1, config["batches"]["most_rows"])

    def keeps(count: int) -> bool:
        return all(n % count == 0 and {m for part in row_plan(n, count, most) for m in part} == {most} for n in rows)

    if not keeps(workers):
        fits = [w for w in range(1, min(rows) + 1) if keeps(w)]
        raise ConfigError(f"--num_workers {workers}: {storage.name(record_file)}'s router losses are each recorded "
                          f"micro-batch's own (megatron-core's, of {most} rows each), which {workers} workers would "
                          f"split otherwise: use {', '.join(map(str, fits)) or 'the recorded DP size'} workers")


def _check_weights(record_file: str, path: str, folder: str) -> None:
    """The record's initial weights are the recorded model's (the harness's own check, in the replay's words: the
    flags its hint names are the record's)."""
    from parity.models.model import check_init_weights, resolve_model_config

    try:
        check_init_weights(path, resolve_model_config(folder))
    except ConfigError as exc:
        why = str(exc).replace(f"init weights file {path} ", "").split(": ")[0]
        raise ConfigError(f"--replay_record {storage.name(record_file)}: its initial weights {path} are not the "
                          f"recorded model's ({why}): record the run again") from None


def _recorded_adapters(record_file: str, weights: str, lora: dict | None) -> dict:
    """A LoRA run's adapters as the flags that build them (adapters.lora_flags: its settings, RunConfig.lora), once
    their initial weights beside the record's are found to be those adapters' (the file
    adapters.adapters_path names); {} for a run without adapters."""
    from parity.models.adapters import check_adapters, lora_flags

    if not lora:
        return {}
    try:
        check_adapters(weights, lora)
    except ConfigError as exc:
        raise ConfigError(f"--replay_record {storage.name(record_file)}: {str(exc).split(': ')[0]}: copy the record's "
                          f"whole folder (recorded_*/ beside it) or record the run again") from None
    return lora_flags(lora)


def _check_groups(record_file: str, cfg) -> None:
    """The recorded groups name the parameters the replay trains, each once (build_optimizer on the model's meta copy:
    with a LoRA run's adapters, whose base is frozen)."""
    import torch

    from parity.models.adapters import add_adapters
    from parity.models.model import meta_model, model_config_from_dict
    from parity.training.optimizer import build_optimizer

    model = add_adapters(meta_model(model_config_from_dict(cfg.model_config)), cfg.lora)
    named = [(n, torch.nn.Parameter(torch.empty(0))) for n, p in model.named_parameters() if p.requires_grad]
    try:
        build_optimizer([p for _, p in named], cfg, [n for n, _ in named])
    except ValueError as exc:
        raise ConfigError(f"--replay_record {storage.name(record_file)}: {exc}") from None
