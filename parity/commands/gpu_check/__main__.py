"""`python -m parity.commands.gpu_check`: the GPU check (check.py)."""

from parity.commands.common import exit_now
from parity.commands.gpu_check.check import main

exit_now(main())
