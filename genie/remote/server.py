"""``genie-server``: owns one real device and runs clients' tapes on it.

Usage::

    genie-server --device cuda:0 --listen 127.0.0.1:5555      # prints how clients connect
    python -m genie.remote.server --device cpu --listen 127.0.0.1:0 --insecure

Structure: the main thread owns the ZeroMQ ROUTER socket. It decodes headers, answers pings,
tells clients whose requests wait or run that the server is alive (``busy``, twice a second),
expires sessions whose lease ran out, cancels the queued requests of clients that disconnect,
and forwards replies. ``--workers`` threads run requests (:class:`~genie.remote.sched.FairQueue`:
one session's requests one at a time and in order, sessions taking turns, so a long tape holds
one worker while the others serve short requests); on CUDA each session runs on a stream of its
own. Tapes run through :func:`genie.remote.guard.run_guarded` (vetted on meta tensors, then
interpreted op by op with the eager backend's semantics) on the server's device.

Sessions: ``hello`` opens one and returns an unguessable token that every later request carries;
a session's store maps client-chosen handle ids to resident tensors and is reachable only with
its token, so clients never see each other's tensors. A session ends on ``bye``, or when no
message came for ``lease`` seconds (its tensors are freed). Each session has a memory quota
that covers the bytes of the distinct storages it holds (followed through resizes), its cached
skeletons (approximate size, capped at :data:`SKELETON_SHARE` of the quota), the bytes of its
queued messages (counted on the main thread before a message is accepted) and, while a tape
runs, the tape's peak working set (vetted on meta tensors before anything runs, see
:mod:`genie.remote.guard`); a request that would pass it is refused and undone. A tape that runs
longer than ``--max-run-seconds`` is stopped between two instructions and its client told.

Residency under memory pressure: a run request may carry *hints* (``ev``: handle id and role
code pairs, :data:`~genie.remote.protocol.ROLES`) that mark the session's own values evictable.
When a tape would pass the quota before anything ran, the server picks victims among hinted
values (never the tape's inputs, nor a storage some unhinted value shares; weights and KV caches
never while the session decodes), activations first, least recently used first, and answers
``pressure`` with their ids instead of running; the client evicts them (it knows how to restore
each: recompute from lineage or re-upload) and sends the request again. Nothing hinted frees
enough: ``quota`` as before, saying what is resident by role. A hint never touches another
session (it names ids of the session's own store) and never makes a value less evictable.

Security: CURVE (authentication and encryption) by default, with keys under ``--keys``
(generated on first start: the server's pair, and one client pair written to a connection file
that clients pass as ``key_file``). ``--insecure`` serves plain TCP for local experiments.
Every message is checked (sizes, types, slots, handle ids, the op allowlist of
:mod:`genie.remote.allowlist`); a bad one gets an error reply and changes nothing. The threat
model (what a key holder can and cannot do) is in docs/deployment.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from .. import backends
from ..errors import ExecutionError
from ..index_check import IndexCheck
from ..index_check import server_scope as index_check_scope
from . import ProtocolError, peer
from . import keys as keyring
from .guard import QuotaError, RunTimeout, run_guarded
from .protocol import (
    ALIGN,
    DECODE_PINNED,
    MAX_HINTS,
    PROTOCOL_VERSION,
    REQUESTS,
    ROLES,
    UPLOAD,
    Compiled,
    InputUpload,
    compile_skeleton,
    fill,
    frame_tensor,
    frame_view,
    join_frames,
    pack,
    split_frames,
    tensor_frame,
    unpack,
)
from .sched import FairQueue, LoadMeter

logger = logging.getLogger("genie.server")

MAX_FRAMES = 1 << 16
MAX_QUEUE = 1024
#: requests one session may have queued (beyond them: a "busy" refusal)
MAX_QUEUED_PER_SESSION = 64
#: the largest ``hello`` (no session yet, so nothing to count it against)
MAX_HELLO_BYTES = 64 << 10
SKELETON_CACHE = 256
#: cached skeletons of a session may take this share of its quota (least recently used evicted)
SKELETON_SHARE = 0.25
#: bytes a compiled skeleton is counted per byte of its packed form (measured: ~24x for a
#: 243-instruction MLP tape, tracemalloc)
SKELETON_COST = 32
#: default of ``--max-run-seconds``
MAX_RUN_SECONDS = 300.0
#: seconds between "busy" notes to clients whose requests wait or run (their timeout counts
#: server silence, so it must be larger than this)
KEEPALIVE = 0.5
#: under pressure, victims free the deficit plus this share of the quota (fewer pressure rounds)
EVICT_SLACK = 0.125


class _Refused(Exception):
    """A request the server refuses: ``kind`` goes to the client with the message."""

    def __init__(self, kind: str, msg: str, **extra: Any) -> None:
        super().__init__(msg)
        self.kind = kind
        self.extra = extra


@dataclass
class Session:
    """One client's state: resident tensors by handle id, compiled skeletons, accounting.

    Storages are keyed by their ``StorageImpl`` (``_cdata``), which a resize keeps (its data
    pointer changes); each entry is ``[tensors holding it, bytes counted]``. ``queued``/``nqueued``
    belong to the main thread's admission check (updated under the server's queue lock).
    """

    token: bytes
    quota: int
    store: dict[int, torch.Tensor] = field(default_factory=dict)
    skeletons: collections.OrderedDict[bytes, tuple[Compiled, int]] = field(
        default_factory=collections.OrderedDict)
    storages: dict[int, list[int]] = field(default_factory=dict)
    nbytes: int = 0
    skel_bytes: int = 0
    queued: int = 0
    nqueued: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    # server-to-server transfers (genie.remote.peer): bytes [sent, received], last put's nonce
    peer_bytes: list[int] = field(default_factory=lambda: [0, 0])
    put_nonce: int = 0
    sends: int = 0  # sends under way (the peer thread holds their values)
    # the storages each send under way pins, (key, bytes) each: counted while no longer held
    pins: tuple[tuple[tuple[int, int], ...], ...] = ()
    # residency: role code of hinted (evictable) handles, last use of each handle (a counter),
    # and whether the last tape was a decode step (its weights and KV caches stay)
    roles: dict[int, int] = field(default_factory=dict)
    used_at: dict[int, int] = field(default_factory=dict)
    tick: int = 0
    decoding: bool = False

    def put(self, hid: int, t: Any) -> None:
        if hid in self.store:
            raise _Refused("protocol", f"handle id {hid} is already in use")
        if not isinstance(t, torch.Tensor):
            raise _Refused("protocol", f"a kept value is a {type(t).__name__}, not a tensor")
        self.store[hid] = t
        self.used_at[hid] = self.tick
        st = t.untyped_storage()
        e = self.storages.get(st._cdata)
        if e is None:
            self.storages[st._cdata] = [1, st.nbytes()]
            self.nbytes += st.nbytes()
        else:
            e[0] += 1

    def drop(self, hid: Any) -> None:
        t = self.store.pop(hid, None) if type(hid) is int else None
        if t is None:
            return
        self.roles.pop(hid, None)
        self.used_at.pop(hid, None)
        key = t.untyped_storage()._cdata
        e = self.storages.get(key)
        if e is None:  # never: every stored tensor is counted; but freeing must not fail
            return
        e[0] -= 1
        if e[0] == 0:
            del self.storages[key]
            self.nbytes -= e[1]

    def refresh(self, tensors: Any) -> None:
        """Recount the storages of ``tensors`` (a tape may have resized them in place)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                e = self.storages.get(st._cdata)
                if e is not None and e[1] != st.nbytes():
                    self.nbytes += st.nbytes() - e[1]
                    e[1] = st.nbytes()

    def used(self) -> int:
        """Bytes counted against the quota: resident storages, cached skeletons, and storages
        that transfers under way pin after the session freed them."""
        pins = self.pins
        return self.nbytes + self.skel_bytes + \
            (peer.unheld_bytes(pins, self.storages) if pins else 0)

    def clear(self) -> None:
        self.store.clear()
        self.roles.clear()
        self.used_at.clear()
        self.storages.clear()
        self.skeletons.clear()
        self.nbytes = 0
        self.skel_bytes = 0

    def residency(self) -> list[int]:
        return [len(self.store), self.nbytes]

    def by_role(self) -> dict[str, list[int]]:
        """``role -> [values, bytes]`` of what the session holds (``unhinted``: no hint; a
        storage counted once, under its first value's role)."""
        out: dict[str, list[int]] = {}
        seen: set[int] = set()
        for hid, t in self.store.items():
            key = t.untyped_storage()._cdata
            code = self.roles.get(hid)
            e = out.setdefault(ROLES[code] if code is not None else "unhinted", [0, 0])
            e[0] += 1
            if key not in seen:
                seen.add(key)
                e[1] += self.storages[key][1] if key in self.storages else 0
        return out

    def victims(self, need: int, protect: set[int], slack: int) -> list[int] | None:
        """Hinted values whose storages free at least ``need`` bytes (up to ``need + slack``),
        in eviction order, or None when everything evictable frees less.

        A storage is evictable when one hinted value holds it, not in ``protect``
        (the pending tape's inputs); while the session decodes, weights and KV caches are not.
        Order: role code (activations first), then least recently used.
        """
        by_st: dict[int, list[int]] = {}
        for hid, t in self.store.items():
            by_st.setdefault(t.untyped_storage()._cdata, []).append(hid)
        cands = []
        for key, hids in by_st.items():
            codes = [self.roles.get(h) for h in hids]
            # values sharing a storage (a view and its base) would not share it once restored
            if len(hids) > 1 or None in codes or not protect.isdisjoint(hids):
                continue
            code = max(c for c in codes if c is not None)
            if self.decoding and code in DECODE_PINNED:
                continue
            cands.append((code, max(self.used_at.get(h, 0) for h in hids), key, hids))
        cands.sort()
        out: list[int] = []
        freed = 0
        for _, _, key, hids in cands:
            if freed >= need + slack:
                break
            out.extend(hids)
            freed += self.storages[key][1] if key in self.storages else 0
        return out if freed >= need else None


class Server:
    """A Genie server on one device. :meth:`start` binds; :meth:`serve` runs until stopped."""

    def __init__(self, device: str = "cpu", listen: str = "127.0.0.1:5555", *,
                 insecure: bool = False, keys_dir: str | None = None, lease: float = 60.0,
                 quota: int | None = None, max_message: int = 8 << 30,
                 max_sessions: int = 64, workers: int = 4,
                 max_run_seconds: float = MAX_RUN_SECONDS, peer_keys: str | None = None,
                 peer_timeout: float = 30.0, index_check: str | None = None,
                 peers: str | None = None) -> None:
        self.device = torch.device(device)
        # check index arguments before indexing kernels (genie.index_check): on CUDA, by default
        # ("all"); on a CPU, by default, those of the kernels that do not check ("cpu")
        self.index_check = index_check_scope(
            index_check if index_check is not None else
            os.environ.get("GENIE_SERVER_INDEX_CHECK", "auto"), self.device)
        self.listen = listen
        self.insecure = insecure
        self.keys_dir = Path(keys_dir or os.environ.get("GENIE_KEYS_DIR") or
                             Path.home() / ".config" / "genie" / "server")
        self.lease = lease
        self.quota = quota if quota is not None else default_quota(self.device)
        self.max_message = max_message
        self.max_sessions = max_sessions
        self.max_run_seconds = max_run_seconds
        self.address = ""
        self.key_file: Path | None = None
        self.sessions: dict[bytes, Session] = {}
        self._lock = threading.Lock()
        self.workers = max(1, workers)
        self._queue = FairQueue()
        self._fd_ident: dict[int, bytes] = {}  # connection (fd) -> peer identity, to cancel
        self._streams: dict[bytes, Any] = {}  # session token -> its CUDA stream
        self._inflight: dict[bytes, tuple[int, Any]] = {}
        self._qlock = threading.Lock()  # guards Session.queued/nqueued (main thread + workers)
        self._stop = threading.Event()
        self._ctx: zmq.Context | None = None
        self._auth: Any = None
        self.peer_keys = peer_keys
        self.peer_timeout = peer_timeout
        self._peers: peer.PeerLinks | None = None
        self.peers_spec = peers  # --peers: the pool members this server may send to
        self.peers = peer.Peers()  # (read in start, once this server's own key is known)
        self._keyring: keyring.KeyRing | None = None
        self._meter = LoadMeter()

    # --- setup ------------------------------------------------------------------------------
    def start(self) -> str:
        """Bind the socket (and start CURVE authentication); returns the address."""
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"genie-server: --listen wants HOST:PORT, got {self.listen!r}")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_message)
        self._sock.router_mandatory = False
        if not self.insecure:
            from zmq.auth.thread import ThreadAuthenticator

            pub, sec, authorized = ensure_keys(self.keys_dir)
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("genie.server.auth"))
            self._auth.start()
            # clients' keys (authorized/) and peers' (peers/): puts come from peers only
            self._keyring = keyring.KeyRing(self.keys_dir)
            self._auth.configure_curve_callback(domain="genie",
                                                credentials_provider=self._keyring)
            self._sock.curve_secretkey = sec
            self._sock.curve_publickey = pub
            self._sock.curve_server = True
            self._sock.zap_domain = b"genie"
            self._server_public = pub.decode()
        if port == "0":
            self._sock.bind(f"tcp://{host}:*")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind("inproc://genie-replies")
        self.peers = peer.Peers(self.peers_spec,
                                None if self.insecure else self._server_public)
        self._peers = peer.PeerLinks(self._ctx, self._peer_key_pair(), "inproc://genie-replies",
                                     min(self.max_message, peer.PEER_REPLY_MAX))
        if not self.insecure:
            self.key_file = write_connection_file(self.keys_dir, self.address,
                                                  self._server_public)
        if not _is_loopback(host):
            logger.warning("genie-server: listening on %s, not loopback%s", host,
                           "; with --insecure anyone who can reach it can run code on this "
                           "device" if self.insecure else "")
        self._mon = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._workers = [threading.Thread(target=self._work, name=f"genie-worker-{i}",
                                          daemon=True) for i in range(self.workers)]
        for w in self._workers:
            w.start()
        return self.address

    def _peer_key_pair(self) -> tuple[bytes, bytes] | None:
        """The key pair this server authenticates with to its peers (never the client pair):
        ``--peer-keys``, else the peer pair of its own key directory (what a pool's members
        share, see :mod:`genie.remote.keys`)."""
        if self.insecure:
            return None
        if self.peer_keys:
            return peer.load_peer_keys(self.peer_keys)
        return keyring.ensure_peer_pair(self.keys_dir)

    def banner(self) -> str:
        if self.insecure:
            how = (f"  connect: GENIE_SERVER={self.address} GENIE_INSECURE=1 "
                   f"python your_program.py\n"
                   f"       or: genie.connect({self.address!r}, insecure=True)")
            sec = "plain TCP, NO authentication (--insecure)"
        else:
            how = (f"  key file: {self.key_file}  (a secret: give it only to trusted clients)\n"
                   f"  connect: GENIE_SERVER={self.address} GENIE_KEY_FILE={self.key_file} "
                   f"python your_program.py\n"
                   f"       or: genie.connect({self.address!r}, key_file={str(self.key_file)!r})")
            sec = "CURVE authenticated and encrypted"
        return (f"genie-server: serving {self.device} on {self.address} ({sec}); "
                f"lease {self.lease:g} s, quota {self.quota} bytes per session, tapes stopped "
                f"after {self.max_run_seconds:g} s, index checks "
                f"{_CHECKS[self.index_check]}\n{how}")

    # --- main thread: I/O ---------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until :meth:`stop` (or SIGINT/SIGTERM via :func:`main`)."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        last_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if self._replies in events:
                    for _ in range(256):
                        try:
                            parts = self._replies.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._inflight.pop(parts[0].bytes, None)
                        self._sock.send_multipart(parts, copy=False)
                if self._sock in events:
                    for _ in range(256):
                        try:
                            parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        try:
                            self._incoming(parts)
                        except Exception as e:  # never let one message stop the server
                            logger.exception("genie-server: dropped a message: %s", e)
                    parts = None  # the last message is not held (uncounted) until the next
                if self._mon in events:
                    self._disconnects()
                now = time.monotonic()
                if now - last_tick >= KEEPALIVE:
                    last_tick = now
                    self._tick(now)
        finally:
            self._close()

    def stop(self) -> None:
        self._stop.set()

    def _incoming(self, parts: list[zmq.Frame]) -> None:
        ident = parts[0].bytes
        if len(parts) < 2:
            return self._send_err(ident, -1, "protocol", "empty message")
        try:
            h = unpack(parts[1].buffer)
        except ProtocolError as e:
            return self._send_err(ident, -1, "protocol", str(e))
        rid = h.get("rid") if isinstance(h, dict) else None
        if type(rid) is not int or type(h.get("t")) is not str or h["t"] not in REQUESTS:
            return self._send_err(ident, -1, "protocol", "a header must be a map with a known "
                                  f"'t' ({', '.join(sorted(REQUESTS))}) and an integer 'rid'")
        if len(parts) - 2 > MAX_FRAMES:
            return self._send_err(ident, rid, "protocol", f"more than {MAX_FRAMES} frames")
        if self._keyring is not None:  # puts from peer keys only, the rest from client keys
            why = self._keyring.refusal(parts[1].get("User-Id"), h["t"])
            if why is not None:
                return self._send_err(ident, rid, "protocol", why)
        if h["t"] == "hello":  # whose session (its load is shared with the same key's only)
            h["_p"] = parts[1].get("User-Id") if self._keyring is not None else ""
        if h["t"] == "put":  # a peer's values: authorized by a ticket, not the session token
            try:
                h["s"] = self._put_session(h)
            except _Refused as e:
                return self._send_err(ident, rid, e.kind, str(e))
        token = h.get("s")
        nbytes = sum(len(p) for p in parts[1:])
        sess = None
        if h["t"] != "hello":
            sess = self.sessions.get(token) if isinstance(token, bytes) else None
            if sess is None:
                return self._send_err(ident, rid, "session", self._unknown_session())
            sess.last_seen = time.monotonic()
            if h["t"] == "ping" and not h.get("free"):
                return self._send(ident, self._pong(sess, rid))
        elif nbytes > MAX_HELLO_BYTES:
            return self._send_err(ident, rid, "protocol", f"a hello of {nbytes} bytes (at most "
                                  f"{MAX_HELLO_BYTES})")
        if self._queue.qsize() > MAX_QUEUE:
            return self._send_err(ident, rid, "busy", "the server's queue is full; retry later")
        if sess is not None:
            with self._qlock:
                if sess.nqueued >= MAX_QUEUED_PER_SESSION:
                    return self._send_err(ident, rid, "busy", f"this session already has "
                                          f"{sess.nqueued} requests queued; wait for answers")
                if sess.queued + nbytes + sess.used() > sess.quota:
                    self._frees_of_refused(sess, h)
                    over = sess.queued + nbytes + sess.used() - sess.quota
                    msg = (f"a message of {nbytes} bytes, with the session's {sess.queued} "
                           f"queued bytes and {sess.used()} resident bytes, passes its quota "
                           f"of {sess.quota} bytes (server flag --quota); send less at once or "
                           "free tensors")
                    if sess.roles and h["t"] in ("run", "put") and over <= sess.nbytes:
                        # evicting hinted values may make room: the client asks which first
                        return self._send(ident, {"t": "err", "rid": rid, "kind": "quota",
                                                  "msg": msg, "room": over})
                    return self._send_err(ident, rid, "quota", msg)
                sess.queued += nbytes
                sess.nqueued += 1
        self._inflight[ident] = (rid, token)
        fd = parts[1].get(zmq.SRCFD)
        if fd >= 0:
            self._fd_ident[fd] = ident
        self._queue.put(token if h["t"] != "hello" else b"hello:" + ident,
                        (ident, h, parts[2:], nbytes))

    def _frees_of_refused(self, sess: Session, h: dict[str, Any]) -> None:
        """A message refused at the door for its size still frees what it names: its frees go
        to the session's queue on their own (no reply), ahead of anything it sends next,
        counted as a queued request of 8 bytes an id (under ``_qlock``)."""
        frees = h.get("free")
        if not isinstance(frees, list) or not frees or \
                sess.nqueued >= MAX_QUEUED_PER_SESSION:
            return
        n = 8 * len(frees)
        sess.queued += n
        sess.nqueued += 1
        self._queue.put(sess.token, (None, {"t": "free", "s": sess.token, "rid": -1,
                                            "free": frees}, [], n))

    def _dequeued(self, h: dict[str, Any], nbytes: int) -> None:
        """A request left the queue (answered or cancelled): uncount its bytes."""
        sess = self.sessions.get(h.get("s")) if h.get("t") not in ("hello", "_expire") else None
        if sess is not None and nbytes:
            with self._qlock:
                sess.queued -= nbytes
                sess.nqueued -= 1

    def _disconnects(self) -> None:
        """Peers that went away: their queued requests are dropped, never run (a tape that
        already runs finishes; its reply goes nowhere)."""
        while self._mon.poll(0):
            ev = recv_monitor_message(self._mon)
            if ev["event"] != zmq.EVENT_DISCONNECTED:
                continue
            ident = self._fd_ident.pop(ev["value"], None)
            if ident is None:
                continue
            self._inflight.pop(ident, None)

            def mine(item: Any) -> bool:
                if item[0] != ident:
                    return False
                self._dequeued(item[1], item[3])
                return True

            n = self._queue.drop(mine)
            if n:
                logger.info("genie-server: a client disconnected; %d queued request(s) "
                            "cancelled", n)

    def _pong(self, sess: Session, rid: Any) -> dict[str, Any]:
        """A ping's answer: residency, how busy the workers were with the other sessions of
        the same client key (``ld``, see :class:`~genie.remote.sched.LoadMeter`: nothing about
        other tenants) and the session's peer bytes sent, received."""
        return {"t": "ok", "rid": rid, "res": sess.residency(),
                "ld": self._meter.load(sess.token), "pb": sess.peer_bytes}

    def _put_session(self, h: dict[str, Any]) -> bytes:
        """The token of the session a peer's ``put`` is for, once its fields and ticket are
        checked (:func:`genie.remote.peer.check_put`: the ticket signs everything the put acts
        on, and a put carries nothing else); :class:`_Refused` otherwise. Main thread."""
        def token_of(sid: bytes) -> bytes | None:
            with self._lock:
                return next((t for t in self.sessions if peer.session_id(t) == sid), None)

        try:
            tok, n = peer.check_put(h, token_of)
        except ProtocolError as e:
            raise _Refused("protocol", str(e)) from None
        except LookupError as e:
            raise _Refused("session", str(e)) from None
        sess = self.sessions.get(tok)
        if sess is None:
            raise _Refused("session", "the destination session of this put does not exist "
                                      "(it expired or was closed)")
        if n <= sess.put_nonce:
            raise _Refused("protocol", f"a put ticket used again (nonce {n}, last "
                                       f"{sess.put_nonce})")
        sess.put_nonce = n
        return tok

    def _unknown_session(self) -> str:
        return ("this session does not exist on the server (it was restarted, or the session "
                f"expired after {self.lease:g} s without a message); its tensors are gone")

    def _tick(self, now: float) -> None:
        for ident, (rid, _) in list(self._inflight.items()):
            self._send(ident, {"t": "busy", "rid": rid})
        busy = {tok for _, tok in self._inflight.values()}
        for tok, s in list(self.sessions.items()):
            if now - s.last_seen > self.lease and tok not in busy:
                self._queue.put(tok, (None, {"t": "_expire", "s": tok}, [], 0))

    def _send(self, ident: bytes, h: dict[str, Any], frames: Any = ()) -> None:
        self._sock.send_multipart([ident, pack(h), *frames], copy=False)

    def _send_err(self, ident: bytes, rid: int, kind: str, msg: str) -> None:
        logger.info("genie-server: refused a request (%s): %s", kind, msg)
        self._send(ident, {"t": "err", "rid": rid, "kind": kind, "msg": msg})

    def _close(self) -> None:
        self._queue.close()
        for w in self._workers:
            w.join(timeout=30)
        if self._peers is not None:
            self._peers.close()
        self._mon.close(linger=0)
        with self._lock:
            for s in self.sessions.values():
                s.clear()
            self.sessions.clear()
        for s in (self._replies, self._sock):
            s.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        assert self._ctx is not None
        self._ctx.term()
        logger.info("genie-server: stopped")

    # --- worker thread: sessions and execution --------------------------------------------------
    def _work(self) -> None:
        assert self._ctx is not None
        out = self._ctx.socket(zmq.PUSH)
        out.linger = 0
        out.connect("inproc://genie-replies")
        try:
            while True:
                got = self._queue.get()
                if got is None:
                    return
                key, (ident, h, frames, nbytes) = got
                self._meter.begin(key)
                try:
                    self._work_one(key, ident, h, frames, out)
                finally:
                    self._meter.end()
                    self._dequeued(h, nbytes)
                    self._queue.done(key)
                    # an idle worker holds nothing of its last request (an upload's frames
                    # stayed alive, uncounted, until the worker's next request)
                    got = frames = h = None
        finally:
            out.close(linger=0)

    def _work_one(self, key: Any, ident: bytes | None, h: dict[str, Any],
                  frames: list[zmq.Frame], out: zmq.Socket) -> None:
        rid = h.get("rid", -1)
        t0 = time.monotonic()
        try:
            with self._stream(key):
                reply, rframes = self._handle(h, frames, ident)
            if reply is None:  # a send: the peer thread answers once the peer has the values
                return
        except _Refused as e:
            reply, rframes = {"t": "err", "kind": e.kind, "msg": str(e), **e.extra}, []
        except ProtocolError as e:
            reply, rframes = {"t": "err", "kind": "protocol", "msg": str(e)}, []
        except Exception as e:
            logger.exception("genie-server: request failed")
            reply, rframes = {"t": "err", "kind": "internal",
                              "msg": f"{type(e).__name__}: {e}"}, []
        if reply.get("t") == "err":
            logger.info("genie-server: request %s failed (%s): %s", h.get("t"),
                        reply.get("kind"), reply.get("msg"))
        if ident is None:
            return
        reply["rid"] = rid
        reply["st"] = round(time.monotonic() - t0, 6)  # the server's own time: the cost model's
        rframes, counts = split_frames(rframes)
        if counts is not None:
            reply["fc"] = counts
        out.send_multipart([ident, pack(reply), *rframes], copy=False)

    def _stream(self, key: Any) -> Any:
        """On CUDA, the session's own stream (its transfers and kernels ordered on it, other
        sessions' work overlapping); elsewhere nothing. Untested here: no GPU on CI."""
        if self.device.type != "cuda" or not isinstance(key, bytes) or \
                key.startswith(b"hello:"):
            return contextlib.nullcontext()
        if key not in self.sessions:
            self._streams.pop(key, None)
            return contextlib.nullcontext()
        st = self._streams.get(key)
        if st is None:
            st = self._streams[key] = torch.cuda.Stream(self.device)
        return _on_stream(st)

    def _handle(self, h: dict[str, Any], frames: list[zmq.Frame], ident: bytes | None = None
                ) -> tuple[dict[str, Any] | None, list]:
        kind = h["t"]
        if kind == "hello":
            return self._hello(h), []
        if kind == "_expire":
            with self._lock:
                s = self.sessions.pop(h["s"], None)
            if s is not None:
                logger.info("genie-server: session %s expired; freed %d tensors (%d bytes)",
                            s.token.hex()[:8], *s.residency())
                s.clear()
                if self._peers is not None and s.sends:
                    self._peers.cancel(s.token)  # what its transfers pinned goes too
            return {"t": "ok"}, []
        sess = self.sessions.get(h.get("s"))  # type: ignore[arg-type]
        if sess is None:
            raise _Refused("session", self._unknown_session())
        sess.last_seen = time.monotonic()
        for hid in _id_list(h.get("free")):
            sess.drop(hid)
        if kind == "free":
            for hid in _id_list(h.get("ids")):
                sess.drop(hid)
            room = h.get("room")
            if room is not None:  # which hinted values would make room for a message
                if type(room) is not int or not 0 < room <= sess.quota:
                    raise ProtocolError(f"'room' must be a byte count in 1..{sess.quota} (the "
                                        f"session's quota), got {room!r:.40}")
                keep = h.get("keep", [])  # what the refused message reads: not a victim
                if not isinstance(keep, list) or len(keep) > MAX_HINTS:
                    raise ProtocolError(f"'keep' must be a list of at most {MAX_HINTS} handle "
                                        "ids")
                victims = sess.victims(room, set(_id_list(keep)),
                                       int(sess.quota * EVICT_SLACK))
                return {"t": "ok", "res": sess.residency(), "victims": victims or []}, []
            return {"t": "ok", "res": sess.residency()}, []
        if kind == "ping":
            return self._pong(sess, None), []
        if kind == "send":
            return self._peer_send(sess, h, ident), []
        if kind == "put":
            return self._peer_put(sess, h, frames), []
        if kind == "bye":
            with self._lock:
                self.sessions.pop(sess.token, None)
            sess.clear()
            if self._peers is not None and sess.sends:
                self._peers.cancel(sess.token)  # what its transfers pinned goes too
            return {"t": "ok"}, []
        if kind == "get":
            vals = []
            for hid in _id_list(h.get("ids")):
                t = sess.store.get(hid)
                if t is None:
                    raise _Refused("protocol", f"no tensor with handle id {hid} in this session")
                vals.append(t)
            reply, rframes = _outputs(vals)
            reply["res"] = sess.residency()
            return reply, rframes
        assert kind == "run"
        return self._run(sess, h, frames)

    def _peer_send(self, sess: Session, h: dict[str, Any], ident: bytes | None) -> None:
        """Push resident values to a peer server's session (:mod:`genie.remote.peer`): checked
        here, sent by the peer thread, which answers the client; None (no reply now). Only to a
        member of this server's pool (``--peers``), with the key registered for it."""
        ids, dids, dest, sk = h.get("ids"), h.get("dids"), h.get("to"), h.get("sk")
        signed, to_s = h.get("o"), h.get("to_s", self.peer_timeout)
        if not isinstance(ids, list) or not 0 < len(ids) <= peer.MAX_VALUES or \
                not all(type(i) is int for i in ids) or not isinstance(dids, list) or \
                len(dids) != len(ids) or not isinstance(signed, list) or \
                len(signed) != len(ids):
            raise ProtocolError(f"a send needs 'ids', 'dids' and 'o' of one length (1 to "
                                f"{peer.MAX_VALUES})")
        if not isinstance(dest, str) or not peer.ADDRESS.fullmatch(dest):
            raise ProtocolError(f"a send's destination must be tcp://host:port, got {dest!r:.80}")
        if sk is not None and (not isinstance(sk, str) or not peer.Z85_KEY.fullmatch(sk)):
            raise ProtocolError("a send's 'sk' must be the destination's CURVE public key (Z85)")
        if type(to_s) not in (int, float) or not to_s > 0:
            raise ProtocolError("a send's 'to_s' must be a positive number of seconds")
        sid, n, tk = h.get("sid"), h.get("n"), h.get("tk")
        if not isinstance(sid, bytes) or len(sid) != peer.SESSION_ID_BYTES or \
                type(n) is not int or not 0 < n < 1 << 63 or not isinstance(tk, bytes) or \
                len(tk) != peer.TICKET_BYTES or \
                not all(type(i) is int and 0 <= i < 1 << 63 for i in dids):
            raise ProtocolError("a send needs 'sid' (8 bytes), 'n' (a positive nonce), 'tk' (a "
                                "16-byte ticket) and non-negative 'dids'")
        registered, key = self.peers.lookup(dest)
        if not registered:  # never connect to a place a client names: one answer for all
            raise _Refused("peer", f"{dest} is not a member of this server's pool: a server "
                                   f"sends only to the peers registered with it (--peers; "
                                   f"{len(self.peers)} registered), whatever listens at an "
                                   "address a client names")
        if sess.sends >= peer.MAX_PENDING:
            raise _Refused("busy", f"this session already has {sess.sends} transfers under "
                                   "way; wait for their answers")
        vals = []
        for i in ids:
            t = sess.store.get(i)
            if t is None:
                raise _Refused("protocol", f"no tensor with handle id {i} in this session")
            vals.append(t)
        geo, frames, nbytes = peer.pack_values(vals)
        for k, (g, want) in enumerate(zip(geo, signed, strict=True)):
            if g.signed() != want:
                raise _Refused("protocol", f"value {k} (handle {ids[k]}) is {g.signed()} on this "
                                           "server (dtype, shape, strides, storage offset, math "
                                           f"bits); the send describes it as {want!r:.80}")
        header = {"t": "put", "sid": sid, "n": n, "ids": dids,
                  "v": [g.signed() for g in geo], "g": [g.group for g in geo], "tk": tk}
        pins = peer.pins_of(vals)

        def sent(nb: int | None) -> None:  # on the peer thread, once
            with self._qlock:
                sess.sends -= 1
                sess.pins = tuple(p for p in sess.pins if p is not pins)
                if nb is not None:
                    sess.peer_bytes[0] += nb

        assert self._peers is not None and ident is not None
        with self._qlock:
            sess.sends += 1
            sess.pins = (*sess.pins, pins)
        self._peers.submit(peer.Outgoing(dest, key, header, frames, nbytes, ident, h["rid"],
                                         timeout=min(float(to_s), self.peer_timeout),
                                         keep=vals, done=sent, session=sess.token))
        return None

    def _peer_put(self, sess: Session, h: dict[str, Any], frames: list[zmq.Frame]
                  ) -> dict[str, Any]:
        """Store a peer's values (fields and ticket checked on arrival, :meth:`_put_session`):
        every geometry checked against its bytes first; the session's quota applies. The answer
        tells the sender the bytes taken, nothing of the session's residency."""
        frames[:] = join_frames(frames, h.get("fc"))
        geo = peer.read_geometry(h.get("v"), h.get("g"), len(frames))
        vals = peer.read_values(geo, frames, self.device)
        added: list[int] = []
        try:
            for hid, v in zip(h["ids"], vals, strict=True):
                sess.put(hid, v)
                added.append(hid)
            self._check_quota(sess)
        except BaseException:
            for a in added:
                sess.drop(a)
            raise
        nb = sum(frame_view(f).nbytes for f in frames)
        sess.peer_bytes[1] += nb
        assert self._peers is not None
        self._peers.received_bytes += nb
        return {"t": "ok", "pb": nb}

    def _hello(self, h: dict[str, Any]) -> dict[str, Any]:
        if h.get("v") != PROTOCOL_VERSION:
            raise _Refused("protocol", f"protocol version {h.get('v')!r}; this server speaks "
                                       f"{PROTOCOL_VERSION}; install matching Genie versions")
        with self._lock:
            if len(self.sessions) >= self.max_sessions:
                raise _Refused("busy", f"the server already has {self.max_sessions} sessions")
            tok = secrets.token_bytes(16)
            self.sessions[tok] = Session(tok, self.quota)
            self._meter.bind(tok, h.get("_p"), alive=self.sessions)
        logger.info("genie-server: session %s opened", tok.hex()[:8])
        return {"t": "ok", "session": tok, "device": str(self.device), "lease": self.lease,
                "quota": self.quota, "torch": torch.__version__, "res": [0, 0]}

    def _run(self, sess: Session, h: dict[str, Any], frames: list[zmq.Frame]
             ) -> tuple[dict[str, Any], list]:
        started = time.monotonic()
        key = h.get("k")
        id0 = h.get("id0")
        if not isinstance(key, bytes) or len(key) != 16 or type(id0) is not int or id0 < 0:
            raise ProtocolError("a run request needs 'k' (16 bytes) and 'id0' (int)")
        frames[:] = join_frames(frames, h.get("fc"))  # in place: the chunks go at once
        entry = sess.skeletons.get(key)
        if "sk" in h:
            entry = self._add_skeleton(sess, key, h["sk"])
        if entry is None:
            return {"t": "miss"}, []
        sess.skeletons.move_to_end(key)
        c = entry[0]
        consts = h.get("c")
        if consts is None:
            d = h.get("d")
            if c.consts is None or not isinstance(d, list) or len(d) % 2:
                return {"t": "miss"}, []
            consts = list(c.consts)
            for i in range(0, len(d), 2):
                p = d[i]
                if type(p) is not int or not 0 <= p < len(consts):
                    raise ProtocolError(f"bad constant position {p!r}")
                consts[p] = d[i + 1]
        if not isinstance(consts, list) or len(consts) != c.n_consts:
            c.consts = None
            raise ProtocolError(f"the skeleton takes {c.n_consts} constants")
        c.consts = consts
        dev = self.device
        in_slots = set(c.inputs)
        new_ids = _new_ids(h.get("ids"), id0, sum(1 for s in c.keep if s not in in_slots))
        hints = _hints(h.get("ev"))
        ph = h.get("ph", 0)
        if ph not in (0, 1):
            raise ProtocolError(f"'ph' (the tape is a decode step) must be 0 or 1, got {ph!r:.40}")
        sess.decoding = ph == 1
        sess.tick += 1
        protect: set[int] = set()
        added: list[int] = []
        try:
            inputs: dict[int, Any] = {}
            for s, v in zip(c.inputs, consts, strict=False):  # inputs come first
                if type(v) is int:
                    t = sess.store.get(v)
                    if t is None:
                        raise _Refused("protocol", f"no tensor with handle id {v} in this session"
                                                   " (freed, or never created)")
                    protect.add(v)
                    sess.used_at[v] = sess.tick
                elif type(v) is InputUpload:
                    if v.ref.index >= len(frames):
                        raise ProtocolError(f"tensor frame {v.ref.index} is missing")
                    t = _device_value(frame_tensor(frames[v.ref.index], v.ref, copy=False), dev)
                    sess.put(v.hid, t)
                    added.append(v.hid)
                    protect.add(v.hid)
                else:
                    raise ProtocolError(f"bad input {v!r:.60}")
                inputs[s] = t
            if hints:  # every hinted id must be the session's: held, made or freed by this
                made = set(new_ids) | set(added)  # request (a hint races its value's free)
                freed = set(_id_list(h.get("free")))
                bad = [hid for hid, _ in hints
                       if hid not in made and hid not in sess.store and hid not in freed]
                if bad:
                    raise ProtocolError(f"residency hints name handle ids {bad[:8]} that this "
                                        "session neither holds nor creates (nor frees) in this "
                                        "request; a hint may only name the session's own values")
                _apply_hints(sess, [(i, c) for i, c in hints if i not in made])  # held now
            self._check_quota(sess, protect)
            inputs_before = set(inputs)
            tape = fill(c, consts, frames, inputs, upload=lambda t: _device_value(t, dev))
            # uploads inside the tape are inputs now, not yet counted in the session
            uploaded = sum(t.untyped_storage().nbytes() for sl, t in tape.inputs.items()
                           if sl not in inputs_before)
            ix = IndexCheck(tape, self.index_check) if self.index_check else None
            try:
                kept = run_guarded(tape, dev, sess.quota - sess.used() - uploaded,
                                   started + self.max_run_seconds, self.max_run_seconds, ix)
            except QuotaError as e:
                if not e.ran:  # nothing ran: evicting hinted values lets it run as sent
                    self._pressure(sess, e.need - e.budget, protect)
                raise _Refused("quota", f"{e}{self._by_role(sess)}") from None
            except RunTimeout as e:
                raise _Refused("timeout", str(e)) from None
            except ExecutionError as e:
                for a in added:
                    sess.drop(a)
                cause = e.__cause__ or e
                # the skeleton's instruction index (fill turned its uploads into inputs)
                ran = [i for i, t in enumerate(c.templates) if t.op != UPLOAD]
                i = ran[e.index] if e.index is not None and e.index < len(ran) else -1
                return {"t": "err", "kind": "exec", "etype": type(cause).__name__,
                        "msg": str(cause), "i": i, **_index_counts(ix)}, []
            sess.refresh(tape.inputs.values())  # resize_ of a resident tensor grows it
            new = iter(new_ids)
            for s in c.keep:
                if s not in in_slots:
                    hid = next(new)
                    sess.put(hid, kept[s])
                    added.append(hid)
            self._check_quota(sess)
        except BaseException:
            for a in added:
                sess.drop(a)
            raise
        _apply_hints(sess, hints)  # the values this request made too, now that they exist
        reply, rframes = _outputs([kept[s] for s in c.outputs])
        reply["res"] = sess.residency()
        reply.update(_index_counts(ix))
        return reply, rframes

    def _add_skeleton(self, sess: Session, key: bytes, sk: Any) -> tuple[Compiled, int]:
        """Compile and cache a skeleton under the hash of its bytes, within the session's
        skeleton share of the quota (least recently used ones evicted; the client resends)."""
        if not isinstance(sk, bytes):
            raise ProtocolError("'sk' must be bytes")
        if hashlib.blake2b(sk, digest_size=16).digest() != key:
            raise ProtocolError("the skeleton's key is not the BLAKE2b-128 hash of its "
                                "bytes; the server caches skeletons by their hash")
        cost = len(sk) * SKELETON_COST
        cap = int(sess.quota * SKELETON_SHARE)
        if cost > cap:
            raise _Refused("quota", f"a tape skeleton of {len(sk)} bytes (~{cost} bytes "
                                    f"compiled) passes the session's skeleton share of the "
                                    f"quota ({cap} bytes); materialize smaller pieces")
        old = sess.skeletons.pop(key, None)
        if old is not None:
            sess.skel_bytes -= old[1]
        while sess.skeletons and (sess.skel_bytes + cost > cap or
                                  len(sess.skeletons) >= SKELETON_CACHE):
            _, (_, n) = sess.skeletons.popitem(last=False)
            sess.skel_bytes -= n
        entry = (compile_skeleton(sk), cost)
        sess.skeletons[key] = entry
        sess.skel_bytes += cost
        return entry

    def _check_quota(self, sess: Session, protect: set[int] | None = None) -> None:
        if sess.used() > sess.quota:
            if protect is not None:
                self._pressure(sess, sess.used() - sess.quota, protect)
            raise _Refused("quota", f"the session would hold {sess.nbytes} bytes on "
                                    f"{self.device} (and {sess.skel_bytes} bytes of cached "
                                    f"tapes); its quota is {sess.quota} bytes (server "
                                    "flag --quota). Free tensors (del) or raise the quota."
                                    f"{self._by_role(sess)}")

    def _pressure(self, sess: Session, need: int, protect: set[int]) -> None:
        """Raise a ``pressure`` refusal naming the values whose eviction frees ``need`` bytes,
        if hinted values can; return when they cannot (the caller refuses with ``quota``)."""
        victims = sess.victims(need, protect, int(sess.quota * EVICT_SLACK))
        if victims:
            raise _Refused("pressure", f"the request needs {need} more bytes than the session's "
                                       f"quota of {sess.quota} leaves; evict {len(victims)} "
                                       "values and send it again", need=need, victims=victims)

    @staticmethod
    def _by_role(sess: Session) -> str:
        roles = sess.by_role()
        if not roles:
            return ""
        what = ", ".join(f"{r} {n} values ({b} bytes)" for r, (n, b) in sorted(roles.items()))
        return (f". Resident by role: {what}; only hinted values (activations first) can be "
                "evicted, never the tape's own inputs, nor weights and KV caches while "
                "decoding")


@contextlib.contextmanager
def _on_stream(st: Any) -> Any:
    """Run a request on CUDA stream ``st``; its work is finished when the request is."""
    with torch.cuda.stream(st):
        yield
    st.synchronize()


_CHECKS = {"all": "on", "cpu": "on for the CPU kernels that do not check", None: "off"}


def _index_counts(ix: IndexCheck | None) -> dict[str, Any]:
    """A run reply's ``ix``: the index tensors the run checked, its syncs and the instructions
    it refused (when it checked any)."""
    return {"ix": [ix.tensors, ix.syncs, ix.refused]} if ix is not None and \
        (ix.tensors or ix.refused) else {}


def _new_ids(ids: Any, id0: int, n: int) -> list[int]:
    """Handle ids for a run's ``n`` new kept values: ``id0, id0 + 1, ...``, or the explicit
    list ``ids`` (a restore puts values back under the ids they had)."""
    if ids is None:
        return list(range(id0, id0 + n))
    if not isinstance(ids, list) or len(ids) != n or \
            not all(type(i) is int and i >= 0 for i in ids) or len(set(ids)) != n:
        raise ProtocolError(f"'ids' must list {n} distinct non-negative handle ids (one per new "
                            f"kept value), got {ids!r:.80}")
    return ids


def _apply_hints(sess: Session, hints: list[tuple[int, int]]) -> None:
    """Record role hints on the session's held values, only ever more evictable (a lower
    code); ids the session does not hold are skipped (validated before)."""
    for hid, code in hints:
        if hid in sess.store:
            old = sess.roles.get(hid)
            if old is None or code < old:
                sess.roles[hid] = code


def _hints(ev: Any) -> list[tuple[int, int]]:
    """Residency hints ``[hid, role code, ...]`` as pairs; ProtocolError when malformed."""
    if ev is None:
        return []
    if not isinstance(ev, list) or len(ev) % 2 or len(ev) > 2 * MAX_HINTS:
        raise ProtocolError(f"residency hints ('ev') must be a flat list of at most {MAX_HINTS} "
                            "[handle id, role code] pairs")
    out = []
    for i in range(0, len(ev), 2):
        hid, code = ev[i], ev[i + 1]
        if type(hid) is not int or hid < 0 or type(code) is not int or \
                not 0 <= code < len(ROLES):
            raise ProtocolError(f"bad residency hint [{hid!r:.20}, {code!r:.20}]: a handle id "
                                f"(int >= 0) and a role code 0..{len(ROLES) - 1} "
                                f"({', '.join(ROLES)})")
        out.append((hid, code))
    return out


def _id_list(x: Any) -> list[int]:
    if x is None:
        return []
    if not isinstance(x, list):
        raise ProtocolError("a handle id list must be a list")
    return [i for i in x if type(i) is int]


def _device_value(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """An uploaded frame's tensor as the session's value: moved to ``dev``, or on the CPU the
    frame's memory itself when it is :data:`ALIGN`-aligned (else an aligned copy)."""
    if dev.type != "cpu":
        return t.to(dev)
    return t if t.data_ptr() % ALIGN == 0 else t.clone(memory_format=torch.preserve_format)


def _outputs(vals: list[torch.Tensor]) -> tuple[dict[str, Any], list[Any]]:
    metas, frames = [], []
    for v in vals:
        if not isinstance(v, torch.Tensor):
            raise _Refused("internal", f"an output is a {type(v).__name__}, not a tensor")
        buf, meta = tensor_frame(v)
        metas.append(meta)
        frames.append(buf)
    return {"t": "ok", "o": metas}, frames


# --- keys ---------------------------------------------------------------------------------------

def ensure_keys(keys_dir: Path) -> tuple[bytes, bytes, Path]:
    """The server's CURVE key pair and the directory of authorized client public keys (created
    on first use, with one authorized client pair for the connection file, and the peer pair
    of :mod:`genie.remote.keys`). A directory others could write to, or a secret others could
    read, is refused with the ``chmod`` that fixes it (:func:`genie.remote.keys.check_modes`)."""
    import zmq.auth

    keys_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    keyring.check_modes(keys_dir)
    secret_file = keys_dir / "server.key_secret"
    if not secret_file.exists():
        old = os.umask(0o077)  # pyzmq writes the secret file world-readable otherwise
        try:
            zmq.auth.create_certificates(str(keys_dir), "server")
        finally:
            os.umask(old)
        os.chmod(secret_file, 0o600)
    pub, sec = zmq.auth.load_certificate(str(secret_file))
    authorized = keys_dir / "authorized"
    authorized.mkdir(exist_ok=True, mode=0o700)
    client_secret = keys_dir / "client.key_secret"
    if not client_secret.exists():
        cpub, csec = zmq.curve_keypair()
        _write_cert(client_secret, cpub, csec)
        _write_cert(authorized / "client.key", cpub, None)
    keyring.ensure_peer_pair(keys_dir)
    assert pub is not None and sec is not None
    return pub, sec, authorized


def _write_cert(path: Path, public: bytes, secret: bytes | None) -> None:
    lines = ["#   ZeroMQ CURVE certificate written by genie-server", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_connection_file(keys_dir: Path, address: str, server_public: str) -> Path:
    """The file a client passes as ``key_file``: address, server key, its own key pair."""
    import zmq.auth

    cpub, csec = zmq.auth.load_certificate(str(keys_dir / "client.key_secret"))
    assert cpub is not None and csec is not None
    path = keys_dir / "client.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"address": address, "server_public_key": server_public,
                   "client_public_key": cpub.decode(), "client_secret_key": csec.decode()},
                  f, indent=1)
    return path


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_quota(dev: torch.device) -> int:
    """80% of the device's memory (of physical RAM for the CPU)."""
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory * 0.8)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8)
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def parse_bytes(s: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = s.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def build_parser() -> argparse.ArgumentParser:
    """``genie-server``'s flags (``genie-pool`` passes the hardening ones to its members)."""
    p = argparse.ArgumentParser(prog="genie-server", description="Serve a real device to Genie "
                                "clients (remote_accelerator tensors run here).")
    p.add_argument("--device", default=None,
                   help="the device to serve: cpu, cuda or cuda:N (default: cuda:0 if present)")
    p.add_argument("--listen", default="127.0.0.1:5555",
                   help="HOST:PORT to bind (default 127.0.0.1:5555; port 0 picks a free one)")
    p.add_argument("--insecure", action="store_true",
                   help="plain TCP without authentication or encryption (local experiments)")
    p.add_argument("--keys", default=None, help="directory of CURVE keys (default "
                   "$GENIE_KEYS_DIR or ~/.config/genie/server); created on first start")
    p.add_argument("--lease", type=float, default=60.0,
                   help="seconds without a message after which a session is freed (default 60)")
    p.add_argument("--quota", type=parse_bytes, default=None,
                   help="memory quota per session, e.g. 8GiB (default 80%% of the device)")
    p.add_argument("--max-message", type=parse_bytes, default=8 << 30,
                   help="largest accepted message frame (default 8GiB)")
    p.add_argument("--max-sessions", type=int, default=64)
    p.add_argument("--max-run-seconds", type=float, default=MAX_RUN_SECONDS,
                   help="a tape running longer is stopped between two instructions and its "
                   f"client told (default {MAX_RUN_SECONDS:g})")
    p.add_argument("--workers", type=int, default=4,
                   help="threads that run requests; sessions take turns, one session's "
                   "requests run in order (default 4)")
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op CPU threads (torch.set_num_threads; default: torch's choice)")
    p.add_argument("--peers", default=None,
                   help="the pool members this server may send values to (server-to-server "
                   "transfers): tcp://HOST:PORT,... (served with this server's own key), or a "
                   "JSON peers or pool file, read again when it changes; default: none (every "
                   "send refused)")
    p.add_argument("--peer-keys", default=None,
                   help="the key pair this server authenticates with to its peers: a "
                   "certificate with its secret key, or a connection file's client pair "
                   "(default: peer.key_secret of --keys, which the members of a pool share)")
    p.add_argument("--peer-timeout", type=float, default=30.0,
                   help="seconds of a peer's silence after which a transfer to it fails "
                   "(default 30)")
    p.add_argument("--index-check", default=os.environ.get("GENIE_SERVER_INDEX_CHECK", "auto"),
                   help="check the index arguments of indexing ops (gather, embedding, ...) "
                   "before their kernels run: auto (on CUDA, where an out-of-range index is a "
                   "device-side assert that breaks the server for every session, every op; on "
                   "a CPU the ops whose kernels do not bound their indices), 1 (every op), 0 "
                   "(a trusted single-tenant server); default $GENIE_SERVER_INDEX_CHECK or auto")
    p.add_argument("--log-level", default=os.environ.get("GENIE_LOG_LEVEL", "INFO"))
    return p


def server_from_args(a: argparse.Namespace) -> Server:
    """The :class:`Server` that parsed flags describe (``--threads`` applied to the process)."""
    device = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    return Server(device, a.listen, insecure=a.insecure, keys_dir=a.keys, lease=a.lease,
                  quota=a.quota, max_message=a.max_message, max_sessions=a.max_sessions,
                  workers=a.workers, max_run_seconds=a.max_run_seconds,
                  peer_keys=a.peer_keys, peer_timeout=a.peer_timeout,
                  index_check=a.index_check, peers=a.peers)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``genie-server`` and ``python -m genie.remote.server``."""
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    # the server runs tapes itself: never forward them to another server
    os.environ.pop("GENIE_SERVER", None)
    backends.set_backends([n for n in backends.backend_order() if n != "remote"])
    server = server_from_args(a)
    server.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    print(server.banner(), flush=True)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
