"""Server-to-server transfers, the parts without sockets (genie.remote.peer, sched.LoadMeter):
values packed as storage spans plus geometry and read back with aliasing and math bits intact;
every malformed or out-of-bounds geometry refused before a tensor is made; tickets bound to the
session, nonce, ids and every field of each value's geometry; peers registered by address; the
load a ping reports covers the asking session's own principal only."""

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
    Peers,
    check_put,
    describe,
    pack_values,
    read_geometry,
    read_values,
    session_id,
    ticket,
    unheld_bytes,
)
from genie.remote.sched import LoadMeter  # noqa: E402

CPU = torch.device("cpu")


def _roundtrip(values: list[torch.Tensor]) -> list[torch.Tensor]:
    geo, frames, nbytes = pack_values(values)
    assert nbytes == sum(len(memoryview(f).cast("B")) for f in frames)
    got = read_geometry([g.signed() for g in geo], [g.group for g in geo], len(frames))
    assert got == geo  # the receiver derives the same offsets from what is signed
    return read_values(got, frames, CPU)


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


@pytest.mark.parametrize("v,g,why", [
    ([["float32", [5], [1], 0, 0]], [0], "reaches byte"),           # one element past the span
    ([["float32", [2, 2], [4, 1], 0, 0]], [0], "reaches byte"),     # strides past the span
    ([["float32", [1], [1], 0, 0]], [1], "names no frame"),
    ([["qint8", [1], [1], 0, 0]], [0], "cannot be sent"),
    ([["float32", [-1], [1], 0, 0]], [0], "bad value shape"),
    ([["float32", [2], [1, 1], 0, 0]], [0], "bad value shape"),
    ([["float32", [1], [1], -4, 0]], [0], "bad value offset"),
    ([["float32", [1], [1], 0, 9]], [0], "bad value offset"),
    ([["float32", [1], [1 << 62], 0, 0]], [0], "bad value shape"),
    ([["float32", [1]]], [0], "bad value geometry"),
    ([["float32", [1], [1], 0, 0]], [], "one per value"),
    ([], [], "1 to"),
])
def test_bad_geometry_is_refused_before_any_tensor(v, g, why) -> None:
    frames = [bytes(16)]
    with pytest.raises(ProtocolError, match=why):
        read_values(read_geometry(v, g, len(frames)), frames, CPU)


def test_offsets_are_derived_from_signed_storage_offsets() -> None:
    """Where a value starts in its frame is never sent: both ends derive it from the signed
    storage offsets (a span starts at its lowest value, rounded down to 16 bytes)."""
    base = torch.arange(40.0)
    a, b = base[7:9], base[20:30:3]
    geo, frames, _ = pack_values([a, b])
    assert [g.offset for g in geo] == [3, 16] and geo[0].so == 7 and geo[1].so == 20
    assert memoryview(frames[0]).nbytes == (29 - 4 + 1) * 4
    # a source that claims other offsets cannot: the receiver computes its own
    got = read_geometry([g.signed() for g in geo], [0, 0], 1)
    assert [g.offset for g in got] == [3, 16]


def test_tickets_bind_every_field_the_receiver_acts_on() -> None:
    tok = b"t" * 16
    signed = [describe(torch.float32, [2, 3], [3, 1], 0)]
    t = ticket(tok, 1, [5], signed)
    assert len(t) == 16 and len(session_id(tok)) == 8 and session_id(tok) != session_id(b"u" * 16)
    for other in (ticket(b"u" * 16, 1, [5], signed), ticket(tok, 2, [5], signed),
                  ticket(tok, 1, [6], signed),
                  ticket(tok, 1, [5], [describe(torch.float64, [2, 3], [3, 1], 0)]),
                  ticket(tok, 1, [5], [describe(torch.float32, [3, 2], [3, 1], 0)]),
                  ticket(tok, 1, [5], [describe(torch.float32, [2, 3], [1, 2], 0)]),  # strides
                  ticket(tok, 1, [5], [describe(torch.float32, [2, 3], [3, 1], 4)]),  # offset
                  ticket(tok, 1, [5], [describe(torch.float32, [2, 3], [3, 1], 0, neg=True)])):
        assert other != t
    assert Geometry(0, torch.float32, (2, 3), (3, 1), 0, 0).signed() == signed[0]
    h = {"t": "put", "rid": 1, "sid": session_id(tok), "n": 1, "ids": [5], "v": signed,
         "g": [0], "tk": t}
    assert check_put(dict(h), {session_id(tok): tok}.get) == (tok, 1)
    # a field the ticket does not sign is refused, whatever it is (a free rode on a put once)
    for extra in ({"free": [5]}, {"s": tok}, {"o": [[0, "float32", [2, 3], [3, 1], 0, 0]]},
                  {"ev": [5, 0]}):
        with pytest.raises(ProtocolError, match="a put carries only"):
            check_put({**h, **extra}, {session_id(tok): tok}.get)
    with pytest.raises(ProtocolError, match="does not match"):
        check_put({**h, "v": [describe(torch.float32, [2, 3], [1, 2], 0)]},
                  {session_id(tok): tok}.get)
    with pytest.raises(LookupError, match="does not exist"):
        check_put(dict(h), {}.get)


def test_pinned_bytes_count_once_and_only_when_no_longer_held() -> None:
    x, y = torch.zeros(10), torch.zeros(20)
    kx, ky = x.untyped_storage()._cdata, y.untyped_storage()._cdata
    pins = (((kx, 40), (ky, 80)), ((kx, 40),))
    assert unheld_bytes(pins, {kx, ky}) == 0
    assert unheld_bytes(pins, {ky}) == 40  # x freed by the session, pinned by two sends
    assert unheld_bytes(pins, set()) == 120


def test_peers_are_registered_addresses_with_their_keys(tmp_path) -> None:
    key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    p = Peers("tcp://127.0.0.1:5555, TCP://Host.example:7", key)
    assert p.lookup("tcp://127.0.0.1:5555") == (True, key)
    assert p.lookup("tcp://host.example:7") == (True, key)
    assert p.lookup("tcp://127.0.0.1:5556") == (False, None) and len(p) == 2
    assert Peers(None).lookup("tcp://127.0.0.1:5555") == (False, None)
    with pytest.raises(SystemExit, match="not tcp://host:port"):
        Peers("tcp://x:1,ipc:///tmp/y")
    f = tmp_path / "peers.json"
    p = Peers(str(f), None)
    assert len(p) == 0  # not written yet: no peers
    other = "A" * 40
    f.write_text('{"peers": [{"address": "tcp://10.0.0.1:1", "server_public_key": "%s"}]}'
                 % other)
    assert p.lookup("tcp://10.0.0.1:1") == (True, other)
    f.write_text('{"address": "tcp://10.0.0.2:2,tcp://10.0.0.3:3", '
                 '"server_public_key": "%s", "client_secret_key": "x"}' % other)  # a pool file
    import os

    os.utime(f, ns=(1, 1))  # a new stamp even within the file system's time resolution
    assert p.lookup("tcp://10.0.0.1:1")[0] is False and p.lookup("tcp://10.0.0.3:3") == \
        (True, other)


def test_load_meter_counts_other_sessions_busy_time() -> None:
    m = LoadMeter(window=0.4)
    for k, who in ((b"a", "alice"), (b"b", "alice"), (b"c", "mallory")):
        m.bind(k, who)
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
    assert m.load(b"c") == 0.0  # ... nor for another principal's session
    assert m.load(b"unbound") == 0.0
    done.set()
    th.join()
    time.sleep(0.5)
    assert m.load(b"a") == 0.0  # out of the window
