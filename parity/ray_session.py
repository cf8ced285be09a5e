"""Whether this process has started or joined Ray, and the node it runs on: asked without importing Ray.

Below both the driver (parity/driver/cluster.py starts or joins Ray) and the worker (parity/training/ runs inside
it, or in a local process group without it), so that neither imports the other for these questions.
"""

from __future__ import annotations

import platform
import sys


def ray_is_up() -> bool:
    """Whether this process has started or joined Ray, asked without importing Ray (about a CPU-second, which a
    local group's rank, never in Ray, would otherwise pay)."""
    return sys.modules.get("ray") is not None and sys.modules["ray"].is_initialized()


def node_name() -> str:
    """This process's node: Ray's node id in a Ray process (a Ray Train worker), the host name elsewhere."""
    return sys.modules["ray"].get_runtime_context().get_node_id() if ray_is_up() else platform.node()
