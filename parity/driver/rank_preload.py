"""Imported by a local group's forkserver (local_group.PRELOAD): the work each forked rank would otherwise repeat, done
once before the forks.

- Fewer garbage collections while it imports (parity/gc_thresholds.py: ~1 CPU-s of a server's start-up), the usual
  thresholds set back before any rank forks: the ranks collect as before.
- What every rank imports (RANK_IMPORTS; one that fails here is left to the rank). Not the strategy modules: a test
  copy of one on sys.path must win over the installed module, as it does in a spawned rank. pyarrow.fs writes the
  records; inductor is what DeepSpeed's initialize imports (its Muon optimizer's module calls torch.compile when
  imported: ~1 s per rank, its first setup went from 3 s to under 1) and what --compile uses.
- DeepSpeed, as a worker imports it (`import_deepspeed`: the CPU accelerator, without the mlflow its autotuner would
  import: 1.8 s here).
- The shared code's fingerprint (fingerprint.shared_files parses every module of the package): the ranks run the code
  this server imported and inherit the answer, computed over the same files.
- gc.freeze(): the ~540 000 objects the imports made leave the collector's generations, so that a full collection in
  a rank (the loop's after every run, and those its allocations set off) walks what the rank made, not them — 0.3 s
  each before, several a run. The objects are the modules', alive for the process's life anyway. The server itself
  unfreezes them when it exits (its ranks leave by os._exit): frozen, they outlive the interpreter's last collection,
  and triton's bindings then print "nanobind: leaked … instances" on the command's terminal after its last line.
"""

import atexit
import contextlib
import gc
import importlib

from parity.gc_thresholds import fewer_collections, usual_collections

RANK_IMPORTS = ("torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.pipelining",
                "transformers.models.qwen2.modeling_qwen2", "parity.training.loop", "pyarrow.fs",
                "torch._inductor.compile_fx")


def preload() -> None:
    """Everything above, in this server, once."""
    fewer_collections()  # before the imports: they are what it is for
    for module in RANK_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    import torch

    from parity.deepspeed_import import import_deepspeed
    from parity.fingerprint import shared_code_sha256

    with contextlib.suppress(ImportError):
        import_deepspeed(torch.device("cpu"))
    shared_code_sha256()
    gc.freeze()
    atexit.register(gc.unfreeze)
    usual_collections()


preload()
