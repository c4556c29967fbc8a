"""Native replay: a repeated plan's tape compiled once into a program of boxed dispatcher calls.

:mod:`~genie.backends.codegen` runs a repeated plan as a generated Python function, and each of
its instructions is still a Python call of an ``OpOverload`` (argument parsing from Python
objects and a Python frame: ~3.5 µs per op on small tensors). Here the tape's structure is
compiled once per plan into a ``genie._C._ReplayProgram`` (``csrc/replay.cpp``): per
instruction the operator handle, the argument stack built against the schema (as
``OpOverload.__call__`` builds it) with the constants in it, and *patches* for what varies:
registers for :class:`~genie.planner.Slot` leaves (also inside lists such as ``cat``'s), and the
per-step parameters read from the step's tape as codegen reads them (float arguments, host
tensors, ``(seed, offset)`` of random ops, and every int and :class:`~genie.graph.MetaArg` of
a shape-generic tape). A run is one native call: no Python per op. A float or int the template
holds is the value of the instruction it was compiled from; a step whose tape runs that very
``Instr`` object (a plan's shared instruction: only the ones a hit rebuilds are new objects)
skips those patches (the program keeps the object, so its identity stays its own).

Invariants:

* A program computes exactly what :func:`~genie.backends.eager.run_instrs` computes, op for op,
  in the same order, with the same frees; ``GENIE_NATIVE_REPLAY=always`` runs every tape
  through it (misses included) and the unit suite passes in every mode
  (``tests/unit/test_native_replay.py`` pins the cases that could differ).
* It depends only on the plan's structure (memoized on ``Plan.artifacts["native"]``, or
  ``"native_generic"`` for tapes whose shapes differ from the plan's, as codegen's artifacts).
* What it cannot compile (an op that is not an ``OpOverload``, an argument tree or type it does
  not map) is decided once per plan (memoized as ``False``): that plan runs as generated code or
  interpreted, as before.
* An op that raises surfaces as :class:`~genie.errors.ExecutionError` naming the op, with the
  exception eager raises (``IndexError``, ``RuntimeError``, ...) as its cause; the instructions
  before it have run (an in-place write may have happened): the error carries the live values
  (``ExecutionError.partial``) and the executor binds the nodes that ran, so nothing is re-run.

When: ``GENIE_NATIVE_REPLAY`` (``genie.config.native_replay``) = ``1`` (default: a plan's tapes
from its second use on, before codegen), ``always`` (every tape), ``0`` (never: codegen and the
interpreter as before). Counters: ``native_replay_plans`` (programs compiled),
``native_replay_refused`` (tapes it could not compile, with the reason at ``GENIE_DEBUG=2``),
``native_replays`` (tapes run natively).

Example:
    >>> import torch, genie
    >>> x = torch.ones(3, device="remote_accelerator")
    >>> for _ in range(3):
    ...     y = ((x + 1) * 2).sum().item()
    >>> y
    12.0
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from .. import _C, graphs
from . import cuda_graphs
from ..config import config, logger
from ..device import real_device
from ..errors import ExecutionError
from ..meta import policy, value_leaves
from ..planner import MetaArg, Slot, Tape, raw_instrs, storage_effects
from ..stats import _counts, _syncs, bump

UPLOAD = "genie.upload"
MODES = ("1", "always", "0")

# patch kinds of csrc/replay.cpp (enum Src)
_SLOT, _SLOT_ALIAS, _LEAF, _META, _META_STEP, _DEVICE = range(6)

# Stands for a tensor in a program's argument template (a register, a MetaArg, a host tensor:
# the step's own is patched in), so that templates hold no step's values.
_PLACEHOLDER = torch.zeros(())
_CPU = torch.device("cpu")  # stands for the run's device in the template


class Program:
    """A compiled tape structure and what its runs need from Python."""

    __slots__ = ("native", "others", "freed")

    def __init__(self, native: Any, others: list[int]) -> None:
        self.native = native
        self.others = others  # remote_accelerator indices of instructions off the tape's device
        self.freed = native.freed

    def __len__(self) -> int:
        return len(self.native)  # instructions

    def __call__(self, tape: Tape, dev: torch.device, split: int = -1,
                 early: Any = None, check: Any = None) -> dict[int, Any]:
        """Run ``tape``; with ``early``, call it with ``{slot: value}`` of the kept slots
        defined once instruction ``split - 1`` has run (see :func:`early_split`). With
        ``check``, ``(callable, instruction indices, slot ids)``: the callable is called as
        ``callable(i, {slot: value})`` before each of those instructions, with the values of
        those slots defined then; what it raises is instruction ``i``'s failure (a server's
        index check, :meth:`genie.index_check.IndexCheck.points`)."""
        devices = [dev, *map(real_device, self.others)] if self.others else [dev]
        stale = tape._stale  # a hit whose instructions are not built: read from its nodes
        instrs = tape.instrs if stale is None else \
            tape.plan.replay_source(raw_instrs(tape), tape.nodes, stale)
        if early is None and check is None:
            r = self.native.run(tape.inputs, instrs, devices)
        else:
            fn, at, slots = check if check is not None else (None, (), ())
            r = self.native.run(tape.inputs, instrs, devices, split, early, fn, at, slots)
        if type(r) is tuple:  # (failing instruction, the exception it raised, live values)
            raise failure(tape, *r) from r[1]
        if self.freed:
            _counts["values_freed"] += self.freed
        _counts["native_replays"] += 1
        return r


def failure(tape: Tape, i: int, e: BaseException, live: dict[int, Any]) -> ExecutionError:
    """The error of a run of ``tape`` whose instruction ``i`` raised ``e`` with the values
    ``live`` (what a program's run returns then); raise it ``from e``."""
    ins = tape.instrs[i]
    err = ExecutionError(ins.op, ins.where, e, i)
    err.partial = (tape, i, live)  # instructions [0, i) ran (see executor.run_tape)
    return err


def _sync() -> None:
    n = _C._replay_graph_calls()  # genie::graph calls a program made directly (graphs.direct)
    if n:
        _counts["graph_cache_hits"] += n
        _counts["graph_direct_calls"] += n


_syncs.append(_sync)


def mode() -> str:
    m = config.native_replay
    if m not in MODES:
        raise ValueError(f"GENIE_NATIVE_REPLAY={m!r}: expected '1' (default), 'always' or '0'")
    return m


def for_tape(tape: Tape) -> Program | None:
    """The program to run ``tape`` with, or None (mode, a plan's first use, or not compilable)."""
    m = mode()
    if m == "0":
        return None
    plan = tape.plan
    if plan is None:
        return _compile_or_none(tape, tape.generic, False) if m == "always" else None
    name = "native_generic" if tape.generic else "native"
    p = plan.artifacts.get(name)
    if p is None:
        if m == "1" and plan.uses < 2:
            return None
        p = _compile_or_none(tape, tape.generic) or False
        plan.artifacts[name] = p
    return p if p is not False else None  # (not ``p or None``: that calls len(p) per run)


def _compile_or_none(tape: Tape, generic: bool, cuda_graph: bool = True) -> Program | None:
    try:
        p = compile_tape(tape, generic, cuda_graph)
    except Exception as e:  # noqa: BLE001 - anything not compilable runs as before
        logger.debug("genie: plan not replayed natively (%s)", e)
        bump("native_replay_refused")
        return None
    bump("native_replay_plans")
    return p


def compile_tape(tape: Tape, generic: bool = False, cuda_graph: bool = True) -> Program:
    """Compile ``tape``'s structure (see the module docstring); ``generic``: ints and MetaArgs
    are read from each step's instructions too. Raises when an instruction cannot be mapped.
    ``cuda_graph``: its steady runs may replay as a CUDA graph (:mod:`.cuda_graphs`)."""
    others: list[int] = []
    leafy: list[tuple[int, int]] = []  # the per-step leaves: (instruction, leaf position)
    uploads: list[int] = []
    top = max([*tape.inputs, *tape.keep,
               *(s for ins in tape.instrs for s in ins.outs if s is not None)], default=-1)
    native = _C._ReplayProgram(top + 1, sorted(tape.keep))
    for i, ins in enumerate(tape.instrs):
        if ins.device == tape.index:
            k = 0
        else:
            if ins.device not in others:
                others.append(ins.device)
            k = 1 + others.index(ins.device)
        frees = list(ins.free)
        if ins.op == UPLOAD:
            out = ins.outs[0] if ins.outs and ins.outs[0] is not None else -1
            native.add_upload(out, k, frees)
            uploads.append(i)
            continue
        op = ins.op
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"instruction {i}: {op!r} is not an OpOverload")
        values: list[Any] = []
        marks: list[int] = []
        patches: list[tuple[Any, ...]] = []
        vals = value_leaves(ins)  # (a bool there: a per-step parameter, as a float)
        for p, x in enumerate(ins.leaves):
            t = type(x)
            patch: tuple[Any, ...] | None = None
            value = x
            if t is Slot:
                patch, value = (_SLOT, x.id), _PLACEHOLDER
            elif t is torch.device and x.type == "remote_accelerator":
                patch, value = (_DEVICE,), _CPU
            elif t is MetaArg:
                m = x.meta
                patch = (_META_STEP, p) if generic else \
                    (_META, tuple(m.shape), tuple(m.stride), m.dtype)
                value = _PLACEHOLDER
            elif isinstance(x, torch.Tensor):  # a host tensor: a per-step parameter
                patch, value = (_LEAF, p), _PLACEHOLDER
            elif t is float or (generic and t is int) or (t is bool and p in vals):
                # per-step parameters, as codegen's
                patch = (_LEAF, p, True)  # baked: a step running this very Instr skips it
            marks.append(-1 if patch is None else len(patches))
            if patch is not None:
                patches.append(patch)
                if patch[0] == _LEAF or patch[0] == _META_STEP:
                    leafy.append((i, p))
            values.append(value)
        if ins.leaves and policy(op).inplace_view:
            # eager.run_instr applies an in-place view op to a fresh alias of its first leaf
            if type(ins.leaves[0]) is not Slot:
                raise TypeError(f"instruction {i}: in-place view of a non-slot {ins.leaves[0]!r}")
            patches[marks[0]] = (_SLOT_ALIAS, ins.leaves[0].id)
        args, kwargs = optree.tree_unflatten(ins.spec, values)
        margs, mkwargs = optree.tree_unflatten(ins.spec, marks)
        s = op._schema
        native.add_op(s.name, s.overload_name, tuple(args), dict(kwargs), tuple(margs),
                      dict(mkwargs), patches, [-1 if o is None else o for o in ins.outs], frees,
                      k, ins.rng is not None, ins)
        if (op is graphs.GRAPH_OP or op is graphs.GRAPH_MUT_OP) and ins.rng is None:
            native.direct_last(graphs.direct)  # the compiled code called without the dispatcher
    if cuda_graph and not others:
        cuda_graphs.install(native, tape, leafy, uploads, generic, compile_tape)
    return Program(native, others)


def early_split(tape: Tape) -> int:
    """The first instruction index ``k`` after which nothing the tape's outputs hold changes:
    every output is defined before ``k``, and no instruction from ``k`` on writes a storage an
    output lives in (what an output is a view of included). A run can hand its outputs over
    after instruction ``k - 1`` while the rest runs (a server's early reply: the loss of a
    training step goes back while its backward and update run). ``len(tape.instrs)`` when the
    outputs are final only at the end, or when the tape has an instruction whose effects the
    op's schema does not say (a non-ATen op, an upload).

    Storages are followed by the schema's alias annotations (``Tensor(a)`` views,
    ``Tensor(a!)`` writes, in lists too; each element of a returned list), plus the views whose
    schemas do not say so (``_unsafe_view``, ``unsafe_split``, ``unsafe_chunk``); all the
    tape's inputs count as one storage, since resident values may share one.
    """
    n = len(tape.instrs)
    inputs = object()  # the root of every input
    root: dict[int, Any] = {s: inputs for s in tape.inputs}
    last: dict[Any, int] = {}  # root -> the last instruction that defines or writes it
    for i, ins in enumerate(tape.instrs):
        if not isinstance(ins.op, torch._ops.OpOverload):
            return n
        effects = storage_effects(ins, root)
        if effects is None:
            return n  # (outputs that do not map onto the schema's returns)
        writes, outs = effects
        for r in writes:
            last[r] = i
        for k, (o, src) in enumerate(outs):
            if src:
                root[o] = src[0]
                for r in src[1:]:  # (an output of several storages: none in ATen's schemas)
                    last[r] = max(last.get(r, i), i)
            else:
                root[o] = (i, k)
            last[root[o]] = max(last.get(root[o], i), i)
    outs = [root.get(s) for s in tape.outputs]
    if not outs or any(r is None for r in outs):
        return n
    return max(last.get(r, -1) for r in outs) + 1
