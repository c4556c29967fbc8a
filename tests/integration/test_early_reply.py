"""Early replies through a loopback server (docs/deployment.md, "Early replies").

A session's worker answers a replayed tape as soon as its outputs are final and runs the rest
after the answer: in the standard training loop (``loss.item()`` after ``opt.step()``, one tape
per step) the loss goes back before the step's backward and update have run, and the client
records the next step meanwhile. Eager on the CPU is the oracle: losses, parameters and a value
that the rest of the step writes must be eager's, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import genie

zmq = pytest.importorskip("zmq")

from test_remote import ServerProc, remote  # noqa: E402,F401 - connects to this module's server

DEV = "remote_accelerator:0"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = ServerProc(tmp_path_factory.mktemp("genie-early-keys"), "--quota", "64MiB")
    yield s
    assert s.stop() == 0, "genie-server did not shut down cleanly on SIGTERM"


def _loop(dev: str, steps: int, probe: bool = False) -> tuple[list[float], list[torch.Tensor]]:
    """The standard loop on ``dev``: losses (or, with ``probe``, a row of the first weight,
    read after each step through a view taken before it) and the parameters after."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)).to(dev)
    x, y = torch.randn(6, 8).to(dev), torch.randn(6, 4).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    row = model[0].weight[0]  # a view of a parameter that every step writes
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append(row.detach().cpu().clone() if probe else loss.item())  # (cpu: a copy)
    return out, [p.detach().cpu() for p in model.parameters()]


def test_each_loss_goes_back_early_and_the_loop_is_eagers(remote) -> None:
    before = genie.stats().get("server_early_replies", 0)
    losses, params = _loop(DEV, 6)
    early = genie.stats().get("server_early_replies", 0) - before
    want_losses, want_params = _loop("cpu", 6)
    assert losses == want_losses
    for p, q in zip(params, want_params, strict=True):
        assert torch.equal(p, q)
    # the first steps run guarded and are compiled; from then on every step is answered early
    assert early >= 3, genie.stats()


def test_a_value_the_rest_of_a_step_writes_is_answered_after_it(remote) -> None:
    """A view of a weight read after ``opt.step()``: its value is the update's, so the worker
    may not answer before the update has run (the view's storage is an input the step writes)."""
    rows, params = _loop(DEV, 5, probe=True)
    want_rows, want_params = _loop("cpu", 5, probe=True)
    for r, w in zip(rows, want_rows, strict=True):
        assert torch.equal(r, w)
    for p, q in zip(params, want_params, strict=True):
        assert torch.equal(p, q)


def test_a_sync_pings_only_while_the_rest_of_an_answered_tape_may_run(remote) -> None:
    """``synchronize()`` waits for the rest of a tape answered early (a sync ping, through the
    worker). When every answer since the last sync was a whole run's, the session's worker has
    nothing left to do and the sync sends nothing: a program that reads a value per call and
    synchronizes after it (bench_compile's server rows) pays one round trip a call, not two."""
    s = genie.stats
    _loop(DEV, 6)  # its steps answered early
    rt = s().get("round_trips", 0)
    torch.remote_accelerator.synchronize()
    assert s()["round_trips"] == rt + 1  # the sync ping
    x = torch.arange(16.0).to(DEV)
    vals = [(x * i).sum().item() for i in range(3)]  # each read's tape ends at its output
    assert vals == [(torch.arange(16.0) * i).sum().item() for i in range(3)]
    early, rt = s().get("server_early_replies", 0), s()["round_trips"]
    here = s().get("syncs_answered_here", 0)
    for _ in range(2):
        torch.remote_accelerator.synchronize()
    assert s()["round_trips"] == rt and s().get("server_early_replies", 0) == early
    assert s()["syncs_answered_here"] == here + 2
    _loop(DEV, 6)
    rt = s()["round_trips"]
    torch.remote_accelerator.synchronize()  # the last step's rest: waited for again
    assert s()["round_trips"] == rt + 1


def test_the_session_reports_what_the_rest_of_a_step_kept(remote) -> None:
    """An early reply cannot say what the rest of its tape keeps; the next answer does (here
    ``synchronize``'s), and what the rest wrote is there: gradients and parameters read back
    after the loop are eager's."""
    def steps(dev: str) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(dev)
        x = torch.randn(6, 8).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            loss.item()
        return model

    model, want = steps(DEV), steps("cpu")
    before = genie.stats().get("server_early_replies", 0)
    torch.remote_accelerator.synchronize()
    assert genie.stats().get("server_early_replies", 0) == before  # (a sync is not a run)
    assert genie.stats()["resident_tensors"] > 0  # the sync's answer carries the residency
    for p, q in zip(model.parameters(), want.parameters(), strict=True):
        assert torch.equal(p.grad.cpu(), q.grad)
        assert torch.equal(p.detach().cpu(), q.detach())
