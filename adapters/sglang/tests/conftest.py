"""Test setup: a torchvision stand-in before SGLang is imported, trace location."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _torchvision_stub import install  # noqa: E402

install()
os.environ.setdefault("SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK", "1")

import torch  # noqa: E402

# The flows index small tensors thousands of times; on a loaded 2-core machine
# intra-op threads make each ``buf[idx] = x`` ~1000x slower (28 ms vs 0.03 ms).
torch.set_num_threads(1)

REPO_ROOT = HERE.parent.parent.parent


def shared_traces() -> Path | None:
    """``../shared/traces`` relative to the repository root (or ``$HYBRIDKV_TRACES``)."""
    env = os.environ.get("HYBRIDKV_TRACES")
    path = Path(env) if env else REPO_ROOT.parent / "shared" / "traces"
    return path if path.is_dir() else None


def publish_test_server_args(**fields):
    """Publish SGLang's default (dummy-model) server args, as its own unit tests do.

    Scheduler helpers read config bags (``get_serving()``, ``get_memory()``);
    returns the override object (call ``restore()`` to undo).
    """
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(**fields)
    override.install()
    return override
