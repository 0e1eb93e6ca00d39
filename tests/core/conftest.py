from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.traces import default_shared_traces


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    path = default_shared_traces()
    if path is None:
        pytest.skip("the shared traces folder (../shared/traces beside the checkout) is absent")
    return path
