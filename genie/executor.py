"""Materialization: plan the requested values, run the tape on the real device, bind results.

The embedded executor maps ``remote_accelerator:N`` to ``cuda:N`` when CUDA is present, else to
the CPU (``GENIE_DEVICE`` overrides). It runs a :class:`~genie.planner.Tape` in order, frees each
value after its last use, and hands the values still needed back to their nodes, which then drop
their inputs (graph truncation: memory stays flat in long loops).

How a tape runs is the backends' business (:mod:`genie.backends`): ``eager`` interprets it op by
op; others compile it or send it to a server.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch.autograd import profiler as _profiler

from . import backends, checks, context, memory, plan_cache
from ._C import (_bind_nodes, _gc_untrack, _hit_run, _math_bits_on, _math_bits_restore, _read,
                 _read_sync_counts, _record_ahead_reset, _release_nodes, _state_apply, _state_word,
                 _step_targets, _without_warning, _wrapper_release)
from .config import config
from .context import _steps
from . import device as _device
from . import graph as _graph
from . import stats as _stats
from .device import real_device
from .errors import DeviceError, ExecutionError
from .graph import Node, pending_total
from .meta import policy
from . import modes as _modes
from .modes import _NO_MODES, disable_modes
from .passes import pipeline
from .planner import PendingSlots, Slot, Tape, build_tape, raw_instrs, value_slice
from .profiling import phase
from .stats import _counts, bump
from .backends import eager as eager_backend  # noqa: E402 - the backends package is imported above
from .backends import native_replay  # noqa: E402

#: the keys ``genie._C._math_bits_on`` re-enables (csrc/state.cpp, kMathBits)
_MATH_BIT_KEYS = (torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative,
                  torch._C.DispatchKey.ZeroTensor)


class real_dispatch:  # noqa: N801 - used as a function: ``with real_dispatch():``
    """Dispatch state for running real ops, even from inside ``__torch_dispatch__``.

    A materialization triggered by an op on a LazyTensor (``.cpu()``, ``.item()``, ``nonzero``)
    runs while the dispatcher excludes every key above Python, the math-bit keys included: a real
    kernel would then read a conjugate (or negative) view's raw memory and ignore the bit. Those
    keys are part of what a real tensor's values mean, so they are re-enabled while real ops run
    (``genie._C._math_bits_on``: one native call each way; three torch guard objects cost ~6 µs
    per materialization).
    """

    __slots__ = ("_mask",)

    def __enter__(self) -> None:
        self._mask = _math_bits_on()

    def __exit__(self, *exc: Any) -> None:
        _math_bits_restore(self._mask)


def _device_for(index: int) -> torch.device:
    """The local real device of ``remote_accelerator:index``. Where this machine has none (a
    client with one GPU connected to two servers), a connected server runs the tape and the
    device is only named: a local fallback would raise CUDA's invalid-device error there."""
    try:
        return real_device(index)
    except DeviceError:
        if not backends.get_backend("remote").is_available():
            raise
        return torch.device("cuda", index)


def states_of(tape: Tape) -> frozenset[int]:
    """The global state words (``genie._C._state_word``) ``tape``'s nodes were recorded under."""
    plan = tape.plan
    if plan is not None:
        return plan.states
    return frozenset(n.entry.state for n in tape.nodes if n.entry is not None)


def run_tape(tape: Tape, index: int,
             defer: Callable[[Callable[[], None]], bool] | None = None) -> list[torch.Tensor]:
    """Run ``tape`` for ``remote_accelerator:index`` on the first backend that takes it.

    Under the global state its ops were recorded under (default dtype, deterministic flags, on
    CUDA the precision flags: csrc/state.cpp), as eager ran them then: a tape recorded under one
    state that is not the current one runs with that state set (and the current one restored
    after); a tape of several states runs op by op in the eager interpreter, each under its own.
    ``defer``: given the binding of the run's nodes, true when it takes it for later (a tape
    sent ahead: bound once the server answered, :func:`run_kept`).
    """
    states = states_of(tape)
    before = None
    per_op = None
    if states and (len(states) > 1 or _state_word() not in states):
        if len(states) == 1:
            before = _state_apply(next(iter(states)))
        elif not pipeline._not_eager():  # a server or compiled backend runs it as one (a gap)
            per_op = [n.entry.state if n.entry is not None else None for n in tape.nodes]
    if tape._stale is not None and (per_op is not None or not _reads_hits()):
        # A hit's instructions are left unbuilt (Tape.instrs) only for a backend that reads
        # their nodes (this process's eager backend: its native replay; a server's client: its
        # encoding) before anything binds them: others read the instructions, and a server's
        # client that sent tapes ahead first settles their answers, which binds (and empties)
        # the nodes they ran, some of which this tape may share.
        _ = tape.instrs
    try:
        bits = _math_bits_on()  # real_dispatch(), inline: once per materialization
        try:
            # genie.passes: the plan's optimized tape when it has one (issue 13); ``ran`` is the
            # tape that ran, ``kept`` the values of ``tape.keep`` either way
            run: Any = pipeline.run if per_op is None else _run_per_op
            args = (tape, _device_for(index)) if per_op is None else \
                (tape, _device_for(index), per_op)
            if checks.DOF_PENDING and checks.dof_pending():
                # a std/var call warned at its line what its kernel warns again now
                kept, ran = _without_warning(checks.DOF_TEXT, lambda: run(*args))
            else:
                kept, ran = run(*args)
        except ExecutionError as e:
            _failed(tape, e, index)
        finally:
            _math_bits_restore(bits)
    finally:
        if before is not None:
            _state_apply(before)
    _counts["nodes_executed"] += len(raw_instrs(ran))  # (their number: a hit's need not be built)
    outputs = [kept[s] for s in tape.outputs]
    if defer is not None and defer(lambda: _bind_ran(tape, kept, ran, index)):
        return outputs
    _bind_ran(tape, kept, ran, index)
    return outputs


def _failed(tape: Tape, e: ExecutionError, index: int) -> NoReturn:
    """Raise ``e``, the failure of a run of ``tape``, once the nodes that ran are bound."""
    partial, e.partial = e.partial, None  # the raised error holds no tensors
    if partial is not None:
        _bind_partial(tape, *partial, index)
    # the user's traceback ends here, in Genie's materialization, not a dozen frames below it
    # in a backend; the message says the op, the cause and where it was recorded
    if e.__cause__ is not None:
        e.__cause__.__traceback__ = None
    raise e.with_traceback(None) from e.__cause__


def _reads_hits() -> bool:
    """Whether the backend that runs tapes now reads a plan-cache hit's per-step values from
    its nodes before anything binds them (so its instructions need not be built): the eager
    backend, and one whose ``reads_hits`` says so (a server's client not sending ahead)."""
    first = pipeline._not_eager()
    return first is None or getattr(backends.get_backend(first), "reads_hits", False)


def _bind_ran(tape: Tape, kept: dict[int, Any], ran: Tape, index: int) -> None:
    # Both tapes are dropped after this. Their nodes are released here, as the bind releases
    # the tape's, and not left to the drop: each node freed lowers the collector's young count,
    # which its allocation never raised (csrc/gccount.h), so frees at the drop ate the count the
    # program's own allocations built and delayed the collection of its garbage cycles
    # (tests/unit/test_gc.py; with memory tracking on, never: the node list is kept to account
    # the peak). ``ran``, a tape the passes made for this step, holds the same nodes.
    keep = ran.nodes is tape.nodes and memory.tracking()
    _bind(tape, kept, release=not keep)
    memory.after_run(ran, kept, index)
    if keep or ran.nodes is not tape.nodes:
        _release_nodes(ran.nodes)


def _run_per_op(tape: Tape, dev: torch.device, states: list[int | None]
                ) -> tuple[dict[int, Any], Tape]:
    """A tape of several states, op by op in the eager interpreter (see :func:`run_tape`)."""
    return eager_backend.run_instrs(tape, dev, states), tape


_PRUNE_AT = 16  # readers of a storage that _bind prunes (shorter lists: Storage.add_reader)


def _bind(tape: Tape, kept: dict[int, torch.Tensor], upto: int | None = None,
          release: bool = False) -> None:
    """Mark the run's nodes executed, keep needed values, release inputs (graph truncation);
    ``upto``: only the first ``upto`` nodes (those that ran before a failure). ``release``: the
    caller is done with ``tape.nodes``: the native loop binds the nodes last first and empties
    the list as it goes (each node it alone held is freed while still in the cache: a 6,480-node
    generate tape freed afterwards cost ~1.5 µs a node in cache misses), so the list holds Nones
    after."""
    if tape._stale is not None and (upto is not None or not release):
        _ = tape.instrs  # a hit's instructions, built while its nodes hold their leaves (see below)
    pending = tape._slots
    lazy = pending.outs if type(pending) is PendingSlots else None  # node i's slots, in order
    nodes = tape.nodes
    if upto is not None:
        nodes = nodes[:upto]
        lazy = None if lazy is None else list(lazy[:upto])
    if lazy is not None and config.native_bind:  # the same loop, natively (csrc/bind.cpp)
        pending_total[0] -= _bind_nodes(nodes, lazy, kept, _PRUNE_AT, config.gc_untrack,
                                        release and upto is None)
        return
    slots = tape.slots if lazy is None else None
    get = kept.get
    untrack = config.gc_untrack
    for i, n in enumerate(nodes):
        vals: list[torch.Tensor | None] = []
        if lazy is not None:
            vals = [get(s) if s is not None else None for s in lazy[i]]
        else:
            idx = n.index
            for k in range(len(n.metas)):
                s = slots.get((idx, k))
                vals.append(get(s) if s is not None else None)
        if all(v is None for v in vals):  # as csrc/bind.cpp: nothing kept, no list
            n.values = (None,) * len(vals)
        else:
            if untrack:  # as csrc/bind.cpp: this list closes no cycle (see there)
                _gc_untrack(vals)
            n.values = vals
        n.executed = True
        n.leaves = None
        n.n_consumers = 0  # no pending consumer to count once a node ran
        for s in n.writes:
            if n in s.pending_writes:
                s.pending_writes.remove(n)
                pending_total[0] -= 1
        # Readers that ran are dead weight; short lists are left to Storage.add_reader's
        # pruning (at doubling), which bounds them: rebuilding every list here cost more than
        # the rest of binding on small training steps.
        for s in n.storages:
            if s is not None and len(s.readers) >= _PRUNE_AT:
                s.prune_readers()


def _bind_partial(tape: Tape, failed: Tape, at: int, live: dict[int, Any], index: int) -> None:
    """Bind what ran of ``tape`` before ``failed`` (the tape a backend ran: ``tape`` or its plan's
    optimized tape) failed at instruction ``at``; ``live``: the values computed so far that were
    still alive, by slot (:attr:`genie.errors.ExecutionError.partial`).

    Eager ran the ops before the failing one, so they must not run again (an in-place write would
    apply twice). The nodes bound are those of a prefix of ``tape`` that all ran; each keeps every
    live value of its outputs, since the pending nodes from the failing one on (not bound: the
    failing op did not happen, and what follows it never ran) may still read them. A value that
    was not computed is never bound: a node whose needed output is not in ``live`` ends the
    prefix.
    """
    if failed is tape:
        upto = at
        kept = {s: live[s] for ins in tape.instrs[:at] for s in ins.outs
                if s is not None and s in live}
    else:
        upto, kept = _ran_prefix(tape, failed, at, live)
    if upto <= 0:
        return
    bump("nodes_executed", upto)
    _bind(tape, kept, upto)
    memory.after_run(tape, kept, index)


def _ran_prefix(tape: Tape, failed: Tape, at: int, live: dict[int, Any]
                ) -> tuple[int, dict[int, Any]]:
    """For an optimized tape (genie.passes: instructions merged, dropped, duplicated or moved)
    that failed at ``at``: the longest prefix of ``tape``'s nodes whose instructions all ran
    and whose outputs still needed are known under their own slots, and those values."""
    pos = {id(n): j for j, n in enumerate(tape.nodes)}
    made: dict[int, set[int]] = {}  # tape node position -> slots its instructions made
    for ins, n in zip(failed.instrs[:at], failed.nodes[:at]):
        j = pos.get(id(n))
        if j is not None:
            made.setdefault(j, set()).update(s for s in ins.outs if s is not None)
    instrs = tape.instrs
    upto = 0
    while upto in made:
        upto += 1
    while upto > 0:
        needed = set(tape.keep)  # what the nodes after the prefix may still read
        for ins in instrs[upto:]:
            needed.update(x.id for x in ins.leaves if type(x) is Slot)
        short = next((j for j in range(upto) for s in instrs[j].outs
                      if s is not None and s in needed and (s not in made[j] or s not in live)),
                     None)
        if short is None:
            break
        upto = short
    kept = {s: live[s] for j in range(upto) for s in instrs[j].outs
            if s is not None and s in made[j] and s in live}
    return upto, kept


#: The values :func:`host_value` evaluates: a lineage of at most ``HOST_NODES`` nodes, each value
#: of at most ``HOST_ELEMENTS`` elements (microseconds on the host).
HOST_NODES = 32
HOST_ELEMENTS = 4096

_aten = torch.ops.aten
# ops whose outputs hold uninitialized memory: their values are whatever the device had there
_UNINITIALIZED = frozenset(
    op for packet in (_aten.empty, _aten.empty_strided, _aten.empty_permuted, _aten.empty_like,
                      _aten.new_empty, _aten.new_empty_strided, _aten._resize_output_)
    for op in (getattr(packet, name) for name in packet.overloads()))
_UPLOAD = "genie.upload"
_HOST = torch.device("cpu")
# ops whose result eager fully specifies (no order of ties, no choice among duplicate writes,
# no rounding): a scalar read on the host (:func:`host_read`) is made of these and views only
_READ_OPS = frozenset(
    op for packet in (
        _aten.eq, _aten.ne, _aten.lt, _aten.le, _aten.gt, _aten.ge, _aten.logical_and,
        _aten.logical_or, _aten.logical_xor, _aten.logical_not, _aten.bitwise_and,
        _aten.bitwise_or, _aten.bitwise_xor, _aten.bitwise_not, _aten.__and__, _aten.__or__,
        _aten.__xor__, _aten.any, _aten.all, _aten.isin, _aten.max, _aten.min, _aten.amax,
        _aten.amin, _aten.sum, _aten.add, _aten.sub, _aten.mul, _aten.neg, _aten.abs,
        _aten.where, _aten.clamp, _aten.maximum, _aten.minimum, _aten.ones, _aten.zeros,
        _aten.full, _aten.ones_like, _aten.zeros_like, _aten.full_like, _aten.arange,
        _aten.scalar_tensor, _aten.lift_fresh, _aten.lift_fresh_copy, _aten.clone, _aten.copy,
        _aten._to_copy, _aten.cat, _aten.stack, _aten.view, _aten._unsafe_view, _aten.reshape,
        _aten.unsqueeze, _aten.squeeze, _aten.expand, _aten.slice, _aten.select, _aten.alias,
        _aten.permute, _aten.t, _aten.transpose, _aten.numel, _aten.fill)
    for op in (getattr(packet, name) for name in packet.overloads()))


def host_value(node: Node, out: int) -> torch.Tensor | None:
    """The value of output ``out`` of the pending ``node``, evaluated on the host, where every
    value it depends on is known to the host and small: ``torch.ones(20, dtype=torch.long,
    device=D)`` then ``ind[-1] = 10``. Else None (nothing runs).

    Known to the host: made by ops on constants and on such values, or a pending upload's
    snapshot. Every value of the lineage (up to :data:`HOST_NODES` nodes, each up to
    :data:`HOST_ELEMENTS` elements) is of an integer or bool dtype, so exact: the host's kernels
    give the device's values on every backend (an upload, the host's own snapshot, may be of any
    dtype). Never a random op (its values are the device generator's), an uninitialized one
    (``empty``), one that changes metadata in place, or a value that ran (that value is the
    device's: an embedded and a remote device must agree). The nodes stay pending: their run on
    the device is unchanged. Used by advanced indexing's bounds check at the call
    (:func:`genie.checks.check_known_indices`)."""
    index = node.metas[out].index
    return _on_host(node, out, lambda n: _host_known(n, index), False)


def _on_host(node: Node, out: int, accept: Any, keep: bool) -> torch.Tensor | None:
    """The value of ``out`` of ``node`` evaluated on the host from a lineage of nodes that pass
    ``accept``, starting from values :func:`host_read` evaluated before (:data:`_host_values`),
    or None. ``keep``: keep the lineage's values there (host_read's, of exactly specified ops).
    """
    value = _host_value_of(node, out)
    if value is not None:
        return value
    known: dict[tuple[int, int], torch.Tensor] = {}

    def have(n: Node, k: int) -> bool:
        v = _host_value_of(n, k)
        if v is None:
            return False
        known[(n.index, k)] = v
        return True

    nodes = value_slice(node, out, accept, HOST_NODES, have)
    if nodes is None:
        return None
    tape = build_tape([(node, out)], nodes, known)
    for ins in tape.instrs:
        ins.free = ()  # a short run: nothing to free early
    tape.keep = {s for ins in tape.instrs for s in ins.outs if s is not None}
    try:
        with real_dispatch():
            kept = eager_backend.run_instrs(
                tape, _HOST, [n.entry.state if n.entry is not None else None for n in nodes])
    except Exception:
        return None  # the device's run raises it, where eager's would (a deferred error)
    bump("host_evaluations")
    for n, ins in zip(tape.nodes, tape.instrs) if keep else ():
        vals = {k: kept[s] for k, s in enumerate(ins.outs)
                if s is not None and not n.storage(k).pending_writes}
        if vals:
            _host_values[n] = vals
    return kept[tape.outputs[0]]


#: Values of pending nodes' outputs that :func:`host_read` evaluated, by
#: node (weakly: gone with the node), so that the next read's lineage starts from them: a
#: generate loop's stopping check, ``unfinished = unfinished & ~done`` then ``unfinished.max() ==
#: 0`` once per token, grows its lineage by ~7 nodes a token and went to the device once it
#: passed HOST_NODES (27 round trips of a 32-token generate). Only outputs whose storage has no
#: pending write, used while it has none (a write would change the value, and the host tape would
#: write the value kept here): the value is the output's as recorded, exact (integer or bool ops,
#: uploads' own snapshots), the device's own when the node runs there.
_host_values: weakref.WeakKeyDictionary[Node, dict[int, torch.Tensor]] = \
    weakref.WeakKeyDictionary()


def _host_value_of(node: Node, out: int) -> torch.Tensor | None:
    if node.executed:
        return None
    vals = _host_values.get(node)
    if vals is None or node.storage(out).pending_writes:
        return None
    return vals.get(out)


def host_read(node: Node, out: int) -> torch.Tensor | None:
    """:func:`host_value` for a scalar read (``.item()``, ``bool()``) of a device served by a
    server: the checks a library makes on small values it made from constants (transformers'
    ``generate``: ``(eos_token_tensor < 0).any()``, ``isin(pad, eos).any()``) cost no round trip.
    Only where the lineage is made of ops whose result eager fully specifies
    (:data:`_READ_OPS`: a value another device would order or round differently is read from the
    device), and never while a training step's effects wait for the next trigger (they run with
    it, :func:`genie.executor.with_step`). None: read it from the device."""
    if _steps.pending:
        return None
    entry = node.entry
    seen = _refused.get(id(entry)) if entry is not None else None
    if seen is not None and seen[0] is not entry:
        seen = None  # another entry, since gone, had that id
    if seen is not None and seen[1]:  # refused before: the device's value, without a walk
        _refused[id(entry)] = (entry, seen[1] - 1)
        return None
    index = node.metas[out].index
    value = _on_host(node, out, lambda n: (n.op == _UPLOAD or n.op in _READ_OPS) and
                     _host_known(n, index), True)
    if entry is not None:
        if value is None:
            if len(_refused) >= REFUSED_MEMORY:
                _refused.clear()
            _refused[id(entry)] = (entry, REFUSED_SKIP)
        elif seen is not None:
            del _refused[id(entry)]
    return value


#: :func:`host_read`: a read whose node's meta-cache entry (op, arguments, input metadata: the
#: same read site of a loop) was refused goes to the device without a walk for the next
#: ``REFUSED_SKIP`` reads of that entry, then is tried again. A generate loop's stopping check
#: (``unfinished.max() == 0``, its lineage reaching the last token's logits) was refused every
#: token after a walk of ~25-45 us with the caches cold from the token's recording. A read sent
#: to the device instead is the same value (the host reads only what the device computes
#: exactly), at most a round trip more
_refused: dict[int, tuple[Any, int]] = {}  # id(entry) -> (entry, reads left to skip)
REFUSED_SKIP = 15
REFUSED_MEMORY = 256


def forget_refusals() -> None:
    """Try every read site on the host again (:func:`host_read`; a new session)."""
    _refused.clear()


def _host_known(n: Node, index: int) -> bool:
    """Whether ``n`` may be in a lineage :func:`host_value` evaluates for a value of
    ``remote_accelerator:index`` (its inputs aside; all on that device: the interpreter runs
    another index's op on that index's real device)."""
    op = n.op
    if n.rng is not None or (op != _UPLOAD and (
            not isinstance(op, torch._ops.OpOverload) or op in _UNINITIALIZED
            or policy(op).inplace_view)):
        return False
    for m in n.metas:
        if m is None:
            continue
        if m.index != index or (op != _UPLOAD and (m.dtype.is_floating_point or
                                                   m.dtype.is_complex)):
            return False
        count = 1
        for s in m.shape:
            count *= s
        if count > HOST_ELEMENTS:
            return False
    return True


def run_targets(targets: list[tuple[Node, int]], index: int) -> list[Any]:
    """The real values of node outputs ``targets`` on ``remote_accelerator:index``.

    Only the nodes the values depend on run; each runs at most once; values that live tensors
    hold stay on the device for later use. Public entry point: :func:`genie.materialize`.
    """
    _record_ahead_reset()  # a read: a piece sent ahead (backends.remote) counts from here
    _wrapper_release()  # outputs whose wrappers died without the GIL: dead before it plans
    if backends.before_plan is not None:  # and what was sent ahead is bound first
        backends.before_plan()
    outs = None
    for node, out in targets:  # values already on the device (_ready's test, in a loop)
        if not node.executed or node.values is None or node.storage(out).pending_writes:
            break
    else:
        outs = [node.values[out] for node, out in targets]
    if outs is None:
        n = len(targets)
        if _read_native[0] and not _profiler._is_profiler_enabled and _fusing():
            outs = _read_fast(targets, n, index)
        else:
            if _steps.pending:
                targets = with_step(targets, index)
            if not _profiler._is_profiler_enabled:  # as below, without the no-op phase contexts
                tape = plan_cache.plan(targets, backends.shape_generic(), _fusing())
                if type(tape) is tuple:  # a column-match hit, its tape not made
                    outs = _run_hit(*tape, targets, n, index)
                else:
                    outs = run_tape(_requested(tape, n), index)
            else:
                with phase("plan"):
                    tape = _requested(plan_cache.plan(targets, backends.shape_generic()), n)
                with phase("execute"):
                    outs = run_tape(tape, index)
            del outs[n:]
    if not _profiler._is_profiler_enabled:
        return backends.fetch(outs)  # handles of values resident on a server -> real tensors
    with phase("transfer"):
        return backends.fetch(outs)


def _read_fast(targets: list[tuple[Node, int]], n: int, index: int) -> list[Any]:
    """:func:`run_targets`' read of pending values on the fused path's terms (:func:`_fusing`,
    no profiler): ``genie._C._read`` (csrc/read.cpp) takes the steady read (the step's extra
    targets, the column-match lookup, the hit's parameters, the fused run and bind) in one call
    and hands back where this Python code goes on otherwise: a miss (``plan_cache.plan`` skips
    what it did), a hit it does not run fused (:func:`_run_hit`), a failing kernel
    (:func:`_hit_failed`), or a run whose values the CPU accounting does not hold here
    (``memory.after_run``). The values of the first ``n`` targets."""
    r = _read(targets if type(targets) is list else list(targets), n, index, _READ_CTX)
    if type(r) is list:
        return r
    return _read_on(r, n, index)


def _read_on(r: tuple, n: int, index: int) -> list[Any]:
    """Where :func:`_read_fast` goes on after ``genie._C._read`` handed back ``r`` (its tuple
    answer; also csrc/read.cpp's ``.item()`` path): the values of the first ``n`` targets."""
    kind, targets, found = r[0], r[1], r[2]
    if kind == 0:  # no column-match hit: slice, look up, or build (found: (span, key[, tried]))
        tape = plan_cache.plan(targets, backends.shape_generic(), True, found)
        if type(tape) is tuple:
            outs = _run_hit(*tape, targets, n, index)
        else:
            outs = run_tape(_requested(tape, n), index)
    elif kind == 1:
        outs = _run_hit(*found, targets, n, index)
    elif kind == 2:
        _hit_failed(*found, targets, n, index, r[3])
    else:
        plan, _, generic, p = found
        vals, _, _, kept = r[3]
        memory.after_run(None, kept, index, _fused(plan, p[1]).high_water)
        return vals
    del outs[n:]
    return outs


# --- the fused hit path --------------------------------------------------------------------------
#
# A read whose slice a cached plan serves (a column-match hit on the eager backend, the plan's
# native program compiled, its passes settled) runs from the match itself: the program reads
# the step's parameters from the found nodes, the values are bound to them, and no Tape, edited
# instructions or backend dispatch is made. Anything else (a miss, passes still verified or
# timed, a script on a hit of other shapes, a profiler, a dispatch mode, a hit of other shapes
# under memory tracking, a failing op) takes the general path (run_tape), which stays the
# reference: both bind the same values to the same nodes. With memory tracking on (a peak was
# asked for), a hit of the plan's own shapes runs fused, its run's high-water mark (the same
# every such hit) computed once from the tape the general path would run.

_fuse = [False]  # the settings allow it (config: native bind and replay, no index checks)
#: ``genie._C._read`` takes a read the fused path may take (:func:`_read_fast`); off
#: (``config.native_read``, ``GENIE_NATIVE_READ=0``): the Python path, its reference
_read_native = [False]


def _fuse_config(c: Any) -> None:
    _fuse[0] = c.native_bind and c.native_replay in ("1", "always") and c.index_check == "0"
    _read_native[0] = c.native_read


config.on_change(_fuse_config)


def _fusing() -> bool:
    """Whether this read may take the fused hit path (settings and process state)."""
    return _fuse[0] and backends.before_plan is None and backends._order[:1] == ["eager"] \
        and not checks.DOF_PENDING and disable_modes() is _NO_MODES


class _Fused:
    """What a plan's fused hits read (``Plan.artifacts["fused"]``; ``["fused_generic"]`` for
    hits whose shapes differ from the plan's), for its passes' state ``passes``
    (``Plan.artifacts["passes"]``) of generation ``gen``: the native program (None: these hits
    take the general path), the instructions it reads a step's parameters from where the
    step's are the plan's, whether such a run counts as waiting for the passes, and with an
    edit script, per plan instruction that may take a step's parameters, the program's
    instructions made from it."""

    __slots__ = ("passes", "gen", "program", "tmpl", "at", "consts", "script", "waiting",
                 "final", "high_water")

    def __init__(self, plan: Any, generic: bool) -> None:
        self.passes = plan.artifacts.get("passes")
        self.gen = pipeline._config["gen"]
        self.program: Any = None
        self.tmpl: list[Any] = plan.instrs
        self.at: dict[int, list[int]] | None = None
        self.consts: dict[int, torch.Tensor] | None = None
        self.script: Any = None
        self.waiting = False
        self.final = False  # made for good (else again at the next hit: passes or program to come)
        # bytes of fresh values alive at once in a run of the plan's own shapes (memory
        # tracking: memory.tape_high_water of the tape the general path runs), once known
        self.high_water: int | None = None
        s = pipeline.settled(plan, generic)
        if s is None:
            return
        owner, st, self.waiting = s
        prog = owner.artifacts.get("native_generic" if generic else "native")
        if prog is None:
            return
        self.final = True
        if prog is False or prog.others:
            return
        if st is not None:
            # instructions of floats, host tensors and random ops
            stale = {*plan.flat[5], *plan.flat[8][0], *plan.rngs}
            if not stale.isdisjoint(st.frozen):  # a step may differ where a pass compared
                return
            self.tmpl = st.tmpl
            self.at = {o: st.by_origin.get(o, []) for o in stale}
            self.consts = st.consts
            self.script = st
        self.program = prog


def _fused(plan: Any, generic: bool) -> _Fused:
    name = "fused_generic" if generic else "fused"
    f = plan.artifacts.get(name)
    if f is None or f.passes is not plan.artifacts.get("passes") or \
            f.gen != pipeline._config["gen"] or not f.final:
        f = plan.artifacts[name] = _Fused(plan, generic)
    return f


def _run_hit(plan: Any, r: Any, generic: bool, p: tuple[list[int], bool],
             targets: list[tuple[Node, int]], n: int, index: int) -> list[Any]:
    """Run a column-match hit (:func:`genie.plan_cache.plan`'s ``found``: the match ``r``, its
    params ``p``) on the fused path when it can take it, else as :func:`run_tape` runs its
    tape; the values of the first ``n`` targets."""
    f = _fused(plan, p[1])
    states = plan.states
    tracking = memory._tracking[0]
    if f.program is None or (states and (len(states) > 1 or _state_word() not in states)) or \
            (tracking and (p[1] or (f.high_water is None and not _high_water(f, plan, r, targets,
                                                                             generic, p, n)))):
        return run_tape(_requested(plan_cache.hit_tape(plan, r, targets, generic, p), n), index)
    found, shaped, _, _, inputs = r
    if p[1]:  # as the general path counts them, before the run
        _counts["plan_cache_generic_hits"] += 1
    if f.waiting:
        bump("passes_waiting")
    out = _hit_run(f.program.native, inputs, f.consts, f.tmpl, f.at, found,
                   [*p[0], *shaped, *plan.rngs] if shaped or plan.rngs else p[0],
                   [_device_for(index)], plan.flat[15], _PRUNE_AT, config.gc_untrack,
                   index if memory.held_here(index) else -1, plan.outputs[:n])
    if len(out) == 3:  # (failing instruction, its exception, live values): as run_tape
        _hit_failed(plan, r, generic, p, targets, n, index, out)
    vals, bound, held, kept = out
    _counts["native_replays"] += 1
    _counts["fused_hits"] += 1
    if f.program.freed:
        _counts["values_freed"] += f.program.freed
    _counts["nodes_executed"] += len(f.tmpl)
    pending_total[0] -= bound
    if held < 0:
        memory.after_run(None, kept, index, f.high_water)
    else:
        memory.held(index, held)
    return vals


def _hit_failed(plan: Any, r: Any, generic: bool, p: tuple[list[int], bool],
                targets: list[tuple[Node, int]], n: int, index: int, out: tuple) -> NoReturn:
    """Raise the failure ``out`` (``genie._C._hit_run``'s: the failing instruction, its
    exception, the live values) of a fused hit's run as :func:`run_tape` raises it, once the
    nodes that ran are bound."""
    f = _fused(plan, p[1])
    tape = _requested(plan_cache.hit_tape(plan, r, targets, generic, p, False), n)
    err = native_replay.failure(tape if f.script is None else f.script.apply(tape), *out)
    err.__cause__ = out[1]
    _failed(tape, err, index)


def _high_water(f: _Fused, plan: Any, r: Any, targets: list[tuple[Node, int]], generic: bool,
                p: tuple[list[int], bool], n: int) -> bool:
    """Set ``f.high_water`` from this hit (of the plan's own shapes) as the general path would
    account its run (:func:`genie.memory.after_run` of the tape it runs: the plan's, or its
    edit script's); False when the script would not take this step (the general path runs it)."""
    tape = _requested(plan_cache.hit_tape(plan, r, targets, generic, p, False), n)
    ran = tape if f.script is None else f.script.apply(tape)
    if ran is None:
        return False
    f.high_water = memory.tape_high_water(ran)
    return True


def run_kept(targets: list[tuple[Node, int]], index: int,
             defer: Callable[[Callable[[], None]], bool] | None = None) -> None:
    """Run what ``targets`` depend on and keep their values where they live (on a server:
    resident handles), returning nothing: :func:`genie.backends.remote.send_ahead`, whose
    ``defer`` (see :func:`run_tape`) binds the nodes when the server has answered. Until then
    they stay pending: a failure leaves them as a failed materialization does."""
    if backends.before_plan is not None:
        backends.before_plan()
    run_tape(_requested(plan_cache.plan(targets, backends.shape_generic()), 0), index, defer)


def _requested(tape: Tape, n: int) -> Tape:
    """``tape`` whose first ``n`` outputs are the values asked for; the step's extra targets
    (:func:`with_step`) run in it but stay where their tensors live (kept: on a server, resident
    handles), never sent back (a remote AdamW step downloaded its parameters, gradients and
    state every step: 4.2 MB for a 4 x 256 MLP)."""
    if len(tape.outputs) <= n:
        return tape
    # (not dataclasses.replace: it walks the fields and costs ~10x this, once per step)
    r = Tape(raw_instrs(tape), tape.inputs, tape.outputs[:n], tape.keep | set(tape.outputs[n:]),
             tape.nodes, tape._slots, tape.index, tape.plan, tape.generic)
    r._stale = tape._stale
    return r


def with_step(targets: list[tuple[Node, int]], index: int) -> list[tuple[Node, int]]:
    """``targets`` and the pending effects of the optimizer steps recorded since the last
    trigger (:func:`genie.context.take_steps`): the parameters, gradients and optimizer state
    on ``remote_accelerator:index`` that the steps left pending, so that forward, backward and
    update run in the tape of the value asked for (one tape per training step: the passes plan
    them together, ``recompute`` frees activations across the whole step, a server gets one
    request). Only work the program already committed to: values it holds, written by ops it
    recorded, which eager ran at ``opt.step()``. Not for an index other than the step's (those
    stay pending as before). Extra targets come after the requested ones, in the optimizer's
    order, each once. Natively (``genie._C._step_targets``: the loop below, ~25 µs of a
    4-layer MLP's AdamW step in Python) unless ``config.native_bind`` is off."""
    opts = context.take_steps()
    if config.native_bind:
        out = _step_targets(targets, opts, index)
        if len(out) > len(targets):
            bump("step_tapes")
        return out
    extra: list[tuple[Node, int]] = []
    seen = {(id(n), o) for n, o in targets}
    for opt in opts:
        for t in context.step_tensors(opt):
            n = getattr(t, "_node", None)
            if n is None:
                continue
            o = t._out
            if n.metas[o].index != index or (n.executed and not n.storage(o).pending_writes):
                continue
            k = (id(n), o)
            if k not in seen:
                seen.add(k)
                extra.append((n, o))
    if extra:
        bump("step_tapes")
    return [*targets, *extra]


def _ready(n: Node, out: int) -> torch.Tensor | None:
    if n.executed and n.values is not None and not n.storage(out).pending_writes:
        return n.values[out]
    return None


#: the modules ``genie._C._read`` reads and updates by name, by position (csrc/read.cpp's Ctx)
_READ_CTX = (plan_cache, _stats, _graph, context, config, pipeline, memory, _device, backends,
             sys.modules[__name__], functools.partial, checks, _modes)
# the counts genie._C._read keeps natively (csrc/read.cpp), added to genie.stats when read
_stats._syncs.append(functools.partial(_read_sync_counts, _stats))
