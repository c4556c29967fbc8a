"""A steady run reply read natively (``genie._C._client_reply``, csrc/client_run.cpp) against the
Python path (``Client._receive`` then ``Client._read_outputs``, ``GENIE_CLIENT_NATIVE=0``), the
reference.

The client does not trust the server: each reply below, well formed or malformed as a server
might send it (wrong counts, dtypes, sizes, strides, keys, types, encodings, statuses, rids,
chunked frames), goes through a real ``Client._receive`` over a ZeroMQ socket pair both ways.
The outcomes must be the same: the same error (type and message), or the same header, the same
output tensors (dtype, shape, strides, bytes) and the same client state (residency, early-reply
flag, counters). The plain replies must be taken natively (else the native path would pass by
never running).
"""

from __future__ import annotations

import itertools
import struct

import msgpack
import pytest
import torch

client = pytest.importorskip("genie.remote.client")
zmq = pytest.importorskip("zmq")

from genie.config import config  # noqa: E402
from genie.remote.handle import Handle  # noqa: E402
from genie.stats import stats as genie_stats  # noqa: E402
from genie.remote.protocol import dtype_name, pack  # noqa: E402

_ctx = zmq.Context()
_names = itertools.count()
RID = 7


def _bits(t: torch.Tensor) -> bytes:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))
    return bytes(flat.view(torch.uint8).tolist()) if t.numel() else b""


def _storage(t: torch.Tensor) -> bytes:
    """A tensor's storage as it is in memory (a bool's byte not read as its truth)."""
    n = t.untyped_storage().nbytes()
    return bytes(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (n,)).tolist())


def _frame(t: torch.Tensor) -> bytes:
    """A tensor's frame as a server sends it: its storage span's bytes, laid out as its
    strides say (a dense tensor's)."""
    n = t.untyped_storage().nbytes()
    return bytes(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (n,)).tolist())


def _meta(t: torch.Tensor, strides: bool = True) -> list:
    return [dtype_name(t.dtype), list(t.shape), list(t.stride()) if strides else None]


def _outcome(native: bool, messages: list[list[bytes]], n_out: int) -> tuple:
    """Read ``messages`` (sent in order) as the answer to request RID of a run with ``n_out``
    outputs, on a fresh client: what it returned (header less "o", the outputs' dtype, shape,
    strides, bytes; the client's residency and early flag) or raised, and whether the native
    reader took it."""
    c = client.Client("tcp://127.0.0.1:1", insecure=True, heartbeat=False)
    name = f"inproc://native-reply-{next(_names)}"
    srv = _ctx.socket(zmq.PAIR)
    srv.bind(name)
    cl = _ctx.socket(zmq.PAIR)
    cl.connect(name)
    c._sock, c._mon = cl, None
    c._poller = zmq.Poller()
    c._poller.register(cl, zmq.POLLIN)
    c.timeout = 1.0
    into = [Handle(100 + k, c, None) for k in range(n_out)]
    sent = client._Sent(RID, "a test run", 10, 0, None, 0.0)
    sent.into = into
    for m in messages:
        srv.send_multipart(m)
    before = dict(genie_stats())
    saved = config.client_native
    config.client_native = native
    try:
        h, frames = c._receive(sent)
        if frames is not client._READ and (n_out or frames):
            c._read_outputs(h, frames, into)
        h = {k: v for k, v in h.items() if k != "o"}
        outs = [(t.dtype, tuple(t.shape), t.stride(), _bits(t), getattr(t, "_genie_own", None),
                 t.storage_offset(), _storage(t)) for t in (x.host for x in into)]
        got = ("ok", h, outs, c.resident, c._unsynced)
    except Exception as e:  # noqa: BLE001 - the error is the outcome compared
        got = ("raised", type(e).__name__, str(e))
    finally:
        config.client_native = saved
        srv.close(linger=0)
        if c._sock is not None:
            cl.close(linger=0)
    after = genie_stats()
    took = after.get("client_native_replies", 0) - before.get("client_native_replies", 0)
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in
                ("server_early_replies", "server_index_checks", "server_vet_hits",
                 "bytes_received")}
    return got, counters, took


def _both(messages: list[list[bytes]], n_out: int) -> tuple[tuple, bool]:
    ref, ref_counts, took_ref = _outcome(False, messages, n_out)
    got, got_counts, took = _outcome(True, messages, n_out)
    assert took_ref == 0
    assert got == ref
    assert got_counts == ref_counts
    return got, bool(took)


def _reply(outs: list[torch.Tensor], strides: bool = True, **h) -> list[bytes]:
    head = {"t": "ok", "o": [_meta(t, strides) for t in outs], "rid": RID, "st": 0.00025,
            "res": [12, 4096], "vt": "hit"}
    head.update(h)
    return [pack(head), *[_frame(t) for t in outs]]


_PLAIN = {
    "a loss": [torch.tensor(2.5)],
    "a token id": [torch.tensor([[50256]])],
    "several dtypes": [torch.arange(6, dtype=torch.int64).view(2, 3).t(),  # strides (1, 3)
                       torch.tensor([True, False, True]),
                       torch.tensor([1 + 2j, -0.0 - 1j, 3j], dtype=torch.complex128),
                       torch.tensor([1.5, float("nan")], dtype=torch.bfloat16),
                       torch.tensor(float("nan"), dtype=torch.float16),
                       torch.tensor([5e-324, -0.0], dtype=torch.float64),
                       torch.randn(4, 1, 5).transpose(0, 2)],
    "size-one dims with any strides": [torch.empty_strided((1, 3, 1), (9, 1, 4)).fill_(3.0)],
    "no outputs": [],
}


@pytest.mark.parametrize("case", list(_PLAIN))
def test_plain_replies_are_read_natively_as_python_reads_them(case):
    outs = _PLAIN[case]
    got, took = _both([_reply(outs)], len(outs))
    assert took and got[0] == "ok"
    for (dt, shape, stride, bits, own, _, _), want in zip(got[2], outs, strict=True):
        assert (dt, shape, stride) == (want.dtype, tuple(want.shape), want.stride())
        assert bits == _bits(want) and own is True
    # without strides: contiguous tensors of the same values
    dense = [t.contiguous() for t in outs]
    got, took = _both([_reply(dense, strides=False)], len(outs))
    assert took and [o[3] for o in got[2]] == [_bits(t) for t in outs]


def test_the_header_fields_are_python_s():
    t = [torch.tensor(1.0)]
    for extra in ({"er": 1, "ix": [3, 1, 0]}, {"er": 0}, {"vt": "vetted", "st": 3},
                  {"res": [0, 0]}, {"vt": "no such kind"}):
        got, took = _both([_reply(t, **extra)], 1)
        assert took and got[0] == "ok", extra
    # no "st", "res", "vt" at all
    got, took = _both([[pack({"t": "ok", "rid": RID, "o": [_meta(t[0])]}), _frame(t[0])]], 1)
    assert took and got[1] == {"t": "ok", "rid": RID}
    # a float32 "st", uint and negative-fixint encodings
    head = msgpack.packb({"t": "ok", "rid": RID, "st": 0.5, "res": [2**40, 7],
                          "o": [_meta(t[0])]}, use_single_float=True)
    got, took = _both([[head, _frame(t[0])]], 1)
    assert took and got[1]["st"] == 0.5


def _raw_map(items: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map written by hand (duplicate keys, odd encodings)."""
    return bytes([0x80 | len(items)]) + b"".join(k + v for k, v in items)


def _p(x) -> bytes:
    return msgpack.packb(x, use_bin_type=True)


_F = torch.tensor([1.0, 2.0])  # the output of the malformed cases
_GOOD = _reply([_F])


def _with(**h) -> list[bytes]:
    return _reply([_F], **h)


_MALFORMED = {
    # counts
    "more metas than outputs": [_p({"t": "ok", "rid": RID, "o": [_meta(_F), _meta(_F)]}),
                                _frame(_F)],
    "fewer metas than outputs": [_p({"t": "ok", "rid": RID, "o": []}), _frame(_F)],
    "no metas": [_p({"t": "ok", "rid": RID}), _frame(_F)],
    "metas not a list": _with(o={"a": 1}),
    "a frame missing": [_p({"t": "ok", "rid": RID, "o": [_meta(_F)]})],
    "a frame too many": [*_GOOD, b"\0" * 8],
    # dtypes
    "unknown dtype": _with(o=[["float33", [2], [1]]]),
    "quantized dtype": _with(o=[["qint8", [8], [1]]]),
    "dtype not a str": _with(o=[[7, [2], [1]]]),
    "dtype of another size": _with(o=[["float64", [2], [1]]]),
    # shapes and sizes
    "negative dim": _with(o=[["float32", [-2], [1]]]),
    "float dim": _with(o=[["float32", [2.0], [1]]]),
    "shape not a list": _with(o=[["float32", 2, [1]]]),
    "frame too short": [_GOOD[0], _GOOD[1][:7]],
    "frame too long": [_GOOD[0], _GOOD[1] + b"\0"],
    "empty tensor": [_p({"t": "ok", "rid": RID, "o": [["float32", [0, 3], None]]}), b""],
    "meta of two entries": _with(o=[["float32", [2]]]),
    "meta of four entries": _with(o=[["float32", [2], [1], 0]]),
    # strides
    "strides of another rank": _with(o=[["float32", [2], [1, 1]]]),
    "negative stride": _with(o=[["float32", [2], [-1]]]),
    "overlapping strides": [_p({"t": "ok", "rid": RID, "o": [["float32", [2, 3], [5, 0]]]}),
                            b"\0" * 24],
    "strides past the frame": _with(o=[["float32", [2], [2]]]),
    "float strides": _with(o=[["float32", [2], [1.0]]]),
    "strides not a list": _with(o=[["float32", [2], 1]]),
    # header fields
    "an unknown key": _with(zz=1),
    "st a str": _with(st="soon"),
    "res of strs": _with(res=["a", 1]),
    "res of three": _with(res=[1, 2, 3]),
    "vt an int": _with(vt=3),
    "er true": _with(er=True),
    "er a float": _with(er=1.0),
    "ix of two": _with(ix=[1, 2]),
    "ix of floats": _with(ix=[1.0, 2, 3]),
    "t missing": [_p({"rid": RID, "o": [_meta(_F)]}), _frame(_F)],
    "t an int": _with(t=1),
    "chunk counts": [_p({"t": "ok", "rid": RID, "o": [_meta(_F)], "fc": [2]}),
                     _frame(_F)[:3], _frame(_F)[3:]],
    "bad chunk counts": _with(fc=[2]),
    "a pressure answer": [_p({"t": "err", "kind": "pressure", "rid": RID, "victims": []})],
    "an op's failure": [_p({"t": "err", "kind": "exec", "rid": RID, "msg": "boom", "at": 0})],
    "a lost session": [_p({"t": "err", "kind": "session", "rid": RID, "msg": "gone"})],
    # encodings
    "not msgpack": [b"\xc1\xc1", _frame(_F)],
    "trailing bytes": [_GOOD[0] + b"\x00", _frame(_F)],
    "duplicate key": [_raw_map([(_p("t"), _p("ok")), (_p("rid"), _p(RID)),
                                (_p("o"), _p([_meta(_F)])), (_p("rid"), _p(RID))]),
                      _frame(_F)],
    "duplicate o": [_raw_map([(_p("t"), _p("ok")), (_p("rid"), _p(RID)),
                              (_p("o"), _p([_meta(_F)])), (_p("o"), _p([["int64", [1], None]]))]),
                    _frame(_F)],
    "duplicate st": [_raw_map([(_p("t"), _p("ok")), (_p("rid"), _p(RID)), (_p("st"), _p(0.5)),
                               (_p("o"), _p([_meta(_F)])), (_p("st"), _p(3))]), _frame(_F)],
    "vt not utf-8": [_raw_map([(_p("t"), _p("ok")), (_p("rid"), _p(RID)),
                               (_p("o"), _p([_meta(_F)])), (_p("vt"), b"\xa2\xff\xfe")]),
                     _frame(_F)],
    "a key not utf-8": [_raw_map([(_p("t"), _p("ok")), (_p("rid"), _p(RID)),
                                  (_p("o"), _p([_meta(_F)])), (b"\xa1\xff", _p(1))]),
                        _frame(_F)],
    "a bin key": [_raw_map([(_p("t"), _p("ok")), (_p("rid"), _p(RID)),
                            (_p("o"), _p([_meta(_F)])), (_p(b"vt"), _p("hit"))]),
                  _frame(_F)],
    "an array count past the bytes": [_p({"t": "ok", "rid": RID})[:-1] + b"\xdd\xff\xff\xff\xff",
                                      _frame(_F)],
    "truncated": [_GOOD[0][:-3], _frame(_F)],
    "rid past int64": [_raw_map([(_p("t"), _p("ok")), (_p("rid"), _p(2**64 - 1)),
                                 (_p("o"), _p([_meta(_F)]))]), _frame(_F)],
    # values a plain dtype reads otherwise
    "a bool byte of 2": [_p({"t": "ok", "rid": RID, "o": [["bool", [], None]]}), b"\x02"],
}


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_malformed_replies_end_as_on_the_python_path(case):
    msg = _MALFORMED[case]
    # each malformed reply, then (for those the client waits past) the good one
    got, took = _both([msg, _GOOD], 1)
    assert not took or got[0] == "ok"


def test_other_requests_answers_and_busy_are_waited_past():
    other = _reply([_F], rid=RID - 1)
    busy = [_p({"t": "busy", "rid": RID})]
    not_a_map = [_p([1, 2]), _frame(_F)]
    got, took = _both([other, busy, not_a_map, _GOOD], 1)
    assert took and got[0] == "ok" and got[2][0][3] == _bits(_F)


def test_large_values_take_the_python_path():
    big = torch.arange(1 << 14, dtype=torch.float32)  # 64 KiB: the Python path's zero copy
    got, took = _both([_reply([big])], 1)
    assert not took and got[0] == "ok" and got[2][0][3] == _bits(big)
    small = big[: (1 << 14) - 1].clone()
    got, took = _both([_reply([small])], 1)
    assert took


def test_the_header_limit_and_bad_arguments():
    head = pack({"t": "ok", "rid": RID, "o": [_meta(_F)]})
    into = [Handle(1, None, None)]
    assert client._client_reply([head, _frame(_F)], RID, into, len(head) - 1) is None
    assert into[0].host is None  # declined: nothing set
    h, got = client._client_reply([head, _frame(_F)], RID, into, len(head))
    assert got == len(head) + 8 and torch.equal(into[0].host, _F)
    assert client._client_reply([head, object()], RID, into, 1 << 20) is None
    assert client._client_reply([head], RID, into, 1 << 20) is None


def test_a_one_element_float_keeps_its_bits():
    """NaN payloads, subnormals, signed zeros: the bytes, as the Python path's bytes' way."""
    for fmt, dtype, vals in (("<f", torch.float32, [1e-45, -0.0, float("inf")]),
                             ("<d", torch.float64, [5e-324, -0.0, float("nan")])):
        for v in vals:
            b = struct.pack(fmt, v)
            got, took = _both([[pack({"t": "ok", "rid": RID, "o": [[dtype_name(dtype), [1],
                                                                     [1]]]}), b]], 1)
            assert took and got[2][0][3] == b
    payload = struct.pack("<I", 0x7FC00123)  # a NaN with a payload
    got, took = _both([[pack({"t": "ok", "rid": RID, "o": [["float32", [], None]]}),
                        payload]], 1)
    assert took and got[2][0][3] == payload
