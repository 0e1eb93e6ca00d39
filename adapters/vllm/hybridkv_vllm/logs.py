"""The adapter's logger, and hybridkv's own log lines routed into vLLM's.

vLLM configures the ``"vllm"`` logger (handler, format, ``VLLM_LOGGING_LEVEL``);
a logger outside that namespace has no handler in a vLLM server and its lines
never appear.  The connector and its save thread log through :data:`logger`
(``vllm.hybridkv_vllm.connector``); hybridkv's own loggers (``"hybridkv.*"``:
backend faults) are attached to vLLM's handlers by :func:`route_core_logs`
when the connector starts.  Plain :mod:`logging`: importable without vLLM.
"""

from __future__ import annotations

import logging

__all__ = ["logger", "route_core_logs"]

logger = logging.getLogger("vllm.hybridkv_vllm.connector")


def route_core_logs() -> None:
    """Give the ``"hybridkv"`` logger vLLM's handlers and level, once (a no-op
    when it has handlers already or vLLM has none).  O(handlers)."""
    core, vl = logging.getLogger("hybridkv"), logging.getLogger("vllm")
    if not core.handlers and vl.handlers:
        for h in vl.handlers:
            core.addHandler(h)
        core.setLevel(vl.level or logging.INFO)
        core.propagate = False
