"""The server's narrow opset through a real server (issue 27): decomposed by the client, refused
by the server, refused by name where no decomposition exists. See tests/unit/test_opset.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import genie

zmq = pytest.importorskip("zmq")

from genie.remote import protocol  # noqa: E402
from genie.remote.decompose import NotServedError  # noqa: E402
from test_remote import ServerProc  # noqa: E402
from test_security import A2, Session, err, host  # noqa: E402

DEV = "remote_accelerator:0"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = ServerProc(tmp_path_factory.mktemp("genie-opset-keys"), "--quota", "64MiB")
    yield s
    assert s.stop() == 0


@pytest.fixture
def remote(server: ServerProc):
    genie.connect(server.address, key_file=str(server.key_file), timeout=30)
    yield server
    genie.disconnect()


def _program(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Forward and backward through ops outside the opset (each has a decomposition)."""
    xr = x.clone().requires_grad_()
    h = F.celu(F.softshrink(xr, 0.2), 0.7) * y
    loss = torch.rot90(h).pow(2).sum() + torch.nansum(h) + torch.trace(h[:, :4])
    (g,) = torch.autograd.grad(loss, xr)
    return [h.detach(), loss.detach(), g]


def test_ops_outside_the_opset_run_decomposed_with_eagers_values(remote) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    want = _program(x, y)
    genie.reset_stats()
    got = [t.cpu() for t in _program(x.to(DEV), y.to(DEV))]
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert genie.stats().get("ops_decomposed_for_server", 0) >= 3


def test_an_op_without_decomposition_is_refused_by_name_at_the_materialization(remote) -> None:
    LU, piv = torch.linalg.lu_factor(torch.randn(3, 3))
    P, L, U = torch.lu_unpack(LU.to(DEV), piv.to(DEV))  # records
    with pytest.raises(NotServedError, match="lu_unpack") as ei:
        L.cpu()
    assert "allowlist.py" in str(ei.value)
    # the session is unharmed: the next value computes
    assert (torch.ones(2, device=DEV) * 3).sum().item() == 6.0


def test_the_server_refuses_an_op_outside_its_opset(server: ServerProc) -> None:
    s = Session(server)
    x = torch.arange(4.0)
    r = s.run(["aten::softshrink.default"], [[0, 0, [-1, -1], [0], [], False]],
              [host(x, 0), 0.5], (protocol.tensor_frame(x)[0],), specs=[A2])
    err(r, "protocol", "softshrink", "opset")
    s.alive()
    s.close()


def _experts(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """A mixture of experts as transformers' MoE layers run it on a non-CPU device: tokens sorted
    by expert, counted with an integral ``histc``, one grouped matmul, and its backward."""
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    order = torch.argsort(ids, stable=True)
    hist_in = ids.float() if ids.device.type == "cpu" else ids.int()  # as transformers does
    counts = torch.histc(hist_in, bins=w.shape[0], min=0, max=w.shape[0] - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = torch._grouped_mm(xr[order], wr, offs)
    loss = h.tanh().pow(2).sum()
    gx, gw = torch.autograd.grad(loss, (xr, wr))
    return [h.detach(), loss.detach(), gx, gw]


def test_a_mixture_of_experts_runs_decomposed_with_eagers_values(remote) -> None:
    torch.manual_seed(0)
    x, w, ids = torch.randn(10, 8), torch.randn(4, 8, 12) * 0.3, torch.randint(0, 4, (10,))
    want = _experts(x, w, ids)
    got = [t.cpu() for t in _experts(x.to(DEV), w.to(DEV), ids.to(DEV))]
    for wv, g in zip(want, got, strict=True):
        assert g.shape == wv.shape and g.dtype == wv.dtype
        torch.testing.assert_close(g, wv, rtol=1e-5, atol=1e-5)
