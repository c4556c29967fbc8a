"""Multipart messages on a ZeroMQ socket at less than pyzmq's per-call cost, for the paths every
request takes (the front's routing, a session worker's requests and replies, the client's requests:
a 1-op round trip's client CPU 0.59 -> 0.51 ms, a GPT-2 4x128 token's -0.07 ms, load 5).

``send_multipart``/``recv_multipart`` read a socket option per frame and combine pyzmq's flag
enums (an enum object per operation, ~1-2 µs each, and more where the code runs with cold caches:
on the worker after a replay that streamed a model's weights through them). These use the flags
as plain ints and each frame's ``more`` bit.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
from typing import Any

import torch
import zmq

from .. import _C
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


def send_parts(sock: zmq.Socket, parts: list[Any], flags: int = 0) -> None:
    """``sock.send_multipart(parts, flags, copy=False)`` without pyzmq's flag enums (see
    :func:`recv_parts`; with ``NOBLOCK``, only the first part may raise ``zmq.Again``: a
    message's parts are queued together)."""
    for p in parts[:-1]:
        sock.send(p, SNDMORE | flags, copy=False)
    sock.send(parts[-1], flags, copy=False)


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


def read_status(part: Any) -> dict[str, Any] | None:
    """A worker's status part (bytes-like) as the map the front reads (``u``, ``res``, ``pb``,
    and ``early`` or ``done`` set to 1); None when the part is not one (a msgpack map).
    ProtocolError when it is one but malformed: its size, what it is, a negative count (a worker
    is no more trusted than a client: its numbers decide what the front admits)."""
    b = bytes(part)
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


# --- front <-> session worker ---------------------------------------------------------------------

#: a :class:`Channel` message: its part count, each part's length, then the parts' bytes
_COUNT = struct.Struct("<I")
_LEN = struct.Struct("<Q")
#: bytes a channel asks the socket for at once (a request's or a status's whole message)
_READ = 1 << 16
#: parts one ``sendmsg`` passes (Linux's ``IOV_MAX`` is 1024)
_IOV = 512
#: a channel's messages written natively (``genie._C._channel_write``: head and parts in one
#: sendmsg, from the parts' own buffers): the front's Python :meth:`Channel.post` cost 28-38 us a
#: request on the caches it wakes to, 16-28 natively (session 52, load 7); what it does not
#: take (a part not a flat buffer, more than 511 parts) goes the Python path, which stays the
#: reference (``GENIE_SERVER_NATIVE_CHANNEL=0``: always). (A native parse of the whole messages
#: read measured no gain over ``_parse``: 8.5-14.7 against 10.6-13.4 us, not kept.)
NATIVE = os.environ.get("GENIE_SERVER_NATIVE_CHANNEL", "1") != "0"
#: parts one channel message may have: a request's frames (the front takes up to 65536) and
#: a reply's (a ``get`` may name up to ``protocol.MAX_ITEMS`` values, large ones in chunks)
MAX_PARTS = 1 << 21


def channel_limit(quota: int) -> int:
    """The most bytes one channel message of a session may carry: its values (its quota; a
    worker refuses a larger reply) and headers of up to 16 MiB each (``protocol.MAX_HEADER_BYTES``)
    with room to spare."""
    return quota + (64 << 20)


class Channel:
    """Multipart messages over a connected Unix stream socket: what the front and a session's
    worker say to each other (a socket pair per session, made by the front; the worker's end
    passed to it through the zygote).

    A message is its part count (u32), each part's length (u64), then the parts' bytes, written
    with one ``sendmsg`` (no copy in user space). Unlike the ZeroMQ ``PAIR`` socket it replaced,
    nothing runs between the two processes' main threads: no I/O thread on either side to hand
    each message to and wake (a small message's round trip between two processes, load 3: 44 us
    of CPU and 45 us of wall through ZeroMQ's ``ipc``, 20 and 20 here).

    The front never blocks on a worker: :meth:`post` writes what the socket takes and keeps the
    rest for :meth:`flush` (when the poller says the socket is writable); :meth:`take` reads what
    is there and returns the messages that are whole. A worker is no more trusted than a client:
    every count and length it declares is checked before it costs memory (more than
    ``max_parts`` parts or ``max_bytes`` bytes in one message: a
    :class:`~genie.remote.ProtocolError`, and the front kills that worker). The worker's side
    blocks (:meth:`send`, :meth:`recv`).
    """

    def __init__(self, sock: socket.socket, max_parts: int, max_bytes: int,
                 heap: bool = False) -> None:
        self.sock = sock
        self.max_parts = max_parts
        self.max_bytes = max_bytes
        # where a large part is received: a mapping of its own (its pages committed as its bytes
        # arrive, returned to the OS when it is freed: the front), or the heap where this process
        # keeps freed memory for reuse (a worker: a mapping per part faulted each of a 128 MiB
        # upload's 32k pages in again, 0.65-0.80x the throughput; in a process that does not keep
        # it, malloc's own threshold moves and its trimming with it)
        self.heap = heap
        self._out: list[memoryview] = []  # written, not yet taken by the socket
        self._scratch = bytearray(_READ)
        self._view = memoryview(self._scratch)
        self._have = self._view[:0]  # read, not yet parsed
        self._lens: list[int] | None = None  # the message being read: its parts' lengths
        self._parts: list[memoryview] = []
        self._cur: memoryview | None = None  # the part being filled, and how far
        self._at = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    # --- sending ---
    @staticmethod
    def _frame(parts: list[Any]) -> tuple[list[Any], int]:
        """The message's buffers (its head first: the part count and lengths) and its bytes."""
        lens = [len(p) if type(p) in _FLAT else memoryview(p).nbytes for p in parts]
        n = len(parts)
        return [struct.pack(f"<I{n}Q", n, *lens), *parts], _COUNT.size + 8 * n + sum(lens)

    def send(self, parts: list[Any]) -> None:
        """Write one message whole (blocking: the worker's side)."""
        if NATIVE and type(parts) is list and \
                _C._channel_write(self.sock.fileno(), parts, True) is not None:
            return
        out, total = self._frame(parts)
        sent = self.sock.sendmsg(out) if len(out) <= _IOV else 0
        if sent < total:  # (the socket took part of it: the rest, from where it stopped)
            rest = _consume(_views(out), sent)
            while rest:
                rest = _consume(rest, self.sock.sendmsg(rest[:_IOV]))

    def post(self, parts: list[Any]) -> bool:
        """Queue one message and write what the socket takes now (never blocks: the front's
        side); False while some of it waits for :meth:`flush`."""
        if NATIVE and not self._out and type(parts) is list:
            try:
                got = _C._channel_write(self.sock.fileno(), parts, False)
            except OSError:  # the other end is gone (as flush: its end is reported where read)
                return True
            if got is not None:
                n, total = got
                if n == total:
                    return True
                self._out = _consume(_views(self._frame(parts)[0]), n)  # the rest waits
                return self.flush()
        self._out += _views(self._frame(parts)[0])
        return self.flush()

    def flush(self) -> bool:
        """Write what waits, as far as the socket takes it; True when nothing is left."""
        while self._out:
            try:
                n = self.sock.sendmsg(self._out[:_IOV], [], socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:  # the other end is gone (its end is reported where it is read)
                self._out = []
                return True
            self._out = _consume(self._out, n)
        return True

    @property
    def pending(self) -> bool:
        """Whether written messages wait for the socket (the front polls for writability)."""
        return bool(self._out)

    # --- receiving ---
    def recv(self) -> list[memoryview] | None:
        """The next message (blocking: the worker's side); None when the other end closed."""
        while True:
            got = self._parse(1)
            if got:
                return got[0]
            if not self._fill(0)[0]:
                if self._lens is not None or self._have.nbytes:
                    raise ProtocolError("the channel closed inside a message")
                return None

    def ready(self, timeout: float) -> bool:
        """Whether a message (or a part of one) waits to be read, after waiting up to
        ``timeout`` seconds for one (the worker's side; the other end closing counts)."""
        if self._have.nbytes or self._lens is not None:
            return True
        return bool(select.select([self.sock], [], [], timeout)[0])

    def take(self) -> list[list[memoryview]]:
        """The messages whole now (never blocks: the front's side). EOFError when the other end
        closed and no message is left; ProtocolError when what it sent is not a message this
        channel takes."""
        msgs = self._parse(1 << 30)
        while True:
            try:
                n, room = self._fill(socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return msgs
            if not n:
                if msgs:
                    return msgs  # (the EOF is read again on the next call)
                raise EOFError("the channel's other end closed")
            msgs += self._parse(1 << 30)
            if n < room:  # the socket had no more (the poller says when it has): no read that
                return msgs  # fails (its exception costs ~10 us where caches are cold)

    def _fill(self, flags: int) -> tuple[int, int]:
        """Read more: straight into the part being filled when much of it is missing, else
        after the cut head kept at the scratch buffer's start (:meth:`_keep`). ``(bytes read,
        bytes asked for)``; nothing read is the end."""
        cur = self._cur
        if cur is not None and not self._have.nbytes and cur.nbytes - self._at >= _READ:
            room = cur.nbytes - self._at
            n = self.sock.recv_into(cur[self._at:], 0, flags)
            self._at += n
            return n, room
        kept = self._have.nbytes
        room = len(self._scratch) - kept
        n = self.sock.recv_into(self._view[kept:], 0, flags)
        self._have = self._view[:kept + n]
        return n, room

    def _parse(self, most: int) -> list[list[memoryview]]:
        """The messages (at most ``most``) that the bytes read make whole."""
        out: list[list[memoryview]] = []
        while len(out) < most:
            have = self._have
            if self._cur is not None:  # a part being filled
                take = min(self._cur.nbytes - self._at, have.nbytes)
                if take:
                    self._cur[self._at:self._at + take] = have[:take]
                    self._at += take
                    self._have = have[take:]
                if self._at < self._cur.nbytes:
                    return out
                self._parts.append(self._cur)
                self._cur = None
            elif self._lens is None:  # a message's head
                if have.nbytes < _COUNT.size:
                    if have.nbytes:
                        self._keep(_COUNT.size)
                    return out
                (k,) = _COUNT.unpack_from(have)
                if not 0 < k <= self.max_parts:
                    raise ProtocolError(f"a message of {k} parts (1 to {self.max_parts})")
                end = _COUNT.size + k * _LEN.size
                if have.nbytes < end:
                    self._keep(end)
                    return out
                lens = struct.unpack_from(f"<{k}Q", have, _COUNT.size)
                total = sum(lens)
                if total > self.max_bytes:
                    raise ProtocolError(f"a message of {total} bytes (at most "
                                        f"{self.max_bytes})")
                if have.nbytes >= end + total:  # whole here (a request, a status): one copy,
                    body = memoryview(bytes(have[end:end + total]))  # its parts views of it
                    parts, at = [], 0
                    for n in lens:
                        parts.append(body[at:at + n])
                        at += n
                    out.append(parts)
                    self._have = have[end + total:]
                    continue
                self._have = have[end:]
                self._lens = list(lens)
                self._parts = []
            lens = self._lens
            if len(self._parts) == len(lens):
                out.append(self._parts)
                self._lens = None
                self._parts = []
                continue
            n = lens[len(self._parts)]
            if n <= self._have.nbytes:  # whole in what was read: copied out
                self._parts.append(memoryview(bytes(self._have[:n])))
                self._have = self._have[n:]
            else:  # a large part's memory is committed as its bytes arrive, not as declared
                self._cur = _heap(n) if self.heap else memoryview(mmap.mmap(-1, n))
                self._at = 0
        return out

    def _keep(self, need: int) -> None:
        """Move a cut head to the scratch buffer's start (grown to ``need`` bytes: a head of
        many parts), where the next read appends to it."""
        rest = bytes(self._have)
        if need > len(self._scratch):
            self._scratch = bytearray(need)
            self._view = memoryview(self._scratch)
        self._scratch[:len(rest)] = rest
        self._have = self._view[:len(rest)]


#: what a part's ``len`` counts in bytes (any other buffer: its memoryview's ``nbytes``)
_FLAT = (bytes, bytearray, zmq.Frame)


def _views(bufs: list[Any]) -> list[memoryview]:
    """Each buffer as a flat byte view (to cut where a write stopped)."""
    views = [b if type(b) is memoryview else memoryview(b) for b in bufs]
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]


def _heap(n: int) -> memoryview:
    """``n`` writable bytes, not zeroed, from torch's CPU allocator (malloc's): reused where the
    process keeps freed memory (a worker, :func:`genie.memory.retain_host_memory`)."""
    return memoryview(torch.empty(n, dtype=torch.uint8).numpy())


def _consume(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    k = 0
    while k < len(views) and n >= views[k].nbytes:
        n -= views[k].nbytes
        k += 1
    rest = views[k:]
    if n:
        rest[0] = rest[0][n:]
    return rest
