"""Residency under memory pressure, the client's half: what each resident value is, and how to
get it back once evicted.

The server knows bytes exactly (shared storages, the pending tape's peak on meta tensors); the
client knows meaning (roles, from :mod:`genie.context`) and how each value was made. So:

1. **Hints.** Each run request names the roles of resident values (``ev``: handle id and role
   code pairs, :data:`~genie.remote.protocol.ROLES`). A value's hint goes out with the request
   *after* the one that made it, when its role is settled (a decode step's new KV cache is known
   as one when the next step receives it). A hinted value is evictable; the server takes
   activations first, then gradients, inputs, optimizer state, weights and KV caches, least
   recently used first within a role, and never a weight or KV cache while the session decodes.
   Only values whose layout a re-upload reproduces (storage offset 0, dense strides) are hinted.
2. **Pressure.** A request that would pass the quota is answered ``pressure`` with victims;
   :meth:`Residency.relieve` evicts them (frees ride on the request sent again) after choosing,
   for each, how it will come back, by the cost model (:mod:`genie.remote.cost`):

   - ``recompute``: re-run the tape that made it (its *recipe*: the instructions, the handles it
     read, its host constants), keeping only the evicted values, under their old handle ids.
     Valid while nothing it read, and the value itself, was written since (write epochs of the
     graph's storages, host tensors' version counters) and it did not write its own inputs;
   - ``upload``: send its host source again: the snapshot it was uploaded from, or a copy
     downloaded at eviction (a *spill*, when no source exists: one download now).

   Cost: ``recompute_s = ops * op_s + flops / flop_rate (+ its host constants' upload)`` against
   ``transfer_s = upload (+ download now, for a spill)``; the cheaper wins.
3. **Restore.** A tape that reads an evicted value brings it back first: uploads ride inside the
   tape itself (an input upload under the old id: no extra round trip); recomputes go in one
   request per recipe before it (deps restored first, recursively). A tape that writes a storage
   an evicted value's recipe read restores that value before it runs. Downloads of an evicted
   value read its host copy, or restore it.

Recipes and upload sources are recorded from the session's first pressure on (a session that
never meets its quota pays nothing but the hints); values made before can still be spilled.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import context
from ..errors import GenieError
from ..graph import Ref
from ..planner import Tape
from ..stats import bump
from .cost import CLIENT, Choice, Work, flops_of, model
from .handle import Handle
from .protocol import ROLE_CODE

if TYPE_CHECKING:
    from .client import Client


#: nodes from a tape's end searched for its phase
PHASE_SCAN = 256
#: entries of :attr:`Residency.live` before its dead ones are first dropped
PRUNE_LIVE = 1024
#: metadata objects whose layout and size :meth:`Residency.ran` remembers (then forgets all)
SIZED_MEMORY = 4096


@dataclass(slots=True, eq=False)
class Recipe:
    """How a run made its kept values: enough to make them again.

    ``inputs``: slot -> weak reference to the :class:`~genie.remote.client.Handle` read, or a
    host tensor; ``deps``: the graph storages read, with their write epochs then; ``host``: host
    tensors sent (instruction constants, host inputs) with their versions then.
    """

    instrs: list[Any]
    inputs: dict[int, Any]
    index: int
    deps: tuple[tuple[Any, int], ...]
    host: tuple[tuple[torch.Tensor, int], ...]
    host_bytes: int
    work: Work | None = None


class Resident:
    """What the client knows of one resident value to evict and restore it."""

    __slots__ = ("role", "nbytes", "storage", "epoch", "source", "recipe", "slot", "evicted",
                 "pins")

    def __init__(self, role: str | None, nbytes: int) -> None:
        self.role = role  # None until hinted
        self.nbytes = nbytes
        self.storage: Any = None  # the graph Storage of the value (None: not tracked)
        self.epoch = 0
        self.source: tuple[torch.Tensor, int] | None = None  # host copy and its version
        self.recipe: Recipe | None = None
        self.slot = -1  # the value's slot in its recipe
        self.evicted: str | None = None  # "recompute" or "upload" while evicted
        self.pins: list[Any] = []  # handles a recompute needs, held while evicted


def dense(meta: Any) -> bool:
    """Whether a re-upload of a value with this metadata reproduces its layout: offset 0 and
    strides that tile its elements exactly (a permutation of contiguous strides)."""
    if meta is None or meta.offset != 0 or getattr(meta, "conj", False) or \
            getattr(meta, "neg", False):
        return False
    expect = 1
    for sz, st in zip(reversed(meta.shape), reversed(meta.stride)):  # contiguous: most are
        if sz != 1:
            if st != expect or sz == 0:
                break
            expect *= sz
    else:
        return True
    dims = sorted((st, sz) for sz, st in zip(meta.shape, meta.stride) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


def _nbytes(meta: Any) -> int:
    n = 1
    for s in meta.shape:
        n *= s
    return n * meta.dtype.itemsize


class Residency:
    """The residency state of one :class:`~genie.remote.client.Client` (used under its lock)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.recording = False  # recipes and sources: from the first pressure on
        self.epochs: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.seq = 0
        self.pending: list[tuple[weakref.ref, Any, int]] = []  # (handle, node, out) to hint
        # id -> the handle (a weak reference), hinted and not evicted; dead entries are dropped
        # when the map has doubled (a WeakValueDictionary's callbacks cost ~2 us a value: 18
        # values a GPT-2 token)
        self.live: dict[int, weakref.ref[Handle]] = {}
        self._prune_at = PRUNE_LIVE
        # id of a value's metadata -> (the metadata, dense, bytes): what ran() hints by
        self._sized: dict[int, tuple[Any, bool, int]] = {}
        self.evicted: weakref.WeakValueDictionary[int, Handle] = weakref.WeakValueDictionary()

    # --- per request ------------------------------------------------------------------------
    def hints(self, extra: list[Handle]) -> list[int]:
        """The ``ev`` list of the next request: pending values (roles read now) and ``extra``
        (values this request puts back or uploads, roles known)."""
        ev: list[int] = []
        for wh, wn, k in self.pending:
            h = wh()
            if h is None or h.res is None or h.res.evicted is not None:
                continue
            n = wn() if wn is not None else None
            r = h.res
            if n is not None:
                r.role = context.node_role(n, k)
            ev += (h.id, ROLE_CODE[r.role or "activation"])
        for h in extra:
            if h.res is not None and h.res.role is not None:
                ev += (h.id, ROLE_CODE[h.res.role])
        return ev

    @staticmethod
    def decoding(tape: Tape) -> bool:
        """Whether ``tape`` is a decode step: its last node recorded in a module call (among
        the last :data:`PHASE_SCAN` nodes) says so."""
        nodes = tape.nodes
        for i in range(len(nodes) - 1, max(len(nodes) - PHASE_SCAN, 0) - 1, -1):
            c = nodes[i].ctx
            if c is not None and (c.call is not None or c.explicit is not None):
                return c.phase == "decode"
        return False

    def before_run(self, tape: Tape) -> None:
        """Restore by recompute what ``tape`` reads, and what a write of ``tape`` would make
        impossible to recompute later (values whose recipe read a storage it writes)."""
        c = self.client
        need = [v for v in tape.inputs.values() if type(v) is Handle and v.client is c and
                v.res is not None and v.res.evicted == "recompute"]
        writes = {st for n in tape.nodes for st in n.writes}
        if writes:
            for h in list(self.evicted.values()):
                r = h.res
                if r is not None and r.evicted == "recompute" and h not in need and \
                        any(st in writes for st, _ in r.recipe.deps):  # type: ignore[union-attr]
                    need.append(h)
        if need:
            self.restore(need)

    def ran(self, tape: Tape, kept: dict[int, Any], owners: dict[int, tuple[Any, int]],
            uploaded: list[Handle], restored: list[Handle]) -> None:
        """After a run: count its writes, note its new values (to hint next time; with their
        recipe and source once recording), mark what came back."""
        self.pending.clear()
        for h in restored:
            self._back(h, "upload")
        if self.recording:
            self.seq += 1
            seq = self.seq
            for n in tape.nodes:
                for st in n.writes:
                    self.epochs[st] = seq
        recipe: Recipe | None = None
        made = False
        inputs = tape.inputs
        live = self.live
        pending = self.pending
        sized = self._sized
        for s, h in kept.items():
            if s in inputs or type(h) is not Handle or h.res is not None:
                continue
            n, k = owners.get(s, (None, 0))
            m = h.meta
            if m is None:
                continue
            # (a step's nodes share their metadata objects with the steps before, where their
            # shapes are the same: dense and size read once per object)
            got = sized.get(id(m))
            if got is None or got[0] is not m:
                got = self.size_of(m)
            if not got[1]:
                continue  # a re-upload would not reproduce its layout: never hinted
            r = h.res = Resident(None, got[2])
            wh = weakref.ref(h)
            live[h.id] = wh
            pending.append((wh, weakref.ref(n) if n is not None else None, k))
            if not self.recording or n is None:
                continue
            r.storage = n.storage(k)
            r.epoch = self.epochs.get(r.storage, 0) if r.storage is not None else 0
            if n.op == "genie.upload" and n.leaves and isinstance(n.leaves[0], torch.Tensor):
                src = n.leaves[0]  # the upload's snapshot: a host source
                if tuple(src.shape) == m.shape and tuple(src.stride()) == m.stride:
                    r.source = (src, src._version)
                continue
            if not made:
                made = True
                recipe = self._recipe(tape)
            if recipe is not None:
                r.recipe, r.slot = recipe, s
        for h in uploaded:
            if h.res is None and h.meta is not None and dense(h.meta):
                h.res = Resident("input", _nbytes(h.meta))
                self.note(h)
                pending.append((weakref.ref(h), None, 0))
        self.pruned()

    def size_of(self, m: Any) -> tuple[Any, bool, int]:
        """``(m, dense(m), bytes)`` of a value's metadata ``m``, kept by its id for the next
        step's values that share it (:meth:`ran`, ``genie._C._client_book``)."""
        sized = self._sized
        if len(sized) >= SIZED_MEMORY:
            sized.clear()
        got = sized[id(m)] = (m, dense(m), _nbytes(m))  # (m held: its id is its own)
        return got

    def pruned(self) -> None:
        """Drop the dead entries of :attr:`live` once it has doubled."""
        live = self.live
        if len(live) > self._prune_at:
            self.live = {i: w for i, w in live.items() if w() is not None}
            self._prune_at = max(PRUNE_LIVE, 2 * len(self.live))

    def note(self, h: Handle) -> None:
        """``h`` is resident and hinted: the server may name it as a victim."""
        self.live[h.id] = weakref.ref(h)

    def handle(self, hid: int) -> Handle | None:
        """The live, hinted, resident handle of id ``hid``, if any."""
        w = self.live.get(hid)
        return w() if w is not None else None

    def _recipe(self, tape: Tape) -> Recipe | None:
        """The recipe of ``tape``'s kept values, or None when re-running it would not give them
        (it writes what it reads, or reads values of another server)."""
        c = self.client
        slots = tape.slots
        in_storage: dict[int, Any] = {}
        for n in tape.nodes:
            for x in n.leaves or ():
                if type(x) is Ref:
                    s = slots.get((x.node.index, x.out))
                    if s is not None and s in tape.inputs and s not in in_storage:
                        in_storage[s] = x.node.storage(x.out)
        writes = {st for n in tape.nodes for st in n.writes}
        inputs: dict[int, Any] = {}
        host: list[tuple[torch.Tensor, int]] = []
        deps = []
        for s, v in tape.inputs.items():
            st = in_storage.get(s)
            if st is not None:
                if st in writes:
                    return None  # it writes what it read: running it again would not do
                deps.append((st, self.epochs.get(st, 0)))
            if type(v) is Handle:
                if v.client is not c:
                    return None
                inputs[s] = weakref.ref(v)
            elif isinstance(v, torch.Tensor):
                inputs[s] = v
                host.append((v, v._version))
            else:
                return None
        nbytes = sum(t.numel() * t.element_size() for t, _ in host)
        for ins in tape.instrs:
            for x in ins.leaves:
                if isinstance(x, torch.Tensor):
                    host.append((x, x._version))
                    nbytes += x.untyped_storage().nbytes()
        return Recipe(tape.instrs, inputs, tape.index, tuple(deps), tuple(host), nbytes)

    # --- validity -------------------------------------------------------------------------
    def _unchanged(self, r: Resident) -> bool:
        return r.storage is not None and self.epochs.get(r.storage, 0) == r.epoch

    def source_ok(self, r: Resident) -> bool:
        """Whether ``r``'s host source still holds its value."""
        return r.source is not None and r.source[0]._version == r.source[1] and \
            (r.evicted is not None or self._unchanged(r))

    def recipe_ok(self, r: Resident) -> bool:
        """Whether re-running ``r``'s recipe gives its value now."""
        rec = r.recipe
        if rec is None or not (r.evicted is not None or self._unchanged(r)):
            return False
        for v in rec.inputs.values():
            if type(v) is weakref.ref and v() is None:
                return False
        return all(self.epochs.get(st, 0) == e for st, e in rec.deps) and \
            all(t._version == ver for t, ver in rec.host)

    def work(self, rec: Recipe) -> Work:
        if rec.work is None:
            metas = {s: (v() if type(v) is weakref.ref else v) for s, v in rec.inputs.items()}
            rec.work = flops_of(rec.instrs, {s: v.meta if hasattr(v, "meta") else v
                                             for s, v in metas.items()})
        return rec.work

    def choose(self, h: Handle) -> tuple[str, Choice | None]:
        """How an evicted ``h`` will come back: ``recompute``, ``upload`` (a host source) or
        ``spill`` (download now, upload later), by the cost model where there is a choice."""
        r = h.res
        assert r is not None
        addr = self.client.address
        m = model()
        have_src = self.source_ok(r)
        up = m.transfer_s(r.nbytes, CLIENT, addr)
        tr = up if have_src else up + m.transfer_s(r.nbytes, addr, CLIENT)
        if self.recipe_ok(r):
            assert r.recipe is not None
            w = self.work(r.recipe)
            rec = m.compute_s(w.flops, addr, w.ops) + (
                m.transfer_s(r.recipe.host_bytes, CLIENT, addr) if r.recipe.host_bytes else 0.0)
            ch = Choice("recompute" if rec < tr else "transfer", rec, tr)
            if ch.kind == "recompute":
                return "recompute", ch
            return ("upload" if have_src else "spill"), ch
        return ("upload" if have_src else "spill"), None

    # --- eviction and restore ---------------------------------------------------------------
    def relieve(self, victims: list[int]) -> None:
        """Evict the server's ``victims`` (their frees go with the next request)."""
        c = self.client
        bump("pressure_events")
        self.recording = True
        spill: list[Handle] = []
        plan: list[tuple[Handle, str]] = []
        for hid in victims:
            if type(hid) is not int:
                continue
            h = self.handle(hid)
            if h is None or h.res is None or h.res.evicted is not None:
                continue  # dead (its free is on its way) or already gone
            mode, _ = self.choose(h)
            if mode == "spill":
                spill.append(h)
                mode = "upload"
            plan.append((h, mode))
        if spill:
            for h, t in zip(spill, c._download(spill), strict=True):
                assert h.res is not None
                h.res.source = (t, t._version)
                bump("evictions.spilled")
                bump("spill_bytes", h.res.nbytes)
        for h, mode in plan:
            r = h.res
            assert r is not None
            if mode == "recompute":
                assert r.recipe is not None
                r.pins = [v() for v in r.recipe.inputs.values() if type(v) is weakref.ref]
            r.evicted = mode
            self.live.pop(h.id, None)
            self.evicted[h.id] = h
            c._pending_free.append(h.id)
            bump("evictions")
            bump(f"evictions.{r.role or 'activation'}")
            bump("evict_bytes", r.nbytes)
            if mode == "recompute":
                bump("evictions.dropped")

    def _back(self, h: Handle, how: str) -> None:
        r = h.res
        assert r is not None
        r.evicted = None
        r.pins = []
        self.evicted.pop(h.id, None)
        self.note(h)
        if r.storage is not None:
            r.epoch = self.epochs.get(r.storage, 0)
        bump(f"restores.{how}")
        bump("restore_bytes", r.nbytes)

    def restore(self, handles: list[Handle]) -> None:
        """Recompute evicted ``handles`` (one request per recipe; what they read first)."""
        groups: dict[Recipe, list[Handle]] = {}
        for h in handles:
            r = h.res
            if r is not None and r.evicted == "recompute" and r.recipe is not None:
                groups.setdefault(r.recipe, []).append(h)
        for rec, hs in groups.items():
            ins: dict[int, Any] = {}
            for s, v in rec.inputs.items():
                d = v() if type(v) is weakref.ref else v
                if d is None:
                    raise GenieError(
                        f"[genie residency] an evicted value (handle #{hs[0].id}) cannot be "
                        "recomputed: a value its recipe read is gone. This is a bug in Genie's "
                        "eviction (its inputs are held while it is evicted); please report it")
                ins[s] = d
            deps = [d for d in ins.values() if getattr(d, "res", None) is not None and
                    d.res.evicted == "recompute"]
            if deps:
                self.restore(deps)
            if not all(self.epochs.get(st, 0) == e for st, e in rec.deps):
                raise GenieError(
                    f"[genie residency] an evicted value (handle #{hs[0].id}) cannot be "
                    "recomputed: a value its recipe read was written since. Genie restores "
                    "such values before the write; please report this as a bug")
            keep = {h.res.slot for h in hs if h.res is not None}
            by_slot = {h.res.slot: h for h in hs if h.res is not None}
            tape = Tape(rec.instrs, ins, [], keep, [], {}, rec.index)
            self.client._restore_run(tape, [by_slot[s] for s in sorted(keep)])
            for h in hs:
                self._back(h, "recompute")

    def download_evicted(self, handles: list[Handle]) -> dict[int, torch.Tensor]:
        """Values of evicted ``handles`` for a download: host copies (cloned: the caller owns
        them), after recomputing those without one; keyed by position."""
        rec = [h for h in handles if h.res is not None and h.res.evicted == "recompute"]
        if rec:
            self.restore(rec)
        out = {}
        for i, h in enumerate(handles):
            r = h.res
            if r is not None and r.evicted == "upload" and r.source is not None:
                out[i] = r.source[0].clone(memory_format=torch.preserve_format)
        return out


__all__ = ["Recipe", "Resident", "Residency", "dense"]

