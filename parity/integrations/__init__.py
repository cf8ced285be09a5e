"""Where the modules of parity.integrations went (release 0.1's names): a script that still imports one gets the
module it moved to, and a FutureWarning, once per name, saying where it went and what to import instead — the public
names come from `parity` itself (parity/__init__.py). Nothing here is used by the harness."""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {  # parity.integrations.<old> → where it lives now (docs/architecture.md)
    **{name: f"parity.recording.{name}" for name in (
        "recorder", "rows", "batch_taking", "states", "recorded_tensors", "world", "group",
        "optimizer_description", "dump", "resume", "recorded_objective")},
    "sharded": "parity.views.table", "adapters_record": "parity.views.adapters",
    **{name: f"parity.attaching.{name}" for name in ("attach", "import_hook", "layer_cut", "model_builders", "launch")},
    **{name: f"parity.replay.{name}" for name in ("replay", "replay_choice", "objective_replay")},
    "transformers": "parity.frameworks.transformers.callback",
    "trainer_hook": "parity.frameworks.transformers.trainer_hook",
    "lightning": "parity.frameworks.lightning.callback",
    "lightning_factory": "parity.frameworks.lightning.factory",
    "trl_objectives": "parity.frameworks.trl.objectives",
    "torchtitan": "parity.frameworks.torchtitan.recording",
    "titan_layout": "parity.frameworks.torchtitan.view",
    "titan_config": "parity.frameworks.torchtitan.config",
}
PUBLIC_INSTEAD = {"recorder": "from parity import ParityRecorder", "transformers": "from parity import ParityCallback",
                  "lightning": "from parity import ParityLightningCallback", "launch": "from parity import launch"}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds parity.integrations.<old> and loads a stand-in that reads every attribute from the module it moved to."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.rpartition(".")[2]
        if fullname.startswith(__name__ + ".") and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        old = spec.name.rpartition(".")[2]
        instead = PUBLIC_INSTEAD.get(old, f"import {MOVED[old]}")
        warnings.warn(f"{spec.name} moved to {MOVED[old]}: {instead}", FutureWarning, stacklevel=2)
        moved = importlib.import_module(MOVED[old])
        stand_in = types.ModuleType(spec.name, moved.__doc__)
        stand_in.__getattr__ = lambda name: getattr(moved, name)
        return stand_in

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved())
