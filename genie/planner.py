"""Planner: from requested values to a Tape (seed 003), plain data the executor (or a server) runs.

The slice is the backward closure of the requested values over three kinds of dependency:

1. data: a node needs the producers of its inputs;
2. write-before-read: reading a storage at record position p needs every pending write to that
   storage recorded before p (in-place ops, writes through views);
3. write-after-read: running a write W needs every live pending reader of the same storage
   recorded before W, because after W the value they read is gone.

Nodes that have already run are not in the slice; their kept values become tape inputs. The slice
runs in record order, which with (2) and (3) reproduces eager's ordering of reads and writes.
Every slot has a last use; values that no live tensor or pending node needs are freed right after
it ("free after", as ``torch.fx.Interpreter`` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ._C import _slice_init
from ._C import _slice_nodes as _native_slice_nodes
from .config import config
from .graph import MetaArg, Node, Ref, Storage, TensorMeta, gc_paused
from .meta import UNANNOTATED_VIEWS, policy
from .stats import _counts


@dataclass(frozen=True, slots=True)
class Slot:
    """A tape value: an input (already on the device) or the output of an instruction."""

    id: int


@dataclass(slots=True)
class Instr:
    """One op to run: ``outs = op(*args, **kwargs)`` with ``args`` rebuilt from ``leaves``.

    ``leaves`` hold :class:`Slot` (tape values), :class:`MetaArg` and constants (numbers,
    dtypes, devices, host tensors of uploads). ``free`` lists slots whose last use is here.
    """

    op: Any
    leaves: list[Any]
    spec: Any
    outs: tuple[int | None, ...]
    rng: tuple[int, int] | None
    free: tuple[int, ...] = ()
    uid: str = ""
    where: str | None = None
    device: int = 0  # the remote_accelerator index the op runs on (cross-device copies differ)


@dataclass(slots=True)
class Tape:
    """A linear program: inputs (real tensors by slot), instructions, outputs and kept slots.

    A plan-cache hit's instructions are built when :attr:`instrs` is first read: until then the
    slot holds its plan's shared list and ``_stale`` says which of them the step's nodes change
    (their host tensors, floats, shapes and random offsets:
    :meth:`genie.plan_cache.Plan.step_instrs`). A native replay reads those from the nodes
    themselves (:meth:`genie.plan_cache.Plan.replay_source`), so a step that only replays builds
    none (a GPT-2 decode step rebuilt and freed ~100 instructions, ~60 µs). So a hit's
    instructions can be read only until its run has bound its nodes (and emptied
    :attr:`nodes`); a later first read raises.
    """

    instrs: list[Instr]
    inputs: dict[int, torch.Tensor]
    outputs: list[int]
    keep: set[int]
    nodes: list[Node] = field(repr=False)
    # (node index, out) -> slot, or PendingSlots until :attr:`slots` is first read
    _slots: dict[tuple[int, int], int] | PendingSlots = field(repr=False)
    index: int = 0  # the remote_accelerator index of the requested values
    plan: Any = field(default=None, repr=False)  # genie.plan_cache.Plan this tape instantiates
    # True when the tape differs from its plan in shapes (ints, metadata arguments, host tensor
    # and input shapes): backends that bake the plan's shapes in must not reuse their artifact
    generic: bool = False
    # a plan-cache hit's instructions not built yet (see above): set after construction, never
    # copied (dataclasses.replace reads :attr:`instrs`, which builds them first)
    _stale: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def slots(self) -> dict[tuple[int, int], int]:
        """``(node index, out) -> slot`` for every value of the run (its nodes' and inputs')."""
        s = self._slots
        if type(s) is PendingSlots:
            s = self._slots = s.build(self.nodes)
        return s


_instrs_slot = Tape.instrs  # the slot's own descriptor, wrapped by the property below


def storage_effects(ins: Instr, root: dict[int, Any]
                    ) -> tuple[list[Any], list[tuple[int, list[Any]]]] | None:
    """What an instruction of an ATen op does to storages, by its schema's alias annotations
    (``Tensor(a!)`` writes, ``Tensor(a)`` views, in lists too; each element of a returned list)
    plus the views whose schemas do not say so (:data:`genie.meta.UNANNOTATED_VIEWS`): the roots
    it writes, and per output slot the roots it is a view of (empty: a fresh storage). ``root``
    maps slots to their storage's root (a slot without one is not followed). None when its
    outputs do not map onto the schema's returns."""
    pol = policy(ins.op)
    args, kwargs = optree.tree_unflatten(ins.spec, ins.leaves)

    def roots(x: Any) -> list[Any]:
        if type(x) is Slot:
            r = root.get(x.id)
            return [r] if r is not None else []
        if isinstance(x, (list, tuple)):
            return [r for e in x for r in roots(e)]
        return []

    def arg(j: int) -> Any:
        return args[j] if j < len(args) else kwargs.get(pol.names[j])

    writes = [r for j in pol.writes for r in roots(arg(j))]
    if pol.inplace_view and args:
        writes += roots(args[0])
    rets = pol.returns
    if len(rets) != 1 and len(ins.outs) != len(rets) and any(o is not None for o in ins.outs):
        return None
    outs = []
    for k, o in enumerate(ins.outs):
        if o is None:
            continue
        ret = rets[0] if len(rets) == 1 else rets[k]  # (a list return: each element)
        outs.append((o, roots(arg(ret[1])) if ret is not None else
                     roots(args[0]) if ins.op in UNANNOTATED_VIEWS and args else []))
    return writes, outs


def _instrs_get(tape: Tape) -> list[Instr]:
    stale = tape._stale
    if stale is not None:
        if tape.nodes and tape.nodes[-1] is None:  # (_bind's release empties it last first)
            raise RuntimeError(
                "this plan-cache hit's instructions were never built, and its run has released "
                "the nodes they are built from: read Tape.instrs before the run ends (e.g. in a "
                "wrapper of genie.passes.pipeline.run, after it returns)")
        _instrs_slot.__set__(tape, tape.plan.step_instrs(_instrs_slot.__get__(tape, Tape),
                                                         tape.nodes, stale))
        tape._stale = None
    return _instrs_slot.__get__(tape, Tape)


def _instrs_set(tape: Tape, instrs: list[Instr]) -> None:
    _instrs_slot.__set__(tape, instrs)
    tape._stale = None


Tape.instrs = property(_instrs_get, _instrs_set,  # type: ignore[assignment, method-assign]
                       doc="The instructions to run, in order (a hit's built on first read).")


def raw_instrs(tape: Tape) -> list[Instr]:
    """``tape``'s instruction list as it is held, without building a hit's (its length is the
    tape's; where ``tape._stale`` is set, the stale ones are still the plan's)."""
    return _instrs_slot.__get__(tape, Tape)


@dataclass(frozen=True, slots=True)
class PendingSlots:
    """:attr:`Tape.slots` not built yet (a plan-cache hit builds it only when read).

    ``outs[i]`` is the output slots of ``Tape.nodes[i]`` (as :attr:`Instr.outs`; shared with
    the plan, never mutated); ``inputs`` maps ``(node index, out)`` of the input values to slots,
    or says the same as a flat ``[node, out, slot, ...]`` list (a column match's:
    :func:`genie.plan_cache.match` makes no key per input unless the slots are read).
    """

    outs: list[tuple[int | None, ...]]
    inputs: dict[tuple[int, int], int] | list[Any]

    def build(self, nodes: list[Node]) -> dict[tuple[int, int], int]:
        d = {(n.index, k): s for n, outs in zip(nodes, self.outs, strict=True)
             for k, s in enumerate(outs) if s is not None}
        ins = self.inputs
        if type(ins) is dict:
            d.update(ins)
        else:
            it = iter(ins)
            d.update(((n.index, k), s) for n, k, s in zip(it, it, it, strict=True))
        return d


@gc_paused
def slice_nodes(targets: list[tuple[Node, int]]) -> list[Node]:
    """Pending nodes the requested values depend on, in record order.

    Runs natively (csrc/slice.cpp, the same walk) unless ``config.native_slice`` is off
    (``GENIE_NATIVE_SLICE=0``); the loop below is the reference, and runs for what the native
    walk does not handle.
    """
    if config.native_slice:
        nodes = _native_slice_nodes(targets)
        if nodes is not NotImplemented:
            _counts["native_slices"] += 1
            return nodes
    needed: dict[int, Node] = {}
    bound: dict[Storage, int] = {}
    stack: list[Node] = []

    def need(n: Node) -> None:
        if not n.executed and n.index not in needed:
            needed[n.index] = n
            stack.append(n)

    def need_storage(s: Storage, upto: int) -> None:
        if bound.get(s, -1) >= upto:
            return
        bound[s] = upto
        for w in s.pending_writes:
            if w.index >= upto:
                break
            need(w)
            for r in s.readers:
                rn = r()
                if rn is not None and not rn.executed and rn.index < w.index:
                    need(rn)

    inf = 1 << 62
    for node, out in targets:
        need(node)
        need_storage(node.storage(out), inf)
    while stack:
        n = stack.pop()
        for ref in n.inputs():
            need(ref.node)
            need_storage(ref.node.storage(ref.out), n.index)
        for s in n.writes:
            need_storage(s, n.index)
    return [needed[i] for i in sorted(needed)]


def value_slice(node: Node, out: int, accept: Any, limit: int,
                known: Any = None) -> list[Node] | None:
    """The pending nodes that the value ``out`` of ``node`` depends on, in record order: the
    data and write-before-read dependencies of :func:`slice_nodes`, without its write-after-read
    readers (a run needs them, the value does not). None where a node is executed (its value
    would be the device's), fails ``accept(node)``, or there are more than ``limit``: the walk
    stops there, so a value computed by a large graph costs a few steps. ``known(node, out)``:
    whether the caller already has that input value (the walk does not go past it; the caller
    passes it to :func:`build_tape`)."""
    needed: dict[int, Node] = {}
    bound: dict[Storage, int] = {}
    stack: list[Node] = []

    def need(n: Node) -> bool:
        if n.index in needed:
            return True
        if n.executed or len(needed) >= limit or not accept(n):
            return False
        needed[n.index] = n
        stack.append(n)
        return True

    def need_storage(s: Storage, upto: int) -> bool:
        if bound.get(s, -1) >= upto:
            return True
        bound[s] = upto
        for w in s.pending_writes:
            if w.index >= upto:
                break
            if not need(w):
                return False
        return True

    if not (need(node) and need_storage(node.storage(out), 1 << 62)):
        return None
    while stack:
        n = stack.pop()
        for ref in n.inputs():
            if known is not None and known(ref.node, ref.out):
                continue
            if not (need(ref.node) and need_storage(ref.node.storage(ref.out), n.index)):
                return None
        for s in n.writes:
            if not need_storage(s, n.index):
                return None
    return [needed[i] for i in sorted(needed)]


@gc_paused
def build_tape(targets: list[tuple[Node, int]], nodes: list[Node] | None = None,
               known: dict[tuple[int, int], torch.Tensor] | None = None) -> Tape:
    """Slice, order and lower the requested values to a :class:`Tape`.

    ``nodes`` is ``slice_nodes(targets)`` when the caller has it already (the plan cache does).
    ``known``: values of outputs outside ``nodes`` by (node index, output), taken as inputs
    where the node holds none (:func:`value_slice`'s ``known``).
    """
    if nodes is None:
        nodes = slice_nodes(targets)
    in_run = {n.index for n in nodes}
    slots: dict[tuple[int, int], int] = {}
    inputs: dict[int, torch.Tensor] = {}
    instrs: list[Instr] = []
    last_use: dict[int, int] = {}
    refs_in: dict[int, int] = {}  # node index -> argument references to it from the run

    def slot_of(node: Node, out: int, at: int, ref: bool = True) -> int:
        key = (node.index, out)
        s = slots.get(key)
        if s is not None and node.index in in_run:
            if ref:
                refs_in[node.index] = refs_in.get(node.index, 0) + 1
        elif s is None:
            if node.index in in_run:
                raise AssertionError(f"{node} used before it runs")  # record order is topological
            value = node.values[out] if node.values is not None else None
            if value is None and known is not None:
                value = known.get(key)
            if value is None:
                raise AssertionError(f"value {node.uid}[{out}] was freed but is still needed")
            s = slots[key] = len(slots)
            inputs[s] = value
        last_use[s] = at
        return s

    for i, n in enumerate(nodes):
        nl = n.leaves  # (a new list on each read: read once)
        if nl is None:
            leaves: list[Any] = []
        else:
            leaves = [Slot(slot_of(x.node, x.out, i)) if type(x) is Ref else x for x in nl]
        outs = []
        for k, m in enumerate(n.metas):
            if m is None:
                outs.append(None)
                continue
            s = slots[(n.index, k)] = len(slots)
            last_use[s] = i
            outs.append(s)
        instrs.append(Instr(n.op, leaves, n.spec, tuple(outs), n.rng, uid=n.uid, where=n.where,
                            device=_device_index(n)))

    outputs = []
    for node, out in targets:
        # a requested value is no argument reference (n_consumers counts those only): counted,
        # it stood for a consumer outside the run, whose input was then freed
        outputs.append(slot_of(node, out, len(instrs), ref=False))

    # Keep a value past the run if a live tensor holds it or a pending node outside the run reads it.
    keep: set[int] = set(outputs)
    for n in nodes:
        for k, m in enumerate(n.metas):
            if m is None:
                continue
            if held_after(n, k, in_run, refs_in.get(n.index, 0)):
                keep.add(slots[(n.index, k)])

    frees: dict[int, list[int]] = {}
    for s, at in last_use.items():
        if s not in keep and s not in inputs and at < len(instrs):
            frees.setdefault(at, []).append(s)
    for i, ins in enumerate(instrs):
        ins.free = tuple(frees.get(i, ()))
    index = targets[0][0].metas[targets[0][1]].index if targets else 0
    return Tape(instrs, inputs, outputs, keep, nodes, slots, index)


# The classes the native slice and instantiate read and make (genie.plan_cache adds _HostMeta).
_slice_init({"Node": Node, "Ref": Ref, "Storage": Storage, "TensorMeta": TensorMeta,
             "MetaArg": MetaArg, "Slot": Slot, "Instr": Instr, "Tape": Tape,
             "PendingSlots": PendingSlots})


def _device_index(n: Node) -> int:
    return next((m.index for m in n.metas if m is not None), 0)


def held_after(n: Node, k: int, in_run: set[int], inside: int = -1) -> bool:
    """Whether output ``k`` of ``n`` must outlive a run of the nodes ``in_run`` (by index):
    a live tensor holds it, or a pending node outside the run reads it (any output of ``n``).
    ``inside``: how many argument references to ``n`` the run makes, when the caller counted
    them; ``n.n_consumers`` equal to it says no consumer is outside without looking for one."""
    if n.live(k):  # a holder counted (default graph), or a capture graph's tensor still n's
        return True
    return n.n_consumers != inside and _has_pending_consumer(n, in_run)


def _has_pending_consumer(n: Node, in_run: set[int]) -> bool:
    """Whether a pending node outside ``in_run`` reads an output of ``n``. Nodes keep only a
    count of their consumers: every pending consumer is among the readers of the storage it
    reads (readers are dropped only once dead or run), so the readers whose arguments name
    ``n`` are its pending consumers (a metadata-only argument is neither)."""
    if not n.n_consumers:  # none was recorded, or n ran
        return False
    for st in dict.fromkeys(n.storages):  # (outputs may share a storage: views)
        if st is None:
            continue
        for w in st.readers:
            c = w()
            if c is not None and not c.executed and c.index not in in_run and c.leaves and \
                    any(type(x) is Ref and x.node is n for x in c.leaves):
                return True
    return False


def format_tape(tape: Tape) -> str:
    """A readable listing of a tape: one instruction per line, with frees."""
    lines = [f"tape: {len(tape.instrs)} instrs, inputs {sorted(tape.inputs)}, "
             f"outputs {tape.outputs}"]
    for ins in tape.instrs:
        args = ", ".join(f"%{x.id}" if isinstance(x, Slot) else
                         ("<meta>" if isinstance(x, MetaArg) else
                          ("<host tensor>" if isinstance(x, torch.Tensor) else repr(x)))
                         for x in ins.leaves)
        outs = ", ".join(f"%{o}" for o in ins.outs if o is not None)
        free = f"  # free {', '.join(f'%{f}' for f in ins.free)}" if ins.free else ""
        lines.append(f"  {outs or '_'} = {ins.op}({args}){free}")
    return "\n".join(lines)
