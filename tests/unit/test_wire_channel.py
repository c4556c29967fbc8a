"""The front <-> session worker channel (``genie.remote.wire.Channel``): messages cross whole
however the stream cuts them, the front's side never blocks, and what a lying worker declares
is refused before it costs memory (the front kills a worker whose message the channel refuses:
tests/integration/test_isolation.py). Every test runs with the native writer (``genie._C.
_channel_write``) and with the Python path it stands for."""

from __future__ import annotations

import os
import random
import select
import socket
import struct
import threading

import pytest

import torch

from genie import _C
from genie.remote import ProtocolError, wire
from genie.remote.wire import Channel


@pytest.fixture(autouse=True, params=["native", "python"])
def _path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(wire, "NATIVE", request.param == "native")
    return request.param


def _raw(parts: list[bytes]) -> bytes:
    return struct.pack(f"<I{len(parts)}Q", len(parts), *map(len, parts)) + b"".join(parts)


def _writer(sock: socket.socket, data: bytes, rng: random.Random) -> threading.Thread:
    def run() -> None:  # the stream cut at random places
        i = 0
        while i < len(data):
            n = rng.randint(1, 100_000)
            sock.sendall(data[i:i + n])
            i += n
        sock.close()

    th = threading.Thread(target=run)
    th.start()
    return th


@pytest.mark.parametrize("side", ["worker", "front"])
def test_messages_cross_whole_however_the_stream_cuts_them(side: str) -> None:
    rng = random.Random(0)
    for _ in range(60):
        a, b = socket.socketpair()
        msgs = [[os.urandom(rng.choice([0, 1, 42, 300, 70_000, 200_000]))
                 for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 6))]
        ch = Channel(b, 16, 1 << 30)
        th = _writer(a, b"".join(_raw(m) for m in msgs), rng)
        got: list[list[bytes]] = []
        if side == "worker":  # blocking, one at a time
            while (m := ch.recv()) is not None:
                got.append([bytes(p) for p in m])
        else:  # what is whole whenever the socket is readable
            b.setblocking(False)
            while True:
                select.select([b], [], [])
                try:
                    got += [[bytes(p) for p in m] for m in ch.take()]
                except EOFError:
                    break
        th.join()
        b.close()
        assert got == msgs


def test_the_front_never_blocks_on_a_worker_that_does_not_read() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    front, worker = Channel(a, 16, 1 << 30), Channel(b, 16, 1 << 30)
    msg = [b"header", os.urandom(8 << 20), b""]
    assert not front.post(msg)  # more than the socket holds: the rest waits, post returns
    assert front.pending
    got: list = []
    th = threading.Thread(target=lambda: got.append(worker.recv()))
    th.start()
    while front.pending:
        select.select([], [a], [])
        front.flush()
    th.join()
    assert [bytes(p) for p in got[0]] == msg


def test_a_worker_gone_while_the_front_writes_costs_nothing() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    front = Channel(a, 16, 1 << 30)
    b.close()
    assert front.post([b"x" * (1 << 20)])  # dropped: its end is read as the worker's end
    with pytest.raises(EOFError):
        front.take()


@pytest.mark.parametrize("head, why", [
    (struct.pack("<I", 0), "0 parts"),
    (struct.pack("<I", 17), "17 parts"),
    (struct.pack("<IQQ", 2, 10, (1 << 30) - 9), "1073741825 bytes"),
    (struct.pack("<IQ", 1, 1 << 62), "4611686018427387904 bytes"),
    (struct.pack("<IQQ", 2, 1 << 63, 1 << 63), "18446744073709551616 bytes"),  # (sum past u64)
    (struct.pack("<IQQQ", 3, 5, (1 << 64) - 1, 7), " bytes"),
])
def test_a_message_past_its_bounds_is_refused_from_its_head(head: bytes, why: str) -> None:
    """The counts come first and are checked before anything is allocated for the parts (the
    head alone is sent: nothing follows it)."""
    a, b = socket.socketpair()
    a.sendall(head)
    b.setblocking(False)
    with pytest.raises(ProtocolError, match=why):
        Channel(b, 16, 1 << 30).take()


def test_a_message_cut_by_its_sender_closing_is_an_error() -> None:
    a, b = socket.socketpair()
    a.sendall(_raw([b"abc", b"defg"])[:-2])
    a.close()
    with pytest.raises(ProtocolError, match="inside a message"):
        Channel(b, 16, 1 << 30).recv()


def test_a_head_of_many_parts_larger_than_one_read() -> None:
    a, b = socket.socketpair()
    parts = [b"x"] * 20_000  # a head of 160 KiB
    th = threading.Thread(target=lambda: a.sendall(_raw(parts)))
    th.start()
    got = Channel(b, 1 << 16, 1 << 30).recv()
    th.join()
    assert got is not None and len(got) == 20_000


def test_ready_says_whether_a_message_waits() -> None:
    """``Channel.ready`` (a worker waiting, after an early-answered run's rest, for the next
    request before it tells the front the run is done): false on an empty channel after the
    wait; true for a message on the socket, for one already read into the channel's buffer
    (two in one read: the second is not on the socket any more), and at the other end's close."""
    a, b = socket.socketpair()
    ch = Channel(a, 16, 1 << 20)
    assert not ch.ready(0) and not ch.ready(0.01)
    b.sendall(_raw([b"one"]) + _raw([b"two", b"2"]))
    assert ch.ready(0)
    assert [bytes(p) for p in ch.recv()] == [b"one"]
    assert ch.ready(0) and not select.select([a], [], [], 0)[0]
    assert [bytes(p) for p in ch.recv()] == [b"two", b"2"]
    assert not ch.ready(0)
    b.sendall(_raw([b"x" * 100])[:10])  # a message's first bytes: the rest comes later
    assert ch.ready(0)
    b.close()
    assert ch.ready(0)
    a.close()


PARTS = [  # what the front and a worker send: bytes, views, a reply's tensor buffers
    [b"status"],
    [b"h", b"", b"x" * 300],
    [bytearray(b"abc"), memoryview(b"0123456789")[2:7], b"end"],
    [memoryview(torch.arange(6, dtype=torch.float32).numpy()), b"t"],  # a view of format 'f'
    [b"a", memoryview(bytes(range(200))).cast("B", (10, 20))],  # 2-d: the Python path casts
    [b"p"] * 600,  # more parts than one native sendmsg takes: the Python path
]


@pytest.mark.parametrize("k", range(len(PARTS)))
def test_a_message_is_written_as_the_python_path_writes_it(k: int) -> None:
    """send and post write the bytes of ``Channel._frame``, whichever path writes them, and the
    other end reads the parts back."""
    parts = PARTS[k]
    want = b"".join(bytes(memoryview(p).cast("B")) if not isinstance(p, bytes) else p
                    for p in Channel._frame(parts)[0])
    for post in (False, True):
        a, b = socket.socketpair()
        ch = Channel(a, 1 << 10, 1 << 30)
        assert ch.post(parts) if post else ch.send(parts) is None
        a.close()
        got = b""
        while chunk := b.recv(1 << 20):
            got += chunk
        b.close()
        assert got == want


def test_what_the_native_writer_does_not_take_it_leaves_unwritten() -> None:
    a, b = socket.socketpair()
    for parts in ([], (b"x",), [b"x", 3], [b"x", memoryview(bytes(8))[::2]], [b"p"] * 600):
        assert _C._channel_write(a.fileno(), parts, False) is None, parts
    assert not select.select([b], [], [], 0)[0]
    a.close()
    b.close()
