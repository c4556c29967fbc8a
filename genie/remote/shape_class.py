"""Vet a structure once per *shape class*, not once per shape (issue 27: vet once, replay natively).

A session's tapes repeat one structure with shapes that move: a decode step's KV cache grows by
a token, ``generate`` starts at a prompt length never seen. The worker's concrete vet
(:func:`genie.remote.guard.vet_tape`) runs every instruction on meta tensors of the exact
shapes, ~30 ms for a GPT-2 12x768 decode step: more than the step's kernels. A shape class
vets the structure once with the moving integers as *symbols* and keeps what the check
depended on:

1. :func:`shape_params` splits one call of a structure into its **static** part (dtypes,
   ranks, aliasing, host constants, baked constants: equal or a different class; a bool an op
   only writes into its output, by its type: :func:`_value_leaves`) and its flat
   list of **integers** (the inputs' sizes, strides, offsets and storage bytes; every ``int``
   argument of every instruction).
2. When a second call of the same static part vets clean with different integers,
   :func:`build` runs the tape once under a ``FakeTensorMode`` with a ``ShapeEnv``: each
   integer that moved (both values >= 2) becomes a backed symbol, every other one stays as it
   is. Every meta kernel's check, every bounds check of a view (:func:`guard.check_bounds`),
   every branch on a size, records a guard on the symbols; the bytes every instruction
   allocates sum to a symbolic **bound** of the working set (host constants and metadata-only
   arguments included). An instruction is run once per (op, argument tree, leaves' symbolic
   metadata, aliasing, constants): a later one with the same key has its effect (a decode
   step's 12 identical layers run once); one with no symbol in its leaves runs on plain meta
   tensors as the concrete vet runs it (``_run``; a GPT-2 12x768 decode step: ~0.15-0.35 s,
   was ~1.0-1.8 s).
3. A later call is admitted by :meth:`ShapeClass.admit` when its fixed integers are the class's
   exactly and its symbols satisfy every guard (PyTorch's own guard code,
   ``ShapeEnv.produce_guards_expression``, ranges and 0/1 specialization included); the bound
   is then its working set for the quota. Anything else (a guard fails, the bound passes the
   budget, a kernel that cannot run symbolically) goes through the concrete vet as before:
   a class only ever skips work the concrete vet would have done with the same answer.

Soundness rests on the meta kernels being traced symbolically: a check on a size is a branch on
a symbolic boolean, which the ShapeEnv records as a guard; a kernel that needs a concrete size
specializes the symbol (a guard of equality). A class never admits a call whose concrete vet
would have failed any check the symbolic run went through.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any, Callable

import optree
import sympy
import torch
import torch._dynamo.config
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP, DimDynamic, ShapeEnv, \
    free_unbacked_symbols
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._sympy.printers import PythonPrinter

from .. import _C
from ..meta import VALUE_LEAVES_NONE as _NONE, policy, value_leaves as _value_leaves
from ..graph import tuple_getter
from ..planner import Instr, MetaArg, Slot, Tape
from ..shape_rules import contiguous_strides
from .guard import META, UPLOAD, _const_key, _has_device_arg, _meta_arg_nbytes, _NoKey, _short, \
    _with_meta_device, check_bounds, meta_view

#: a class is built from two calls whose moving integers are all at least this (0 and 1 are
#: specialized by PyTorch's symbolic shapes: a size of 1 broadcasts)
MIN_SYMBOL = 2
#: at most this many symbols per class (a structure whose every integer moves is not a class)
MAX_SYMBOLS = 1024

_BAKED = (bool, str, complex, torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Part(tuple):
    """A part of a class key that a structure's calls share (the instructions' part, kept in
    ``Filled.params`` while only numbers change): its hash computed once, not on every request
    (a GPT-2 4x128 step's ~1,000 items). Equal as the tuple it is."""

    def __hash__(self) -> int:
        try:
            return self._h  # type: ignore[attr-defined,has-type]
        except AttributeError:
            self._h = h = tuple.__hash__(self)
            return h


class ClassKey:
    """The static part of a call (:func:`shape_params`) with its hash computed once: a request
    looks its structure up 2-3 times (vetted shapes, shape classes), and a GPT-2 decode step's
    key holds ~1,400 items (~9 µs a hash). Equal when the parts are equal (always compared
    whole on a hit: a hash never stands for the key); ``key[i]`` is part ``i``."""

    __slots__ = ("parts", "_hash", "baked")

    def __init__(self, parts: tuple, baked: tuple | None = None) -> None:
        self.parts = parts
        self._hash = hash(parts)
        #: the constants of the call's instructions, with the values the class key holds by
        #: type only (:func:`_value_leaves`, which a native program reads per step)
        self.baked = parts[1] if baked is None else baked

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is ClassKey and self._hash == other._hash and
                                 self.parts == other.parts)

    def __getitem__(self, i: int) -> Any:
        return self.parts[i]

    def __repr__(self) -> str:
        return f"ClassKey({self.parts!r:.200})"


def shape_params(key: bytes, tape: Tape, filled: Any = None
                 ) -> tuple[ClassKey, tuple[int, ...]] | None:
    """``(class key, integers)`` of one call of a skeleton (None when a constant cannot be
    keyed). The class key holds everything but the integers: the skeleton's key, the constants
    a native program bakes (see ``native_replay.compile_tape``), the inputs' ranks, dtypes,
    conj/neg bits, density and aliasing, host tensors' and metadata arguments' layouts, and the
    floats of ops whose float values decide sizes. Random seeds are not constants
    (``Instr.rng``). With ``filled`` (a :class:`genie.remote.protocol.Filled` whose tape this
    is), the instructions' part is kept there and patched when only numbers changed.

    The inputs are keyed natively in one pass (``genie._C._input_key``, csrc/session.cpp: every
    request of a replayed structure keys all of them): per input its slot, rank, dtype, conj and
    neg bits, whether it is dense (its storage holds exactly its elements from offset 0,
    contiguous, first of its storage) and which earlier input's storage it shares; its sizes are
    integers, and unless dense its strides, offset and storage bytes too."""
    static, ints = _C._input_key(tape.inputs)
    got = _instr_params(tape, filled)
    if got is None:
        return None
    baked, cbaked, istatic, iints = got
    return ClassKey((key, cbaked, static, istatic), baked), ints + iints


def _instr_params(tape: Tape, filled: Any
                  ) -> tuple[tuple, tuple, tuple, tuple[int, ...]] | None:
    """``(baked, baked as the class keys them, static, integers)`` of a tape's instructions."""
    if filled is not None and filled.params is not None:
        baked, cbaked, istatic, iints, pos = filled.params
        fresh = list(iints)
        flips: list[tuple[int, bool]] = []
        instrs = tape.instrs  # (a property: read once, not per patched leaf)
        for i, j in filled.patched:
            x = instrs[i].leaves[j]
            p = pos.get((i, j))
            t = type(x)
            if p is not None and p >= 0 and t is int:
                fresh[p] = x
            elif p is not None and p < 0 and t is bool:  # a value argument's bool: baked, the
                flips.append((-1 - p, x))  # class keys its type (HF's is_done, last step)
            elif t is not float or policy(instrs[i].op).float_values_matter:
                break  # a baked constant or a float that decides sizes: key it anew
        else:
            if flips:
                bl = list(baked)
                for k, x in flips:
                    bl[k] = (bool, x)
                baked = _Part(bl)
            out = tuple(fresh)
            filled.params = (baked, cbaked, istatic, out, pos)
            filled.patched.clear()
            return baked, cbaked, istatic, out
    baked_l: list[Any] = []
    cbaked_l: list[Any] = []
    static: list[Any] = []
    ints: list[int] = []
    where: dict[tuple[int, int], int] = {}
    for i, ins in enumerate(tape.instrs):
        floats = policy(ins.op).float_values_matter if ins.op != UPLOAD else True
        values = _value_leaves(ins) if ins.op != UPLOAD else _NONE
        for j, x in enumerate(ins.leaves):
            t = type(x)
            if t is Slot:
                continue
            if t is int:
                where[(i, j)] = len(ints)
                ints.append(x)
                static.append(int)
            elif t is float:
                static.append(x if floats else float)
            elif t is MetaArg:
                m = x.meta
                static.append((m.shape, m.stride, m.dtype))
            elif isinstance(x, torch.Tensor):
                static.append((tuple(x.shape), x.stride(), x.dtype))
            elif x is None or t in _BAKED:
                if t is bool and j in values:  # (-1 - its place in baked: patched in place)
                    where[(i, j)] = -1 - len(baked_l)
                    cbaked_l.append((t, t))
                else:
                    cbaked_l.append((t, x))
                baked_l.append((t, x))
            else:
                return None
        static.append(len(ins.leaves))
    baked = _Part(baked_l)
    cbaked = _Part(cbaked_l)
    out = (baked, baked if cbaked == baked else cbaked, _Part(static), tuple(ints))
    if filled is not None:
        filled.params = (*out, where)
        filled.patched.clear()
    return out


@dataclass(slots=True)
class ShapeClass:
    """A structure's calls that one symbolic vet covers: fixed integers, guards, a bound."""

    n: int                                  # integers per call
    sym_idx: tuple[int, ...]                # positions that are symbols
    fixed: Callable[[tuple], tuple]         # the fixed positions of a call
    fixed_vals: tuple                       # ... and their values
    syms: Callable[[tuple], tuple]          # the symbols' values of a call
    same_a: Callable[[tuple], tuple]        # positions that share a symbol ...
    same_b: Callable[[tuple], tuple]        # ... equal to these (the symbol's first position)
    guard: Callable[[dict[str, int]], bool]
    bound: Callable[..., int]
    n_guards: int
    signs: tuple[int, ...] | None = None  # -1: the symbol is the negation of its integers
    hits: int = 0
    #: the same admission held natively (``genie._C._ShapeAdmit``, csrc/worker_replay.cpp: a
    #: worker's steady requests admitted without Python), or None when an expression uses what
    #: its evaluator does not (:func:`native_expr`)
    native: Any = None

    def admit(self, ints: tuple[int, ...]) -> int | None:
        """The working-set bound of a call in this class, or None when it is not in it."""
        if len(ints) != self.n or self.fixed(ints) != self.fixed_vals or \
                self.same_a(ints) != self.same_b(ints):
            return None
        vals = self.syms(ints)
        if self.signs is not None:
            vals = tuple(v * s for v, s in zip(vals, self.signs, strict=True))
        try:  # a guard over a client's integers may divide by one of them: not admitted
            if not self.guard({f"t{k}": v for k, v in enumerate(vals)}):
                return None
            bound = int(self.bound(*vals))
        except (ArithmeticError, ValueError, TypeError, OverflowError):
            return None
        self.hits += 1
        return bound

    def why_not(self, ints: tuple[int, ...]) -> str:
        """Why :meth:`admit` refuses ``ints`` (for the log)."""
        if len(ints) != self.n:
            return f"{len(ints)} integers, the class has {self.n}"
        fixed = self.fixed(ints)
        if fixed != self.fixed_vals:
            pos = [i for i in range(self.n) if i not in set(self.sym_idx)]
            return "fixed integers moved: " + ", ".join(
                f"#{p} {a} -> {b}" for p, a, b in zip(pos, self.fixed_vals, fixed, strict=True)
                if a != b)[:300]
        if self.same_a(ints) != self.same_b(ints):
            return "integers that moved together no longer equal"
        return "its guards or its bound"


class NotAClass(Exception):
    """The structure cannot be vetted symbolically (the concrete vet stays its only check)."""


def moved(a: tuple[int, ...], b: tuple[int, ...]) -> list[int] | None:
    """Positions where two calls' integers differ, or None when they cannot be one class's
    symbols (too many, or a pair not both >= :data:`MIN_SYMBOL` nor both <= its negation)."""
    if len(a) != len(b):
        return None
    out = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if not out or len(out) > MAX_SYMBOLS or any(
            not (min(a[i], b[i]) >= MIN_SYMBOL or max(a[i], b[i]) <= -MIN_SYMBOL) for i in out):
        return None  # (a negative integer that moves, ``x[-n:]``, is the negation of a symbol)
    return out


def build(tape: Tape, ints: tuple[int, ...], sym_idx: list[int],
          prev: tuple[int, ...] | None = None, memo: bool = True) -> ShapeClass:
    """Vet ``tape`` symbolically with the integers at ``sym_idx`` as symbols (their values in
    ``ints`` as hints). Positions whose values were equal in ``prev`` and are equal now share a
    symbol (the class then requires them equal). :class:`NotAClass` when it cannot (whatever
    went wrong: a class is an optimization, never a reason for a request to fail); the class
    admits ``ints``."""
    return from_spec(build_spec(tape, ints, sym_idx, prev, memo), ints)


def build_spec(tape: Tape, ints: tuple[int, ...], sym_idx: list[int],
               prev: tuple[int, ...] | None = None, memo: bool = True) -> dict[str, Any]:
    """What :func:`build` vets, as plain data (integers, lists, two expressions as text): what a
    worker's background build (a forked child, :mod:`genie.remote.worker`) sends back to be
    compiled by :func:`from_spec`."""
    try:
        return _build(tape, ints, sym_idx, prev, memo)
    except NotAClass:
        raise
    except Exception as e:  # noqa: BLE001 - see build()
        raise NotAClass(f"{type(e).__name__}: {e}") from e
    finally:
        FakeTensorMode.cache_clear()  # its entries hold this class's symbols


def _build(tape: Tape, ints: tuple[int, ...], sym_idx: list[int],
           prev: tuple[int, ...] | None, memo: bool) -> dict[str, Any]:
    groups: dict[tuple[int, int], list[int]] = {}
    for p in sym_idx:
        groups.setdefault((prev[p] if prev is not None else p, ints[p]), []).append(p)
    env = ShapeEnv(duck_shape=False, should_record_events=False)  # (no replay of its events)
    vals: list[Any] = list(ints)
    placeholders = []
    reps: list[int] = []
    same_a: list[int] = []
    same_b: list[int] = []
    signs: list[int] = []
    for k, ps in enumerate(groups.values()):
        p = ps[0]
        sign = -1 if ints[p] < 0 else 1
        s = env.create_symbol(sign * ints[p], LocalSource(f"t{k}"),
                              dynamic_dim=DimDynamic.DYNAMIC)
        node = env.create_symintnode(s, hint=sign * ints[p])
        signs.append(sign)
        for q in ps:
            vals[q] = node if sign > 0 else -node
            if q != p:
                same_a.append(q)
                same_b.append(p)
        placeholders.append(node)
        reps.append(p)
    if not all(isinstance(x, torch.SymInt) for x in placeholders):
        raise NotAClass("an integer was specialized when made a symbol")
    # each instruction runs once: FakeTensorMode's cache of results costs more than it saves
    with _disable_current_modes(), torch.no_grad(), \
            torch._dynamo.config.patch(fake_tensor_cache_enabled=False), \
            FakeTensorMode(shape_env=env):
        bound = _run(tape, iter(vals), memo)
    code = env.produce_guards_expression(placeholders) or "True"
    symbols = [x.node._expr for x in placeholders]
    expr = env.replace(bound) if isinstance(bound, sympy.Expr) else bound
    free = getattr(expr, "free_symbols", set())
    if any(f not in symbols for f in free):
        raise NotAClass("the working set depends on a value that is not an argument")
    return {"n": len(ints), "sym_idx": list(sym_idx), "reps": reps, "same_a": same_a,
            "same_b": same_b, "signs": signs, "guard": code,
            "names": [str(s) for s in symbols],
            "bound": PythonPrinter().doprint(expr) if free else str(int(expr))}


def from_spec(spec: Any, ints: tuple[int, ...]) -> ShapeClass:
    """The class :func:`build_spec` described, compiled; it must admit ``ints`` (the call it was
    built from). A spec is checked before anything of it runs: its integers are positions
    within a call, its two expressions use only arithmetic, comparisons and the pure functions
    of PyTorch's guard printers over the class's own symbols (:func:`check_expr`), so a spec
    that did not come from :func:`build_spec` is refused (:class:`NotAClass`), never run."""
    try:
        n = spec["n"]
        sym_idx, reps, same_a, same_b, signs = (tuple(spec[k]) for k in (
            "sym_idx", "reps", "same_a", "same_b", "signs"))
        code, names, body = spec["guard"], list(spec["names"]), spec["bound"]
    except (KeyError, TypeError, ValueError) as e:
        raise NotAClass(f"a malformed class ({type(e).__name__}: {e})") from None
    if n != len(ints) or not all(type(i) is int and 0 <= i < n for i in (
            *sym_idx, *reps, *same_a, *same_b)) or len(set(sym_idx)) != len(sym_idx) or \
            not set(reps) | set(same_a) | set(same_b) <= set(sym_idx) or \
            len(same_a) != len(same_b) or len(signs) != len(reps) or \
            any(s not in (1, -1) for s in signs) or len(names) != len(reps) or \
            len(set(names)) != len(names) or \
            not all(type(x) is str and _SYMBOL.fullmatch(x) for x in names) or \
            not isinstance(code, str) or not isinstance(body, str):
        raise NotAClass("a malformed class")
    check_expr(code, {"L"}, guard=True)
    check_expr(body, set(names))
    guard = eval(compile(f"lambda L: {code}", "<genie shape class guard>", "eval"),
                 dict(SYMPY_INTERP))
    bound_fn = eval(compile(f"lambda {', '.join(names)}: {body}", "<genie shape class bound>",
                            "eval"), dict(SYMPY_INTERP))
    sym_set = set(sym_idx)
    fixed = tuple_getter(tuple(i for i in range(n) if i not in sym_set))
    cls = ShapeClass(n, sym_idx, fixed, fixed(ints), tuple_getter(reps), tuple_getter(same_a),
                     tuple_getter(same_b), guard, bound_fn, code.count(" and ") + 1,
                     signs if -1 in signs else None)
    if cls.admit(ints) is None:
        raise NotAClass("the class does not admit the call it was built from")
    g, b = native_expr(code, {}), native_expr(body, {x: k for k, x in enumerate(names)})
    if g is not None and b is not None:
        cls.native = _C._ShapeAdmit(n, [i for i in range(n) if i not in sym_set],
                                    list(cls.fixed_vals), list(same_a), list(same_b),
                                    list(reps), list(signs), g, b)
        if cls.native.admit(list(ints)) != cls.admit(ints):  # (never: the same expressions)
            cls.native = None
    cls.hits = 0
    return cls


# node codes of csrc/worker_replay.cpp (enum Op, enum Cmp)
_N_CONST, _N_VAR, _N_NEG, _N_NOT, _N_AND, _N_OR, _N_CMP, _N_IF, _N_ABS, _N_BOOL = \
    0, 1, 8, 9, 10, 11, 12, 13, 14, 17
_N_BIN = {ast.Add: 2, ast.Sub: 3, ast.Mult: 4, ast.FloorDiv: 5, ast.Mod: 6, ast.Pow: 7}
_N_CALL = {"abs": 14, "min": 15, "max": 16, "int": -1, "bool": 17, "sym_min": 15,
           "sym_max": 16}
_N_CMPS = {ast.Eq: 0, ast.NotEq: 1, ast.Lt: 2, ast.LtE: 3, ast.Gt: 4, ast.GtE: 5}


class _NotNative(Exception):
    pass


def native_expr(text: str, names: dict[str, int]) -> list[tuple] | None:
    """A class expression (checked by :func:`check_expr`) as ``genie._C._ShapeAdmit``'s node
    list: ``(op, value, children, comparisons)``, children before their parent, the root last;
    variables are the class's symbols by index (``L['tK']`` in a guard: ``K``; a name of
    ``names`` in a bound). None when it uses anything but integer constants, ``+ - * // % **``,
    comparisons, ``and or not``, ``x if c else y`` and ``abs min max int bool``
    (``torch.sym_min``/``sym_max``): the class is then admitted in Python only."""
    nodes: list[tuple] = []

    def add(op: int, v: int = 0, kids: tuple = (), cmps: tuple = ()) -> int:
        nodes.append((op, v, list(kids), list(cmps)))
        return len(nodes) - 1

    def walk(n: ast.AST) -> int:
        if isinstance(n, ast.Constant) and type(n.value) in (int, bool):
            v = int(n.value)
            if not -(1 << 63) <= v < (1 << 63):
                raise _NotNative
            return add(_N_CONST, v)
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and \
                n.value.id == "L" and isinstance(n.slice, ast.Constant) and \
                type(n.slice.value) is str and re.fullmatch(r"t[0-9]{1,6}", n.slice.value) \
                and not names:
            return add(_N_VAR, int(n.slice.value[1:]))
        if isinstance(n, ast.Name) and n.id in names:
            return add(_N_VAR, names[n.id])
        if isinstance(n, ast.BinOp) and type(n.op) in _N_BIN:
            a, b = walk(n.left), walk(n.right)
            return add(_N_BIN[type(n.op)], 0, (a, b))
        if isinstance(n, ast.UnaryOp):
            a = walk(n.operand)
            if isinstance(n.op, ast.UAdd):
                return a
            if isinstance(n.op, ast.USub):
                return add(_N_NEG, 0, (a,))
            if isinstance(n.op, ast.Not):
                return add(_N_NOT, 0, (a,))
        if isinstance(n, ast.BoolOp):
            kids = tuple(walk(x) for x in n.values)
            return add(_N_AND if isinstance(n.op, ast.And) else _N_OR, 0, kids)
        if isinstance(n, ast.Compare) and all(type(o) in _N_CMPS for o in n.ops):
            kids = (walk(n.left), *(walk(x) for x in n.comparators))
            return add(_N_CMP, 0, kids, tuple(_N_CMPS[type(o)] for o in n.ops))
        if isinstance(n, ast.IfExp):
            kids = (walk(n.test), walk(n.body), walk(n.orelse))
            return add(_N_IF, 0, kids)
        if isinstance(n, ast.Call) and not n.keywords:
            f = n.func
            name = f.id if isinstance(f, ast.Name) else \
                f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and \
                f.value.id == "torch" and f.attr in ("sym_min", "sym_max") else None
            op = _N_CALL.get(name) if name is not None else None
            if op is not None:
                kids = tuple(walk(x) for x in n.args)
                if op == -1 and len(kids) == 1:  # int(x) of an integer
                    return kids[0]
                if op in (_N_ABS, _N_BOOL) and len(kids) == 1:
                    return add(op, 0, kids)
                if op in (15, 16) and len(kids) >= 2:
                    return add(op, 0, kids)
        raise _NotNative

    try:
        walk(ast.parse(text, mode="eval").body)
    except (_NotNative, SyntaxError, ValueError, RecursionError):
        return None
    return nodes


#: what a class's expressions may call: PyTorch's guard and size printers emit these
_PURE_BUILTINS = frozenset({"abs", "min", "max", "int", "float", "bool", "round"})
_PURE_GLOBALS = frozenset({"IsNonOverlappingAndDenseIndicator",
                           "cast_symbool_to_symint_guardless"})
_EXPR_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub,
               ast.UAdd, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod,
               ast.Pow, ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
               ast.IfExp, ast.Call, ast.Name, ast.Load, ast.Attribute, ast.Subscript,
               ast.Constant, ast.Tuple)


def check_expr(text: str, names: set[str], guard: bool = False) -> None:
    """:class:`NotAClass` unless ``text`` is an expression of arithmetic, comparisons and
    boolean logic over ``names`` (``L['tK']`` in a guard), calling only pure functions."""
    if len(text) > 1 << 20:
        raise NotAClass("a class expression of more than 1 MiB")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError) as e:
        raise NotAClass(f"a class expression that does not parse ({e})") from None
    keys = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}
    for node in ast.walk(tree):
        if not isinstance(node, _EXPR_NODES):
            raise NotAClass(f"a class expression with {type(node).__name__}")
        if isinstance(node, ast.Constant) and (type(node.value) not in (int, float, bool, str) or
                                               (type(node.value) is str and id(node) not in keys)):
            raise NotAClass("a class expression with a constant of another type")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and not (
                isinstance(node.right, ast.Constant) and type(node.right.value) is int and
                0 <= node.right.value <= 64):
            raise NotAClass("a class expression with a power that is not a small constant")
        if isinstance(node, ast.Subscript):  # L['t3']
            if not (guard and isinstance(node.value, ast.Name) and node.value.id == "L" and
                    isinstance(node.slice, ast.Constant) and type(node.slice.value) is str and
                    _SYMBOL.fullmatch(node.slice.value)):
                raise NotAClass("a class expression that indexes something else")
        elif isinstance(node, ast.Attribute):  # math.floor, torch.sym_max
            if not (isinstance(node.value, ast.Name) and (
                    (node.value.id == "math" and not node.attr.startswith("_")) or
                    (node.value.id == "torch" and node.attr.startswith("sym_")))):
                raise NotAClass(f"a class expression that reads .{node.attr}")
        elif isinstance(node, ast.Name):
            if node.id not in names and node.id not in _PURE_BUILTINS and \
                    node.id not in _PURE_GLOBALS and node.id not in ("math", "torch"):
                raise NotAClass(f"a class expression that names {node.id!r:.40}")
        elif isinstance(node, ast.Call):
            if node.keywords or not isinstance(node.func, (ast.Name, ast.Attribute)) or (
                    isinstance(node.func, ast.Name) and node.func.id in ("math", "torch")):
                raise NotAClass("a class expression with a call of something else")


_SYMBOL = re.compile(r"[a-z]{1,2}[0-9]{1,6}")  # t3 (a guard's source), s3 (its symbol)


class _SV:
    """A tensor value of the symbolic run as metadata (its integers may be symbols). ``t`` is its
    fake tensor once one exists (made by the op that produced it, or built from the metadata
    when a later instruction runs on it in the fake mode); ``key`` is what an effect's key holds
    of it (its storage's bytes included); ``static``: no symbol in it."""

    __slots__ = ("meta", "sid", "key", "t", "static")

    def __init__(self, meta: tuple, sid: int, nbytes: Any, t: Any = None,
                 key: tuple | None = None) -> None:
        self.meta, self.sid, self.t = meta, sid, t
        self.key = key if key is not None else _meta_key(meta, nbytes)
        self.static = _no_symbol(self.key)


def _no_symbol(key: tuple) -> bool:
    shape, stride, offset, _, _, _, nbytes = key
    return type(offset) is int and type(nbytes) is int and \
        all(type(x) is int for x in shape) and all(type(x) is int for x in stride)


def _meta_key(meta: tuple, nbytes: Any) -> tuple:
    shape, stride, offset, dtype, conj, neg = meta
    return (tuple(map(_k, shape)), tuple(map(_k, stride)), _k(offset), dtype, conj, neg,
            _k(nbytes))


def _k(x: Any) -> Any:
    """An integer of the run as a key: itself, or a symbolic one's expression (two equal
    expressions are equal for every value of the symbols)."""
    return x if type(x) is int else x.node._expr


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.is_conj(),
            t.is_neg())


@dataclass(frozen=True, slots=True)
class _SymEffect:
    """What an instruction did in the symbolic run (the same for the same op, argument tree and
    leaves by :func:`_key`): per output ``("leaf", j, meta, key)`` (on leaf ``j``'s storage),
    ``("new", k, meta, key)`` (on fresh storage ``k`` of ``fresh[k]`` bytes) or
    ``("value", v)``."""

    outs: tuple
    fresh: tuple


class _Run:
    """The storages of a symbolic run (by an index of the run) and the fake tensors on them."""

    def __init__(self) -> None:
        self.nbytes: list[Any] = []  # a storage never resizes in a class (_infer)
        self.base: list[Any] = []  # a fake tensor on it, or None until one is needed
        self.dense: dict[int, _SV] = {}  # a dense input's storage: its value
        self.by_cdata: dict[int, int] = {}
        self.keep: list[Any] = []  # every fake tensor made lives: no storage address is reused

    def new(self, nbytes: Any, t: Any = None) -> int:
        self.nbytes.append(nbytes)
        self.base.append(None)
        sid = len(self.base) - 1
        if t is not None:
            self._base(sid, t)
        return sid

    def _base(self, sid: int, t: torch.Tensor) -> None:
        self.base[sid] = t
        self.by_cdata[t.untyped_storage()._cdata] = sid
        self.keep.append(t)

    def storage(self, t: torch.Tensor) -> int:
        """The run's index of a fake tensor's storage (a new one for a storage not seen)."""
        sid = self.by_cdata.get(t.untyped_storage()._cdata)
        return self.new(t.untyped_storage().nbytes(), t) if sid is None else sid

    def value(self, t: torch.Tensor) -> _SV:
        sid = self.storage(t)
        return _SV(_meta(t), sid, self.nbytes[sid], t)

    def tensor(self, v: _SV) -> torch.Tensor:
        """``v``'s fake tensor, made on its storage from its metadata when it has none."""
        if v.t is None:
            base = self.base[v.sid]
            if base is None:
                d = self.dense.get(v.sid)
                if d is not None:  # a dense input: made as the concrete vet makes it
                    d.t = torch.empty(d.meta[0], dtype=d.meta[3], device=META)
                    self._base(v.sid, d.t)
                    if v is d:
                        return d.t
                else:
                    self._base(v.sid, torch.empty(self.nbytes[v.sid], dtype=torch.uint8,
                                                  device=META))
                base = self.base[v.sid]
            m = meta_view(base, v.meta)
            self.keep.append(m)
            v.t = m
        return v.t


def _run(tape: Tape, it: Any, memo: bool = True) -> Any:
    """The symbolic run (under the fake mode): the working-set bound; raises on any check.

    With ``memo`` (the default):

    - an instruction whose op, argument tree and leaves (metadata as symbolic expressions,
      which leaves share a storage, constants) are an earlier instruction's is not run again: it
      has that one's effect (a decode step's identical transformer layers run once). Run again,
      its checks would be the same expressions, already guards, and its branches would follow
      the same hints: nothing would change in the class;
    - an instruction with no symbol in its leaves runs on plain meta tensors, as the concrete
      vet runs it (its checks are the same for every call of the class: no guard to record),
      not through the fake mode (a layer norm: ~0.1 ms, not ~25 ms);
    - a dense input's fake tensor is made when an instruction runs in the fake mode on it.

    tests/unit/test_shape_classes.py checks that a class built either way admits the same calls.
    """
    run = _Run()
    env: dict[int, Any] = {}
    fixed = 0  # the bound: its integer part and its symbolic terms (counted: no arithmetic
    terms: dict[Any, int] = {}  # on symbols per instruction)
    dense: dict[int, int] = {}
    for s, v in tape.inputs.items():
        shape = [next(it) for _ in range(v.dim())]
        st = v.untyped_storage()
        cd = st._cdata
        # (no symbol in it: its fake tensor is made when an instruction runs on it in the fake
        # mode; that adds no guard)
        lazy = memo and not v.is_conj() and not v.is_neg() and all(type(x) is int for x in shape)
        if v.storage_offset() == 0 and st.nbytes() == v.numel() * v.element_size() and \
                v.is_contiguous() and cd not in dense:  # dense: as shape_params keyed it
            if lazy:
                sid = dense[cd] = run.new(st.nbytes())
                sv = run.dense[sid] = _SV((tuple(shape), contiguous_strides(shape), 0, v.dtype,
                                           False, False), sid, st.nbytes())
                env[s] = sv
                continue
            m = torch.empty(shape, dtype=v.dtype, device=META)
            dense[cd] = run.storage(m)
        else:
            stride = [next(it) for _ in range(v.dim())]
            off = next(it)
            nb = next(it)
            sid = dense.get(cd)
            if sid is None:
                sid = dense[cd] = run.new(nb) if lazy and type(nb) is int else \
                    run.new(nb, torch.empty(nb, dtype=torch.uint8, device=META))
            if check_bounds(shape, stride, off, v.element_size(), run.nbytes[sid]) is not None:
                raise NotAClass("an input leaves its storage")
            sv = _SV((tuple(shape), tuple(stride), off, v.dtype, False, False), sid,
                     run.nbytes[sid])
            if lazy and sv.static:
                env[s] = sv
                continue
            m = run.tensor(sv)
        if v.is_conj():
            m = m.conj()
        if v.is_neg():
            m = torch._neg_view(m)
        env[s] = run.value(m)
    effects: dict[Any, _SymEffect] = {}
    for ins in tape.instrs:
        op = ins.op
        if op == UPLOAD:  # the call's host data (transformers' `torch.tensor(0.0, device=...)`
            # in each step's mask): a fresh dense value of the metadata the class's key fixes,
            # as the concrete vet makes and counts it (the host data too, as a host constant)
            x = ins.leaves[0]
            m = torch.empty_like(_leaf(None, x), device=META)
            fixed += m.untyped_storage().nbytes()
            if isinstance(x, torch.Tensor):
                fixed += x.untyped_storage().nbytes()
            env[ins.outs[0]] = run.value(m)
            continue
        pol = policy(op)
        if pol.inplace_view or pol.dynamic and op is not _INDEX:
            raise NotAClass(f"{op} changes metadata in place or depends on data")
        vals: list[Any] = []
        for x in ins.leaves:
            t = type(x)
            if t is Slot:
                vals.append(env[x.id])
            elif t is int:
                vals.append(next(it))
            else:
                if t is MetaArg:
                    fixed += _meta_arg_nbytes(x.meta)
                elif isinstance(x, torch.Tensor):
                    fixed += x.untyped_storage().nbytes()
                vals.append(x)
        if op is _INDEX and any(_dtype(v) in (torch.bool, torch.uint8) for v in vals[1:]):
            raise NotAClass(f"{op} with a mask depends on data")  # (integer indices do not)
        key = _key(op, ins.spec, vals) if memo else None
        eff = effects.get(key) if key is not None else None
        if eff is None:
            outs, eff = _infer(run, ins, vals, memo and _static(vals))
            if key is not None:
                effects[key] = eff
        else:
            outs = _apply(run, eff, vals)
        for nb in eff.fresh:
            if type(nb) is int:
                fixed += nb
            else:
                e = nb.node._expr
                terms[e] = terms.get(e, 0) + 1
        for s, o in zip(ins.outs, outs, strict=False):  # (outputs the tape does not name)
            if s is not None:
                env[s] = o
    if not terms:
        return fixed
    return sympy.Add(sympy.Integer(fixed), *(c * e for e, c in terms.items()))



_INDEX = torch.ops.aten.index.Tensor  # data-dependent only when an index is a mask
_MATMUL = torch.ops.aten.matmul.default


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``aten.matmul``'s output in the fake mode, from its inputs' symbolic sizes: a fresh
    contiguous tensor of the broadcast batch and the two outer sizes, with eager's checks as
    guards. torch 2.11's composite matmul reads plain sizes (``size()``), which specializes
    every symbol it touches: a GPT-2 step's class built there admitted only the call it was
    built from."""
    da, db = a.dim(), b.dim()
    torch._check(da > 0 and db > 0, lambda: "both arguments to matmul need to be at least 1D")
    torch._check(a.dtype == b.dtype, lambda: "expected both matmul operands to have the same "
                 f"dtype, but got {a.dtype} and {b.dtype}")
    ka, kb = a.shape[-1], b.shape[-2] if db > 1 else b.shape[0]
    torch._check(ka == kb, lambda: f"matmul: size mismatch, {tuple(a.shape)} @ {tuple(b.shape)}")
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])) if da > 2 or db > 2 \
        else ()
    shape = (*batch, *((a.shape[-2],) if da > 1 else ()), *((b.shape[-1],) if db > 1 else ()))
    return torch.empty(shape, dtype=a.dtype, device=a.device)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``aten.linear``'s output in the fake mode (torch 2.11's runs its composite matmul, which
    cannot take symbolic sizes there): ``x @ w.T`` plus a bias that broadcasts to it."""
    torch._check(w.dim() == 2, lambda: f"linear: a 2-D weight, got {w.dim()}-D")
    out = _matmul(x, w.t())
    if b is not None:
        torch._check(b.dtype == x.dtype, lambda: f"linear: bias of {b.dtype}, input {x.dtype}")
        torch._check(tuple(torch.broadcast_shapes(b.shape, out.shape)) == tuple(out.shape),
                     lambda: f"linear: a bias of {tuple(b.shape)} for {tuple(out.shape)}")
    return out


#: ops whose fake run Genie computes itself in the symbolic run (``_outputs``)
_OWN = {_MATMUL: _matmul, torch.ops.aten.linear.default: _linear}


def _dtype(v: Any) -> torch.dtype | None:
    """The dtype of a symbolic run's tensor value (None for other leaves)."""
    if type(v) is _SV:
        return v.meta[3]
    return v.dtype if isinstance(v, torch.Tensor) else None


def _static(vals: list[Any]) -> bool:
    """No symbol in an instruction's leaves (its values' metadata, its integers)."""
    for v in vals:
        t = type(v)
        if (t is _SV and not v.static) or t is torch.SymInt or t is torch.SymFloat or \
                t is torch.SymBool:
            return False
    return True


def _key(op: Any, spec: Any, vals: list[Any]) -> tuple | None:
    """What decides an instruction's effect in the symbolic run (None: a constant not keyed)."""
    parts: list[Any] = [op, spec]
    first: dict[int, int] = {}
    try:
        for j, v in enumerate(vals):
            t = type(v)
            if t is _SV:
                parts.append((v.key, first.setdefault(v.sid, j)))
            elif t is int:
                parts.append((int, v))
            elif t is torch.SymInt:
                parts.append((torch.SymInt, v.node._expr))
            elif t is MetaArg:
                parts.append((MetaArg, v.meta.shape, v.meta.stride, v.meta.dtype))
            elif isinstance(v, torch.Tensor):
                parts.append((torch.Tensor, tuple(v.shape), v.stride(), v.dtype))
            elif t is torch.device:
                parts.append(torch.device)
            else:
                parts.append(_const_key(v, True))
    except _NoKey:
        return None
    return tuple(parts)


def _leaf(run: _Run | None, v: Any, bases: dict[int, torch.Tensor] | None = None) -> Any:
    """An instruction's argument in the fake mode (``run``), or as a plain meta tensor with the
    storages of ``bases`` (:func:`_static`)."""
    t = type(v)
    if t is _SV:
        if run is not None:
            return run.tensor(v)
        base = bases.get(v.sid)  # type: ignore[union-attr]
        if base is None:
            base = bases[v.sid] = torch.empty(v.key[6], dtype=torch.uint8,  # type: ignore
                                              device=META)
        return meta_view(base, v.meta)
    if t is torch.device:
        return META
    if t is MetaArg:
        return torch.empty_strided(v.meta.shape, v.meta.stride, dtype=v.meta.dtype, device=META)
    if isinstance(v, torch.Tensor):  # a host constant
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=META)
    return v


def _infer(run: _Run, ins: Instr, vals: list[Any], static: bool
           ) -> tuple[list[Any], _SymEffect]:
    """Run one instruction, in the fake mode or (``static``) on plain meta tensors: its
    outputs and its effect."""
    if static:
        with _disable_current_modes():
            bases: dict[int, torch.Tensor] = {}
            leaves = [_leaf(None, v, bases) for v in vals]
            return _outputs(run, ins, vals, leaves, False)
    leaves = [_leaf(run, v) for v in vals]
    return _outputs(run, ins, vals, leaves, True)


def _outputs(run: _Run, ins: Instr, vals: list[Any], leaves: list[Any], fake: bool
             ) -> tuple[list[Any], _SymEffect]:
    op = ins.op
    sizes = {_sid(v): v.untyped_storage().nbytes() for v in leaves
             if isinstance(v, torch.Tensor)}
    before = [_meta_key(_meta(x), x.untyped_storage().nbytes()) if type(v) is _SV else None
              for v, x in zip(vals, leaves, strict=True)]
    args, kwargs = optree.tree_unflatten(ins.spec, leaves)
    if _has_device_arg(op):
        args, kwargs = _with_meta_device(op, args, kwargs)
    own = _OWN.get(op) if fake and not kwargs else None
    out = own(*args) if own is not None else op(*args, **kwargs)
    for sid, n in sizes.items():  # resize_, out= growth: not a class (the ledger tracks it)
        if not _same(n, _storage_bytes(leaves, sid)):
            raise NotAClass(f"{op} resizes a storage")
    where: dict[int, int] = {}
    for j, (b, leaf) in enumerate(zip(before, leaves, strict=True)):
        if isinstance(leaf, torch.Tensor):
            where.setdefault(_sid(leaf), j)
            if b is not None and b != _meta_key(_meta(leaf), leaf.untyped_storage().nbytes()):
                raise NotAClass(f"{op} changes an argument's metadata")  # (out= reshaped)
    outs: list[Any] = []
    specs: list[Any] = []
    fresh: list[Any] = []
    new: dict[int, int] = {}
    flat = optree.tree_leaves(out, none_is_leaf=True)
    if fake and free_unbacked_symbols([o for o in flat
                                       if isinstance(o, (torch.Tensor, torch.SymInt))]):
        raise NotAClass(f"{op} makes a size that depends on data")  # (not one to reuse)
    for o in flat:
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if check_bounds(o.shape, o.stride(), o.storage_offset(), o.element_size(),
                            st.nbytes()) is not None:
                raise NotAClass(f"{op} makes a view past its storage")
            cd = st._cdata
            j = where.get(cd)
            if j is None:
                k = new.get(cd)
                if k is None:
                    k = new[cd] = len(fresh)
                    fresh.append(st.nbytes())
                spec: tuple = ("new", k)
                sid = run.storage(o) if fake else -1 - k
            else:
                spec = ("leaf", j)
                v = vals[j]  # (a host constant's or a metadata argument's: its own storage)
                sid = v.sid if type(v) is _SV else run.new(leaves[j].untyped_storage().nbytes())
            specs.append((*spec, _meta(o), _meta_key(_meta(o), st.nbytes())))
            outs.append((sid, o))
        elif isinstance(o, (torch.SymFloat, torch.SymBool)):
            raise NotAClass(f"{op} returns a symbolic scalar")
        else:
            specs.append(("value", o))
            outs.append(o)
    if _short(len(outs), ins.outs):
        raise NotAClass(f"{op} returns {len(outs)} values; the tape names {len(ins.outs)}")
    if not fake:  # plain meta: fresh storages are the run's, their fake tensors made when needed
        sids = [run.new(nb) for nb in fresh]
    vs: list[Any] = []
    for spec, o in zip(specs, outs, strict=True):
        if spec[0] == "value":
            vs.append(o)
        else:
            sid, t = o
            if sid < 0:
                sid = sids[-1 - sid]
            vs.append(_SV(spec[2], sid, None, t if fake else None, spec[3]))
    return vs, _SymEffect(tuple(specs), tuple(fresh))


def _apply(run: _Run, eff: _SymEffect, vals: list[Any]) -> list[Any]:
    """The outputs of an instruction with a known effect (nothing runs)."""
    sids = [run.new(nb) for nb in eff.fresh]
    outs: list[Any] = []
    for spec in eff.outs:
        kind = spec[0]
        if kind == "value":
            outs.append(spec[1])
            continue
        if kind == "new":
            sid = sids[spec[1]]
        else:
            v = vals[spec[1]]
            sid = v.sid if type(v) is _SV else run.new(spec[3][6])
        outs.append(_SV(spec[2], sid, None, None, spec[3]))
    return outs


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _same(a: Any, b: Any) -> bool:
    """Two byte counts are the same expression (no guard is recorded to decide it)."""
    if type(a) is int and type(b) is int:
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return bool(a.node._expr == b.node._expr)
    return False


def _storage_bytes(leaves: list[Any], sid: int) -> Any:
    for v in leaves:
        if isinstance(v, torch.Tensor) and _sid(v) == sid:
            return v.untyped_storage().nbytes()
    return None


def warm() -> None:
    """Build the class of a small attention block's tape (:func:`_warm_tape`): what a worker's
    class builds would otherwise each do first happens here, once, in the zygote, and every
    build's child inherits it (imports, sympy's caches, the guard printer, the symbolic paths of
    the common meta kernels). In a build's child, after a one-instruction warm-up and after this
    one (CPU, 2 runs each, load ~4): a GPT-2 4x128 generate's decode step 0.14-0.22 -> 0.11-0.13
    s, its prefill 0.27-0.38 -> 0.22-0.24 s; a 12x768 decode step 0.09-0.12 -> 0.09-0.10 s. The
    zygote pays ~0.3 s once."""
    tapes = [_warm_tape(t) for t in (5, 6)]
    (_, a), (_, b) = (shape_params(b"", t) for t in tapes)  # type: ignore[misc]
    build(tapes[1], b, moved(a, b) or [], a)


def _warm_tape(t: int) -> Tape:
    """An attention block of ``t`` tokens on meta tensors, as a transformer's tapes record it:
    embedding, layer norm, projections, heads, a KV cache, softmax, positions."""
    aten = torch.ops.aten
    c, h, d = 8, 2, 4
    instrs: list[Instr] = []

    def add(op: Any, args: tuple, outs: tuple[int, ...], **kwargs: Any) -> None:
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        instrs.append(Instr(op, leaves, spec, outs, None))

    S = Slot
    add(aten.embedding.default, (S(1), S(0)), (10,))
    add(aten.native_layer_norm.default, (S(10), [c], S(4), S(5), 1e-5), (11, 12, 13))
    add(aten.view.default, (S(11), [t, c]), (14,))
    add(aten.addmm.default, (S(3), S(14), S(2)), (15,))
    add(aten.view.default, (S(15), [1, t, 3 * c]), (16,))
    add(aten.split.Tensor, (S(16), c, 2), (17, 18, 19))
    for x, y in ((17, 20), (18, 22)):
        add(aten.view.default, (S(x), [1, t, h, d]), (y,))
        add(aten.transpose.int, (S(y), 1, 2), (y + 1,))
    add(aten.cat.default, ([S(6), S(23)], 2), (24,))
    add(aten.transpose.int, (S(24), -1, -2), (25,))
    add(aten.matmul.default, (S(21), S(25)), (26,))
    add(aten.pow.Tensor_Scalar, (S(26), 2.0), (27,))
    add(aten._softmax.default, (S(27), -1, False), (28,))
    add(aten.matmul.default, (S(28), S(24)), (29,))
    add(aten.transpose.int, (S(29), 1, 2), (30,))
    add(aten.clone.default, (S(30),), (31,), memory_format=torch.contiguous_format)
    add(aten.view.default, (S(31), [1, t, c]), (32,))
    add(aten.add.Tensor, (S(32), S(10)), (33,))
    add(aten.tanh.default, (S(33),), (34,))
    add(aten.mul.Tensor, (S(34), S(33)), (35,))
    add(aten.slice.Tensor, (S(35), 1, -1, 2 ** 63 - 1), (36,))
    add(aten.cumsum.default, (S(0), 1), (37,))
    add(aten.arange.default, (t,), (38,), dtype=torch.int64, device=torch.device("cpu"),
        pin_memory=False)
    add(aten.unsqueeze.default, (S(38), 0), (39,))
    add(aten.eq.Tensor, (S(37), S(39)), (40,))
    add(aten.where.self, (S(40), S(37), S(39)), (41,))
    inputs = {0: torch.empty(1, t, dtype=torch.int64, device=META),
              1: torch.empty(16, c, device=META), 2: torch.empty(c, 3 * c, device=META),
              3: torch.empty(3 * c, device=META), 4: torch.empty(c, device=META),
              5: torch.empty(c, device=META), 6: torch.empty(1, h, t, d, device=META)}
    return Tape(instrs, inputs, [36, 41], {36, 41}, [], {})
