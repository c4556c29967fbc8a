"""Server-to-server transfers: a server hands resident values directly to another server.

A client that wants values of its session on server A to be in its session on server B (a KV
cache made by a prefill on A, needed by a decode on B) sends A one ``send`` request. A reads the
values from the session's store and pushes them to B in one ``put`` message; B stores them in the
client's session there under ids the client chose, and answers A; A answers the client. The bytes
never pass through the client: its cost is one round trip of a few hundred bytes.

**Where to.** A server sends only to the members of its own pool: the addresses (and server
public keys) registered by whoever started it (``--peers``, a list or a file the pool keeps
current, :class:`Peers`), never to a host and port a client names. A destination that is not
registered is refused before any connection is tried, with one message whatever is (or is not)
listening there; a registered one that fails gets one message too, whatever failed (refused,
dropped, silent, wrong key: the cause goes to the server's log). So a key holder cannot use a
server to reach, or to tell apart, the ports of its network.

**Who may write into a session.** The destination session is named by a public id (a hash of its
token, :func:`session_id`), never by the token itself; the ``put`` carries a *ticket*, a keyed
BLAKE2b MAC made by the client with its session token as key (:func:`ticket`) over a nonce, the
handle ids and each value's dtype, shape, strides, storage offset and math bits. A ``put`` carries
nothing else the receiver acts on but the grouping of the values into storages (which values
share one storage: the source's to say, as the bytes are) and the frame layout; every other field
is refused (a ``free`` riding on a put deleted handles of the session once). So A learns a
capability for exactly this write and nothing else: it can neither read that session (a put's
answer tells nothing of the session's residency), nor free or run anything in it, nor replay the
ticket (the nonce must grow), nor change what it writes beyond the bytes. B trusts no peer more
than a client: every field is checked before memory is touched and the session's quota applies
(:func:`read_values`).

**Authentication.** Peers authenticate as servers, not as clients: A connects to B with CURVE,
with the server key *registered* for B (a client's word for it is never used, so an endpoint
that does not hold B's secret key cannot complete the handshake and never receives a byte) and
A's *peer key pair* (``peer.key_secret`` of its key directory, distinct from the client pair
handed to clients; B accepts it only when its public key is in B's ``peers/`` directory, and
takes only ``put`` messages from it, and ``put`` messages only from it: :class:`KeyRing` in
:mod:`genie.remote.keys`). With ``--insecure`` there is no authentication at all, but the
registry still decides where a server sends.

**Aliasing survives.** Values that share a storage on A (a view and its base) are sent as one
byte span of that storage plus each value's geometry, and share one storage on B again.

**Failures never hang, and free what they held.** A transfer waits at most ``timeout`` seconds
of silence from B (B's "busy" notes extend it, as for a client). While it waits, A's worker is
free: :class:`PeerLinks` owns the peer sockets on a thread of its own (one connection per
destination and session) and answers the client when B has answered. A transfer pins the
storages it reads until it ends; bytes pinned that the session no longer holds count against its
quota (:func:`unheld_bytes`), a failed transfer closes its connection (what ZeroMQ still queued
is dropped at once), and a session that ends cancels its transfers. Peer connections take at most
:data:`PEER_REPLY_MAX` bytes a message (answers only).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import re
import threading
import time
import warnings
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..memory import malloc_trim
from . import ProtocolError
from .protocol import (
    ALIGN,
    MAX_DIMS,
    check_bounds,
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
#: idle peer connections a server keeps open (least recently used closed beyond)
MAX_LINKS = 16
#: the largest message a peer connection takes in (a put's answer is a few hundred bytes)
PEER_REPLY_MAX = 64 << 10
#: a value span's start is rounded down to this many bytes (the largest itemsize: complex128),
#: so every value's offset stays a whole number of its elements
SPAN_ALIGN = 16
#: the largest storage offset a put may name (elements)
MAX_OFFSET = 1 << 62
#: what a peer address may look like
ADDRESS = re.compile(r"tcp://[A-Za-z0-9.\-\[\]:]{1,255}:\d{1,5}")
#: a CURVE public key in Z85
Z85_KEY = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
#: the fields of a ``put`` header; any other is refused (see the module docstring)
PUT_FIELDS = frozenset({"t", "rid", "sid", "n", "ids", "v", "g", "tk", "fc"})


def session_id(token: bytes) -> bytes:
    """The public id of the session whose (secret) token is ``token``."""
    return hashlib.blake2b(token, digest_size=SESSION_ID_BYTES, person=b"genie-sid").digest()


def ticket(token: bytes, nonce: int, ids: list[int], signed: list[list[Any]]) -> bytes:
    """The MAC that lets a peer write ``ids`` into the session of ``token``, once (``nonce`` must
    exceed the session's last one); ``signed`` holds each value's ``[dtype, shape, strides,
    storage offset, math bits]`` (:func:`describe`), all of which the receiver acts on.

    Example:
        >>> tok = bytes(16)
        >>> t = ticket(tok, 1, [3], [["float32", [2, 2], [2, 1], 0, 0]])
        >>> len(t), t == ticket(tok, 1, [3], [["float32", [2, 2], [1, 2], 0, 0]])
        (16, False)
    """
    return hashlib.blake2b(pack([nonce, ids, signed]), key=token, digest_size=TICKET_BYTES,
                           person=b"genie-put").digest()


def describe(dtype: torch.dtype, shape: Any, stride: Any, offset: int, conj: bool = False,
             neg: bool = False) -> list[Any]:
    """What a ticket signs of one value: ``[dtype, shape, strides, storage offset, math bits
    (1 conj, 2 neg)]``, as the client's metadata and the source's tensor both say it."""
    return [dtype_name(dtype), list(shape), list(stride), int(offset),
            (1 if conj else 0) | (2 if neg else 0)]


# --- the values of a transfer -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Geometry:
    """One value of a transfer: its storage group (one frame each), what the ticket signs of it
    (dtype, shape, strides, the source's storage offset ``so``, math bits) and where it starts
    in its group's frame (``offset``, elements: derived from the signed storage offsets,
    :func:`_offsets`, never sent)."""

    group: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    bits: int
    so: int = 0

    def signed(self) -> list[Any]:
        return [dtype_name(self.dtype), list(self.shape), list(self.stride), self.so, self.bits]


def _offsets(groups: list[int], isz: list[int], numel: list[int], so: list[int]
             ) -> tuple[list[int], dict[int, int]]:
    """Each value's offset in its group's span (elements) and each group's span start in the
    source storage (bytes): a span starts at its lowest non-empty value, rounded down to
    :data:`SPAN_ALIGN`. Both ends compute it, so offsets never travel unsigned."""
    lo: dict[int, int] = {}
    for g, i, n, o in zip(groups, isz, numel, so, strict=True):
        if n:
            b = o * i
            lo[g] = min(lo.get(g, b), b)
    lo = {g: b - b % SPAN_ALIGN for g, b in lo.items()}
    return [(o * i - lo[g]) // i if n else 0
            for g, i, n, o in zip(groups, isz, numel, so, strict=True)], lo


def pack_values(values: list[torch.Tensor]) -> tuple[list[Geometry], list[Any], int]:
    """(geometry of each value, one frame per storage span, bytes): values sharing a storage
    travel as one span of it, so they share a storage at the destination too."""
    keys: dict[int, int] = {}  # storage -> group
    groups = [keys.setdefault(v.untyped_storage()._cdata, len(keys)) for v in values]
    isz = [v.element_size() for v in values]
    numel = [v.numel() for v in values]
    so = [v.storage_offset() for v in values]
    offs, lo = _offsets(groups, isz, numel, so)
    hi: dict[int, int] = {}
    for v, g, i, n, o in zip(values, groups, isz, numel, so, strict=True):
        if n:
            end = o * i + (sum((s - 1) * d for s, d in zip(v.shape, v.stride(), strict=True))
                           + 1) * i
            hi[g] = max(hi.get(g, 0), end)
    frames: list[Any] = [b""] * len(keys)
    first: dict[int, torch.Tensor] = {}
    for v, g in zip(values, groups, strict=True):
        first.setdefault(g, v)
    for g, v in first.items():
        if g not in lo:
            continue  # only empty values: an empty frame
        u8 = torch.empty(0, dtype=torch.uint8, device=v.device)
        u8.set_(v.untyped_storage(), 0, (v.untyped_storage().nbytes(),), (1,))
        span = u8[lo[g]:hi[g]]
        if span.device.type != "cpu":
            span = span.cpu()
        frames[g] = span.numpy()
    geo = [Geometry(g, v.dtype, tuple(v.shape), tuple(v.stride()), off,
                    (1 if v.is_conj() else 0) | (2 if v.is_neg() else 0), o)
           for v, g, off, o in zip(values, groups, offs, so, strict=True)]
    return geo, frames, sum(frame_view(f).nbytes for f in frames)


def read_geometry(signed: Any, groups: Any, n_frames: int) -> list[Geometry]:
    """The values' geometry of a ``put``: ``signed`` as the ticket signs it (:func:`describe`),
    ``groups`` the frame of each value (ProtocolError when any field is malformed)."""
    if not isinstance(signed, list) or not 0 < len(signed) <= MAX_VALUES:
        raise ProtocolError(f"a put carries 1 to {MAX_VALUES} values, described in 'v'")
    if not isinstance(groups, list) or len(groups) != len(signed):
        raise ProtocolError("a put names the frame of each value in 'g' (one per value)")
    out = []
    for m, g in zip(signed, groups, strict=True):
        if not isinstance(m, list) or len(m) != 5:
            raise ProtocolError(f"bad value geometry {m!r:.80}: want [dtype, shape, stride, "
                                "storage offset, bits]")
        dt, shape, stride, so, bits = m
        if type(g) is not int or not 0 <= g < n_frames:
            raise ProtocolError(f"value group {g!r:.20} names no frame (the put has "
                                f"{n_frames})")
        if type(so) is not int or not 0 <= so < MAX_OFFSET or type(bits) is not int or \
                not 0 <= bits <= 3:
            raise ProtocolError(f"bad value offset or bits {so!r:.20}, {bits!r:.20}")
        if not isinstance(shape, list) or not isinstance(stride, list) or \
                len(shape) > MAX_DIMS or len(stride) != len(shape) or \
                not all(type(i) is int and 0 <= i < MAX_OFFSET for i in shape + stride):
            raise ProtocolError(f"bad value shape or strides {shape!r:.60}, {stride!r:.60}")
        out.append([g, dtype_of(dt), tuple(shape), tuple(stride), so, bits])
    offs, _ = _offsets([m[0] for m in out], [m[1].itemsize for m in out],
                       [math.prod(m[2]) for m in out], [m[4] for m in out])
    return [Geometry(g, dt, sh, st, off, bits, so)
            for (g, dt, sh, st, so, bits), off in zip(out, offs, strict=True)]


def read_values(geo: list[Geometry], frames: list[Any], dev: torch.device
                ) -> list[torch.Tensor]:
    """The values a ``put`` carries, on ``dev``: every value is checked against the bytes of its
    group before any tensor is made (ProtocolError otherwise); each group becomes one storage,
    the frame's memory itself on a CPU server when it is aligned."""
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


def check_put(h: dict[str, Any], token_of: Callable[[bytes], bytes | None]
              ) -> tuple[bytes, int]:
    """The destination token and nonce of a peer's ``put`` header, once its fields and ticket
    are checked (ProtocolError or LookupError, the latter when no session has its id); the
    caller checks that the nonce grows. ``token_of`` maps a public session id to its token."""
    extra = sorted(str(k)[:20] for k in h if k not in PUT_FIELDS)
    if extra:
        raise ProtocolError(f"a put carries only {', '.join(sorted(PUT_FIELDS))}; it also has "
                            f"{', '.join(extra)} (a put writes values and nothing else)")
    sid, n, ids, v, g, tk = h.get("sid"), h.get("n"), h.get("ids"), h.get("v"), h.get("g"), \
        h.get("tk")
    if not isinstance(sid, bytes) or len(sid) != SESSION_ID_BYTES or \
            type(n) is not int or not 0 < n < 1 << 63 or not isinstance(tk, bytes) or \
            len(tk) != TICKET_BYTES:
        raise ProtocolError("a put needs 'sid' (8 bytes), 'n' (a positive nonce) and 'tk' (a "
                            "16-byte ticket)")
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_VALUES or \
            not all(type(i) is int and 0 <= i < 1 << 63 for i in ids) or \
            len(set(ids)) != len(ids) or not isinstance(v, list) or len(v) != len(ids) or \
            not isinstance(g, list) or len(g) != len(ids):
        raise ProtocolError(f"a put needs 'ids' (1 to {MAX_VALUES} distinct ids) and one "
                            "signed geometry in 'v' and one group in 'g' per id")
    tok = token_of(sid)
    if tok is None:
        raise LookupError("the destination session of this put does not exist (it expired or "
                          "was closed)")
    try:
        expect = ticket(tok, n, ids, v)
    except Exception:
        raise ProtocolError("a put whose geometry cannot be signed") from None
    import hmac

    if not hmac.compare_digest(expect, tk):
        raise ProtocolError("the put's ticket does not match its session, nonce, ids and "
                            "values' geometry (only the session's client can make one)")
    return tok, n


def unheld_bytes(pins: tuple[tuple[tuple[int, int], ...], ...], held: Container[int]) -> int:
    """Bytes that transfers under way pin and the session no longer holds: ``pins`` has one
    entry per transfer, ``(storage key, bytes)`` per storage it reads; ``held`` the storage keys
    the session still counts. Each storage counted once."""
    seen: set[int] = set()
    n = 0
    for spans in pins:
        for key, nb in spans:
            if key not in seen and key not in held:
                seen.add(key)
                n += nb
    return n


def pins_of(values: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """The storages ``values`` read, as :func:`unheld_bytes` counts them."""
    out: dict[int, int] = {}
    for v in values:
        st = v.untyped_storage()
        out[st._cdata] = st.nbytes()
    return tuple(out.items())


# --- where a server may send: its pool ----------------------------------------------------------

def normalize(address: str) -> str:
    return address.strip().lower()


class Peers:
    """The pool members a server may send to: address -> the member's CURVE server public key
    (Z85; None on ``--insecure`` servers).

    ``spec`` (``--peers``): None (no peers: every send is refused), a comma-separated list of
    ``tcp://host:port`` (each served with ``default_key``, the key of this server's own key
    directory, which a pool's members share), or the path of a JSON file, read again whenever
    it changes: ``{"peers": [{"address": ..., "server_public_key": ...}, ...]}``, or a pool file
    (``address``: the members comma-separated, ``server_public_key``: their key). A file that
    does not exist yet means no peers yet (a pool writes it once its members are up).
    """

    def __init__(self, spec: str | None = None, default_key: str | None = None) -> None:
        self.default_key = default_key
        self._file: Path | None = None
        self._stamp: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._map: dict[str, str | None] = {}
        if spec is None or not spec.strip():
            return
        if spec.strip().lower().startswith("tcp://"):
            for a in spec.split(","):
                if not ADDRESS.fullmatch(normalize(a)):
                    raise SystemExit(f"genie-server: --peers: {a.strip()!r} is not "
                                     "tcp://host:port; give a comma-separated list of the pool "
                                     "members' addresses, or a peers file")
                self._map[normalize(a)] = default_key
        else:
            self._file = Path(spec).expanduser()
            self._reload()

    def set(self, entries: list[tuple[str, str | None]]) -> None:
        """Replace the registered members (a launcher that keeps them in memory, e.g. Ray)."""
        m = {normalize(a): self._key(k) for a, k in entries
             if isinstance(a, str) and ADDRESS.fullmatch(normalize(a))}
        with self._lock:
            self._map = m

    def lookup(self, address: str) -> tuple[bool, str | None]:
        """(registered, its server key) of ``address``."""
        self._reload()
        with self._lock:
            a = normalize(address)
            return (a in self._map, self._map.get(a))

    def __len__(self) -> int:
        self._reload()
        return len(self._map)

    def _key(self, k: Any) -> str | None:
        if isinstance(k, str) and Z85_KEY.fullmatch(k):
            return k
        return self.default_key

    def _reload(self) -> None:
        if self._file is None:
            return
        try:
            st = self._file.stat()
        except OSError:
            with self._lock:
                self._map, self._stamp = {}, None
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            d = json.loads(self._file.read_text())
            if "peers" in d:
                entries = [(e["address"], e.get("server_public_key")) for e in d["peers"]]
            else:
                addr = d.get("address", "")
                addrs = addr.split(",") if isinstance(addr, str) else list(addr)
                keys = d.get("server_keys") or [d.get("server_public_key")] * len(addrs)
                entries = list(zip((a.strip() for a in addrs if a.strip()), keys, strict=False))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("genie-server: cannot read the peers file %s (%s); no peers until "
                           "it is valid", self._file, e)
            entries = []
        self.set(entries)
        self._stamp = stamp


# --- the sending side ---------------------------------------------------------------------------

#: the one answer a client gets when a registered peer did not take a transfer (whatever failed:
#: the cause is logged on the sending server)
#: seconds after a failed transfer's connection closes at which freed memory goes back to the
#: OS: ZeroMQ's reaper frees the queued frames when it gets to run (late on a loaded machine), so
#: the allocator is asked again until the last of these
TRIM_AFTER = (0.3, 1.0, 3.0, 8.0)


UNDELIVERED = ("the peer server {dest} did not take the values: it is down or unreachable, it "
               "is not the server registered for that address, or it did not answer within "
               "{timeout:g} s (this server's log has the cause)")


@dataclass
class Outgoing:
    """One transfer under way: where to, what, and whom to answer."""

    dest: str
    server_key: str | None  # the destination's registered key (None: plain TCP)
    header: dict[str, Any]
    frames: list[Any]
    nbytes: int
    reply_to: bytes  # the client's connection (ROUTER identity)
    rid: int  # the client's request id
    deadline: float = 0.0
    timeout: float = 30.0
    keep: list[Any] = field(default_factory=list)  # the values, alive until sent
    done: Callable[[int | None], None] | None = None  # called once: the bytes, None if failed
    session: bytes = b""  # the sending session (its transfers share a connection per peer)


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
    through ``reply_endpoint`` (the server's reply socket, whose main thread forwards it). One
    connection per (destination, session): a failed transfer closes its connection (dropping
    what ZeroMQ still queued for it) without touching other sessions' transfers, and
    :meth:`cancel` ends a closed session's transfers at once.

    Args:
        ctx: the server's ZeroMQ context.
        keys: this server's peer key pair (public, secret; Z85 bytes), or None for plain TCP.
        reply_endpoint: where answers to clients go.
        reply_max: the largest message a peer connection takes in.
    """

    def __init__(self, ctx: zmq.Context, keys: tuple[bytes, bytes] | None,
                 reply_endpoint: str, reply_max: int = PEER_REPLY_MAX) -> None:
        self.ctx = ctx
        self.keys = keys
        self.reply_endpoint = reply_endpoint
        self.reply_max = reply_max
        self.sent_bytes = 0
        self.received_bytes = 0
        self._q: queue.SimpleQueue[Outgoing | bytes | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._rids = iter(range(1, 1 << 62))
        self._thread = threading.Thread(target=self._loop, name="genie-peer", daemon=True)
        self._thread.start()

    def submit(self, t: Outgoing) -> None:
        self._q.put(t)
        os.write(self._wake_w, b"x")

    def cancel(self, session: bytes) -> None:
        """End the transfers of ``session`` (it closed or expired): their connections close,
        which frees what they pinned; their clients are told."""
        self._q.put(bytes(session))
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
        links: dict[tuple[str, bytes], _Link] = {}
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
            t.frames.clear()

        def drop(key: tuple[str, bytes], why: str | None, cause: str = "") -> None:
            """Close a link; its transfers fail (``why``: the client's message, None: the
            uniform one, with ``cause`` logged)."""
            link = links.pop(key, None)
            if link is None:
                return
            if link.pending and cause:
                logger.info("genie-server: the connection to the peer %s failed: %s", key[0],
                            cause)
            for t in link.pending.values():
                answer(t, why if why is not None else
                       UNDELIVERED.format(dest=t.dest, timeout=t.timeout))
            had = bool(link.pending)
            link.pending.clear()
            poller.unregister(link.mon)
            poller.unregister(link.sock)
            link.sock.disable_monitor()
            for s in (link.mon, link.sock):
                s.close(linger=0)
            if had:  # what it pinned is freed by ZeroMQ's own thread, in chunks the allocator
                now = time.monotonic()  # keeps: hand it back to the OS soon
                trim[:] = [now + d for d in TRIM_AFTER]

        trim: list[float] = []  # when to return freed memory to the OS (soonest first)
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
                        if isinstance(t, bytes):  # a session ended: its transfers with it
                            for key in [k for k in links if k[1] == t]:
                                drop(key, "the session ended before the peer took the values")
                            continue
                        try:
                            self._start(t, links, poller, answer, drop)
                        except Exception as e:  # one bad transfer never stops the others
                            logger.exception("genie-server: a transfer to %s failed to start",
                                             t.dest)
                            answer(t, f"it could not be sent ({type(e).__name__}: {e})")
                for key, link in list(links.items()):
                    try:
                        if link.mon in events:
                            why = self._monitor(link)
                            if why is not None:
                                drop(key, None, why)
                                continue
                        if link.sock in events:
                            self._replies(link, answer)
                    except Exception as e:  # never let the thread die: fail this link only
                        logger.exception("genie-server: the link to %s failed", key[0])
                        drop(key, None, f"{type(e).__name__}: {e}")
                now = time.monotonic()
                for key, link in list(links.items()):
                    late = [t for t in link.pending.values() if now > t.deadline]
                    if late:  # the peer is silent: close the connection, freeing its queue
                        drop(key, None, f"no answer within {late[0].timeout:g} s")
                    elif not link.pending and now - link.used > 60:
                        drop(key, "idle")
                if trim and now >= trim[0]:
                    del trim[0]
                    malloc_trim()  # a transfer's 1 MiB frames are heap chunks glibc keeps
        finally:
            for key in list(links):
                drop(key, "the server is stopping")
            out.close(linger=0)

    def _start(self, t: Outgoing, links: dict[tuple[str, bytes], _Link], poller: zmq.Poller,
               answer: Callable[..., None], drop: Callable[..., None]) -> None:
        key = (t.dest, t.session)
        link = links.get(key)
        if link is None:
            if len(links) >= MAX_LINKS:
                idle = [k for k, lk in links.items() if not lk.pending]
                if idle:
                    drop(min(idle, key=lambda k: links[k].used), "closed (too many links)")
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.setsockopt(zmq.MAXMSGSIZE, self.reply_max)
            if self.keys is not None:
                if t.server_key is None:
                    return answer(t, "no server key is registered for it: a CURVE server "
                                     "connects to its peers with CURVE only (give their keys "
                                     "in the peers file)")
                sock.curve_serverkey = t.server_key.encode()
                sock.curve_publickey, sock.curve_secretkey = self.keys
            # A name of its own: pyzmq's default (inproc://monitor.s-<fd>) is reused by the next
            # socket that gets a closed link's file descriptor while libzmq's reaper may still
            # hold the old name, and that bind fails with "Address already in use".
            mon = sock.get_monitor_socket(addr=f"inproc://genie-peer-monitor-{next(_monitors)}")
            sock.connect(t.dest)
            link = links[key] = _Link(sock, mon)
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
        """Why the link failed (for the log), or None."""
        while link.mon.poll(0):
            ev = recv_monitor_message(link.mon)["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.connected = True
            elif ev == zmq.EVENT_DISCONNECTED and link.connected:
                return "the connection dropped (peer killed or restarted?)"
            elif ev == zmq.EVENT_CONNECT_RETRIED and not link.connected:
                return "connection refused"
            elif ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return ("the peer refused this server's peer key (not in its peers/ "
                        "directory)")
            elif ev in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                return ("the security handshake failed: the endpoint does not hold the server "
                        "key registered for it, or one side is --insecure and the other is not")
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
                answer(t, f"the peer refused it ({str(h.get('kind'))[:16]}): "
                          f"{str(h.get('msg'))[:2000]}", h)


def load_peer_keys(path: str) -> tuple[bytes, bytes]:
    """(public, secret) of a peer key pair: a ZeroMQ certificate with its secret key
    (``peer.key_secret``), or a connection file's client pair (``client.json``)."""
    p = os.path.expanduser(path)
    try:
        text = open(p).read()
        if text.lstrip().startswith("{"):
            d = json.loads(text)
            return d["client_public_key"].encode(), d["client_secret_key"].encode()
        import zmq.auth

        pub, sec = zmq.auth.load_certificate(p)
        if pub is None or sec is None:
            raise ValueError("no secret key in it")
        return pub, sec
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise SystemExit(f"genie-server: cannot read a peer key pair from {path}: {e}; give "
                         "the peer.key_secret of a key directory (or a connection file)") \
            from None
