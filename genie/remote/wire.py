"""Multipart messages on a ZeroMQ socket at less than pyzmq's per-call cost, for the paths every
request takes (the front's routing, a session worker's requests and replies, the client's requests:
a 1-op round trip's client CPU 0.59 -> 0.51 ms, a GPT-2 4x128 token's -0.07 ms, load 5).

``send_multipart``/``recv_multipart`` read a socket option per frame and combine pyzmq's flag
enums (an enum object per operation, ~1-2 µs each, and more where the code runs with cold caches:
on the worker after a replay that streamed a model's weights through them). These use the flags
as plain ints and each frame's ``more`` bit.
"""

from __future__ import annotations

import struct
from typing import Any

import zmq

from . import ProtocolError

#: pyzmq's flags as plain ints: its enum members cost an enum object per operation (~11 a
#: request on the front's path, ~1-2 us each)
EVENTS, POLLIN, NOBLOCK, SNDMORE, SRCFD = int(zmq.EVENTS), int(zmq.POLLIN), \
    int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.SRCFD)


def readable(sock: zmq.Socket) -> bool:
    """Whether ``sock`` holds a message now: a drained socket is left on this (~4 us), not on
    a receive that raises ``zmq.Again`` (~10 us: the exception and its message). The poller
    reports anything that arrives after (level-triggered), so nothing waits on it."""
    return bool(sock.get(EVENTS) & POLLIN)


def recv_parts(sock: zmq.Socket, flags: int = NOBLOCK) -> list[zmq.Frame]:
    """``sock.recv_multipart(flags, copy=False)`` without pyzmq's per-frame option read and
    flag enums (~2x cheaper for a request's few frames): each frame says if more follow (a
    message's frames arrive together, so only the first may wait, with ``flags`` 0)."""
    f = sock.recv(flags, copy=False)
    parts = [f]
    while f.more:
        f = sock.recv(NOBLOCK, copy=False)
        parts.append(f)
    return parts


def send_parts(sock: zmq.Socket, parts: list[Any]) -> None:
    """``sock.send_multipart(parts, copy=False)`` without pyzmq's flag enums (see
    :func:`recv_parts`)."""
    for p in parts[:-1]:
        sock.send(p, SNDMORE, copy=False)
    sock.send(parts[-1], 0, copy=False)


#: a session worker's status, the first frame of its replies to the front (``[status, header,
#: *frames]``; an answered run's end is the status alone): tag 0 (a msgpack map, the format of
#: the worker's rarer messages, never starts with it), what the message is (:data:`REPLY`,
#: :data:`EARLY`, :data:`DONE`), bytes counted against the quota, residency (values, bytes),
#: peer bytes (sent, taken). Fixed width: read without a decoder, packed without an encoder
#: (warm: 0.55 against a map's 1.0 us to read, 0.10 against 0.75 to pack; the front's decode
#: of a map measured ~9 us a call after a replay's cold caches; two a step with an early reply)
STATUS = struct.Struct("<BBqqqqq")
#: a request's reply; the early reply of a run whose rest still runs; the end of that run
REPLY, EARLY, DONE = 0, 1, 2
_WHAT = {REPLY: None, EARLY: "early", DONE: "done"}


def status(what: int, used: int, res: list[int], pb: list[int]) -> bytes:
    """The status frame a worker sends (see :data:`STATUS`)."""
    return STATUS.pack(0, what, used, res[0], res[1], pb[0], pb[1])


def read_status(frame: zmq.Frame) -> dict[str, Any] | None:
    """A worker's status frame as the map the front reads (``u``, ``res``, ``pb``, and
    ``early`` or ``done`` set to 1); None when the frame is not one (a msgpack map).
    ProtocolError when it is one but malformed: its size, what it is, a negative count (a worker
    is no more trusted than a client: its numbers decide what the front admits)."""
    b = frame.bytes
    if b[:1] != b"\x00":
        return None
    if len(b) != STATUS.size:
        raise ProtocolError(f"a worker status of {len(b)} bytes (it has {STATUS.size})")
    _, what, used, n, nb, sent, took = STATUS.unpack(b)
    if what not in _WHAT or min(used, n, nb, sent, took) < 0:
        raise ProtocolError(f"a worker status that says {what} with negative or unknown counts")
    out: dict[str, Any] = {"u": used, "res": [n, nb], "pb": [sent, took]}
    if _WHAT[what] is not None:
        out[_WHAT[what]] = 1
    return out
