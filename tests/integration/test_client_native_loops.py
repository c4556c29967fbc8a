"""A steady run's reply read and its handles booked natively (``genie._C._client_reply``,
``genie._C._client_book``, csrc/client_run.cpp) through a loopback server: the standard training
loop and a greedy decode loop, with the native paths on and off (``GENIE_CLIENT_NATIVE=0``, the
Python paths), against eager on the CPU, bit for bit. The native paths must take the steady
steps; every run booked natively is booked again by the Python path from the same state, which
must make the same handles and residency records (tests/unit/test_client_native.py and
test_client_book.py hold them against the Python paths for malformed input)."""

from __future__ import annotations

import pytest
import torch

import genie
from genie.config import config

zmq = pytest.importorskip("zmq")

from genie.remote import client as client_mod  # noqa: E402
from genie.remote.handle import Handle  # noqa: E402
from test_remote import ServerProc, remote  # noqa: E402,F401 - connects to this module's server

DEV = "remote_accelerator:0"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = ServerProc(tmp_path_factory.mktemp("genie-client-native-keys"))
    yield s
    assert s.stop() == 0, "genie-server did not shut down cleanly on SIGTERM"


_RES_SLOTS = ("role", "nbytes", "storage", "epoch", "source", "recipe", "slot", "evicted", "pins")


class _NoRelease:
    """The client of a handle the test made twice: its id is not freed on the server."""

    alive = False

    def _release(self, hid: int) -> None:
        pass


def _booked(kept, res) -> tuple:
    """A booking's handles and residency state, handles by id."""
    def res_of(h):
        return None if h.res is None else tuple(getattr(h.res, k) for k in _RES_SLOTS)
    return ([(s, h.id, id(h.client), id(h.meta), h.host, res_of(h)) for s, h in kept.items()],
            [(i, w() is not None and w().id) for i, w in res.live.items()],
            [(w() is not None and w().id, wn() if wn is not None else None, k)
             for w, wn, k in res.pending])


@pytest.fixture(params=[True, False], ids=["native", "python"])
def native(request, monkeypatch):
    monkeypatch.setattr(config, "client_native", request.param)
    orig = client_mod.Client._book
    checked = []

    def book(self, r):
        res = self.res
        live0, pending0, sized0 = dict(res.live), list(res.pending), dict(res._sized)
        n0 = genie.stats().get("client_native_books", 0)
        kept = orig(self, r)
        if genie.stats().get("client_native_books", 0) == n0:
            return kept
        after = (res.live, list(res.pending), res._sized)
        want = _booked(kept, res)
        res.live, res._sized = dict(live0), dict(sized0)
        res.pending[:] = pending0
        config.client_native = False
        try:
            kept_py = orig(self, r)
        finally:
            config.client_native = True
        assert _booked(kept_py, res) == want
        for s, h in kept_py.items():  # (made twice: the Python path's are dropped unfreed)
            if h is not kept[s]:
                assert type(h) is Handle
                h.client = _NoRelease()
        res.live, res._sized = after[0], after[2]
        res.pending[:] = after[1]
        r.kept = kept
        checked.append(len(kept))
        return kept

    monkeypatch.setattr(client_mod.Client, "_book", book)
    yield request.param
    if request.param:
        assert len(checked) >= 4, "no steady run was booked natively"
    else:
        assert not checked


def _train(dev: str, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4)).to(dev)
    x, y = torch.randn(6, 8).to(dev), torch.randn(6, 4).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def _decode(dev: str, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding with a growing cache: each token's argmax read back (``.item()``), its
    logits (a row of floats, ``.cpu()``) at the end."""
    torch.manual_seed(1)
    emb = torch.nn.Embedding(50, 16).to(dev)
    proj = torch.nn.Linear(16, 50).to(dev)
    cache = torch.zeros(1, 0, 16).to(dev)
    tok, out, logits = 3, [], None
    with torch.no_grad():
        for _ in range(steps):
            h = emb(torch.tensor([[tok]]).to(dev))
            cache = torch.cat([cache, h], dim=1)
            logits = proj(torch.tanh(cache.mean(dim=1)))
            tok = int(logits.argmax(dim=-1).item())
            out.append(tok)
    assert logits is not None
    return out, logits.cpu()


def test_training_loop(remote, native) -> None:
    before = genie.stats().get("client_native_replies", 0)
    losses, params = _train(DEV, 8)
    took = genie.stats().get("client_native_replies", 0) - before
    want_losses, want_params = _train("cpu", 8)
    assert losses == want_losses
    for p, q in zip(params, want_params, strict=True):
        assert torch.equal(p, q)
    if native:
        assert took >= 4, genie.stats()  # the steady steps' replies
    else:
        assert took == 0


def test_decode_loop(remote, native) -> None:
    before = genie.stats().get("client_native_replies", 0)
    toks, logits = _decode(DEV, 12)
    took = genie.stats().get("client_native_replies", 0) - before
    want_toks, want_logits = _decode("cpu", 12)
    assert toks == want_toks
    assert logits.dtype == want_logits.dtype and logits.shape == want_logits.shape
    assert logits.stride() == want_logits.stride()
    assert torch.equal(logits, want_logits)
    if native:
        assert took >= 6, genie.stats()
    else:
        assert took == 0
