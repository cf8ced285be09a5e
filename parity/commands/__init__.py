"""What each top-level script runs. Every command turns bad input into one line and exit 2 (`run_command`). A command's
process collects garbage less often while it imports (parity/gc_thresholds.py): it is the harness's own, never a
user's."""

from parity.gc_thresholds import fewer_collections

fewer_collections()
