"""Replay: a tape's instructions as one flat generated Python function (as ``torch.fx`` does).

:func:`~genie.backends.eager.run_instrs` interprets a tape: per instruction it rebuilds the
argument tree with ``optree``, looks values up in a slot dict and checks the op's policy. A plan
that repeats runs the same instructions every step, so ``eager`` runs it as generated code
instead: one function per plan with a local per slot (``v3``), the argument trees spelled out as
Python call expressions, ``del`` after each value's last use (the tape's ``free`` lists), and
only the per-step parameters read from the step's tape (host tensors of uploads, float
arguments, ``(seed, offset)`` of random ops). Everything else is baked in as constants.

Invariants:

* The generated function computes exactly what the interpreter computes, op for op, in the
  same order, with the same frees (``GENIE_CODEGEN=always`` runs every tape, misses included,
  through it; the unit suite passes in both modes, see ``tests/unit/test_codegen.py``).
* It depends only on the plan's structure, never on a step's values: what varies between tapes
  of one plan (:class:`~genie.plan_cache.Plan`: host tensors, floats, rng) is read from the
  step's instructions, so one function serves every tape of its plan (memoized on
  ``Plan.artifacts["codegen"]``).
* An op that raises surfaces as :class:`~genie.errors.ExecutionError` naming the op and the
  source line where it was recorded, as in the interpreter (the failing instruction is found
  from the traceback's line number, the values computed so far from its frame's locals, for
  the executor to bind the instructions that ran: no bookkeeping on the hot path).

When: ``GENIE_CODEGEN`` = ``repeat`` (default: a plan's tapes from its second use on; a miss
is interpreted, since generating costs about as much as interpreting once), ``always`` (every
tape), ``0`` (never; the interpreter only).
A plan that :mod:`~genie.backends.native_replay` compiles (``GENIE_NATIVE_REPLAY``, on by
default) runs as a native program instead; generated code takes what it refuses.

Example:
    >>> import torch, genie
    >>> from genie.backends import codegen
    >>> x = torch.ones(3, device="remote_accelerator")
    >>> for _ in range(3):
    ...     y = ((x + 1) * 2).sum().item()
    >>> y
    12.0
"""

from __future__ import annotations

import os
from typing import Any

import optree
import torch

from ..config import logger
from ..device import real_device
from ..errors import ExecutionError
from ..meta import policy
from ..planner import MetaArg, Slot, Tape
from ..stats import bump
from .rng import generator_for, seed_from

UPLOAD = "genie.upload"

_mode = os.environ.get("GENIE_CODEGEN", "repeat").strip().lower() or "repeat"
if _mode not in ("repeat", "always", "0"):
    raise ValueError(f"GENIE_CODEGEN={_mode!r}: expected 'repeat' (default), 'always' or '0'")


def set_mode(mode: str) -> None:
    """``"repeat"`` (default), ``"always"`` or ``"0"`` (off); see the module docstring."""
    global _mode
    if mode not in ("repeat", "always", "0"):
        raise ValueError(f"codegen mode {mode!r}: expected 'repeat', 'always' or '0'")
    _mode = mode


def mode() -> str:
    return _mode


class Generated:
    """A generated replay function and what it needs to report errors."""

    __slots__ = ("fn", "source", "lines", "code")

    def __init__(self, fn: Any, source: str, lines: dict[int, int]) -> None:
        self.fn = fn
        self.source = source
        self.lines = lines  # source line -> instruction index
        self.code = fn.__code__

    def __call__(self, tape: Tape, dev: torch.device) -> dict[int, Any]:
        try:
            return self.fn(tape.inputs, tape.instrs, dev)
        except Exception as e:
            found = self._failing(e)
            if found is None:
                raise
            i, frame = found
            ins = tape.instrs[i]
            err = ExecutionError(ins.op, ins.where, e, i)
            # the instructions before i ran: their live values are the frame's locals v<slot>
            live = {int(k[1:]): v for k, v in frame.f_locals.items()
                    if k[:1] == "v" and k[1:].isdigit()}
            err.partial = (tape, i, live)  # see executor.run_tape
            raise err from e

    def _failing(self, e: BaseException) -> tuple[int, Any] | None:
        """The failing instruction and the generated function's frame, from the traceback."""
        tb = e.__traceback__
        line = frame = None
        while tb is not None:
            if tb.tb_frame.f_code is self.code:
                line, frame = tb.tb_lineno, tb.tb_frame
            tb = tb.tb_next
        i = self.lines.get(line) if line is not None else None
        return None if i is None else (i, frame)


def for_tape(tape: Tape) -> Generated | None:
    """The generated function to run ``tape`` with, or None to interpret it (mode, or a miss)."""
    if _mode == "0":
        return None
    plan = tape.plan
    if plan is None:
        if _mode != "always":
            return None
        try:
            return generate(tape)
        except _Unspellable:
            return None
    # a tape whose shapes differ from its plan's reads every int and metadata argument from
    # its own instructions (one function for all shapes); the plan's own tapes bake them in
    name = "codegen_generic" if tape.generic else "codegen"
    g = plan.artifacts.get(name)
    if g is None:
        if _mode == "repeat" and plan.uses < 2:
            return None
        try:
            g = generate(tape, generic=tape.generic)
        except _Unspellable as e:  # an argument tree codegen cannot spell: interpret this plan
            logger.debug("genie: plan interpreted, not generated (%s)", e)
            g = False
        plan.artifacts[name] = g
        bump("codegen_plans")
    return g or None


_counter = [0]


def _simple(x: Any) -> bool:
    """Constants that ``repr`` spells exactly (and that are not per-step parameters)."""
    t = type(x)
    return x is None or t is bool or t is int or t is str


def generate(tape: Tape, generic: bool = False) -> Generated:
    """Generate the replay function of ``tape``'s structure (see the module docstring);
    ``generic``: ints and metadata arguments are read from the step's instructions too."""
    consts: dict[str, Any] = {"_leaves": optree.tree_leaves, "_real_device": real_device,
                              "_rng_call": _rng_call, "_empty": torch.empty_strided,
                              "_empty_meta": _empty_meta,
                              "_alias": torch.ops.aten.alias.default}
    names: dict[int, str] = {}  # id(constant) -> global name: one global per object

    def const(x: Any) -> str:
        n = names.get(id(x))
        if n is None:
            n = names[id(x)] = f"_c{len(names)}"
            consts[n] = x
        return n

    body: list[str] = []
    lines: dict[int, int] = {}
    head = 2  # line 1: def
    for s in tape.inputs:
        body.append(f"v{s} = inputs[{s}]")
    freed = 0
    for i, ins in enumerate(tape.instrs):
        devx = "dev" if ins.device == tape.index else f"_real_device({ins.device})"
        start = len(body)
        if ins.op == UPLOAD:
            call = f"I[{i}].leaves[0].to({devx}, copy={devx}.type == 'cpu')"
            outs_tree = False
        else:
            exprs: list[str] = []
            for p, x in enumerate(ins.leaves):
                t = type(x)
                if t is Slot:
                    exprs.append(f"v{x.id}")
                elif t is torch.device:
                    exprs.append(devx if x.type == "remote_accelerator" else const(x))
                elif t is MetaArg:
                    m = x.meta
                    if generic:
                        exprs.append(f"_empty_meta(I[{i}].leaves[{p}].meta, {devx})")
                    else:
                        exprs.append(f"_empty({tuple(m.shape)!r}, {tuple(m.stride)!r}, "
                                     f"dtype={const(m.dtype)}, device={devx})")
                elif generic and t is int:
                    exprs.append(f"I[{i}].leaves[{p}]")  # a shape: a parameter of this plan
                elif _simple(x):
                    exprs.append(repr(x))
                elif t is float or isinstance(x, torch.Tensor) or type(x).__name__ == "_HostMeta":
                    exprs.append(f"I[{i}].leaves[{p}]")  # a per-step parameter
                else:
                    exprs.append(const(x))
            if exprs and policy(ins.op).inplace_view:
                exprs[0] = f"_alias({exprs[0]})"
            args, kwargs = optree.tree_unflatten(ins.spec, [_Src(e) for e in exprs])
            argv = [_render(a) for a in args] + [f"{k}={_render(v)}" for k, v in kwargs.items()]
            fn = const(ins.op)
            if ins.rng is not None:
                call = f"_rng_call({devx}, I[{i}].rng, {fn}, {', '.join(argv)})" if argv else \
                    f"_rng_call({devx}, I[{i}].rng, {fn})"
            else:
                call = f"{fn}({', '.join(argv)})"
            outs_tree = not _returns_one_tensor(ins.op, ins.outs)
        outs = ins.outs
        if not outs_tree:
            target = f"v{outs[0]}" if outs and outs[0] is not None else "_"
            body.append(f"{target} = {call}")
        else:
            body.append(f"_o = _leaves({call}, none_is_leaf=True)")
            for k, s in enumerate(outs):
                if s is not None:
                    body.append(f"v{s} = _o[{k}]")
        for ln in range(start, len(body)):
            lines[head + ln] = i
        if ins.free:
            body.append("del " + ", ".join(f"v{s}" for s in ins.free))
            freed += len(ins.free)
    if freed:
        body.append(f"_bump('values_freed', {freed})")
        consts["_bump"] = bump
    body.append("return {" + ", ".join(f"{s}: v{s}" for s in sorted(tape.keep)) + "}")
    _counter[0] += 1
    src = "def replay(inputs, I, dev):\n" + "".join(f"    {b}\n" for b in body)
    filename = f"<genie replay {_counter[0]}>"
    code = compile(src, filename, "exec")
    ns: dict[str, Any] = dict(consts)
    exec(code, ns)
    # Not registered in linecache (it would grow with every plan ever generated, evicted or not):
    # the source is Generated.source, and errors name the op and its recorded line anyway.
    return Generated(ns["replay"], src, lines)


def _empty_meta(m: Any, dev: torch.device) -> torch.Tensor:
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=dev)


class _Unspellable(Exception):
    """An argument tree with a node type :func:`_render` does not spell (interpreted instead)."""


class _Src:
    """A leaf of an argument tree already spelled as Python source."""

    __slots__ = ("src",)

    def __init__(self, src: str) -> None:
        self.src = src


def _render(x: Any) -> str:
    t = type(x)
    if t is _Src:
        return x.src
    if t is tuple:
        return "(" + "".join(_render(e) + ", " for e in x) + ")"
    if t is list:
        return "[" + ", ".join(_render(e) for e in x) + "]"
    if t is dict:
        return "{" + ", ".join(f"{k!r}: {_render(v)}" for k, v in x.items()) + "}"
    if x is None:
        return "None"
    raise _Unspellable(f"genie codegen: cannot spell an argument tree node of type {t.__name__}")


def _returns_one_tensor(op: Any, outs: tuple[int | None, ...]) -> bool:
    """Whether ``op`` returns a bare Tensor (so its one output needs no flattening)."""
    if len(outs) != 1 or not isinstance(op, torch._ops.OpOverload):
        return False
    rets = op._schema.returns
    return len(rets) == 1 and isinstance(rets[0].type, torch.TensorType)


def _rng_call(dev: torch.device, rng: tuple[int, int], fn: Any, /, *args: Any,
              **kwargs: Any) -> Any:
    gen = generator_for(dev)
    saved = gen.get_state()
    gen.manual_seed(seed_from(*rng))
    try:
        return fn(*args, **kwargs)
    finally:
        gen.set_state(saved)

