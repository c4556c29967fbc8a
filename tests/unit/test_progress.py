"""Progress messages (genie/progress.py): quiet by default, sizes and rates when enabled; the
``compiled`` backend's compilations report through it (remote transfers: test_transfers.py)."""

import logging

import pytest
import torch

import genie
import genie.progress as progress
from genie import backends, plan_cache
from genie.backends import compiled


def test_quiet_by_default(caplog):
    with caplog.at_level(logging.WARNING, logger="genie.progress"):
        with progress.waiting("compiling"), progress.transfer("upload", 1 << 30, "tcp://x"):
            pass
    assert not caplog.records


def test_waits_and_large_transfers_report_sizes_and_rates(caplog):
    with caplog.at_level(logging.INFO, logger="genie.progress"):
        with progress.waiting("compiling a plan of 12 ops"):
            pass
        with progress.transfer("upload", 100 << 20, "tcp://127.0.0.1:5555"):
            pass
        with progress.transfer("download", 1 << 10, "tcp://127.0.0.1:5555"):  # small: silent
            pass
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "genie: compiling a plan of 12 ops..."
    assert msgs[1].startswith("genie: compiling a plan of 12 ops: done in ")
    assert msgs[2] == "genie: upload of 100.0 MB to tcp://127.0.0.1:5555..."
    assert msgs[3].startswith("genie: upload of 100.0 MB to tcp://127.0.0.1:5555 done in ")
    assert "MB/s" in msgs[3] and len(msgs) == 4


@pytest.fixture
def compiled_backend():
    order, comp = backends.backend_order(), compiled.compiler()
    compiled.set_compiler("aot_eager")  # a real torch.compile, without a C++ toolchain
    backends.set_backends(["compiled", "eager"])
    plan_cache.clear()
    yield
    backends.set_backends(order)
    compiled.set_compiler(comp)
    plan_cache.clear()


def test_compiled_backend_reports_its_compilation_only_when_asked(compiled_backend, caplog):
    x = torch.randn(6, 5)
    with caplog.at_level(logging.WARNING, logger="genie.progress"):
        got = ((x.to("remote_accelerator") * 3).tanh() + 1).cpu()
    torch.testing.assert_close(got, (x * 3).tanh() + 1)
    assert genie.stats().get("compiled_plans", 0) >= 1
    assert not [r for r in caplog.records if r.name == "genie.progress"]
    plan_cache.clear()
    with caplog.at_level(logging.INFO, logger="genie.progress"):
        got = ((x.to("remote_accelerator") * 4).sin() - 1).cpu()
    torch.testing.assert_close(got, (x * 4).sin() - 1)
    msgs = [r.getMessage() for r in caplog.records if r.name == "genie.progress"]
    assert any(m.startswith("genie: compiling a plan of ") and m.endswith("...") for m in msgs)
    assert any("with torch.compile: done in " in m for m in msgs), msgs
