"""The client side of one server session: a ZeroMQ connection, handles, batched frees.

A :class:`Client` opens one session on one ``genie-server``. Each materialization is one request
(:meth:`Client.run`): the tape's skeleton (only if the session lacks it), its constants (only the
ones that changed), and the host tensors the server has not seen. The reply carries the requested
outputs; every other value the program still holds stays on the server and comes back as a
:class:`Handle`.

Lifetime: a handle's finalizer queues its id; queued ids ride on the next request (``free``) or,
when the program is idle, on the heartbeat thread's own connection, which also keeps the
session's lease.

Failure: the client waits for an answer at most ``timeout`` seconds of server *silence* (a server
busy with a long tape says so twice a second), watches the connection (a server that dies
mid-request is reported at once) and then raises a :class:`~genie.remote.RemoteError` naming the
server; a client that lost its session refuses all later work with :class:`SessionLostError`.

Server to server (:meth:`Client.send`): values of this session go to another session of the same
program on another server directly (one round trip to this server; the bytes never pass through
the client, see :mod:`genie.remote.peer`); ``genie.stats()`` counts them in ``peer_bytes``.

Recovery (``replay=True``): the client keeps its session's :class:`~genie.remote.lineage.Lineage`;
when the server dies or forgets the session, it opens a new session on the next address of its
pool (or the same one once it is back), replays the log (same handle ids, same random seeds),
re-sends the interrupted request and goes on; handles stay valid. Only what cannot be replayed
(no server answers within ``timeout``, or the replay itself fails) raises as without replay.

Memory pressure: requests carry residency hints (roles of resident values); a request the
server answers ``pressure`` is sent again after the client evicted the values it named, each to
come back by recompute or re-upload as the cost model says (:mod:`genie.remote.residency`). Every
round trip feeds the cost model (:mod:`genie.remote.cost`): bytes and network time (the reply
says how long the server worked), and now and then a tape's FLOPs against its run time.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import itertools
import logging
import math
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from .. import _C, graphs, progress
from ..config import config as _config
from ..errors import ExecutionError, GenieError
from ..graph import TensorMeta
from ..planner import PendingSlots, Tape, raw_instrs
from ..progress import transfer_done, transfer_started
from ..stats import _counts, bump
from ..tape_io import UPLOAD
from . import (
    PeerTransferError,
    ProtocolError,
    QuotaExceededError,
    RemoteError,
    RunTimeoutError,
    ServerUnavailableError,
    SessionLostError,
)
from .cost import CLIENT, LARGE_BYTES, SMALL_BYTES, flops_of, model
from .decompose import for_server
from .lineage import FreeEntry, Lineage, PeerEntry, PutEntry, RunEntry, host_sources
from .peer import describe, session_id, ticket
from .protocol import (
    _DTYPES,
    ALIGN,
    MAX_HEADER_BYTES,
    WIRE_DTYPES,
    EXT_INPUT,
    PROTOCOL_VERSION,
    FrameRef,
    const_delta,
    dtype_of,
    encode_tape,
    frame_tensor,
    frame_view,
    ROLE_CODE,
    host_ref,
    join_frames,
    pack,
    split_frames,
    unpack,
)
from .handle import Handle
from .residency import SIZED_MEMORY, Residency, Resident, dense
from .wire import NOBLOCK, recv_parts, send_parts

logger = logging.getLogger("genie.remote")

#: how many skeletons a client remembers having sent (the server keeps more, so it never misses)
SKELETON_MEMORY = 256
#: rounds of eviction one request may go through before the client gives up
MAX_PRESSURE_ROUNDS = 8
#: every N-th run of a known skeleton, the tape's FLOPs and run time feed the cost model
FLOP_SAMPLE_EVERY = 16
#: every N-th small round trip's time feeds the cost model's link latency (bulk ones: all)
LATENCY_SAMPLE_EVERY = 4
#: run replies' ``vt`` (how the server vetted the tape) -> the counter it bumps
_VETTED_AS = {"guarded": "server_guarded_runs", "vetted": "server_vets",
              "class": "server_shape_class_hits", "hit": "server_vet_hits"}
#: seconds between the heartbeat's pings while :attr:`Client.watch_load` is on
LOAD_EVERY = 0.25


#: frames at least this large become the downloaded tensor's memory (no copy); smaller ones are
#: copied (they may sit unaligned inside the message struct)
ZERO_COPY_MIN = 1 << 16

#: a steady run's reply read natively (csrc/client_run.cpp, :meth:`Client._receive`): its
#: header and outputs in one call, or None for the Python path (GENIE_CLIENT_NATIVE=0: always)
_client_reply = _C._client_reply
_C._client_reply_init({k: v for k, v in _DTYPES.items() if v in WIRE_DTYPES}, ZERO_COPY_MIN)
#: a steady run's handles and residency records made in one call, or None for the Python path
#: (Client._book; GENIE_CLIENT_NATIVE=0: always)
_client_book = _C._client_book
_C._client_book_init(Handle, Resident, SIZED_MEMORY)
#: ``frames`` of a reply whose outputs were read with its header (:func:`_client_reply`)
_READ: list[Any] = []


#: the dtypes a one-element download is read as a number (:func:`_host_tensor`): the format,
#: and for floats the smallest normal magnitude (a subnormal goes the bytes' way: a process
#: that flushes denormals, ``torch.set_flush_denormal``, zeroes it in the conversion)
_SCALAR: dict[torch.dtype, tuple[struct.Struct, float]] = {
    torch.bool: (struct.Struct("?"), 0.0), torch.uint8: (struct.Struct("B"), 0.0),
    torch.int8: (struct.Struct("b"), 0.0), torch.int16: (struct.Struct("<h"), 0.0),
    torch.int32: (struct.Struct("<i"), 0.0), torch.int64: (struct.Struct("<q"), 0.0),
    torch.float16: (struct.Struct("<e"), torch.finfo(torch.float16).tiny),
    torch.float32: (struct.Struct("<f"), torch.finfo(torch.float32).tiny),
    torch.float64: (struct.Struct("<d"), torch.finfo(torch.float64).tiny)}


def _host_tensor(buf: Any, m: list[Any]) -> torch.Tensor:
    """A downloaded value: over :data:`ZERO_COPY_MIN` bytes, the received buffer's memory when
    it is :data:`ALIGN`-aligned (chunks joined, see :func:`~genie.remote.protocol.join_frames`:
    this process's alone and writable; the tensor keeps it alive), else a copy.

    A one-element value of a plain dtype (the read after a step: ``loss.item()``, a generate
    token's stopping test) is read as its number and made with one ``torch.full``, not as bytes
    cloned and viewed (three torch calls, ~80 us a read right after the wait on the server,
    with the caches cold, against ~5 warm). A NaN or a subnormal goes the bytes' way (a NaN's
    payload kept)."""
    dtype = dtype_of(m[0])
    sc = _SCALAR.get(dtype)
    if sc is not None and type(buf) is memoryview and buf.nbytes == sc[0].size and \
            buf.format == "B" and type(m[1]) is list and \
            all(type(d) is int and d == 1 for d in m[1]):
        x = sc[0].unpack(buf)[0]
        # a float: NaN and subnormals as bytes, and a zero that is not all zero bits (a
        # subnormal the unpacking flushed: a process in flush-denormal mode reads one as 0.0)
        if not sc[1] or (x == x and (abs(x) >= sc[1] if x else
                                     not any(buf[:-1]) and not buf[-1] & 0x7F)):
            shape = tuple(m[1])
            t = torch.full(shape, x, dtype=dtype)
            if m[2] is not None and tuple(m[2]) != t.stride():
                st = tuple(m[2])
                if len(st) != len(shape) or any(type(v) is not int or v < 0 for v in st):
                    raise ProtocolError(f"bad strides {list(st)} for shape {list(shape)}")
                t = t.as_strided(shape, st)
            t._genie_own = True
            return t
    ref = FrameRef(0, dtype, tuple(m[1]), None if m[2] is None else tuple(m[2]))
    copy = (buf.nbytes if type(buf) is memoryview else frame_view(buf).nbytes) < ZERO_COPY_MIN
    t = frame_tensor(buf, ref, copy)  # a copy is the allocator's memory
    if not copy and t.data_ptr() % ALIGN:  # a received frame: not where eager's would be
        t = t.clone(memory_format=torch.preserve_format)
    t._genie_own = True  # no one else holds it: `.cpu()` returns it without another copy
    return t


def _nbytes(f: Any) -> int:
    if isinstance(f, (bytes, bytearray)):
        return len(f)
    if isinstance(f, zmq.Frame):
        return len(f.buffer)
    return memoryview(f).nbytes


class Client:
    """One session on one server.

    Args:
        address: ``tcp://host:port``.
        server_key: the server's CURVE public key (Z85); None with ``insecure``.
        client_public / client_secret: this client's CURVE key pair (authorized by the server).
        insecure: plain TCP, no authentication (a server started with ``--insecure``).
        timeout: seconds of server silence after which a request fails (at least 1: a busy
            server says it is alive twice a second).
        heartbeat: run the background thread that keeps the lease and flushes frees.
        replay: keep the session's lineage and rebuild it elsewhere when the server is lost.
        fallbacks: the addresses to rebuild on (tried in order; the own address is tried last),
            or a function that gives them (a pool whose members are replaced).
        replay_ops / replay_bytes: bounds on a replay's cost (ops, host bytes held) past which
            the client checkpoints (downloads the session's live values).
    """

    def __init__(self, address: str, *, server_key: str | None = None,
                 client_public: str | None = None, client_secret: str | None = None,
                 insecure: bool = False, timeout: float = 30.0, heartbeat: bool = True,
                 replay: bool = False,
                 fallbacks: Sequence[str] | Callable[[], Sequence[str]] = (),
                 replay_ops: int | None = None, replay_bytes: int | None = None) -> None:
        if not insecure and not (server_key and client_public and client_secret):
            raise ServerUnavailableError(
                address, "a secure connection needs the server's public key and an authorized "
                "client key pair: pass key_file= (the file genie-server printed), or "
                "insecure=True for a server started with --insecure")
        self.address = address
        self.timeout = max(1.0, timeout)
        self._keys = None if insecure else (server_key, client_public, client_secret)
        self._want_heartbeat = heartbeat
        self._lock = threading.RLock()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._mon: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None
        self._connected = False
        self._rids = itertools.count(1)
        self._ids = itertools.count(1)
        self._pending_free: collections.deque[int] = collections.deque()
        self._skeletons: collections.OrderedDict[bytes, list[Any]] = collections.OrderedDict()
        # compiled graphs (genie::graph) this session holds: sent once, then named by key
        self._graphs_sent: set[str] = set()
        self._uploads: dict[int, tuple[weakref.ref, Handle]] = {}
        self._hb: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._last_activity = time.monotonic()
        self.session: bytes | None = None
        self.info: dict[str, Any] = {}
        self.alive = True
        self.lost: str | None = None
        self.resident = (0, 0)
        #: how busy other sessions keep the server's workers (``ld`` of ping replies, see
        #: :class:`~genie.remote.sched.LoadMeter`) and when it was read (``time.monotonic``)
        self.load: tuple[float, float] = (0.0, float("-inf"))
        #: ping every :data:`LOAD_EVERY` seconds to keep :attr:`load` fresh (placement sets it)
        self.watch_load = False
        self._nonce = 0  # the last nonce of a put ticket for this session
        self._lineage: Lineage | None = None
        if replay:
            self._lineage = Lineage()
            if replay_ops is not None:
                self._lineage.max_ops = replay_ops
            if replay_bytes is not None:
                self._lineage.max_host_bytes = replay_bytes
        self._fallbacks = fallbacks
        self.res = Residency(self)
        self._runs = 0
        self._work: dict[bytes, Any] = {}  # estimated work by skeleton key (cost model samples)
        self._decoding = False  # the last tape was a decode step (sticky for puts, restores)
        #: a run sent ahead whose answer is not read yet (:meth:`run` with ``wait=False``); read
        #: before anything else is sent (:meth:`_settle`)
        self._inflight: _Ahead | None = None
        #: whether the server may still work for this session after its last answer: an answer
        #: said the rest of its tape still runs (an early reply), or a peer transfer touched the
        #: session, since the last sync ping (:meth:`synchronize` pings only then)
        self._unsynced = False

    # --- lifecycle --------------------------------------------------------------------------
    def open(self) -> Client:
        """Connect and open the session (one round trip); idempotent."""
        with self._lock:
            if self.session is not None:
                return self
            self._check_alive()
            if self._ctx is not None:  # left by a hello that failed: its sockets are closed
                _retire(self._ctx)
            self._ctx = zmq.Context()
            self._sock, self._mon = self._socket(monitor=True)
            self._poller = zmq.Poller()
            self._poller.register(self._sock, zmq.POLLIN)
            self._poller.register(self._mon, zmq.POLLIN)
            try:
                h, _ = self._call_locked({"t": "hello", "v": PROTOCOL_VERSION,
                                          "torch": torch.__version__}, (), "opening a session")
            except BaseException:
                # a refused hello (busy: max sessions) leaves no open socket behind: the
                # context's finalizer would wait for it forever
                for sk in (self._mon, self._sock):
                    if sk is not None:
                        sk.close(linger=0)
                self._sock = self._mon = self._poller = None
                raise
            sess = h.get("session")
            if not isinstance(sess, bytes):
                raise self._fail(ProtocolError("hello answered without a session",
                                               server=self.address))
            self.session = sess
            self.info = {k: v for k, v in h.items() if k not in ("t", "rid", "session")}
            model().set_device(self.address, str(self.info.get("device", "cpu")))
            if h.get("torch") != torch.__version__:
                logger.warning("genie: server %s runs torch %s, this client %s; ops missing on "
                               "the server will be refused", self.address, h.get("torch"),
                               torch.__version__)
            if self._want_heartbeat:
                self._hb = threading.Thread(target=self._heartbeat, name="genie-heartbeat",
                                            daemon=True)
                self._hb.start()
            logger.info("genie: session opened on %s (device %s)", self.address,
                        self.info.get("device"))
            return self

    def _socket(self, monitor: bool = False) -> tuple[zmq.Socket, zmq.Socket | None]:
        assert self._ctx is not None
        s = self._ctx.socket(zmq.DEALER)
        s.linger = 0
        if self._keys is not None:
            s.curve_serverkey = self._keys[0].encode()
            s.curve_publickey = self._keys[1].encode()
            s.curve_secretkey = self._keys[2].encode()
        mon = s.get_monitor_socket() if monitor else None
        s.connect(self.address)
        return s, mon

    def close(self) -> None:
        """End the session (the server frees its tensors at once) and close the connection."""
        with self._lock:
            if self.session is not None and self.alive:
                saved, self.timeout = self.timeout, min(self.timeout, 2.0)
                try:
                    self._settle()
                except Exception:  # noqa: BLE001 - closing: what failed ahead is not asked for
                    pass
                try:
                    self._call_locked({"t": "bye"}, (), "closing the session")
                except RemoteError:
                    pass
                self.timeout = saved
            self._inflight = None
            self._shutdown("the client disconnected (genie.disconnect())")

    def _shutdown(self, why: str, final: bool = True) -> None:
        """Close the connection; ``final=False`` keeps what a recovery needs (uploads, frees)."""
        self.alive = False
        self.lost = self.lost or why
        self._hb_stop.set()
        if self._hb is not None and self._hb is not threading.current_thread():
            self._hb.join(timeout=5)
        if final:
            self._lineage = None
            self._pending_free.clear()
            self._uploads.clear()
        for s in (self._mon, self._sock):
            if s is not None:
                s.close(linger=0)
        self._mon = self._sock = None
        if self._ctx is not None:
            _retire(self._ctx)
            self._ctx = None

    def _check_alive(self) -> None:
        if not self.alive:
            raise SessionLostError(self.address, f"this session is gone ({self.lost}); "
                                   "reconnect with genie.connect() and recompute the values")

    def _fail(self, err: RemoteError) -> RemoteError:
        """Record a fatal failure, close everything, return the error to raise."""
        why = str(err).split("] ", 1)[-1]
        self.lost = why
        self._shutdown(why, final=self._lineage is None)
        return err

    def _release(self, hid: int) -> None:
        if self.alive:
            self._pending_free.append(hid)

    # --- one round trip ------------------------------------------------------------------------
    def _call(self, header: dict[str, Any], frames: Any = (), what: str = "a request"
              ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        with self._lock:
            self.open()
            return self._call_locked(header, frames, what)

    def _call_locked(self, header: dict[str, Any], frames: Any, what: str
                     ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        if self._inflight is not None:
            self._settle()
        return self._receive(self._send(header, frames, what))

    def _send(self, header: dict[str, Any], frames: Any, what: str) -> _Sent:
        """Send one request (under the lock); :meth:`_receive` reads its answer."""
        self._check_alive()
        assert self._sock is not None and self._poller is not None
        rid = next(self._rids)
        header["rid"] = rid
        if self.session is not None:
            header["s"] = self.session
        frees = self._drain_frees()
        if frees:
            header["free"] = frees
        frames, counts = split_frames(frames)
        if counts is not None:
            header["fc"] = counts
        data = pack(header)
        size = sum(_nbytes(f) for f in frames)
        # zmq sends in the background: an upload ends when the server answers, not here
        up = transfer_started("upload", size, self.address)
        sent_at = time.perf_counter()
        try:
            send_parts(self._sock, [data, *frames], NOBLOCK)
        except zmq.Again:
            self._send_when_writable([data, *frames], what)
        except zmq.ZMQError as e:
            raise self._fail(ServerUnavailableError(self.address, f"cannot send {what}: {e}")
                             ) from None
        bump("round_trips")
        bump("bytes_sent", len(data) + size)
        self._last_activity = time.monotonic()
        return _Sent(rid, what, len(data), size, up, sent_at)

    def _send_when_writable(self, parts: list[Any], what: str) -> None:
        """Send ``parts`` once the socket takes them: it refuses while it has no connection (a
        handshake that failed dropped it; a blocking send would wait forever, where the
        connection's monitor says why), for at most ``timeout`` seconds."""
        assert self._sock is not None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLOUT)
        if self._mon is not None:
            poller.register(self._mon, zmq.POLLIN)
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(ServerUnavailableError(
                    self.address, f"cannot send {what}: no connection to the server within "
                    f"{self.timeout:g} s{self._lost_note()}. Check that genie-server runs at "
                    f"{self.address}, then genie.connect() again."))
            events = dict(poller.poll(min(left, 1.0) * 1000))
            if self._mon in events:
                self._read_monitor(what)
            try:
                send_parts(self._sock, parts, NOBLOCK)
                return
            except zmq.Again:
                continue
            except zmq.ZMQError as e:
                raise self._fail(ServerUnavailableError(self.address,
                                                        f"cannot send {what}: {e}")) from None

    def _receive(self, sent: _Sent) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """The answer to the request ``sent`` (raised as an error when it is one)."""
        rid, what = sent.rid, sent.what
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(ServerUnavailableError(
                    self.address, f"no answer to {what} within {self.timeout:g} s; the server is "
                    f"unreachable or stopped{self._lost_note()}. Check that genie-server runs "
                    f"at {self.address}, then genie.connect() again."))
            events = dict(self._poller.poll(min(left, 1.0) * 1000))
            if self._mon in events:
                self._read_monitor(what)
            if self._sock not in events:
                continue
            parts = recv_parts(self._sock, 0)
            into = sent.into
            if into is not None and _config.client_native:
                # a booked run's plain reply: its header checked and outputs read in one call
                # (None: anything else, read below as ever)
                fast = _client_reply(parts, rid, into, MAX_HEADER_BYTES)
                if fast is not None:
                    h, got = fast
                    bump("bytes_received", got)
                    bump("client_native_replies")
                    self._took(h, sent, got)
                    return h, _READ
            got = sum(len(p.buffer) for p in parts)
            bump("bytes_received", got)
            try:
                h = unpack(parts[0].buffer)
            except ProtocolError as e:
                raise self._fail(ProtocolError(f"undecodable answer: {e}", server=self.address)
                                 ) from None
            if not isinstance(h, dict) or h.get("rid") != rid:
                continue  # an answer to an earlier, abandoned request
            kind = h.get("t")
            if kind == "busy":
                deadline = time.monotonic() + self.timeout
                continue
            self._took(h, sent, got)
            if kind == "err":
                raise self._error(h)
            try:
                return h, join_frames(parts[1:], h.get("fc"))
            except ProtocolError as e:
                raise self._fail(e.at(self.address)) from None

    def _took(self, h: dict[str, Any], sent: _Sent, got: int) -> None:
        """What an answer ``h`` (``got`` bytes) to the request ``sent`` tells besides its
        values: the link's figures, the server's counters, residency."""
        rid, head, size, up, sent_at = sent.rid, sent.head, sent.size, sent.up, sent.sent_at
        self._last_activity = time.monotonic()
        # durations span request to reply, the server's work included: lower bounds on rate
        # (reported only when large: not called for the others, read after every wait)
        if up is not None:
            transfer_done("upload", size, self.address, up, "request to reply")
        if got >= progress.LARGE:
            transfer_done("download", got, self.address, sent_at, "request to reply")
        st = h.get("st")
        moved = head + size + got
        # the link's figures: a bulk transfer's rate, every one; the latency of small ones
        # from every LATENCY_SAMPLE_EVERY-th (a steady loop sends one a step, the cost
        # model's lock and lookups ~10 us each right after the wait)
        if (type(st) is float or type(st) is int) and (
                moved >= LARGE_BYTES or (moved < SMALL_BYTES and
                                         rid % LATENCY_SAMPLE_EVERY == 0)):
            model().observe_transfer(moved, time.perf_counter() - sent_at - st, CLIENT,
                                     self.address)
        ix = h.get("ix")  # index arguments the server checked (genie.index_check)
        if isinstance(ix, list) and len(ix) == 3 and all(type(v) is int for v in ix):
            bump("server_index_checks", ix[0])
            bump("server_index_check_syncs", ix[1])
            bump("server_index_check_refusals", ix[2])
        vt = h.get("vt")  # how the server vetted a run (genie.remote.shape_class)
        if vt in _VETTED_AS:
            bump(_VETTED_AS[vt])
        if h.get("er") == 1:  # answered before the rest of its tape ran (worker.py)
            bump("server_early_replies")
            self._unsynced = True
        res = h.get("res")
        if isinstance(res, list) and len(res) == 2:
            self.resident = (res[0], res[1])
            _counts["resident_tensors"] = res[0]
            _counts["resident_bytes"] = res[1]

    def _lost_note(self) -> str:
        n, b = self.resident
        return f"; the session's {n} resident tensors ({b} bytes) are lost" if n else ""

    def _read_monitor(self, what: str) -> None:
        assert self._mon is not None
        while self._mon.poll(0):
            ev = recv_monitor_message(self._mon)["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
            elif ev == zmq.EVENT_DISCONNECTED:
                was, self._connected = self._connected, False
                if was:
                    raise self._fail(ServerUnavailableError(
                        self.address, f"the connection to the server dropped ({what} got no "
                        f"answer; server killed or restarted?){self._lost_note()}"))
            elif ev == zmq.EVENT_CONNECT_RETRIED and not self._connected:
                raise self._fail(ServerUnavailableError(
                    self.address, f"connection refused: no genie-server listens there "
                    f"({what} failed){self._lost_note()}"))
            elif ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise self._fail(ServerUnavailableError(
                    self.address, "the server refused this client's key (not authorized); use "
                    "the key file that genie-server printed"))
            elif ev in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                raise self._fail(ServerUnavailableError(
                    self.address, "the security handshake failed: wrong server key, or a CURVE "
                    "client talking to an --insecure server (or the reverse)"))

    def _error(self, h: dict[str, Any], tape: Tape | None = None) -> RemoteError | Exception:
        kind, msg = h.get("kind"), str(h.get("msg", "unknown error"))
        if kind == "session":
            return self._fail(SessionLostError(self.address, msg))
        if kind == "quota":
            if type(h.get("room")) is int:  # refused at the door: evicting may make room
                return _Pressure(h)
            return QuotaExceededError(self.address, msg)
        if kind == "pressure":
            return _Pressure(h)
        if kind == "protocol":
            return ProtocolError(f"the server rejected a message: {msg}", server=self.address)
        if kind == "exec":
            return _ExecFailure(h)
        if kind == "timeout":
            return RunTimeoutError(self.address, msg)
        if kind == "peer":
            e = PeerTransferError(self.address, msg)
            pk, room = h.get("pk"), h.get("room")
            e.refused = pk if isinstance(pk, str) else None
            e.room = room if type(room) is int and room > 0 else None
            return e
        return RemoteError(self.address, msg)

    def _drain_frees(self) -> list[int]:
        q = self._pending_free
        out = []
        try:
            while q:
                out.append(q.popleft())
        except IndexError:  # drained concurrently by the heartbeat thread
            pass
        if out:
            bump("frees_sent", len(out))
            lin = self._lineage
            if lin is not None:
                lin.record_free(out)
        return out

    # --- the requests ----------------------------------------------------------------------------
    def run(self, tape: Tape, wait: bool = True) -> dict[int, Any]:
        """Run ``tape`` in the session; returns a handle for every kept slot (outputs downloaded
        into ``handle.host``).

        ``wait=False`` (a tape with no outputs to download: :func:`genie.backends.remote.
        send_ahead`) sends the request and returns its handles at once; the answer is read
        before the session's next request (:meth:`_settle`); a failure there leaves the
        tape's nodes pending."""
        with self._lock:
            if self._inflight is not None:
                self._settle()
            if self.session is None:  # (open() re-enters the lock only to find it open)
                self.open()
            lin = self._lineage
            if lin is not None and lin.stale():
                try:
                    self._checkpoint()
                except (ServerUnavailableError, SessionLostError):
                    self._recover()
                    self._checkpoint()
            res = self.res
            if res.evicted:
                res.before_run(tape)
            r = _Run(tape)
            uploads, restored = r.uploads, r.restored

            # (nothing evicted: no handle's residency record is read; a GPT-2 token reads 65
            # inputs, each record a cache miss after the recording)
            some_evicted = bool(res.evicted)

            def input_const(s: int, v: Any, frames: list[Any]) -> Any:
                if type(v) is Handle and v.client is self:  # resident here (as most are)
                    if not some_evicted:
                        return v.id
                    x = v.res
                    if x is None or x.evicted is None:
                        return v.id
                return self._input_const(s, v, frames, uploads, restored)

            # kept uploads go as input uploads: a first call that uploads a model's weights
            # has the skeleton of the calls after it (genie.remote.protocol.encode_tape)
            r.enc = enc = encode_tape(tape, input_const, hoist=True)
            r.n_new = n_new = len(enc.order)
            r.id0 = id0 = next(self._ids)
            if n_new > 1:  # (under the lock, as every use of the counter)
                self._ids = itertools.count(id0 + n_new)
            header: dict[str, Any] = {"t": "run", "k": enc.key, "id0": id0}
            r.base = base = self._skeletons.get(enc.key)
            delta = const_delta(base, enc.consts) if base is not None else None
            if base is None:
                header["sk"] = enc.skeleton
                header["c"] = enc.consts
                bump("skeletons_sent")
            elif delta is None:
                header["c"] = enc.consts
            else:
                header["d"] = delta
            r.gkeys = gkeys = _graph_keys(tape)
            new_graphs = [k for k in gkeys if k not in self._graphs_sent]
            if new_graphs:
                header["g"] = [[k, graphs.lookup(k).data] for k in new_graphs]
                bump("graphs_sent", len(new_graphs))
            ev = res.hints(restored)
            if ev:
                r.extra["ev"] = ev
            self._decoding = res.decoding(tape)
            if self._decoding:
                r.extra["ph"] = 1
            header.update(r.extra)
            self._skeletons.pop(enc.key, None)
            r.header = header
            r.what = f"a tape of {len(raw_instrs(tape))} ops"  # (a hit's need not be built)
            ahead = not wait and not tape.outputs
            try:
                sent: _Sent | None = self._send(header, enc.frames, r.what)
            except (ServerUnavailableError, SessionLostError):
                if self._lineage is None or ahead:
                    raise
                sent = None  # _exchange recovers the session and sends it again
            # the handles and residency of what the run makes are booked while the server runs
            # it: the client waits anyway, and after the answer it starts on cold caches; the
            # answer then only fills in the outputs. Not a run that puts evicted values back
            # (they are marked back once the server has them)
            early = ahead or not restored
            if early:
                kept = self._book(r)
                if sent is not None:  # its answer may be read natively (_client_reply)
                    sent.into = [kept[s] for s in tape.outputs]
            if ahead and sent is not None:
                # sent ahead: the answer before the next request (the caller binds the tape's
                # nodes once it is answered)
                self._inflight = _Ahead(r, sent)
                bump("runs_sent_ahead")
                return kept
            try:
                h, frames = self._exchange(r, sent)
            except BaseException:
                if early:
                    self._unbook(r)
                raise
            if not early:
                self._book(r)
            return self._ran(r, h, frames)

    def _book(self, r: _Run) -> dict[int, Any]:
        """Book run ``r`` before its answer: a handle for every kept slot, residency (a failed
        run is unbooked: :meth:`_unbook`)."""
        tape = r.tape
        res = self.res
        if r.base is not None and (self._runs + 1) % FLOP_SAMPLE_EVERY == 0:
            r.work = self._work_of(r)
        # a plan's tape that uploads and puts back nothing, residency not recording: booked in
        # one native call (None: declined, having changed nothing; booked below as ever)
        if _config.client_native and not r.uploads and not r.restored and not res.recording:
            rows = _kept_rows(tape, r.enc.order)
            if rows is not None:
                kept = _client_book(rows, tape.nodes, tape.inputs, r.id0, self, res._sized,
                                    res.live, res.pending, res.size_of)
                if kept is not None:
                    bump("client_native_books")
                    r.kept = kept
                    r.remote_inputs = {}  # (no upload reads them)
                    r.owners = {}
                    res.pruned()
                    return kept
        r.kept = kept = self._kept(r, fresh=True)
        res.ran(tape, kept, r.owners,
                [r.remote_inputs[s] for s in r.uploads if s in tape.inputs], r.restored)
        return kept

    def _unbook(self, r: _Run) -> None:
        """Undo :meth:`_book` of run ``r``, which failed: no hints about values never made."""
        res = self.res
        res.pending.clear()
        assert r.kept is not None
        for s, v in r.kept.items():
            if s not in r.tape.inputs:
                res.live.pop(v.id, None)
                v.res = None

    def _exchange(self, r: _Run, sent: _Sent | None = None
                  ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """The answer to run ``r`` (``sent``: its request, already sent): sent again whole
        after a lost session or a forgotten skeleton; an op's failure raised as eager's."""
        tape, enc = r.tape, r.enc
        try:
            try:
                h, frames = self._call_run(r.header, enc.frames, r.what, tape, sent)
            except (ServerUnavailableError, SessionLostError):
                if self._lineage is None:
                    raise
                self._recover()  # a new session: the interrupted tape goes whole
                h = {"t": "miss"}
            if h.get("t") == "miss":  # the server forgot the skeleton: send it whole
                header = {"t": "run", "k": enc.key, "id0": r.id0, "sk": enc.skeleton,
                          "c": enc.consts, **r.extra}
                bump("skeletons_sent")
                if r.gkeys:  # and the graphs it calls (evicted, or a new session)
                    header["g"] = [[k, graphs.lookup(k).data] for k in r.gkeys]
                    bump("graphs_sent", len(r.gkeys))
                h, frames = self._call_run(header, enc.frames, r.what + " (resent)", tape)
        except _ExecFailure as f:
            err = f.error(tape, self.address, enc.hoisted)
            raise err from err.__cause__  # the server's exception, rebuilt (None: none)
        return h, frames

    def _kept(self, r: _Run, fresh: bool = False) -> dict[int, Any]:
        """A handle for every kept slot of run ``r``: its inputs' own, the server's numbering
        of what it makes. ``fresh``: the run's input uploads get handles not yet known to later
        runs (their answer is not read: :meth:`_ran` makes them known)."""
        tape, uploads = r.tape, r.uploads
        inputs = tape.inputs
        keep = tape.keep
        remote_inputs: dict[int, Handle] = {}
        # the inputs that need one: kept, or uploaded with this run (not every input a step
        # reads: a GPT-2 token reads 65, keeps 18)
        for s in (*keep, *uploads) if uploads else keep:
            if s not in inputs or s in remote_inputs:
                continue
            v = inputs[s]
            if type(v) is Handle and v.client is self:
                remote_inputs[s] = v
            elif s in uploads:
                t, hid = uploads[s]
                remote_inputs[s] = Handle(hid, self, TensorMeta.of(t, tape.index)) if fresh \
                    else self._remember_upload(t, hid, tape.index)
            elif isinstance(v, torch.Tensor):
                remote_inputs[s] = self._uploads[id(v)][1]
        r.remote_inputs = remote_inputs
        nodes = tape.nodes
        id0 = r.id0
        rows = _kept_rows(tape, r.enc.order) if not uploads else None
        if rows is not None:  # a plan's tape: its kept slots' places known from the plan
            kept: dict[int, Any] = {}
            owners: dict[int, tuple[Any, int]] = {}
            for s, i, k, j in rows:
                if i < 0:
                    kept[s] = remote_inputs[s]
                    continue
                n = nodes[i]
                m = n.metas[k]
                if m is not None:
                    owners[s] = (n, k)
                kept[s] = Handle(id0 + j, self, m)
            r.owners = owners
            return kept
        metas: dict[int, TensorMeta] = {}
        owners = {}
        for i, k, s in _kept_at(tape):
            n = nodes[i]
            m = n.metas[k]
            if m is not None:
                metas[s] = m
                owners[s] = (n, k)
        r.owners = owners
        kept = {}
        made = dict(zip(r.enc.order, range(id0, id0 + r.n_new)))  # as the server numbers them
        for s in sorted(keep):
            if s in inputs:
                kept[s] = remote_inputs[s]
            else:  # made by the tape, or an upload sent as an input upload (its own id)
                j = made.get(s)
                kept[s] = Handle(uploads[s][1] if j is None else j, self, metas.get(s))
        return kept

    def _ran(self, r: _Run, h: dict[str, Any], frames: list[zmq.Frame]) -> dict[int, Any]:
        """Book run ``r`` (booked, :meth:`_book`) after its answer ``h``: skeleton and graphs
        known, lineage, uploads; its outputs read into their handles."""
        tape, enc = r.tape, r.enc
        self._runs += 1
        self._graphs_sent.update(r.gkeys)
        st = h.get("st")
        if r.base is not None and self._runs % FLOP_SAMPLE_EVERY == 0 and \
                (type(st) is float or type(st) is int):
            w = r.work if r.work is not None else self._work_of(r)
            model().observe_run(w.flops, w.ops, st, self.address)
        self._skeletons[enc.key] = enc.consts
        uploads = r.uploads
        lin = self._lineage
        if lin is not None:
            srcs = host_sources(x for ins in tape.instrs for x in ins.leaves)
            srcs += [(t, t._version) for t, _ in uploads.values()]
            lin.record_run(RunEntry(enc.key, enc.skeleton, enc.consts, enc.frames, r.id0,
                                    len(tape.instrs), srcs),
                           [hid for _, hid in uploads.values()] +
                           [x.id for x in r.restored] + list(range(r.id0, r.id0 + r.n_new)))
        if len(self._skeletons) > SKELETON_MEMORY:
            self._skeletons.popitem(last=False)
        kept = r.kept  # booked (_book): its uploads are there now
        assert kept is not None
        inputs = tape.inputs
        for s, (t, _) in uploads.items():
            if s in inputs:
                self._register_upload(t, r.remote_inputs[s])
        if frames is not _READ and (tape.outputs or frames):
            self._read_outputs(h, frames, [kept[s] for s in tape.outputs])
        return kept

    def _work_of(self, r: _Run) -> Any:
        """The estimated work of run ``r``'s structure, for the cost model: estimated once per
        structure (its shapes may move since; flops_of costs ~20 ms on a GPT-2 step)."""
        w = self._work.get(r.enc.key)
        if w is None:
            w = self._work[r.enc.key] = flops_of(r.tape)
            if len(self._work) > SKELETON_MEMORY:
                self._work.pop(next(iter(self._work)))
        return w

    def settle(self) -> None:
        """Read the answer of the run sent ahead, if one is on its way (:meth:`_settle`)."""
        with self._lock:
            if self._inflight is not None:
                self._settle()

    def after_answer(self, f: Callable[[], None]) -> bool:
        """Call ``f`` once the answer of the run just sent ahead is read and booked (never when
        it failed); false when no run is on its way."""
        a = self._inflight
        if a is None:
            return False
        a.done = f
        return True

    def _settle(self) -> None:
        """Read the answer of the run sent ahead (:meth:`run`, ``wait=False``), book it and call
        its :meth:`after_answer` (which binds its nodes). A run sent ahead is work done early,
        not a request of the program's: when it fails (an op's error, the quota, a timeout) its
        nodes stay pending and nothing is raised here; the read that needs them runs them as
        any read would, with the recovery a read has (eviction, recomputation, a smaller plan),
        and raises what eager would there. A failure that ends the session (the server lost,
        a message refused) is the session's: raised here, as by any request."""
        a, self._inflight = self._inflight, None
        if a is None:
            return
        try:
            h, frames = self._exchange(a.run, a.sent)
        except Exception as e:  # noqa: BLE001 - see above: the read that needs it raises it
            self._unbook(a.run)
            bump("runs_ahead_failed")
            if not self.alive:
                raise
            logger.debug("genie: a run sent ahead to %s failed (%s: %s); its ops stay pending",
                         self.address, type(e).__name__, e)
            return
        self._ran(a.run, h, frames)
        if a.done is not None:
            a.done()

    def put(self, t: torch.Tensor, meta: TensorMeta, role: str = "input") -> Handle:
        """Upload the host tensor ``t`` now (one round trip) and keep it as a resident value.

        Its frame is ``t``'s own memory (no host copy); the call returns once the server holds
        the value, so later writes to ``t`` do not reach it. ``role`` (``input`` or ``weight``)
        goes with it as its residency hint.
        """
        with self._lock:
            self.open()
            hid = next(self._ids)
            tape = Tape([], {0: t}, [], set(), [], {}, meta.index)
            enc = encode_tape(tape, lambda _s, v, frames: msgpack.ExtType(
                EXT_INPUT, pack([host_ref(v, frames), hid])))
            header: dict[str, Any] = {"t": "run", "k": enc.key, "id0": 0, "c": enc.consts}
            if enc.key not in self._skeletons:
                header["sk"] = enc.skeleton
            hint = dense(meta)
            if hint:
                header["ev"] = [hid, ROLE_CODE[role]]
            if self._decoding:
                header["ph"] = 1
            what = f"an upload of {t.numel() * t.element_size()} bytes"
            try:
                h, _ = self._call_run(header, enc.frames, what)
            except (ServerUnavailableError, SessionLostError):
                if self._lineage is None:
                    raise
                self._recover()
                h = {"t": "miss"}
            if h.get("t") == "miss":
                header["sk"] = enc.skeleton
                self._call_run(header, enc.frames, what + " (resent)")
            self._skeletons[enc.key] = enc.consts
            lin = self._lineage
            if lin is not None:
                lin.record_run(RunEntry(enc.key, enc.skeleton, enc.consts, enc.frames, 0, 0,
                                        [(t, t._version)]), [hid])
            bump("uploads_sent_now")
            out = Handle(hid, self, meta)
            if hint:
                out.res = Resident(role, t.numel() * t.element_size())
                self.res.note(out)
            return out

    def get(self, handles: list[Handle]) -> list[torch.Tensor]:
        """Download the values of ``handles`` (one round trip); an evicted value comes from its
        host copy, or is recomputed first."""
        with self._lock:
            if self._inflight is not None:
                self._settle()
            self._check_alive()
            if self.res.evicted and any(h.res is not None and h.res.evicted for h in handles):
                host = self.res.download_evicted(handles)
                rest = [h for i, h in enumerate(handles) if i not in host]
                got = iter(self._download(rest) if rest else ())
                return [host[i] if i in host else next(got) for i in range(len(handles))]
            return self._download(handles)

    def _download(self, handles: list[Handle]) -> list[torch.Tensor]:
        """Download resident values (one round trip)."""
        with self._lock:
            self._check_alive()
            header = {"t": "get", "ids": [x.id for x in handles]}
            what = f"a download of {len(handles)} value(s)"
            try:
                h, frames = self._call(header, (), what)
            except (ServerUnavailableError, SessionLostError):
                if self._lineage is None:
                    raise
                self._recover()
                h, frames = self._call_locked(header, (), what)
            return self._read_outputs(h, frames, None)

    def send(self, handles: list[Handle], dest: Client) -> list[Handle]:
        """Copy resident values of this session into ``dest``'s session (another server of the
        pool), server to server: one round trip to this server, which pushes the values to
        ``dest``'s server (:mod:`genie.remote.peer`). Returns their handles in ``dest``.

        Values that share a storage here share one there. Evicted values are brought back
        here first; a destination short of quota evicts its own values by role to make room.
        A failure raises :class:`~genie.remote.PeerTransferError` naming both servers and the
        cause (within this client's timeout); with replay on, a lost session on either side is
        rebuilt and the transfer tried once more.
        """
        if any(h.client is not self for h in handles):
            raise ValueError("Client.send: every handle must belong to this client's session")
        if any(h.meta is None for h in handles):
            raise ValueError("Client.send: a handle without metadata cannot be sent")
        # what the ticket signs of each value: everything the destination acts on
        signed = [describe(m.dtype, m.shape, m.stride, m.offset, m.conj, m.neg)
                  for m in (h.meta for h in handles) if m is not None]
        self._bring_back(handles)
        with dest._lock:
            dest.open()
            ids = [next(dest._ids) for _ in handles]
        nbytes = self._send_ids([h.id for h in handles], signed, dest, ids)
        lin = dest._lineage
        if lin is not None:
            lin.record_peer(PeerEntry(self, [h.id for h in handles], ids, signed, list(handles),
                                      nbytes))
        return [Handle(i, dest, h.meta) for i, h in zip(ids, handles, strict=True)]

    def _bring_back(self, handles: list[Handle]) -> None:
        """Evicted values among ``handles`` back in this session (a send reads them on this
        server): recomputed, or uploaded from their host copies under their own ids."""
        with self._lock:
            if not self.res.evicted:
                return
            ev = [h for h in handles if h.res is not None and h.res.evicted is not None]
            rec = [h for h in ev if h.res.evicted == "recompute"]  # type: ignore[union-attr]
            if rec:
                self.res.restore(rec)
            up = [h for h in ev if h.res.evicted == "upload"]  # type: ignore[union-attr]
            if up:
                self._restore_run(Tape([], dict(enumerate(up)), [], set(), [], {},
                                       up[0].meta.index if up[0].meta else 0), [])

    def _make_room(self, nbytes: int) -> bool:
        """Evict values of this session (by role, :mod:`genie.remote.residency`) to free
        ``nbytes`` (what a peer's values need beyond the quota); whether any were evicted."""
        with self._lock:
            quota = int(self.info.get("quota", 0) or 0)
            room = min(nbytes, quota) if quota else nbytes
            got, _ = self._call({"t": "free", "ids": [], "room": max(1, room), "keep": []}, (),
                                "a request for room")
            victims = got.get("victims")
            if not isinstance(victims, list) or not victims:
                return False
            self.res.relieve(victims)
            self._call({"t": "free", "ids": []}, (), "the frees of an eviction")  # before the put
            return True

    def _send_ids(self, src_ids: list[int], signed: list[list[Any]], dest: Client,
                  ids: list[int]) -> int:
        """The ``send`` request of :meth:`send` (and of a replay); the bytes moved. A
        destination short of quota makes room by eviction first (as for a tape)."""
        what = f"a transfer of {len(ids)} value(s) to {dest.address}"
        need = sum(math.prod(m[1]) * dtype_of(m[0]).itemsize for m in signed) + 4096
        rounds = 0
        recovered = False
        while True:
            with dest._lock:
                dest.open()
                dest._nonce += 1
                nonce = dest._nonce
                assert dest.session is not None
                header: dict[str, Any] = {
                    "t": "send", "ids": src_ids, "to": dest.address, "sid":
                    session_id(dest.session), "n": nonce, "dids": ids, "o": signed,
                    "tk": ticket(dest.session, nonce, ids, signed), "to_s": self.timeout}
            with self._lock:
                try:
                    h, _ = self._call(header, (), what)
                    break
                except (ServerUnavailableError, SessionLostError):
                    if self._lineage is None or recovered:
                        raise
                    recovered = True
                    self._recover()
                except PeerTransferError as e:
                    if e.refused in ("quota", "pressure") and rounds < MAX_PRESSURE_ROUNDS:
                        rounds += 1
                        if dest._make_room(e.room or need):
                            continue
                    if recovered or e.refused is not None or not dest._lost_and_rebuilt():
                        raise
                    recovered = True
        # (the destination's worker takes the values as a request of its own session)
        self._unsynced = dest._unsynced = True
        nb = h.get("pb")
        nb = nb if type(nb) is int and nb >= 0 else 0
        bump("peer_transfers")
        bump("peer_bytes", nb)
        return nb

    def synchronize(self) -> None:
        """Wait until the server has finished the work this session gave it: a ping, which
        its worker answers after the rest of a tape it answered early. Nothing to wait for when
        no session is open, or when every answer since the last sync was a whole run's (the
        worker answers a request after its work and takes the next only then; a run sent ahead
        is settled first): a program that reads a value per call and synchronizes after it (a
        benchmark's loop) pays one round trip a call, not two."""
        if self.session is None or not self.alive:
            return
        with self._lock:
            if self._inflight is not None:
                self._settle()
            if not self._unsynced:
                bump("syncs_answered_here")
                return
            self._call_locked({"t": "ping", "sync": 1}, (), "a synchronize")
            self._unsynced = False

    def _lost_and_rebuilt(self) -> bool:
        """After a failed transfer into this session: whether the session was lost and has
        been rebuilt (replay on), so the transfer can be tried again."""
        with self._lock:
            try:
                self._call({"t": "ping"}, (), "a ping")
                return False  # alive: the failure was the transfer's own
            except (ServerUnavailableError, SessionLostError):
                if self._lineage is None:
                    return False
                self._recover()
                return True

    # --- lineage: checkpoints and recovery ------------------------------------------------------
    def _checkpoint(self) -> None:
        """Replace the lineage by the session's live values (one download)."""
        lin = self._lineage
        assert lin is not None
        t0 = time.monotonic()
        frees = self._drain_frees()
        ids = list(lin.live)
        header: dict[str, Any] = {"t": "get", "ids": ids}
        if frees:
            header["free"] = frees
        h, frames = self._call_locked(header, (), f"a checkpoint of {len(ids)} value(s)")
        lin.checkpoint(ids, self._read_outputs(h, frames, None))
        bump("checkpoints")
        logger.info("genie: checkpoint of %d values (%d bytes) from %s in %.3f s", len(ids),
                    lin.host_bytes, self.address, time.monotonic() - t0)

    def _recover(self) -> None:
        """Open a session on a pool address and replay the lineage into it; on failure, end
        this client as without replay and raise :class:`SessionLostError`."""
        lin = self._lineage
        assert lin is not None
        t0 = time.monotonic()
        lost, first = self.lost, self.address
        candidates = self._candidates(first)
        if lin.sources_changed():
            self._shutdown(lost or "lost", final=True)
            raise SessionLostError(first, f"the session was lost ({lost}) and cannot be rebuilt: "
                                   "a host tensor it was built from was written since it was "
                                   "sent; recompute from the start")
        deadline = t0 + self.timeout
        errors: list[str] = []
        while True:
            candidates = self._candidates(first)  # a pool may have replaced a member meanwhile
            for addr in candidates:
                try:
                    self._reopen(addr)
                    n = self._replay(lin)
                except (ServerUnavailableError, SessionLostError) as e:
                    errors.append(str(e))
                    continue
                except RemoteError as e:  # the replay itself failed: nothing more to try
                    errors.append(str(e))
                    break
                dt = time.monotonic() - t0
                bump("replays")
                bump("replayed_requests", n)
                _counts["last_recovery_ms"] = int(dt * 1000)
                logger.warning("genie: the session on %s was lost (%s); rebuilt on %s by "
                               "replaying %d requests (%d ops) in %.3f s", first, lost, addr, n,
                               lin.ops, dt)
                return
            else:
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
            break
        self.address = first
        self.lost = lost
        self._shutdown(lost or "lost", final=True)
        raise SessionLostError(first, f"the session was lost ({lost}) and could not be rebuilt "
                               f"on {', '.join(candidates)} within {self.timeout:g} s: "
                               f"{errors[-1] if errors else 'no server answered'}; start a "
                               "server and genie.connect() again, then recompute")

    def _candidates(self, lost: str) -> list[str]:
        """Where to rebuild: the other pool members first, the lost address last."""
        fb = self._fallbacks
        try:
            addrs = list(fb() if callable(fb) else fb)
        except Exception as e:  # an unreadable pool file: the known addresses still work
            logger.warning("genie: cannot read the pool's addresses: %s", e)
            addrs = []
        return [a for a in addrs if a != lost] + [lost]

    def _reopen(self, addr: str) -> None:
        for s in (self._mon, self._sock):
            if s is not None:
                s.close(linger=0)
        self._mon = self._sock = None
        if self._ctx is not None:
            _retire(self._ctx)
            self._ctx = None
        self.address = addr
        self.alive, self.lost, self.session = True, None, None
        self._nonce = 0
        self._connected = False
        self._hb_stop = threading.Event()
        self._skeletons.clear()
        self._graphs_sent.clear()
        self.open()

    def _replay(self, lin: Lineage) -> int:
        """Send the lineage to the fresh session; the number of requests it took."""
        n = 0
        sent: dict[bytes, list[Any]] = {}
        for e in list(lin.entries):
            if type(e) is PutEntry:
                tape = Tape([], dict(enumerate(e.values)), [], set(), [], {}, 0)
                hids = iter(e.ids)
                enc = encode_tape(tape, lambda _s, v, frames: msgpack.ExtType(
                    EXT_INPUT, pack([host_ref(v, frames), next(hids)])))
                self._call_locked({"t": "run", "k": enc.key, "id0": 0, "sk": enc.skeleton,
                                   "c": enc.consts}, enc.frames, "a checkpoint upload")
            elif type(e) is RunEntry:
                header: dict[str, Any] = {"t": "run", "k": e.key, "id0": e.id0, "c": e.consts}
                if e.key not in sent:
                    header["sk"] = e.skeleton
                sent[e.key] = e.consts
                try:
                    h, _ = self._call_locked(header, e.frames, f"a replayed tape of {e.ops} ops")
                    if h.get("t") == "miss":
                        header["sk"] = e.skeleton
                        self._call_locked(header, e.frames, f"a replayed tape of {e.ops} ops")
                except _ExecFailure as f:
                    raise RemoteError(self.address, f"a replayed tape failed: {f}") from None
            elif type(e) is PeerEntry:
                try:
                    e.source._bring_back(e.pinned)
                    e.source._send_ids(e.src_ids, e.signed, self, e.ids)
                except RemoteError as err:  # the source lost them too: nothing to rebuild from
                    raise RemoteError(self.address, f"values this session received from "
                                      f"{e.source.address} could not be sent again: {err}"
                                      ) from None
            else:
                assert type(e) is FreeEntry
                self._call_locked({"t": "free", "ids": e.ids}, (), "replayed frees")
            n += 1
        self._skeletons.clear()
        self._skeletons.update(sent)
        self._graphs_sent.clear()
        return n

    def _read_outputs(self, h: dict[str, Any], frames: list[zmq.Frame],
                      into: list[Handle] | None) -> list[torch.Tensor]:
        metas = h.get("o")
        n = len(into) if into is not None else len(frames)
        if not isinstance(metas, list) or len(metas) != n or len(frames) != n:
            raise self._fail(ProtocolError("answer with a wrong number of outputs",
                                           server=self.address))
        out = []
        for k, (m, f) in enumerate(zip(metas, frames, strict=True)):
            try:
                t = _host_tensor(getattr(f, "buffer", f), m)
            except ProtocolError as e:  # a reply the decoder refuses: name this server
                raise self._fail(e.at(self.address)) from None
            except (TypeError, IndexError, ValueError) as e:  # (strides of another rank: zip's)
                raise self._fail(ProtocolError(f"bad output metadata {m!r:.80} ({e})",
                                               server=self.address)) from None
            if into is not None:
                into[k].host = t
            out.append(t)
        return out

    def _input_const(self, slot: int, v: Any, frames: list[Any],
                     uploads: dict[int, tuple[torch.Tensor, int]],
                     restored: list[Handle]) -> Any:
        if type(v) is Handle:
            if v.client is self:
                r = v.res
                if r is not None and r.evicted is not None and v not in restored:
                    if r.evicted != "upload" or r.source is None:
                        raise GenieError(f"[genie residency] handle #{v.id} is evicted "
                                         f"({r.evicted}) but was not restored before a tape "
                                         "read it; this is a bug in Genie, please report it")
                    restored.append(v)  # back under its own id, inside this request
                    return msgpack.ExtType(EXT_INPUT, pack([host_ref(r.source[0], frames),
                                                            v.id]))
                return v.id
            if not v.client.alive:
                raise SessionLostError(v.client.address, "a tensor used here lived in a session "
                                       f"that is gone ({v.client.lost}); recompute it")
            # a value on another server: its reply brought it along, or download it
            v = v.host if v.host is not None else v.client.get([v])[0]
        elif not isinstance(v, torch.Tensor):
            raise TypeError(f"cannot send a tape input of type {type(v).__name__}")
        hit = self._uploads.get(id(v))
        if hit is not None and hit[0]() is v:
            return hit[1].id
        hid = next(self._ids)
        uploads[slot] = (v, hid)
        return msgpack.ExtType(EXT_INPUT, pack([host_ref(v, frames), hid]))

    def _call_run(self, header: dict[str, Any], frames: Any, what: str,
                  tape: Tape | None = None, sent: _Sent | None = None
                  ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """A run request of ``tape``, sent again after evicting what the server names under
        pressure (the handles it reads must stay; ``sent``: the request is on its way, only its
        answer is read)."""
        for _ in range(MAX_PRESSURE_ROUNDS):
            try:
                if sent is not None:
                    s, sent = sent, None
                    return self._receive(s)
                return self._call_locked(header, frames, what)
            except _Pressure as p:
                victims = p.h.get("victims")
                if "room" in p.h:  # the message itself does not fit: which values make room?
                    got, _ = self._call_locked({"t": "free", "ids": [], "room": p.h["room"],
                                                "keep": self._reads(tape)}, (),
                                               "a request for room")
                    victims = got.get("victims")
                    if not victims:
                        raise QuotaExceededError(self.address, str(p.h.get("msg"))) from None
                if not isinstance(victims, list) or not victims:
                    raise self._fail(ProtocolError("a pressure answer without victims",
                                                   server=self.address)) from None
                self.res.relieve(victims)
        raise QuotaExceededError(self.address, f"{what} still passes the session's quota after "
                                 f"{MAX_PRESSURE_ROUNDS} rounds of eviction; free tensors (del) "
                                 "or ask for a larger --quota")

    def _reads(self, tape: Tape | None) -> list[int]:
        """The ids of this session's handles ``tape`` reads (a request for room keeps them;
        listed only then, not for every request)."""
        if tape is None:
            return []
        return [v.id for v in tape.inputs.values() if type(v) is Handle and v.client is self]

    def _restore_run(self, tape: Tape, handles: list[Handle]) -> None:
        """Recompute evicted ``handles`` with ``tape`` (their recipe, keeping only them), put
        back under their own ids."""
        uploads: dict[int, tuple[torch.Tensor, int]] = {}
        restored: list[Handle] = []
        enc = encode_tape(tape, lambda s, v, frames: self._input_const(s, v, frames, uploads,
                                                                       restored))
        ids = [h.id for h in handles]
        ev: list[int] = []
        for h in [*handles, *restored]:
            if h.res is not None and h.res.role is not None:
                ev += (h.id, ROLE_CODE[h.res.role])
        header: dict[str, Any] = {"t": "run", "k": enc.key, "id0": 0, "ids": ids,
                                  "c": enc.consts}
        if ev:
            header["ev"] = ev
        if self._decoding:
            header["ph"] = 1
        if enc.key not in self._skeletons:
            header["sk"] = enc.skeleton
        what = f"a restore of {len(ids)} evicted value(s) ({len(tape.instrs)} ops)"
        try:
            h, _ = self._call_run(header, enc.frames, what, tape)
            if h.get("t") == "miss":
                header["sk"] = enc.skeleton
                self._call_run(header, enc.frames, what + " (resent)", tape)
        except _ExecFailure as f:
            err = f.error(tape, self.address)
            raise err from err.__cause__  # the server's exception, rebuilt (None: none)
        self._skeletons[enc.key] = enc.consts
        up_ids = [hid for _, hid in uploads.values()]
        lin = self._lineage
        if lin is not None:
            srcs = host_sources(x for ins in tape.instrs for x in ins.leaves)
            srcs += [(t, t._version) for t, _ in uploads.values()]
            lin.record_run(RunEntry(enc.key, enc.skeleton, enc.consts, enc.frames, 0,
                                    len(tape.instrs), srcs),
                           up_ids + [r.id for r in restored] + ids)
        self._pending_free.extend(up_ids)  # host inputs of the recipe: needed only here
        for r in restored:
            self.res._back(r, "upload")

    def _remember_upload(self, t: torch.Tensor, hid: int, index: int) -> Handle:
        """A client-side value now also lives on the server: later uses send its handle."""
        h = Handle(hid, self, TensorMeta.of(t, index))
        self._register_upload(t, h)
        return h

    def _register_upload(self, t: torch.Tensor, h: Handle) -> None:
        key = id(t)
        uploads = self._uploads
        uploads[key] = (weakref.ref(t, lambda _r: uploads.pop(key, None)), h)

    def uploaded(self, t: torch.Tensor) -> Handle | None:
        """The handle of a client-side tensor that was uploaded as a tape input, if any."""
        hit = self._uploads.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    # --- background: lease and frees ------------------------------------------------------------
    def _heartbeat(self) -> None:
        """Keep the lease and send frees while the program is idle, on a socket of its own."""
        lease = float(self.info.get("lease", 60.0))
        lease_every = max(0.5, min(lease / 3.0, 10.0))
        last_ping = time.monotonic()
        sock: zmq.Socket | None = None
        rids = itertools.count(1)
        try:
            sock, _ = self._socket()
            while not self._hb_stop.wait(LOAD_EVERY if self.watch_load else 0.25):
                now = time.monotonic()
                every = LOAD_EVERY if self.watch_load else lease_every
                idle = now - self._last_activity > 0.5
                if not ((self._pending_free and (idle or len(self._pending_free) > 4096))
                        or now - last_ping > every):
                    continue
                # frees only while no request runs: a checkpoint reads the live ids, and a
                # free that overtook it would make it ask for a freed value
                locked = self._lock.acquire(blocking=False)
                try:
                    # (nor while a run sent ahead is on its way: it may read them)
                    frees = self._drain_frees() if locked and self._inflight is None else []
                    rid = -next(rids)
                    sock.send_multipart([pack({"t": "free" if frees else "ping", "rid": rid,
                                               "s": self.session, "ids": frees})])
                finally:
                    if locked:
                        self._lock.release()
                last_ping = now
                waited = 0.0
                while not self._hb_stop.is_set() and waited < self.timeout:
                    if sock.poll(250):
                        self._pong(sock.recv_multipart(), rid)
                        break
                    waited += 0.25
                else:
                    if not self._hb_stop.is_set():
                        logger.warning("genie: heartbeat to %s got no answer", self.address)
        except Exception as e:  # never let the background thread die loudly
            logger.debug("genie: heartbeat thread stopped: %s", e)
        finally:
            if sock is not None:
                sock.close(linger=0)


    def _pong(self, parts: list[bytes], rid: int) -> None:
        """Read the server's load from a heartbeat ping's answer."""
        try:
            h = unpack(parts[0])
        except ProtocolError:
            return
        if isinstance(h, dict) and h.get("rid") == rid:
            ld = h.get("ld")
            if type(ld) in (int, float) and ld >= 0:
                self.load = (float(ld), time.monotonic())


#: where a plan keeps the positions of its tapes' kept values (:func:`_kept_at`)
_KEPT = "remote.kept"
#: where a plan keeps its tapes' kept slots with their nodes and server ids (:func:`_kept_rows`)
_KEPT_ROWS = "remote.kept_rows"
#: a plan's artifact: its tapes call no compiled graph (:func:`_graph_keys`)
_NO_GRAPHS = "remote.no_graphs"


def _graph_keys(tape: Tape) -> list[str]:
    """The graph keys ``tape`` calls (:func:`genie.graphs.keys_of`); for a tape of a plan that
    calls no graph, none without a scan (a plan's tapes run its ops, whatever their constants:
    ~3.5 us a GPT-2 4x128 token, ~8 us a 12x768 one)."""
    plan = tape.plan
    art = getattr(plan, "artifacts", None) if getattr(plan, "instrs", None) is not None else None
    if art is not None and art.get(_NO_GRAPHS):
        return []
    keys = graphs.keys_of(tape.instrs)
    if art is not None and not keys:
        art[_NO_GRAPHS] = True
    return keys


def _kept_at(tape: Tape) -> list[tuple[int, int, int]]:
    """``(node index, output index, slot)`` of each value of ``tape.keep`` its nodes make, in
    node order: by each node's slots when the tape has not built its slot map (a plan-cache
    hit: the same for every tape of the plan that keeps the same slots, so kept on the plan),
    else through the map."""
    keep = tape.keep
    pending = tape._slots
    if type(pending) is not PendingSlots:
        slots = tape.slots
        return [(i, k, s) for i, n in enumerate(tape.nodes) for k in range(len(n.metas))
                if (s := slots.get((n.index, k))) is not None and s in keep]
    outs = pending.outs
    art = getattr(tape.plan, "artifacts", None)
    hit = art.get(_KEPT) if art is not None else None
    if hit is not None and hit[0] is outs and hit[1] == keep:
        return hit[2]
    if len(outs) != len(tape.nodes):
        raise ValueError(f"a tape of {len(tape.nodes)} nodes with the slots of {len(outs)}")
    at = [(i, k, s) for i, o in enumerate(outs) for k, s in enumerate(o)
          if s is not None and s in keep]
    if art is not None:
        art[_KEPT] = (outs, set(keep), at)
    return at


def _kept_rows(tape: Tape, order: list[int]) -> list[tuple[int, int, int, int]] | None:
    """For a plan-cache hit (its slot map not built), ``(slot, node index, output index, place
    in order)`` of each kept slot in slot order (``node index`` -1: a tape input), the same for
    every tape of the plan that keeps the same slots and numbers them by the same ``order``
    (its wire's), so kept on the plan; None for another tape."""
    pending = tape._slots
    art = getattr(tape.plan, "artifacts", None)
    if type(pending) is not PendingSlots or art is None:
        return None
    keep = tape.keep
    hit = art.get(_KEPT_ROWS)
    if hit is not None and hit[0] is pending.outs and hit[1] is order and hit[2] == keep:
        return hit[3]
    made = {s: (i, k) for i, k, s in _kept_at(tape)}
    place = {s: j for j, s in enumerate(order)}
    inputs = tape.inputs
    rows = []
    for s in sorted(keep):
        if s in inputs:
            rows.append((s, -1, 0, 0))
        elif s in made and s in place:
            rows.append((s, *made[s], place[s]))
        else:  # made by no node of the tape's, or not numbered by the server: not this path
            return None
    art[_KEPT_ROWS] = (pending.outs, order, set(keep), rows)
    return rows


def _retire(ctx: zmq.Context) -> None:
    """Terminate a client's ZeroMQ context off the caller's thread. ``term()`` waits until every
    socket of the context is closed; one still open elsewhere (a heartbeat thread that did not
    stop in time, a socket libzmq keeps for a monitor) must not hang the program: a context
    dropped to the garbage collector ran ``term()`` inside the next request and hung a test run
    for good (found by a clean-clone CI run). The sockets are closed with linger 0 before this."""
    threading.Thread(target=ctx.term, name="genie-zmq-term", daemon=True).start()


class _Sent:
    """A request on its way (:meth:`Client._send`): what :meth:`Client._receive` needs."""

    __slots__ = ("rid", "what", "head", "size", "up", "sent_at", "into")

    def __init__(self, rid: int, what: str, head: int, size: int, up: Any, sent_at: float
                 ) -> None:
        self.rid, self.what, self.head, self.size = rid, what, head, size
        self.up, self.sent_at = up, sent_at
        # a booked run's output handles: its reply may be read natively (_client_reply)
        self.into: list[Handle] | None = None


class _Run:
    """One run request of :meth:`Client.run`, from encoding to booking."""

    __slots__ = ("tape", "enc", "header", "extra", "what", "uploads", "restored",
                 "id0", "n_new", "base", "gkeys", "kept", "remote_inputs", "owners", "work")

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.extra: dict[str, Any] = {}
        self.uploads: dict[int, tuple[torch.Tensor, int]] = {}
        self.restored: list[Handle] = []
        self.kept: dict[int, Any] | None = None  # its handles, once booked (Client._book)
        self.work: Any = None  # sent ahead: its estimated work, when the cost model samples it


class _Ahead:
    """A run sent without waiting (:meth:`Client.run`, ``wait=False``); it holds the run's tape,
    so the handles it reads stay alive (no free of them overtakes it)."""

    __slots__ = ("run", "sent", "done")

    def __init__(self, run: _Run, sent: _Sent) -> None:
        self.run, self.sent = run, sent
        self.done: Callable[[], None] | None = None  # after_answer's


class _Pressure(Exception):
    """The server answered ``pressure``: evict its victims and send the request again."""

    def __init__(self, h: dict[str, Any]) -> None:
        super().__init__(h.get("msg"))
        self.h = h


class _ExecFailure(Exception):
    """An op failed on the server; becomes an :class:`ExecutionError` with the tape's op."""

    def __init__(self, h: dict[str, Any]) -> None:
        super().__init__(h.get("msg"))
        self.h = h

    def error(self, tape: Tape, address: str, hoisted: frozenset[int] = frozenset()
              ) -> Exception:
        """The error of ``tape``'s instruction the server names (by its index on the wire:
        ops outside the opset decomposed, ``hoisted`` uploads sent as input uploads)."""
        i, msg = self.h.get("i"), str(self.h.get("msg"))
        etype = getattr(builtins, str(self.h.get("etype")), None)
        if not (isinstance(etype, type) and issubclass(etype, Exception)):
            etype = RuntimeError
        try:
            cause = etype(msg)
        except Exception:
            cause = RuntimeError(msg)
        origin: list[int] = []  # the wire's instructions: ops outside the opset decomposed
        with contextlib.suppress(Exception):
            for_server(tape, origin)
        if hoisted:
            instrs = tape.instrs
            origin = [o for o in origin if not (instrs[o].op == UPLOAD and
                                                instrs[o].outs[0] in hoisted)]
        if type(i) is int and 0 <= i < len(origin):
            ins = tape.instrs[origin[i]]
            return ExecutionError(ins.op, ins.where, cause, origin[i])
        return RemoteError(address, f"a tape failed on the server: {msg}")
