"""The process group around a recorder: a gloo group of one for a run of one process that has none — a loop of your
own that never calls init_process_group, Trainer without a launcher, Lightning's single-device strategy — which the
recorder starts (its exchange is a collective) and ends at its close(); and, from that close, a reference to the
default gloo group held to the process's exit (`hold_group`).

Why. Over gloo a collective's Work is still held, after it returned, by one of the group's `pt_gloo_runloop`
threads, which releases it a moment later: the tensors it holds — Python-made, the recorder's — then drop their Python
objects from that thread, which must take the GIL to do it. Where the main thread holds the GIL meanwhile in a call
that waits for that thread, the process hangs or dies:
- the group destroyed with the GIL held: the PyTorch DDP tutorial's loop calls `dist.destroy_process_group()` and
  returns, and DDP's Reducer, the group's last owner, joins the group's threads in its destructor, which pybind runs
  without letting the GIL go. A recorded copy of it (torchrun, 2 ranks, gloo) hung in 4 runs of 12 on this 2-core
  machine, the rank's main thread in ProcessGroupGloo's destructor, a thread in AsyncAllgatherWork's, waiting for the
  GIL. Waiting at close() for the threads to let go does not do: under load one of them still held a Work after a
  collective of the recorder's own, issued after it, had been released (1 close in 10 in the suite);
- the interpreter's finalization reached first (Trainer, Lightning and DeepSpeed keep their groups past the loop):
  CPython ends a thread that asks for the GIL then, the forced unwind meets the Work's noexcept destructor and the rank
  aborts ("terminate called without an active exception"; about one run in ten of examples/hf_trainer.py --nproc 2).
Held by the recorder, the group outlives DDP's Reducer; at the process's exit (atexit, before finalization) a pause
with the GIL free lets the threads finish, and the reference is dropped from Python, whose holder destroys the group —
joining its threads — with the GIL released.
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

PAUSE_S = 0.2  # at a process's exit, once; the threads need the GIL for microseconds

_held: list = []  # the default gloo groups a recorder closed over, to this process's exit


def own_group(world_size: int) -> bool:
    """A gloo group of one where the run is one process without a group; whether it was started here."""
    if dist.is_initialized() or world_size != 1:
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def hold_group() -> None:
    """Where the default group is gloo: a reference to it, held to this process's exit (once a group)."""
    if not (dist.is_initialized() and dist.get_backend() == "gloo"):
        return
    group = dist.group.WORLD
    if any(held is group for held in _held):
        return
    if not _held:
        atexit.register(_let_go)
    _held.append(group)


def _let_go() -> None:
    """At exit: a pause with the GIL free, then the groups dropped (each destroyed, its threads joined, the GIL
    released)."""
    time.sleep(PAUSE_S)
    _held.clear()


def release(own: bool) -> None:
    """After the recorder closed: the group started here ended (from Python: its threads joined with the GIL
    released), the loop's own held (hold_group)."""
    if own:
        dist.destroy_process_group()
    else:
        hold_group()
