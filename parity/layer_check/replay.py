"""Replaying one step of a training run layer by layer, from the DDP baseline's own state (the layer check's
--replay): a divergence the loss curves first see at step k is traced to a module and a phase at step k.

Driver:
[1] the newest intact checkpoint of the baseline's run at or before step k — or, when there is none, the
    run's initial weights at step 0;
[2] the layer-check folder gets that state as its shared weights (init_weights.safetensors, full tensors
    under Hugging Face names), AdamW's moments (optimizer_state.safetensors), the global batch of step k as
    its inputs, and replay.json naming the start.
Worker, every strategy:
[3] loads those weights like any initial weights, and the moments into its own optimizer in its own sharded
    form (Strategy.set_optimizer_state);
[4] trains the steps from the checkpoint up to k with the shared train step (none when the checkpoint is at
    k: then every strategy starts from exactly the baseline's state); the layer check then records step k.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import asdict, dataclass

from parity import registry
from parity.errors import ConfigError
from parity.storage import atomic_path, write_json_atomic
from parity.training.checkpoints import DIR_PREFIX, META_FILE, damage

REPLAY_FILE = "replay.json"
OPTIMIZER_FILE = "optimizer_state.safetensors"
# The baseline's settings the replay keeps: the model, the data and the optimizer, as it trained.
KEPT = ("model_name", "num_layers", "seq_length", "precision", "reduce_dtype", "grad_accum_dtype", "learning_rate",
        "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "warmup_steps", "max_grad_norm", "seed", "dataset",
        "num_samples", "tokenizer", "packing", "padding_free")


@dataclass(frozen=True)
class ReplayStart:
    run: str  # the baseline's run folder, <storage_path>/<experiment_name>
    checkpoint: str | None  # the checkpoint started from; None: the run's initial weights
    from_step: int  # the steps that checkpoint holds (0 for the initial weights)
    step: int  # the step recorded
    config: dict  # the baseline's resolved RunConfig

    def describe(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "config"}

    @property
    def global_batch_size(self) -> int:
        return self.config["batch_size"] * self.config["dp_size"]


def find_start(path: str, step: int) -> ReplayStart:
    """[1] `path` is a DDP run folder or one checkpoint in it. ConfigError if nothing there can start a replay."""
    path = os.path.abspath(path)
    single = os.path.isfile(os.path.join(path, META_FILE))
    run = os.path.dirname(path) if single else path
    folders = [path] if single else sorted(glob.glob(os.path.join(run, DIR_PREFIX + "*")), reverse=True)
    metas = [(folder, meta) for folder in folders if (meta := _meta(folder))]
    if not metas:
        raise ConfigError(f"--replay {path}: no checkpoint of a training run there (a run folder is "
                          f"<storage_path>/<experiment_name>): train the baseline with --checkpoint_interval")
    config = metas[0][1]["config"]
    if config["strategy"] != "ddp":
        raise ConfigError(f"--replay {path} holds {config['strategy']} checkpoints: a replay starts from the DDP "
                          f"baseline's")
    total = config["debug_steps"]
    if step < 0 or (total is not None and step >= total):
        raise ConfigError(f"--step {step} is not a step of {run} (0 to {(total or 1) - 1})")
    for folder, meta in metas:
        if meta["step"] > step:
            continue
        problem = damage(folder, meta["world_size"], range(meta["world_size"]))
        if problem is None:
            return ReplayStart(run, folder, meta["step"], step, config)
        print(f"{folder} is damaged ({problem}): not replaying from it")
    if single:
        raise ConfigError(f"--replay {path} cannot start step {step}: it is damaged or after the step; give its "
                          f"run folder {run} to start from another checkpoint")
    return ReplayStart(run, None, 0, step, config)


def _meta(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, META_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_folder(start: ReplayStart, out: str, weights_path: str, inputs_path: str, batches) -> None:
    """[2] The layer-check folder's weights, moments, inputs and replay.json, on the driver. A LoRA run's state is
    its PEFT model's: the base goes into the weights under stock names, the adapters (and saved modules' copies) into
    the adapters' file beside them, as a LoRA run's --save_init_weights writes them, and the moments are theirs."""
    from safetensors.torch import save_file

    from parity.layer_check.inputs import write_inputs
    from parity.models.adapters import adapters_path, add_adapters, load_adapters, save_run_weights
    from parity.models.model import build_model, load_init_weights, model_config_from_dict

    lora = start.config.get("lora")
    model = build_model(model_config_from_dict(start.config["model_config"]), start.config["seed"])
    if start.checkpoint is None:
        load_init_weights(model, start.config["init_weights_path"])
        model = add_adapters(model, lora)
        if lora is not None:
            load_adapters(model, adapters_path(start.config["init_weights_path"]), lora)
    else:
        model = add_adapters(model, lora)
        baseline = registry.load(start.config["strategy_path"])  # DDP's class (checked above), by the run's own path
        weights, moments, count = baseline.read_full_state(start.checkpoint, model.config, lora)
        model.load_state_dict(weights)
        tensors = {f"{key}/{name}": m[key].contiguous() for name, m in moments.items() for key in m}
        with atomic_path(os.path.join(out, OPTIMIZER_FILE)) as tmp:
            save_file(tensors, tmp, metadata={"step": str(count)})
    save_run_weights(model, lora, weights_path)
    write_inputs(batches, start.config["seed"], inputs_path, step=start.step)
    write_json_atomic(os.path.join(out, REPLAY_FILE), start.describe())


def check_folder(start: ReplayStart | None, out: str) -> None:
    """A layer-check folder that already has its weights and inputs must have them from this start (a replay's,
    or None: the initial weights at step 0): dumps from two starts do not compare."""
    try:
        with open(os.path.join(out, REPLAY_FILE)) as f:
            held = json.load(f)
    except FileNotFoundError:
        held = None
    except (OSError, ValueError):
        held = "unreadable"
    wanted = start.describe() if start else None
    if held != wanted:
        has = f"the replay of step {held['step']} from {held['checkpoint'] or 'the initial weights'}" \
            if isinstance(held, dict) else "a start that cannot be read" if held else "a step from initial weights"
        wants = f"this replay of step {start.step}" if start else "a step from initial weights"
        raise ConfigError(f"{out} holds {has}, not {wants}: use a fresh --output_dir")


def advance(worker, replay: dict, output_dir: str) -> int:
    """[3]–[4] on a worker set up from the folder's weights; returns the step to record."""
    from safetensors import safe_open

    from parity.training.data import dp_slice
    from parity.training.strategy import lr_at

    cfg, ctx, strategy = worker.cfg, worker.ctx, worker.strategy
    start, step, batches = replay["from_step"], replay["step"], replay["batches"]
    if start:
        moments: dict = {}
        with safe_open(os.path.join(output_dir, OPTIMIZER_FILE), framework="pt") as f:
            count = int(f.metadata()["step"])
            for key in f.keys():
                kind, name = key.split("/", 1)
                moments.setdefault(name, {})[kind] = f.get_tensor(key)
        strategy.set_optimizer_state(moments, count)
    for s in range(start, step):
        global_batch = batches(s)
        strategy.train_step(dp_slice(global_batch, ctx.dp_rank, cfg.batch_size), global_batch.divisor, lr_at(s, cfg))
    where = replay["checkpoint"] or "the initial weights"
    worker.log(f"replay: from {where} (step {start}), {step - start} steps trained, recording step {step}")
    return step
