"""Shared set-up of the model families' tests."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _few_threads() -> Iterator[None]:
    """One torch thread per test: tiny models run fastest so, and tests stay steady on 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
