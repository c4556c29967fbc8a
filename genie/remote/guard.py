"""Run a client's tape under the server's rules: vetted on meta tensors first, then run.

A server never runs a received tape as it comes. :func:`run_guarded`:

1. **Vets** it (:func:`vet`): every instruction runs first on ``meta`` tensors that carry the real
   inputs' shapes, strides, offsets, dtypes and storage sizes (aliasing included: two inputs that
   share a storage share a meta storage). Meta kernels check shapes and dtypes; the vet checks
   storage bounds itself (a view whose elements reach past its storage is refused: some views'
   meta kernels, ``as_strided``, do not check) and refuses negative strides. It also knows the
   exact bytes every instruction allocates (factories whatever their size argument, ``new_*``,
   ``empty_strided`` from its strides, ``arange``, ``resize_`` growth, metadata-only arguments,
   host constants), follows the tape's frees, and so computes the tape's **peak working set**;
   a tape whose peak passes the session's free quota is refused (:class:`QuotaError`) before any
   real memory is touched.
2. **Runs** it op by op on the device (the eager interpreter's semantics: seeded random ops,
   in-place views applied to a fresh alias), checking a **deadline** between instructions
   (:class:`RunTimeout`; one huge kernel cannot be interrupted, the next instruction is).
   Memory handed to the tape is never another session's data: the outputs of the ``empty``
   family (:data:`ZEROED`), metadata-only arguments and the growth of ``resize_`` are zeroed.

3. With an :class:`~genie.index_check.IndexCheck` (the server's ``--index-check``, on for
   CUDA), checks the **index arguments** of indexing ops on the device before their kernels run
   (on CUDA an out-of-range index is a device-side assert that would break the device for every
   session): an out-of-range one is an :class:`ExecutionError` with eager's exception.

Ops whose output size depends on data (``nonzero``, ``unique``, ``masked_select``, ``item``:
tagged ``dynamic_output_shape``/``data_dependent_output``, or without a meta kernel) end a vetted
stretch: the tape runs up to and including such an op, its result is accounted at once (refused
if over quota), and the rest of the tape is vetted from the real values before it runs.

Not covered (documented in docs/deployment.md): a kernel's own temporary buffers (a matmul's
workspace) are not counted; a single long kernel runs to its end.

Example:
    >>> import torch
    >>> from genie.planner import Instr, Slot, Tape
    >>> from genie.remote.guard import QuotaError, run_guarded
    >>> import optree
    >>> args = (([4096],), {})
    >>> spec = optree.tree_structure(args, none_is_leaf=True)
    >>> ins = Instr(torch.ops.aten.zeros.default, optree.tree_leaves(args, none_is_leaf=True),
    ...             spec, (0,), None)
    >>> tape = Tape([ins], {}, [0], {0}, [], {})
    >>> run_guarded(tape, torch.device("cpu"), budget=1 << 20)[0].shape
    torch.Size([4096])
    >>> try:
    ...     run_guarded(tape, torch.device("cpu"), budget=1000)
    ... except QuotaError as e:
    ...     print(e.need)
    16384
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..backends.eager import arg as eager_arg
from ..backends.rng import generator_for, seed_from
from ..errors import ExecutionError
from ..index_check import IndexCheck, IndexOutOfRange
from ..meta import policy
from ..planner import MetaArg, Slot, Tape
from . import vet_rules
from .protocol import check_bounds

UPLOAD = "genie.upload"
META = torch.device("meta")

#: Ops (base names, any overload) whose fresh outputs are uninitialized memory: zeroed whole.
ZEROED = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                    "empty_permuted"})
#: Ops that grow their first argument's storage in place: the growth is zeroed.
RESIZING = frozenset({"resize_", "resize_as_"})


class QuotaError(Exception):
    """The tape's working set would pass the session's quota (nothing ran past ``index``)."""

    def __init__(self, index: int, op: Any, need: int, budget: int) -> None:
        self.index, self.op, self.need, self.budget = index, op, need, budget
        self.ran = True  # False when refused before any instruction ran (the request undone)
        super().__init__(
            f"the tape needs {need} bytes at instruction {index} ({op}), counting its "
            f"intermediates; the session has {max(budget, 0)} bytes of quota left. Free "
            "tensors (del), split the work, or ask for a larger --quota")


class RunTimeout(Exception):
    """The tape ran past the server's ``--max-run-seconds``."""

    def __init__(self, index: int, n: int, limit: float) -> None:
        self.index = index
        super().__init__(
            f"the tape ran longer than the server's limit of {limit:g} s (--max-run-seconds) "
            f"and was stopped before instruction {index} of {n}; its results are discarded. "
            "Materialize smaller pieces (genie.materialize more often) or ask for a larger limit")


@dataclass(frozen=True, slots=True)
class Vetted:
    """What :func:`vet` found: instructions ``[start, upto)`` are checked; ``peak`` bytes."""

    upto: int
    peak: int


class TV:
    """A tensor value as the vet sees it: its metadata as one tuple (what an effect's key holds:
    shape, stride, offset, dtype, conj, neg) and the id of its storage."""

    __slots__ = ("meta", "sid")

    def __init__(self, meta: tuple, sid: int) -> None:
        self.meta, self.sid = meta, sid


@dataclass(frozen=True, slots=True)
class _Out:
    """One output of a vetted instruction: a tensor's metadata and where its storage comes
    from (``src``: the leaf whose storage it shares, or -1 for a fresh one of ``nbytes``), or a
    plain ``value``."""

    meta: tuple | None
    src: int
    nbytes: int
    value: Any = None


@dataclass(frozen=True, slots=True)
class _Effect:
    """What an instruction does to metadata (the same for the same op, argument tree and leaf
    metadata): its outputs, and the leaves whose storage it resized (leaf index, new bytes)."""

    outs: tuple[_Out, ...]
    grows: tuple[tuple[int, int], ...]


_BARRIER = _Effect((), ())  # an op whose output size depends on data
#: per op that is not an OpOverload (the upload): whether its float arguments' values are part
#: of an effect's key (an OpOverload keeps it as ``_genie_floats``)
_floats: dict[Any, bool] = {}
#: effects by (op, tree, leaf keys): the vet of a repeated op is a dict lookup
_effects: dict[Any, _Effect] = {}
MAX_EFFECTS = 8192


class _NoKey(Exception):
    pass


def _const_key(x: Any, floats: bool) -> Any:
    t = type(x)
    if t is float:
        return (float, x) if floats else float
    if x is None or t is bool or t is int or t is str or t is complex or t is torch.dtype or \
            t is torch.layout or t is torch.memory_format:
        return (t, x)
    if t is list or t is tuple or t is torch.Size:
        return (t, tuple(_const_key(v, floats) for v in x))
    raise _NoKey


class _Ledger:
    """Bytes per storage of the tape's values; ``live`` counts what the session does not hold
    yet (fresh storages whole, resident storages by their growth)."""

    def __init__(self) -> None:
        self.st: dict[int, list[int]] = {}  # sid -> [nbytes, slots, base]
        self.live = 0
        self.next_sid = -1  # fresh storages get negative ids (real ones are _cdata)

    def fresh(self, nbytes: int) -> int:
        sid = self.next_sid
        self.next_sid -= 1
        self.st[sid] = [nbytes, 0, 0]
        self.live += nbytes
        return sid

    def hold(self, sid: int) -> None:
        self.st[sid][1] += 1

    def resize(self, sid: int, n: int) -> None:
        e = self.st[sid]
        self.live += max(n - e[2], 0) - max(e[0] - e[2], 0)
        e[0] = n

    def release(self, sid: int) -> None:
        e = self.st[sid]
        e[1] -= 1
        if e[1] == 0:
            self.live -= max(e[0] - e[2], 0)
            del self.st[sid]


def meta_view(base: torch.Tensor, meta: tuple) -> torch.Tensor:
    """A meta tensor viewing ``base``'s storage with ``meta`` = (shape, stride, offset, dtype,
    conj, neg): a vetted value as the meta kernels see it (its storage's extent, its aliasing)."""
    shape, stride, offset, dtype, conj, neg = meta
    m = torch.empty(0, dtype=dtype, device=META)
    m.set_(base.untyped_storage(), offset, shape, stride)
    if conj:
        m = m.conj()
    if neg:
        m = torch._neg_view(m)
    return m


def _tv_of(v: torch.Tensor, ledger: _Ledger, resident: dict[int, int]) -> TV:
    """``v`` as the vet sees it, its storage held in ``ledger`` (``resident``: the counted bytes
    of the storages the session holds, by ``_cdata``)."""
    st = v.untyped_storage()
    sid = st._cdata
    e = ledger.st.get(sid)
    if e is None:
        n = st.nbytes()
        base = resident.get(sid, 0)
        ledger.st[sid] = [n, 1, base]
        ledger.live += max(n - base, 0)
    else:
        e[1] += 1
    return TV((tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.is_conj(),
               v.is_neg()), sid)


def _with_meta_device(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Factories without a device argument default to the CPU: on the vet they must not."""
    for i, a in enumerate(op._schema.arguments):
        if a.name == "device" and "Device" in str(a.real_type):
            if i < len(args):
                if args[i] is None:
                    args = (*args[:i], META, *args[i + 1:])
            elif kwargs.get("device") is None:
                kwargs = {**kwargs, "device": META}
            break
    return args, kwargs


def _host_bytes(tape: Tape) -> int:
    n = 0
    for ins in tape.instrs:
        for x in ins.leaves:
            if isinstance(x, torch.Tensor):
                n += x.untyped_storage().nbytes()
    return n


def _infer(ins: Any, env: dict[int, Any], ledger: _Ledger, i: int) -> _Effect:
    """Run one instruction on meta tensors built from the leaves' metadata: its effect, or
    _BARRIER; ExecutionError when the op refuses them or a view leaves its storage."""
    bases: dict[int, torch.Tensor] = {}
    leaves: list[Any] = []
    sids: list[int | None] = []
    for x in ins.leaves:
        t = type(x)
        sid = None
        if t is Slot:
            v = env[x.id]
            if type(v) is TV:
                sid = v.sid
                base = bases.get(sid)
                if base is None:
                    base = bases[sid] = torch.empty(ledger.st[sid][0], dtype=torch.uint8,
                                                    device=META)
                v = meta_view(base, v.meta)
        elif t is torch.device:
            v = META
        elif t is MetaArg:
            v = torch.empty_strided(x.meta.shape, x.meta.stride, dtype=x.meta.dtype, device=META)
        elif isinstance(x, torch.Tensor):
            v = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=META)
        else:
            v = x
        leaves.append(v)
        sids.append(sid)
    op = ins.op
    if op == UPLOAD:
        out: Any = torch.empty_like(leaves[0], device=META)
    else:
        pol = policy(op)
        if pol.inplace_view:
            leaves[0] = torch.ops.aten.alias.default(leaves[0])
        args, kwargs = optree.tree_unflatten(ins.spec, leaves)
        if _has_device_arg(op):
            args, kwargs = _with_meta_device(op, args, kwargs)
        try:
            out = op(*args, **kwargs)
        except Exception as e:
            if pol.dynamic or isinstance(e, NotImplementedError):
                return _BARRIER  # its size depends on data: run up to here first
            raise ExecutionError(op, ins.where, e, i) from e
    where = {}
    for j, v in enumerate(leaves):
        if isinstance(v, torch.Tensor):
            where.setdefault(v.untyped_storage()._cdata, j)
    outs = []
    for o in optree.tree_leaves(out, none_is_leaf=True):
        if not isinstance(o, torch.Tensor):
            outs.append(_Out(None, -1, 0, o))
            continue
        st = o.untyped_storage()
        bad = check_bounds(o.shape, o.stride(), o.storage_offset(), o.element_size(),
                           st.nbytes())
        if bad is not None:
            raise ExecutionError(op, ins.where, IndexError(
                f"out of bounds: {bad}; the server refuses views past their storage"), i)
        src = where.get(st._cdata, -1)
        if src >= 0 and sids[src] is None:
            src = -1  # a view of a constant: its own storage as far as the session goes
        outs.append(_Out((tuple(o.shape), tuple(o.stride()), o.storage_offset(), o.dtype,
                          o.is_conj(), o.is_neg()), src, st.nbytes()))
    grows = tuple((j, leaves[j].untyped_storage().nbytes()) for j, sid in enumerate(sids)
                  if sid is not None and isinstance(leaves[j], torch.Tensor) and
                  leaves[j].untyped_storage().nbytes() != ledger.st[sid][0])
    return _Effect(tuple(outs), grows)


def vet(tape: Tape, start: int, env: dict[int, Any], budget: int, resident: dict[int, int],
        baseline: int = 0, deadline: float | None = None, limit: float = 0.0) -> Vetted:
    """Check ``tape.instrs[start:]`` on meta tensors, given the real values ``env`` before it.

    ``resident`` maps the storages (``_cdata``) the session already holds to their counted
    bytes; ``baseline`` is memory the request already uses (host constants). Raises
    :class:`QuotaError` when the working set passes ``budget``, :class:`ExecutionError` when an
    op refuses its meta arguments or a view leaves its storage; returns where vetting stopped
    (an op whose output size depends on data) and the peak. The effect of an op on metadata is
    cached, so a repeated tape costs a dict lookup per instruction.
    """
    ledger = _Ledger()
    menv: dict[int, Any] = {}
    for s, v in env.items():
        if isinstance(v, torch.Tensor):
            menv[s] = _tv_of(v, ledger, resident)
        else:
            menv[s] = v
    peak = ledger.live + baseline
    if peak > budget:
        raise QuotaError(start, "the values so far", peak, budget)
    n = len(tape.instrs)
    st = ledger.st
    instrs = tape.instrs
    for i in range(start, n):
        if deadline is not None and time.monotonic() > deadline:
            raise RunTimeout(i, n, limit)
        ins = instrs[i]
        op = ins.op
        floats = _floats.get(op) if type(op) is str else getattr(op, "_genie_floats", None)
        if floats is None:
            floats = _float_values_matter(op)
        transient = 0
        try:
            parts: list[Any] = [op, ins.spec]
            for x in ins.leaves:
                t = type(x)
                if t is Slot:
                    v = menv[x.id]
                    parts.append((v.meta, st[v.sid][0]) if type(v) is TV
                                 else _const_key(v, True))
                elif t is MetaArg:
                    m = x.meta
                    parts.append((MetaArg, m.shape, m.stride, m.dtype))
                    transient += _meta_arg_nbytes(m)
                elif t is int or t is bool or x is None:
                    parts.append((t, x))
                elif t is torch.device:
                    parts.append(torch.device)
                elif isinstance(x, torch.Tensor):
                    parts.append((torch.Tensor, tuple(x.shape), x.stride(), x.dtype))
                else:
                    parts.append(_const_key(x, floats))
            key: Any = tuple(parts)
            eff = _effects.get(key)
        except _NoKey:
            key, eff = None, None
            transient = sum(_meta_arg_nbytes(x.meta) for x in ins.leaves if type(x) is MetaArg)
        if eff is None:
            eff = _ruled(op, ins, menv, st) or _infer(ins, menv, ledger, i)
            if key is not None:
                if len(_effects) >= MAX_EFFECTS:
                    _effects.clear()
                _effects[key] = eff
        if eff is _BARRIER:
            return Vetted(i, peak)
        outs = eff.outs
        if len(ins.outs) > len(outs) and _short(len(outs), ins.outs):
            raise ExecutionError(op, ins.where, ValueError(
                f"the op returns {len(outs)} values; the tape names {len(ins.outs)}"), i)
        for j, nb in eff.grows:
            ledger.resize(menv[ins.leaves[j].id].sid, nb)
        fresh = 0
        for s, o in zip(ins.outs, outs):
            if o.meta is None:
                if s is not None:
                    menv[s] = o.value
                continue
            if o.src >= 0:
                sid = menv[ins.leaves[o.src].id].sid
            else:
                sid = ledger.fresh(o.nbytes)
            if s is None:
                if o.src < 0:
                    fresh += o.nbytes
                    ledger.hold(sid)
                    ledger.release(sid)
                continue
            st[sid][1] += 1  # ledger.hold
            menv[s] = TV(o.meta, sid)
        live = ledger.live + baseline + transient + fresh
        if live > peak:
            peak = live
            if peak > budget:
                raise QuotaError(i, op, peak, budget)
        for s in ins.free:
            v = menv.pop(s)
            if type(v) is TV:
                ledger.release(v.sid)
    return Vetted(n, peak)


def _ruled(op: Any, ins: Any, env: dict[int, Any], st: dict[int, list[int]]
           ) -> _Effect | None:
    """The effect :mod:`genie.remote.vet_rules` computes for ``ins`` without meta tensors (None:
    no rule, or one that declined; a view past its storage is left to meta's refusal)."""
    try:
        outs = vet_rules.effect(op, ins, env, st)
    except Exception:  # a rule's own failure (the fuzzer's to find): meta decides
        return None
    if outs is None:
        return None
    for meta, _, nbytes in outs:
        if check_bounds(meta[0], meta[1], meta[2], meta[3].itemsize, nbytes) is not None:
            return None
    return _Effect(tuple(_Out(m, src, nb) for m, src, nb in outs), ())


def _float_values_matter(op: Any) -> bool:
    """Whether ``op``'s float arguments' values are part of an effect's key, remembered."""
    floats = op == UPLOAD or policy(op).float_values_matter
    try:
        op._genie_floats = floats
    except AttributeError:
        _floats[op] = floats
    return floats


def _meta_arg_nbytes(m: Any) -> int:
    if any(s == 0 for s in m.shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(m.shape, m.stride))) * m.dtype.itemsize


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


def _has_device_arg(op: Any) -> bool:
    try:
        return op._genie_has_device
    except AttributeError:
        has = any(a.name == "device" for a in op._schema.arguments)
        try:
            op._genie_has_device = has
        except AttributeError:
            pass
        return has


def run_guarded(tape: Tape, dev: torch.device, budget: int, deadline: float | None = None,
                limit: float = 0.0, index_check: IndexCheck | None = None,
                info: dict[str, Any] | None = None) -> dict[int, Any]:
    """Vet ``tape`` against ``budget`` free bytes, then run it on ``dev`` before ``deadline``
    (``time.monotonic()``); returns the values of ``tape.keep`` and ``tape.outputs``.

    With ``index_check`` (an :class:`~genie.index_check.IndexCheck` made for this tape), the
    index arguments of indexing ops are checked on the device before their kernels run: an
    out-of-range one is an :class:`ExecutionError` with eager's exception, never a kernel's
    device-side assert.

    ``info``, when given, receives ``peak`` (the vetted working set) and ``whole`` (True when
    one vet covered the whole tape: no op whose output size depends on data), what a caller
    needs to run the same structure and shapes again without vetting it."""
    from torch.utils._python_dispatch import _disable_current_modes

    env, resident, baseline = _start(tape)
    n = len(tape.instrs)
    ix = index_check
    # Below autograd, as the native replay runs (csrc/replay.cpp): the real values never carry
    # autograd history, and its checks would refuse what eager allowed where the client recorded
    # (the global state a tape was recorded under stays on the client: a view's in-place
    # detach_, which torch.tensor(..., device=) makes, is refused outside inference mode)
    with _disable_current_modes(), torch.no_grad(), \
            torch._C._AutoDispatchBelowADInplaceOrView():
        try:
            first = vet(tape, 0, env, budget, resident, baseline, deadline, limit)
        except QuotaError as e:
            e.ran = False
            raise
        checked = first.upto
        if info is not None:
            info["peak"] = first.peak
            info["whole"] = checked >= n
        for i, ins in enumerate(tape.instrs):
            if deadline is not None and time.monotonic() > deadline:
                raise RunTimeout(i, n, limit)
            try:
                if ix is not None:
                    ix.step(i, ins, env)
                outs = _run_instr(ins, env, dev)
                if _short(len(outs), ins.outs):
                    raise ValueError(f"the op returned {len(outs)} values; the tape names "
                                     f"{len(ins.outs)}")
            except IndexOutOfRange as e:
                raise ExecutionError(ins.op, ins.where, e.args[0], i) from e.args[0]
            except Exception as e:
                raise ExecutionError(ins.op, ins.where, e, i) from e
            for s, v in zip(ins.outs, outs):
                if s is not None:
                    env[s] = v
            for s in ins.free:
                del env[s]
            if i == checked:  # an op whose size depends on data ran: account, vet the rest
                checked = vet(tape, i + 1, env, budget, resident, baseline, deadline,
                              limit).upto
    return {s: env[s] for s in (*tape.keep, *tape.outputs)}


def _start(tape: Tape) -> tuple[dict[int, Any], dict[int, int], int]:
    """A run's environment (the tape's inputs), the bytes of the storages it already holds,
    and the bytes of its host constants."""
    env: dict[int, Any] = dict(tape.inputs)
    resident = {}
    for v in env.values():
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            resident[st._cdata] = st.nbytes()
    return env, resident, _host_bytes(tape)


def vet_tape(tape: Tape, budget: int, deadline: float | None = None,
             limit: float = 0.0) -> Vetted:
    """:func:`vet` of a whole tape before it runs (nothing runs): where vetting stopped (``upto``
    < the tape's length at an op whose output size depends on data) and the peak working set.
    :class:`QuotaError` (``ran`` False) past ``budget``."""
    from torch.utils._python_dispatch import _disable_current_modes

    env, resident, baseline = _start(tape)
    with _disable_current_modes(), torch.no_grad():
        try:
            return vet(tape, 0, env, budget, resident, baseline, deadline, limit)
        except QuotaError as e:
            e.ran = False
            raise


def _memory_kind(op: Any) -> int:
    """1: an ``empty``-family op (zero its outputs); 2: a resizing op (zero the growth); 0."""
    try:
        return op._genie_memory_kind
    except AttributeError:
        base = op._schema.name.removeprefix("aten::")
        kind = 1 if base in ZEROED else 2 if base in RESIZING else 0
        op._genie_memory_kind = kind
        return kind


def _short(n: int, outs: tuple[int | None, ...]) -> bool:
    """Whether an op's ``n`` outputs leave a slot the tape names without a value."""
    return any(s is not None for s in outs[n:])


def _zero_out(t: torch.Tensor) -> None:
    """Zero the whole storage of ``t`` (an ``empty``-family output)."""
    st = t.untyped_storage()
    if t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == \
            st.nbytes():
        t.zero_()  # the common case: one memset, no extra tensor
    else:
        _zero(st)


def _zero(st: Any, start: int = 0) -> None:
    n = st.nbytes() - start
    if n > 0:
        torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, start, (n,), (1,)).zero_()


def _run_instr(ins: Any, env: dict[int, Any], dev: torch.device) -> list[Any]:
    if ins.op == UPLOAD:
        return [ins.leaves[0].to(dev, copy=dev.type == "cpu")]
    leaves = [_arg(x, env, dev) for x in ins.leaves]
    op = ins.op
    pol = policy(op)
    if pol.inplace_view:
        leaves[0] = torch.ops.aten.alias.default(leaves[0])
    args, kwargs = optree.tree_unflatten(ins.spec, leaves)
    kind = _memory_kind(op)
    grown = None
    if kind == 2:
        grown = args[0].untyped_storage(), args[0].untyped_storage().nbytes()
    if ins.rng is not None:
        gen = generator_for(dev)
        saved = gen.get_state()
        gen.manual_seed(seed_from(*ins.rng))
        try:
            out = op(*args, **kwargs)
        finally:
            gen.set_state(saved)
    else:
        out = op(*args, **kwargs)
    if kind == 1:
        for t in _tensors(out):
            _zero_out(t)
    elif grown is not None and grown[0].nbytes() > grown[1]:
        _zero(grown[0], grown[1])
    return optree.tree_leaves(out, none_is_leaf=True)


def _arg(x: Any, env: dict[int, Any], dev: torch.device) -> Any:
    """The eager interpreter's argument, with metadata-only arguments zeroed (fresh memory)."""
    v = eager_arg(x, env, dev)
    if type(x) is MetaArg:
        _zero_out(v)
    return v
