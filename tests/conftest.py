"""Shared fixtures: every test starts with the kill switch off and a fresh fake clock."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

import safecompile
from safecompile.testing import FakeClock

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


@pytest.fixture(autouse=True)
def _clean_switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test leaks a kill-switch setting into the next."""
    monkeypatch.delenv(safecompile.ENV_VAR, raising=False)
    safecompile.enable()
    yield
    safecompile.enable()


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when the test says so."""
    return FakeClock()


@pytest.fixture
def x() -> torch.Tensor:
    """A small input."""
    return torch.randn(4, 8)
