"""The ``compiled`` backend: a tape as a ``torch.fx`` graph, compiled once per plan by
``torch.compile``.

Each tape becomes a ``GraphModule``: one placeholder per tape input, per upload and per host
tensor constant (the values that change from step to step), one ``call_function`` per
instruction with numbers, dtypes and devices baked in (they are part of the plan's structure, see
:mod:`genie.plan_cache`), and the kept slots as outputs. The compiled module is stored on the
tape's :class:`~genie.plan_cache.Plan`, so a loop that repeats its structure compiles once and
then only feeds new inputs. In-place updates of inputs (optimizer steps) are handled by
``torch.compile``'s functionalization, which writes the results back into the input tensors.

Compiler: ``GENIE_COMPILER`` (``inductor`` by default when a C++ compiler is on the PATH for CPU
devices, else ``aot_eager``); :func:`set_compiler` changes it at run time.

What it refuses (:meth:`CompiledBackend.check`; the registry then falls back to ``eager`` with one
warning per reason):

- tapes without a cached plan (``GENIE_PLAN_CACHE=0``): there would be nothing to reuse;
- random ops: their values are defined by Genie's ``(seed, offset)`` contract on the device's
  eager generator, which a compiled RNG does not reproduce;
- tapes whose instructions run on more than one device;
- ops whose outputs are nested containers.

Tapes with fewer than ``GENIE_COMPILE_MIN_INSTRS`` (default 3) compute instructions are not worth
a compilation: the backend runs them with the eager interpreter itself, silently.
"""

from __future__ import annotations

import operator
import os
import shutil
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..errors import ExecutionError
from ..meta import policy
from ..planner import MetaArg, Slot, Tape
from ..stats import bump
from . import BackendUnsupported, register_backend
from .eager import run_instrs

UPLOAD = "genie.upload"
_SMALL = object()  # artifact of plans too small to compile: run by the eager interpreter
MIN_INSTRS = int(os.environ.get("GENIE_COMPILE_MIN_INSTRS", "3") or 3)
VERIFY = os.environ.get("GENIE_COMPILE_VERIFY", "1").strip() != "0"

_compiler: str | None = os.environ.get("GENIE_COMPILER", "").strip() or None


def default_compiler() -> str:
    """``inductor`` when it can build CPU kernels here (a C++ compiler is found), else
    ``aot_eager`` (the same graph capture and functionalization, kernels run by ATen)."""
    try:
        from torch._inductor import config as ic

        cxx = ic.cpp.cxx[-1] if isinstance(ic.cpp.cxx, tuple) else ic.cpp.cxx
    except Exception:
        return "aot_eager"
    return "inductor" if shutil.which(cxx or "g++") else "aot_eager"


def compiler() -> str:
    """The ``torch.compile`` backend in use."""
    global _compiler
    if _compiler is None:
        _compiler = default_compiler()
    return _compiler


def set_compiler(name: str) -> None:
    """Use ``torch.compile(backend=name)`` for plans compiled from now on.

    Example:
        >>> from genie.backends import compiled
        >>> compiled.set_compiler("aot_eager")
        >>> compiled.compiler()
        'aot_eager'
    """
    global _compiler
    _compiler = name


# --- lowering a tape to fx ----------------------------------------------------------------------

_out_kinds: dict[Any, str | None] = {}


def _out_kind(op: Any) -> str | None:
    """How an op's flat outputs map to its return value: ``"one"`` (a Tensor), ``"index"``
    (a tuple of Tensors or a Tensor[]: getitem k), ``"none"`` (no return), None (nested)."""
    k = _out_kinds.get(op, "?")
    if k != "?":
        return k
    rets = op._schema.returns
    if not rets:
        k = "none"
    elif len(rets) == 1:
        t = rets[0].type
        if isinstance(t, torch.TensorType):
            k = "one"
        elif isinstance(t, torch.ListType) and isinstance(t.getElementType(), torch.TensorType):
            k = "index"
        else:
            k = None
    elif all(isinstance(r.type, torch.TensorType) for r in rets):
        k = "index"
    else:
        k = None
    _out_kinds[op] = k
    return k


def refusal(tape: Tape) -> str | None:
    """Why this backend cannot take ``tape`` (None when it can)."""
    if tape.plan is None:
        return "the tape has no cached plan (GENIE_PLAN_CACHE=0), so no compilation to reuse"
    for ins in tape.instrs:
        if ins.rng is not None:
            return ("random ops follow Genie's (seed, offset) contract on the eager generator, "
                    "which a compiled graph does not reproduce")
        if ins.device != tape.index:
            return "the tape runs on more than one device"
        if ins.op == UPLOAD:
            continue
        if not isinstance(ins.op, torch._ops.OpOverload):
            return f"{ins.op} is not an ATen op"
        if _out_kind(ins.op) is None:
            return f"{ins.op} returns a nested structure"
    return None


@dataclass
class Compiled:
    """A plan's compiled module and how to feed it.

    ``feeds`` lists, per placeholder after the tape inputs, ``(instr, leaf, is_upload)``: where
    the step's value sits in the tape. ``floats`` are the float arguments it takes as inputs
    (the plan's :attr:`~genie.plan_cache.Plan.floats` when it was compiled).
    """

    fn: Any
    inputs: list[int]
    feeds: list[tuple[int, int, bool]]
    keep: list[int]
    floats: frozenset[tuple[int, int]]
    graph: Any  # the GraphModule (for inspection: print(c.graph.code))


def to_graph_module(tape: Tape, dev: torch.device, floats: frozenset[tuple[int, int]] = frozenset()
                    ) -> tuple[torch.fx.GraphModule, list[int], list[tuple[int, int, bool]],
                               list[int]]:
    """``(module, input slots, feeds, kept slots)``: ``tape`` as an fx graph (see module doc).

    Float arguments at ``floats`` positions ``(instr, leaf)`` become inputs; others are baked in.
    """
    g = torch.fx.Graph()
    env: dict[int, torch.fx.Node] = {}
    inputs = sorted(tape.inputs)
    for s in inputs:
        env[s] = g.placeholder(f"in{s}")
    feeds: list[tuple[int, int, bool]] = []
    aten = torch.ops.aten
    for i, ins in enumerate(tape.instrs):
        if ins.op == UPLOAD:
            feeds.append((i, 0, True))
            env[ins.outs[0]] = g.placeholder(f"upload{i}")
            continue
        leaves: list[Any] = []
        for j, x in enumerate(ins.leaves):
            t = type(x)
            if t is Slot:
                leaves.append(env[x.id])
            elif t is MetaArg:
                m = x.meta
                leaves.append(g.call_function(aten.empty_strided.default,
                                              (list(m.shape), list(m.stride)),
                                              {"dtype": m.dtype, "device": dev}))
            elif isinstance(x, torch.Tensor):
                feeds.append((i, j, False))
                leaves.append(g.placeholder(f"host{i}_{j}"))
            elif t is float and (i, j) in floats:
                feeds.append((i, j, False))
                leaves.append(g.placeholder(f"scalar{i}_{j}"))
            elif t is torch.device and x.type == "remote_accelerator":
                leaves.append(dev)
            else:
                leaves.append(x)
        if policy(ins.op).inplace_view:  # as eager: re-view a fresh alias (see eager.run_instr)
            leaves[0] = g.call_function(aten.alias.default, (leaves[0],))
        args, kwargs = optree.tree_unflatten(ins.spec, leaves)
        node = g.call_function(ins.op, tuple(args), kwargs)
        kind = _out_kind(ins.op)
        for k, s in enumerate(ins.outs):
            if s is not None:
                env[s] = node if kind == "one" else g.call_function(operator.getitem, (node, k))
    keep = sorted(tape.keep)
    g.output(tuple(env[s] for s in keep))
    return torch.fx.GraphModule(torch.nn.Module(), g), inputs, feeds, keep


def _compile(tape: Tape, dev: torch.device) -> Compiled:
    floats = frozenset(tape.plan.floats)
    gm, inputs, feeds, keep = to_graph_module(tape, dev, floats)
    fn = torch.compile(gm, backend=compiler(), dynamic=False)
    bump("compiled_plans")
    return Compiled(fn, inputs, feeds, keep, floats, gm)


def _compile_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo import exc

    return tuple(e for e in (getattr(exc, n, None) for n in (
        "BackendCompilerFailed", "Unsupported", "InternalTorchDynamoError", "TorchRuntimeError",
        "UserError")) if isinstance(e, type))


@register_backend("compiled")
class CompiledBackend:
    """Runs a tape as one ``torch.compile``-d fx graph, compiled once per cached plan."""

    name = "compiled"

    def __init__(self) -> None:
        self._available: bool | None = None

    def is_available(self) -> bool:
        if self._available is None:
            try:
                import torch._dynamo  # noqa: F401

                self._available = torch._dynamo.is_dynamo_supported()
            except Exception:
                self._available = False
        return self._available

    def check(self, tape: Tape) -> str | None:
        plan = tape.plan
        if plan is None:
            return refusal(tape)
        art = plan.artifacts.get("compiled")
        if art is None:
            reason = refusal(tape)
            if reason is not None:
                plan.artifacts["compiled"] = reason
            return reason
        return art if isinstance(art, str) else None

    def run(self, tape: Tape, device: torch.device) -> dict[int, Any]:
        plan = tape.plan
        art = plan.artifacts.get("compiled")
        if art is _SMALL or (art is None and
                             sum(ins.op != UPLOAD for ins in tape.instrs) < MIN_INSTRS):
            plan.artifacts["compiled"] = _SMALL
            return run_instrs(tape, device)
        if isinstance(art, str):
            raise BackendUnsupported(art)
        if art is None or art.floats != plan.floats:
            # first use, or a float argument changed value since: compile with it as an input
            art = _compile(tape, device)
            if VERIFY:
                return _trial(tape, device, art)
            plan.artifacts["compiled"] = art
        args = _args(tape, device, art)
        from torch.utils._python_dispatch import _disable_current_modes

        try:
            with _disable_current_modes(), torch.no_grad():
                outs = art.fn(*args)
        except _compile_errors() as e:  # only without the trial run (GENIE_COMPILE_VERIFY=0)
            reason = _failure(e)
            plan.artifacts["compiled"] = reason
            raise BackendUnsupported(reason) from e
        except Exception as e:
            raise ExecutionError(f"compiled plan ({len(tape.instrs)} instrs)", None, e) from e
        bump("compiled_runs")
        return dict(zip(art.keep, outs))


def _args(tape: Tape, device: torch.device, art: Compiled) -> list[Any]:
    args: list[Any] = [tape.inputs[s] for s in art.inputs]
    instrs = tape.instrs
    for i, j, up in art.feeds:
        x = instrs[i].leaves[j]
        args.append(x.to(device, copy=True) if up else x)
    return args


def _failure(e: BaseException) -> str:
    cause = getattr(e, "inner_exception", None) or e
    name = getattr(compiler(), "__name__", compiler())
    text = str(cause).strip().splitlines()
    return (f"torch.compile(backend={name!r}) failed: {type(cause).__name__}: "
            f"{text[0][:200] if text else ''}")


def _trial(tape: Tape, device: torch.device, art: Compiled) -> dict[int, Any]:
    """First run of a new compilation: eager computes the real values, the compiled module runs
    on copies of the inputs (same storages sharing, strides and offsets) and must agree.

    A compilation that fails or disagrees is remembered as the plan's refusal reason (one warning)
    and never touches a real value; the step's values are eager's either way.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    from . import _warned
    from ..config import logger

    args = _args(tape, device, art)
    copies = _copy_sharing(args)
    kept = run_instrs(tape, device)  # the reference; errors here are real, and propagate
    reason = None
    try:
        with _disable_current_modes(), torch.no_grad():
            outs = art.fn(*copies)
    except Exception as e:
        reason = _failure(e)
    else:
        n = len(art.inputs)
        pairs = [(f"value %{s}", o, kept[s]) for s, o in zip(art.keep, outs)]
        pairs += [(f"input %{s} after the run", c, a)
                  for s, c, a in zip(art.inputs, copies[:n], args[:n])]
        for what, got, want in pairs:
            if not _agrees(got, want):
                reason = f"its result differs from eager's ({what}); a torch.compile bug"
                break
    plan = tape.plan
    if reason is None:
        plan.artifacts["compiled"] = art
        bump("compiled_verified")
    else:
        plan.artifacts["compiled"] = reason
        if ("compiled", reason) not in _warned:
            _warned.add(("compiled", reason))
            logger.warning("genie: backend 'compiled' skipped (%s); eager runs this plan", reason)
    return kept


def _copy_sharing(args: list[Any]) -> list[Any]:
    """Copies of the tensors in ``args`` that share storages exactly as the originals do."""
    storages: dict[tuple[str, int], Any] = {}
    out = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            out.append(a)
            continue
        st = a.untyped_storage()
        key = (str(a.device), st.data_ptr())
        c = storages.get(key)
        if c is None:
            c = storages[key] = st.clone()
        t = torch.empty((0,), dtype=a.dtype, device=a.device)
        t.set_(c, a.storage_offset(), a.shape, a.stride())
        out.append(t)
    return out


def _agrees(got: Any, want: Any) -> bool:
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return got == want
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype.is_floating_point or got.dtype.is_complex:
        return torch.allclose(got, want, rtol=1e-3, atol=1e-4, equal_nan=True)
    return torch.equal(got, want)
