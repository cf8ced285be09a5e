"""A process that recorded ends without aborting: the framework callbacks call `settle_at_exit` when their recorder
closes.

Trainer and Lightning never destroy their process group, and the recorder's last collectives (close()'s, through
all_gather_object) drop Python-made tensors as soon as they return. Over gloo the Work is still held by one of the
group's `pt_gloo_runloop` threads, which releases it a moment later: the tensors' last reference then frees their
Python objects from that thread, which must take the GIL to do it. Where the main thread has reached the
interpreter's finalization by then, CPython ends a thread that asks for the GIL (pthread_exit), the forced unwind
meets the Work's noexcept destructor, and std::terminate aborts the process ("terminate called without an active
exception"): measured on examples/hf_trainer.py --nproc 2 in about one run in ten on this 2-core machine, a rank
killed by SIGABRT after its record was complete (gdb: AsyncAllgatherWork's destructor on pt_gloo_runloop, the main
thread in Py_FinalizeEx). atexit callbacks run before finalization starts: a pause there, with the GIL free, lets
those threads finish.
"""

from __future__ import annotations

import atexit
import time

PAUSE_S = 0.2  # at a process's exit, once; the threads need the GIL for microseconds

_registered = False


def settle_at_exit() -> None:
    """Pause at this process's exit (once, whatever the number of calls) so that the process group's threads release
    the last collectives' tensors before the interpreter finalizes."""
    global _registered
    if not _registered:
        atexit.register(time.sleep, PAUSE_S)
        _registered = True
