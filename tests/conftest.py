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
def fresh_passes():
    """A test of genie.passes starts from an empty plan cache and leaves passes and the memory
    budget at their defaults (``pytestmark = pytest.mark.usefixtures("fresh_passes")``)."""
    from genie import passes, plan_cache
    from genie.passes import pipeline

    plan_cache.clear()
    pipeline.clear_reports()
    wait = pipeline._wait[0]
    pipeline._wait[0] = False  # a plan's passes prepared at its first run (GENIE_PASSES_WAIT=0)
    yield
    pipeline._wait[0] = wait
    passes.set_passes(None)
    passes.set_memory_budget(None)
    plan_cache.clear()


@pytest.fixture
def dev() -> torch.device:
    return torch.device(DEV)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "kernel_error: provokes an error only the kernel can see (an out-of-range index) "
        "on the real device; skipped where that device is CUDA")


def pytest_collection_modifyitems(config, items):
    """On CUDA an out-of-range index is a device-side assert, not an ``IndexError``: it leaves
    the process's CUDA context unusable (eager's too), and every later test in the process
    would fail. Tests that provoke one on purpose run where the real device is the CPU."""
    from genie.device import real_device

    if os.environ.get("GENIE_SERVER") or real_device(0).type != "cuda":
        return
    skip = pytest.mark.skip(reason="an out-of-range index on CUDA is a device-side assert that "
                            "poisons the process's CUDA context (as in eager); CPU only")
    for item in items:
        if "kernel_error" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("GENIE_SERVER"):
        terminalreporter.write_line(
            f"genie: {_round_trips[0]} round trips to {os.environ['GENIE_SERVER']}")
