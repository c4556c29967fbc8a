"""Placement: which server of the pool runs each tape, and which values move for it.

With several servers behind ``remote_accelerator`` (``genie.connect([a, b])``,
``GENIE_SERVER=a,b``, a pool file), a *policy* (``GENIE_PLACEMENT``, ``genie.connect(...,
placement=...)``) picks the server of every tape:

- ``fixed``: ``remote_accelerator:N`` runs on server N (values another server holds come through
  the client, as before placement existed). No :class:`Router` is made: the remote backend runs
  tapes exactly as it did.
- ``phase-split``: a tape of a decode (a model call that receives state an earlier call of the
  same model produced, :mod:`genie.context`) runs on server N+1, any other model call (the
  prefill, or a plain forward) on server N, and a tape outside any model call (sampling, stopping
  criteria) where most of its input bytes already are.
- ``semantic`` (the default with several servers): a decode runs where its KV cache is (the
  inputs whose role is ``kv_cache``); a model call that is not a decode (compute-heavy: a
  prefill) runs where the cost model (:mod:`genie.remote.cost`) says it finishes first, counting
  the transfers of the inputs missing there and the server's compute slowed by the work other
  sessions keep it busy with (:class:`~genie.remote.sched.LoadMeter`, read from heartbeat pings);
  it leaves the server holding most of its inputs only for an estimate below :data:`MARGIN`
  times that server's; other tapes run where most of their input bytes are. With no phases and no
  load (a training loop, one client) every tape stays on its device's server, as with ``fixed``.

Whatever the policy, three rules keep eager's semantics (they come before the policy):

1. **Writes and views stay home.** A value's *home* is the server that holds it (its primary
   copy). A tape that writes a value it reads, or keeps a view of one, runs on that value's home
   (decided from ``Node.writes`` and storage identity, i.e. from op schemas' alias annotations:
   the values sharing the storage live there and see the write). If such values live on two
   servers, the ones with a single live value in their storage move (become primary on the
   chosen server); otherwise :class:`~genie.remote.PlacementError`.
2. **Replicas are read-only copies.** An input held elsewhere is copied server to server
   (:meth:`~genie.remote.client.Client.send`, never through the client) and the copy is kept as
   long as the value lives: weights are replicated once per server that needs them. A write to a
   storage bumps its version; a replica of an older version is never used again (the written
   inputs' replicas are freed at once).
3. **Explicit device copies are honoured.** A tape whose ops span several device indices
   (``x.to("remote_accelerator:1")``) runs each device's part on that device's server; values
   cross server to server.

Counters (``genie.stats()``): ``placement.tapes``, ``placement.moved`` (tapes run off their
device's server), ``placement.replicas`` (values copied to another server), ``placement.migrated``,
``peer_transfers`` and ``peer_bytes`` (counted by the client's transfers).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..graph import Node, Ref, Storage
from ..planner import Tape
from ..stats import bump
from . import PlacementError
from .client import Client, Handle
from .cost import CostModel, Work, flops_of, model

logger = logging.getLogger("genie.remote.placement")

#: the policies, by name (``GENIE_PLACEMENT``)
POLICIES = ("fixed", "phase-split", "semantic")
#: a compute-heavy tape leaves the server holding most of its inputs only if the estimated time
#: elsewhere is below this fraction of the estimate there (measurements are noisy; moving costs
#: replicas' memory)
MARGIN = 0.8
#: a server's load (from its ping replies) older than this many seconds is not used
LOAD_MAX_AGE = 2.0


def check_policy(name: str, servers: int) -> str:
    """The policy ``name``, checked (ValueError names the policies and what fits).

    Example:
        >>> check_policy("semantic", 2)
        'semantic'
        >>> check_policy("phase-split", 1)
        Traceback (most recent call last):
        ...
        ValueError: placement 'phase-split' runs prefill and decode on two servers; 1 given: connect to at least two, or use 'fixed'
    """
    if name not in POLICIES:
        raise ValueError(f"unknown placement policy {name!r}; the policies are "
                         f"{', '.join(POLICIES)} (GENIE_PLACEMENT, genie.connect(placement=...))")
    if name == "phase-split" and servers < 2:
        raise ValueError(f"placement 'phase-split' runs prefill and decode on two servers; "
                         f"{servers} given: connect to at least two, or use 'fixed'")
    return name


# --- what a tape needs ------------------------------------------------------------------------

@dataclass(slots=True)
class Input:
    """A tape input held by a server: its primary copy, the storage it shares, its size."""

    slot: int
    primary: Handle
    storage: Storage | None  # the graph storage (None: not read by any op of this tape)
    owner: tuple[Node, int] | None  # the node output whose value ``primary`` is
    nbytes: int
    kv: bool  # role ``kv_cache`` (genie.context)


@dataclass(slots=True)
class Profile:
    """What placement reads of a tape: its kind, its server-held inputs, its writes."""

    kind: str  # "decode", "compute" (a model call that is not a decode) or "other"
    inputs: list[Input]
    pinned: list[Input]  # inputs written by the tape, or whose storage a kept value views
    written: set[Storage]


def kind_of(nodes: list[Node]) -> str:
    """``decode`` if any node was recorded in a decode (detected or ``genie.phase``),
    ``compute`` if any in another model call's forward (or an explicit ``prefill``), else
    ``other``."""
    compute = False
    for n in nodes:
        c = n.ctx
        if c is None:
            continue
        p = getattr(c, "phase", None)
        if p == "decode":
            return "decode"
        if p == "prefill" or (getattr(c, "call", None) is not None and
                              getattr(c, "region", None) == "forward"):
            compute = True
    return "compute" if compute else "other"


def _nbytes(h: Handle) -> int:
    m = h.meta
    if m is None:
        return 0
    n = 1
    for s in m.shape:
        n *= s
    return n * m.dtype.itemsize


def profile(tape: Tape, nodes: list[Node], clients: list[Client]) -> Profile:
    """The :class:`Profile` of ``tape`` (whose instructions are ``nodes``' ops)."""
    slots = tape.slots
    inputs = tape.inputs
    found: dict[int, tuple[Storage, Node, int]] = {}
    written: set[Storage] = set()
    kept_storages: set[Storage] = set()
    keep = tape.keep
    for n in nodes:
        if n.writes:
            written.update(n.writes)
        if n.leaves:
            for x in n.leaves:
                if type(x) is Ref:
                    s = slots.get((x.node.index, x.out))
                    if s is not None and s in inputs and s not in found:
                        found[s] = (x.node.storage(x.out), x.node, x.out)
        for k, m in enumerate(n.metas):
            if m is not None and slots.get((n.index, k)) in keep:
                st = n.storage(k)
                if st is not None:
                    kept_storages.add(st)
    ins: list[Input] = []
    pinned: list[Input] = []
    for s, v in inputs.items():
        if type(v) is not Handle:
            if not isinstance(v, torch.Tensor):
                continue
            h = next((c.uploaded(v) for c in clients if c.uploaded(v) is not None), None)
            if h is None:
                continue  # a host value: uploaded wherever the tape runs
            v = h
        st, node, out = found.get(s, (None, None, None))
        kv = node is not None and node.tags is not None and node.tags.get("role") == "kv_cache"
        inp = Input(s, v, st, (node, out) if node is not None else None, _nbytes(v), kv)
        ins.append(inp)
        if st is not None and (st in written or st in kept_storages):
            pinned.append(inp)
    return Profile(kind_of(nodes), ins, pinned, written)


# --- the router ---------------------------------------------------------------------------------

class Router:
    """Runs tapes on the server its policy picks, moving inputs server to server.

    Args:
        policy: ``phase-split`` or ``semantic`` (``fixed`` needs no router).
        clients: the sessions, one per server; ``remote_accelerator:N``'s own server is
            ``clients[N % len(clients)]``.
        costs: the cost model (default: the process's, :func:`genie.remote.cost.model`).
    """

    def __init__(self, policy: str, clients: list[Client], costs: CostModel | None = None
                 ) -> None:
        check_policy(policy, len(clients))
        if policy == "fixed":
            raise ValueError("placement 'fixed' runs without a router")
        self.policy = policy
        self.clients = clients
        self.costs = costs if costs is not None else model()
        # primary -> {server: (replica, version of its storage when copied)}
        self._replicas: weakref.WeakKeyDictionary[Handle, dict[Client, tuple[Handle, int]]] = \
            weakref.WeakKeyDictionary()
        self._versions: weakref.WeakKeyDictionary[Storage, int] = weakref.WeakKeyDictionary()
        # the live primaries of each storage (whether a storage can move: it has one value)
        self._values: weakref.WeakKeyDictionary[Storage, weakref.WeakSet[Handle]] = \
            weakref.WeakKeyDictionary()
        if policy == "semantic":
            for c in clients:
                c.watch_load = True

    def close(self) -> None:
        for c in self.clients:
            c.watch_load = False
        self._replicas.clear()

    # --- running -------------------------------------------------------------------------------
    def run(self, tape: Tape, index: int, nodes: list[Node] | None = None,
            pin: bool = False) -> dict[int, Any]:
        """Run ``tape`` (ops of ``remote_accelerator:index``; ``nodes``: the nodes of its
        instructions, default ``tape.nodes``) where the policy says, or on the device's own
        server with ``pin``; the kept values by slot, as :meth:`Client.run` returns them."""
        nodes = tape.nodes if nodes is None else nodes
        prof = profile(tape, nodes, self.clients)
        home = self.clients[index % len(self.clients)]
        target = home if pin and not prof.pinned else self._target(prof, tape, home, index)
        inputs = self._bring(prof, tape, target)
        routed = dataclasses.replace(tape, inputs=inputs) if inputs is not tape.inputs else tape
        kept = target.run(routed)
        self._after(prof, tape, nodes, kept)
        bump("placement.tapes")
        if target is not home:
            bump("placement.moved")
        return kept

    def _target(self, prof: Profile, tape: Tape, home: Client, index: int) -> Client:
        if prof.pinned:
            by: dict[Client, int] = {}
            for i in prof.pinned:
                c = i.primary.client
                by[c] = by.get(c, 0) + i.nbytes
            if len(by) == 1:
                return next(iter(by))
            return max(by, key=lambda c: (by[c], c is home))  # the others move there
        if self.policy == "phase-split":
            if prof.kind == "decode":
                return self.clients[(index + 1) % len(self.clients)]
            if prof.kind == "compute":
                return home
            return self._local(prof, home)
        if prof.kind == "decode":
            kv: dict[Client, int] = {}
            for i in prof.inputs:
                if i.kv:
                    c = i.primary.client
                    kv[c] = kv.get(c, 0) + i.nbytes
            if kv:
                return max(kv, key=lambda c: (kv[c], c is home))
            return self._local(prof, home)
        if prof.kind == "compute":
            return self._cheapest(prof, tape, home)
        return self._local(prof, home)

    def _present(self, inp: Input, c: Client) -> bool:
        return inp.primary.client is c or self._replica(inp, c) is not None

    def _local(self, prof: Profile, home: Client) -> Client:
        """The server holding most of the inputs' bytes (ties: the device's own server)."""
        best, best_b = home, -1
        for c in [home, *[c for c in self.clients if c is not home]]:
            b = sum(i.nbytes for i in prof.inputs if self._present(i, c))
            if b > best_b:
                best, best_b = c, b
        return best

    def _cheapest(self, prof: Profile, tape: Tape, home: Client) -> Client:
        """Where a compute-heavy tape should finish first (see the module docstring)."""
        local = self._local(prof, home)
        work = self._work(tape)
        est = {c: self._estimate(prof, work, c) for c in self.clients if c.alive}
        if not est:
            return local
        best = min(est, key=lambda c: (est[c], c is not local))
        if local in est and best is not local and est[best] >= MARGIN * est[local]:
            best = local
        if best is not local:
            logger.debug("genie: placement moves a %d-op tape to %s (%.4f s estimated, %.4f s "
                         "on %s)", work.ops, best.address, est[best], est.get(local, 0.0),
                         local.address)
        return best

    def _estimate(self, prof: Profile, work: Work, c: Client) -> float:
        """Seconds for ``c`` to run the tape: its missing inputs' transfers, then its compute
        slowed by the other sessions' load there."""
        c.open()
        missing: dict[Client, int] = {}  # one send per source server
        for i in prof.inputs:
            if not self._present(i, c):
                missing[i.primary.client] = missing.get(i.primary.client, 0) + i.nbytes
        t = sum(self.costs.transfer_s(n, src.address, c.address) for src, n in missing.items())
        load, at = c.load
        if time.monotonic() - at > LOAD_MAX_AGE:
            load = 0.0
        return t + self.costs.compute_s(work.flops, c.address, work.ops) * (1.0 + load)

    @staticmethod
    def _work(tape: Tape) -> Work:
        """The tape's FLOPs and ops (memoized on its plan: the cost is meta tensors per op)."""
        plan = tape.plan
        if plan is not None:
            w = plan.artifacts.get("placement.work")
            if w is None:
                w = plan.artifacts["placement.work"] = flops_of(tape)
            return w
        return flops_of(tape)

    # --- moving inputs ---------------------------------------------------------------------------
    def _version(self, st: Storage | None) -> int:
        return self._versions.get(st, 0) if st is not None else -1

    def _replica(self, inp: Input, c: Client) -> Handle | None:
        reps = self._replicas.get(inp.primary)
        if reps is None or inp.storage is None:
            return None
        got = reps.get(c)
        if got is None:
            return None
        if got[1] != self._version(inp.storage) or not c.alive:
            del reps[c]  # a stale copy: freed on its server
            return None
        return got[0]

    def _bring(self, prof: Profile, tape: Tape, target: Client) -> dict[int, Any]:
        """The tape's inputs as ``target`` holds them: replicas made (server to server) for
        those held elsewhere; pinned ones held elsewhere move (see the module docstring)."""
        pinned = {id(i) for i in prof.pinned}
        out: dict[int, Any] | None = None
        todo: dict[Client, list[Input]] = {}
        for i in prof.inputs:
            v = tape.inputs[i.slot]
            if i.primary.client is target:
                if v is not i.primary:  # a host tensor's upload on this server
                    out = out if out is not None else dict(tape.inputs)
                    out[i.slot] = i.primary
                continue
            if id(i) in pinned:
                self._check_movable(i, target)
            rep = self._replica(i, target)
            if rep is not None:
                out = out if out is not None else dict(tape.inputs)
                out[i.slot] = rep
                if id(i) in pinned:
                    self._promote(i, rep)
                continue
            todo.setdefault(i.primary.client, []).append(i)
        for src, items in todo.items():
            uniq: dict[int, Handle] = {}
            for i in items:
                uniq.setdefault(id(i.primary), i.primary)
            got = dict(zip(uniq, src.send(list(uniq.values()), target), strict=True))
            out = out if out is not None else dict(tape.inputs)
            for i in items:
                h = got[id(i.primary)]
                out[i.slot] = h
                if id(i) in pinned:
                    self._promote(i, h)
                elif i.storage is not None:
                    self._replicas.setdefault(i.primary, {})[target] = \
                        (h, self._version(i.storage))
            bump("placement.replicas", len(uniq))
        return out if out is not None else tape.inputs

    def _check_movable(self, inp: Input, target: Client) -> None:
        """A pinned input held away from the chosen server may move only if it is the only
        live value of its storage (moving one view would break its sharing with the others)."""
        st = inp.storage
        vals = self._values.get(st) if st is not None else None
        others = [h for h in (vals or ()) if h is not inp.primary]
        if inp.owner is None or others:
            raise PlacementError(
                inp.primary.client.address,
                f"a tape writes (or keeps views of) values whose memory lives on several "
                f"servers ({inp.primary.client.address} and {target.address}), and a value "
                f"held on {inp.primary.client.address} shares its memory with "
                f"{len(others)} other live value(s), so it cannot move without breaking eager's "
                "aliasing. Materialize the values on one device first, or connect with "
                "placement='fixed' (GENIE_PLACEMENT=fixed)")

    def _promote(self, inp: Input, h: Handle) -> None:
        """``h`` (on the chosen server) becomes the value of ``inp``'s node: the value moved."""
        assert inp.owner is not None
        node, out = inp.owner
        old = inp.primary
        if node.values is not None and node.values[out] is old:
            node.values[out] = h
        self._replicas.pop(old, None)
        st = inp.storage
        if st is not None:
            vals = self._values.get(st)
            if vals is not None:
                vals.discard(old)
            self._values.setdefault(st, weakref.WeakSet()).add(h)
        bump("placement.migrated")

    def _after(self, prof: Profile, tape: Tape, nodes: list[Node], kept: dict[int, Any]) -> None:
        """After a run: written storages get a new version (their inputs' replicas are freed
        now, others' are refused when next looked up); kept values are registered by storage."""
        for st in prof.written:
            self._versions[st] = self._versions.get(st, 0) + 1
        if prof.written:
            for i in prof.inputs:
                if i.storage in prof.written:
                    self._replicas.pop(i.primary, None)
        slots = tape.slots
        for n in nodes:
            for k, m in enumerate(n.metas):
                if m is None:
                    continue
                v = kept.get(slots.get((n.index, k)))  # type: ignore[arg-type]
                st = n.storage(k)
                if type(v) is Handle and st is not None:
                    vals = self._values.get(st)
                    if vals is None:
                        vals = self._values[st] = weakref.WeakSet()
                    vals.add(v)
