"""A worker's reply frames (``genie.remote.protocol.tensor_frames``): one native pass
(``genie._C._frames_of``) for contiguous CPU tensors, ``tensor_frame`` one by one otherwise;
either way the metadata and bytes ``tensor_frame`` gives, and a buffer that holds its tensor.
A run's early answer written natively (``genie._C._send_early``), and a lane's reply
(``genie._C._send_reply``), is what the front reads of the Python path's, and one it cannot
write it leaves to that path having written nothing.
"""

from __future__ import annotations

import gc
import select
import socket
import threading
from typing import Any

import pytest
import torch

from genie import _C
from genie.remote.protocol import (
    _DTYPE_NAME,
    FrameRef,
    dtype_of,
    frame_tensor,
    frame_view,
    pack,
    tensor_frame,
    tensor_frames,
    unpack,
)
from genie.remote.wire import EARLY, REPLY, Channel, read_status, status

DENSE = [
    torch.arange(12, dtype=torch.float32).view(3, 4),
    torch.arange(10, dtype=torch.int64)[3:],  # an offset into its storage
    torch.tensor([True, False, True]),
    torch.randn(2, 3, dtype=torch.complex64),
    torch.randn(5, dtype=torch.bfloat16),
    torch.tensor(3.5, dtype=torch.float64),  # 0-d
    torch.zeros(1, 1).expand(1, 1),  # one element, any strides
    torch.randn(4, 1, 3).transpose(0, 1),  # contiguous by a size-1 dimension's stride
]
OTHERS = [
    torch.randn(3, 4).t(),  # dense, not contiguous: strides sent
    torch.randn(4, 4)[:, ::2],  # not dense: copied
    torch.zeros(0, 3),  # no elements
    torch.randn(3, dtype=torch.complex64).conj(),  # a conj bit
    torch.randn(3).requires_grad_(),
]


def _same(vals: list[torch.Tensor]) -> None:
    metas, bufs = tensor_frames(vals)
    assert len(metas) == len(bufs) == len(vals)
    for v, meta, buf in zip(vals, metas, bufs, strict=True):
        want_buf, want_meta = tensor_frame(v)
        assert meta == want_meta and type(meta) is list
        assert frame_view(buf).tobytes() == frame_view(want_buf).tobytes()
        dt, shape, stride = meta
        back = frame_tensor(buf, FrameRef(0, dtype_of(dt), tuple(shape),
                                          None if stride is None else tuple(stride)), copy=True)
        torch.testing.assert_close(back, v.detach().resolve_conj(), rtol=0, atol=0)


def test_contiguous_values_are_framed_in_one_native_pass() -> None:
    assert _C._frames_of(DENSE, _DTYPE_NAME) is not None
    _same(DENSE)


@pytest.mark.parametrize("other", range(len(OTHERS)))
def test_any_other_value_frames_them_all_as_tensor_frame_does(other: int) -> None:
    vals = [*DENSE[:2], OTHERS[other], DENSE[3]]
    if other != len(OTHERS) - 1:  # (requires_grad alone is no reason to leave the native pass)
        assert _C._frames_of(vals, _DTYPE_NAME) is None
    _same(vals)


def test_not_a_tensor_or_an_unnamed_dtype_is_left_to_python() -> None:
    assert _C._frames_of([torch.ones(2), 3.0], _DTYPE_NAME) is None
    assert _C._frames_of([torch.ones(2)], {}) is None
    with pytest.raises(TypeError):
        _C._frames_of([torch.ones(2)], [])


def test_a_buffer_holds_its_tensor_and_is_read_only() -> None:
    _, (buf,) = tensor_frames([torch.arange(100_000, dtype=torch.int32) * 3])
    gc.collect()
    m = memoryview(buf)
    assert m.readonly and m.nbytes == 400_000 and m.format == "B"
    assert torch.frombuffer(bytearray(m), dtype=torch.int32)[-1].item() == 299_997


# --- a run's early answer written natively (genie._C._send_early) -------------------------------

def _python_early(sock: socket.socket, used: int, res: list[int], pb: list[int], rid: Any,
                  st: float, vt: str, vals: list[torch.Tensor]) -> None:
    """The early answer as the Python path writes it (worker.py: _answer_early, answer)."""
    metas, frames = tensor_frames([v.clone(memory_format=torch.preserve_format) for v in vals])
    reply = {"t": "ok", "o": metas, "vt": vt, "er": 1, "rid": rid, "st": st}
    Channel(sock, 16, 1 << 30).send([status(EARLY, used, res, pb), pack(reply), *frames])


def _python_reply(sock: socket.socket, used: int, res: list[int], pb: list[int], rid: Any,
                  st: float, vt: str, vals: list[torch.Tensor]) -> None:
    """A lane's reply as serve_session's Python path writes it (worker.py: _run_lane's
    _outputs, then the loop's rid, st, split_frames and status)."""
    metas, frames = tensor_frames(vals)
    reply = {"t": "ok", "o": metas, "res": res, "vt": vt, "rid": rid, "st": st}
    Channel(sock, 16, 1 << 30).send([status(REPLY, used, res, pb), pack(reply), *frames])


#: the native writer, the Python path it stands for, and the status the front reads of both
WRITERS = {"early": (_C._send_early, _python_early, {"early": 1}),
           "reply": (_C._send_reply, _python_reply, {})}


def _read_one(ch: Channel) -> list[bytes]:
    got: list[list[bytes]] = []
    while not got:
        got = [[bytes(p) for p in m] for m in ch.take()]
    assert len(got) == 1
    return got[0]


ANSWERS = [
    (DENSE[:1], 7, "hit"),
    (DENSE, 0, "class"),
    ([torch.tensor(0.25)], -1, "hit"),  # a training step's loss, a reply to no rid
    ([torch.tensor([1, 2, 3], dtype=torch.int8), torch.ones(300, dtype=torch.float16)],
     (1 << 63) - 1, "x" * 40),
    ([torch.randn(256, 1024)], 1 << 40, "guarded"),  # 1 MiB: past the socket's buffer
]


@pytest.mark.parametrize("which", sorted(WRITERS))
@pytest.mark.parametrize("k", range(len(ANSWERS)))
def test_a_native_answer_is_the_python_paths(k: int, which: str) -> None:
    """The front reads the native answer (early, or a lane's reply) as the Python path's: the
    same status, header (its map decoded) and frames, written whole however much the socket
    takes at once."""
    vals, rid, vt = ANSWERS[k]
    write, python, what = WRITERS[which]
    used, res, pb, st = 123_456, [7, 98_765], [0, 1 << 33], 0.000125
    got = []
    for native in (True, False):
        a, b = socket.socketpair()
        front = Channel(b, 1 << 10, 1 << 30)
        if native:
            th = threading.Thread(target=lambda: got.append(write(
                a.fileno(), used, res, pb, rid, st, vt, vals, _DTYPE_NAME)))
        else:
            th = threading.Thread(target=python, args=(a, used, res, pb, rid, st, vt, vals))
        th.start()
        msg = _read_one(front)
        th.join()
        assert not select.select([b], [], [], 0)[0]  # one message, nothing after it
        a.close()
        b.close()
        got.append(msg)
    (ok, native), python = got[:2], got[2]
    assert ok is True
    assert read_status(native[0]) == read_status(python[0]) == \
        {"u": used, "res": res, "pb": pb, **what}
    assert unpack(native[1]) == unpack(python[1])
    assert native[1] == python[1]  # (msgpack's bytes too: the same map, the same order)
    assert native[2:] == python[2:] and len(native) == 2 + len(vals)


BAD = [  # (what differs from a good call, its arguments): each answered by the Python path
    ("a value not contiguous", dict(values=[torch.randn(3, 4).t()])),
    ("a value without elements", dict(values=[torch.zeros(0, 3)])),
    ("a value with a conj bit", dict(values=[torch.randn(3, dtype=torch.complex64).conj()])),
    ("a value over 1 MiB (split in chunks)", dict(values=[torch.zeros((1 << 18) + 1)])),
    ("a value that is no tensor", dict(values=[3.0])),
    ("values not a list", dict(values=(torch.ones(2),))),
    ("a dtype without a name", dict(names={})),
    ("rid a bool", dict(rid=True)),
    ("rid a float", dict(rid=7.0)),
    ("rid a str", dict(rid="7")),
    ("rid past int64", dict(rid=1 << 63)),
    ("rid None", dict(rid=None)),
    ("vt not a str", dict(vt=b"hit")),
    ("st not a float", dict(st=1)),
    ("used a bool", dict(used=True)),
    ("res of three", dict(res=[1, 2, 3])),
    ("pb of strs", dict(pb=["1", "2"])),
]


@pytest.mark.parametrize("which", sorted(WRITERS))
@pytest.mark.parametrize("why, change", BAD, ids=[b[0] for b in BAD])
def test_a_native_answer_it_cannot_write_writes_nothing(why: str, change: dict, which: str
                                                        ) -> None:
    """Whatever a request's header made of ``rid`` (a client's value), and any value or count
    the native writer does not take, it leaves to the Python path having written nothing."""
    write = WRITERS[which][0]
    a, b = socket.socketpair()
    args = dict(fd=a.fileno(), used=1, res=[1, 4], pb=[0, 0], rid=3, st=0.5, vt="hit",
                values=[torch.ones(2)], names=_DTYPE_NAME)
    assert write(**args) is True  # (the good call it differs from)
    Channel(b, 16, 1 << 30).take()
    args.update(change)
    assert write(**args) is None, why
    assert not select.select([b], [], [], 0)[0], why
    a.close()
    b.close()


@pytest.mark.parametrize("which", sorted(WRITERS))
def test_a_native_answer_to_a_closed_channel_raises_as_the_python_path(which: str) -> None:
    a, b = socket.socketpair()
    b.close()
    with pytest.raises(BrokenPipeError):
        WRITERS[which][0](a.fileno(), 1, [1, 4], [0, 0], 3, 0.5, "hit", [torch.ones(2)],
                          _DTYPE_NAME)
    with pytest.raises(BrokenPipeError):
        Channel(a, 16, 1 << 30).send([b"x"])
    a.close()
