"""Server-to-server transfers: a server hands resident values directly to another server.

A client that wants values of its session on server A to be in its session on server B (a KV
cache made by a prefill on A, needed by a decode on B) sends A one ``send`` request. A reads the
values from the session's store and pushes them to B in one ``put`` message; B stores them in the
client's session there under ids the client chose, and answers A; A answers the client. The bytes
never pass through the client: its cost is one round trip of a few hundred bytes.

**Who may write into a session.** The destination session is named by a public id (a hash of its
token, :func:`session_id`), never by the token itself; the ``put`` carries a *ticket*, a keyed
BLAKE2b MAC made by the client with its session token as key (:func:`ticket`) over a nonce, the
handle ids and each value's dtype and shape. So A learns a capability for exactly this write and
nothing else: it can neither read that session, nor run tapes in it, nor replay the ticket (the
nonce must grow), nor change what it writes (ids, dtypes and shapes are signed; the geometry of
each value is checked against the bytes that came). B trusts no peer more than a client: every
field is checked before memory is touched and the session's quota applies (:func:`read_values`).

**Authentication** is the client's: A connects to B like a client does, with CURVE (B's server
key as the client gave it, and A's *peer key pair*, an authorized client key of B: the key pair a
pool's members share, see :class:`PeerLinks`), or plain TCP when A serves ``--insecure``. A
destination that cannot complete the handshake with the expected key never receives a byte.

**Aliasing survives.** Values that share a storage on A (a view and its base) are sent as one
byte span of that storage plus each value's geometry (dtype, shape, strides, offset, math bits),
and share one storage on B again.

**Failures never hang.** A transfer waits at most ``timeout`` seconds of silence from B (B's
"busy" notes extend it, as for a client); a refused connection, a dropped one, a failed
handshake or a refusal by B ends it at once with an error reply (kind ``peer``) naming B and the
cause. While it waits, A's worker is free: :class:`PeerLinks` owns the peer sockets on a thread
of its own and answers the client when B has answered.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import queue
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import ProtocolError
from .protocol import (
    ALIGN,
    MAX_DIMS,
    dtype_name,
    dtype_of,
    frame_view,
    pack,
    split_frames,
    unpack,
)

_monitors = iter(range(1 << 62))  # one inproc name per peer link's monitor, never reused

logger = logging.getLogger("genie.server.peer")

#: bytes of a session's public id (:func:`session_id`) and of a ticket (:func:`ticket`)
SESSION_ID_BYTES = 8
TICKET_BYTES = 16
#: the most values one transfer may carry
MAX_VALUES = 4096
#: transfers one session may have under way (each holds its values until the peer has them)
MAX_PENDING = 4
#: peer connections a server keeps open (least recently used closed beyond)
MAX_LINKS = 16
#: a value span's start is rounded down to this many bytes (the largest itemsize: complex128),
#: so every value's offset stays a whole number of its elements
SPAN_ALIGN = 16
#: what a destination address may look like (checked before connecting)
ADDRESS = re.compile(r"tcp://[A-Za-z0-9.\-\[\]:]{1,255}:\d{1,5}")
#: a CURVE public key in Z85
Z85_KEY = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")


def session_id(token: bytes) -> bytes:
    """The public id of the session whose (secret) token is ``token``."""
    return hashlib.blake2b(token, digest_size=SESSION_ID_BYTES, person=b"genie-sid").digest()


def ticket(token: bytes, nonce: int, ids: list[int], signed: list[list[Any]]) -> bytes:
    """The MAC that lets a peer write ``ids`` (dtype and shape of each in ``signed``) into the
    session of ``token``, once (``nonce`` must exceed the session's last one).

    Example:
        >>> tok = bytes(16)
        >>> t = ticket(tok, 1, [3], [["float32", [2, 2]]])
        >>> len(t), t == ticket(tok, 1, [3], [["float32", [2, 3]]]), len(session_id(tok))
        (16, False, 8)
    """
    return hashlib.blake2b(pack([nonce, ids, signed]), key=token, digest_size=TICKET_BYTES,
                           person=b"genie-put").digest()


# --- the values of a transfer -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Geometry:
    """Where one value lies in the byte span of its group: ``[group, dtype, shape, stride,
    offset in elements, math bits (1 conj, 2 neg)]`` on the wire."""

    group: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    bits: int

    def wire(self) -> list[Any]:
        return [self.group, dtype_name(self.dtype), list(self.shape), list(self.stride),
                self.offset, self.bits]

    def signed(self) -> list[Any]:
        return [dtype_name(self.dtype), list(self.shape)]


def pack_values(values: list[torch.Tensor]) -> tuple[list[Geometry], list[Any], int]:
    """(geometry of each value, one frame per storage span, bytes): values sharing a storage
    travel as one span of it, so they share a storage at the destination too."""
    spans: dict[int, list[Any]] = {}  # storage -> [group, lo, hi, storage]
    raw: list[tuple[int, int, int, torch.Tensor]] = []
    for v in values:
        st = v.untyped_storage()
        isz = v.element_size()
        if v.numel() == 0:
            lo = hi = v.storage_offset() * isz
        else:
            lo = v.storage_offset() * isz
            hi = lo + (sum((s - 1) * d for s, d in zip(v.shape, v.stride(), strict=True)) + 1) \
                * isz
        e = spans.get(st._cdata)
        if e is None:
            spans[st._cdata] = [len(spans), lo, hi, v]
        else:
            e[1], e[2] = min(e[1], lo), max(e[2], hi)
        raw.append((st._cdata, lo, hi, v))
    frames: list[Any] = []
    starts: dict[int, int] = {}
    for key, (g, lo, hi, v) in spans.items():
        lo -= lo % SPAN_ALIGN
        starts[key] = lo
        u8 = torch.empty(0, dtype=torch.uint8, device=v.device)
        u8.set_(v.untyped_storage(), 0, (v.untyped_storage().nbytes(),), (1,))
        span = u8[lo:hi]
        if span.device.type != "cpu":
            span = span.cpu()
        frames.append(span.numpy() if span.numel() else b"")
        assert g == len(frames) - 1
    geo = []
    for key, lo, _hi, v in raw:
        off = (lo - starts[key]) // v.element_size() if v.numel() else 0
        geo.append(Geometry(spans[key][0], v.dtype, tuple(v.shape), tuple(v.stride()), off,
                            (1 if v.is_conj() else 0) | (2 if v.is_neg() else 0)))
    return geo, frames, sum(frame_view(f).nbytes for f in frames)


def read_geometry(o: Any, n_frames: int) -> list[Geometry]:
    """The values' geometry of a ``put`` (ProtocolError when any field is malformed)."""
    if not isinstance(o, list) or not 0 < len(o) <= MAX_VALUES:
        raise ProtocolError(f"a put carries 1 to {MAX_VALUES} values, described in 'o'")
    out = []
    for m in o:
        if not isinstance(m, list) or len(m) != 6:
            raise ProtocolError(f"bad value geometry {m!r:.80}: want [group, dtype, shape, "
                                "stride, offset, bits]")
        g, dt, shape, stride, off, bits = m
        if type(g) is not int or not 0 <= g < n_frames:
            raise ProtocolError(f"value group {g!r:.20} names no frame (the put has "
                                f"{n_frames})")
        if type(off) is not int or off < 0 or type(bits) is not int or not 0 <= bits <= 3:
            raise ProtocolError(f"bad value offset or bits {off!r:.20}, {bits!r:.20}")
        if not isinstance(shape, list) or not isinstance(stride, list) or \
                len(shape) > MAX_DIMS or len(stride) != len(shape) or \
                not all(type(i) is int and i >= 0 for i in shape + stride):
            raise ProtocolError(f"bad value shape or strides {shape!r:.60}, {stride!r:.60}")
        out.append(Geometry(g, dtype_of(dt), tuple(shape), tuple(stride), off, bits))
    return out


def read_values(geo: list[Geometry], frames: list[Any], dev: torch.device
                ) -> list[torch.Tensor]:
    """The values a ``put`` carries, on ``dev``: every value is checked against the bytes of its
    group before any tensor is made (ProtocolError otherwise); each group becomes one storage,
    the frame's memory itself on a CPU server when it is aligned."""
    from .guard import check_bounds

    sizes = [frame_view(f).nbytes for f in frames]
    for k, m in enumerate(geo):
        isz = m.dtype.itemsize
        if math.prod(m.shape) > 0:
            why = check_bounds(m.shape, m.stride, m.offset, isz, sizes[m.group])
            if why is not None:
                raise ProtocolError(f"value {k} of the put: {why}")
    storages: dict[int, Any] = {}
    out = []
    for m in geo:
        st = storages.get(m.group)
        if st is None:
            st = storages[m.group] = _storage(frames[m.group], sizes[m.group], dev)
        t = torch.empty(0, dtype=m.dtype, device=dev)
        t.set_(st, m.offset, m.shape, m.stride)
        if m.bits & 1:
            t = t.conj()
        if m.bits & 2:
            t = torch._neg_view(t)
        out.append(t)
    return out


def _storage(frame: Any, nbytes: int, dev: torch.device) -> Any:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=dev).untyped_storage()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers: copied, or only read by torch
        u8 = torch.frombuffer(frame_view(frame), dtype=torch.uint8)
    if dev.type != "cpu":
        u8 = u8.to(dev)
    elif u8.data_ptr() % ALIGN:  # a received frame: copy it to where torch's allocator aligns
        u8 = u8.clone()
    return u8.untyped_storage()


# --- the sending side ---------------------------------------------------------------------------

@dataclass
class Outgoing:
    """One transfer under way: where to, what, and whom to answer."""

    dest: str
    server_key: str | None
    header: dict[str, Any]
    frames: list[Any]
    nbytes: int
    reply_to: bytes  # the client's connection (ROUTER identity)
    rid: int  # the client's request id
    deadline: float = 0.0
    timeout: float = 30.0
    keep: list[Any] = field(default_factory=list)  # the values, alive until sent
    done: Callable[[int | None], None] | None = None  # called once: the bytes, None if failed


@dataclass
class _Link:
    sock: zmq.Socket
    mon: zmq.Socket
    connected: bool = False
    pending: dict[int, Outgoing] = field(default_factory=dict)
    used: float = 0.0


class PeerLinks:
    """The server's connections to its peers, on a thread of their own.

    Workers :meth:`submit` transfers and return at once; this thread sends them, waits for each
    destination's answer (at most ``timeout`` seconds of its silence), and answers the client
    through ``reply_endpoint`` (the server's reply socket, whose main thread forwards it).

    Args:
        ctx: the server's ZeroMQ context.
        keys: this server's peer key pair (public, secret; Z85 bytes), or None for plain TCP.
        reply_endpoint: where answers to clients go.
    """

    def __init__(self, ctx: zmq.Context, keys: tuple[bytes, bytes] | None,
                 reply_endpoint: str) -> None:
        self.ctx = ctx
        self.keys = keys
        self.reply_endpoint = reply_endpoint
        self.sent_bytes = 0
        self.received_bytes = 0
        self._q: queue.SimpleQueue[Outgoing | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._rids = iter(range(1, 1 << 62))
        self._thread = threading.Thread(target=self._loop, name="genie-peer", daemon=True)
        self._thread.start()

    def submit(self, t: Outgoing) -> None:
        self._q.put(t)
        os.write(self._wake_w, b"x")

    def close(self) -> None:
        self._q.put(None)
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=10)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # --- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        out = self.ctx.socket(zmq.PUSH)
        out.linger = 0
        out.connect(self.reply_endpoint)
        links: dict[str, _Link] = {}
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)

        def answer(t: Outgoing, err: str | None, got: dict[str, Any] | None = None) -> None:
            if t.done is not None:
                t.done(t.nbytes if err is None else None)
                t.done = None  # once
            if err is None:
                self.sent_bytes += t.nbytes
                h = {"t": "ok", "rid": t.rid, "pb": t.nbytes}
                logger.debug("genie-server: sent %d bytes to %s", t.nbytes, t.dest)
            else:
                h = {"t": "err", "rid": t.rid, "kind": "peer",
                     "msg": f"sending {len(t.header.get('ids', []))} value(s) ({t.nbytes} "
                            f"bytes) to the peer server {t.dest} failed: {err}"}
                pk = got.get("kind") if got is not None else None
                if isinstance(pk, str):
                    h["pk"] = pk[:16]  # the destination's own refusal kind (quota, ...)
                room = got.get("room") if got is not None else None
                if type(room) is int and room > 0:
                    h["room"] = room  # bytes the destination would need freed
                logger.info("genie-server: %s", h["msg"])
            out.send_multipart([t.reply_to, pack(h)])
            t.keep.clear()

        def drop(dest: str, why: str) -> None:
            link = links.pop(dest, None)
            if link is None:
                return
            for t in link.pending.values():
                answer(t, why)
            poller.unregister(link.mon)
            poller.unregister(link.sock)
            link.sock.disable_monitor()
            for s in (link.mon, link.sock):
                s.close(linger=0)

        try:
            while True:
                events = dict(poller.poll(100))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                    while True:
                        try:
                            t = self._q.get_nowait()
                        except queue.Empty:
                            break
                        if t is None:
                            return
                        try:
                            self._start(t, links, poller, answer, drop)
                        except Exception as e:  # one bad transfer never stops the others
                            logger.exception("genie-server: a transfer to %s failed to start",
                                             t.dest)
                            answer(t, f"it could not be sent ({type(e).__name__}: {e})")
                for dest, link in list(links.items()):
                    try:
                        if link.mon in events:
                            why = self._monitor(link)
                            if why is not None:
                                drop(dest, why)
                                continue
                        if link.sock in events:
                            self._replies(link, answer)
                    except Exception as e:  # never let the thread die: fail this link only
                        logger.exception("genie-server: the link to %s failed", dest)
                        drop(dest, f"the link failed ({type(e).__name__}: {e})")
                now = time.monotonic()
                for dest, link in list(links.items()):
                    for rid, t in list(link.pending.items()):
                        if now > t.deadline:
                            del link.pending[rid]
                            answer(t, f"no answer within {t.timeout:g} s (the peer is hung or "
                                      "unreachable); check that it runs and that this server "
                                      "can reach it")
                    if not link.pending and now - link.used > 60:
                        drop(dest, "idle")
        finally:
            for dest in list(links):
                drop(dest, "the server is stopping")
            out.close(linger=0)

    def _start(self, t: Outgoing, links: dict[str, _Link], poller: zmq.Poller,
               answer: Callable[..., None], drop: Callable[[str, str], None]) -> None:
        link = links.get(t.dest)
        if link is None:
            if len(links) >= MAX_LINKS:
                idle = [d for d, lk in links.items() if not lk.pending]
                if idle:
                    drop(min(idle, key=lambda d: links[d].used), "closed (too many links)")
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0
            if self.keys is not None:
                if t.server_key is None:
                    return answer(t, "no server key for it: a CURVE server connects to peers "
                                     "with CURVE only (the client sends the key it uses)")
                sock.curve_serverkey = t.server_key.encode()
                sock.curve_publickey, sock.curve_secretkey = self.keys
            # A name of its own: pyzmq's default (inproc://monitor.s-<fd>) is reused by the next
            # socket that gets a closed link's file descriptor while libzmq's reaper may still
            # hold the old name, and that bind fails with "Address already in use".
            mon = sock.get_monitor_socket(addr=f"inproc://genie-peer-monitor-{next(_monitors)}")
            sock.connect(t.dest)
            link = links[t.dest] = _Link(sock, mon)
            poller.register(sock, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
        rid = next(self._rids)
        t.header["rid"] = rid
        frames, counts = split_frames(t.frames)
        if counts is not None:
            t.header["fc"] = counts
        data = pack(t.header)
        t.deadline = time.monotonic() + t.timeout
        link.used = time.monotonic()
        link.sock.send_multipart([data, *frames], copy=False)
        link.pending[rid] = t

    def _monitor(self, link: _Link) -> str | None:
        while link.mon.poll(0):
            ev = recv_monitor_message(link.mon)["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.connected = True
            elif ev == zmq.EVENT_DISCONNECTED and link.connected:
                return "the connection to the peer dropped (peer killed or restarted?)"
            elif ev == zmq.EVENT_CONNECT_RETRIED and not link.connected:
                return "connection refused: no genie-server listens there"
            elif ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return ("the peer refused this server's peer key (not in its authorized "
                        "keys): serve both with the pool's key directory (--keys) or give "
                        "--peer-keys a connection file the peer authorizes")
            elif ev in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                return ("the security handshake failed: the peer does not hold the server key "
                        "the client gave, or one side is --insecure and the other is not")
        return None

    def _replies(self, link: _Link, answer: Callable[..., None]) -> None:
        while True:
            try:
                parts = link.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                h = unpack(parts[0])
            except ProtocolError:
                continue
            if not isinstance(h, dict):
                continue
            t = link.pending.get(h.get("rid"))  # type: ignore[arg-type]
            if t is None:
                continue
            if h.get("t") == "busy":
                t.deadline = time.monotonic() + t.timeout
                continue
            del link.pending[h["rid"]]
            if h.get("t") == "ok":
                answer(t, None, h)
            else:
                answer(t, f"the peer refused it ({h.get('kind')}): {h.get('msg')}", h)


def load_peer_keys(path: str) -> tuple[bytes, bytes, bytes]:
    """(server key, public, secret) from a connection file (``client.json``, a pool file)."""
    import json

    try:
        d = json.loads(open(os.path.expanduser(path)).read())
        return (d["server_public_key"].encode(), d["client_public_key"].encode(),
                d["client_secret_key"].encode())
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise SystemExit(f"genie-server: cannot read peer keys from {path}: {e}; give the "
                         "connection file genie-server or genie-pool wrote") from None
