"""First on the PYTHONPATH of a torchtitan job the tests launch as its users do (`torchrun … -m torchtitan.train
…`): every process of the job installs the tests' CPU changes (tests/titan_cpu.py says which and why), each made
when its torchtitan module is first imported. Under verify_trainer.py parity's own sitecustomize comes first and runs
this one, the one it shadows. It runs the one it shadows in turn, tests/gc_site's (fewer collections while the job
imports, as in every other process the suite starts)."""

import importlib.util
import os
import runpy
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
runpy.run_path(os.path.join(_TESTS, "gc_site", "sitecustomize.py"))
_PATH = os.path.join(_TESTS, "titan_cpu.py")
if "titan_cpu" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("titan_cpu", _PATH)
    sys.modules["titan_cpu"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["titan_cpu"])
sys.modules["titan_cpu"].install()
