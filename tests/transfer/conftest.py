"""Fixtures for the transfer-layer tests (helpers live in _transfer_helpers)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
