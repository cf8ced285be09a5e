"""The garbage collector's thresholds while a harness process imports. Python 3.11's collector runs full collections
over the heap each time it grows by a quarter, and torch, transformers, DeepSpeed, Ray and megatron-core fill it by
hundreds of thousands of objects as they import: 30–40 % of such a process's start-up CPU on the test machine, ~1 CPU-s
a process (docs/benchmark.md#the-collector-while-a-process-imports). The harness's own processes — its commands, the
forkserver its local ranks fork from, its Ray workers on a local cluster, the tests' — collect less often while they import
(`fewer_collections`); a worker sets the thresholds it had back before it trains (`usual_collections`), so that a
cycle holding a device's tensors is freed as soon as it was before. A user's processes are left as they are."""

from __future__ import annotations

import gc

IMPORTING = (50_000, 50, 100)  # young collections every 50 000 allocations, not 700; a full one 100× rarer
_usual: tuple[int, int, int] | None = None


def fewer_collections() -> None:
    """Collect at IMPORTING's thresholds from here on (the thresholds before kept for usual_collections)."""
    global _usual
    if _usual is None:
        _usual = gc.get_threshold()
    gc.set_threshold(*IMPORTING)


def usual_collections() -> None:
    """The thresholds this process had before fewer_collections (nothing where it was not called)."""
    if _usual is not None:
        gc.set_threshold(*_usual)
