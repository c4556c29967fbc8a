"""A session's worker: the sandboxed process that holds one session's tensors and runs its tapes.

``genie-server`` runs no client's kernel in its own process. Its front (:mod:`.server`)
authenticates, decodes headers and routes; each session lives in a process of its own, forked
from a *zygote* the front starts once (a fresh interpreter that imported torch and Genie and
never ran a kernel, so a fork is ~10 ms and inherits no thread pool, lock or CUDA context).

What a worker can reach: its session's store, compiled skeletons and accounting
(:class:`Session`), and its end of a Unix socket pair the front made for it (a
:class:`genie.remote.wire.Channel`; the front passes it through the zygote, so it has no name
in the file system). It has no listening socket, no other session's
memory, no peer links (the front sends a transfer's bytes), and it cannot create files
(``RLIMIT_FSIZE`` 0) or dump core. Where the kernel allows it (root, or unprivileged user
namespaces), it has no network at all: it is moved into a network namespace of its own with only
a loopback device. Its memory is bounded by the OS (``RLIMIT_DATA`` = what it had at fork plus
twice the session's quota plus :data:`DATA_SLACK`; on CUDA the caching allocator's per-process
fraction), so the quota holds where the accounting misses a transient (a meta-less kernel's
output, an ``mm`` temporary). A kernel that crashes, reads past its buffer or hangs costs this
process only: the front sees it die (the zygote reaps it and reports the signal), tells the
session's client, and every other session keeps its process, its values and its speed.

Protocol with the front (all messages multipart):

- front -> worker: ``[header, *frames]``, the client's header bytes and tensor frames as they
  came (a peer's ``put`` too, its ticket checked by the front).
- worker -> front: ``[status, header, *frames]``: ``status`` is a fixed-width part the front
  reads (:data:`genie.remote.wire.STATUS`: a reply, an early reply or the end of an answered run;
  bytes counted against the quota, residency, peer bytes), ``header`` and ``frames`` go to the
  requester unchanged. The rarer messages start with a msgpack map of the same fields instead
  (``u``, ``res``, ``pb``): for a ``send`` the worker answers ``[{..., "send": {...}}, b"",
  *value frames]`` (the front pushes them to the peer); a run whose rest failed after its early
  reply ends with ``[{..., "done": 1, "fatal": why}]``.
- On start the worker sends ``[{"ready": pid}]``. The front closing its end is the goodbye.

A worker's messages are bounded (:func:`genie.remote.wire.channel_limit`): the front reads no
more parts or bytes than that, and a worker whose message passes it is killed; the worker refuses
a reply whose values pass its session's quota (a ``get`` naming one value many times) rather than
send it.

Requests of one session run in order, one at a time (the front forwards the next when the last
is answered).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import hashlib
import json
import logging
import os
import resource
import select
import signal
import socket
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _C, backends, graphs, tape_io
from ..config import config as genie_config
from ..errors import ExecutionError
from ..index_check import IndexCheck, IndexOutOfRange
from ..memory import retain_host_memory, retain_limit
from . import ProtocolError, allowlist, compiler, logbudget, peer, wire
from ..backends import native_replay
from ..device import real_device
from ..meta import policy
from ..planner import Instr, Tape
from .guard import QuotaError, RunTimeout, run_guarded, vet_tape
from . import shape_class
from .shape_class import NotAClass, build, moved, shape_params
from .wire import DONE, EARLY, MAX_PARTS, REPLY, Channel, channel_limit, status
from .protocol import (
    _DTYPE_NAME,
    ALIGN,
    DECODE_PINNED,
    MAX_HINTS,
    ROLES,
    UPLOAD,
    Compiled,
    Filled,
    InputUpload,
    compile_skeleton,
    fill,
    frame_tensor,
    refill,
    frame_view,
    join_frames,
    pack,
    resolve_op,
    split_frames,
    tensor_frames,
    unpack,
)

logger = logging.getLogger("genie.server.worker")

SKELETON_CACHE = 256
#: cached skeletons of a session may take this share of its quota (least recently used evicted)
SKELETON_SHARE = 0.25
#: bytes a compiled skeleton is counted per byte of its packed form (measured: ~24x for a
#: 243-instruction MLP tape, tracemalloc)
SKELETON_COST = 32
#: bytes a compiled graph (genie::graph, sent as data) is counted per byte of its data: its
#: decoded modules and compiled kernels; graphs share the skeletons' share of the quota
GRAPH_COST = 64
#: graphs one request may carry
MAX_GRAPHS_PER_REQUEST = 64
#: under pressure, victims free the deficit plus this share of the quota (fewer pressure rounds)
EVICT_SLACK = 0.125
#: what a resident handle costs against the quota whatever its bytes (its tensor object, its
#: entries here): a million zero-byte handles are ~800 MB of the worker's memory, not nothing
HANDLE_COST = 1024
#: handles one session may hold
MAX_HANDLES = 1 << 18
#: bytes a worker may allocate beyond what it had at fork and twice its quota (the interpreter's
#: own growth: compiled skeletons' Python objects, allocator caches)
DATA_SLACK = 512 << 20
#: device bytes a CUDA worker's caching allocator may hold beyond twice its quota: the math
#: libraries' workspaces, which it allocates through that allocator (cuBLAS and cuBLASLt: 32 MiB
#: each on Hopper; a 600x600 matmul under a 16 MiB quota failed without it on the H200 run)
CUDA_SLACK = 96 << 20
#: a request's frees leave the session's store and accounting at once, but are deallocated after
#: its reply is sent (:meth:`Worker.after_reply`), off the request's critical path, when the
#: storages they leave hold at most this many bytes (and an eighth of the quota): a GPT-2 decode
#: step frees ~10-18 values a request, their deallocation ~15-30 us of the worker's time between
#: the request and its reply (session 48, load 7-8); a larger free is made at once (the OS bound
#: on the worker's memory leaves room for this much more)
FREES_LATER_MAX = 8 << 20
#: vetted (structure, shapes) and native programs a session keeps (cleared when full)
MAX_VETTED = 4096
MAX_PROGRAMS = 256
#: shape classes one structure may be given (each widens the last by what moved)
CLASS_TRIES = 3
#: longer tapes keep the concrete vet (a symbolic vet costs up to ~2 ms per instruction it runs
#: in the fake mode, inside the request's deadline when inline)
CLASS_MAX_INSTRS = 8192
#: a shape class build's first estimate of its cost (then measured), seconds per instruction;
#: ``GENIE_SERVER_CLASS_BUILD_COST`` sets it (0: a class at a structure's second clean vet).
#: Only builds made inline (``GENIE_SERVER_CLASS_BUILD=inline``) stall a request, so only they
#: wait until vetting has cost as much (ski rental); background builds start at once. (A GPT-2
#: 12x768 decode step: 0.24-0.44 ms per instruction, its repeated layers and its instructions
#: without a symbol not run in the fake mode, see ``shape_class._run``; ~2-3 ms before.)
BUILD_SECONDS_PER_INSTR = 0.0005
#: a background build (a forked child) that runs longer is stopped; its structure keeps the
#: concrete vet (and may try again, up to :data:`CLASS_TRIES`)
BUILD_SECONDS_MAX = 120.0
#: what a build's child may send back (a class is integers and two expressions)
BUILD_REPLY_MAX = 8 << 20
BUILD_MODES = ("background", "inline", "off")
#: background builds a worker runs at once where the machine has cores to spare (forked
#: children at the lowest priority; ``GENIE_SERVER_CLASS_BUILDS`` sets it): a build of a large
#: structure (seconds) does not hold back another's, e.g. a generate call's prefill (a new
#: prompt length each call) beside its decode step. With fewer than :data:`BUILD_SLOTS_CORES`
#: cores one: a second build there competes with the requests (a 2-core loopback measured the
#: first vetted steps of a 12x768 decode 1.78x eager with two against 1.45x with one)
BUILD_SLOTS = 2
BUILD_SLOTS_CORES = 4


def build_cost() -> float:
    """The first estimate of a class build's seconds per instruction (see above)."""
    v = os.environ.get("GENIE_SERVER_CLASS_BUILD_COST", "")
    try:
        return max(float(v), 0.0) if v else BUILD_SECONDS_PER_INSTR
    except ValueError:
        logger.warning("genie-server: GENIE_SERVER_CLASS_BUILD_COST=%r is not a number of "
                       "seconds; using %s", v, BUILD_SECONDS_PER_INSTR)
        return BUILD_SECONDS_PER_INSTR


def build_slots() -> int:
    """How many background class builds a worker runs at once (``GENIE_SERVER_CLASS_BUILDS``,
    1 to 8; by default :data:`BUILD_SLOTS` on a machine of :data:`BUILD_SLOTS_CORES` cores or
    more, else 1)."""
    v = os.environ.get("GENIE_SERVER_CLASS_BUILDS", "")
    if v:
        if v.isdigit() and 1 <= int(v) <= 8:
            return int(v)
        logger.warning("genie-server: GENIE_SERVER_CLASS_BUILDS=%r is not a number from 1 to 8; "
                       "using the default", v)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return BUILD_SLOTS if cores >= BUILD_SLOTS_CORES else 1


#: a background build's niceness above the worker's (``GENIE_SERVER_CLASS_BUILD_NICE``, 0 to
#: 19). 0: a build (~0.1-0.3 s of CPU for a GPT-2 step since ``shape_class._run`` reuses effects)
#: shares the CPU with its session's requests; at 19 (before), other niced work on a loaded
#: 2-core machine starved it: a 12x768 decode step's class took 5-60 s to arrive instead of
#: ~1-2 s, its steps vetted concretely meanwhile (docs/deployment.md, "Shape classes sooner")
BUILD_NICE = 0


def build_nice() -> int:
    """The niceness of a background build's child (see :data:`BUILD_NICE`)."""
    v = os.environ.get("GENIE_SERVER_CLASS_BUILD_NICE", "")
    if v:
        if v.isdigit() and int(v) <= 19:
            return int(v)
        logger.warning("genie-server: GENIE_SERVER_CLASS_BUILD_NICE=%r is not a number from 0 "
                       "to 19; using %d", v, BUILD_NICE)
    return BUILD_NICE


def build_mode() -> str:
    """How a worker builds shape classes (``GENIE_SERVER_CLASS_BUILD``): ``background`` (a
    forked child per build, the request path never waits; the default), ``inline`` (in the
    request that finds the class, ski rental: see :data:`BUILD_SECONDS_PER_INSTR`), ``off``."""
    v = os.environ.get("GENIE_SERVER_CLASS_BUILD", "") or "background"
    if v not in BUILD_MODES:
        logger.warning("genie-server: GENIE_SERVER_CLASS_BUILD=%r is not one of %s; using "
                       "background", v, ", ".join(BUILD_MODES))
        return "background"
    return v


#: a skeleton whose native lane passed this many requests in a row to the Python path (a
#: constant the lane does not patch changes every call, inputs that change layout) gets no lane
#: again: each pass costs the lane's build and a fill of the tape anew
LANE_MISSES = 8
#: lane outcomes (``genie._C._WorkerLane.step``'s codes) by name, for :attr:`Worker.lane_passes`
LANE_PASS = {1: "delta", 2: "constant", 3: "input", 4: "layout", 5: "shapes", 6: "budget",
             8: "quota"}
# kinds of a lane's constants (csrc/worker_replay.cpp, enum Kind)
_K_INPUT, _K_INT, _K_FLOAT, _K_SEED, _K_OFFSET, _K_FIXED, _K_BOOL = range(7)


def native_lanes() -> bool:
    """Whether a worker runs a vetted skeleton's steady requests in one native call
    (``GENIE_SERVER_NATIVE_LANE``, ``1`` by default; ``0``: every request on the Python path)."""
    v = os.environ.get("GENIE_SERVER_NATIVE_LANE", "") or "1"
    if v not in ("0", "1"):
        logger.warning("genie-server: GENIE_SERVER_NATIVE_LANE=%r is not 0 or 1; using 1", v)
        return True
    return v == "1"


def native_serve() -> bool:
    """Whether a lane's steady request is served whole natively, from its decoded header to its
    reply (``genie._C._WorkerLane.serve``: ``GENIE_SERVER_NATIVE_SERVE``, ``1`` by default;
    ``0``: :meth:`Worker._run_lane`'s Python around the lane's step, the reference)."""
    v = os.environ.get("GENIE_SERVER_NATIVE_SERVE", "") or "1"
    if v not in ("0", "1"):
        logger.warning("genie-server: GENIE_SERVER_NATIVE_SERVE=%r is not 0 or 1; using 1", v)
        return True
    return v == "1"


def native_replies() -> bool:
    """Whether a lane's reply is written in one native call (``genie._C._send_reply``:
    ``GENIE_SERVER_NATIVE_REPLY``, ``1`` by default; ``0``: by serve_session's Python path)."""
    v = os.environ.get("GENIE_SERVER_NATIVE_REPLY", "") or "1"
    if v not in ("0", "1"):
        logger.warning("genie-server: GENIE_SERVER_NATIVE_REPLY=%r is not 0 or 1; using 1", v)
        return True
    return v == "1"


#: what :meth:`Worker.handle` returns for a reply already written (``Worker.reply_native``)
SENT: dict[str, Any] = {"t": "sent"}


#: an early reply (:meth:`Worker._replay`) leaves at least this share of a tape's instructions
#: to run after it (less is not worth a second message to the front)
EARLY_MIN_TAIL = 0.2
#: outputs of at most this many bytes go back early (they are copied: the rest may free them)
EARLY_MAX_BYTES = 1 << 20
#: seconds a worker waits, once the rest of an early-answered run is done, for the session's
#: next request before it tells the front that the run is done (the front forwards the next
#: request while the rest runs, and its reply says so; a training loop's next step arrives
#: within ~1-3 ms of the loss). The session counts as running meanwhile
DONE_WAIT = 0.02


def early_replies() -> bool:
    """Whether a worker answers a replayed run as soon as its outputs are final, while the rest
    of the tape runs (``GENIE_SERVER_EARLY_REPLY``, ``1`` by default; ``0``: at the end)."""
    v = os.environ.get("GENIE_SERVER_EARLY_REPLY", "") or "1"
    if v not in ("0", "1"):
        logger.warning("genie-server: GENIE_SERVER_EARLY_REPLY=%r is not 0 or 1; using 1", v)
        return True
    return v == "1"


class ClassBuilds:
    """One of a worker's shape-class build slots (:data:`BUILD_SLOTS`): a build in a forked
    child of the worker (:func:`shape_class.build_spec`): the session's requests go on,
    concretely vetted, while the symbolic vet (~0.1-0.3 s of CPU for a GPT-2 step) runs beside
    them (at :data:`BUILD_NICE` above the worker). The child
    shares nothing it can change with the worker (a copy-on-write fork, killed with it) and
    sends back the class as data, which :func:`shape_class.from_spec` checks before compiling
    it; a child that fails, crashes, sends too much or runs past :data:`BUILD_SECONDS_MAX`
    costs its structure the class, nothing else."""

    def __init__(self) -> None:
        self.pid = 0
        self.fd = -1
        self.job: tuple[Any, tuple[int, ...], Any] | None = None  # (structure, ints, class)
        self.buf = bytearray()
        self.started = 0.0

    @property
    def busy(self) -> bool:
        return self.pid != 0

    def start(self, ck: Any, tape: Tape, ints: tuple[int, ...], pos: list[int],
              prev: tuple[int, ...], cls: Any) -> bool:
        if self.pid:
            return False
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError as e:
            os.close(r)
            os.close(w)
            logger.info("genie-server: no background class build (%s)", e)
            return False
        if pid == 0:  # the child: build, write, exit (no handler, no zmq, no atexit)
            # the worker's objects (~340k) are never collected here: a full collection of them
            # would copy every page they lie on (a GPT-2 prefill's build: 0.44 s of CPU and
            # 26k page faults with it, 0.23 s and 7.5k without); the build's own still are
            gc.freeze()
            code = 0
            try:
                os.close(r)
                die_with_parent()
                with contextlib.suppress(OSError):
                    os.nice(build_nice())
                try:
                    out = {"spec": shape_class.build_spec(tape, ints, pos, prev)}
                except NotAClass as e:
                    out = {"no": str(e)[:500]}
                except Exception as e:  # noqa: BLE001 - said to the worker, as why not
                    out = {"no": f"the build failed: {type(e).__name__}: {e}"[:500]}
                data = json.dumps(out).encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(w, view):]
            except BaseException:  # noqa: BLE001 - a child never returns into the worker
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        os.set_blocking(r, False)
        self.pid, self.fd, self.job = pid, r, (ck, ints, cls)
        self.buf = bytearray()
        self.started = time.monotonic()
        return True

    def poll(self) -> tuple[Any, tuple[int, ...], Any, Any] | None:
        """A finished build: ``(structure, ints, class before, spec or why not)``."""
        if not self.pid:
            return None
        why: Any = None
        while True:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                chunk = None
                break
            except OSError as e:
                why = f"its pipe failed ({e})"
                break
            if not chunk:
                break
            self.buf += chunk
            if len(self.buf) > BUILD_REPLY_MAX:
                why = f"it sent more than {BUILD_REPLY_MAX} bytes"
                break
        if why is None and chunk is None:  # still running
            if time.monotonic() - self.started <= BUILD_SECONDS_MAX:
                return None
            why = f"it ran past {BUILD_SECONDS_MAX:.0f} s"
        return self._finish(why)

    def _finish(self, why: Any) -> tuple[Any, tuple[int, ...], Any, Any]:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)  # (one that exited is a zombie: no effect)
        status = "status unknown"
        with contextlib.suppress(OSError):
            st = os.waitpid(self.pid, 0)[1]
            status = f"signal {os.WTERMSIG(st)}" if os.WIFSIGNALED(st) else \
                f"exit status {os.WEXITSTATUS(st)}"
        os.close(self.fd)
        job, data = self.job, bytes(self.buf)
        self.pid, self.fd, self.job, self.buf = 0, -1, None, bytearray()
        assert job is not None
        out: Any = why
        if why is None:
            try:
                got = json.loads(data)
                out = got["spec"] if "spec" in got else str(got["no"])
            except (ValueError, TypeError, KeyError) as e:
                out = (f"its process ended without a reply ({status})" if not data else
                       f"its reply did not parse ({type(e).__name__})")
        return (*job, out)

    def stop(self) -> None:
        if self.pid:
            self._finish("stopped")


#: the test-only kernels (a segfault, an out-of-bounds read) are registered in workers started
#: with this variable set to 1; never in production
TEST_KERNELS_ENV = "GENIE_SERVER_TEST_KERNELS"


class Refused(Exception):
    """A request the server refuses: ``kind`` goes to the client with the message."""

    def __init__(self, kind: str, msg: str, **extra: Any) -> None:
        super().__init__(msg)
        self.kind = kind
        self.extra = extra


@dataclass
class Session:
    """One client's state: resident tensors by handle id, compiled skeletons, accounting.

    Storages are keyed by their ``StorageImpl`` (``_cdata``), which a resize keeps (its data
    pointer changes); each entry is ``[tensors holding it, bytes counted]``. Every handle also
    costs :data:`HANDLE_COST` bytes.
    """

    token: bytes
    quota: int
    store: dict[int, torch.Tensor] = field(default_factory=dict)
    skeletons: collections.OrderedDict[bytes, tuple[Compiled, int]] = field(
        default_factory=collections.OrderedDict)
    storages: dict[int, list[int]] = field(default_factory=dict)
    nbytes: int = 0
    skel_bytes: int = 0
    # compiled graphs (genie::graph) by content key -> bytes counted, least recently used first
    graphs: collections.OrderedDict[str, int] = field(default_factory=collections.OrderedDict)
    peer_bytes: list[int] = field(default_factory=lambda: [0, 0])
    # residency: role code of hinted (evictable) handles, last use of each handle (a counter),
    # and whether the last tape was a decode step (its weights and KV caches stay)
    roles: dict[int, int] = field(default_factory=dict)
    used_at: dict[int, int] = field(default_factory=dict)
    tick: int = 0
    decoding: bool = False

    def put(self, hid: int, t: Any) -> None:
        if hid in self.store:
            raise Refused("protocol", f"handle id {hid} is already in use")
        if not isinstance(t, torch.Tensor):
            raise Refused("protocol", f"a kept value is a {type(t).__name__}, not a tensor")
        if len(self.store) >= MAX_HANDLES:
            raise Refused("quota", f"the session holds {len(self.store)} values, the most a "
                                   "session may hold; free tensors (del) first")
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

    def put_many(self, hids: list[int], ts: list[Any]) -> None:
        """:meth:`put` of a run's kept values, all or none, in one native pass over the
        session's dicts (``genie._C._put_handles``); anything :meth:`put` refuses is refused by
        it, naming the first value, with nothing put."""
        delta = _C._put_handles(self.store, self.storages, self.used_at, hids, ts, self.tick,
                                MAX_HANDLES)
        if delta is not None:
            self.nbytes += delta
            return
        done: list[int] = []  # one by one: :meth:`put` refuses what it refuses, naming it
        try:
            for hid, t in zip(hids, ts, strict=True):
                self.put(hid, t)
                done.append(hid)
        except BaseException:
            self.drop_many(done)
            raise

    def drop_many(self, hids: list[int], later: list[Any] | None = None) -> None:
        """:meth:`drop` of several ids (those not held are skipped), in one native pass over the
        session's dicts (``genie._C._drop_handles``). ``later``: the dropped values join it
        (uncounted at once, deallocated when the caller clears it) unless the storages they
        leave are over :data:`FREES_LATER_MAX` bytes."""
        if not hids:
            return
        held = list(map(self.store.get, hids)) if later is not None else None
        delta = _C._drop_handles(self.store, self.storages, self.roles, self.used_at, hids)
        self.nbytes += delta
        if held is not None and -delta <= min(FREES_LATER_MAX, self.quota // 8):
            later += held

    def refresh(self, tensors: Any) -> None:
        """Recount the storages of ``tensors`` (a tape may have resized them in place): natively,
        one pass (``genie._C._storages_grown``, csrc/session.cpp; a decode step's 173 inputs
        every request)."""
        self.nbytes += _C._storages_grown(tensors, self.storages)

    def used(self) -> int:
        """Bytes counted against the quota: resident storages, handles, cached skeletons."""
        return self.nbytes + self.skel_bytes + HANDLE_COST * len(self.store)

    def clear(self) -> None:
        self.store.clear()
        self.roles.clear()
        self.used_at.clear()
        self.storages.clear()
        self.skeletons.clear()
        for key in self.graphs:
            graphs.forget(key)
        self.graphs.clear()
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


@dataclass(frozen=True)
class Config:
    """What a worker needs of the server's flags (sent to the zygote as JSON at its start)."""

    device: str
    quota: int
    max_run_seconds: float
    index_check: str | None
    threads: int = 0
    test_kernels: bool = False

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def from_json(s: str) -> Config:
        return Config(**json.loads(s))


class Worker:
    """One session's request handler, in the session's own process."""

    def __init__(self, token: bytes, cfg: Config) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        graphs.check_calls = True  # a client's genie::graph_mut calls: each one's writes checked
        self.index_check = cfg.index_check
        self.sess = Session(token, cfg.quota)
        # vet once, replay natively (:meth:`_replay`): vetted peaks by structure and shapes,
        # native programs by structure and the constants they bake, structures with barriers
        self.vetted: dict[Any, int] = {}
        self.programs: dict[Any, Any] = {}
        self.barriers: set[bytes] = set()
        self.replays = 0
        self._guarded: tuple[Any, Any, Any] | None = None
        # shape classes by structure (False: none can be built), the integers of the last
        # vetted call of each structure, and how many classes each structure has been given
        self.classes: dict[Any, Any] = {}
        self.last_ints: dict[Any, tuple[int, ...]] = {}
        self.class_tries: dict[Any, int] = {}
        self.vets = 0  # concrete vets (guarded runs included)
        self.vet_seconds: dict[Any, float] = {}  # concrete vet time per structure since a build
        self.build_cost = build_cost()  # a class build's seconds per instruction (inline)
        self.build_mode = build_mode()
        self.builds = [ClassBuilds() for _ in range(build_slots())]
        self._next_build: tuple | None = None  # a build to start once the reply is out
        self._ix: IndexCheck | None = None  # the index check of the replay running
        self.refills = 0  # tapes patched from the last call's (protocol.refill)
        self.unindexed: set[bytes] = set()  # skeletons without an op the index check covers
        #: skeleton -> where its replays stop for the index check (IndexCheck.points)
        self.check_points: dict[bytes, tuple[list[int], list[int]]] = {}
        self.how = "guarded"  # how the last run was vetted: guarded, vetted, class, hit
        # early replies: where each program's outputs are final (native_replay.early_split),
        # the front's sender (set by serve_session), and whether this request was answered
        self.early = early_replies()
        self.splits: dict[Any, int] = {}
        self.answer: Any = None
        #: the early answer of ``vals`` written natively (serve_session): True when sent
        self.answer_native: Any = None
        self.answered = False
        #: a lane's reply of ``vals`` written natively (serve_session): True when sent, and
        #: then :data:`SENT` is what the request returns; the replies it wrote
        self.reply_native: Any = None
        self.native_replies = 0
        # a lane's steady request whole in one native call (:meth:`_serve`): on or off, the
        # channel it writes replies to (-1: none, the reply is Python's) and when the request
        # arrived (serve_session's clock, for the reply's ``st``)
        self.serve_native = native_serve()
        self.served = 0  # (the lane requests it served)
        self.reply_fd = -1
        self.t0 = 0.0
        #: values the last request freed, deallocated once its reply is out (FREES_LATER_MAX)
        self.freed: list[Any] = []
        # native lanes (:meth:`_run_lane`): on or off, the requests they ran, what they passed
        # to the Python path (by LANE_PASS name), and what the last replay found to build one
        self.lanes = native_lanes()
        self.lane_runs = 0
        self.lane_passes: collections.Counter[str] = collections.Counter()
        self._lane_src: tuple | None = None
        self._lane_outputs: list[int] = []

    # --- dispatch ---------------------------------------------------------------------------------
    def handle(self, h: dict[str, Any], frames: list[Any]
               ) -> tuple[dict[str, Any], list[Any], dict[str, Any] | None]:
        """``(reply, reply frames, send)``: ``send`` is a peer transfer for the front to make."""
        kind = h.get("t")
        if kind == "run" and self.serve_native and not frames:
            got = self._serve(h)
            if got is not None:
                return got
        sess = self.sess
        if self.freed:  # (a request that found no after_reply: a peer send's)
            self.freed.clear()
        sess.drop_many(_id_list(h.get("free")), self.freed)
        if kind == "free":
            sess.drop_many(_id_list(h.get("ids")))
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
                return {"t": "ok", "res": sess.residency(), "victims": victims or []}, [], None
            return {"t": "ok", "res": sess.residency()}, [], None
        if kind == "ping":
            return {"t": "ok", "res": sess.residency(), "pb": sess.peer_bytes}, [], None
        if kind == "send":
            return self._peer_send(h)
        if kind == "put":
            return self._peer_put(h, frames), [], None
        if kind == "bye":
            sess.clear()
            return {"t": "ok"}, [], None
        if kind == "get":
            vals = []
            for hid in _id_list(h.get("ids")):
                t = sess.store.get(hid)
                if t is None:
                    raise Refused("protocol", f"no tensor with handle id {hid} in this session")
                vals.append(t)
            reply, rframes = _outputs(vals, sess.quota)
            reply["res"] = sess.residency()
            return reply, rframes, None
        if kind == "run":
            reply, rframes = self._run(h, frames)
            return reply, rframes, None
        raise ProtocolError(f"a session does not take {kind!r:.40} requests")

    # --- peers ------------------------------------------------------------------------------------
    def _peer_send(self, h: dict[str, Any]) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
        """The values of a ``send`` packed for the peer (the front checked the header's shape and
        makes the transfer); the reply header is the ``put`` the front sends."""
        ids, signed = h.get("ids"), h.get("o")
        vals = []
        for i in ids:  # type: ignore[union-attr]
            t = self.sess.store.get(i)
            if t is None:
                raise Refused("protocol", f"no tensor with handle id {i} in this session")
            vals.append(t)
        geo, frames, nbytes = peer.pack_values(vals)
        for k, (g, want) in enumerate(zip(geo, signed, strict=True)):  # type: ignore[arg-type]
            if g.signed() != want:
                raise Refused("protocol", f"value {k} (handle {ids[k]}) is {g.signed()} on this "  # type: ignore[index]
                                          "server (dtype, shape, strides, storage offset, math "
                                          f"bits); the send describes it as {want!r:.80}")
        put = {"t": "put", "sid": h["sid"], "n": h["n"], "ids": h["dids"],
               "v": [g.signed() for g in geo], "g": [g.group for g in geo], "tk": h["tk"]}
        return put, frames, {"nbytes": nbytes}

    def _peer_put(self, h: dict[str, Any], frames: list[Any]) -> dict[str, Any]:
        """Store a peer's values (its ticket checked by the front): every geometry checked
        against its bytes first; the session's quota applies."""
        sess = self.sess
        frames[:] = join_frames(frames, h.get("fc"))
        ids = h.get("ids")
        geo = peer.read_geometry(h.get("v"), h.get("g"), len(frames))
        if not isinstance(ids, list) or len(ids) != len(geo):
            raise ProtocolError("a put needs one id per geometry")
        vals = peer.read_values(geo, frames, self.device)
        added: list[int] = []
        try:
            for hid, v in zip(ids, vals, strict=True):
                sess.put(hid, v)
                added.append(hid)
            self._check_quota()
        except BaseException:
            for a in added:
                sess.drop(a)
            raise
        nb = sum(frame_view(f).nbytes for f in frames)
        sess.peer_bytes[1] += nb
        return {"t": "ok", "pb": nb}  # the bytes taken, nothing of the session's residency

    # --- tapes --------------------------------------------------------------------------------
    def _serve(self, h: dict[str, Any]
               ) -> tuple[dict[str, Any], list[Any], dict[str, Any] | None] | None:
        """A steady run request of a skeleton with a lane, whole in one native call
        (``_WorkerLane.serve``, csrc/worker_replay.cpp): what :meth:`handle`, :meth:`_run` and
        :meth:`_run_lane` do for it, from the decoded header to the reply written to the front's
        channel, with the same checks. None, having changed nothing, when the request is not
        one the lane takes as sent (:meth:`handle` then runs it as any request)."""
        key = h.get("k")
        sess = self.sess
        entry = sess.skeletons.get(key) if type(key) is bytes else None
        if entry is None or not entry[0].lane:
            return None
        c = entry[0]
        self._take_builds()
        lane = c.lane  # (a class a build installed drops the lanes of its structure)
        if not lane:
            return None
        split = self.splits.get(c.lane_pkey, -1) if self.answer is not None else -1
        if self.freed:
            self.freed.clear()
        self._ix = None
        self._lane_outputs = c.outputs
        r = lane.serve(sess, h, self.freed, c.made, c.outputs, c.writes, split,
                       self._lane_early if split > 0 else None, self.reply_fd, self.t0,
                       _DTYPE_NAME, _SERVE_LIMITS)
        if r is None:
            return None
        sess.skeletons.move_to_end(key)
        if type(r) is int:  # the lane passed it (its frees dropped): the Python path runs it
            self.lane_passes[LANE_PASS.get(r, str(r))] += 1
            reply, rframes = self._run(h, [], passed=True)
            return reply, rframes, None
        c.lane_misses = 0
        self.how = "class" if lane.how else "hit"
        self.replays += 1
        self.lane_runs += 1
        self.served += 1
        stage, kept = r
        if stage == 2:
            self.native_replies += 1
            return SENT, [], None
        id0 = h["id0"]
        if stage == 0:
            reply, rframes = self._lane_post(c, lane, kept, _hints(h.get("ev")), id0,
                                             id0 + len(c.made))
        else:
            reply, rframes = self._lane_reply(kept, c.outputs)
        return reply, rframes, None

    def _run(self, h: dict[str, Any], frames: list[Any], passed: bool = False
             ) -> tuple[dict[str, Any], list]:
        """A run request on the Python path (``passed``: its lane ran it as far as a pass, in
        :meth:`_serve`, which counted the pass)."""
        sess = self.sess
        started = time.monotonic()
        key = h.get("k")
        id0 = h.get("id0")
        if not isinstance(key, bytes) or len(key) != 16 or type(id0) is not int or id0 < 0:
            raise ProtocolError("a run request needs 'k' (16 bytes) and 'id0' (int)")
        frames[:] = join_frames(frames, h.get("fc"))  # in place: the chunks go at once
        entry = sess.skeletons.get(key)
        if "sk" in h:
            entry = self._add_skeleton(key, h["sk"])
        if "g" in h:
            self._add_graphs(h["g"])
        if entry is None:
            return {"t": "miss"}, []
        sess.skeletons.move_to_end(key)
        c = entry[0]
        lane = c.lane
        if lane or passed:
            if not passed and "c" not in h and "ids" not in h and "sk" not in h and \
                    "g" not in h and not frames:
                got = self._run_lane(c, lane, key, h, id0)
                if got is not None:
                    c.lane_misses = 0
                    return got
            elif not passed:
                self.lane_passes["request"] += 1
            c.lane_misses += 1
            _drop_lane(c, c.lane_misses >= LANE_MISSES)
        self._lane_src = None
        consts = h.get("c")
        old = c.consts
        changed: list[int] | None = None  # the constants a delta changed (None: all sent)
        if consts is None:
            d = h.get("d")
            if old is None or not isinstance(d, list) or len(d) % 2:
                return {"t": "miss"}, []
            consts = list(old)
            changed = []
            for i in range(0, len(d), 2):
                p = d[i]
                if type(p) is not int or not 0 <= p < len(consts):
                    raise ProtocolError(f"bad constant position {p!r:.40}")
                consts[p] = d[i + 1]
                changed.append(p)
        if not isinstance(consts, list) or len(consts) != c.n_consts:
            c.consts = None
            c.filled = None
            raise ProtocolError(f"the skeleton takes {c.n_consts} constants")
        c.consts = consts
        dev = self.device
        new_ids = _new_ids(h.get("ids"), id0, len(c.made))
        hints = _hints(h.get("ev"))
        ph = h.get("ph", 0)
        if ph not in (0, 1):
            raise ProtocolError(f"'ph' (the tape is a decode step) must be 0 or 1, got {ph!r:.40}")
        sess.decoding = ph == 1
        sess.tick += 1
        protect: set[int] = set()
        added: list[int] = []
        ix = None
        try:
            inputs = self._held_inputs(c, consts, protect)
            if inputs is None:  # input uploads among them (or a bad input): one by one
                inputs = {}
                for s, v in zip(c.inputs, consts, strict=False):  # inputs come first
                    if type(v) is int:
                        t = sess.store.get(v)
                        if t is None:
                            raise Refused("protocol", f"no tensor with handle id {v} in this "
                                                      "session (freed, or never created)")
                        protect.add(v)
                        sess.used_at[v] = sess.tick
                    elif type(v) is InputUpload:
                        if v.ref.index >= len(frames):
                            raise ProtocolError(f"tensor frame {v.ref.index} is missing")
                        t = _device_value(frame_tensor(frames[v.ref.index], v.ref, copy=False),
                                          dev)
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
            self._check_quota(protect)
            inputs_before = set(inputs) if c.uploads else None
            tape = None
            if changed is not None and old is not None:
                try:
                    tape = refill(c, old, consts, changed, frames, inputs,
                                  upload=lambda t: _device_value(t, dev))
                except BaseException:
                    c.filled = None  # patched half way: fill anew next time
                    raise
                if tape is not None:
                    self.refills += 1
            if tape is None:
                c.filled = None  # a fill that fails half way leaves nothing to patch
                tape = fill(c, consts, frames, inputs, upload=lambda t: _device_value(t, dev))
            gkeys = graphs.keys_of(tape.instrs) if c.graph_calls else []
            if any(k not in sess.graphs for k in gkeys):  # evicted, or never sent: resend
                for a in added:
                    sess.drop(a)
                return {"t": "miss", "graphs": [k for k in gkeys if k not in sess.graphs]}, []
            for k in gkeys:
                sess.graphs.move_to_end(k)
            # uploads inside the tape are inputs now, not yet counted in the session
            uploaded = 0 if inputs_before is None else \
                sum(tape.inputs[sl].untyped_storage().nbytes()
                    for sl in tape.inputs.keys() - inputs_before)
            # which ops the index check covers is the skeleton's (its key hashes its ops): one
            # that has none skips it (a check without a plan never learns what writes forget)
            ix = IndexCheck(tape, self.index_check) if self.index_check and \
                key not in self.unindexed else None
            if ix is not None and not ix.plan:
                if len(self.unindexed) >= MAX_PROGRAMS:
                    self.unindexed.clear()
                self.unindexed.add(key)
            budget = sess.quota - sess.used() - uploaded
            try:
                self._guarded = None
                self.how = "guarded"
                kept = self._replay(key, tape, budget, started, c.filled,
                                    ix if ix is not None and ix.plan else None)
                if kept is None:
                    info: dict[str, Any] = {}
                    t0 = time.monotonic()
                    kept = run_guarded(tape, dev, budget, started + self.cfg.max_run_seconds,
                                       self.cfg.max_run_seconds, ix, info)
                    self._learn(tape, info, time.monotonic() - t0)
            except QuotaError as e:
                if not e.ran:  # nothing ran: evicting hinted values lets it run as sent
                    self._pressure(e.need - e.budget, protect)
                raise Refused("quota", f"{e}{self._by_role()}") from None
            except RunTimeout as e:
                raise Refused("timeout", str(e)) from None
            except ExecutionError as e:
                for a in added:
                    sess.drop(a)
                added.clear()
                _lane_back(c, False)
                return self._exec_reply(c, e, ix)
            if c.writes:  # resize_ (out=, set_) of a resident tensor grows it; a tape of
                sess.refresh(tape.inputs.values())  # ops that write nothing resizes nothing
            sess.put_many(new_ids, [kept[s] for s in c.made])
            added.extend(new_ids)
            self._check_quota()
        except BaseException:
            for a in added:
                sess.drop(a)
            c.filled = None  # the constants kept (c.consts) may not be the last tape's: refill
            _lane_back(c, False)  # would patch a delta onto instructions without this
            raise  # request's changes
        _apply_hints(sess, hints)  # the values this request made too, now that they exist
        _lane_back(c, self._lane_src is not None and ix is None)
        if self._lane_src is not None and c.lane is None and ix is None:
            self._make_lane(c)
        if self.answered:  # the client has its values: serve_session sends the front only
            return {"t": "ok"}, []  # that the run is done
        reply, rframes = _outputs([kept[s] for s in c.outputs], sess.quota)
        reply["res"] = sess.residency()
        reply["vt"] = self.how
        reply.update(_index_counts(ix))
        return reply, rframes

    def _run_lane(self, c: Compiled, lane: Any, key: bytes, h: dict[str, Any], id0: int
                  ) -> tuple[dict[str, Any], list] | None:
        """A steady request of a skeleton with a native lane (``genie._C._WorkerLane``,
        csrc/worker_replay.cpp): its delta applied, its inputs resolved (handle ids the session
        holds), keyed for the shape class, admitted (the vetted shapes, or the class's guards
        held natively) within the budget, and run, in one native call. None when the lane
        passes the request to the Python path (:meth:`_run`), having changed nothing: that path
        checks it as every request, and refuses what it refuses. What stays in Python here: the
        header's hints, the quota before and after, the kept values' puts and the reply."""
        sess = self.sess
        end = id0 + len(c.made)
        ph = h.get("ph", 0)
        try:  # (what the Python path refuses, it refuses: after the delta is its constants)
            hints = _hints(h.get("ev"))
        except ProtocolError:
            hints = None
        if hints is None or ph not in (0, 1):
            self.lane_passes["request"] += 1
            return None
        if hints:  # as _run: every hinted id must be the session's (held, made or freed)
            store = sess.store
            other = [hid for hid, _ in hints if hid not in store and not id0 <= hid < end]
            if other and not set(_id_list(h.get("free"))).issuperset(other):
                self.lane_passes["request"] += 1
                return None
        sess.decoding = ph == 1
        sess.tick += 1
        used = sess.used()
        if used > sess.quota:
            self.lane_passes["quota"] += 1
            return None  # (the Python path refuses, naming what would make room)
        self._take_builds()
        lane = c.lane  # (a class a build installed drops the lanes of its structure)
        if not lane:
            return None
        split = self.splits.get(c.lane_pkey, -1) if self.answer is not None else -1
        self._ix = None
        self._lane_outputs = c.outputs
        r = lane.step(sess.store, sess.used_at, h.get("d"), sess.tick, sess.quota - used,
                      split, self._lane_early if split > 0 else None)
        if type(r) is int:
            self.lane_passes[LANE_PASS.get(r, str(r))] += 1
            return None
        self.how = "class" if lane.how else "hit"
        self.replays += 1
        self.lane_runs += 1
        return self._lane_post(c, lane, r, hints, id0, end)

    def _lane_post(self, c: Compiled, lane: Any, r: Any, hints: list[tuple[int, int]],
                   id0: int, end: int) -> tuple[dict[str, Any], list]:
        """A lane's request after its program ran (``r``: its kept values, or the failed
        instruction's (instruction, exception, live values)): the hints, the puts of the kept
        values under ``id0``.., the quota and the reply."""
        sess = self.sess
        if hints:  # the held values' now, the made values' once they are put
            _apply_hints(sess, [(i, code) for i, code in hints if not id0 <= i < end])
        new_ids = list(range(id0, end))
        added: list[int] = []
        try:
            if type(r) is tuple:  # (instruction, exception, live values)
                tape = Tape(lane.instrs, lane.inputs, list(c.outputs), set(c.keep), [], {})
                raise native_replay.failure(tape, *r) from r[1]
            kept = r
            if c.writes:
                sess.refresh(lane.inputs.values())
            sess.put_many(new_ids, [kept[s] for s in c.made])
            added = new_ids
            self._check_quota()
        except ExecutionError as e:
            return self._exec_reply(c, e, None)
        except BaseException:
            for a in added:
                sess.drop(a)
            raise
        if hints:
            _apply_hints(sess, [(i, code) for i, code in hints if id0 <= i < end])
        return self._lane_reply(kept, c.outputs)

    def _lane_reply(self, kept: dict[int, Any], outputs: list[int]
                    ) -> tuple[dict[str, Any], list]:
        """A lane request's reply, its kept values put: nothing more when an early answer sent
        the values; else written natively where it can be (:data:`SENT`), or the reply."""
        sess = self.sess
        if self.answered:
            return {"t": "ok"}, []
        vals = [kept[s] for s in outputs]
        # written whole by one native call where it can be (what _outputs refuses for the
        # quota goes its way): the values' bytes are in the socket before it returns
        if self.reply_native is not None and \
                sum(v.nbytes for v in vals if isinstance(v, torch.Tensor)) <= sess.quota and \
                self.reply_native(vals, self.how):
            self.native_replies += 1
            return SENT, []
        reply, rframes = _outputs(vals, sess.quota)
        reply["res"] = sess.residency()
        reply["vt"] = self.how
        return reply, rframes

    def _lane_early(self, now: dict[int, Any]) -> None:
        self._answer_early(self._lane_outputs, now)

    def _make_lane(self, c: Compiled) -> None:
        """After a replayed request on the Python path: the skeleton's native lane (see
        :meth:`_run_lane`) when its later requests can be its: every input a held handle (no
        uploads, no host tensors, no graph calls, no index check), the replay admitted by its
        vetted shapes or by a class whose guards are held natively."""
        pkey, ck, ints, peak, cls, prog = self._lane_src  # type: ignore[misc]
        self._lane_src = None
        f = c.filled
        if not self.lanes or c.lane is False or f is None or f.params is None or f.patched or \
                f.frames or f.uploads or c.uploads or c.graph_calls or \
                (cls is not None and cls.native is None) or not isinstance(c.consts, list):
            return
        baked, _, _, iints, pos = f.params
        if baked != ck.baked:
            return
        instrs = list(f.instrs)
        n_in = len(c.inputs)
        known = c.lane_kinds  # (what the constants are, per fill and class key: a pass
        if known is not None and known[0] is f.where and known[1] is pos:  # patches)
            kinds = known[2]
        else:
            kinds = [(_K_INPUT, -1, -1, -1)] * n_in
            for k in range(n_in, c.n_consts):
                i, j = f.where.get(k, (-1, 0))
                kind, q = _K_FIXED, -1
                if i >= 0:
                    ins = instrs[i]
                    if j >= 0:
                        x = ins.leaves[j]
                        if type(x) is int and pos.get((i, j), -1) >= 0:
                            kind, q = _K_INT, pos[(i, j)]
                        elif type(x) is float and not policy(ins.op).float_values_matter:
                            kind = _K_FLOAT
                        elif type(x) is bool and pos.get((i, j), 0) < 0:
                            kind = _K_BOOL  # (a value argument's bool: the class keys its
                            # type, the program reads it per step; HF's is_done)
                    elif ins.rng is not None:
                        kind = _K_SEED if j == -1 else _K_OFFSET
                kinds.append((kind, i, j, q))
            c.lane_kinds = (f.where, pos, kinds)
        devices = [self.device, *map(real_device, prog.others)]
        exact = [[list(ints), peak]] if cls is None else []
        try:
            lane = _C._WorkerLane(prog.native, devices, instrs, _copy_instr, c.consts,
                                  list(c.inputs), kinds,
                                  ck[2], list(iints), exact, cls.native if cls is not None
                                  else None)
        except (TypeError, ValueError) as e:  # (never: what the lane takes is checked above)
            logger.debug("genie-server: no native lane (%s)", e)
            c.lane = False
            c.lane_misses = 0  # (none again: see _lane_back)
            return
        c.lane = lane
        c.filled = None  # the lane patches the instructions now (see _drop_lane)
        c.lane_pkey = pkey
        c.lane_state = (f.where, *f.params[:3], pos)

    def _exec_reply(self, c: Compiled, e: ExecutionError, ix: IndexCheck | None
                    ) -> tuple[dict[str, Any], list]:
        """The reply to a run whose instruction failed (its index in the skeleton)."""
        cause = e.__cause__ or e
        if isinstance(cause, MemoryError) or "can't allocate memory" in str(cause) or \
                "DefaultCPUAllocator" in str(cause):
            cause = MemoryError(f"{cause} (the session's worker may not allocate past "
                                f"twice its quota of {self.sess.quota} bytes)")
        # the skeleton's instruction index (fill turned its uploads into inputs)
        ran = [i for i, t in enumerate(c.templates) if t.op != UPLOAD]
        i = ran[e.index] if e.index is not None and e.index < len(ran) else -1
        return {"t": "err", "kind": "exec", "etype": type(cause).__name__,
                "msg": str(cause), "i": i, "vt": self.how, **_index_counts(ix)}, []

    def _held_inputs(self, c: Compiled, consts: list[Any], protect: set[int]
                     ) -> dict[int, Any] | None:
        """The input slots' values when every input is a value the session holds (a replayed
        structure's request: no uploads), resolved in bulk, with no Python per input: each id
        must be held (Refused, as one by one, naming the first that is not); they join
        ``protect`` and are marked used by this request (``genie._C._held_inputs``, one native
        pass). None when an input is not a handle id (an upload, or a bad input: resolved one
        by one)."""
        sess = self.sess
        got = _C._held_inputs(sess.store, sess.used_at, consts, c.inputs, sess.tick)
        if type(got) is int:
            raise Refused("protocol", f"no tensor with handle id {got} in this session (freed, "
                                      "or never created)")
        if got is not None:
            protect.update(consts[:len(c.inputs)])
        return got

    def _replay(self, key: bytes, tape: Tape, budget: int, started: float,
                filled: Any = None, ix: IndexCheck | None = None) -> dict[int, Any] | None:
        """Vet once, replay natively: a structure's first call runs through the guard (vetted,
        interpreted, stopped between instructions at the deadline); once one has run whole
        (no op whose output size depends on data) well within the deadline, its later calls run
        as one native program (:mod:`genie.backends.native_replay`, compiled once per structure
        and baked constants, shapes as parameters). A call is vetted on meta only when neither
        its exact shapes were vetted before nor a shape class of its structure admits it
        (:mod:`genie.remote.shape_class`: built from two calls whose integers moved). With
        ``ix`` (the index check of a tape with checked arguments) the replay stops where an
        interpreted run would check (:meth:`IndexCheck.points`, once per structure).
        None: run it through the guard (:attr:`_guarded` says what to learn from that run)."""
        self._guarded = None
        self.how = "guarded"
        if key in self.barriers:
            return None
        self._take_builds()
        got = shape_params(key, tape, filled)
        if got is None:
            return None
        ck, ints = got
        # the constants its native program bakes: the class key's (a written bool by its type:
        # the program reads its value per step, native_replay.compile_tape)
        pkey = (key, ck[1])
        prog = self.programs.get(pkey)
        if prog is None:
            self._guarded = (pkey, ck, ints)
            return None
        if prog is False:
            return None
        vkey = (ck, ints)
        peak = self.vetted.get(vkey)
        self.how = "hit"
        if peak is None:
            cls = self.classes.get(ck)
            if cls:
                peak = cls.admit(ints)
                self.how = "class"
                if peak is not None and peak > budget:
                    peak = None  # a bound, not the peak: the exact vet may still fit
        if peak is None:
            self.how = "vetted"
            self.vets += 1
            t0 = time.monotonic()
            v = vet_tape(tape, budget, started + self.cfg.max_run_seconds,
                         self.cfg.max_run_seconds)
            if v.upto < len(tape.instrs):  # data-dependent sizes: vetted step by step
                self.barriers.add(key)
                return None
            peak = v.peak
            self._remember(vkey, peak)
            self.vet_seconds[ck] = self.vet_seconds.get(ck, 0.0) + time.monotonic() - t0
            self._classify(ck, ints, tape)
        elif peak > budget:
            e = QuotaError(0, "the tape", peak, budget)
            e.ran = False
            raise e
        self.replays += 1
        if self.lanes and ix is None and self.how != "vetted":  # (a native lane may take this
            # structure's next calls: once they are admitted without a vet)
            self._lane_src = (pkey, ck, vkey[1], peak,
                              self.classes.get(ck) if self.how == "class" else None, prog)
        split = self.splits.get(pkey, -1) if self.answer is not None else -1
        check = None
        if ix is not None:
            points = self.check_points.get(key)
            if points is None:
                if len(self.check_points) >= MAX_PROGRAMS:
                    self.check_points.clear()
                points = self.check_points[key] = ix.points()
            check = (_checker(ix, tape), *points)
        self._ix = ix
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if split > 0 or check is not None:
                early = (lambda now: self._answer_early(tape.outputs, now)) if split > 0 \
                    else None
                return prog(tape, self.device, split, early, check)
            return prog(tape, self.device)
        finally:
            torch._C._set_grad_enabled(grad)

    def _answer_early(self, outputs: list[int], now: dict[int, Any]) -> None:
        """The replayed tape's outputs are final (nothing after this instruction writes them):
        answer now, while the rest of the tape (a training step's backward and update) runs. The
        front keeps the session busy until the worker says it is done; what the rest keeps is
        the session's then. A failure of the rest ends the session (serve_session): its client
        has its values, and what the rest was to write is unknown."""
        vals = [now.get(s) for s in outputs]
        if any(not isinstance(v, torch.Tensor) for v in vals):
            return
        nbytes = sum(v.nbytes for v in vals)
        if nbytes > EARLY_MAX_BYTES:
            return
        # written whole by one native call where it can be (no index counts to add; what
        # _outputs refuses for the quota goes its way): the values' bytes are in the socket
        # before it returns, so they need no copy
        if self.answer_native is not None and self._ix is None and nbytes <= self.sess.quota \
                and self.answer_native(vals, self.how):
            self.answered = True
            return
        # copies: the values go out while the rest runs (and may free or reuse their memory)
        reply, frames = _outputs([v.clone(memory_format=torch.preserve_format) for v in vals],
                                 self.sess.quota)
        reply["vt"] = self.how
        reply["er"] = 1
        reply.update(_index_counts(self._ix))  # the checks made before the answer
        self.answer(reply, frames)
        self.answered = True

    def _classify(self, ck: Any, ints: tuple[int, ...], tape: Tape) -> None:
        """After a clean concrete vet: when the structure's integers moved since its last vetted
        call, vet it once symbolically (a shape class) so that calls like these skip the vet:
        in a forked child by default (:class:`ClassBuilds`; the class serves from the first
        request after it is done), or inline."""
        prev = self.last_ints.get(ck)
        if len(self.last_ints) >= MAX_PROGRAMS and prev is None:
            self.last_ints.clear()
            self.class_tries.clear()
            self.vet_seconds.clear()
        self.last_ints[ck] = ints
        cls = self.classes.get(ck)
        tries = self.class_tries.get(ck, 0)
        # a structure without instructions (values uploaded and kept: a model's weights moved to
        # the device, one structure whose sizes move with each weight's shape) is vetted for
        # ~0.1 ms; a class would cost a fork of the worker (~8-15 ms of its CPU) and the child's
        # page faults (~15-20 ms), twice per model loaded (a GPT-2 12x768's weights)
        if prev is None or cls is False or tries >= CLASS_TRIES or self.build_mode == "off" or \
                not tape.instrs or len(tape.instrs) > CLASS_MAX_INSTRS:
            return
        background = self.build_mode == "background"
        if background and (self._free_build() is None or self._building(ck)):
            return  # every slot busy, or this structure's build runs: a later call tries again
        if not background and len(tape.instrs) > self.cfg.max_run_seconds * 125:
            return  # (inline: up to ~2 ms an instruction, at most a quarter of the deadline)
        # inline, ski rental: build once the concrete vets of this structure have cost what a
        # build is expected to (a structure seen a few times never pays a build it cannot win
        # back; one that keeps moving pays at most about twice what vetting it once per class
        # costs)
        if not background and self.vet_seconds.get(ck, 0.0) < len(tape.instrs) * self.build_cost:
            return
        pos = moved(prev, ints)
        if pos is None:
            return
        if cls:  # a class that did not admit this call: widen it by what moved now
            logger.debug("genie-server: a call its structure's shape class does not admit (%s): "
                         "widening it", cls.why_not(ints))
            pos = sorted(set(pos) | set(cls.sym_idx))
        self.class_tries[ck] = tries + 1
        if background:  # forked once the reply is out (a fork of a large worker: ~30-90 ms)
            self._next_build = (ck, tape, ints, pos, prev, cls, tries)
            return
        t0 = time.monotonic()
        try:
            new = build(tape, ints, pos, prev)
        except NotAClass as e:
            self._no_class(ck, cls, tries, e)
            return
        took = time.monotonic() - t0
        logger.debug("genie-server: shape class of %d symbols, %d guards in %.3f s",
                     len(pos), new.n_guards, took)
        if self.build_cost:  # (0: classes as soon as they can be built, for tests)
            self.build_cost = 0.5 * self.build_cost + 0.5 * took / max(len(tape.instrs), 1)
        self.vet_seconds[ck] = 0.0  # a widened class is paid for again
        self._add_class(ck, new)

    def after_reply(self) -> None:
        """Start the background build the last request found (:meth:`_classify`), now that its
        reply is out: the fork's cost falls between requests, not in one. The tape ran since
        it was vetted, so it is keyed again first: a build reads the inputs' metadata as they
        are now, and must build the class of the call that was vetted. The request's frees are
        deallocated here (:data:`FREES_LATER_MAX`)."""
        self.freed.clear()
        job, self._next_build = self._next_build, None
        if job is None:
            return
        ck, tape, ints, pos, prev, cls, tries = job
        slot = self._free_build()
        why = "no free build slot" if slot is None else \
            "its structure's build runs" if self._building(ck) else \
            "its classes changed" if self.classes.get(ck) is not cls else \
            "its inputs changed while it ran" if shape_params(ck[0], tape) != (ck, ints) else \
            None if slot.start(ck, tape, ints, pos, prev, cls) else "the fork failed"
        if why is not None:
            logger.debug("genie-server: no class build started (%s)", why)
            self.class_tries[ck] = tries  # nothing was tried: a later call tries again

    def _free_build(self) -> ClassBuilds | None:
        return next((b for b in self.builds if not b.busy), None)

    def _building(self, ck: Any) -> bool:
        return any(b.job is not None and b.job[0] == ck for b in self.builds)

    def _take_builds(self) -> None:
        for b in self.builds:
            if b.busy:
                self._take_build(b)

    def _take_build(self, slot: ClassBuilds) -> None:
        """Install the class a background build finished (checked by ``from_spec``)."""
        started = slot.started
        got = slot.poll()
        if got is None:
            return
        ck, ints, cls, out = got
        if self.classes.get(ck) is not cls:
            return  # the structure's classes were dropped (or replaced) meanwhile
        tries = self.class_tries.get(ck, 1) - 1
        if isinstance(out, dict):
            try:
                new = shape_class.from_spec(out, ints)
            except NotAClass as e:
                self._no_class(ck, cls, tries, e)
                return
            logger.debug("genie-server: shape class of %d symbols, %d guards in %.3f s "
                         "(background)", len(new.sym_idx), new.n_guards,
                         time.monotonic() - started)
            self._add_class(ck, new)
        else:
            self._no_class(ck, cls, tries, out)

    def _no_class(self, ck: Any, cls: Any, tries: int, why: Any) -> None:
        if tries + 1 >= CLASS_TRIES or cls is None:
            self.classes[ck] = False
            logger.info("genie-server: no shape class for a structure: each new shape of it is "
                        "vetted on meta (%s)", why)
        else:
            logger.debug("genie-server: no wider shape class for a structure (%s)", why)

    def _add_class(self, ck: Any, new: Any) -> None:
        if len(self.classes) >= MAX_PROGRAMS:
            self.classes.clear()
        self.classes[ck] = new
        for c, _ in self.sess.skeletons.values():  # (a lane holds the class it was built with;
            _drop_lane(c)  # a structure whose lanes passed requests tries again with this one)
            c.lane_misses = 0

    def _learn(self, tape: Tape, info: dict[str, Any], seconds: float) -> None:
        """After a guarded run of a structure not replayed yet: remember its vet, and compile it
        when it ran whole, in under a quarter of the deadline."""
        if self._guarded is None:
            return
        pkey, ck, ints = self._guarded
        self._guarded = None
        self.vets += 1
        if not info.get("whole"):
            self.barriers.add(pkey[0])
            return
        self._remember((ck, ints), info["peak"])
        if len(self.last_ints) >= MAX_PROGRAMS:
            self.last_ints.clear()
        self.last_ints[ck] = ints
        if seconds > self.cfg.max_run_seconds / 4:
            return  # long tapes stay where the deadline can stop them between instructions
        full = Tape(tape.instrs, tape.inputs, tape.outputs, set(tape.keep) | set(tape.outputs),
                    [], {})
        try:
            prog = native_replay.compile_tape(full, generic=True)
        except Exception as e:  # noqa: BLE001 - what it cannot compile is interpreted
            logger.debug("genie-server: not replayed natively (%s)", e)
            prog = False
        if len(self.programs) >= MAX_PROGRAMS:
            self.programs.clear()
            self.splits.clear()
        self.programs[pkey] = prog
        if prog and self.early:
            n = len(tape.instrs)
            k = native_replay.early_split(full)
            if 0 < k <= n * (1 - EARLY_MIN_TAIL):
                self.splits[pkey] = k

    def _remember(self, vkey: Any, peak: int) -> None:
        if len(self.vetted) >= MAX_VETTED:
            self.vetted.clear()
        self.vetted[vkey] = peak

    def _add_skeleton(self, key: bytes, sk: Any) -> tuple[Compiled, int]:
        """Compile and cache a skeleton under the hash of its bytes, within the session's
        skeleton share of the quota (least recently used ones evicted; the client resends)."""
        sess = self.sess
        if not isinstance(sk, bytes):
            raise ProtocolError("'sk' must be bytes")
        if hashlib.blake2b(sk, digest_size=16).digest() != key:
            raise ProtocolError("the skeleton's key is not the BLAKE2b-128 hash of its "
                                "bytes; the server caches skeletons by their hash")
        cost = len(sk) * SKELETON_COST
        cap = int(sess.quota * SKELETON_SHARE)
        if cost > cap:
            raise Refused("quota", f"a tape skeleton of {len(sk)} bytes (~{cost} bytes "
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

    def _add_graphs(self, entries: Any) -> None:
        """Admit compiled graphs sent as data (``[[key, data], ...]``): the key must be the
        SHA-256 of the data, every op of the graph must be admitted by this server's opset
        (:mod:`genie.remote.allowlist`), and the graphs share the skeletons' share of the quota
        (least recently used ones evicted; the client resends on a miss)."""
        sess = self.sess
        if not isinstance(entries, list) or len(entries) > MAX_GRAPHS_PER_REQUEST:
            raise ProtocolError(f"'g' must be a list of at most {MAX_GRAPHS_PER_REQUEST} "
                                "[key, graph data] pairs")
        cap = int(sess.quota * SKELETON_SHARE)
        for e in entries:
            if not (isinstance(e, list) and len(e) == 2 and graphs.is_key(e[0])
                    and isinstance(e[1], bytes)):
                raise ProtocolError("a graph entry must be [key (64 hex digits), data (bytes)]")
            key, data = e
            if graphs.content_key(data) != key:
                raise ProtocolError(f"graph {key[:12]}...: the key is not the SHA-256 of its "
                                    "data; the server caches graphs by content")
            if key in sess.graphs:
                continue
            cost = len(data) * GRAPH_COST
            if cost > cap:
                raise Refused("quota", f"a compiled graph of {len(data)} bytes (~{cost} bytes "
                                       f"compiled) passes the session's share of the quota for "
                                       f"compiled code ({cap} bytes); compile smaller functions")
            while sess.graphs and sess.skel_bytes + cost > cap:
                old, n = sess.graphs.popitem(last=False)
                graphs.forget(old)
                sess.skel_bytes -= n
            try:
                graphs.register(data, resolve=_graph_op)
            except graphs.GraphError as err:
                raise ProtocolError(f"compiled graph {key[:12]}... refused: {err}") from None
            except ProtocolError as err:
                raise ProtocolError(f"compiled graph {key[:12]}... refused: {err}") from None
            sess.graphs[key] = cost
            sess.skel_bytes += cost

    def _check_quota(self, protect: set[int] | None = None) -> None:
        sess = self.sess
        if sess.used() > sess.quota:
            if protect is not None:
                self._pressure(sess.used() - sess.quota, protect)
            raise Refused("quota", f"the session would hold {sess.nbytes} bytes in "
                                   f"{len(sess.store)} values on {self.device} (and "
                                   f"{sess.skel_bytes} bytes of cached tapes); its quota is "
                                   f"{sess.quota} bytes (server flag --quota). Free tensors "
                                   f"(del) or raise the quota.{self._by_role()}")

    def _pressure(self, need: int, protect: set[int]) -> None:
        """Raise a ``pressure`` refusal naming the values whose eviction frees ``need`` bytes,
        if hinted values can; return when they cannot (the caller refuses with ``quota``)."""
        sess = self.sess
        victims = sess.victims(need, protect, int(sess.quota * EVICT_SLACK))
        if victims:
            raise Refused("pressure", f"the request needs {need} more bytes than the session's "
                                      f"quota of {sess.quota} leaves; evict {len(victims)} "
                                      "values and send it again", need=need, victims=victims)

    def _by_role(self) -> str:
        roles = self.sess.by_role()
        if not roles:
            return ""
        what = ", ".join(f"{r} {n} values ({b} bytes)" for r, (n, b) in sorted(roles.items()))
        return (f". Resident by role: {what}; only hinted values (activations first) can be "
                "evicted, never the tape's own inputs, nor weights and KV caches while "
                "decoding")


def _drop_lane(c: Compiled, never: bool = False) -> None:
    """Drop a skeleton's lane (``never``: build none again), leaving the Python path the last
    call's instructions as the lane patched them (``protocol.Filled``: a delta is then patched
    onto them, as after a call on that path, not filled anew; the untouched instructions are
    still the objects the program was compiled from, whose baked leaves its runs skip)."""
    lane = c.lane
    if lane and c.lane_state is not None and isinstance(c.consts, list) and \
            c.consts is lane.consts:
        where, baked, cbaked, istatic, pos = c.lane_state
        instrs = list(lane.instrs)
        flips = [(-1 - p, instrs[i].leaves[j]) for (i, j), p in pos.items() if p < 0]
        if flips:  # (the value bools the lane patched: a program's key holds their values)
            bl = list(baked)
            for k, x in flips:
                bl[k] = (bool, x)
            baked = type(baked)(bl)
        c.filled = Filled(instrs, where, [], [], [],
                          (baked, cbaked, istatic, lane.instr_ints, pos))
    c.lane = False if never else None
    c.lane_state = None


def _lane_back(c: Compiled, admitted: bool) -> None:
    """A lane that passed :data:`LANE_MISSES` requests in a row (none built since: see
    :func:`_drop_lane`) is built again once as many requests in a row ran on the Python path
    admitted without a vet (``admitted``): its calls came back within its class (a generate's
    short prompts after long ones its class did not admit). Any other request starts the count
    again."""
    if c.lane is False and c.lane_misses > 0:
        c.lane_misses = c.lane_misses - 1 if admitted else LANE_MISSES
        if c.lane_misses == 0:
            c.lane = None


def _copy_instr(ins: Instr) -> Instr:
    """A lane's own copy of an instruction it patches (as ``protocol.refill`` copies them)."""
    return Instr(ins.op, list(ins.leaves), ins.spec, ins.outs, ins.rng, ins.free, ins.uid,
                 ins.where, ins.device)


def _graph_op(name: str) -> Any:
    """An op of a compiled graph: an ATen op this server admits (never a graph in a graph)."""
    if not name.startswith("aten::"):
        raise ProtocolError(f"op {name[:120]!r} does not run on a Genie server inside a graph: "
                            "only admitted ATen ops (genie/remote/allowlist.txt)")
    return resolve_op(name)


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


_INT_ONLY = {int}
#: what a lane's native request checks against (``_WorkerLane.serve``'s ``limits``)
_SERVE_LIMITS = [MAX_HINTS, len(ROLES), MAX_HANDLES, HANDLE_COST, FREES_LATER_MAX]


def _hints(ev: Any) -> list[tuple[int, int]]:
    """Residency hints ``[hid, role code, ...]`` as pairs; ProtocolError when malformed."""
    if ev is None:
        return []
    if not isinstance(ev, list) or len(ev) % 2 or len(ev) > 2 * MAX_HINTS:
        raise ProtocolError(f"residency hints ('ev') must be a flat list of at most {MAX_HINTS} "
                            "[handle id, role code] pairs")
    if not ev:
        return []
    ids, codes = ev[0::2], ev[1::2]  # (every item an int: ids >= 0, codes of ROLES, in C loops)
    if set(map(type, ev)) == _INT_ONLY and min(ids) >= 0 and min(codes) >= 0 and \
            max(codes) < len(ROLES):
        return list(zip(ids, codes))
    out = []  # (one by one: the first bad pair named)
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


def _outputs(vals: list[torch.Tensor], quota: int) -> tuple[dict[str, Any], list[Any]]:
    for v in vals:
        if not isinstance(v, torch.Tensor):
            raise Refused("internal", f"an output is a {type(v).__name__}, not a tensor")
    nbytes = sum(v.nbytes for v in vals)
    if nbytes > quota:  # (views of one storage, or one value named many times)
        raise Refused("quota", f"the reply's {len(vals)} values are {nbytes} bytes, more than "
                               f"the session's quota of {quota} bytes; ask for fewer at once")
    metas, frames = tensor_frames(vals)
    return {"t": "ok", "o": metas}, frames


# --- the worker process ---------------------------------------------------------------------------

def serve_session(fd: int, token: bytes, cfg: Config, retains: bool = False) -> None:
    """The worker's loop on its end of the front's socket pair (``fd``): answer requests until
    the front closes it; ``retains``: this process keeps freed host memory for reuse."""
    w = Worker(token, cfg)
    sock = socket.socket(fileno=fd)
    chan = Channel(sock, MAX_PARTS, channel_limit(cfg.quota), heap=retains)
    global _front
    _front = chan
    chan.send([pack({"ready": os.getpid()})])
    sess = w.sess
    h: Any = None
    t0 = 0.0

    def answer(reply: dict[str, Any], rframes: list[Any]) -> None:  # an early reply
        reply["rid"] = h.get("rid", -1)
        reply["st"] = round(time.monotonic() - t0, 6)
        rframes, counts = split_frames(rframes)
        if counts is not None:
            reply["fc"] = counts
        chan.send([status(EARLY, sess.used(), sess.residency(), sess.peer_bytes), pack(reply),
                   *rframes])

    def answer_native(vals: list[torch.Tensor], how: str) -> bool:
        return _C._send_early(chan.fileno(), sess.used(), sess.residency(), sess.peer_bytes,
                              h.get("rid", -1), round(time.monotonic() - t0, 6), how, vals,
                              _DTYPE_NAME) is not None

    def reply_native(vals: list[torch.Tensor], how: str) -> bool:
        return _C._send_reply(chan.fileno(), sess.used(), sess.residency(), sess.peer_bytes,
                              h.get("rid", -1), round(time.monotonic() - t0, 6), how, vals,
                              _DTYPE_NAME) is not None

    if w.early:
        w.answer = answer
        w.answer_native = answer_native
    if native_replies():
        w.reply_native = reply_native
        w.reply_fd = chan.fileno()
    try:
        while True:
            parts = chan.recv()
            if parts is None:
                return  # the front's goodbye
            w.t0 = t0 = time.monotonic()
            send = None
            h = None
            w.answered = False
            try:
                h = unpack(parts[0])
                if not isinstance(h, dict):
                    raise ProtocolError("a header must be a map")
                reply, rframes, send = w.handle(h, list(parts[1:]))
            except Refused as e:
                reply, rframes = {"t": "err", "kind": e.kind, "msg": str(e), **e.extra}, []
            except ProtocolError as e:
                reply, rframes = {"t": "err", "kind": "protocol", "msg": str(e)}, []
            except Exception as e:
                logger.exception("genie-server: request failed")
                reply, rframes = {"t": "err", "kind": "internal",
                                  "msg": f"{type(e).__name__}: {e}"}, []
            if reply is SENT:  # (a lane's reply, written natively)
                w.after_reply()
                continue
            if reply.get("t") == "err":
                logger.info("genie-server: request %s failed (%s): %s",
                            h.get("t") if isinstance(h, dict) else "?", reply.get("kind"),
                            reply.get("msg"))
            used, res = sess.used(), sess.residency()
            if w.answered:  # the client has its values: the front now learns the run is done
                w.answered = False
                if reply.get("t") == "err":  # the rest of the tape failed after the answer
                    fatal = (f"the work that ran after its reply failed ({reply.get('etype', '')}"
                             f": {reply.get('msg')}), so what it was to write is unknown")
                    chan.send([pack({"u": used, "res": res, "pb": sess.peer_bytes, "done": 1,
                                     "fatal": fatal})])
                    w.after_reply()
                    continue
                w.after_reply()
                # the front forwards the session's next request without waiting for this word
                # (the next reply says the rest is done): said only when none comes soon, so a
                # training loop's step is one message each way, not two to the front
                if not chan.ready(DONE_WAIT):
                    chan.send([status(DONE, used, res, sess.peer_bytes)])
                continue
            if send is not None:
                chan.send([pack({"u": used, "res": res, "pb": sess.peer_bytes, "send": send}),
                           pack(reply), *rframes])
                continue
            reply["rid"] = h.get("rid", -1) if isinstance(h, dict) else -1
            reply["st"] = round(time.monotonic() - t0, 6)  # the server's own time
            rframes, counts = split_frames(rframes)
            if counts is not None:
                reply["fc"] = counts
            chan.send([status(REPLY, used, res, sess.peer_bytes), pack(reply), *rframes])
            w.after_reply()
    except (BrokenPipeError, ConnectionResetError):
        return  # the front went away while this worker answered
    finally:
        for b in w.builds:
            b.stop()
        sess.clear()
        chan.close()


# --- sandbox --------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _no_network() -> bool:
    """Move this process into a network namespace of its own (no interface but a loopback that
    is down): True when the kernel allowed it. Unix sockets by path keep working."""
    libc = _libc()
    if libc.unshare(_CLONE_NEWNET) == 0:
        return True
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        return False
    with contextlib.suppress(OSError):  # keep our own ids inside the user namespace
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    return True


def limit_data(extra: int) -> int:
    """Bound this process's private writable memory (``RLIMIT_DATA``) to what it has now plus
    ``extra`` bytes; the limit set (0 where the OS refuses)."""
    limit = vm_data() + extra
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    except (ValueError, OSError):
        return 0
    return limit


def vm_data() -> int:
    """This process's private writable memory (``VmData``), bytes: what ``RLIMIT_DATA`` bounds."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def sandbox(cfg: Config) -> dict[str, Any]:
    """Confine this (freshly forked) worker; returns what took effect, for the front's log."""
    done: dict[str, Any] = {}
    tempfile.gettempdir()  # cached now: later calls (torch's) must not probe by writing a file
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        done["core"] = 0
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        done["fsize"] = 0
    if torch.device(cfg.device).type == "cpu":
        limit = limit_data(2 * cfg.quota + DATA_SLACK)
        if limit:
            done["data"] = limit
        # freed host memory kept for reuse, within the quota (a GPT-2 12x768 AdamW step faulted
        # ~106k pages in per request without it; see genie.memory.retain_host_memory)
        done["retain"] = retain_host_memory(min(retain_limit(), cfg.quota))
    done["netns"] = _no_network()
    return done


def _cuda_limit(cfg: Config) -> None:
    dev = torch.device(cfg.device)
    if dev.type == "cuda":  # the caching allocator refuses past the quota's share (and slack)
        if dev.index is None:  # "--device cuda": the current one (the fraction needs an index)
            dev = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, (2 * cfg.quota + CUDA_SLACK) / total), dev)


def _checker(ix: IndexCheck, tape: Tape) -> Any:
    """The index check as a replay calls it between instructions (see ``Program.__call__``):
    an out-of-range argument fails the instruction with eager's exception, as in
    :func:`genie.remote.guard.run_guarded`."""
    instrs = tape.instrs

    def check(i: int, env: dict[int, Any]) -> None:
        try:
            ix.step(i, instrs[i], env)
        except IndexOutOfRange as e:
            raise e.args[0] from None

    return check


# --- test-only kernels ----------------------------------------------------------------------------

def register_test_kernels() -> list[str]:
    """Kernels that misbehave as a buggy one would, for the isolation tests: ``segfault(x)``
    dereferences a null pointer; ``overread(x, n)`` returns ``n`` bytes starting at ``x``'s data,
    whatever lies past its end. Registered (and admitted by the server) only when the server runs
    with ``GENIE_SERVER_TEST_KERNELS=1``; clients define the same schemas to record them.
    ``spin(x, seconds)`` keeps a core busy for ``seconds`` inside one kernel; ``fail_if(x)``
    raises when ``x``'s first element is not zero (a data-dependent error the meta vet cannot
    see)."""
    lib = define_test_ops()
    lib.impl("segfault", _segfault_impl, "CPU")
    lib.impl("fail_if", _fail_if_impl, "CPU")
    lib.impl("overread", _overread_impl, "CPU")
    lib.impl("spin", _spin_impl, "CPU")
    lib.impl("lie", _lie_impl, "CPU")
    tape_io.ALLOWED_NAMESPACES = (*tape_io.ALLOWED_NAMESPACES, "genie_test")
    allowlist.TEST_OPS.update({"genie_test::segfault.default", "genie_test::overread.default",
                               "genie_test::spin.default", "genie_test::lie.default",
                               "genie_test::fail_if.default"})
    return sorted(allowlist.TEST_OPS)


_test_lib: Any = None
_front: Any = None  # the worker's socket to the front (the ``lie`` test kernel writes to it)


def define_test_ops() -> Any:
    """The ``genie_test`` schemas with meta kernels (a client records them with these)."""
    global _test_lib
    if _test_lib is None:
        lib = torch.library.Library("genie_test", "DEF")
        lib.define("segfault(Tensor x) -> Tensor")
        lib.define("overread(Tensor x, int n) -> Tensor")
        lib.define("spin(Tensor x, float seconds) -> Tensor")
        lib.impl("spin", lambda x, seconds: torch.empty_like(x), "Meta")
        lib.define("fail_if(Tensor x) -> Tensor")
        lib.impl("fail_if", lambda x: torch.empty_like(x), "Meta")
        lib.define("lie(Tensor x) -> Tensor")
        lib.impl("lie", lambda x: torch.empty_like(x), "Meta")
        lib.impl("segfault", lambda x: torch.empty_like(x), "Meta")
        lib.impl("overread", lambda x, n: torch.empty(n, dtype=torch.uint8, device="meta"),
                 "Meta")
        _test_lib = lib
    return _test_lib


def _fail_if_impl(x: torch.Tensor) -> torch.Tensor:
    if x.numel() and x.reshape(-1)[0].item() != 0:
        raise RuntimeError("genie_test::fail_if: its input's first element is not zero")
    return x.clone()


def _segfault_impl(x: torch.Tensor) -> torch.Tensor:
    ctypes.string_at(0xFFFFFFFFFFFFF000, 1)  # kernel space: SIGSEGV (page 0 may be mapped)
    os.kill(os.getpid(), signal.SIGSEGV)
    return x.clone()


def _lie_impl(x: torch.Tensor) -> torch.Tensor:
    """A worker whose memory a kernel corrupted may say anything to the front; by ``x``'s size:
    a transfer whose header does not decode (4), a status frame one byte short (5), a status
    that is no known message (6), a status whose counts are negative (7: a session that says
    it uses less than nothing would have the front queue past its quota); or a message the
    channel does not take: more parts than a message may have (8), more bytes than it may have
    (9, declared, never sent), a head that promises more than follows (10: the front waits for
    the rest, which never comes as a message); the end of a run it never answered early (11)."""
    lies = {5: status(REPLY, 0, [0, 0], [0, 0])[:-1],
            6: wire.STATUS.pack(0, 9, 0, 0, 0, 0, 0),
            7: status(EARLY, -(1 << 40), [0, 0], [0, 0])}
    head = lambda *lens: struct.pack(f"<I{len(lens)}Q", len(lens), *lens)  # noqa: E731
    raw = {8: head(*[0] * (MAX_PARTS + 1)),
           9: head(wire.STATUS.size, _front.max_bytes - wire.STATUS.size + 1) if _front else b"",
           10: head(wire.STATUS.size, 4096) + status(REPLY, 0, [0, 0], [0, 0])}
    if _front is not None:
        n = x.numel()
        if n in raw:
            _front.sock.sendall(raw[n])
        elif n == 11:
            _front.send([status(DONE, 0, [0, 0], [0, 0])])
        else:
            lie = lies.get(n)
            _front.send([pack({"send": {}, "u": "x", "res": [1], "pb": None}), b"\xc1"]
                        if lie is None else [lie, pack({"t": "ok", "rid": 0})])
    return x.clone()


def _spin_impl(x: torch.Tensor, seconds: float) -> torch.Tensor:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # one kernel that keeps a core busy and does not return
        pass
    return x.clone()


def _overread_impl(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(ctypes.string_at(x.data_ptr(), n)), dtype=torch.uint8)


# --- the zygote -----------------------------------------------------------------------------------

def _send_line(s: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    s.sendall(struct.pack("<I", len(data)) + data)


def zygote(ctl_fd: int, cfg: Config) -> int:
    """Fork a worker per ``spawn`` line from the front; report each worker's death.

    Control protocol (length-prefixed JSON over the inherited socket): front -> zygote
    ``{"spawn": token hex}`` with the worker's end of its socket pair (``SCM_RIGHTS``, in the
    same ``sendmsg``); zygote -> front ``{"zygote": pid}`` once it is
    ready, ``{"pid": n, "token": hex}`` after a
    fork, ``{"dead": pid, "signal": n or null, "code": n or null}`` when a worker ended. The zygote
    exits when the front closes the socket (and dies with the front)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if torch.cuda.is_initialized():  # a forked worker could not use CUDA: fail now, clearly
        raise RuntimeError("genie-server: CUDA was initialized in the zygote, so no session "
                           "worker forked from it could use the GPU; start the server with "
                           "PYTORCH_NVML_BASED_CUDA_CHECK=1 (genie-server sets it) and report this")
    ctl = socket.socket(fileno=ctl_fd)
    _send_line(ctl, {"zygote": os.getpid()})
    buf = b""
    fds: list[int] = []  # channels received, in the order of their spawn lines
    children: set[int] = set()
    while True:
        r, _, _ = select.select([ctl], [], [], 0.1)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            try:
                _send_line(ctl, {"dead": pid,
                                 "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                                 "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None})
            except OSError:  # the front is gone: so are its sessions
                break
        if not r:
            continue
        try:
            data, got, _, _ = socket.recv_fds(ctl, 1 << 16, 64)
        except OSError:
            data, got = b"", []
        fds += got
        if not data:  # the front closed: its sessions end now, and so does the zygote
            for pid in children:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            os._exit(0)  # no interpreter teardown (seconds with torch loaded)
        buf += data
        while len(buf) >= 4:
            (n,) = struct.unpack_from("<I", buf)
            if len(buf) < 4 + n:
                break
            msg = json.loads(buf[4:4 + n])
            buf = buf[4 + n:]
            if not fds:  # (never: the front sends a channel with every spawn line)
                logging.getLogger("genie.server.worker").error("a spawn without its channel")
                continue
            fd = fds.pop(0)
            pid = os.fork()
            if pid == 0:  # the worker: its own channel only
                code = 0
                try:
                    ctl.close()
                    for other in fds:
                        os.close(other)
                    os.set_inheritable(fd, False)
                    _worker_main(fd, bytes.fromhex(msg["spawn"]), cfg)
                except BaseException:  # noqa: BLE001 - a worker must never return into the loop
                    logging.getLogger("genie.server.worker").exception("worker failed")
                    code = 1
                finally:
                    os._exit(code)
            os.close(fd)
            children.add(pid)
            _send_line(ctl, {"pid": pid, "token": msg["spawn"]})


def _worker_main(fd: int, token: bytes, cfg: Config) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    # before the sandbox: the helper writes the files Inductor needs, which this process cannot
    compiler.start(cfg.device, _graph_op, cfg.quota, lambda: (
        die_with_parent(), _no_network(), limit_data(2 * cfg.quota + compiler.COMPILE_SLACK)))
    got = sandbox(cfg)
    _cuda_limit(cfg)
    if "GENIE_CUDA_GRAPHS" not in os.environ:
        # A CUDA graph's memory pool is not charged to the session's quota yet, and under the
        # allocator's fraction it made a session's later kernels run out of memory (H200,
        # session 56): a worker graphs only where its operator sets GENIE_CUDA_GRAPHS=1.
        genie_config.cuda_graphs = "0"
    logger.debug("genie-server: worker %d sandboxed: %s", os.getpid(), got)
    serve_session(fd, token, cfg, retains=bool(got.get("retain")))


def main(argv: list[str] | None = None) -> int:
    """``python -m genie.remote.worker FD CONFIG_JSON``: the zygote (started by the front)."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=os.environ.get("GENIE_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(name)s: %(message)s")
    # each worker (forked from here) is one session: its lines spend one budget, its own
    logbudget.install(keyed=False)
    cfg = Config.from_json(argv[1])
    os.environ.pop("GENIE_SERVER", None)  # the worker runs tapes itself
    backends.set_backends([n for n in backends.backend_order() if n != "remote"])
    if cfg.test_kernels:
        register_test_kernels()
    warm()
    # every worker forks from here: what the zygote holds (torch, Genie: ~325k objects) is never
    # scanned by a worker's full collection, nor are its pages copied into the worker by one (a
    # GPT-2 12x768 decode's worker: one full collection of 0.56 s in its first 48 steps before)
    gc.freeze()
    return zygote(int(argv[0]), cfg)


def warm() -> None:
    """What every worker would otherwise load on its first tape (seconds: sympy and torch's
    reference implementations, imported lazily by meta kernels), loaded once in the zygote.
    Meta tensors only: no CPU kernel runs here, so no thread pool exists to be forked."""
    import torch._decomp  # noqa: F401
    import torch._refs  # noqa: F401
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # its first use imports (the guard enters it per tape)
        pass
    allowlist.checked_in()  # the opset file, read once here
    for name in ("aten::mul.Scalar", "aten::add.Tensor", "aten::clone.default",
                 "aten::mm.default", "aten::view.default", "aten::copy_.default"):
        allowlist.admitted(name)

    aten = torch.ops.aten
    m = torch.empty(4, 4, device="meta")
    i = torch.zeros(4, dtype=torch.long, device="meta")
    with contextlib.suppress(Exception):
        aten.randn.default([4, 4], device="meta")
        aten.rand.default([4, 4], device="meta")
        aten.arange.start_step(0, 4, 1, device="meta")
        aten.full.default([4], 1.0, device="meta")
        for f in (aten.relu.default, aten.neg.default, aten.exp.default, aten.sum.default):
            f(m)
        aten.add.Tensor(m, m)
        aten.mm.default(m, m)
        aten.embedding.default(m, i)
        aten.index_select.default(m, 0, i)
        aten._softmax.default(m, -1, False)
        aten.native_layer_norm.default(m, [4], None, None, 1e-5)
    shape_class.warm()  # the symbolic machinery's lazy imports (~1 s on a worker's first class)


if __name__ == "__main__":
    sys.exit(main())
