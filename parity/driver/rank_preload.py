"""Imported last by a local group's forkserver (local_group.PRELOAD), after what every rank imports: the work each
forked rank would otherwise repeat, done once before the forks.

- The shared code's fingerprint (fingerprint.shared_files parses every module of the package): the ranks run the code
  this server imported and inherit the answer, computed over the same files.
- gc.freeze(): the ~600 000 objects the imports made leave the collector's generations, so that a full collection in
  a rank (the loop's after every run, and those its allocations set off) walks what the rank made, not them — 0.3 s
  each before, several a run. The objects are the modules', alive for the process's life anyway. The server itself
  unfreezes them when it exits (its ranks leave by os._exit): frozen, they outlive the interpreter's last collection,
  and triton's bindings then print "nanobind: leaked … instances" on the command's terminal after its last line.
"""

import atexit
import gc

from parity.fingerprint import shared_code_sha256

shared_code_sha256()
gc.freeze()
atexit.register(gc.unfreeze)
