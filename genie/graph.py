"""The recorded graph: nodes, tensor metadata and storage identity.

A :class:`Node` is one recorded call of an ATen overload (or a factory/upload). Its argument tree
holds :class:`Ref` leaves (an output of an earlier node) and constants. Liveness is Python's own:
a ``LazyTensor`` holds its producer node strongly, a node holds its input nodes strongly and counts
its output tensors (never holds them), so the graph that still matters is exactly what live
tensors can reach.
Once a node has run, it drops its inputs (graph truncation) and keeps only the values that a live
tensor or a pending consumer still needs.

Mutation is recorded imperatively, in the order the program issued it (see docs/semantics.md):
every output belongs to a :class:`Storage` (views share their base's), a node that writes a storage
is appended to ``Storage.pending_writes``, and the planner closes a slice over those writes and
over earlier readers (write-after-read), so running a slice in record order on real tensors
reproduces eager aliasing exactly.

Invariants:
- ``Node.index`` is unique and increases with record order, process-wide; it orders execution.
- ``Node.uid`` (``op*N``) is deterministic per :class:`Graph`: same program, same ids.
- A node runs at most once (``Node.executed``); its ``values`` are never recomputed.

This module is the bottom of the core: it imports nothing from Genie, and every other core module
(meta inference, planner, executor, the tensor facade) builds on its types.
"""

from __future__ import annotations

import copyreg
import functools
import gc
import itertools
import math
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch

from ._C import Alive
from ._C import Node as _NativeNode
from ._C import (_default_seq_len, _default_seq_note, _default_seq_of, _gc_retrack_below,
                 _gc_retrack_writers, _gc_track, _gc_untrack, _gc_untrack_node,
                 _wrapper_in_impl, _wrapper_release)
from .config import config

_record_counter = itertools.count()
_graph_task_id = torch._C._current_graph_task_id


class _Current(threading.local):
    """What this thread is recording under (set by :mod:`genie.context`'s hooks; nodes take
    ``ctx`` at creation). ``backward``: the context of ops the autograd engine records outside
    any module (None until :mod:`genie.context` is active). Class attributes are the defaults of
    every thread."""

    ctx: Any = None
    backward: Any = None


current = _Current()


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, stride, storage offset, dtype and device index of one lazy value."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    index: int  # remote_accelerator device index
    # Math bits of complex views (``x.conj()``, ``x.conj().imag``): part of what the values mean,
    # and composite code branches on them (``resolve_conj``), so a LazyTensor carries them.
    conj: bool = False
    neg: bool = False

    @staticmethod
    def of(t: torch.Tensor, index: int) -> TensorMeta:
        return TensorMeta(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, index,
                          t.is_conj(), t.is_neg())


def meta_tensor(m: TensorMeta) -> torch.Tensor:
    """A meta tensor with ``m``'s shape, stride, offset, dtype and math bits (no data)."""
    if m.offset == 0:
        t = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
    else:
        extent = 1 + sum((s - 1) * st for s, st in zip(m.shape, m.stride) if s > 0)
        if any(s == 0 for s in m.shape):
            extent = 0
        base = torch.empty((m.offset + extent,), dtype=m.dtype, device="meta")
        t = base.as_strided(m.shape, m.stride, m.offset)
    if m.conj:
        torch._C._set_conj(t, True)
    if m.neg:
        torch._C._set_neg(t, True)
    return t


@dataclass(frozen=True, slots=True)
class MetaArg:
    """An argument used only for its metadata (``zeros_like(x)`` never needs ``x``'s values)."""

    meta: TensorMeta


class Ref:
    """An argument that is the ``out``-th output of ``node`` (a lazy value).

    A plain slotted class, not a frozen dataclass: one is made per lazy input of every recorded
    op, and a frozen dataclass's ``__init__`` costs several times more.
    """

    __slots__ = ("node", "out")

    def __init__(self, node: Node, out: int) -> None:
        self.node = node
        self.out = out

    def __repr__(self) -> str:
        return f"Ref({self.node.uid}, {self.out})"


def same_const(a: Any, b: Any) -> bool:
    """Whether two recorded constants are the same value: the one equality of constants that
    the plan cache (is a step's constant a change?) and the wire protocol (which constants
    travel in a delta?) both use.

    Tells ``1`` from ``True`` from ``1.0`` (types must match) and ``-0.0`` from ``0.0``; a NaN
    equals a NaN (a NaN constant that repeats is not a change). Values whose ``==`` fails or is
    not a truth value (tensors) count as different unless they are the same object.

    >>> same_const(float("nan"), float("nan")), same_const(0.0, -0.0), same_const(1, True)
    (True, False, False)
    """
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is float:
        if a != a:
            return b != b
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    try:
        return bool(a == b)
    except Exception:
        return False


P = ParamSpec("P")
R = TypeVar("R")


def gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` with CPython's cyclic garbage collector paused (when it was enabled).

    Planning a slice allocates a few objects per node (instructions, slot lists, plan columns);
    with a large graph alive (1.5M tracked objects for a 100k-node chain) the collections those
    allocations trigger walk the whole heap, and made planning a 10k-node slice ~10x slower per
    node than with the collector paused (``bench_engine.py::test_plan`` with
    ``GENIE_BENCH_LARGE=1``). No cycle these functions create needs collecting before they return;
    the allocations still count, so the collector runs at its next trigger after the call.
    Nested calls leave it to the outermost; a collector someone else disabled stays disabled.
    Only for pure CPU-bound work: the pause is process-wide, so nothing that waits (execution, a
    server's reply) runs inside it.
    """
    @functools.wraps(fn)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


# Pending-write entries over all storages: an upper bound of the true count, never below it (a
# storage that dies with pending writes leaves it high). While it is 0 no storage has a pending
# write, and the plan cache skips checking the storages a plan that does not write reads
# (genie.plan_cache.match).
pending_total = [0]


class Storage:
    """Identity of one lazy storage, shared by a base value and all views of it.

    ``pending_writes`` are recorded, not yet executed nodes that mutate this storage, in record
    order: the shared empty tuple until the first write (most storages are never written, and a
    list per recorded output cost an allocation at record and a free at teardown), then a list.
    ``readers`` are weak references to pending nodes that read it (for write-after-read): the
    shared empty tuple until the first reader, then a list (an output read by no pending node,
    as a step's last values, never makes one). Readers that died or ran are dropped when the list
    doubles (:meth:`add_reader`), when binding meets a long one, and where a writing plan's column
    match reads the list (csrc/match.cpp).
    ``role`` is set where a storage's meaning is known for its whole life (the upload of a
    parameter: ``weight``), so in-place updates and views keep it (:func:`genie.context.node_role`).
    """

    __slots__ = ("pending_writes", "readers", "_prune_at", "role", "__weakref__")

    def __init__(self) -> None:
        self.pending_writes: list[Node] | tuple[()] = ()
        self.readers: list[weakref.ref[Node]] | tuple[()] = ()
        self._prune_at = 64
        self.role: str | None = None

    def add_writer(self, node: Node, deferred: bool = False) -> None:
        """Note a pending write. A pending writer is the one edge that can close a cycle
        (storage -> writer -> its inputs -> a node whose ``storages`` hold this storage), so the
        storage and this list go back under the cyclic GC (record may have taken them off), or,
        ``deferred``, only if the writer stays pending (:func:`defer_writer`)."""
        pw = self.pending_writes
        if type(pw) is tuple:
            pw = self.pending_writes = []
            if deferred:
                _gc_untrack(pw)
        pw.append(node)
        if not deferred:
            _gc_track(self, pw)

    def prune_readers(self) -> None:
        """Drop the readers that died or ran."""
        self.readers = [w for w in self.readers if (n := w()) is not None and not n.executed]

    def add_reader(self, r: weakref.ref[Node]) -> None:
        """Note a pending reader; readers that died or ran are pruned when the list doubles.

        A weight read every step and never written by a run (no ``_bind`` prunes it) would
        otherwise grow its list forever.
        """
        readers = self.readers
        if type(readers) is tuple:
            readers = self.readers = list(readers)
        readers.append(r)
        if len(readers) >= self._prune_at:
            self.prune_grown()

    def prune_grown(self) -> None:
        """:meth:`add_reader`'s pruning, once the list reached ``_prune_at``."""
        self.readers = readers = [w for w in self.readers
                                  if (n := w()) is not None and not n.executed]
        self._prune_at = max(64, 2 * len(readers))


class Node(_NativeNode):
    """One recorded op.

    The fields are ``genie._C.Node``'s (csrc/node.cpp: a native struct, read and written by the
    natives through its member offsets); this class adds only methods and properties. The
    native type's deallocator keeps the cyclic collector's young count where it was when a node
    is freed outside Genie's own code (a pending graph dropped unread), see csrc/node.cpp.

    Attributes:
        op: the ``torch._ops.OpOverload`` (or a Genie pseudo-op such as ``genie.upload``).
        leaves / spec: the flattened ``(args, kwargs)`` tree; lazy inputs are :class:`Ref`.
            The arguments are inline in the native node (a lazy input is its producer node and
            output number), so ``leaves`` is a new list of fresh Refs on each read (None once
            the node ran); :meth:`leaf`, ``n_leaves`` and :meth:`refs` read them without it.
        metas: one :class:`TensorMeta` per tensor output (None for non-tensor outputs).
        out_spec: tree spec to rebuild the op's return value from its flat outputs.
        storages: the :class:`Storage` of each tensor output (a property: a single output's is
            held inline, as ``_st``; :meth:`storage` reads one without making a list).
        writes: storages this node mutates.
        outputs: each output's liveness (as ``storages``: ``_out``, :meth:`output`): on the
            default graph the count of live holders (None until a tensor is bound; csrc/node.h
            ``out_count_add``), on a capture graph a weak reference to its tensor. Read it with
            :meth:`live`.
        n_consumers: how many argument references recorded nodes made to an output while this
            node was pending (dead and executed consumers still count); 0 once it ran. The
            consumers themselves are found through the output storages' readers
            (:attr:`consumers`).
        values: real tensors after execution (only those still needed are kept; a tuple of
            Nones when none is, as for most intermediates of a run).
        rng: ``(seed, offset)`` for random ops, fixed at record time.
        graph / uid: the owning :class:`Graph` and the node's deterministic unique id, ``op*N``
            (a property: ``seq`` is N, the node's record position in its graph, so recording
            makes no string per node; on the default graph no int either, see :class:`Graph`).
        where: the user's source line (only with ``GENIE_RECORD_SOURCE=1`` or in capture).
        entry: the meta-cache entry the op was recorded with (None for uploads and pseudo-ops).
            Entries are interned per meta-cache key (op, argument tree, input metadata,
            non-float constants), so ``a.entry is b.entry`` proves those equal: the plan cache
            compares nodes by it (:mod:`genie.plan_cache`).
    """

    __slots__ = ()  # the fields are the native base's (csrc/node.cpp): none of its own

    # the native base's fields, in its order (copying: __getstate__)
    _FIELDS = (
        "op", "leaves", "spec", "metas", "out_spec", "_st", "writes", "_out",
        "values", "executed", "index", "rng", "graph", "_seq", "where", "n_consumers",
        "tags", "entry", "ctx", "_wref",
    )

    def __init__(self, op: Any, leaves: list[Any], spec: Any, metas: list[TensorMeta | None],
                 out_spec: Any, storages: list[Storage | None], writes: tuple[Storage, ...],
                 graph: Graph, rng: tuple[int, int] | None = None) -> None:
        self.op = op
        self.leaves = leaves
        self.spec = spec
        self.metas = metas
        self.out_spec = out_spec
        # a single output's storage and liveness inline, a list otherwise (no list per node)
        one = len(metas) == 1
        self._st: Storage | None | list[Storage | None] = storages[0] if one else storages
        self.writes = writes
        self._out: Liveness | list[Liveness] = None if one else [None] * len(metas)
        self.values: list[torch.Tensor | None] | tuple[None, ...] | None = None
        self.executed = False
        self.index = next(_record_counter)
        self.rng = rng
        self.graph = graph
        self._seq = graph.next_seq(self.index)
        self.where: str | None = None
        # how many argument references to an output recorded nodes made while this node was
        # pending (a small int: no list per node); 0 once it ran
        self.n_consumers = 0
        self.tags: dict[str, Any] | None = None
        self.entry: Any = None
        # what the program was doing (genie.context.Context: module path, region, phase); on
        # the autograd engine's thread, outside any module, the backward region's context
        ctx = current.ctx
        if ctx is None and current.backward is not None and _graph_task_id() != -1:
            ctx = current.backward
        self.ctx: Any = ctx
        self._wref = weakref.ref(self)
        graph.on_node(self)

    @property
    def name(self) -> str:
        return op_name(self.op)

    @property
    def seq(self) -> int:
        """The node's record position in its graph (N of its uid): ``_seq``, or on the default
        graph, where ``_seq`` is None, from its index (csrc/seq.cpp)."""
        s = self._seq
        return s if s is not None else _default_seq_of(self.index)

    @property
    def uid(self) -> str:
        return f"op*{self.seq}"

    @property
    def storages(self) -> list[Storage | None]:
        """The :class:`Storage` of each output (a new list for a single output)."""
        s = self._st
        return s if type(s) is list else [s]

    def storage(self, k: int) -> Storage | None:
        """The :class:`Storage` of output ``k``."""
        s = self._st
        if type(s) is list:
            return s[k]
        if k != 0:
            raise IndexError(f"{self} has one output, not {k + 1}")
        return s

    @property
    def outputs(self) -> list[Liveness]:
        """Each output's liveness (a new list for a single output): a count of the live tensors
        that hold it (default graph), a weak reference to its tensor (capture graphs), None until
        one is bound."""
        o = self._out
        return o if type(o) is list else [o]

    def output(self, k: int) -> Liveness:
        """Output ``k``'s liveness (see :attr:`outputs`; :meth:`live` says whether it is held)."""
        o = self._out
        if type(o) is list:
            return o[k]
        if k != 0:
            raise IndexError(f"{self} has one output, not {k + 1}")
        return o

    def live(self, k: int) -> bool:
        """Whether a live tensor holds output ``k``: a holder counted (the default graph: a
        wrapper whose impl's record is this output, or a liveness token :class:`Alive`), or the
        tensor a capture graph follows, alive and still this node's (not rebound since)."""
        o = self.output(k)
        if type(o) is int:
            return o > 0
        t = o() if o is not None else None
        return t is not None and getattr(t, "_node", None) is self

    def set_output(self, k: int, r: Liveness) -> None:
        o = self._out
        if type(o) is list:
            o[k] = r
        elif k != 0:
            raise IndexError(f"{self} has one output, not {k + 1}")
        else:
            self._out = r

    @property
    def consumers(self) -> tuple[weakref.ref[Node], ...]:
        """The pending nodes that read an output, as their weak references (``_wref``), each
        once, for tools and tests: found through the output storages' readers (every pending
        consumer is among them, :func:`genie.planner.held_after`). Recording keeps only their
        count, ``n_consumers``."""
        if self.executed or not self.n_consumers:
            return ()
        found: dict[Node, weakref.ref[Node]] = {}  # (nodes hash by identity)
        for st in dict.fromkeys(self.storages):  # (outputs may share a storage: views)
            if st is None:
                continue
            for w in st.readers:
                c = w()
                if c is not None and c not in found and not c.executed and \
                        any(x is self for x, _ in c.refs()):
                    found[c] = w
        return tuple(found.values())

    def inputs(self) -> list[Ref]:
        """Lazy inputs of this node (empty once it has run and released them)."""
        return [Ref(n, k) for n, k in self.refs()]

    def __getstate__(self) -> tuple[None, dict[str, Any]]:
        """The set fields, as a slotted class's state (``copy.deepcopy`` of a LazyTensor copies
        its node, as it did when the fields were slots)."""
        return None, {f: getattr(self, f) for f in Node._FIELDS if hasattr(self, f)}

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """As a slotted class's, but made with room for its leaves (the native node's arguments
        are inline and sized when it is made, csrc/node.h)."""
        return copyreg.__newobj__, (type(self), None, [None] * self.n_leaves), self.__getstate__()

    def __repr__(self) -> str:
        state = "done" if self.executed else "pending"
        return f"Node({self.uid}, {self.name}, {state})"


# An output's liveness, a node's ``_out`` item: the count of its live holders (default graph), a
# weak reference to its tensor (capture graphs), None until a tensor is bound.
Liveness = int | weakref.ref[Any] | None


def track(t: Any, node: Node, out: int) -> None:
    """Make ``node.output(out)`` follow the liveness of the LazyTensor ``t``, bound to it (its
    ``_node`` and ``_out`` set first).

    On the default graph the node counts its output's live holders (docs/node-layout.md section
    7, step 2b): a wrapper whose impl holds its record is one while that record is set (setting
    ``_node``/``_out`` counted it, csrc/wrapper.cpp); any other wrapper holds a liveness token
    :class:`Alive` (``t._alive``), counted while it lives, which a rebound tensor replaces. A
    capture graph follows the tensor itself, through a weak reference (:func:`genie.export`
    reads it back).
    """
    if node.graph.keep_nodes:
        node.set_output(out, weakref.ref(t))
    elif not _wrapper_in_impl(t):
        a = t._alive = Alive(node, out)
        if config.gc_untrack:
            # Neither can close a cycle: the token holds only the node, and the tensor's dict the
            # node and the token, none of which holds a tensor. CPython tracks the dict again by
            # itself when a GC-capable value is stored in it (`t.attr = obj`).
            _gc_untrack(a, t.__dict__)


def share(t: Any, src: Any) -> None:
    """Make ``t``, rebound to ``src``'s value (``t.data = src``, ``t.set_(src)``; its ``_node``
    and ``_out`` set to src's first), keep that value alive as ``src`` does: the node counts ``t``
    as one more holder, so the value lives while either tensor does (before the counts, a token
    of ``t``'s own replaced ``src``'s in the node, and the value was freed by the next run once
    ``t`` died, ``src`` still holding it)."""
    track(t, src._node, src._out)


# --- the cyclic garbage collector ---------------------------------------------------------------
#
# Recording allocates about ten small GC-tracked objects per op (the node, its argument, storage
# and output lists, its Refs, weak references). They live until the next
# materialization, so CPython's collector promotes them to its oldest generation, and every few
# decode steps runs a full collection over the whole heap: with a transformers model alive
# (~400k tracked objects) that cost a GPT-2 decode step more than recording itself (21 of 57 ms,
# /tmp script in the issue 11 note). Objects the collector can never need to see are therefore
# taken off its lists at record time. Invariants:
#
# - Only a node that cannot close a reference cycle is untracked: Node -> Node edges (a node's
#   inline arguments, csrc/node.h) go to older nodes, and Storage -> Node edges exist only in ``Storage.pending_writes``. So a cycle
#   needs a write: storage -> writer -> (inputs ...) -> a node whose ``storages`` hold that storage.
#   Capture-graph nodes, nodes created outside ``record`` and, with ``gc_defer_writes=0``,
#   writers stay tracked.
# - A tracked node's inputs, transitively, are tracked: before a capture node is recorded,
#   :func:`retrack_below` tracks again everything below it, stopping at tracked nodes.
# - A writer is recorded untracked too (``config.gc_defer_writes``; 0: tracked, with everything
#   below it re-tracked at record, as a capture node). Nearly every write runs at the next
#   materialization, which breaks its cycle (the run takes it off ``pending_writes`` and drops its
#   inputs): re-tracking the step's whole graph at every write, as before, put an optimizer
#   step's forward and backward back under the collector every step, and their promotion to the
#   oldest generation cost a small training step ~300 µs of full collections.
#   :func:`defer_writer` notes each such writer (weakly); :func:`retrack_writers` puts those still
#   pending back under the collector, with everything below them and the storages they write,
#   (a) when a full collection starts (a ``gc.callbacks`` hook: ``gc.collect()`` and the
#   collector's own full collections find every cycle a dropped write closed) and (b) when more
#   than ``_DEFER_LIMIT`` writers are pending at once (a program that writes without ever
#   materializing: bounded garbage between young collections). Each cycle is then made of
#   tracked objects only, and collected as before.


def untrack_node(node: Node, leaves: list[Any]) -> None:
    """Take a recorded node (no writes, default graph), once its output tensors are bound, off
    the GC: the node, ``leaves`` and its Refs, its storage and output lists, the weak
    references in them, and its own weak reference (one native call)."""
    _gc_untrack_node(node, leaves, Ref)


def retrack_below(leaves: list[Any]) -> None:
    """Track again every untracked node (and its containers) reachable from the Refs in ``leaves``.

    Amortized O(1) per node: a node is re-tracked at most once and the walk stops at tracked
    nodes, whose inputs are tracked already (the invariant above). Native: one call per write.
    """
    _gc_retrack_below(leaves, Ref)


# Writers recorded untracked and not yet re-tracked, as weak references (Node._wref): pruned of
# writers that ran or died when the list reaches _deferred_at.
_deferred: list[weakref.ref[Node]] = []
_DEFER_LIMIT = 4096
_deferred_at = [_DEFER_LIMIT]


def defer_writer(wref: weakref.ref[Node]) -> None:
    """Note a writer recorded untracked (``wref``: its ``_wref``); see "the cyclic garbage
    collector" above. Amortized O(1): the list is pruned when it reaches ``_deferred_at``, and
    its pending writers are re-tracked if they are still at least half of it."""
    q = _deferred
    q.append(wref)
    if len(q) >= _deferred_at[0]:
        q[:] = [w for w in q if (n := w()) is not None and not n.executed]
        if 2 * len(q) >= _DEFER_LIMIT:
            retrack_writers()
        _deferred_at[0] = max(_DEFER_LIMIT, 2 * len(q))


def retrack_writers() -> int:
    """Put every deferred writer still pending back under the collector, with everything below
    it and the storages it writes; returns how many. Every cycle a dropped write closed is then
    collectable."""
    q = _deferred
    nodes = [n for w in q if (n := w()) is not None and not n.executed]
    q.clear()
    _deferred_at[0] = _DEFER_LIMIT
    if nodes:
        _gc_retrack_writers(nodes, Ref)
    return len(nodes)


def _on_gc(phase: str, info: dict[str, int]) -> None:
    # A full collection: what it would find only after a re-track, it finds now. The objects
    # tracked here join the youngest generation, which a full collection collects too.
    if phase == "start" and info["generation"] == 2 and _deferred:
        retrack_writers()


gc.callbacks.append(_on_gc)


def live_nodes() -> int:
    """How many nodes are alive in the process, GC-tracked or not (tests and benchmarks).

    Untracked nodes do not appear in ``gc.get_objects()``; they are found from the tracked
    objects that refer to them (tensors, through their impls or untracked dicts; tracked nodes,
    storages)
    and through inputs and pending writes. Slow (a pass over the whole heap): never on a hot path.
    """
    _wrapper_release()
    stack: list[Node] = []
    for o in gc.get_objects():
        if type(o) is Node:
            stack.append(o)
            continue
        if _wrapper_in_impl(o):  # a LazyTensor whose impl holds its record (csrc/wrapper.cpp)
            stack.append(o._node)
        for r in gc.get_referents(o):
            t = type(r)
            if t is Node:
                stack.append(r)
            elif t is Ref:
                stack.append(r.node)
            elif t is dict and not gc.is_tracked(r):  # a LazyTensor's dict (graph.track)
                stack += [v for v in r.values() if type(v) is Node]
    seen: set[int] = set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        stack += [x for x, _ in n.refs()]
        for s in n.storages:
            if s is not None:
                stack += s.pending_writes
    return len(seen)


def op_name(op: Any) -> str:
    """``aten.add.Tensor`` for an OpOverload, the pseudo-op's name otherwise."""
    return str(op)


class Graph:
    """A recording scope: hands out deterministic unique ids and keeps per-graph counts.

    The process has one default graph; ``genie.capture()`` opens its own. Nodes are not stored in a
    list here (that would keep every node alive forever); a capture graph keeps its nodes because a
    user asked to inspect them.
    """

    def __init__(self, name: str = "default", keep_nodes: bool = False) -> None:
        self.name = name
        self.keep_nodes = keep_nodes
        self.nodes: list[Node] = []
        self._total = 0

    def next_seq(self, index: int) -> int | None:
        """N of seed 000's unique id ``op*N`` (Node.uid) for the node with process-wide index
        ``index``: the record position in this graph (the op's name and inputs live in the
        complex id, genie.ids), or None where :attr:`Node.seq` derives it from the index."""
        n = self._total
        self._total = n + 1
        return n

    def on_node(self, node: Node) -> None:
        if self.keep_nodes:
            self.nodes.append(node)

    def __len__(self) -> int:
        return self._total


class _DefaultGraph(Graph):
    """The process's default graph. Its nodes store no position: within a run of consecutive
    indices recorded here, a node's position is its index minus the run's base, and the runs
    (broken by a capture's nodes or an index taken without a node) are kept natively
    (csrc/seq.cpp) instead of an int per node."""

    def next_seq(self, index: int) -> int | None:
        return _default_seq_note(index)

    def __len__(self) -> int:
        return _default_seq_len()


def tuple_getter(idx: Sequence[int]) -> Callable[[Sequence[Any]], tuple]:
    """``f(seq) -> tuple(seq[i] for i in idx)`` in one C call (``operator.itemgetter``, which
    returns the item itself for one index): the per-call picks of a compiled graph's caller
    (genie.dynamo) and of a shape class's key (genie.remote.shape_class)."""
    if not idx:
        return lambda _: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda s: (s[i],)
    return operator.itemgetter(*idx)


def short_op_name(op: Any) -> str:
    """``add`` for ``aten.add.Tensor``; pseudo-ops keep their own name."""
    name = getattr(op, "_opname", None)
    if name is None:
        return str(op)
    return name


DEFAULT_GRAPH: Graph = _DefaultGraph("default")
