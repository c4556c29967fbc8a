"""Shared fixtures: every test starts with zeroed counters and the embedded CPU default."""

import pytest
import torch

import genie

DEV = "remote_accelerator:0"


@pytest.fixture(autouse=True)
def _fresh_stats():
    genie.reset_stats()
    yield


@pytest.fixture
def dev() -> torch.device:
    return torch.device(DEV)
