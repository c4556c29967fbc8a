"""A worker's guess at a structure's next call (issue 27, docs/deployment.md "Guessed calls").

When a structure's integers moved by the same steps in its last two vetted calls (a decode step:
the KV length one more each call), the worker vets the call that moves them once more right after
its reply, while the client records it, so that call replays without a vet. Here the class builds
are off (``GENIE_SERVER_CLASS_BUILD=off``), so each call's vetting is the guess's alone. Eager is
the oracle for values; the attacker who knows the worker guesses steers the guess past a value's
storage and meets the concrete vet's refusal, never a kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

import genie

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from test_remote import ServerProc  # noqa: E402
from test_security import A1, Session  # noqa: E402
from test_shape_class import STRIDED, _reply_tensor, _resident  # noqa: E402

DEV = "remote_accelerator:0"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    os.environ["GENIE_SERVER_CLASS_BUILD"] = "off"
    try:
        s = ServerProc(tmp_path_factory.mktemp("genie-guess-keys"), "--quota", "64MiB")
    finally:
        os.environ.pop("GENIE_SERVER_CLASS_BUILD", None)
    yield s
    assert s.stop() == 0


@pytest.fixture
def remote(server: ServerProc):
    genie.connect(server.address, key_file=str(server.key_file), timeout=60)
    yield server
    genie.disconnect()


def _attend(x: torch.Tensor, cache: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """One decode step of a hand-written attention: the KV cache grows by one row a call."""
    k = torch.cat([cache[0], x @ w], dim=0)
    cache[0] = k
    return torch.softmax(x @ k.t(), dim=-1) @ k


def test_a_steady_decode_loop_is_guessed_and_equals_eager(remote) -> None:
    torch.manual_seed(0)
    w, x, k0 = torch.randn(8, 8), torch.randn(1, 8), torch.randn(3, 8)
    wd, xd = w.to(DEV), x.to(DEV)
    got, want = [k0.to(DEV)], [k0]
    genie.reset_stats()
    for _ in range(12):
        assert torch.equal(_attend(xd, got, wd).cpu(), _attend(x, want, w))
    s = genie.stats()
    assert s.get("server_predicted_hits", 0) >= 6, s  # every call from the fourth or fifth
    assert s.get("server_vets", 0) <= 4, s


def test_a_wrong_guess_costs_only_its_time(remote) -> None:
    """The steps change (one row a call, then two): the call the worker guessed never comes;
    the one that does is vetted, and its values are eager's."""
    torch.manual_seed(1)
    w, k0 = torch.randn(8, 8), torch.randn(3, 8)
    wd = w.to(DEV)
    got, want = [k0.to(DEV)], [k0]
    for rows in (1, 1, 1, 1, 1, 2, 2, 2, 2):
        x = torch.randn(rows, 8)
        assert torch.equal(_attend(x.to(DEV), got, wd).cpu(), _attend(x, want, w))


def test_a_guess_steered_past_a_values_storage_admits_nothing(server: ServerProc) -> None:
    """An attacker moves ``as_strided(x, [n], [1])`` by one element a call over one resident
    8-element value: the guesses for n <= 8 are right and replay; the guess for n = 9 fails its
    check, so the call with n = 9 is vetted, and refused, as it is without guesses."""
    sess = Session(server)
    try:
        hid = _resident(sess, torch.arange(8.0))

        def strided(n: int) -> dict | None:
            return sess.run(["aten::as_strided.default", "aten::clone.default"],
                            [[0, 0, [0, -1, -1], [1], [], False], [1, 1, [1], [2], [1], False]],
                            [hid, n, 1], inputs=(0,), outputs=(2,), specs=[STRIDED, A1])

        seen = []
        for n in range(2, 9):
            r = strided(n)
            assert r and r["t"] == "ok", r
            assert torch.equal(_reply_tensor(sess, r), torch.arange(float(n)))
            seen.append(r["vt"])
        assert seen[-1] == "predicted", seen
        r = strided(9)
        assert r and r["t"] == "err" and r["kind"] == "exec", r
        assert "storage" in r["msg"] or "bounds" in r["msg"], r["msg"]
        r = strided(8)  # and the session goes on
        assert r and r["t"] == "ok", r
    finally:
        sess.close()
