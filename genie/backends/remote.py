"""The ``remote`` backend: tapes run on a ``genie-server``; values stay there as handles.

:func:`connect` (or ``GENIE_SERVER=tcp://host:port`` at import) puts this backend first: every
materialization becomes one request to a server: with one server, that one; with several, the one
the placement policy picks (:mod:`genie.remote.placement`: ``fixed`` maps ``remote_accelerator:N``
to the N-th address; ``phase-split`` and ``semantic`` place tapes by phase, roles and measured
costs, and move values server to server). Values that live tensors still hold are bound to their nodes as
:class:`~genie.remote.client.Handle` objects (the tensors stay on the server); the values the
program asked for come back in the same reply and reach the caller through this backend's
:meth:`RemoteBackend.fetch` (called by :func:`genie.backends.fetch`) as CPU tensors.

Example (needs a server on this machine, see docs/deployment.md)::

    import torch, genie
    genie.connect("tcp://127.0.0.1:5555", key_file="~/.config/genie/server/client.json")
    x = torch.ones(3, device="remote_accelerator")
    (x * 2).sum().item()          # 6.0, one round trip
    genie.disconnect()
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.autograd import profiler as _profiler

from .. import _C, context, device, executor, lazy_tensor, memory
from ..config import whole
from ..errors import DeviceError, GenieError
from ..graph import DEFAULT_GRAPH
from ..planner import Slot, Tape
from .. import backends
from . import BackendUnsupported, backend_order, register_backend, set_backends

_clients: list[Any] = []
#: why GENIE_SERVER / GENIE_POOL could not be used at import (connect_from_env); raised, as a
#: GenieError, by the first materialization, so that ``import torch`` itself never fails
_env_error: str | None = None
_router: Any = None  # genie.remote.placement.Router, when a policy other than fixed runs
_atexit = False

#: host tensors at least this large are sent when ``.to()`` records their upload (one round
#: trip each, their own memory as the frame) instead of being snapshotted for the next request
UPLOAD_NOW_MIN = 4 << 20


def ahead_ops() -> int:
    """``GENIE_REMOTE_AHEAD``, read at each :func:`connect` (never at import: ``import torch``
    loads Genie, and a bad setting must fail only the program that connects)."""
    try:
        n = whole("GENIE_REMOTE_AHEAD", "a whole number of recorded ops after which what the "
                  "last one computes is sent to the server ahead (0: never, the default)")
    except ValueError as e:
        raise GenieError(str(e)) from None
    return AHEAD_OPS if n is None else n


#: every this many recorded ops, the value the last one made is sent to the server without
#: waiting (:func:`send_ahead`); GENIE_REMOTE_AHEAD overrides it. Off (0) by default: on a
#: loopback server it did not pay (docs/deployment.md, "Sending ahead")
AHEAD_OPS = 0
_graph_task_id = torch._C._current_graph_task_id
_ahead = 0  # RemoteBackend.run: the thread whose tape running now is sent ahead (0: none)
_sent: Any = None  # the client RemoteBackend.run just sent a tape ahead on (send_ahead takes it)


def connect(address: str | Sequence[str] | None = None, *, key_file: str | None = None,
            server_key: str | None = None, client_keys: tuple[str, str] | None = None,
            insecure: bool = False, timeout: float = 30.0, lazy: bool = False,
            replay: bool | None = None, replay_ops: int | None = None,
            replay_bytes: int | None = None, pool: Any = None,
            placement: str | None = None) -> None:
    """Run ``remote_accelerator`` tensors on Genie server(s) from now on.

    Args:
        address: ``tcp://host:port``, or a list (``remote_accelerator:i`` runs on the i-th); by
            default the address in ``key_file`` or ``$GENIE_SERVER``.
        key_file: the connection file ``genie-server`` printed (server key and an authorized
            client key pair); default ``$GENIE_KEY_FILE``.
        server_key / client_keys: the same keys given directly (Z85 strings).
        insecure: plain TCP, for a server started with ``--insecure``.
        timeout: seconds of server silence after which an operation fails with
            :class:`~genie.remote.ServerUnavailableError` (a busy server keeps saying it is alive).
        lazy: open the session at the first materialization instead of now.
        replay: keep each session's lineage and, when its server is lost, rebuild the session on
            another address of the list (or the same one once it is back) and go on (see
            docs/deployment.md, "Recovery"); default on when several addresses are given.
        replay_ops / replay_bytes: a replay's cost bounds (ops; host bytes the lineage holds)
            past which the session is checkpointed (its live values downloaded).
        pool: a :class:`~genie.remote.pool.Pool`, or the path of the pool file ``genie-pool``
            printed (``GENIE_POOL``): its servers in order, keys from it, replay on, and a
            recovering client looks there for the servers that replaced dead ones.
        placement: with several servers, where each tape runs: ``fixed`` (device N on server
            N), ``phase-split`` (prefill on server N, decode on server N+1, the KV cache moving
            server to server) or ``semantic`` (from phases, roles and measured costs; the
            default with several servers); default ``$GENIE_PLACEMENT``. See
            docs/deployment.md, "Placement".

    Raises:
        ServerUnavailableError: the server cannot be reached or refuses the keys.

    Example:
        >>> genie.connect("tcp://127.0.0.1:5555", insecure=True)     # doctest: +SKIP
    """
    try:
        from ..remote.client import Client
    except ImportError as e:
        raise GenieError(f"genie.connect() needs pyzmq and msgpack ({e}); "
                         "pip install 'genie-remote-accelerator[remote]'") from None
    keys: dict[str, Any] = {}
    fallbacks: Any = None
    if pool is not None:
        from ..remote.pool import read_pool_file

        if isinstance(pool, (str, os.PathLike)):
            keys = read_pool_file(pool)
            fallbacks = lambda: read_pool_file(pool)["address"]  # noqa: E731
        else:
            keys = {**(pool.keys or {}), "address": pool.addresses,
                    "insecure": pool.keys is None}
            fallbacks = lambda: pool.addresses  # noqa: E731
        address = address or keys["address"]
        insecure = insecure or bool(keys.get("insecure"))
        replay = True if replay is None else replay
    key_file = key_file or os.environ.get("GENIE_KEY_FILE") or None
    if key_file and pool is None:
        path = Path(key_file).expanduser()
        try:
            keys = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise GenieError(f"cannot read the Genie key file {path}: {e}") from None
    if address is None:
        address = keys.get("address") or os.environ.get("GENIE_SERVER")
    if not address:
        raise GenieError("genie.connect() needs an address (tcp://host:port), a key_file with "
                         "one, or $GENIE_SERVER")
    addrs = [a.strip() for a in address.split(",")] if isinstance(address, str) else list(address)
    if not insecure:
        server_key = server_key or keys.get("server_public_key")
        if client_keys is None and keys:
            client_keys = (keys.get("client_public_key"), keys.get("client_secret_key"))
    policy = placement or os.environ.get("GENIE_PLACEMENT", "").strip() or \
        ("semantic" if len(addrs) > 1 else "fixed")
    try:
        from ..remote.placement import check_policy

        check_policy(policy, len(addrs))
    except ValueError as e:
        raise GenieError(f"[genie.connect] {e}") from None
    ahead = ahead_ops()
    disconnect()
    cpub, csec = client_keys if client_keys else (None, None)
    if replay is None:
        replay = len(addrs) > 1
    new = [Client(a, server_key=server_key, client_public=cpub, client_secret=csec,
                  insecure=insecure, timeout=timeout, replay=replay,
                  fallbacks=fallbacks or addrs,
                  replay_ops=replay_ops, replay_bytes=replay_bytes) for a in addrs]
    if not lazy:
        try:
            for c in new:
                c.open()
        except BaseException:
            for c in new:
                c.close()
            raise
    _clients[:] = new
    executor.forget_refusals()
    global _router
    if policy != "fixed" and len(new) > 1:
        from ..remote.placement import Router

        _router = Router(policy, new)
    set_backends(["remote", *[n for n in backend_order() if n != "remote"]])
    lazy_tensor.upload_now = _upload_now
    if ahead > 0 and _router is None:
        _C._record_ahead(ahead, send_ahead)
        backends.before_plan = settle
    if device.device_count() < len(new):
        device._native()._set_device_count(len(new))
    global _atexit
    if not _atexit:
        atexit.register(disconnect)
        _atexit = True


def disconnect() -> None:
    """End the sessions (servers free their tensors) and go back to the in-process executor.

    Tensors whose values lived on a server cannot be used afterwards (they raise
    :class:`~genie.remote.SessionLostError`); ``.cpu()`` what you need first.
    """
    global _router, _env_error
    _env_error = None
    lazy_tensor.upload_now = None
    _C._record_ahead(0, None)
    backends.before_plan = None
    if _router is not None:
        _router.close()
        _router = None
    for c in _clients:
        c.close()
    _clients.clear()
    if "remote" in backend_order():
        set_backends([n for n in backend_order() if n != "remote"])


def _upload_now(src: torch.Tensor, meta: Any, graph: Any) -> Any:
    """:data:`genie.lazy_tensor.upload_now`: a large, contiguous host tensor whose upload
    needs no conversion goes to its server now, from its own memory (no snapshot copy: the
    server holds the value when this returns); None leaves the upload to be recorded."""
    if graph.keep_nodes or meta.index >= len(_clients) or src.layout is not torch.strided or \
            src.device.type != "cpu" or src.numel() * src.element_size() < UPLOAD_NOW_MIN:
        return None
    if (type(src) is not torch.Tensor and not isinstance(src, torch.nn.Parameter)) or \
            src.dtype != meta.dtype or tuple(src.shape) != meta.shape or \
            tuple(src.stride()) != meta.stride or not src.is_contiguous() or \
            src.is_conj() or src.is_neg() or meta.conj or meta.neg:
        return None
    c = _clients[meta.index]
    if not c.alive or backend_order()[:1] != ["remote"]:
        return None
    from ..remote.protocol import WIRE_DTYPES

    if src.dtype not in WIRE_DTYPES:
        return None  # refused when the tape runs, with the protocol's message
    return c.put(src, meta, "weight" if isinstance(src, torch.nn.Parameter) else "input")


def placement() -> str:
    """The placement policy tapes run under now (``fixed`` with one server or none)."""
    return _router.policy if _router is not None else "fixed"


def clients() -> list[Any]:
    """The connected :class:`~genie.remote.client.Client` objects, by device index."""
    return list(_clients)


memory.sessions[0] = clients  # how genie.memory finds a device's session (it sits below)
device.sessions[0] = clients  # and genie.device whether work goes to a server


def _synchronize(index: int) -> bool:
    """``torch.remote_accelerator.synchronize()`` on a connected device: wait for its server
    (the rest of a tape its worker answered early); False when the device has no server."""
    if index >= len(_clients):
        return False
    _clients[index].synchronize()
    return True


device.remote_sync = _synchronize
# (a scalar read the host can answer skips the round trip only under fixed placement: a
# placement policy decides each tape's server from the runs it sees, e.g. where a prefill's
# inputs live, and a read answered here would change that)
device.remote_served = lambda index: index < len(_clients) and _router is None


def client_for(index: int) -> Any:
    if index >= len(_clients):
        raise DeviceError(f"remote_accelerator:{index} has no server: connected to "
                          f"{len(_clients)} ({', '.join(c.address for c in _clients)}). "
                          "Pass one address per device to genie.connect().")
    return _clients[index]


def fetch_values(values: list[Any]) -> list[Any]:
    """Materialized values as the caller gets them (CPU tensors): :meth:`RemoteBackend.fetch`.

    Handles give the value their reply brought along, or are downloaded (one request per server);
    a client-side tensor that was also uploaded as a tape input is read back from the server,
    which may have written to it since.
    """
    from ..remote.client import Handle

    out = list(values)
    todo: dict[Any, list[tuple[int, Any]]] = {}
    for i, v in enumerate(values):
        if type(v) is Handle:
            if v.host is not None:
                out[i] = v.host
            else:
                todo.setdefault(v.client, []).append((i, v))
        elif isinstance(v, torch.Tensor):
            for c in _clients:
                h = c.uploaded(v)
                if h is not None:
                    todo.setdefault(c, []).append((i, h))
                    break
    for c, items in todo.items():
        for (i, _), t in zip(items, c.get([h for _, h in items]), strict=True):
            out[i] = t
    for v in values:
        if type(v) is Handle:
            v.host = None
    return out


def send_ahead(result: Any) -> None:
    """Send what ``result`` (an op's return value, every :data:`AHEAD_OPS`-th recorded op: the
    native record path calls this) depends on to its server now, keeping the values there and
    not waiting for the answer: the server computes while the program records on, and the
    request that finally needs a value finds most of its work done. The answer is read before
    the session's next request; a failure is raised there (the op then recorded, or the value
    then read), not at the op that failed.

    Only the slice of this one value is sent: what it does not depend on goes with a later
    request, as without sending ahead. Not in a training step, which stays one tape
    (docs/semantics.md: the passes plan its memory across forward, backward and update; a
    forward that records for autograd, the backward, an optimizer step or its pending effects
    are not sent ahead), nor under a placement policy (it picks servers per tape), in a
    capture or under the profiler: inference (``no_grad``, ``inference_mode``) is what goes."""
    global _ahead
    t = result
    if type(t) is not lazy_tensor.LazyTensor:
        if type(t) is not tuple and type(t) is not list:
            return
        t = next((x for x in t if type(x) is lazy_tensor.LazyTensor), None)
        if t is None:
            return
    node = t._node
    if node is None or node.executed or _ahead or _router is not None or not _clients or \
            node.graph is not DEFAULT_GRAPH:  # a capture's nodes are for the user to read
        return
    if _profiler._is_profiler_enabled or torch.is_grad_enabled() or \
            _graph_task_id() != -1 or context._steps.pending:
        return
    ctx = node.ctx
    if ctx is not None and ctx.region == "optimizer":
        return
    index = node.metas[t._out].index
    if index >= len(_clients):
        return
    _ahead = threading.get_ident()
    try:
        executor.run_kept([(node, t._out)], index, _bind_later)
    finally:
        _ahead = 0


def _bind_later(bind: Any) -> bool:
    """``run_kept``'s ``defer``: the nodes of a tape sent ahead are bound when its answer is
    read (false: it ran without being sent ahead, bind now)."""
    global _sent
    c, _sent = _sent, None
    return c is not None and c.after_answer(bind)


def settle() -> None:
    """Read the answers of the tapes sent ahead and bind what they made (before a
    materialization plans: ``genie.backends.before_plan``)."""
    for c in _clients:
        if c._inflight is not None:
            c.settle()


def _index(tape: Tape) -> int:
    if hasattr(tape, "index"):
        return tape.index
    for n in reversed(tape.nodes):
        for m in n.metas:
            if m is not None:
                return m.index
    return 0


@register_backend("remote")
class RemoteBackend:
    """Runs each tape on the server of its device: one request, kept values as handles."""

    name = "remote"
    shape_generic = True  # it runs any tape as given: shapes need not be the plan's

    def is_available(self) -> bool:
        return bool(_clients) or _env_error is not None

    @property
    def reads_hits(self) -> bool:
        """Whether a plan-cache hit's instructions may stay unbuilt (``genie.executor``): the
        client encodes a hit from its nodes (``Plan.replay_source``) before anything binds
        them, unless a tape sent ahead is on its way (the run first settles its answer,
        binding its nodes, which this tape may share) or a policy places tapes (it reads
        instructions)."""
        return _router is None and all(c._inflight is None for c in _clients)

    def check(self, tape: Tape) -> str | None:
        return None

    def fetch(self, values: list[Any]) -> list[Any]:
        """Handles (and tensors uploaded to a server) as the CPU tensors the caller gets."""
        return fetch_values(values)

    def run(self, tape: Tape, device: torch.device) -> dict[int, Any]:
        from ..remote.client import Handle
        from ..remote.protocol import Unsendable

        if _env_error is not None and not _clients:
            raise GenieError(_env_error)
        try:
            devs = _devices(tape)
            if len(devs) > 1:
                return _run_split(tape)
            index = devs.pop() if devs else _index(tape)
            c = client_for(index)
            if _router is not None:
                return _router.run(tape, index)
            if _ahead != threading.get_ident():
                return c.run(tape)
            global _sent
            kept = c.run(tape, wait=False)
            _sent = c if c._inflight is not None else None
            return kept
        except Unsendable as e:
            if any(type(v) is Handle for v in tape.inputs.values()):
                raise GenieError(f"[genie] {e}; the tape's other values live on the server, so "
                                 "it cannot run locally either") from None
            raise BackendUnsupported(str(e)) from None


def _devices(tape: Tape) -> set[int]:
    """The devices ``tape``'s ops run on; a plan's tapes run where its instructions do (a
    plan-cache hit keeps each instruction's device), so a plan's set is kept on it."""
    plan = tape.plan
    tmpl = getattr(plan, "instrs", None)
    if tmpl is None:
        return {getattr(ins, "device", 0) for ins in tape.instrs}
    devs = plan.artifacts.get(_DEVICES)
    if devs is None:
        devs = plan.artifacts[_DEVICES] = frozenset(getattr(ins, "device", 0) for ins in tmpl)
    return set(devs)


#: where a plan keeps the devices of its instructions (:func:`_devices`)
_DEVICES = "remote.devices"


def _run_split(tape: Tape) -> dict[int, Any]:
    """A tape whose ops run on several devices (a copy between servers): one request per run
    of consecutive ops on the same device, on that device's server; values crossing over come
    back with the earlier request's reply and go to the next server as uploads (``fixed``), or
    go server to server (other placements)."""
    from ..remote.client import Handle

    segs: list[tuple[int, list[Any]]] = []
    seg_nodes: list[list[Any]] = []
    for ins, node in zip(tape.instrs, tape.nodes, strict=True):
        if not segs or segs[-1][0] != ins.device:
            segs.append((ins.device, []))
            seg_nodes.append([])
        segs[-1][1].append(ins)
        seg_nodes[-1].append(node)
    made: dict[int, int] = {}
    reads: list[set[int]] = []
    for k, (_, instrs) in enumerate(segs):
        made.update((s, k) for ins in instrs for s in ins.outs if s is not None)
        reads.append({x.id for ins in instrs for x in ins.leaves if type(x) is Slot})
    values: dict[int, Any] = dict(tape.inputs)
    crossing: list[Any] = []
    later: set[int] = set()
    later_reads = []
    for r in reversed(reads):
        later_reads.append(set(later))
        later |= r
    later_reads.reverse()
    try:
        for k, (d, instrs) in enumerate(segs):
            mine = {s for s, kk in made.items() if kk == k}
            cross = later_reads[k] & mine
            # fixed: crossing values come back in the reply (they go on as uploads); otherwise
            # they stay resident and go server to server
            outputs = [s for s in tape.outputs if s in mine] + \
                (sorted(cross) if _router is None else [])
            sub = Tape(instrs, {s: values[s] for s in reads[k] if made.get(s) != k}, outputs,
                       (tape.keep & mine) | cross, tape.nodes, tape.slots, d)
            c = client_for(d)
            kept = c.run(sub) if _router is None else _router.run(sub, d, seg_nodes[k], pin=True)
            crossing.extend(kept[s] for s in cross if s not in tape.outputs)
            values.update(kept)
    finally:
        for h in crossing:
            if type(h) is Handle:
                h.host = None
    return {s: values[s] for s in tape.keep}


def connect_from_env() -> None:
    """``GENIE_SERVER`` at import: connect lazily (the session opens at first use).

    Genie is imported by ``import torch`` (the ``torch.backends`` entry point), so a setting
    that cannot be used (an unreadable ``GENIE_KEY_FILE``, ``GENIE_SERVER`` without keys, a bad
    timeout) must not fail that import, nor any program that never touches the device: it is
    kept, and the first materialization on the device raises it, with the fix. The remote
    backend stays first meanwhile, so nothing silently runs on this machine instead.
    """
    global _env_error
    names = ("GENIE_POOL", "GENIE_SERVER", "GENIE_KEY_FILE", "GENIE_INSECURE", "GENIE_TIMEOUT")
    try:
        pool = os.environ.get("GENIE_POOL", "").strip()
        if pool:
            connect(pool=pool, timeout=float(os.environ.get("GENIE_TIMEOUT", "30")), lazy=True)
            return
        addr = os.environ.get("GENIE_SERVER", "").strip()
        if addr:
            connect(addr, insecure=os.environ.get("GENIE_INSECURE", "") == "1",
                    timeout=float(os.environ.get("GENIE_TIMEOUT", "30")), lazy=True)
    except Exception as e:  # noqa: BLE001 (any of them must wait for the first use)
        env = ", ".join(f"{n}={os.environ[n]!r}" for n in names if os.environ.get(n))
        _env_error = (
            f"[genie] cannot use the Genie server this environment names ({env}): {e}. Fix the "
            "environment before starting Python: GENIE_KEY_FILE must be the client.json the "
            "server wrote into its keys directory on first start (genie-server prints its path; "
            "docs/deployment.md), GENIE_INSECURE=1 only for a server started with --insecure; "
            "or unset GENIE_SERVER (and GENIE_POOL) to run remote_accelerator on this machine.")
        set_backends(["remote", *[n for n in backend_order() if n != "remote"]])
