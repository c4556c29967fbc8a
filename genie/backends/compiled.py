"""The ``compiled`` backend: a tape as a ``torch.fx`` graph, compiled once per plan by
``torch.compile``.

Each tape becomes a ``GraphModule``: one placeholder per tape input, per upload, per host
tensor constant and per float argument seen to change (the values that change from step to
step), one ``call_function`` per instruction with the other constants baked in, and the kept
slots as outputs (kept views of inputs are re-applied after the call instead). The compiled module
is stored on the tape's :class:`~genie.plan_cache.Plan`, so a loop that repeats its structure
compiles once and then only feeds new inputs. In-place updates of inputs (optimizer steps) are
handled by ``torch.compile``'s functionalization, which writes the results back into the inputs.

The first run of each compilation is a trial: eager computes the real values while the compiled
module runs on copies of the inputs, and must agree (``GENIE_COMPILE_VERIFY=0`` skips it). A
compilation that fails or disagrees never touches a real value; its plan runs on eager.

Compiler: ``GENIE_COMPILER`` (``inductor`` by default when a C++ compiler is on the PATH for CPU
devices, else ``aot_eager``); :func:`set_compiler` changes it at run time.

What it refuses (:meth:`CompiledBackend.check`; the registry then falls back to ``eager`` with one
warning per reason):

- tapes without a cached plan (``GENIE_PLAN_CACHE=0``): there would be nothing to reuse;
- random ops: their values are defined by Genie's ``(seed, offset)`` contract on the device's
  eager generator, which a compiled RNG does not reproduce;
- tapes whose instructions run on more than one device;
- ops whose outputs are nested containers;
- a float that changes from step to step in a non-Tensor argument of an op outside
  :data:`_SCALAR_REWRITES`: ``torch.compile`` specializes those and would recompile every step.
  The ops in that table (``addcdiv``/``addcmul``, ``add``/``sub`` with ``alpha``, ``mul``/``div``
  by a Scalar, and their in-place forms: what optimizers use for per-step factors such as Adam's
  ``addcdiv_(..., value=-lr / bias_correction)``) are lowered with the scalar in a Tensor-typed
  argument, where it is a kernel argument, so an Adam loop compiles once. Their ``_foreach_*``
  forms (``Scalar``, ``ScalarList`` and ``add``/``sub`` ``List`` with ``alpha``: the
  multi-tensor optimizers' bias corrections and step sizes) are lowered as one such op per
  tensor, the k-th float of a ScalarList going to the k-th tensor's op;
- plans whose compilation failed, disagreed with eager in the trial, or recompiled.

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

from ..config import logger
from ..errors import ExecutionError
from ..meta import policy
from ..planner import MetaArg, Slot, Tape
from ..progress import waiting
from ..stats import bump
from . import BackendUnsupported, _warned, register_backend
from .eager import run_instr, run_instrs

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
    if tape.generic:
        return ("its shapes differ from those its plan was compiled for (a shape-generic plan "
                "hit; GENIE_SHAPE_GENERIC=0 compiles a plan per shape instead)")
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

    ``feeds`` lists, per placeholder after the tape inputs, ``(instr, leaf, kind)``: where the
    step's value sits in the tape; kind ``"upload"`` (a host tensor to copy to the device),
    ``"host"`` (a host tensor argument) or ``"float"`` (fed as a 0-d float64 tensor).
    ``floats`` are the float arguments it takes as inputs (the plan's
    :attr:`~genie.plan_cache.Plan.floats` when it was compiled).
    """

    fn: Any
    inputs: list[int]
    feeds: list[tuple[int, int, str]]
    keep: list[int]
    floats: frozenset[tuple[int, int]]
    graph: Any  # the GraphModule (for inspection: print(c.graph.code))
    replay: list[int]  # view instructions re-applied to the real inputs after the call
    replayed: list[int]  # kept slots that are inputs or views of inputs (computed by replay)
    compiles: int = 0  # how many graphs torch.compile built for it (1 when nothing specialized)


@dataclass
class Lowered:
    """A tape as an fx graph: the module, what feeds its placeholders, what it returns."""

    gm: torch.fx.GraphModule
    inputs: list[int]  # tape input slots, the first placeholders
    feeds: list[tuple[int, int, str]]  # then (instr, leaf, kind) per further placeholder
    keep: list[int]  # kept slots the graph returns, in order
    replay: list[int]  # view instructions to re-apply to the real inputs after the call
    replayed: list[int]  # kept slots that are inputs or views of inputs


def to_graph_module(tape: Tape, dev: torch.device,
                    floats: frozenset[tuple[int, int]] = frozenset()) -> Lowered:
    """``tape`` as an fx graph (see the module doc).

    Float arguments at ``floats`` positions ``(instr, leaf)`` become inputs; others are baked in.
    Kept values that are inputs or views of inputs (``w.t()`` saved for backward while ``w`` is
    updated in place) are not graph outputs: their view ops are re-applied to the real inputs
    after the call, which keeps their aliasing exact and avoids asking ``torch.compile`` to
    regenerate views of mutated inputs.
    """
    scalar_floats = _scalar_floats(tape, floats)
    g = torch.fx.Graph()
    env: dict[int, torch.fx.Node] = {}
    inputs = sorted(tape.inputs)
    for s in inputs:
        env[s] = g.placeholder(f"in{s}")
    feeds: list[tuple[int, int, str]] = []
    chain: dict[int, tuple[int, ...]] = {s: () for s in inputs}  # view of an input: via instrs
    aten = torch.ops.aten
    for i, ins in enumerate(tape.instrs):
        if ins.op == UPLOAD:
            feeds.append((i, 0, "upload"))
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
                feeds.append((i, j, "host"))
                leaves.append(g.placeholder(f"host{i}_{j}"))
            elif t is float and (i, j) in floats:
                # A 0-d float64 tensor read with .item(): the value is data, so torch.compile
                # does not specialize on it (a Python float input would be guarded on, and
                # recompiled for every new learning rate). float64 holds the float exactly.
                feeds.append((i, j, "float"))
                leaves.append(g.call_method("item", (g.placeholder(f"scalar{i}_{j}"),)))
            elif t is torch.device and x.type == "remote_accelerator":
                leaves.append(dev)
            else:
                leaves.append(x)
        if policy(ins.op).inplace_view:  # as eager: re-view a fresh alias (see eager.run_instr)
            leaves[0] = g.call_function(aten.alias.default, (leaves[0],))
        args, kwargs = optree.tree_unflatten(ins.spec, leaves)
        if any((i, j) in scalar_floats for j in range(len(ins.leaves))):
            node = _SCALAR_REWRITES[ins.op](g, tuple(args), kwargs)
        else:
            node = g.call_function(ins.op, tuple(args), kwargs)
        kind = _out_kind(ins.op)
        pol = policy(ins.op)
        if kind == "one" and len(pol.returns) == 1 and pol.returns[0] is not None and \
                pol.returns[0][0] == "view" and ins.outs[0] is not None:
            targs, tkwargs = optree.tree_unflatten(ins.spec, ins.leaves)
            src = pol.arg(pol.returns[0][1], targs, tkwargs)
            if type(src) is Slot and src.id in chain:
                chain[ins.outs[0]] = (*chain[src.id], i)
        for k, s in enumerate(ins.outs):
            if s is None:
                continue
            if kind == "one":
                env[s] = node
            elif type(node) is list:  # a rewritten _foreach_ op: one node per tensor
                env[s] = node[k]
            else:
                env[s] = g.call_function(operator.getitem, (node, k))
    keep = [s for s in sorted(tape.keep) if s not in chain]
    replayed = [s for s in sorted(tape.keep) if s in chain]
    replay = sorted({i for s in replayed for i in chain[s]})
    g.output(tuple(env[s] for s in keep))
    return Lowered(torch.fx.GraphModule(torch.nn.Module(), g), inputs, feeds, keep, replay,
                   replayed)


def _compile(tape: Tape, dev: torch.device) -> Compiled:
    floats = frozenset(tape.plan.floats)
    lo = to_graph_module(tape, dev, floats)
    art = Compiled(None, lo.inputs, lo.feeds, lo.keep, floats, lo.gm, lo.replay, lo.replayed)
    inner = compiler()
    if isinstance(inner, str):
        from torch._dynamo import lookup_backend

        inner = lookup_backend(inner)

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        art.compiles += 1  # more than one: torch.compile specialized on something that changes
        with waiting(f"compiling a plan of {len(tape.instrs)} ops with torch.compile"):
            return inner(gm, example_inputs)

    art.fn = torch.compile(lo.gm, backend=counting, dynamic=False)
    bump("compiled_plans")
    return art


def _scalar_floats(tape: Tape, floats: frozenset[tuple[int, int]] | set[tuple[int, int]]
                   ) -> set[tuple[int, int]]:
    """The changing floats (``(instr, leaf)``) that sit in non-Tensor arguments."""
    out = set()
    for i, j in floats:
        ins = tape.instrs[i]
        arg = _schema_arg(ins.op, ins.spec, j)
        if arg is None or not isinstance(arg.type, torch.TensorType):
            out.add((i, j))
    return out


def _changing_scalar(tape: Tape, floats: set[tuple[int, int]]) -> str | None:
    """A reason to refuse when a float that changes per step sits in a non-Tensor argument of an
    op that :data:`_SCALAR_REWRITES` cannot rewrite: torch.compile specializes those."""
    for i, j in sorted(_scalar_floats(tape, floats)):
        ins = tape.instrs[i]
        rewrite = _SCALAR_REWRITES.get(ins.op)
        if rewrite is not None:
            args, _ = optree.tree_unflatten(ins.spec, ins.leaves)
            if all(_lazy(a) for a in args[:rewrite.tensors]):
                continue
        arg = _schema_arg(ins.op, ins.spec, j)
        name = arg.name if arg is not None else "?"
        return (f"the float argument '{name}' of {ins.op} changes from step to step, and "
                "torch.compile specializes non-Tensor arguments (it would recompile every "
                "step); ops whose scalars can be graph inputs (with Tensor operands): "
                + ", ".join(sorted(str(op) for op in _SCALAR_REWRITES
                                   if not op.__name__.startswith("_foreach_")))
                + ", and their _foreach_ forms")
    return None


# --- changing Scalar arguments as graph inputs ----------------------------------------------
#
# torch.compile turns a float that reaches a Tensor-typed argument (``x * lr``) into a kernel
# argument, but specializes (guards on, recompiles for) one in a Scalar argument
# (``addcdiv_(..., value=-step_size)``). These ops are re-expressed with the scalar in a
# Tensor-typed argument, in the order of operations of their CPU kernels
# (aten/src/ATen/native/cpu/PointwiseOpsKernel.cpp, BinaryOpsKernel.cpp), so the values are
# eager's up to how the compiler fuses them (checked by the trial run).

def _lazy(a: Any) -> bool:
    """A lazy value (a slot of the tape), or a list of them (a ``Tensor[]`` argument)."""
    if type(a) in (list, tuple):
        return bool(a) and all(type(x) is Slot for x in a)
    return type(a) is Slot


def _kw(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, 1)


class _Rewrite:
    """An fx emitter for one op; its first ``tensors`` arguments must be Tensors (lazy values),
    or lists of them for a ``_foreach_`` op."""

    def __init__(self, tensors: int, emit: Any) -> None:
        self.tensors = tensors
        self.emit = emit

    def __call__(self, g: torch.fx.Graph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.emit(g, args, kwargs)


def _addc(combine: Any, inplace: bool) -> _Rewrite:
    """``addcmul``/``addcdiv``: ``self + value * t1 (*|/) t2``."""
    aten = torch.ops.aten

    def emit(g: torch.fx.Graph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self_, t1, t2 = args[:3]
        scaled = g.call_function(aten.mul.Tensor, (t1, _kw(args, kwargs, 3, "value")))
        term = g.call_function(combine, (scaled, t2))
        return g.call_function(aten.add_.Tensor if inplace else aten.add.Tensor, (self_, term))

    return _Rewrite(3, emit)


def _alpha(base: Any) -> _Rewrite:
    """``add``/``sub`` with ``alpha``: ``self (+|-) alpha * other``."""
    aten = torch.ops.aten

    def emit(g: torch.fx.Graph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        scaled = g.call_function(aten.mul.Tensor, (args[1], _kw(args, kwargs, 2, "alpha")))
        return g.call_function(base, (args[0], scaled))

    return _Rewrite(2, emit)


def _as_tensor_overload(op: Any) -> _Rewrite:
    """``mul.Scalar(x, s)`` -> ``mul.Tensor(x, s)`` (a Python scalar there is a wrapped
    number: the same type promotion)."""
    def emit(g: torch.fx.Graph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return g.call_function(op, args, kwargs)

    return _Rewrite(1, emit)


def _per_tensor(elem: _Rewrite, lists: int) -> _Rewrite:
    """A ``_foreach_`` op as ``elem`` once per tensor (a list of fx nodes, one per output).

    Its first ``lists`` arguments are ``Tensor[]``; a ``Scalar[]`` argument gives the k-th
    tensor's op its k-th float, a Scalar goes to every one. This is also how PyTorch's own
    per-tensor (slow path) foreach kernels compute them: ``xs[k].div_(scalars[k])``.
    """
    def pick(a: Any, k: int) -> Any:
        return a[k] if type(a) in (list, tuple) else a

    def emit(g: torch.fx.Graph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return [elem(g, tuple(pick(a, k) for a in args),
                     {name: pick(v, k) for name, v in kwargs.items()})
                for k in range(len(args[0]))]

    return _Rewrite(lists, emit)


def _foreach_rewrites(table: dict[Any, _Rewrite]) -> None:
    """Add the ``_foreach_`` forms of the ops in ``table`` (what multi-tensor optimizers call
    with per-step floats: Adam's ``_foreach_div_(xs, bias_corrections)`` and
    ``_foreach_addcdiv_(params, m, v, step_sizes)``, SGD's ``_foreach_add_(ps, gs, alpha=-lr)``
    under a scheduler)."""
    aten = torch.ops.aten
    for name in ("add", "sub", "mul", "div"):
        for suffix in ("", "_"):
            fe = getattr(aten, f"_foreach_{name}{suffix}")
            scalar = _per_tensor(_as_tensor_overload(getattr(aten, name + suffix).Tensor), 1)
            table[fe.Scalar] = table[fe.ScalarList] = scalar
            if name in ("add", "sub"):  # List with alpha
                table[fe.List] = _per_tensor(table[getattr(aten, name + suffix).Tensor], 2)
    for name in ("addcdiv", "addcmul"):
        for suffix in ("", "_"):
            fe = getattr(aten, f"_foreach_{name}{suffix}")
            per = _per_tensor(table[getattr(aten, name + suffix).default], 3)
            table[fe.Scalar] = table[fe.ScalarList] = per


def _scalar_rewrites() -> dict[Any, _Rewrite]:
    aten = torch.ops.aten
    table = {
        aten.addcdiv.default: _addc(aten.div.Tensor, False),
        aten.addcdiv_.default: _addc(aten.div.Tensor, True),
        aten.addcmul.default: _addc(aten.mul.Tensor, False),
        aten.addcmul_.default: _addc(aten.mul.Tensor, True),
        aten.add.Tensor: _alpha(aten.add.Tensor),
        aten.add_.Tensor: _alpha(aten.add_.Tensor),
        aten.sub.Tensor: _alpha(aten.sub.Tensor),
        aten.sub_.Tensor: _alpha(aten.sub_.Tensor),
    }
    for name in ("mul", "div"):
        for suffix in ("", "_"):
            packet = getattr(aten, name + suffix)
            table[packet.Scalar] = _as_tensor_overload(packet.Tensor)
    _foreach_rewrites(table)
    return table


_SCALAR_REWRITES: dict[Any, _Rewrite] = _scalar_rewrites()


def _schema_arg(op: Any, spec: Any, leaf: int) -> Any:
    """The schema argument that flat leaf ``leaf`` of ``op``'s (args, kwargs) belongs to."""
    args, kwargs = optree.tree_unflatten(spec, list(range(spec.num_leaves)))
    schema_args = op._schema.arguments
    for p, a in enumerate(args):
        if leaf in optree.tree_leaves(a, none_is_leaf=True):
            return schema_args[p] if p < len(schema_args) else None
    for name, a in kwargs.items():
        if leaf in optree.tree_leaves(a, none_is_leaf=True):
            return next((x for x in schema_args if x.name == name), None)
    return None


def _dynamo_config() -> Any:
    """Trace-time settings for our graphs: ``.item()`` of a float input stays in the graph."""
    import torch._dynamo

    return torch._dynamo.config.patch(capture_scalar_outputs=True)


def _call(art: Compiled, args: list[Any], tape: Tape, dev: torch.device) -> dict[int, Any]:
    """Run the compiled module on ``args``, then re-apply the kept views of its inputs."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad(), _dynamo_config():
        kept = dict(zip(art.keep, art.fn(*args), strict=True))
        if art.replayed:
            env = dict(zip(art.inputs, args, strict=False))  # feeds follow
            for i in art.replay:
                ins = tape.instrs[i]
                for s, v in zip(ins.outs, run_instr(ins, env, dev), strict=False):
                    if s is not None:
                        env[s] = v
            for s in art.replayed:
                kept[s] = env[s]
    return kept


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
        if plan is None or tape.generic:  # the plan's artifact is for the plan's shapes only
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
            reason = _changing_scalar(tape, plan.floats)
            if reason is not None:
                plan.artifacts["compiled"] = reason
                raise BackendUnsupported(reason)
            art = _compile(tape, device)
            if VERIFY:
                return _trial(tape, device, art)
            plan.artifacts["compiled"] = art
        try:
            kept = _call(art, _args(tape, device, art), tape, device)
        except _compile_errors() as e:  # only without the trial run (GENIE_COMPILE_VERIFY=0)
            reason = _failure(e)
            plan.artifacts["compiled"] = reason
            raise BackendUnsupported(reason) from e
        except Exception as e:
            raise ExecutionError(f"compiled plan ({len(tape.instrs)} instrs)", None, e) from e
        bump("compiled_runs")
        if art.compiles > 1:  # a guard failed: it would recompile again; eager from now on
            plan.artifacts["compiled"] = ("torch.compile recompiled this plan (it specialized on "
                                          "a value that changes between steps)")
        return kept


def _args(tape: Tape, device: torch.device, art: Compiled) -> list[Any]:
    args: list[Any] = [tape.inputs[s] for s in art.inputs]
    instrs = tape.instrs
    for i, j, kind in art.feeds:
        x = instrs[i].leaves[j]
        if kind == "upload":
            x = x.to(device, copy=True)
        elif kind == "float":
            x = torch.tensor(x, dtype=torch.float64)
        args.append(x)
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
    args = _args(tape, device, art)
    copies = _copy_sharing(args)
    kept = run_instrs(tape, device)  # the reference; errors here are real, and propagate
    reason = None
    try:
        got = _call(art, copies, tape, device)
    except Exception as e:
        reason = _failure(e)
    else:
        n = len(art.inputs)
        pairs = [(f"value %{s}", got[s], kept[s]) for s in tape.keep]
        pairs += [(f"input %{s} after the run", c, a)
                  for s, c, a in zip(art.inputs, copies[:n], args[:n], strict=True)]
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
