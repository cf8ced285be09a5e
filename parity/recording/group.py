"""The process group around a recorder: a gloo group of one for a run of one process that has none — a loop of your
own that never calls init_process_group, Trainer without a launcher, Lightning's single-device strategy — which the
recorder starts (its exchange is a collective) and ends at its close(); and at the exit of every process whose recorder
closed over gloo, a pause that lets the group's threads finish (`settle_at_exit`).

Why the pause. Trainer and Lightning never destroy their process group, DeepSpeed keeps its groups in module globals
past a loop's destroy_process_group, and the recorder's last collectives (close()'s, through all_gather_object) drop
Python-made tensors as soon as they return. Over gloo the Work is still held by one
of the group's `pt_gloo_runloop` threads, which releases it a moment later: the tensors' last reference then frees
their Python objects from that thread, which must take the GIL to do it. Where the main thread has reached the
interpreter's finalization by then, CPython ends a thread that asks for the GIL (pthread_exit), the forced unwind
meets the Work's noexcept destructor, and std::terminate aborts the process ("terminate called without an active
exception"): measured on examples/hf_trainer.py --nproc 2 in about one run in ten on this 2-core machine, a rank
killed by SIGABRT after its record was complete (gdb: AsyncAllgatherWork's destructor on pt_gloo_runloop, the main
thread in Py_FinalizeEx); seen once in five suites on examples/sharded_loop.py --shard zero2, whose command then
exited 1 and was not replayed. atexit callbacks run before finalization starts: a pause there, with the GIL free, lets
those threads finish.
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

PAUSE_S = 0.2  # at a process's exit, once; the threads need the GIL for microseconds

_registered = False


def own_group(world_size: int) -> bool:
    """A gloo group of one where the run is one process without a group; whether it was started here."""
    if dist.is_initialized() or world_size != 1:
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def settle_at_exit() -> None:
    """A pause at this process's exit where its default group is gloo (once, whatever the number of calls): the
    recorder's close() asks it after its last collectives."""
    global _registered
    if not _registered and dist.is_initialized() and dist.get_backend() == "gloo":
        atexit.register(time.sleep, PAUSE_S)
        _registered = True


def release(own: bool) -> None:
    """After the recorder closed: the group started here ended."""
    if own:
        dist.destroy_process_group()
