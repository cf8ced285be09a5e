"""Whether the Hugging Face hub can be reached, asked once and quickly: on an offline machine the hub
libraries retry for half a minute before they fail, so a model, tokenizer or dataset name that only the
hub knows is rejected in seconds instead."""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0


@functools.lru_cache(maxsize=1)
def hub_unreachable() -> str | None:
    """None when the hub answers; else why not, in a few words."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{host}:{port} does not answer: {exc.strerror or type(exc).__name__}"
    return None
