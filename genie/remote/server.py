"""``genie-server``: owns one real device and runs clients' tapes on it, one process per session.

Usage::

    genie-server --device cuda:0 --listen 127.0.0.1:5555      # prints how clients connect
    python -m genie.remote.server --device cpu --listen 127.0.0.1:0 --insecure

Structure: this process is the *front*. It owns the ZeroMQ ROUTER socket that clients connect
to, authenticates them (CURVE), decodes headers, checks admission (sizes, queued bytes against
the session's quota, a peer ``put``'s ticket), answers pings, tells clients whose requests wait
or run that the server is alive (``busy``, twice a second), expires sessions whose lease ran out,
cancels the queued requests of clients that disconnect, makes server-to-server transfers
(:mod:`genie.remote.peer`) and routes everything else to the session's *worker*. It never holds
a session's tensors and never runs a kernel.

Each session lives in a worker process of its own (:mod:`genie.remote.worker`), forked from a
zygote on ``hello`` and sandboxed: its resident tensors, its cached skeletons and its kernels are
in its own address space, with the OS bounding its memory, no network and no files. A kernel
that crashes or reads out of bounds costs that session only: the worker dies or reads its own
memory, its client gets a clear error (kind ``session``), every other session goes on. A
session's requests run in its worker one at a time, in order; sessions run side by side, as the
OS schedules their processes (``--workers N`` caps how many run at once). A request that runs
past ``--max-run-seconds`` is stopped by its worker between two instructions (the session
survives); one that is still running :data:`HARD_GRACE` later (a single long kernel) is stopped
by killing the worker (the session ends, its client is told).

Sessions: ``hello`` opens one and returns an unguessable token that every later request carries;
a session's handles are reachable only with its token. A session ends on ``bye``, when no message
came for ``lease`` seconds, or when its worker dies. Its memory quota (``--quota``) covers the
bytes of the distinct storages it holds (followed through resizes), a fixed cost per handle, its
cached skeletons, the bytes of its queued messages (counted here before a message is accepted)
and, while a tape runs, the tape's peak working set (vetted on meta tensors before anything
runs, see :mod:`genie.remote.guard`); a request that would pass it is refused and undone.

Residency under memory pressure: a run request may carry *hints* that mark the session's own
values evictable; the worker answers ``pressure`` with victims when a tape would pass the quota
(see :class:`genie.remote.worker.Session`).

Security: CURVE (authentication and encryption) by default, with keys under ``--keys``
(generated on first start: the server's pair, and one client pair written to a connection file
that clients pass as ``key_file``). ``--insecure`` serves plain TCP for local experiments.
Every message is checked (sizes, types, slots, handle ids, the op allowlist of
:mod:`genie.remote.allowlist`); a bad one gets an error reply and changes nothing. The threat
model (what a key holder can and cannot do) is in docs/deployment.md.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import ipaddress
import json
import logging
import logging.handlers
import os
import queue
import secrets
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..index_check import server_scope as index_check_scope
from . import ProtocolError, peer
from . import keys as keyring
from . import logbudget
from .protocol import PROTOCOL_VERSION, REQUESTS, pack, unpack
from .sched import LoadMeter
from .wire import SRCFD, Channel, MAX_PARTS, channel_limit, read_status, readable, recv_parts, \
    send_parts
from .worker import TEST_KERNELS_ENV, Config

logger = logging.getLogger("genie.server")

MAX_FRAMES = 1 << 16
MAX_QUEUE = 1024
#: requests one session may have queued (beyond them: a "busy" refusal)
MAX_QUEUED_PER_SESSION = 64
#: why sessions whose workers died ended, kept for their clients' next request (the latest)
MAX_ENDED = 256
#: the largest ``hello`` (no session yet, so nothing to count it against)
MAX_HELLO_BYTES = 64 << 10
#: default of ``--max-run-seconds``
MAX_RUN_SECONDS = 300.0
#: a request still running this long past ``--max-run-seconds`` (plus the same share of it) is
#: stopped by killing its worker: a single kernel that does not return
HARD_GRACE = 1.0
#: seconds between "busy" notes to clients whose requests wait or run (their timeout counts
#: server silence, so it must be larger than this)
KEEPALIVE = 0.25
#: seconds a new session's worker may take to start
SPAWN_TIMEOUT = 30.0
#: seconds the zygote may take to import torch and Genie and warm up, at the server's start
ZYGOTE_TIMEOUT = 120.0


def _to_regular_file(fd: int) -> bool:
    """Whether ``fd`` is open on a regular file (what a sandboxed worker cannot write)."""
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False


def _relay(src: int, dst: int) -> None:
    """Copy what the zygote and its workers write (``src``, a pipe) into ``dst`` until every
    writer has exited."""
    with contextlib.suppress(OSError):
        while data := os.read(src, 1 << 16):
            while data:
                data = data[os.write(dst, data):]
    os.close(src)


@dataclass
class Link:
    """The front's side of one session: its worker's channel and process, its queue, and what
    the worker last reported (``used`` bytes against the quota, residency, peer bytes)."""

    token: bytes
    sock: Channel
    quota: int
    pid: int = 0
    ready: bool = False
    hello: tuple[bytes, int] | None = None  # the hello waiting for the worker to start
    born: float = field(default_factory=time.monotonic)
    # requests waiting: (ident or None, frames to forward, rid, bytes, kind)
    pending: collections.deque[tuple[bytes | None, list[Any], int, int, str]] = field(
        default_factory=collections.deque)
    cur: tuple[bytes | None, int, int, str, float] | None = None  # ident, rid, bytes, kind, t0
    queued: int = 0  # bytes of requests waiting or running
    nqueued: int = 0
    used: int = 0
    res: list[int] = field(default_factory=lambda: [0, 0])
    pb: list[int] = field(default_factory=lambda: [0, 0])
    put_nonce: int = 0
    sends: int = 0  # transfers under way (the peer thread holds their bytes)
    pinned: int = 0  # bytes those transfers hold here, counted against the quota
    last_seen: float = field(default_factory=time.monotonic)
    killed: str | None = None  # why the front killed the worker (a deadline)
    answered: bool = False  # the running request's client has its reply (an early reply)
    # the next request went to the worker while the rest of an early-answered run may still
    # run (its reply, or a late word that the run is done, says it is over)
    tail: bool = False
    send_to: dict[int, tuple[str, float]] = field(default_factory=dict)
    tenant: str = ""  # the client key that opened it: whose log budget its lines spend


#: poll event bits as plain ints: pyzmq's flag enums cost an enum object per operation (~2 us,
#: three on every wake of the serve loop; see genie.remote.wire)
_POLLOUT, _IN_OR_ERR = int(zmq.POLLOUT), int(zmq.POLLIN | zmq.POLLERR)


class Server:
    """A Genie server on one device. :meth:`start` binds; :meth:`serve` runs until stopped."""

    def __init__(self, device: str = "cpu", listen: str = "127.0.0.1:5555", *,
                 insecure: bool = False, keys_dir: str | None = None, lease: float = 60.0,
                 quota: int | None = None, max_message: int = 8 << 30,
                 max_sessions: int = 64, workers: int = 0,
                 max_run_seconds: float = MAX_RUN_SECONDS, peer_keys: str | None = None,
                 peer_timeout: float = 30.0, index_check: str | None = None,
                 threads: int = 0, peers: str | None = None) -> None:
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
        # a message larger than the quota can never be admitted: ZeroMQ drops it unread
        self.max_message = min(max_message, self.quota + (1 << 20))
        self.max_sessions = max_sessions
        self.max_run_seconds = max_run_seconds
        self.workers = max(0, workers)
        self.threads = threads
        self.address = ""
        self.key_file: Path | None = None
        self.links: dict[bytes, Link] = {}
        self._by_sock: dict[Any, Link] = {}
        self._by_pid: dict[int, Link] = {}
        self._running = 0
        self._answering: tuple[bytes | None, int] | None = None
        self._fd_ident: dict[int, bytes] = {}  # connection (fd) -> peer identity, to cancel
        self._inflight: dict[bytes, tuple[int, Any]] = {}
        self._from: list[Any] | None = None  # the client message being handled (_incoming)
        # why sessions whose workers died ended (token -> message), the latest MAX_ENDED
        self._ended: collections.OrderedDict[bytes, str] = collections.OrderedDict()
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
        self._qlock = threading.Lock()  # Link.sends / pb, shared with the peer thread
        self._zygote: subprocess.Popen | None = None
        self._ctl: socket.socket | None = None
        self._ctl_buf = b""
        self.test_kernels = os.environ.get(TEST_KERNELS_ENV) == "1"

    # --- setup ------------------------------------------------------------------------------
    def start(self) -> str:
        """Start the zygote, bind the socket (and start CURVE authentication); returns the
        address."""
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"genie-server: --listen wants HOST:PORT, got {self.listen!r}")
        self._start_zygote()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_message)
        self._sock.router_mandatory = False
        if not self.insecure:
            from zmq.auth.thread import ThreadAuthenticator

            pub, sec, _ = ensure_keys(self.keys_dir)
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
        return self.address

    def _start_zygote(self) -> None:
        """The process that forks session workers: a fresh interpreter (no thread pool, no CUDA
        context, no lock held by another thread), started once."""
        ours, theirs = socket.socketpair()
        cfg = Config(str(self.device), self.quota, self.max_run_seconds, self.index_check,
                     self.threads, self.test_kernels)
        env = dict(os.environ)
        env.pop("GENIE_SERVER", None)
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # genie is imported explicitly
        # CUDA must not be initialized in the zygote, or no forked worker can use it ("Cannot
        # re-initialize CUDA in forked subprocess"): torch.cuda.is_available() asks NVML instead
        # of the CUDA runtime (found on the first GPU run: every CUDA session failed to start)
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        # a worker cannot write a regular file (RLIMIT_FSIZE 0, worker.sandbox): where this
        # server's output goes to one (``genie-server ... > server.log 2>&1``), the zygote and its
        # workers write to a pipe this process copies into it, else their log (a failed request's
        # traceback) would be lost without a word. Their end never blocks: a line that finds the
        # pipe full (the file's disk stalled) is dropped, as the front drops its own
        relay = os.pipe() if _to_regular_file(2) else None
        if relay:
            os.set_blocking(relay[1], False)
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "genie.remote.worker", str(theirs.fileno()), cfg.to_json()],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
            stdout=relay and relay[1], stderr=relay and relay[1])
        theirs.close()
        if relay:
            os.close(relay[1])
            threading.Thread(target=_relay, args=(relay[0], 2), name="genie-worker-log",
                             daemon=True).start()
        self._ctl = ours
        # the banner says "serving" once sessions can start: wait for the zygote's warm-up
        ours.settimeout(ZYGOTE_TIMEOUT)
        try:
            first = ours.recv(4096)
        except OSError:
            first = b""
        ours.settimeout(None)
        if not first or b'"zygote"' not in first:
            self._zygote.kill()
            raise SystemExit("genie-server: the process that starts session workers did not "
                             f"come up within {ZYGOTE_TIMEOUT:g} s (see the log above)")

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
                f"one sandboxed process per session; lease {self.lease:g} s, quota "
                f"{self.quota} bytes per session, tapes stopped after "
                f"{self.max_run_seconds:g} s, index checks {_CHECKS[self.index_check]}"
                f"{'; TEST KERNELS ADMITTED (' + TEST_KERNELS_ENV + '=1)' if self.test_kernels else ''}"
                f"\n{how}")

    # --- the loop -------------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until :meth:`stop` (or SIGINT/SIGTERM via :func:`main`)."""
        self._poller = poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        assert self._ctl is not None
        poller.register(self._ctl.fileno(), zmq.POLLIN)
        last_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                for s, ev in events.items():
                    link = self._by_sock.get(s)
                    if link is not None:
                        if ev & _POLLOUT and link.sock.flush():
                            poller.register(s, zmq.POLLIN)  # all written: readable only
                        if not ev & _IN_OR_ERR:
                            continue
                        try:
                            self._from_worker(link)
                        except Exception as e:  # a worker is no more trusted than a client
                            logger.exception("genie-server: session %s: its worker sent what "
                                             "the front cannot read (%s)",
                                             link.token.hex()[:8], e)
                            with contextlib.suppress(OSError):
                                os.kill(link.pid, signal.SIGKILL)
                            if self._answering is not None and self._answering[0] is not None:
                                ident, rid = self._answering
                                self._inflight.pop(ident, None)
                                self._send_err(ident, rid, "session", "the session's worker "
                                               "sent a malformed reply; the session is gone")
                            self._answering = None
                            self._worker_died(link, None, None, f"sent a malformed reply ({e})")
                if self._replies in events:
                    for _ in range(256):
                        try:
                            parts = recv_parts(self._replies)
                        except zmq.Again:
                            break
                        self._inflight.pop(parts[0].bytes, None)
                        send_parts(self._sock, parts)
                        if not readable(self._replies):
                            break
                if self._sock in events:
                    for _ in range(256):
                        try:
                            parts = recv_parts(self._sock)
                        except zmq.Again:
                            break
                        try:
                            self._incoming(parts)
                        except Exception as e:  # never let one message stop the server
                            logger.exception("genie-server: dropped a message: %s", e)
                        if not readable(self._sock):
                            break
                    parts = None  # the last message is not held (uncounted) until the next
                if self._ctl.fileno() in events:
                    self._from_zygote()
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

    # --- clients -> front ---------------------------------------------------------------------
    def _incoming(self, parts: list[zmq.Frame]) -> None:
        self._from = parts  # whose log budget a refusal's line spends (_send_err)
        try:
            self._incoming_from(parts)
        finally:
            self._from = None

    def _incoming_from(self, parts: list[zmq.Frame]) -> None:
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
        kind = h["t"]
        principal = None
        if self._keyring is not None:  # puts from peer keys only, the rest from client keys
            principal = parts[1].get("User-Id")
            why = self._keyring.refusal(principal, kind)
            if why is not None:
                return self._send_err(ident, rid, "protocol", why)
        nbytes = sum(len(p) for p in parts[1:])
        if kind == "hello":
            if nbytes > MAX_HELLO_BYTES:
                return self._send_err(ident, rid, "protocol", f"a hello of {nbytes} bytes (at "
                                      f"most {MAX_HELLO_BYTES})")
            return self._hello(ident, rid, h, "" if principal is None else principal)
        try:
            if kind == "put":  # a peer's values: authorized by a ticket, not the session token
                link = self._put_link(h)
            else:
                token = h.get("s")
                link = self.links.get(token) if isinstance(token, bytes) else None  # type: ignore[assignment]
                if link is None:
                    return self._send_err(ident, rid, "session", self._unknown_session(token))
                if kind == "send":
                    self._check_send(h)
                    link.send_to[rid] = (h["to"], h.get("to_s", self.peer_timeout))
        except ProtocolError as e:
            return self._send_err(ident, rid, "protocol", str(e))
        except _Refused as e:
            return self._send_err(ident, rid, e.kind, str(e))
        link.last_seen = time.monotonic()
        if kind == "ping" and not h.get("free") and h.get("sync") != 1:
            return self._send(ident, self._pong(link, rid))  # (a sync waits for the worker)
        if sum(len(lk.pending) for lk in self.links.values()) > MAX_QUEUE:
            return self._send_err(ident, rid, "busy", "the server's queue is full; retry later")
        if link.nqueued >= MAX_QUEUED_PER_SESSION:
            return self._send_err(ident, rid, "busy", f"this session already has "
                                  f"{link.nqueued} requests queued; wait for answers")
        frees_only = kind in ("free", "ping", "bye") and nbytes <= MAX_HELLO_BYTES
        if not frees_only and link.queued + nbytes + link.used + link.pinned > link.quota:
            self._frees_of_refused(link, h)
            over = link.queued + nbytes + link.used + link.pinned - link.quota
            msg = (f"a message of {nbytes} bytes, with the session's {link.queued} queued bytes "
                   f"and {link.used} resident bytes, passes its quota of {link.quota} bytes "
                   "(server flag --quota); send less at once or free tensors")
            if kind in ("run", "put") and over <= link.res[1]:
                # evicting hinted values may make room: the client asks which first
                return self._send(ident, {"t": "err", "rid": rid, "kind": "quota",
                                          "msg": msg, "room": over})
            return self._send_err(ident, rid, "quota", msg)
        fwd = list(parts[1:])
        self._inflight[ident] = (rid, link.token)
        fd = parts[1].get(SRCFD)
        if fd >= 0:
            self._fd_ident[fd] = ident
        self._enqueue(link, ident, fwd, rid, nbytes, kind)

    def _enqueue(self, link: Link, ident: bytes | None, fwd: list[Any], rid: int, nbytes: int,
                 kind: str) -> None:
        link.pending.append((ident, fwd, rid, nbytes, kind))
        link.queued += nbytes
        link.nqueued += 1
        self._pump(link)

    def _frees_of_refused(self, link: Link, h: dict[str, Any]) -> None:
        """A message refused at the door for its size still frees what it names: its frees go
        to the session's worker on their own (no reply), ahead of anything it sends next."""
        frees = h.get("free")
        if not isinstance(frees, list) or not frees or link.nqueued >= MAX_QUEUED_PER_SESSION:
            return
        msg = pack({"t": "free", "rid": -1, "free": frees})
        self._enqueue(link, None, [msg], -1, len(msg), "free")

    def _pump(self, link: Link) -> None:
        """Forward the session's next request to its worker, if it is idle (and, with
        ``--workers N``, fewer than N sessions run), or answered early: the worker reads the
        request once the rest of that run is done, and the request's time runs from that run's
        start (its deadline covers both)."""
        if not link.ready or not link.pending:
            return
        t0 = time.monotonic()
        if link.cur is not None:
            if not link.answered:
                return
            t0 = link.cur[4]  # (the request takes over its slot of --workers)
            self._finished(link, link.cur)
            link.answered = False
            link.tail = True
        elif self.workers and self._running >= self.workers:
            return
        ident, fwd, rid, nbytes, kind = link.pending.popleft()
        link.cur = (ident, rid, nbytes, kind, t0)
        self._meter.begin(link.token, slot=link.token)
        self._running += 1
        if not link.sock.post(fwd):  # the rest goes when the worker's socket takes it
            self._poller.register(link.sock.fileno(), zmq.POLLIN | zmq.POLLOUT)

    def _pump_all(self) -> None:
        if self.workers:  # a slot freed: the sessions that wait take turns (oldest request first)
            waiting = sorted((lk for lk in self.links.values() if lk.pending and lk.cur is None),
                             key=lambda lk: lk.last_seen)
            for lk in waiting:
                self._pump(lk)

    def _pong(self, link: Link, rid: Any) -> dict[str, Any]:
        """A ping's answer: the session's residency, how busy the other sessions of the same
        client key kept the server (``ld``, :class:`~genie.remote.sched.LoadMeter`: nothing about
        other tenants) and its peer bytes sent, received."""
        with self._qlock:
            pb = list(link.pb)
        return {"t": "ok", "rid": rid, "res": link.res, "ld": self._meter.load(link.token),
                "pb": pb}

    def _hello(self, ident: bytes, rid: int, h: dict[str, Any], principal: str) -> None:
        if h.get("v") != PROTOCOL_VERSION:
            return self._send_err(ident, rid, "protocol", f"protocol version {h.get('v')!r}; "
                                  f"this server speaks {PROTOCOL_VERSION}; install matching "
                                  "Genie versions")
        if len(self.links) >= self.max_sessions:
            return self._send_err(ident, rid, "busy",
                                  f"the server already has {self.max_sessions} sessions")
        if self._zygote is None or self._zygote.poll() is not None:
            return self._send_err(ident, rid, "internal", "the server cannot start session "
                                  "workers (its zygote process died; see the server's log); "
                                  "restart genie-server")
        assert self._ctx is not None and self._ctl is not None
        tok = secrets.token_bytes(16)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        chan = Channel(ours, MAX_PARTS, channel_limit(self.quota))
        link = Link(tok, chan, self.quota, hello=(ident, rid), tenant=principal)
        self.links[tok] = link
        self._meter.bind(tok, principal, alive=self.links)  # whose load it may see
        self._by_sock[chan.fileno()] = link
        self._poller.register(chan.fileno(), zmq.POLLIN)
        self._inflight[ident] = (rid, tok)
        try:  # the worker's end goes with its spawn line (the zygote hands it to the worker)
            _send_line(self._ctl, {"spawn": tok.hex()}, theirs.fileno())
        finally:
            theirs.close()

    def _put_link(self, h: dict[str, Any]) -> Link:
        """The session a peer's ``put`` is for, once its fields and ticket are checked
        (:func:`genie.remote.peer.check_put`: the ticket signs everything the put acts on, and a
        put carries nothing else); :class:`_Refused` otherwise."""
        def token_of(sid: bytes) -> bytes | None:
            return next((t for t in self.links if peer.session_id(t) == sid), None)

        try:
            tok, n = peer.check_put(h, token_of)
        except ProtocolError as e:
            raise _Refused("protocol", str(e)) from None
        except LookupError as e:
            raise _Refused("session", str(e)) from None
        link = self.links.get(tok)
        if link is None:
            raise _Refused("session", "the destination session of this put does not exist "
                                      "(it expired or was closed)")
        if n <= link.put_nonce:
            raise _Refused("protocol", f"a put ticket used again (nonce {n}, last "
                                       f"{link.put_nonce})")
        link.put_nonce = n
        return link

    def _check_send(self, h: dict[str, Any]) -> None:
        """A ``send``'s fields the front acts on (the worker packs the values)."""
        ids, dids, dest = h.get("ids"), h.get("dids"), h.get("to")
        signed, to_s = h.get("o"), h.get("to_s", self.peer_timeout)
        if not isinstance(ids, list) or not 0 < len(ids) <= peer.MAX_VALUES or \
                not all(type(i) is int for i in ids) or not isinstance(dids, list) or \
                len(dids) != len(ids) or not isinstance(signed, list) or \
                len(signed) != len(ids):
            raise ProtocolError(f"a send needs 'ids', 'dids' and 'o' of one length (1 to "
                                f"{peer.MAX_VALUES})")
        if not isinstance(dest, str) or not peer.ADDRESS.fullmatch(dest):
            raise ProtocolError(f"a send's destination must be tcp://host:port, got {dest!r:.80}")
        sk = h.get("sk")  # an older client's destination key: checked, never used
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
        registered, _ = self.peers.lookup(dest)
        if not registered:  # never connect to a place a client names: one answer for all
            raise _Refused("peer", f"{dest} is not a member of this server's pool: a server "
                                   f"sends only to the peers registered with it (--peers; "
                                   f"{len(self.peers)} registered), whatever listens at an "
                                   "address a client names")

    # --- workers -> front -----------------------------------------------------------------------
    def _from_worker(self, link: Link) -> None:
        try:
            msgs = link.sock.take()  # (ProtocolError: the worker is killed)
        except EOFError:  # the worker closed its end: it is gone, or will be
            self._poller.unregister(link.sock.fileno())
            with contextlib.suppress(OSError):
                os.kill(link.pid, signal.SIGKILL)  # (the zygote reports its end)
            return
        for parts in msgs:
            if link.token not in self.links:
                return
            internal = read_status(parts[0])  # (ProtocolError: the worker is killed)
            if internal is None:  # its rarer messages: a msgpack map
                try:
                    internal = unpack(parts[0])
                except ProtocolError:
                    internal = {}
                if not isinstance(internal, dict):
                    internal = {}
            if "ready" in internal:
                link.ready = True
                if link.hello is not None:
                    ident, rid = link.hello
                    link.hello = None
                    self._inflight.pop(ident, None)
                    logger.info("genie-server: session %s opened (worker %s)",
                                link.token.hex()[:8], link.pid or internal["ready"],
                                extra={"tenant": link.tenant})
                    self._send(ident, {"t": "ok", "rid": rid, "session": link.token,
                                       "device": str(self.device), "lease": self.lease,
                                       "quota": self.quota, "torch": torch.__version__,
                                       "res": [0, 0]})
                self._pump(link)
                continue
            if link.tail:  # the request running came while the rest of an early-answered
                link.tail = False  # run may still have run: the worker's next word ends that
                fatal = internal.get("fatal")
                if isinstance(fatal, str):  # the rest failed: the waiting client learns why
                    self._worker_died(link, None, None, fatal=fatal[:2000])
                    continue
                if internal.get("done") == 1 and len(parts) == 1:  # (said before the request
                    self._took_status(link, internal)  # came; else its reply says it)
                    continue
            if internal.get("early") == 1:  # the values are final; the tape's rest still runs
                if link.cur is None or link.answered or len(parts) < 2:
                    continue  # (a worker answers a request once)
                link.answered = True
                u, res = internal.get("u"), internal.get("res")
                if type(u) is int:
                    link.used = u
                if _two_ints(res):
                    link.res = res
                ident = link.cur[0]
                if ident is not None:
                    self._inflight.pop(ident, None)
                    send_parts(self._sock, [ident, *parts[1:]])
                self._pump(link)  # (a request that came meanwhile goes now)
                continue
            cur, link.cur = link.cur, None
            if cur is None:
                continue
            if link.answered:  # the end of an answered run: the session is free again
                link.answered = False
                cur = (None, *cur[1:])  # (its client has the reply)
                fatal = internal.get("fatal")
                if isinstance(fatal, str):
                    link.cur = cur
                    self._worker_died(link, None, None, fatal=fatal[:2000])
                    continue
            self._answering = cur[0], cur[1]  # answered by the handler if the reply is bad
            ident, rid, nbytes, kind, _ = cur
            self._finished(link, cur)
            if len(parts) < 2 and ident is not None:
                raise ProtocolError("a reply without its header")
            self._took_status(link, internal)
            send = internal.get("send")
            if send is not None and ident is not None:
                self._peer_send(link, ident, rid, parts)
            elif ident is not None:
                self._inflight.pop(ident, None)
                if kind == "ping":  # the bytes this session's transfers sent are counted here
                    h = unpack(parts[1])
                    with self._qlock:
                        h["pb"] = list(link.pb)
                    parts = [parts[0], pack(h), *parts[2:]]
                send_parts(self._sock, [ident, *parts[1:]])
            self._answering = None
            if kind == "bye":
                self._end(link, "closed by its client")
                continue
            self._pump(link)
            self._pump_all()

    def _finished(self, link: Link, cur: tuple[Any, ...]) -> None:
        """The worker is done with request ``cur`` (its reply, or its rest after an early one):
        it leaves the session's running and queued counts."""
        self._meter.end(slot=link.token)
        self._running -= 1
        link.queued -= cur[2]
        link.nqueued -= 1

    def _took_status(self, link: Link, internal: dict[str, Any]) -> None:
        """What a worker's message says of its session: bytes used, residency, peer bytes."""
        u, res, pb = internal.get("u"), internal.get("res"), internal.get("pb")
        if type(u) is int:
            link.used = u
        if _two_ints(res):
            link.res = res
        if _two_ints(pb):
            with self._qlock:
                link.pb[1] = pb[1]

    def _peer_send(self, link: Link, ident: bytes, rid: int, parts: list[Any]) -> None:
        """Push the values a worker packed to the peer server (:mod:`genie.remote.peer`), with
        the key registered for that member of the pool; the peer thread answers the client once
        the peer has them. The bytes it holds meanwhile count against the session's quota."""
        header = unpack(parts[1])
        frames = list(parts[2:])
        nbytes = sum(len(f) for f in frames)
        # the request's own fields (validated on arrival): destination, timeout
        dest, to_s = link.send_to.pop(rid)
        registered, key = self.peers.lookup(dest)
        if not registered:  # the pool changed meanwhile
            self._inflight.pop(ident, None)
            return self._send_err(ident, rid, "peer", f"{dest} is no longer a member of this "
                                  "server's pool")
        if link.sends >= peer.MAX_PENDING:
            self._inflight.pop(ident, None)
            return self._send_err(ident, rid, "busy", f"this session already has {link.sends} "
                                  "transfers under way; wait for their answers")

        def sent(nb: int | None) -> None:  # on the peer thread, once
            with self._qlock:
                link.sends -= 1
                link.pinned -= nbytes
                if nb is not None:
                    link.pb[0] += nb

        assert self._peers is not None
        with self._qlock:
            link.sends += 1
            link.pinned += nbytes
        self._peers.submit(peer.Outgoing(dest, key, header, frames, nbytes, ident, rid,
                                         timeout=min(float(to_s), self.peer_timeout),
                                         keep=frames, done=sent, session=link.token))

    def _from_zygote(self) -> None:
        assert self._ctl is not None
        try:
            data = self._ctl.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            logger.error("genie-server: the zygote (the process that starts session workers) "
                         "exited; new sessions are refused")
            assert self._poller is not None
            self._poller.unregister(self._ctl.fileno())
            return
        self._ctl_buf += data
        while len(self._ctl_buf) >= 4:
            (n,) = struct.unpack_from("<I", self._ctl_buf)
            if len(self._ctl_buf) < 4 + n:
                return
            msg = json.loads(self._ctl_buf[4:4 + n])
            self._ctl_buf = self._ctl_buf[4 + n:]
            if "pid" in msg:
                link = self.links.get(bytes.fromhex(msg["token"]))
                if link is not None:
                    link.pid = msg["pid"]
                    self._by_pid[link.pid] = link
                else:  # the session ended before its worker started
                    with contextlib.suppress(OSError):
                        os.kill(msg["pid"], signal.SIGKILL)
            elif "dead" in msg:
                link = self._by_pid.pop(msg["dead"], None)
                if link is not None and link.token in self.links:
                    self._worker_died(link, msg.get("signal"), msg.get("code"))

    def _worker_died(self, link: Link, sig: int | None, code: int | None,
                     why: str | None = None, fatal: str | None = None) -> None:
        """A session's worker ended on its own (a crash) or was killed for a deadline, or
        reported ``fatal`` (the rest of a tape it had answered early failed): its client is
        told, the session is gone; no other session is touched."""
        if fatal is not None:
            kind, msg = "session", (
                f"the session ended: {fatal}; the session and its {link.res[0]} resident "
                "tensors are gone. Other sessions are not affected. Connect again and rerun; "
                "run the program eagerly on the CPU to find the failing op")
        elif link.killed is not None:
            kind, msg = "timeout", link.killed
        else:
            how = why or (f"killed by signal {signal.Signals(sig).name}" if sig else
                          f"exited with status {code}")
            what = f" while running a {link.cur[3]} request" if link.cur else ""
            kind, msg = "session", (
                f"the session's worker process {how}{what} (a kernel crashed or ran out of "
                f"memory); the session and its {link.res[0]} resident tensors are gone. Other "
                "sessions are not affected. Run the failing program eagerly on the CPU to find "
                "the op, or report it with the server's log")
        logger.warning("genie-server: session %s: %s", link.token.hex()[:8], msg,
                       extra={"tenant": link.tenant})
        self._ended[link.token] = msg  # told to the token's holder when it next asks
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)
        victims = [(p[0], p[2]) for p in link.pending]
        if link.cur is not None:
            victims.insert(0, (link.cur[0], link.cur[1]))
            self._meter.end(slot=link.token)
            self._running -= 1
            link.cur = None
        link.pending.clear()
        for ident, rid in victims:
            if ident is not None:
                self._inflight.pop(ident, None)
                self._send_err(ident, rid, kind, msg)
        if link.hello is not None:
            self._send_err(link.hello[0], link.hello[1], "internal",
                           f"the session's worker did not start ({msg})")
            link.hello = None
        self._end(link, None)
        self._pump_all()

    def _end(self, link: Link, why: str | None) -> None:
        """Close a session: its worker exits on the front's goodbye (or is killed)."""
        self.links.pop(link.token, None)
        self._by_sock.pop(link.sock.fileno(), None)
        if self._peers is not None and link.sends:
            self._peers.cancel(link.token)  # what its transfers hold goes too
        with contextlib.suppress(Exception):
            self._poller.unregister(link.sock.fileno())
        link.sock.close()  # the goodbye: the worker reads the end of its channel and exits
        if link.pid and link.pid in self._by_pid and not link.ready:
            with contextlib.suppress(OSError):
                os.kill(link.pid, signal.SIGKILL)
        if why is not None:
            logger.info("genie-server: session %s %s; freed %d tensors (%d bytes)",
                        link.token.hex()[:8], why, *link.res, extra={"tenant": link.tenant})

    # --- housekeeping -----------------------------------------------------------------------------
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
            n = 0
            for link in list(self.links.values()):
                if link.hello is not None and link.hello[0] == ident:  # nobody to answer
                    self._end(link, "closed: its client went away before it opened")
                    n += 1
                    continue
                keep = collections.deque()
                for item in link.pending:
                    if item[0] == ident:
                        link.queued -= item[3]
                        link.nqueued -= 1
                        n += 1
                    else:
                        keep.append(item)
                link.pending = keep
            if n:
                logger.info("genie-server: a client disconnected; %d queued request(s) "
                            "cancelled", n)

    def _unknown_session(self, token: Any = None) -> str:
        why = self._ended.get(token) if isinstance(token, bytes) else None
        if why is not None:  # its worker died with no request of its client waiting to hear it
            return f"this session does not exist on the server any more: {why}"
        return ("this session does not exist on the server (it was restarted, or the session "
                f"expired after {self.lease:g} s without a message, or its worker died); its "
                "tensors are gone")

    def _tick(self, now: float) -> None:
        for ident, (rid, _) in list(self._inflight.items()):
            self._send(ident, {"t": "busy", "rid": rid})
        hard = self.max_run_seconds * (1 + HARD_GRACE) + HARD_GRACE
        for link in list(self.links.values()):
            if link.cur is not None and link.killed is None and now - link.cur[4] > hard:
                what = f"a {link.cur[3]} request" if not link.tail else \
                    f"a run answered early and the {link.cur[3]} request after it"
                link.killed = (f"{what} ran {now - link.cur[4]:.1f} s, past the "
                               f"server's limit of {self.max_run_seconds:g} s (--max-run-seconds)"
                               " inside one kernel; the session's worker was stopped and the "
                               f"session's {link.res[0]} resident tensors are gone. Split the "
                               "work into smaller materializations")
                with contextlib.suppress(OSError):
                    os.kill(link.pid, signal.SIGKILL)
            elif not link.ready and now - link.born > SPAWN_TIMEOUT:
                self._worker_died(link, None, None)
            elif link.cur is None and not link.pending and link.ready and \
                    now - link.last_seen > self.lease:
                self._end(link, f"expired after {self.lease:g} s without a message")

    def _send(self, ident: bytes, h: dict[str, Any], frames: Any = ()) -> None:
        send_parts(self._sock, [ident, pack(h), *frames])

    def _send_err(self, ident: bytes, rid: int, kind: str, msg: str) -> None:
        logger.info("genie-server: refused a request (%s): %s", kind, msg,
                    extra={"tenant": self._tenant()})
        self._send(ident, {"t": "err", "rid": rid, "kind": kind, "msg": msg})

    def _tenant(self) -> str:
        """The client key of the message being handled: whose log budget a line about it spends
        (one budget for all without CURVE, where anyone may connect, and for what no client
        message caused)."""
        parts = self._from
        if parts is None or len(parts) < 2 or self._keyring is None:
            return ""
        try:
            return parts[1].get("User-Id")
        except (zmq.ZMQError, UnicodeDecodeError):
            return ""

    def _close(self) -> None:
        t0 = time.monotonic()
        for link in list(self.links.values()):
            self._end(link, "closed: the server stops")
        if self._ctl is not None:
            self._ctl.close()  # the zygote kills what is left and exits
        if self._peers is not None:
            self._peers.close()
        if self._zygote is not None:
            try:
                self._zygote.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
        self._mon.close(linger=0)
        for s in (self._replies, self._sock):
            s.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        assert self._ctx is not None
        self._ctx.term()
        logger.info("genie-server: stopped (%.1f s)", time.monotonic() - t0)


class _Refused(Exception):
    """A request the front refuses: ``kind`` goes to the client with the message."""

    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


def _two_ints(x: Any) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(type(v) is int for v in x)


def _send_line(s: socket.socket, obj: dict[str, Any], fd: int | None = None) -> None:
    data = json.dumps(obj).encode()
    msg = struct.pack("<I", len(data)) + data
    if fd is None:
        s.sendall(msg)
    else:  # (a short line: one sendmsg takes it whole)
        socket.send_fds(s, [msg], [fd])


_CHECKS = {"all": "on", "cpu": "on for the CPU kernels that do not check", None: "off"}


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
        keyring.write_cert(client_secret, cpub, csec)
        keyring.write_cert(authorized / "client.key", cpub, None)
    keyring.ensure_peer_pair(keys_dir)
    assert pub is not None and sec is not None
    return pub, sec, authorized


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
    p.add_argument("--workers", type=int, default=0,
                   help="at most this many sessions run a request at once, the others' "
                   "requests wait their turn (each session runs in its own process; default 0: "
                   "no cap, the OS shares the device's cores among them)")
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op CPU threads of each session's worker (torch.set_num_threads; "
                   "default: torch's choice)")
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
    """The :class:`Server` that parsed flags describe."""
    device = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    return Server(device, a.listen, insecure=a.insecure, keys_dir=a.keys, lease=a.lease,
                  quota=a.quota, max_message=a.max_message, max_sessions=a.max_sessions,
                  workers=a.workers, max_run_seconds=a.max_run_seconds,
                  peer_keys=a.peer_keys, peer_timeout=a.peer_timeout,
                  index_check=a.index_check, peers=a.peers, threads=a.threads)


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """Hands records to the log thread; when its queue is full (the log sink stalls: a pipe
    nobody reads, a slow disk, a tenant whose sessions die faster than lines are written) a
    record is dropped and counted, never waited for: the front's loop must not block on I/O."""

    dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            type(self).dropped += 1


def _log_off_the_loop(capacity: int = 10_000) -> None:
    """Route the root logger's records through a bounded queue to a thread that writes them."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    if not handlers:
        return
    q: queue.Queue[logging.LogRecord] = queue.Queue(capacity)
    for h in handlers:
        root.removeHandler(h)
    root.addHandler(_DroppingQueueHandler(q))
    listener = logging.handlers.QueueListener(q, *handlers, respect_handler_level=True)
    listener.start()
    atexit.register(listener.stop)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``genie-server`` and ``python -m genie.remote.server``."""
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    _log_off_the_loop()
    logbudget.install(keyed=True)
    os.environ.pop("GENIE_SERVER", None)  # the workers run tapes themselves
    server = server_from_args(a)
    # the banner waits for the process that starts session workers to import PyTorch and warm
    # up (seconds; tens on a loaded machine): say so at once, on stderr (stdout's first line
    # stays the banner that scripts read)
    print(f"genie-server: starting on {server.device}: warming up the process that starts session "
          "workers ...", file=sys.stderr, flush=True)
    server.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    print(server.banner(), flush=True)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
