"""The direct path of genie.passes.pipeline.run: with ``eager`` the only backend, a steady read
of a cached plan (no decision left for its passes: pipeline.settled) runs in the eager backend
(its native program) without genie.backends.run and the passes' decisions, with the same values,
errors, binding and counters; anything not settled takes the general path."""

from __future__ import annotations

import pytest
import torch

import genie
from genie import backends, passes
from genie.backends import backend_order, set_backends
from genie.config import config
from genie.device import real_device
from genie.errors import ExecutionError
from genie.passes import pipeline

D = "remote_accelerator"
EAGER = str(real_device(0))

pytestmark = pytest.mark.usefixtures("fresh_passes")


@pytest.fixture(autouse=True)
def _eager_native():
    saved, mode = backend_order(), config.native_replay
    set_backends(["eager"])
    config.native_replay = "1"
    yield
    set_backends(saved)
    config.native_replay = mode


def _general_path_forbidden(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a settled steady read took the general path")

    monkeypatch.setattr(backends, "run", refuse)


def _general_path_counted(monkeypatch):
    calls = []
    run = backends.run
    monkeypatch.setattr(backends, "run", lambda *a: calls.append(1) or run(*a))
    return calls


def _read(x):
    return (x * 2 + 1).sum().item()


def test_a_steady_read_runs_its_native_program_directly(monkeypatch):
    x = torch.arange(16.0, device=D)
    want = _read(torch.arange(16.0, device=EAGER))
    for _ in range(3):  # a miss, then hits: the native program from the second use
        assert _read(x) == want
    _general_path_forbidden(monkeypatch)
    genie.reset_stats()
    for _ in range(3):
        assert _read(x) == want
    s = genie.stats()
    assert s["native_replays"] == 3 and s["plan_cache_hits"] == 3
    assert s["nodes_executed"] == 9 and s["materializations"] == 3


def test_a_plan_of_another_state_runs_under_it_on_the_direct_path(monkeypatch):
    passes.set_passes([])  # (a folded constant would keep the plan verifying for a while)
    saved = torch.get_default_dtype()

    def record(dev):
        torch.set_default_dtype(torch.float64)
        try:  # a factory and a division: the default dtype
            return torch.arange(4, device=dev) / 3 + torch.ones(4, device=dev)
        finally:
            torch.set_default_dtype(saved)

    want = record(EAGER)
    for i in range(5):
        if i == 3:
            _general_path_forbidden(monkeypatch)
        got = record(D).cpu()  # read under another state: its plan's state is set for the run
        assert got.dtype == torch.float64 and torch.equal(got, want)
        assert torch.get_default_dtype() == saved


def test_a_second_backend_takes_the_general_path(monkeypatch):
    set_backends(["compiled", "eager"])
    calls = _general_path_counted(monkeypatch)
    x = torch.arange(16.0, device=D)
    for _ in range(3):
        _read(x)
    assert len(calls) == 3


def test_a_plan_whose_passes_are_verified_takes_the_general_path(monkeypatch):
    monkeypatch.setenv("GENIE_PASSES_GATE", "0")
    passes.set_passes(["cse", "dce"])
    x = torch.ones(8, device=D)
    genie.materialize(x)
    calls = _general_path_counted(monkeypatch)
    ((x + 1).exp() + (x + 1).exp()).sum().item()  # its first run: the passes prepare, verify
    assert len(calls) >= 1


@pytest.mark.kernel_error
def test_an_error_on_the_direct_path_is_eagers_after_binding_what_ran(monkeypatch):
    def step(a, idx):
        a.add_(1)  # a write before the failing op, in the same tape
        return a.gather(0, idx).cpu()

    a = torch.zeros(3, device=D)
    ok = torch.tensor([1]).to(D)
    bad = torch.tensor([7]).to(D)
    genie.materialize(a, ok, bad)
    for _ in range(3):
        step(a, ok)
    _general_path_forbidden(monkeypatch)
    with pytest.raises(ExecutionError, match="gather.*failed on the device: RuntimeError") as e:
        step(a, bad)
    assert type(e.value.__cause__) is RuntimeError
    with pytest.raises(RuntimeError):  # what eager raises
        torch.zeros(3).gather(0, torch.tensor([7]))
    assert a.cpu().tolist() == [4.0, 4.0, 4.0]  # the write ran once, bound, not run again


def test_an_optimized_plan_in_state_on_runs_its_script_directly(monkeypatch):
    monkeypatch.setenv("GENIE_PASSES_GATE", "0")  # kept after verification (no timing noise)
    passes.set_passes(["cse", "dce"])
    x = torch.ones(8, device=D)
    genie.materialize(x)

    def read():
        return ((x + 1).exp() + (x + 1).exp()).sum().item()

    want = ((torch.ones(8) + 1).exp() * 2).sum().item()
    for _ in range(12):
        read()
    (st,) = [r for r in passes.report()]
    assert st.state == "on"
    _general_path_forbidden(monkeypatch)
    genie.reset_stats()
    for _ in range(3):
        assert read() == pytest.approx(want)
    s = genie.stats()
    # the optimized tape ran: one exp fewer than the tape (cse), natively
    assert s["native_replays"] == 3
    assert s["nodes_executed"] == 3 * (st.instrs_after)
    assert st.instrs_after < st.instrs_before


def test_a_waiting_plan_counts_its_waits_on_the_direct_path(monkeypatch):
    monkeypatch.setattr(pipeline, "_wait", [True])
    lengths = iter(range(3, 20))

    def read():
        n = next(lengths)  # a new shape each call: a shape-generic hit, whose passes wait
        return (torch.ones(n, device=D) * 2 + 1).sum().item()

    for _ in range(3):
        read()
    _general_path_forbidden(monkeypatch)
    genie.reset_stats()
    assert read() == 3.0 * 6
    s = genie.stats()
    assert s["passes_waiting"] == 1 and s["plan_cache_generic_hits"] == 1
