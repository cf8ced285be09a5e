"""The process group around a recorder: a gloo group of one for a run of one process that has none — a loop of your
own that never calls init_process_group, Trainer without a launcher, Lightning's single-device strategy — which the
recorder starts (its exchange is a collective) and ends at its close(); and, at that close, a wait until the group's
threads have let go of the recorder's collectives (`settle`).

Why the wait. Over gloo a collective's Work is still held, after it returned, by one of the group's `pt_gloo_runloop`
threads, which releases it a moment later: the tensors it holds — Python-made, the recorder's — then drop their Python
objects from that thread, which must take the GIL to do it. Where the main thread holds the GIL meanwhile in a call
that waits for that thread, the process hangs or dies:
- the group destroyed while the thread waits: the PyTorch DDP tutorial's loop — `dist.destroy_process_group()`, then
  its function returns and DDP's Reducer, the group's last owner, joins the group's threads with the GIL held. A
  recorded copy of it (torchrun, 2 ranks, gloo) hung in 4 runs of 12 on this 2-core machine, the rank's main thread in
  ProcessGroupGloo's destructor, the thread in AsyncAllgatherWork's, waiting for the GIL;
- the interpreter's finalization reached first (Trainer, Lightning and DeepSpeed keep their groups past the loop):
  CPython ends a thread that asks for the GIL then, the forced unwind meets the Work's noexcept destructor and the rank
  aborts ("terminate called without an active exception"; about one run in ten of examples/hf_trainer.py --nproc 2).
So close() ends with one collective of its own over a tensor it watches, and waits — the GIL free — until its Python
object is gone: the thread released that Work, and every earlier one, while it waited.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

SETTLE_S = 5.0  # the wait's cap; the threads need the GIL for microseconds
PAUSE_S = 0.2  # where no last collective can be made (a rank that stopped recording): a pause instead


def own_group(world_size: int) -> bool:
    """A gloo group of one where the run is one process without a group; whether it was started here."""
    if dist.is_initialized() or world_size != 1:
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def settle(every_rank: bool) -> float:
    """After the recorder's last collective, where the default group is gloo: the GIL let go until the group's threads
    have released their Works. `every_rank`: every rank is here (close() of a recorder that recorded to its end), so
    one more collective can show it — its tensor's Python object freed; else a pause of PAUSE_S. Returns the seconds
    waited (0.0: not gloo)."""
    if not (dist.is_initialized() and dist.get_backend() == "gloo"):
        return 0.0
    began = time.monotonic()
    if not every_rank:
        time.sleep(PAUSE_S)
        return time.monotonic() - began
    token = torch.zeros(1)
    dist.all_reduce(token)
    watched = weakref.ref(token)
    del token  # its last Python reference: the Work's release frees it
    while watched() is not None and time.monotonic() - began < SETTLE_S:
        time.sleep(0.001)
    return time.monotonic() - began


def release(own: bool) -> None:
    """After the recorder closed: the group started here ended."""
    if own:
        dist.destroy_process_group()
