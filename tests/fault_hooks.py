"""Test copies of the strategy modules with one fault at a known point. A copy under the real module's name is for a
run in a subprocess whose PYTHONPATH puts it first: the driver and every Ray worker import it instead of the real
module (the main job's strategies). A copy under a name of its own (`module`) is a user's strategy class for a run in
this process: `--strategy_class <module>:<Class>`, its folder on sys.path, and Ray Train ships it to the workers.
Each copy loads the real module from the repository and subclasses its strategy to do one thing before or
after the n-th call of one of its methods; nothing in the harness knows about them."""

from __future__ import annotations

import os

from conftest import REPO

MODULES = {"ddp": ("ddp_strategy", "DDPStrategy"), "deepspeed": ("autotp_strategy", "DeepSpeedStrategy"),
           "fsdp": ("fsdp_strategy", "FSDPStrategy")}

TEMPLATE = '''
import importlib.util
import os
import resource
import sys

_spec = importlib.util.spec_from_file_location("_real_{module}", {path!r})
_real = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # before it runs: its dataclasses look it up
_spec.loader.exec_module(_real)
globals().update({{k: v for k, v in vars(_real).items() if not k.startswith("__")}})


class {cls}(_real.{cls}):
    """The real strategy, with a fault {when} call number {call} of {method} in this process (a run that
    has not resumed calls train_step once per step, from step 0)."""

    def {method}(self, *args, **kwargs):
        self._calls = getattr(self, "_calls", -1) + 1
        fault = self._calls == {call}
        if fault and {before}:
            {fault}
        result = super().{method}(*args, **kwargs)
        if fault and not {before}:
            {fault}
        return result
'''

# Rank {rank} dies once (a marker file remembers it), after the checkpoint reported before it is committed:
# a checkpoint reported less than a controller poll before a death would otherwise be lost with it.
KILL = '''if self.ctx.rank == {rank} and not os.path.exists({marker!r}):
                import ray.train
                open({marker!r}, "w").close()
                ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
                os._exit(1)'''

# From here on no file this process writes may grow beyond {limit} bytes: the kernel refuses the write
# (EFBIG, "File too large") as a full disk refuses it (ENOSPC). The tests run as root, for whom no
# directory is read-only, and mounting a small filesystem would need privileges CI may not have.
# Once per rank (marker files remember it): the same command with --resume runs the same code without the fault.
FILE_SIZE_LIMIT = '''if not os.path.exists({marker!r} + str(self.ctx.rank)):
                open({marker!r} + str(self.ctx.rank), "w").close()
                resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))'''


def write_copy(directory, strategy: str, method: str, call: int, before: bool, fault: str,
               module: str | None = None) -> str:
    """Write the faulty copy of `strategy`'s module into `directory` (a PYTHONPATH entry), as `module`.py (default:
    the real module's name); returns the directory."""
    real, cls = MODULES[strategy]
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{module or real}.py"), "w") as f:
        f.write(TEMPLATE.format(module=real, cls=cls, path=os.path.join(REPO, f"{real}.py"), method=method,
                                call=call, before=before, when="before" if before else "after", fault=fault))
    return str(directory)


def kill_once(directory, strategy: str, step: int, rank: int = 1, module: str | None = None) -> str:
    """Rank `rank` dies before its train step `step`, once."""
    marker = os.path.join(str(directory), f"{strategy}.killed")
    return write_copy(directory, strategy, "train_step", step, True, KILL.format(rank=rank, marker=marker), module)


def file_size_limit(directory, strategy: str, method: str, call: int, before: bool, limit: int,
                    module: str | None = None) -> str:
    """Every rank's files stop growing beyond `limit` bytes before (or after) call `call` of `method`, once."""
    marker = os.path.join(str(directory), f"{strategy}.size_limited.")
    return write_copy(directory, strategy, method, call, before, FILE_SIZE_LIMIT.format(limit=limit, marker=marker),
                      module)


# A strategy that changed since a run: every step at twice the learning rate (a "fix" its user tries).
DOUBLE_LR = '''
import importlib.util
import sys

_spec = importlib.util.spec_from_file_location("_real_ddp_strategy", {path!r})
_real = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_real)
globals().update({{k: v for k, v in vars(_real).items() if not k.startswith("__")}})


class DDPStrategy(_real.DDPStrategy):
    def optimizer_step(self, lr):
        return super().optimizer_step(2 * lr)
'''
