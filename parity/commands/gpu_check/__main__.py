"""`python -m parity.commands.gpu_check`: the GPU check (check.py)."""

import sys

from parity.commands.gpu_check.check import main

sys.exit(main())
