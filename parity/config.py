"""Flags ⇄ one dataclass, and the checks that run on the driver before any worker starts.

The flag names are the seed scripts' (`--num_workers --tp_size --dp_size --batch_size ...`): users
already type them. Every check raises `ConfigError` with one line naming the problem and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from parity.errors import ConfigError

PRECISIONS = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class RunConfig:
    """Everything a run depends on. `resolve()` fills the derived fields; the record stores all of it."""

    strategy: str
    model_name: str = "Qwen/Qwen2.5-0.5B"
    num_workers: int = 2
    tp_size: int = 1
    dp_size: int | None = None
    batch_size: int = 2
    seq_length: int = 1024
    num_layers: int | None = None
    num_epochs: int = 1
    debug_steps: int | None = None
    learning_rate: float | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    precision: str = "auto"
    seed: int = 42
    dataset: str = "synthetic"
    num_samples: int = 10000
    tokenizer: str | None = None
    log_interval: int = 10
    loss_output_dir: str = "/tmp/loss_curves"
    storage_path: str = "/tmp/ray_checkpoints"
    experiment_name: str | None = None
    init_weights_path: str = "/tmp/shared_weights/init_weights.pt"
    save_init_weights: bool = False
    final_checkpoint_dir: str | None = None
    device: str = "auto"
    # Strategy-specific flags (e.g. --zero_stage), declared by the strategy module.
    options: dict[str, Any] = field(default_factory=dict)
    # Filled on the driver by the launcher once the cluster is known.
    cpus_per_worker: float | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def use_cuda(self) -> bool:
        return self.device == "cuda"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        return cls(**data)


def build_parser(strategy: str, description: str, add_strategy_arguments=None) -> argparse.ArgumentParser:
    """The flags every entry script shares; the strategy module may add its own."""
    d = RunConfig(strategy=strategy)
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model_name", default=d.model_name,
                   help="built-in preset (Qwen/Qwen2.5-0.5B, qwen2-tiny), a local directory with config.json, "
                        "or a hub name when the hub is reachable")
    g.add_argument("--num_layers", type=int, default=None, help="override num_hidden_layers")
    g = p.add_argument_group("layout")
    g.add_argument("--num_workers", type=int, default=d.num_workers, help="Ray Train workers = tp_size × dp_size")
    g.add_argument("--tp_size", type=int, default=d.tp_size, help="tensor-parallel degree")
    g.add_argument("--dp_size", type=int, default=None, help="data-parallel degree (default num_workers / tp_size)")
    g.add_argument("--device", choices=DEVICES, default=d.device,
                   help="auto: one GPU per worker when the cluster has them, else CPU workers over gloo")
    g = p.add_argument_group("training")
    g.add_argument("--batch_size", type=int, default=d.batch_size, help="samples per data-parallel rank per step")
    g.add_argument("--seq_length", type=int, default=d.seq_length)
    g.add_argument("--num_epochs", type=int, default=d.num_epochs)
    g.add_argument("--debug_steps", type=int, default=None, help="stop after this many steps (overrides epochs)")
    g.add_argument("--learning_rate", type=float, default=None, help="AdamW lr (default: the preset's)")
    g.add_argument("--weight_decay", type=float, default=d.weight_decay)
    g.add_argument("--adam_beta1", type=float, default=d.adam_beta1)
    g.add_argument("--adam_beta2", type=float, default=d.adam_beta2)
    g.add_argument("--adam_epsilon", type=float, default=d.adam_epsilon)
    g.add_argument("--warmup_steps", type=int, default=d.warmup_steps, help="linear warm-up, then constant lr")
    g.add_argument("--max_grad_norm", type=float, default=d.max_grad_norm, help="global-norm clipping; 0 = off")
    g.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                   help="fp32, or bf16 (autocast compute, fp32 master weights and optimizer state); "
                        "auto = bf16 on GPU, fp32 on CPU")
    g.add_argument("--autocast", action="store_true", help="same as --precision bf16 (seed scripts' flag)")
    g.add_argument("--seed", type=int, default=d.seed, help="seeds the initial weights and the data")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=d.dataset,
                   help="synthetic (learnable Markov text), wikitext (needs the hub), or text:PATH (a local file)")
    g.add_argument("--num_samples", type=int, default=d.num_samples, help="samples per epoch of the synthetic set")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for text data: 'bytes' (UTF-8 bytes) or a name/path (default: the model's; "
                        "'bytes' for qwen2-tiny)")
    g = p.add_argument_group("outputs")
    g.add_argument("--log_interval", type=int, default=d.log_interval, help="log and rewrite the loss JSON every N steps")
    g.add_argument("--loss_output_dir", default=d.loss_output_dir, help=f"where loss_{strategy}.json goes")
    g.add_argument("--storage_path", default=d.storage_path, help="Ray Train RunConfig storage_path")
    g.add_argument("--experiment_name", default=None, help="Ray Train run name (default: <strategy>_tp<T>_dp<D>)")
    g.add_argument("--init_weights_path", default=d.init_weights_path, help="shared initial weights (.pt or .safetensors)")
    g.add_argument("--save_init_weights", action="store_true", help="initialise fresh weights and write them first")
    g.add_argument("--final_checkpoint_dir", default=None,
                   help="Hugging Face-format model written at the end (default: <storage_path>/<name>/final_model)")
    if add_strategy_arguments is not None:
        add_strategy_arguments(p.add_argument_group(f"{strategy} options"))
    return p


def config_from_args(strategy: str, args: argparse.Namespace) -> RunConfig:
    values = vars(args).copy()
    if values.pop("autocast"):
        if values["precision"] == "fp32":
            raise ConfigError("--autocast asks for bf16 but --precision fp32 was also given: pass only one of them")
        values["precision"] = "bf16"
    names = {f.name for f in dataclasses.fields(RunConfig)}
    options = {k: v for k, v in values.items() if k not in names}
    common = {k: v for k, v in values.items() if k in names}
    return RunConfig(strategy=strategy, options=options, **common)


def to_argv(flags: dict[str, Any]) -> list[str]:
    """{"tp_size": 2, "autocast": True} → ["--tp_size", "2", "--autocast"] (False/None are left out)."""
    argv: list[str] = []
    for key, value in flags.items():
        if value is True:
            argv.append(f"--{key}")
        elif value is not False and value is not None:
            argv += [f"--{key}", str(value)]
    return argv


def check_layout(cfg: RunConfig) -> None:
    """Positive sizes and num_workers = tp_size × dp_size; fills dp_size when it was left out."""
    for name in ("num_workers", "tp_size", "batch_size", "seq_length", "num_epochs", "log_interval", "num_samples"):
        _positive(name, getattr(cfg, name))
    for name in ("dp_size", "num_layers", "debug_steps"):
        if getattr(cfg, name) is not None:
            _positive(name, getattr(cfg, name))
    if cfg.warmup_steps < 0:
        raise ConfigError(f"--warmup_steps must be 0 or more (got {cfg.warmup_steps})")
    if cfg.max_grad_norm < 0:
        raise ConfigError(f"--max_grad_norm must be 0 (off) or positive (got {cfg.max_grad_norm})")
    if cfg.learning_rate is not None and cfg.learning_rate <= 0:
        raise ConfigError(f"--learning_rate must be positive (got {cfg.learning_rate})")
    if cfg.dp_size is None:
        if cfg.num_workers % cfg.tp_size:
            raise ConfigError(f"--num_workers {cfg.num_workers} is not a multiple of --tp_size {cfg.tp_size}: "
                              f"num_workers must equal tp_size × dp_size")
        cfg.dp_size = cfg.num_workers // cfg.tp_size
    elif cfg.tp_size * cfg.dp_size != cfg.num_workers:
        raise ConfigError(f"--num_workers {cfg.num_workers} ≠ --tp_size {cfg.tp_size} × --dp_size {cfg.dp_size}: "
                          f"pass --num_workers {cfg.tp_size * cfg.dp_size} or change tp/dp")


def check_heads(cfg: RunConfig, num_attention_heads: int, num_key_value_heads: int) -> None:
    """Tensor parallelism splits attention by heads, so tp_size must divide both head counts."""
    for label, count in (("KV-head", num_key_value_heads), ("attention-head", num_attention_heads)):
        if count % cfg.tp_size:
            divisors = [d for d in range(1, count + 1) if count % d == 0 and num_attention_heads % d == 0]
            raise ConfigError(f"--tp_size {cfg.tp_size} does not divide the model's {label} count ({count}): "
                              f"use a tp_size in {divisors}")


def check_writable_dir(flag: str, path: str) -> None:
    """Create the directory if needed and prove a file can be written there, before any worker runs."""
    if "://" in path:  # remote storage (s3://, gs://): Ray Train checks it itself
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test_"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path} is not a writable directory ({exc.strerror}): "
                          f"choose a directory you can write to") from None


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"--{name} must be a positive integer (got {value})")
