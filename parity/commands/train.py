"""train_<strategy>.py: flags → resolve (one line on bad input) → the run's data → Ray Train launch."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Mapping

from parity import console, storage
from parity.commands.common import OneLineParser, exit_now, run_command
from parity.driver.cluster import ray_for_this_command
from parity.driver.config import add_run_flags, add_strategy_options, resolve
from parity.errors import ConfigError


def build_parser(strategy: str, description: str = "", argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The script's flags: the shared ones and the strategy's own — those of the --strategy_class given in `argv`
    (a Strategy subclass of the user's, with options of its own) instead of the script's strategy."""
    from parity.registry import load, row

    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--strategy_class", default=None)
    path = probe.parse_known_args(sys.argv[1:] if argv is None else argv)[0].strategy_class
    parser = OneLineParser(description)
    add_run_flags(parser)
    cls = load(path or row(strategy).path)
    add_strategy_options(parser, [cls])
    if cls.replays_records:  # a trusted loop a recorded run is replayed under (DDP's, FSDP2's, ZeRO-3's class says so)
        parser.add_argument("--replay_record", default=argparse.SUPPRESS, metavar="LOSS_JSON",  # absent unless given
                            help="replay a run recorded by parity's recorder (its loss_<name>.json) under this loop (DDP; "
                                 "FSDP2 fully sharded, no TP; DeepSpeed ZeRO-3): the record "
                                 "supplies the model, weights, data, optimizer, lr, micro-batches, precision and steps; "
                                 "give only --num_workers, --device, the output and checkpoint flags and "
                                 "--noise_reference (docs/own_trainer.md)")
        parser.add_argument("--dump_step", type=int, default=argparse.SUPPRESS, metavar="K",
                            help="with --replay_record: instead of training, record step K of the replay fully (every "
                                 "module's output and gradient, every parameter's gradient and update, under Hugging "
                                 "Face names) into --loss_output_dir as dump_ddp.*, beside the dump the recorder wrote "
                                 "with dump_step=K: compare_dumps.py --input_dir there names the first divergent module")
    return parser


def given_flags(strategy: str, argv: list[str] | None) -> dict:
    """Only the flags the user typed (no defaults), by name."""
    from parity.registry import load, row

    parser = OneLineParser()
    add_run_flags(parser, given_only=True)
    add_strategy_options(parser, [load(row(strategy).path)], given_only=True)
    parser.add_argument("--replay_record", default=argparse.SUPPRESS)
    parser.add_argument("--dump_step", default=argparse.SUPPRESS)
    given = vars(parser.parse_known_args(sys.argv[1:] if argv is None else argv)[0])
    given.pop("replay_record", None)
    given.pop("dump_step", None)
    return given


def replay(record_file: str, given: Mapping[str, Any], strategy: str, dump_step: int | None = None) -> str:
    """train_ddp.py --replay_record: the replay's config and batches from the record (parity/replay/replay.py),
    then trained as every run — or with `dump_step`, that step recorded fully (parity/recording/dump.py); returns
    the loss record's (or the dump's) path. Raises ConfigError or TrainingFailed."""
    from parity.driver.launch import launch_runs
    from parity.replay.replay import plan_replay
    from parity.training.record import run_record_path

    from parity.replay.replay_choice import REPLAYS, choose

    name = next((name for name, (loop, _, _) in REPLAYS.items() if loop == strategy), None)
    if dump_step is not None and name != "ddp":
        raise ConfigError("--dump_step: the replay's step is dumped under DDP: use train_ddp.py --replay_record")
    cfg, batches = plan_replay(record_file, given, strategy=strategy, dump_step=dump_step,
                               flags=REPLAYS[name][1] if name else None)
    if name:
        choose(name, cfg, None, storage.name(record_file))  # one line where its states would not fit a worker
    if dump_step is not None:
        from parity.recording.dump import dump_replay

        with console.terminal(run_log(cfg), cfg.verbose) as log:
            with console.pointing_to(log, f"[{cfg.strategy}] "):
                path = dump_replay(cfg, batches, dump_step)
            console.say(f"[{cfg.strategy}] dumped step {dump_step} of the replay: {path}; then compare_dumps.py "
                        f"--input_dir {storage.parent(path)}")
        return path
    t0 = time.perf_counter()
    with console.terminal(run_log(cfg), cfg.verbose) as log, ray_for_this_command():
        with console.pointing_to(log, f"[{cfg.strategy}] "):
            launch_runs([cfg], [{"batches": batches}])
        path = run_record_path(cfg)
        console.say(f"[{cfg.strategy}] replayed {storage.name(record_file)} in {time.perf_counter() - t0:.1f} s; "
                    f"loss record: {path}")
    return path


def run(strategy: str, values: Mapping[str, Any]) -> str:
    """Resolve, then train; returns the loss record's path. Raises ConfigError or TrainingFailed."""
    from parity.training.data import training_data
    from parity.driver.launch import launch_runs
    from parity.training.record import run_record_path

    cfg = resolve(strategy, values)
    batches = training_data(cfg)
    t0 = time.perf_counter()
    with console.terminal(run_log(cfg), cfg.verbose) as log, ray_for_this_command():
        with console.pointing_to(log, f"[{cfg.strategy}] "):
            ray_start_s = launch_runs([cfg], [{"batches": batches}])
        path = run_record_path(cfg)
        console.say(f"[{cfg.strategy}] finished in {time.perf_counter() - t0:.1f} s (Ray start-up {ray_start_s:.1f} s); "
                    f"loss record: {path}")
    return path


def run_log(cfg) -> str:
    """Where a run's Ray, DeepSpeed and torch output goes: <loss_output_dir>/logs/<experiment_name>.log."""
    return storage.join(cfg.loss_output_dir, "logs", f"{cfg.experiment_name}.log")


def main(strategy: str, description: str = "", argv: list[str] | None = None) -> int:
    """The whole of train_<strategy>.py."""
    def train() -> int:
        values = vars(build_parser(strategy, description, argv).parse_args(argv))
        record, dump_step = values.pop("replay_record", None), values.pop("dump_step", None)
        if dump_step is not None and not record:
            raise ConfigError("--dump_step needs --replay_record: it records a step of a recorded run's replay")
        if record:
            replay(record, given_flags(strategy, argv), strategy, dump_step)
        else:
            run(strategy, values)
        return 0

    return run_command(train, "training")


if __name__ == "__main__":  # python -m parity.commands.train STRATEGY [flags]
    exit_now(main(sys.argv[1], argv=sys.argv[2:]))
