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

from ..backends.eager import generator_for, seed_from
from ..errors import ExecutionError
from ..meta import policy
from ..planner import MetaArg, Slot, Tape

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


class _Ledger:
    """Bytes per storage of the tape's values; ``live`` counts what the session does not hold
    yet (fresh storages whole, resident storages by their growth)."""

    def __init__(self) -> None:
        self.entries: dict[int, list[Any]] = {}  # key -> [keepalive, nbytes, slots, base]
        self.live = 0

    def add(self, t: torch.Tensor, base: int | None = None) -> None:
        st = t.untyped_storage()
        e = self.entries.get(st._cdata)
        if e is None:
            n = st.nbytes()
            b = n if base is None else base
            self.entries[st._cdata] = [t, n, 1, b]
            self.live += n - b
        else:
            e[2] += 1

    def new_bytes(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        return 0 if st._cdata in self.entries else st.nbytes()

    def refresh(self, t: torch.Tensor) -> None:
        e = self.entries.get(t.untyped_storage()._cdata)
        if e is not None:
            n = t.untyped_storage().nbytes()
            self.live += max(n - e[3], 0) - max(e[1] - e[3], 0)
            e[1] = n

    def release(self, t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        e = self.entries.get(key)
        if e is not None:
            e[2] -= 1
            if e[2] == 0:
                self.live -= max(e[1] - e[3], 0)
                del self.entries[key]


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


def check_bounds(t: torch.Tensor) -> str | None:
    """Why ``t`` addresses memory outside its storage (None when it does not)."""
    if t.numel() == 0:
        return None
    if any(st < 0 for st in t.stride()) or t.storage_offset() < 0:
        return f"negative strides {list(t.stride())} or offset {t.storage_offset()}"
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    need = (last + 1) * t.element_size()
    have = t.untyped_storage().nbytes()
    if need > have:
        return (f"a view of shape {list(t.shape)}, strides {list(t.stride())}, offset "
                f"{t.storage_offset()} reaches byte {need} of a storage of {have} bytes")
    return None


def _meta_of(v: Any, bases: dict[int, torch.Tensor]) -> Any:
    """The meta twin of a real value (tensors share a meta storage when they share a storage)."""
    if not isinstance(v, torch.Tensor):
        return v
    st = v.untyped_storage()
    base = bases.get(st._cdata)
    if base is None:
        base = bases[st._cdata] = torch.empty(st.nbytes(), dtype=torch.uint8, device=META)
    m = torch.empty(0, dtype=v.dtype, device=META)
    m.set_(base.untyped_storage(), v.storage_offset(), v.shape, v.stride())
    if v.is_conj():
        m = m.conj()
    if v.is_neg():
        m = torch._neg_view(m)
    return m


def _meta_leaf(x: Any, env: dict[int, Any]) -> tuple[Any, int]:
    """(meta value, transient bytes) of one instruction leaf."""
    t = type(x)
    if t is Slot:
        return env[x.id], 0
    if t is torch.device:
        return META, 0
    if t is MetaArg:
        m = x.meta
        v = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=META)
        return v, v.untyped_storage().nbytes()
    if isinstance(x, torch.Tensor):  # a host constant (already in memory: counted as baseline)
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=META), 0
    return x, 0


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


def _host_bytes(tape: Tape) -> int:
    n = 0
    for ins in tape.instrs:
        for x in ins.leaves:
            if isinstance(x, torch.Tensor):
                n += x.untyped_storage().nbytes()
    return n


def vet(tape: Tape, start: int, env: dict[int, Any], budget: int, resident: dict[int, int],
        baseline: int = 0, deadline: float | None = None, limit: float = 0.0) -> Vetted:
    """Check ``tape.instrs[start:]`` on meta tensors, given the real values ``env`` before it.

    ``resident`` maps the storages (``_cdata``) the session already holds to their counted
    bytes; ``baseline`` is memory the request already uses (host constants). Raises
    :class:`QuotaError` when the working set passes ``budget``, :class:`ExecutionError` when an
    op refuses its meta arguments or a view leaves its storage; returns where vetting stopped
    (an op whose output size depends on data) and the peak.
    """
    bases: dict[int, torch.Tensor] = {}
    ledger = _Ledger()
    menv: dict[int, Any] = {}
    for s, v in env.items():
        m = _meta_of(v, bases)
        menv[s] = m
        if isinstance(v, torch.Tensor):
            ledger.add(m, resident.get(v.untyped_storage()._cdata, 0))
    peak = ledger.live + baseline
    if peak > budget:
        raise QuotaError(start, "the values so far", peak, budget)
    n = len(tape.instrs)
    for i in range(start, n):
        if deadline is not None and time.monotonic() > deadline:
            raise RunTimeout(i, n, limit)
        ins = tape.instrs[i]
        op = ins.op
        transient = 0
        leaves = []
        for x in ins.leaves:
            v, b = _meta_leaf(x, menv)
            leaves.append(v)
            transient += b
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
                return Vetted(i, peak)  # its size depends on data: run up to here first
            raise ExecutionError(op, ins.where, e, i) from e
        outs = optree.tree_leaves(out, none_is_leaf=True)
        for x in ins.leaves:  # in-place ops (resize_, out=) may grow what they write
            if type(x) is Slot:
                for t in _tensors(menv[x.id]):
                    ledger.refresh(t)
        fresh = 0
        for s, v in zip(ins.outs, outs):
            for t in _tensors(v):
                bad = check_bounds(t)
                if bad is not None:
                    raise ExecutionError(op, ins.where, IndexError(
                        f"out of bounds: {bad}; the server refuses views past their storage"),
                        i)
                if s is None:
                    fresh += ledger.new_bytes(t)
        for s, v in zip(ins.outs, outs):
            if s is not None:
                menv[s] = v
                for t in _tensors(v):
                    ledger.add(t, 0)
        peak = max(peak, ledger.live + baseline + transient + fresh)
        if peak > budget:
            raise QuotaError(i, op, peak, budget)
        for s in ins.free:
            for t in _tensors(menv.pop(s)):
                ledger.release(t)
    return Vetted(n, peak)


def run_guarded(tape: Tape, dev: torch.device, budget: int, deadline: float | None = None,
                limit: float = 0.0) -> dict[int, Any]:
    """Vet ``tape`` against ``budget`` free bytes, then run it on ``dev`` before ``deadline``
    (``time.monotonic()``); returns the values of ``tape.keep`` and ``tape.outputs``."""
    from torch.utils._python_dispatch import _disable_current_modes

    env: dict[int, Any] = dict(tape.inputs)
    resident = {}
    for v in env.values():
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            resident[st._cdata] = st.nbytes()
    baseline = _host_bytes(tape)
    n = len(tape.instrs)
    with _disable_current_modes(), torch.no_grad():
        checked = vet(tape, 0, env, budget, resident, baseline, deadline, limit).upto
        for i, ins in enumerate(tape.instrs):
            if deadline is not None and time.monotonic() > deadline:
                raise RunTimeout(i, n, limit)
            try:
                outs = _run_instr(ins, env, dev)
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


def _zero(st: Any, start: int = 0) -> None:
    n = st.nbytes() - start
    if n > 0:
        torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, start, (n,), (1,)).zero_()


def _run_instr(ins: Any, env: dict[int, Any], dev: torch.device) -> list[Any]:
    leaves = [_arg(x, env, dev) for x in ins.leaves]
    op = ins.op
    pol = policy(op)
    if pol.inplace_view:
        leaves[0] = torch.ops.aten.alias.default(leaves[0])
    args, kwargs = optree.tree_unflatten(ins.spec, leaves)
    base = op._schema.name[len("aten::"):]
    grown = None
    if base in RESIZING:
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
    if base in ZEROED:
        for t in _tensors(out):
            _zero(t.untyped_storage())
    elif grown is not None and grown[0].nbytes() > grown[1]:
        _zero(grown[0], grown[1])
    return optree.tree_leaves(out, none_is_leaf=True)


def _arg(x: Any, env: dict[int, Any], dev: torch.device) -> Any:
    t = type(x)
    if t is Slot:
        return env[x.id]
    if t is torch.device:
        return dev if x.type == "remote_accelerator" else x
    if t is MetaArg:
        m = x.meta
        v = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=dev)
        _zero(v.untyped_storage())
        return v
    return x
