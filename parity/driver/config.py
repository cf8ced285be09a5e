"""The run configuration: flags → one complete, frozen `RunConfig`, made in one place (`resolve`).

The flag names are the seed scripts' (`--num_workers --tp_size --dp_size --batch_size ...`): users
already type them. `resolve` checks everything that can be checked on the driver and raises
`ConfigError` with one line naming the problem and the fix, before any worker (or Ray) starts. The entry
scripts, the main job and the layer check all call it; nothing completes a config anywhere else.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from types import SimpleNamespace
from typing import Any, Mapping

from parity import storage
from parity.errors import ConfigError
from parity.layout import DEFAULT_PP_SIZE, STAGE_FLAGS, Layout, given_pp_size
from parity.models.presets import PRESETS, TINY_PRESETS
from parity.precision import DTYPES, POLICIES, complete_policy, resolve_policy
from parity.run_config import RunConfig

PRECISIONS = ("auto", *POLICIES)  # --precision's choices: the policies, or auto (the device decides)
DTYPE_NAMES = tuple(DTYPES)


def _policies(where) -> str:
    """The policies `where(policy)` holds for, in words (for help texts derived from the table)."""
    return " and ".join(name for name, policy in POLICIES.items() if where(policy))


DEVICES = ("auto", "cpu", "cuda")
PATH_FLAGS = ("loss_output_dir", "storage_path", "init_weights_path", "final_checkpoint_dir")

# Each flag: (group, name, default, argparse keywords). The default is what a run gets when not told.
FLAGS = (
    ("strategy", "strategy_class", None,
     {"help": "module:Class — train with your own Strategy subclass (parity.training.strategy.Strategy) instead of "
              "this script's; it must be importable where the driver and the workers run (installed, or on "
              "PYTHONPATH), and its `name` names the loss record"}),
    ("model", "model_name", "Qwen/Qwen2.5-0.5B",
     {"help": "a built-in model (" + ", ".join(name for name in PRESETS if name not in TINY_PRESETS) + "; tiny CPU "
              "presets " + ", ".join(TINY_PRESETS) + "), a local directory with the config.json of any decoder-only "
              "causal LM transformers knows, or a hub name when the hub is reachable (docs/model_families.md)"}),
    ("model", "num_layers", None, {"type": int, "help": "override num_hidden_layers"}),
    ("layout", "num_workers", 2, {"type": int, "help": "Ray Train workers = pp_size × tp_size × dp_size"}),
    ("layout", "tp_size", 1, {"type": int, "help": "tensor-parallel degree"}),
    ("layout", "dp_size", None, {"type": int, "help": "data-parallel degree (default num_workers / (pp_size × tp_size))"}),
    ("layout", "pp_size", DEFAULT_PP_SIZE,
     {"type": int, "help": "pipeline ranks per model replica, each holding its stages (num_workers = pp_size × "
                           "dp_size; rank = dp_rank × pp_size + pp_rank): a flag of the strategies with pipeline "
                           "stages only (train_pipeline.py)"}),
    ("layout", "ep_size", 1,
     {"type": int, "help": "expert-parallel degree of a mixture-of-experts model: each expert on ep_size fewer ranks, "
                           "tokens sent to their experts' ranks; EP groups are ep_size consecutive ranks (whole TP "
                           "groups), so it divides dp_size × tp_size and tp_size divides it (docs/moe.md)"}),
    ("layout", "device", "auto",
     {"choices": DEVICES, "help": "auto: one GPU per worker when the cluster has them, else CPU workers over gloo"}),
    ("training", "batch_size", 2, {"type": int, "help": "samples per data-parallel rank per step"}),
    ("training", "seq_length", 1024, {"type": int}),
    ("training", "grad_accum_steps", 1,
     {"type": int, "help": "split each DP rank's batch into N micro-batches, gradients accumulated over them (each "
                           "strategy its own way); --batch_size must be a multiple of N"}),
    ("training", "num_epochs", 1, {"type": int}),
    ("training", "debug_steps", None, {"type": int, "help": "stop after this many steps (overrides epochs)"}),
    ("training", "learning_rate", None, {"type": float, "help": "AdamW lr (default: the preset's)"}),
    ("training", "weight_decay", 0.0, {"type": float}),
    ("training", "adam_beta1", 0.9, {"type": float}),
    ("training", "adam_beta2", 0.999, {"type": float}),
    ("training", "adam_epsilon", 1e-8, {"type": float}),
    ("training", "warmup_steps", 0, {"type": int, "help": "linear warm-up, then constant lr"}),
    ("training", "max_grad_norm", 1.0, {"type": float, "help": "global-norm clipping; 0 = off"}),
    ("training", "activation_checkpointing", False,
     {"action": "store_true", "help": "recompute each decoder layer's activations in backward (each strategy its own "
                                      "way: docs/running.md)"}),
    ("training", "compile", False,
     {"action": "store_true", "help": "torch.compile each decoder layer (DDP, FSDP) or the engine's module (DeepSpeed's "
                                      "engine.compile)"}),
    ("precision", "precision", "auto",
     {"choices": PRECISIONS, "help": "the precision policy (docs/precision.md): " + "; ".join(
         f"{name} ({policy.holds})" for name, policy in POLICIES.items()) + "; auto = bf16 on GPU, fp32 on CPU, or what "
         "a strategy's own settings ask for (a --deepspeed_config)"}),
    ("precision", "autocast", False, {"action": "store_true", "help": "same as --precision bf16 (seed scripts' flag)"}),
    ("precision", "reduce_dtype", None,
     {"choices": DTYPE_NAMES, "help": "the dtype gradients are reduced over DP in (default: the gradients' own — " +
      ", ".join(f"{d} in {_policies(lambda p, d=d: p.reduce_dtypes[0] == d)}" for d in DTYPES
                if any(p.reduce_dtypes[0] == d for p in POLICIES.values())) + ")"}),
    ("precision", "grad_accum_dtype", None,
     {"choices": DTYPE_NAMES, "help": "the dtype micro-batch gradients accumulate in under --grad_accum_steps (default: "
                                      f"the gradients' own; fp32 in {_policies(lambda p: p.master_copy)}: into the fp32 "
                                      "master gradients, DeepSpeed's data_types.grad_accum_dtype)"}),
    ("precision", "loss_scale", None,
     {"type": float, "help": "fp16: a static loss scale; 0 = dynamic (default; DeepSpeed's fp16.loss_scale)"}),
    ("precision", "initial_scale_power", None,
     {"type": int, "help": "fp16: the dynamic scale starts at 2^N (default 16)"}),
    ("precision", "loss_scale_window", None,
     {"type": int, "help": "fp16: good steps after which the scale doubles (default 1000)"}),
    ("precision", "hysteresis", None,
     {"type": int, "help": "fp16: overflows before the scale is halved (default 2)"}),
    ("precision", "consecutive_hysteresis", None,
     {"action": "store_true", "help": "fp16: refill the hysteresis at every good step (default off)"}),
    ("precision", "min_loss_scale", None, {"type": float, "help": "fp16: the lowest scale (default 1)"}),
    ("training", "seed", 42, {"type": int, "help": "seeds the initial weights and the data"}),
    ("data", "dataset", "synthetic",
     {"help": "synthetic (learnable Markov text), synthetic_padded (the same in samples of different lengths, "
              "right-padded, labels -100 on the padding), wikitext (needs the hub), or text:PATH (a local file)"}),
    ("data", "packing", False,
     {"action": "store_true", "help": "pack documents of varying lengths (the synthetic language's) into full rows, "
                                      "each document's position ids from 0, fed with no mask and no cache so that no "
                                      "token attends across documents; the loss is over every real token "
                                      "(docs/finetune.md)"}),
    ("data", "padding_free", False,
     {"action": "store_true", "help": "feed each micro-batch's samples as one row, their padding dropped and each "
                                      "sample's position ids from 0 (docs/finetune.md)"}),
    ("lora", "lora_r", None,
     {"type": int, "help": "train LoRA adapters of rank R on a frozen base, through peft (pip install -e '.[lora]'; "
                           "docs/finetune.md): only the adapters train; the base stays the init-weights file's"}),
    ("lora", "lora_alpha", None, {"type": float, "help": "the adapters' scale alpha (alpha / r multiplies them; default 2 × r)"}),
    ("lora", "lora_dropout", 0.0,
     {"type": float, "help": "must be 0: strategies (and a replay) cannot draw the same dropout masks"}),
    ("lora", "lora_targets", None,
     {"help": "the linear layers that get adapters, by their last name part: q_proj,v_proj,... (default: peft's for the "
              "family)"}),
    ("lora", "lora_modules_to_save", None,
     {"help": "modules trained whole beside the adapters (peft's modules_to_save), by their last name part: "
              "embed_tokens,lm_head,norm,... (a tied embedding and lm_head train as one weight)"}),
    ("objective", "objective", None,
     {"help": "what a step's gradient is the gradient of (docs/posttrain.md): causal_lm (the token mean, the default), "
              "a GRPO-family loss (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo) or dpo, trained on --rollouts"}),
    ("objective", "objective_args", None,
     {"nargs": "+", "metavar": "KEY=VALUE", "help": "the objective's settings, by TRL's argument names: beta=0.04 "
                                                    "epsilon_high=0.28 loss_type=sigmoid,sft …"}),
    ("objective", "rollouts", None,
     {"help": "a rollout file (make_rollouts.py, or a recorded run's): what each optimizer step consumes — prompts, "
              "completions, advantages, old and reference log-probs; it sets the steps, a step's rows "
              "(= --batch_size × dp_size) and --seq_length"}),
    ("data", "num_samples", 10000, {"type": int, "help": "samples per epoch of the synthetic set"}),
    ("data", "tokenizer", None,
     {"help": "tokenizer for text data: 'bytes' (UTF-8 bytes) or a name/path (default: the model's; 'bytes' "
              "for the tiny presets)"}),
    ("outputs", "log_interval", 10, {"type": int, "help": "log and rewrite the loss JSON every N steps"}),
    ("outputs", "replica_check_interval", 1,
     {"type": int, "help": "check every N steps, at every checkpoint and at the end that every tensor several ranks "
                           "hold (parameters and their optimizer state) is bit for bit the same on each; a "
                           "difference FAILs the run (docs/running.md#replicas)"}),
    ("outputs", "verbose", False,
     {"action": "store_true", "help": "show Ray's, DeepSpeed's and torch's own output on the terminal (by default it "
                                      "goes to a log file in --loss_output_dir/logs, whose path is printed)"}),
    ("outputs", "loss_output_dir", "/tmp/loss_curves", {"help": "where loss_<strategy>.json goes"}),
    ("outputs", "report_to", "none",
     {"nargs": "+", "metavar": "TRACKER", "help": "experiment trackers rank 0 logs every step, the config and the "
                                                 "fingerprint to, and the comparison its verdict: wandb, mlflow, "
                                                 "tensorboard (one or several) or none "
                                                 "(docs/running.md#experiment-trackers)"}),
    ("outputs", "storage_path", "/tmp/ray_checkpoints", {"help": "Ray Train RunConfig storage_path"}),
    ("outputs", "experiment_name", None, {"help": "Ray Train run name (default: <strategy>_tp<T>_dp<D>)"}),
    ("outputs", "init_weights_path", "/tmp/shared_weights/init_weights.pt",
     {"help": "shared initial weights (.pt or .safetensors)"}),
    ("outputs", "save_init_weights", False,
     {"action": "store_true", "help": "initialise fresh weights and write them first"}),
    ("outputs", "noise_reference", False,
     {"action": "store_true", "help": "record this run as a noise reference of its strategy "
                                      "(noise_reference_<strategy>_tp<T>_dp<D>.json): the baseline's strategy again at "
                                      "another layout, from which plot_loss_curves.py calibrates its bounds"}),
    ("outputs", "final_checkpoint_dir", None,
     {"help": "Hugging Face-format model written at the end (default: <storage_path>/<name>/final_model)"}),
    ("checkpoints", "checkpoint_interval", 50,
     {"type": int, "help": "a checkpoint (model, optimizer, step, RNG, the loss record so far) every N steps, "
                           "and one at the end; 0 = at the end only"}),
    ("checkpoints", "no_teacher_forced", False,
     {"action": "store_true", "help": "skip the teacher-forced check: at step 0 and every --checkpoint_interval steps "
                                      "the strategy's next update is compared with a reference step from its own state "
                                      "(parameters, AdamW's moments, grad norm); a failing check FAILs the run "
                                      "(docs/teacher_forced.md)"}),
    ("checkpoints", "keep_checkpoints", 2, {"type": int, "help": "keep the last K checkpoints; 0 = keep all"}),
    ("checkpoints", "resume", False,
     {"action": "store_true", "help": "continue the unfinished run in <storage_path>/<experiment_name> from its latest "
                                      "checkpoint; without it an existing run folder is replaced by a fresh run"}),
    ("checkpoints", "max_failures", 1,
     {"type": int, "help": "restarts after a worker failure, each from the latest checkpoint; -1 = no limit"}),
)
DEFAULTS = {name: default for _, name, default, _ in FLAGS}
POLICY_FLAGS = tuple(name for group, name, _, _ in FLAGS
                     if group == "precision" and name not in ("precision", "autocast"))
"""The precision policy's refinements as flags: the reduce and accumulation dtypes, fp16's loss scaler."""
TYPES = {name: kwargs.get("type", str) for _, name, _, kwargs in FLAGS if "action" not in kwargs}


def add_run_flags(parser: argparse.ArgumentParser, given_only: bool = False) -> None:
    """The flags every entry script shares, in their groups. `given_only`: no defaults, so only the flags
    the user gave appear in the result (the main job's EXTRA_ARGS)."""
    groups: dict[str, Any] = {}
    for group, name, default, kwargs in FLAGS:
        if name in STAGE_FLAGS:
            continue  # add_strategy_options adds them, for a strategy with pipeline stages
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        groups[group].add_argument(f"--{name}", default=argparse.SUPPRESS if given_only else default, **kwargs)


def add_strategy_options(parser: argparse.ArgumentParser, strategy_classes, given_only: bool = False) -> None:
    """Each strategy's own flags, one group per strategy; and, once, the layout flags of pipeline stages (STAGE_FLAGS)
    where one of the strategies has them."""
    if any(cls.pipeline_parallel for cls in strategy_classes):
        group = parser.add_argument_group("layout of pipeline stages")
        for _, name, default, kwargs in (flag for flag in FLAGS if flag[1] in STAGE_FLAGS):
            group.add_argument(f"--{name}", default=argparse.SUPPRESS if given_only else default, **kwargs)
    for cls in strategy_classes:
        if cls.options:
            group = parser.add_argument_group(f"{cls.name} options")
            for option in cls.options:
                option.add_to(group, given_only)


def resolve(strategy: str, values: Mapping[str, Any], *, cluster=None,
            weights_written_before_launch: bool = False) -> RunConfig:
    """Flags (a name → value mapping; missing or None means the default) → a checked, complete RunConfig.

    The precision policy is resolved here once: --precision (or --autocast), what the strategy's own settings ask for
    (Strategy.precision_request: a --deepspeed_config's bf16 or fp16 section), the device (auto), then the policy's
    refinements (parity.precision). `cluster` (a parity.driver.cluster.Cluster) decides --device/--precision
    auto and each worker's CPU share; by default the running or addressed Ray cluster, else this machine. With
    `weights_written_before_launch` the init-weights file need not exist yet: the main job's DDP run or
    the layer check's driver writes it before this run launches; only its directory is checked.
    """
    from parity.registry import class_path, load, row
    from parity.tracking import trackers
    from parity.driver.cluster import probe_cluster
    from parity.objectives import micro_rows, parse_settings, resolve_objective
    from parity.training.data import check_source
    from parity.models.families import family_of, kv_heads
    from parity.models.adapters import check_adapters, lora_settings
    from parity.models.model import check_init_weights, resolve_model_config
    from parity.models.presets import default_learning_rate, default_tokenizer

    values = dict(values)
    perturb = values.pop("perturb", None)  # a noise reference's arithmetic (RunConfig.perturb): planned, not a flag
    if isinstance(values.get("strategy_class"), type):  # a class handed in by code (a test, the calibration study)
        values["strategy_class"] = class_path(values["strategy_class"])
    # The run's class, resolved once into the path RunConfig carries: every later place loads it (registry.load).
    strategy_path = values.get("strategy_class") or row(strategy).path
    cls = load(strategy_path)
    if values.get("strategy_class"):
        strategy = _own_name(cls, values["strategy_class"])
    option_names = {o.name for o in cls.options}
    # A stage flag given to a strategy without pipeline stages is refused as any flag it does not take.
    refused = set() if cls.pipeline_parallel else {k for k in STAGE_FLAGS if values.get(k) is not None}
    unknown = sorted((set(values) - set(DEFAULTS) - option_names) | refused)
    if unknown:
        raise ConfigError(f"--{unknown[0]} is not a flag of train_{strategy}.py: see its --help")
    types = {**TYPES, **{o.name: o.type or type(o.default) for o in cls.options}}
    given = {k: _typed(k, v, types.get(k)) for k, v in values.items() if v is not None}
    s = {**DEFAULTS, **cls.with_default_options(given)}
    options = {name: s.pop(name) for name in sorted(option_names)}
    s["precision"] = precision_flags(s["precision"], s.pop("autocast"))
    _check_numbers(s)
    s["pp_size"] = given_pp_size(cls, given)
    layout = Layout.from_flags(s["num_workers"], s["tp_size"], s["dp_size"], s["pp_size"], s["ep_size"],
                               pipeline=cls.pipeline_parallel)  # the run's one layout: RunConfig carries its degrees
    s["dp_size"] = layout.dp_size
    if s["batch_size"] % s["grad_accum_steps"]:
        raise ConfigError(f"--batch_size {s['batch_size']} is not a multiple of --grad_accum_steps "
                          f"{s['grad_accum_steps']}: each micro-batch is batch_size / grad_accum_steps samples")
    s["objective"] = resolve_objective(s["objective"], parse_settings(s.pop("objective_args")))
    _rollout_run(s, options)
    resolve_policy(s, cls.precision_request(options))
    cluster = cluster or probe_cluster()
    s["device"], s["precision"], s["cpus_per_worker"], spread = _placement(s, cluster)
    complete_policy(s)
    if s["precision"] not in cls.precisions:
        raise ConfigError(f"{strategy} does not run the {s['precision']} policy (it runs {', '.join(cls.precisions)}): "
                          f"pass one of them with --precision (a strategy of your own adopts a policy as "
                          f"docs/custom_strategy.md says)")

    model_config = resolve_model_config(s["model_name"], s["num_layers"])
    family = family_of(model_config)  # read from a meta model: one the seam cannot describe is refused here, not in a worker
    layout.check_heads(model_config.num_attention_heads, kv_heads(model_config))
    if layout.ep_size > 1:
        layout.check_experts(family.moe, model_config.model_type)
    if s["ep_size"] > 1 and not cls.expert_parallel:
        raise ConfigError(f"{strategy} does not shard experts (every expert on every rank): --ep_size must be 1 (got "
                          f"{s['ep_size']}); use train_fsdp.py or train_transformers.py for expert parallelism")
    if s["seq_length"] > (getattr(model_config, "max_position_embeddings", None) or s["seq_length"]):  # ALiBi: none
        raise ConfigError(f"--seq_length {s['seq_length']} is above the model's max_position_embeddings "
                          f"({model_config.max_position_embeddings}): use a shorter sequence")
    s["lora"] = lora_settings(s.pop("lora_r"), s.pop("lora_alpha"), s.pop("lora_dropout"), s.pop("lora_targets"),
                              model_config, s.pop("lora_modules_to_save"))
    if perturb and not cls.takes_perturb:
        raise ConfigError(f"{strategy} does not train a perturbed noise reference (RunConfig.perturb): DDP does")
    if POLICIES[s["precision"]].frozen_apart and not s["lora"]:
        raise ConfigError(f"--precision {s['precision']} holds a frozen base in bf16 under the parameters that train: "
                          f"it needs frozen ones, LoRA's base (--lora_r R); for a whole model in bf16 pass "
                          f"--precision bf16_pure")
    if s["lora"] and not cls.takes_adapters:
        raise ConfigError(f"{strategy} does not train LoRA adapters (it trains every parameter): use train_ddp.py, "
                          f"train_fsdp.py or train_deepspeed.py with --lora_r (docs/finetune.md)")
    cls.validate(SimpleNamespace(strategy=strategy, options=options, **s), model_config)
    rows = micro_rows({**s, "options": options})  # (a pipeline's --microbatches are filled in by its validate)
    if s["objective"] and s["objective"]["name"] == "dpo" and rows % 2:
        raise ConfigError(f"a DPO micro-batch holds whole pairs (chosen, rejected): micro-batches of {rows} rows cut "
                          f"one; use an even --batch_size ÷ micro-batches")

    if s["learning_rate"] is None:
        s["learning_rate"] = default_learning_rate(s["model_name"])
    if s["tokenizer"] is None:
        s["tokenizer"] = default_tokenizer(s["model_name"])
    _absolute_paths(s)
    check_source(s["dataset"], s["packing"], s["padding_free"])
    s["experiment_name"] = s["experiment_name"] or (f"{strategy}_tp{s['tp_size']}_dp{s['dp_size']}"
                                                    + (f"_ep{s['ep_size']}" if s["ep_size"] > 1 else "")
                                                    + ("_noise_reference" if s["noise_reference"] else ""))
    s["final_checkpoint_dir"] = s["final_checkpoint_dir"] or storage.join(
        s["storage_path"], s["experiment_name"], "final_model")

    if spread:
        _check_every_node_sees(s, cluster)
    s["report_to"] = trackers.check(s["report_to"], s["loss_output_dir"], spread)
    if s["save_init_weights"] or weights_written_before_launch:
        if os.path.isdir(s["init_weights_path"]):
            raise ConfigError(f"--init_weights_path {s['init_weights_path']} is a directory: give the file to write "
                              f"(e.g. {os.path.join(s['init_weights_path'], 'init_weights.pt')})")
        storage.check_writable_dir("--init_weights_path's directory", storage.parent(s["init_weights_path"]))
    else:
        check_init_weights(s["init_weights_path"], model_config)
        check_adapters(s["init_weights_path"], s["lora"])
    storage.check_writable_dir("--loss_output_dir", s["loss_output_dir"])
    storage.check_writable_dir("--storage_path", s["storage_path"])
    storage.check_writable_dir("--final_checkpoint_dir's parent", storage.parent(s["final_checkpoint_dir"]))
    cfg = RunConfig(strategy=strategy, strategy_path=strategy_path, options=options, model_config=model_config.to_dict(),
                    perturb=perturb, **s)
    if cfg.resume:
        from parity.training.checkpoints import check_resume

        check_resume(cfg)
    return cfg


def _rollout_run(s: dict, options: dict) -> None:
    """--rollouts FILE: the run's data is the file's steps (--dataset rollouts:FILE), its rows a step the global batch
    and its length --seq_length, checked against the objective; ConfigError in one line for what cannot train."""
    from parity.objectives.rollouts import read_rollouts
    from parity.training.data import ROLLOUTS

    path, objective = s.pop("rollouts"), s["objective"]
    if path is None:
        if objective is not None:
            raise ConfigError(f"--objective {objective['name']} trains on a rollout file: give --rollouts FILE "
                              f"(make_rollouts.py writes one from any model; docs/posttrain.md)")
        return
    other_data = s["dataset"] != DEFAULTS["dataset"]  # (flags at their defaults count as not given)
    if other_data or s["packing"] or s["padding_free"]:
        flag = "--dataset" if other_data else "--packing" if s["packing"] else "--padding_free"
        raise ConfigError(f"{flag} with --rollouts: a rollout file is the run's data, its rows fed as they are; drop "
                          f"{flag}")
    rollouts = read_rollouts(storage.absolute(path))
    wanted = rollouts.family if objective is None else "dpo" if objective["name"] == "dpo" else "grpo"
    if wanted != rollouts.family:
        raise ConfigError(f"--objective {objective['name']} trains on {wanted} rollouts, and --rollouts {path} holds "
                          f"{rollouts.family} ones: give a {wanted} rollout file")
    rows, global_rows = rollouts.rows_per_step(), s["batch_size"] * s["dp_size"]
    if rows != global_rows:
        fits = f"--batch_size {rows // s['dp_size']}" if rows and rows % s["dp_size"] == 0 else "another layout"
        raise ConfigError(f"--rollouts {path} holds {rows or 'different numbers of'} rows a step, the run's global "
                          f"batch is --batch_size {s['batch_size']} × dp_size {s['dp_size']} = {global_rows}: use {fits}")
    settings = (objective or {}).get("settings", {})
    if settings.get("beta") and rollouts.family == "grpo" and "ref_logps" not in rollouts.tensors:
        raise ConfigError(f"--objective {objective['name']} with beta {settings['beta']} needs the reference's "
                          f"log-probs, and --rollouts {path} has none: give beta=0, or a file with ref_logps")
    if settings.get("vllm_importance_sampling_correction") and "sampler_logps" not in rollouts.tensors:
        raise ConfigError(f"--objective {objective['name']} with vllm_importance_sampling_correction weighs each "
                          f"token by π_old ÷ the sampler's probability, and --rollouts {path} has no sampler side: "
                          f"give vllm_importance_sampling_correction=False, or a file with sampler_logps "
                          f"(docs/sampler.md)")
    if settings.get("ld_alpha") is not None and "ref_logps" not in rollouts.tensors:
        raise ConfigError(f"--objective dpo with ld_alpha weighs the reference's tokens, and --rollouts {path} holds "
                          f"only its sums (ref_seq_logps): give a file with ref_logps")
    if s["seq_length"] not in (DEFAULTS["seq_length"], rollouts.seq_length):
        raise ConfigError(f"--seq_length {s['seq_length']}: --rollouts {path} holds rows of {rollouts.seq_length} "
                          f"tokens; drop --seq_length")
    s["seq_length"], s["dataset"] = rollouts.seq_length, ROLLOUTS + rollouts.path


def _own_name(cls, path: str) -> str:
    """The name a strategy class of its own records under: its `name`, which must say which run it is."""
    if not isinstance(cls.name, str) or not cls.name.isidentifier() or cls.name == "base":
        raise ConfigError(f"--strategy_class {path}: set the class's `name` (e.g. name = \"my_fsdp\"): it names the "
                          f"loss record, loss_<name>.json")
    return cls.name


def _typed(name: str, value, kind):
    """A flag's value as its parser would have made it, whoever passed it (a command, a test)."""
    if isinstance(value, (list, tuple)):  # a flag of several values (--report_to)
        return tuple(_typed(name, v, kind) for v in value)
    if kind is int:
        if isinstance(value, bool) or not float(value).is_integer():
            raise ConfigError(f"--{name} must be an integer (got {value})")
        return int(value)
    if kind is float:
        return float(value)
    if kind is str:
        return str(value)  # paths may come as pathlib.Path
    return value


def precision_flags(precision: str, autocast: bool) -> str:
    """--precision and the seed scripts' --autocast as one policy name (auto stays auto)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision}: use one of {', '.join(PRECISIONS)}")
    if autocast:
        if precision not in ("auto", "bf16"):
            raise ConfigError(f"--autocast asks for bf16 (autocast over fp32 parameters) but --precision {precision} was "
                              f"also given: pass only one of them")
        return "bf16"
    return precision


# Every float flag: finite, and in its range (low, high, low included?, high included?, what it means).
FLOAT_RANGES = {
    "learning_rate": (0.0, math.inf, False, False, "a positive number"),
    "lora_alpha": (0.0, math.inf, False, False, "a positive number"),
    "lora_dropout": (0.0, 1.0, True, False, "in [0, 1)"),
    "weight_decay": (0.0, math.inf, True, False, "0 or positive"),
    "adam_beta1": (0.0, 1.0, True, False, "in [0, 1)"),
    "adam_beta2": (0.0, 1.0, True, False, "in [0, 1)"),
    "adam_epsilon": (0.0, math.inf, False, False, "a positive number"),
    "max_grad_norm": (0.0, math.inf, True, False, "0 (off) or positive"),
}
# Every size: at least this.
INT_MINIMUMS = {"lora_r": 1, "num_workers": 1, "tp_size": 1, "dp_size": 1, "ep_size": 1, "batch_size": 1, "seq_length": 2, "num_layers": 1,
                "grad_accum_steps": 1,
                "num_epochs": 1, "debug_steps": 1, "log_interval": 1, "replica_check_interval": 1, "num_samples": 1,
                "warmup_steps": 0, "seed": 0,
                "checkpoint_interval": 0, "keep_checkpoints": 0}


def _check_numbers(s: dict) -> None:
    """Sizes at least their minimum; every float finite and in its range (argparse takes 'nan' as a float)."""
    for name, minimum in INT_MINIMUMS.items():
        if s[name] is not None and s[name] < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ConfigError(f"--{name} must be {what} (got {s[name]})")
    if s["max_failures"] < -1:
        raise ConfigError(f"--max_failures must be -1 (no limit) or an integer >= 0 (got {s['max_failures']})")
    for name, (low, high, low_ok, high_ok, words) in FLOAT_RANGES.items():
        value = s[name]
        if value is None:
            continue
        inside = (low < value or (low_ok and value == low)) and (value < high or (high_ok and value == high))
        if not math.isfinite(value) or not inside:
            raise ConfigError(f"--{name} must be {words} (got {value})")
    if s["device"] not in DEVICES:
        raise ConfigError(f"--device {s['device']}: use one of {', '.join(DEVICES)}")


def _absolute_paths(s: dict) -> None:
    """Ray workers do not run in the driver's directory: every local path travels absolute (a URI as given)."""
    for name in PATH_FLAGS:
        if s[name]:
            s[name] = storage.absolute(s[name])
    if s["dataset"].startswith("text:"):
        s["dataset"] = "text:" + os.path.abspath(s["dataset"][len("text:"):])
    if os.path.isdir(s["model_name"]):
        s["model_name"] = os.path.abspath(s["model_name"])


def _placement(s: dict, cluster) -> tuple[str, str, float, bool]:
    """(device, precision, CPUs per worker, whether workers may run on other nodes than this driver) from
    --device/--precision and what the cluster offers. A joined cluster short of GPUs for --device cuda may
    be waiting for its autoscaler: the run goes ahead (Ray Train waits for the GPUs), on nodes to come."""
    workers = s["num_workers"]
    waits_for_gpus = s["device"] == "cuda" and cluster.gpus < workers
    if waits_for_gpus and not cluster.joined:
        raise ConfigError(f"--device cuda needs {workers} GPUs (one per worker), the Ray cluster has "
                          f"{cluster.gpus}: use --device cpu or fewer workers")
    if waits_for_gpus:
        print(f"note: --device cuda: the Ray cluster has {cluster.gpus} of the {workers} GPUs this run needs "
              f"now; the run waits until its autoscaler adds them", file=sys.stderr, flush=True)
    device = s["device"] if s["device"] != "auto" else ("cuda" if cluster.gpus >= workers else "cpu")
    precision = s["precision"] if s["precision"] != "auto" else ("bf16" if device == "cuda" else "fp32")
    return device, precision, min(1.0, cluster.cpus / workers), cluster.nodes > 1 or waits_for_gpus


def _check_every_node_sees(s: dict, cluster) -> None:
    """Workers that may run on other nodes (rank 0 writes the record and the checkpoint, every rank reads
    the weights) need paths every node sees: a URI, a shared mount, or a folder declared shared."""
    for name in PATH_FLAGS:
        if not storage.visible_to_every_node(s[name]):
            where = (f"the Ray cluster has {cluster.nodes} nodes" if cluster.nodes > 1
                     else "its GPUs are on nodes still to come")
            raise ConfigError(f"--{name} {s[name]} is a local path, and this run's workers may run on other "
                              f"nodes than this driver ({where}): use a URI (s3://, gs://, …), a mount every node "
                              f"shares ({', '.join(storage.SHARED_MOUNTS)}), or name a folder every node shares "
                              f"in PARITY_SHARED_PATHS")


