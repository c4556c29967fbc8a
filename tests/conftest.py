"""Shared fixtures: every test starts with zeroed counters and the embedded CPU default.

With ``GENIE_SERVER`` set, the same tests run through a Genie server; the run's total of round
trips is printed at the end, so a caller can tell that the server was really used.
"""

import os

import pytest
import torch

import genie

DEV = "remote_accelerator:0"
_round_trips = [0]


@pytest.fixture(autouse=True)
def _fresh_stats():
    genie.reset_stats()
    yield
    _round_trips[0] += genie.stats().get("round_trips", 0)


@pytest.fixture
def dev() -> torch.device:
    return torch.device(DEV)


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("GENIE_SERVER"):
        terminalreporter.write_line(
            f"genie: {_round_trips[0]} round trips to {os.environ['GENIE_SERVER']}")
