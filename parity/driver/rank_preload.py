"""Imported last by a local group's forkserver (local_group.PRELOAD), after what every rank imports: the work each
forked rank would otherwise repeat, done once before the forks.

- DeepSpeed, as a worker imports it (`import_deepspeed`: the CPU accelerator, without the mlflow its autotuner would
  import: 1.8 s here).
- The shared code's fingerprint (fingerprint.shared_files parses every module of the package): the ranks run the code
  this server imported and inherit the answer, computed over the same files.
- gc.freeze(): the ~600 000 objects the imports made leave the collector's generations, so that a full collection in
  a rank (the loop's after every run, and those its allocations set off) walks what the rank made, not them — 0.3 s
  each before, several a run. The objects are the modules', alive for the process's life anyway. The server itself
  unfreezes them when it exits (its ranks leave by os._exit): frozen, they outlive the interpreter's last collection,
  and triton's bindings then print "nanobind: leaked … instances" on the command's terminal after its last line.
"""

import atexit
import contextlib
import gc

import torch

from parity.fingerprint import shared_code_sha256
from parity.deepspeed_import import import_deepspeed

with contextlib.suppress(ImportError):  # an import that fails here is left to the rank
    import_deepspeed(torch.device("cpu"))
shared_code_sha256()
gc.freeze()
atexit.register(gc.unfreeze)
