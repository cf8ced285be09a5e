"""The strategies by their one name: the flag value, the record's `strategy`, `loss_<name>.json`,
the class (`<Label>Strategy`) and the label in reports — and any other Strategy subclass by its import path,
"module:Class" (a user's own strategy, a seeded bug of the calibration catalogue), whose `name` names its
record.

Each strategy lives in its top-level module (`ddp_strategy.py`, `autotp_strategy.py` — the design card's
file name for DeepSpeed — `fsdp_strategy.py`, `pipeline_strategy.py` and `transformers_strategy.py`: transformers'
own TP and FSDP2) and is imported only when asked for,
because each pulls its library (DeepSpeed picks an accelerator when it is imported). The strategy modules
import nothing from here, so there is no cycle.

NAMES are the strategies the main job and the layer check run by default (STRATEGIES, --strategy all), at
TP_SIZE × DP_SIZE; the pipeline, whose layout is --pp_size × --dp_size, and transformers' own distributed training
are registered beside them (by name in their train_*.py, STRATEGIES and --strategy, with labels and options).
"""

from __future__ import annotations

from parity.errors import ConfigError, LibraryMissing

NAMES = ("ddp", "deepspeed", "fsdp")
OTHER_NAMES = ("pipeline", "transformers")  # registered, not in the main job's or the layer check's default set
KNOWN = NAMES + OTHER_NAMES
LABELS = {"ddp": "DDP", "deepspeed": "DeepSpeed", "fsdp": "FSDP", "pipeline": "Pipeline",
          "transformers": "transformers"}


def label(name: str) -> str:
    """How reports name a strategy; a name the harness does not know is shown as it is."""
    return LABELS.get(name, name)


def pp_size_of(config: dict) -> int:
    """The pipeline ranks per model replica of a run (its config or dump metadata): 1 without a pipeline."""
    return (config.get("options") or {}).get("pp_size", 1)


def run_label(name: str, config: dict) -> str:
    """A run's name in reports with its layout: "FSDP (TP=2, DP=2)", "Pipeline (PP=2, DP=2)", "FSDP (TP=1, DP=4,
    EP=2)"."""
    pp, tp, ep = pp_size_of(config), config["tp_size"], config.get("ep_size", 1)
    return (f"{label(name)} ({f'PP={pp}' if pp > 1 else f'TP={tp}'}, DP={config['dp_size']}"
            f"{f', EP={ep}' if ep > 1 else ''})")


def strategy_class(name: str, path: str | None = None):
    """The Strategy subclass for `name` — or the one at import `path` when given; ConfigError for an unknown
    name or a library that cannot be imported."""
    if path:
        return import_strategy(path)
    if name not in KNOWN:
        raise ConfigError(f"unknown strategy '{name}': use one of {', '.join(KNOWN)}")
    try:
        if name == "ddp":
            from ddp_strategy import DDPStrategy as cls
        elif name == "deepspeed":
            from autotp_strategy import DeepSpeedStrategy as cls
        elif name == "pipeline":
            from pipeline_strategy import PipelineStrategy as cls
        elif name == "transformers":
            from transformers_strategy import TransformersStrategy as cls
        else:
            from fsdp_strategy import FSDPStrategy as cls
    except ImportError as exc:
        raise LibraryMissing(name, exc) from None
    return cls


def class_path(cls) -> str:
    """"module:Class", the path import_strategy imports `cls` by."""
    return f"{cls.__module__}:{cls.__qualname__}"


def import_strategy(path: str):
    """The Strategy subclass at "module:Class". ConfigError when it cannot be imported or is not a Strategy; the
    module must be importable where the run's workers start (installed, or on PYTHONPATH)."""
    import importlib

    from parity.training.strategy import Strategy

    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ConfigError(f"--strategy_class {path}: expected module:Class (e.g. my_strategy:MyStrategy)")
    try:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except ImportError as exc:
        raise ConfigError(f"--strategy_class {path}: cannot import {module_name} ({exc}): put its folder on "
                          f"PYTHONPATH (or install it) where the driver and the workers run") from None
    except AttributeError:
        raise ConfigError(f"--strategy_class {path}: {module_name} has no {qualname}") from None
    if not (isinstance(obj, type) and issubclass(obj, Strategy)) or obj is Strategy:
        raise ConfigError(f"--strategy_class {path} is not a subclass of parity.training.strategy.Strategy")
    return obj


def module_folder(path: str) -> str | None:
    """The folder Ray Train's workers need on their PYTHONPATH to import a strategy class at `path`
    ("module:Class") as the driver did: its top-level module's, unless that is installed (site-packages) or one
    of the harness's own (the parity package, the top-level strategy modules: every worker imports them
    already). On a cluster of other machines the folder must be there too: a Ray job's working_dir is, or
    install the module."""
    import importlib.util
    import os
    import sys
    import sysconfig

    top = path.partition(":")[0].split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.origin:
        return None
    source = os.path.abspath(os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin)
    installed = [os.path.abspath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")]
    harness = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules[__name__].__file__)))
    if any(source.startswith(p + os.sep) for p in installed) or os.path.dirname(source) == harness or \
            source == os.path.join(harness, "parity"):
        return None
    return os.path.dirname(source)


def option_owners() -> dict[str, str]:
    """Every strategy's own flags: {option name: the strategy that has it}, in KNOWN order."""
    return {option.name: name for name in KNOWN for option in strategy_class(name).options}


def flags_for(strategy: str, given: dict) -> dict:
    """`given` without the other strategies' own flags: the run flags and `strategy`'s options."""
    owners = option_owners()
    return {k: v for k, v in given.items() if owners.get(k, strategy) == strategy}


def unrun_option(given: dict, strategies: list[str]) -> tuple[str, str] | None:
    """(flag, strategy) for the first flag in `given` that belongs to a strategy not in `strategies`."""
    return next(((k, s) for k, s in option_owners().items() if k in given and s not in strategies), None)
