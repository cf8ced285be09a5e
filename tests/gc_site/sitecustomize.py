"""Imported at start-up by every Python process the suite starts (conftest puts this folder first on PYTHONPATH): the
examples' and the tests' scripts and the ranks they spawn — a user's processes, which the harness leaves at CPython's
thresholds — import torch, transformers, Lightning or vLLM under fewer garbage collections, as the harness's own
processes do (parity/gc_thresholds.py: ~1 CPU-s of each one's start-up; docs/benchmark.md#the-collector-while-a-process-imports).
The thresholds move when the collector runs, never what a run computes. The harness's processes still set CPython's own
back before they train (usual_collections: the thresholds recorded here are CPython's). Where the process's Python
cannot import parity, nothing changes."""

try:
    from parity.gc_thresholds import fewer_collections
except ImportError:
    pass
else:
    fewer_collections()
