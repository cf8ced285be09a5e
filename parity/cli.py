"""What every entry script does: flags → checks (one line on failure) → Ray Train launch."""

from __future__ import annotations

import os
import sys
import time

from parity.config import RunConfig, build_parser, check_heads, check_layout, check_writable_dir, config_from_args
from parity.data import GlobalBatches, open_dataset
from parity.errors import ConfigError
from parity.model import check_init_weights, default_learning_rate, default_tokenizer, resolve_model_config
from parity.record import record_path
from parity.strategies import strategy_class


def prepare(strategy: str, argv: list[str] | None = None, description: str = "") -> RunConfig:
    """Parse and check everything that can be checked without a worker. Raises ConfigError."""
    cls = strategy_class(strategy)
    args = build_parser(strategy, description, cls.add_arguments).parse_args(argv)
    cfg = config_from_args(strategy, args)
    check_layout(cfg)
    model_config = resolve_model_config(cfg.model_name, cfg.num_layers)
    check_heads(cfg, model_config.num_attention_heads, model_config.num_key_value_heads)
    if cfg.seq_length > model_config.max_position_embeddings:
        raise ConfigError(f"--seq_length {cfg.seq_length} is above the model's max_position_embeddings "
                          f"({model_config.max_position_embeddings}): use a shorter sequence")
    cls.validate(cfg, model_config)
    _absolute_paths(cfg)
    if cfg.learning_rate is None:
        cfg.learning_rate = default_learning_rate(cfg.model_name)
    if cfg.tokenizer is None:
        cfg.tokenizer = default_tokenizer(cfg.model_name)
    cfg.experiment_name = cfg.experiment_name or f"{strategy}_tp{cfg.tp_size}_dp{cfg.dp_size}"
    cfg.final_checkpoint_dir = cfg.final_checkpoint_dir or os.path.join(
        cfg.storage_path, cfg.experiment_name, "final_model")

    if cfg.save_init_weights:
        check_writable_dir("--init_weights_path's directory", os.path.dirname(cfg.init_weights_path))
    else:
        check_init_weights(cfg.init_weights_path, model_config)
    check_writable_dir("--loss_output_dir", cfg.loss_output_dir)
    check_writable_dir("--storage_path", cfg.storage_path)
    GlobalBatches(open_dataset(cfg.dataset, cfg.tokenizer, model_config.vocab_size, cfg.seq_length,
                               cfg.num_samples, cfg.seed), cfg.global_batch_size, cfg.seed)
    return cfg


def run(strategy: str, argv: list[str] | None = None, description: str = "") -> str:
    """Check, then train; returns the loss record's path. Raises ConfigError or TrainingFailed."""
    from parity.launch import launch

    cfg = prepare(strategy, argv, description)
    t0 = time.perf_counter()
    ray_start_s = launch(cfg)
    path = record_path(cfg.loss_output_dir, strategy)
    print(f"[{strategy}] finished in {time.perf_counter() - t0:.1f} s (Ray start-up {ray_start_s:.1f} s); "
          f"loss record: {path}", flush=True)
    return path


def main(strategy: str, description: str = "") -> int:
    """Entry-script main of train_<strategy>.py."""
    def train() -> int:
        run(strategy, sys.argv[1:], description)
        return 0

    return exit_code(train, "training")


def exit_code(action, what: str) -> int:
    """Run `action` (returning an exit code) the way every entry script does: bad input is one line on
    stderr and exit 2; a run that failed on a worker is one line naming `what` failed, and exit 1."""
    from parity.launch import TrainingFailed

    try:
        return action()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingFailed as exc:
        print(f"error: {what} failed: {exc}", file=sys.stderr)
        return 1


def _absolute_paths(cfg: RunConfig) -> None:
    """Ray workers do not run in the driver's directory: every local path travels absolute."""
    for name in ("loss_output_dir", "storage_path", "init_weights_path", "final_checkpoint_dir"):
        value = getattr(cfg, name)
        if value and "://" not in value:
            setattr(cfg, name, os.path.abspath(os.path.expanduser(value)))
    if cfg.dataset.startswith("text:"):
        cfg.dataset = "text:" + os.path.abspath(cfg.dataset[len("text:"):])
    if os.path.isdir(cfg.model_name):
        cfg.model_name = os.path.abspath(cfg.model_name)
