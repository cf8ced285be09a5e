"""The strategies: one table of rows (name, label, class path, in the default set), and the loader every other place
uses. A row's name is the flag value (--strategy, STRATEGIES), the record's `strategy`, `loss_<name>.json` and its
entry script's suffix; its label names it in reports; its class path, "module:Class", is where its class lives.

`resolve` (parity/driver/config.py) turns a run's strategy — a row's name, a --strategy_class path of the user's, or a
class handed in by code — into one class path, `RunConfig.strategy_path`, once; every later place loads that path
with `load` (importlib), never looking a name up again. Any Strategy subclass loads the same way (a user's own, a
seeded bug of the calibration catalogue): its `name` names its record.

Nothing here imports a strategy module: each pulls its library when loaded (DeepSpeed picks an accelerator when it is
imported), and the strategy modules sit floors above this table. Adding a strategy is its module, its entry script and
one row here: the main job, the layer check and the benchmark read the table and the class's attributes
(`tensor_parallel`, `pipeline_parallel`, `expert_parallel`, …). The rows `default` True are the runs of the main job
and the layer check by default (STRATEGIES, --strategy all) at TP_SIZE × DP_SIZE.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from parity.errors import ConfigError, LibraryMissing
from parity.layout import STAGE_FLAGS


@dataclass(frozen=True)
class Row:
    name: str  # the flag value, the record's `strategy`, loss_<name>.json, train_<name>.py
    label: str  # how reports name it
    path: str  # "module:Class"
    default: bool  # run by the main job and the layer check by default


ROWS = (
    Row("ddp", "DDP", "ddp_strategy:DDPStrategy", True),
    Row("deepspeed", "DeepSpeed", "autotp_strategy:DeepSpeedStrategy", True),  # the design card's file name
    Row("fsdp", "FSDP", "fsdp_strategy:FSDPStrategy", True),
    Row("pipeline", "Pipeline", "pipeline_strategy:PipelineStrategy", False),
    Row("transformers", "transformers", "transformers_strategy:TransformersStrategy", False),  # its own TP and FSDP2
)
NAMES = tuple(r.name for r in ROWS if r.default)  # the default set, in run order (ddp first: the baseline)
KNOWN = tuple(r.name for r in ROWS)
LABELS = {r.name: r.label for r in ROWS}
_BY_NAME = {r.name: r for r in ROWS}
_BY_PATH = {r.path: r for r in ROWS}


def label(name: str) -> str:
    """How reports name a strategy; a name the harness does not know is shown as it is."""
    return LABELS.get(name, name)


def pp_size_of(config: dict) -> int:
    """The pipeline ranks per model replica of a run (its config or dump metadata): 1 without a pipeline."""
    return config.get("pp_size", 1)


def run_label(name: str, config: dict) -> str:
    """A run's name in reports with its layout: "FSDP (TP=2, DP=2)", "Pipeline (PP=2, DP=2)", "FSDP (TP=1, DP=4,
    EP=2)", a recorded megatron-core run "(TP=2, PP=2, DP=1)" (its pipeline and experts in its sharding's mesh: the
    record, as its replay, has none)."""
    mesh = mesh_of(config)
    pp, tp = max(pp_size_of(config), mesh.get("pp", 1)), config["tp_size"]
    ep = max(config.get("ep_size", 1), mesh.get("ep", 1))
    layout = f"TP={tp}, PP={pp}" if pp > 1 and tp > 1 else f"PP={pp}" if pp > 1 else f"TP={tp}"
    layout += f", VPP={mesh['vpp']}" if mesh.get("vpp", 1) > 1 else ""
    return f"{label(name)} ({layout}, DP={config['dp_size']}{f', EP={ep}' if ep > 1 else ''})"


def mesh_of(config: dict) -> dict[str, int]:
    """A recorded run's device mesh as the record's schema holds it, {dim name: size} (empty where none was recorded);
    a record of an earlier release held an FSDP2 mesh as a list of sizes, read here with its dims unnamed."""
    mesh = (config.get("sharding") or {}).get("mesh") or {}
    return mesh if isinstance(mesh, dict) else {f"dim{i}": n for i, n in enumerate(mesh)}


def row(name: str) -> Row:
    """The row named `name`; ConfigError for a name the table does not hold."""
    if name not in _BY_NAME:
        raise ConfigError(f"unknown strategy '{name}': use one of {', '.join(KNOWN)}")
    return _BY_NAME[name]


def path_of(strategy: str) -> str:
    """The class path of a strategy as a command names it: a row's name, or "module:Class" as it is."""
    return strategy if ":" in strategy else row(strategy).path


def class_path(cls) -> str:
    """"module:Class", the path `load` loads `cls` by."""
    return f"{cls.__module__}:{cls.__qualname__}"


def load(path: str):
    """The Strategy subclass at "module:Class". A row's class whose library cannot be imported raises LibraryMissing;
    any other path ConfigError when it cannot be imported or is not a Strategy subclass. The module must be importable
    where the run's workers start (installed, or on PYTHONPATH)."""
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ConfigError(f"--strategy_class {path}: expected module:Class (e.g. my_strategy:MyStrategy)")
    try:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except ImportError as exc:
        if path in _BY_PATH:
            raise LibraryMissing(_BY_PATH[path].name, exc) from None
        raise ConfigError(f"--strategy_class {path}: cannot import {module_name} ({exc}): put its folder on "
                          f"PYTHONPATH (or install it) where the driver and the workers run") from None
    except AttributeError:
        raise ConfigError(f"--strategy_class {path}: {module_name} has no {qualname}") from None
    # A Strategy subclass's module imported parity.training.strategy already: the base is read, not imported, here.
    base = getattr(sys.modules.get("parity.training.strategy"), "Strategy", None)
    if base is None or not (isinstance(obj, type) and issubclass(obj, base)) or obj is base:
        raise ConfigError(f"--strategy_class {path} is not a subclass of parity.training.strategy.Strategy")
    return obj


def classes() -> list:
    """Every row's class, in the table's order (for their flags: each strategy's own options)."""
    return [load(r.path) for r in ROWS]


def module_folder(path: str) -> str | None:
    """The folder Ray Train's workers need on their PYTHONPATH to import a strategy class at `path`
    ("module:Class") as the driver did: its top-level module's, unless that is installed (site-packages) or one
    of the harness's own (the parity package, the top-level strategy modules: every worker imports them
    already). On a cluster of other machines the folder must be there too: a Ray job's working_dir is, or
    install the module."""
    import importlib.util
    import os
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
    """Every strategy's own flags: {option name: the strategy that has it}, in the table's order; and the layout flags
    only a strategy with pipeline stages takes (parity.layout.STAGE_FLAGS: --pp_size), to the first such row's."""
    stages = {flag: r.name for r, cls in reversed(list(zip(ROWS, classes()))) if cls.pipeline_parallel
              for flag in STAGE_FLAGS}
    return {**stages, **{option.name: r.name for r, cls in zip(ROWS, classes()) for option in cls.options}}


def flags_for(strategy: str, given: dict) -> dict:
    """`given` without the other strategies' own flags: the run flags and `strategy`'s options."""
    owners = option_owners()
    return {k: v for k, v in given.items() if owners.get(k, strategy) == strategy}


def unrun_option(given: dict, strategies: list[str]) -> tuple[str, str] | None:
    """(flag, strategy) for the first flag in `given` that belongs to a strategy not in `strategies`."""
    return next(((k, s) for k, s in option_owners().items() if k in given and s not in strategies), None)
