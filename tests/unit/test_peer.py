"""Server-to-server transfers, the parts without sockets (genie.remote.peer, sched.LoadMeter):
values packed as storage spans plus geometry and read back with aliasing and math bits intact;
every malformed or out-of-bounds geometry refused before a tensor is made; tickets bound to the
session, nonce, ids, dtypes and shapes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from genie.remote import ProtocolError  # noqa: E402
from genie.remote.peer import (  # noqa: E402
    Geometry,
    pack_values,
    read_geometry,
    read_values,
    session_id,
    ticket,
)
from genie.remote.sched import LoadMeter  # noqa: E402

CPU = torch.device("cpu")


def _roundtrip(values: list[torch.Tensor]) -> list[torch.Tensor]:
    geo, frames, nbytes = pack_values(values)
    assert nbytes == sum(len(memoryview(f).cast("B")) for f in frames)
    return read_values(read_geometry([g.wire() for g in geo], len(frames)), frames, CPU)


def test_values_sharing_a_storage_share_one_after_the_transfer() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    view, col = base.t(), base[:, 2]
    ints = base.view(torch.int32)[1:3]  # another dtype over the same bytes
    other = torch.randn(5)
    got = _roundtrip([base, view, col, ints, other])
    for a, b in zip(got, [base, view, col, ints, other], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    ptrs = {t.untyped_storage().data_ptr() for t in got[:4]}
    assert len(ptrs) == 1 and got[4].untyped_storage().data_ptr() not in ptrs
    got[0][0, 2] = -1.0  # a write through the base is seen by the views, as on the sender
    assert got[1][2, 0] == -1.0 and got[2][0] == -1.0


def test_only_the_span_the_values_use_travels() -> None:
    big = torch.zeros(1 << 16)
    geo, frames, nbytes = pack_values([big[1000:1010]])
    assert nbytes <= 10 * 4 + 16
    assert torch.equal(read_values(geo, frames, CPU)[0], big[1000:1010])


def test_math_bits_and_empty_values_survive() -> None:
    z = torch.randn(3, dtype=torch.complex64)
    got = _roundtrip([z.conj(), torch._neg_view(z), torch.empty(0, 3)])
    assert got[0].is_conj() and torch.equal(got[0].resolve_conj(), z.conj().resolve_conj())
    assert got[1].is_neg() and torch.equal(got[1].resolve_neg(), -z)
    assert got[2].shape == (0, 3)


@pytest.mark.parametrize("geo,why", [
    ([[0, "float32", [4], [1], 1, 0]], "reaches byte"),          # one element past the span
    ([[0, "float32", [2, 2], [4, 1], 0, 0]], "reaches byte"),    # strides past the span
    ([[1, "float32", [1], [1], 0, 0]], "names no frame"),
    ([[0, "qint8", [1], [1], 0, 0]], "cannot be sent"),
    ([[0, "float32", [-1], [1], 0, 0]], "bad value shape"),
    ([[0, "float32", [2], [1, 1], 0, 0]], "bad value shape"),
    ([[0, "float32", [1], [1], -4, 0]], "bad value offset"),
    ([[0, "float32", [1], [1], 0, 9]], "bad value offset"),
    ([[0, "float32", [1]]], "bad value geometry"),
    ([], "1 to"),
])
def test_bad_geometry_is_refused_before_any_tensor(geo, why) -> None:
    frames = [bytes(16)]
    with pytest.raises(ProtocolError, match=why):
        read_values(read_geometry(geo, len(frames)), frames, CPU)


def test_tickets_bind_session_nonce_ids_dtypes_and_shapes() -> None:
    tok = b"t" * 16
    signed = [["float32", [2, 3]]]
    t = ticket(tok, 1, [5], signed)
    assert len(t) == 16 and len(session_id(tok)) == 8 and session_id(tok) != session_id(b"u" * 16)
    for other in (ticket(b"u" * 16, 1, [5], signed), ticket(tok, 2, [5], signed),
                  ticket(tok, 1, [6], signed), ticket(tok, 1, [5], [["float64", [2, 3]]]),
                  ticket(tok, 1, [5], [["float32", [3, 2]]])):
        assert other != t
    assert Geometry(0, torch.float32, (2, 3), (3, 1), 0, 0).signed() == signed[0]


def test_load_meter_counts_other_sessions_busy_time() -> None:
    m = LoadMeter(window=0.4)
    assert m.load(b"a") == 0.0
    done = threading.Event()

    def busy() -> None:
        m.begin(b"b")
        done.wait(5)
        m.end()

    th = threading.Thread(target=busy)
    th.start()
    time.sleep(0.25)
    assert m.load(b"a") > 0.4  # b's running request counts for a ...
    assert m.load(b"b") == 0.0  # ... not for b itself
    done.set()
    th.join()
    time.sleep(0.5)
    assert m.load(b"a") == 0.0  # out of the window
