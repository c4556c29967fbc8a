"""Op policy from schemas and tags, and output metadata from meta tensors behind a cache.

Functions here take *meta leaves*: an op call's flattened ``(args, kwargs)`` in which every lazy
input stands as its :class:`~genie.graph.TensorMeta` (the tensor facade converts them; this module
never sees a LazyTensor, so it sits below :mod:`genie.lazy_tensor` in the import order).

Recording never touches data: the output shape, stride and dtype of an op come from running the
op on ``meta`` tensors built from its inputs' metadata. That costs tens of microseconds, so results
are cached by a key of (op overload, argument tree structure, global state word, input metadata,
scalar arguments); a repeated op pays one dict lookup. The state word (``genie._C._state_word``:
default dtype, deterministic-algorithm flags, on CUDA the precision flags) stands for the global
state an op's result depends on; see docs/semantics.md, "Global state". Errors raised by the
meta kernel (shape mismatch, bad dim, device mismatch) propagate unchanged, so they reach the
user's line with eager's exception type.

Policy (what an op mutates, which input its outputs alias, whether it is random or data-dependent)
comes from ``op._schema`` alias annotations and ``op.tags``, never from names, with one
exception: kernels that write arguments their schemas do not mark (the batch norms' running
statistics), from torch's own ``SchemaInfo`` and :data:`UNMARKED_WRITES` (see
:func:`_unmarked_writes`).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ._C import _gc_untrack, _record_clear, _state_word, _whole_ops, _whole_ops_enable
from . import checks
from .config import config
from .device import DEVICE_TYPE
from .errors import UnsupportedOpError
from .graph import TensorMeta, meta_tensor
from .modes import disable_modes
from .portable import portable_kernel
from .shape_rules import KW_RULES, RULES
from .stats import _counts

_DYNAMIC = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
aten = torch.ops.aten

# Ops whose first argument is read only for shape/dtype/layout: recorded with a MetaArg.
METADATA_ONLY = frozenset(
    op for packet in (aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like,
                      aten.rand_like, aten.randn_like, aten.randint_like, aten.new_empty,
                      aten.new_empty_strided, aten.new_zeros, aten.new_ones, aten.new_full)
    for op in (getattr(packet, name) for name in packet.overloads())
)


@dataclass(frozen=True, slots=True)
class OpPolicy:
    """What the schema says about one overload.

    Attributes:
        writes: schema positions of arguments the op may mutate (``Tensor(a!)`` /
            ``Tensor(a!)[]``, and those of ``unmarked``).
        unmarked: the positions among ``writes`` the schema does not mark (``native_batch_norm``'s
            ``running_mean`` and ``running_var``: :func:`_unmarked_writes`).
        write_flag: schema position of the bool argument (``training``) without which the op
            writes none of ``unmarked`` (-1: none). A call's own writes: :meth:`call_writes`.
        returns: per return, ``(kind, arg_position)`` with kind ``"write"`` (returns its mutated
            argument: ``add_``, ``out=``), ``"view"`` (aliases an input: ``view``, ``unbind``) or
            ``None`` (fresh storage).
        random: tagged ``nondeterministic_seeded``: gets a (seed, offset) at record time.
        dynamic: output shape or value depends on data: must run before recording continues.
        inplace_view: changes its argument's metadata in place (``transpose_``).
        names: argument names by schema position (to find kwargs).
        portable: for ops with only a fused CUDA kernel, the decomposition recorded in their
            place (see :mod:`genie.portable`); None for every other op.
    """

    writes: tuple[int, ...]
    returns: tuple[tuple[str, int] | None, ...]
    random: bool
    dynamic: bool
    inplace_view: bool
    names: tuple[str, ...]
    portable: Any = None
    metadata_only: bool = False  # reads its first argument's metadata only (zeros_like, new_*)
    # Float values can change output metadata only in factories (arange(0, 1.5, 0.5)) and through
    # float-typed arguments (scale_factors); elsewhere a float is a Scalar operand, whose type
    # (not value) decides the result dtype. When False, meta-cache keys hold a float's type only,
    # so a decaying learning rate does not miss the cache every step.
    float_values_matter: bool = True
    key: int = 0  # small unique int standing for the op in meta-cache keys (cheap to hash)
    # Has a CompositeImplicitAutograd kernel: reaches __torch_dispatch__ only when the autograd
    # keys are skipped (``torch.inference_mode()``); recorded as its decomposition, as eager runs it.
    # False for the ops of WHOLE, which are recorded as one node.
    implicit: bool = False
    unmarked: tuple[int, ...] = ()
    write_flag: int = -1

    def arg(self, pos: int, args: tuple, kwargs: dict) -> Any:
        if pos < len(args):
            return args[pos]
        return kwargs.get(self.names[pos])

    def call_writes(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        """The positions this call writes: :attr:`writes`, less :attr:`unmarked` where its
        :attr:`write_flag` is False (an eval-mode batch norm reads its running statistics)."""
        if self.write_flag < 0 or self.arg(self.write_flag, args, kwargs) is not False:
            return self.writes
        return tuple(p for p in self.writes if p not in self.unmarked)


_policies: dict[Any, OpPolicy] = {}

#: Composite ops recorded as one node where autograd does not need their decomposition (no_grad,
#: inference, inputs that need no grad): ``matmul`` and ``linear`` (default overloads). Their
#: kernel at AutogradPrivateUse1 (csrc/whole.cpp) decides; the device runs the same composite
#: when the node replays. ``GENIE_WHOLE_OPS=0`` (``config.whole_ops``): always decomposed.
WHOLE = frozenset(_whole_ops())
config.on_change(lambda cfg: _whole_ops_enable(cfg.whole_ops))


#: Ops tagged ``nondeterministic_seeded`` only for a dropout their CPU kernel refuses: they draw
#: nothing, so they take no (seed, offset) and stay on the native record path and in compiled
#: plans. ``_scaled_dot_product_flash_attention_for_cpu`` (SDPA's fused CPU kernel, chosen by
#: csrc/whole.cpp's stub only without dropout): its kernel raises for ``dropout_p > 0``.
SEEDED_FOR_NOTHING = frozenset({torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default})


#: Kernels that write arguments their schemas do not mark (``Tensor?`` where ``Tensor(a!)?``
#: belongs) and torch's ``SchemaInfo`` does not list (it lists ``native_batch_norm``, its
#: ``.out``, ``cudnn_batch_norm``, ``miopen_batch_norm`` and their composites): op -> (the
#: arguments written, the bool argument without which they are not, or None). Their kernels
#: update the running statistics in place: ``batch_norm_update_stats`` on the CPU (checked in
#: tests/unit/test_unmarked_writes.py), the others on CUDA or ROCm, and every ``.out`` here calls
#: its functional overload (CompositeExplicitAutograd).
UNMARKED_WRITES: dict[Any, tuple[tuple[str, ...], str | None]] = {
    **{getattr(packet, name): (("running_mean", "running_var"), None)
       for packet in (aten.batch_norm_update_stats, aten.batch_norm_gather_stats,
                      aten.batch_norm_gather_stats_with_counts)
       for name in ("default", "out")},
    aten.cudnn_batch_norm.out: (("running_mean", "running_var"), "training"),
    aten.miopen_batch_norm.out: (("running_mean", "running_var"), "training"),
}


def _unmarked_writes(op: Any, schema: Any) -> tuple[tuple[int, ...], int]:
    """The positions of the arguments ``op`` writes without its schema marking them, and of the
    bool argument without which it writes none of them (-1: none).

    torch's schemas of the batch norms (``native_batch_norm``, kept for compatibility) do not
    mark ``running_mean``/``running_var`` as written, though a training call updates them in
    place; torch knows (``_decomp``'s "native_batch_norm ... has a wrong schema"), and its
    ``SchemaInfo`` says they are mutable, unless ``training`` is known False. Found here from
    ``SchemaInfo`` and :data:`UNMARKED_WRITES`; every consumer of :attr:`OpPolicy.writes`
    (recording's pending writes, the passes, the plan cache, liveness, the remote path, compiled
    graphs) then sees them as any other write."""
    args = schema.arguments
    named = UNMARKED_WRITES.get(op)
    if named is not None:
        written, flag = named
        return (tuple(i for i, a in enumerate(args) if a.name in written),
                next((i for i, a in enumerate(args) if a.name == flag), -1))
    info = torch._C._SchemaInfo(schema)
    pos = tuple(i for i, a in enumerate(args)
                if "Tensor" in str(a.type) and (a.alias_info is None or not a.alias_info.is_write)
                and info.is_mutable(_argument(i)))
    if not pos:
        return (), -1
    for i, a in enumerate(args):
        if str(a.type) == "bool":
            off = torch._C._SchemaInfo(schema)
            off.add_argument_value(a.name, False)
            if not any(off.is_mutable(_argument(j)) for j in pos):
                return pos, i
    return pos, -1


def _argument(i: int) -> Any:
    return torch._C._SchemaArgument(torch._C._SchemaArgType.input, i)


#: ``Scalar`` arguments whose value is only written into an output (``full``'s ``fill_value``,
#: ``masked_fill``'s ``value``): their type can decide an output's dtype, their value never
#: decides metadata nor what a meta kernel checks
_VALUE_ARGS = frozenset({"fill_value", "value"})
VALUE_LEAVES_NONE: frozenset[int] = frozenset()
_value_leaves_of: dict[tuple[Any, Any], frozenset[int]] = {}


def value_leaves(ins: Any) -> frozenset[int]:
    """The leaves of ``ins`` that are a :data:`_VALUE_ARGS` argument whole: a bool there is
    keyed by its type in a class key, so that a call differing only in it (HF's stopping
    criteria fill ``full((batch,), is_done)``, ``True`` at a generate's last step) is of the
    class of its other steps (genie.remote.shape_class); a native program reads it per step, as
    a float (``native_replay.compile_tape``), so that a server's native lane patches it
    (csrc/worker_replay.cpp, ``kWrittenBool``)."""
    op = ins.op
    try:
        named = op._genie_value_args  # (cached on the op, as meta.policy is: ~0.1 µs a look)
    except AttributeError:
        schema = getattr(op, "_schema", None)
        named = () if schema is None else tuple(
            (p, a.name) for p, a in enumerate(schema.arguments)
            if a.name in _VALUE_ARGS and isinstance(a.type, torch._C.NumberType))
        with contextlib.suppress(AttributeError):
            op._genie_value_args = named
    if not named:
        return VALUE_LEAVES_NONE
    k = (op, ins.spec)
    got = _value_leaves_of.get(k)
    if got is None:
        tree = optree.tree_unflatten(ins.spec, list(range(ins.spec.num_leaves)))
        args, kwargs = tree if type(tree) is tuple and len(tree) == 2 else ((), {})
        found = set()
        for p, name in named:
            x = args[p] if p < len(args) else kwargs.get(name)
            if type(x) is int:  # (the leaf's index: the argument is one leaf)
                found.add(x)
        got = frozenset(found)
        if len(_value_leaves_of) >= 4096:
            _value_leaves_of.clear()
        _value_leaves_of[k] = got
    return got


#: views whose schemas do not say so (their output shares the first argument's storage)
UNANNOTATED_VIEWS = frozenset((torch.ops.aten._unsafe_view.default,
                               torch.ops.aten.unsafe_split.Tensor,
                               torch.ops.aten.unsafe_split_with_sizes.default,
                               torch.ops.aten.unsafe_chunk.default))


def policy(op: Any) -> OpPolicy:
    """The (cached) :class:`OpPolicy` of an ``OpOverload``.

    Cached on the op object itself as well: ``OpOverload.__hash__`` is Python code, and the
    recording hot path would otherwise pay it on every op.
    """
    try:
        return op._genie_policy
    except AttributeError:
        pass
    p = _policies.get(op)
    if p is None:
        p = _policies[op] = _analyze(op)
        try:
            op._genie_policy = p
        except AttributeError:  # pseudo-ops (strings) cannot carry attributes
            pass
    return p


def _analyze(op: Any) -> OpPolicy:
    schema = op._schema
    sets: dict[str, int] = {}
    writes = []
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is None:
            continue
        if info.is_write:
            writes.append(i)
        for s in info.before_set:
            sets.setdefault(s, i)
    view_src = next((i for i, a in enumerate(schema.arguments)
                     if a.alias_info is not None and not a.alias_info.is_write), None)
    returns: list[tuple[str, int] | None] = []
    for r in schema.returns:
        info = r.alias_info
        if info is None:
            returns.append(None)
        elif info.is_write:
            src = next((sets[s] for s in info.before_set if s in sets), None)
            returns.append(("write", src) if src is not None else None)
        else:
            src = next((sets[s] for s in info.before_set if s in sets), view_src)
            returns.append(("view", src) if src is not None else None)
    tags = set(op.tags)
    unmarked, write_flag = _unmarked_writes(op, schema)
    return OpPolicy(
        writes=tuple(sorted((*writes, *unmarked))),
        returns=tuple(returns),
        random=torch.Tag.nondeterministic_seeded in tags and op not in SEEDED_FOR_NOTHING,
        dynamic=bool(tags & _DYNAMIC),
        inplace_view=torch.Tag.inplace_view in tags,
        names=tuple(a.name for a in schema.arguments),
        portable=portable_kernel(op),
        metadata_only=op in METADATA_ONLY,
        float_values_matter=_float_values_matter(schema),
        key=len(_policies),
        implicit=torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "CompositeImplicitAutograd") and op.name() not in WHOLE,
        unmarked=unmarked,
        write_flag=write_flag,
    )


def _float_values_matter(schema: Any) -> bool:
    """Whether a float argument's value (not only its type) can decide an output's metadata:
    a float-typed argument, or Scalars of an op with no tensor input other than its ``out=``
    (a factory: ``arange.out(end)`` sizes its output by ``end``)."""
    has_tensor = False
    for a in schema.arguments:
        t = str(a.type)  # e.g. "Tensor", "List[Tensor]", "float", "Optional[List[float]]"
        if "float" in t:
            return True
        if "Tensor" in t and not (a.kwarg_only and a.alias_info is not None and
                                  a.alias_info.is_write):
            has_tensor = True
    return not has_tensor


class MetaCache:
    """``key -> MetaEntry``; bounded (cleared when full)."""

    def __init__(self) -> None:
        self._d: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return self._d.get(key)

    #: Bound on entries: a program whose keys never repeat must not grow memory without limit.
    limit = 1 << 16

    def put(self, key: Any, value: Any) -> None:
        d = self._d
        if len(d) >= self.limit:
            self.clear()  # rare, and cheaper on the hot path than LRU bookkeeping on every hit
        d[key] = value
        if config.gc_untrack:
            _untrack_entry(key, value)

    def clear(self) -> None:
        self._d.clear()
        _record_clear()  # the native record path's entries are this cache's, by identity keys

    def __len__(self) -> int:
        return len(self._d)


meta_cache = MetaCache()


def _untrack_entry(key: tuple, entry: MetaEntry) -> None:
    """Take a new cache entry off the cyclic collector's lists (``GENIE_GC_UNTRACK``).

    An entry lives as long as the cache (or the nodes and plans that share it) and is never
    part of a reference cycle: the key holds the op, the argument tree, input ``TensorMeta``s and
    constants, none of which refers back to it; the entry holds its outputs' metadata, constants
    and specs. Tracked, each miss left ~8 long-lived objects that young collections promoted
    into the oldest generation, and those promotions are what schedule a full collection of the
    process's heap (~170 ms with torch and transformers loaded): a generate loop at new lengths
    promoted ~450 such objects per call. Off the lists, they are still freed by reference
    counting when the cache drops them.
    """
    _gc_untrack(key, entry, entry.metas, entry.consts, entry.plan,
                *[m for m in entry.metas if m is not None])


@dataclass(frozen=True, slots=True)
class MetaEntry:
    """The meta cache's value for one key: what recording an op call needs besides its arguments.

    Interned per key (op, argument tree, input metadata, non-float constants): nodes recorded with
    equal keys share one entry, so ``a.entry is b.entry`` proves those equal (the plan cache
    compares nodes by identity).

    Attributes:
        metas: one :class:`TensorMeta` per flat output (None for non-tensor outputs).
        out_spec: tree spec to rebuild the op's return value from its flat outputs.
        consts: the non-tensor outputs (None at tensor positions).
        plan: per tensor output ``(flat index, "write"/"view"/None, schema position of its
            source)``, from :func:`output_plan`.
        spec: the call's argument tree spec (equal for every call with this key; nodes share it).
        klass: the call's *shape class*, interned (:func:`shape_class`): equal for calls that
            differ at most in shapes, strides, int constants and float values, so that a
            shape-generic plan compares nodes by ``a.entry.klass is b.entry.klass``.
        state: the global state word the call was recorded under (``genie._C._state_word``:
            default dtype, deterministic-algorithm flags, and on CUDA the precision flags). It
            is part of the key, so entries (and the plans that compare them) of different states
            differ; the executor runs a node under its entry's state (genie.executor).
    """

    metas: list[TensorMeta | None]
    out_spec: Any
    consts: list[Any]
    plan: tuple[tuple[int, str | None, int], ...]
    spec: Any
    klass: Any = field(default=None, compare=False)
    state: int = 0


@dataclass(frozen=True, slots=True)
class WarnedEntry(MetaEntry):
    """The entry of a call eager warns for, on every call, from metadata alone (std of a
    reduction with no degrees of freedom: :func:`genie.checks.dof_warning`): ``warnings`` are
    eager's texts, which ``lazy_tensor._record`` warns at each call it records. The native record
    path learns only exact :class:`MetaEntry` objects (csrc/record.cpp), so such calls always
    take the Python path, which warns."""

    warnings: tuple[str, ...] = ()


_classes: dict[Any, Any] = {}


def _kind(x: Any) -> Any:
    t = type(x)
    if t is TensorMeta:
        return (x.dtype, len(x.shape), x.index, x.conj, x.neg)
    if t is int or t is float:
        return t
    if isinstance(x, torch.Tensor):
        return ("T", x.device.type, x.dim(), x.dtype)
    if isinstance(x, torch.Generator):
        return torch.Generator
    return (t, x)


def shape_class(func: Any, spec: Any, leaves: list[Any], metas: list[TensorMeta | None],
                out_spec: Any, state: int = 0) -> Any:
    """The interned shape class of a call (see :attr:`MetaEntry.klass`): op, argument tree,
    global state word, each leaf's kind (a tensor's dtype, rank, device and math bits;
    ``int``/``float`` for numbers; other constants by value), and each output's kind."""
    try:
        key = (func, spec, state, tuple(map(_kind, leaves)),
               tuple(None if m is None else _kind(m) for m in metas), out_spec)
        k = _classes.get(key)
    except TypeError:  # an unhashable constant: a class of its own
        return object()
    if k is None:
        if len(_classes) >= MetaCache.limit:
            _classes.clear()  # bounded like the meta cache; classes are compared by identity
        k = _classes[key] = key
        if config.gc_untrack:  # as _untrack_entry: interned for the cache's life, in no cycle
            _gc_untrack(key, key[3], key[4])
    return k


_LEAF_SPEC = optree.tree_structure(0, none_is_leaf=True)
_out_specs: dict[tuple[type, int], Any] = {}


def _out_spec(kind: type, n: int) -> Any:
    """The tree spec of ``n`` outputs returned as a ``kind`` (tuple or list), interned."""
    spec = _out_specs.get((kind, n))
    if spec is None:
        spec = _out_specs[kind, n] = optree.tree_structure(kind([0] * n), none_is_leaf=True)
    return spec


def infer(func: Any, pol: OpPolicy, leaves: list[Any], spec: Any, index: int) -> MetaEntry:
    """Output metadata for a cache miss: a shape rule (:mod:`genie.shape_rules`) where one
    applies, else ``func`` run on meta tensors built from the meta leaves ``leaves``; then the
    checks eager does and the meta kernels skip (:mod:`genie.checks`), which raise eager's
    error."""
    entry = _infer(func, pol, leaves, spec, index)
    try:
        checked = func._genie_checked
    except AttributeError:
        checked = checks.checked(func)
    if checked:
        checks.check(func, leaves, spec, entry.klass)
        if func in checks.DOF_WARNED:
            msgs = checks.dof_warning(func, leaves, spec, entry.metas[0])
            if msgs:
                entry = WarnedEntry(entry.metas, entry.out_spec, entry.consts, entry.plan,
                                    entry.spec, entry.klass, entry.state, msgs)
    if pol.writes and _overlapping_write(pol, leaves, spec):
        # Most eager kernels refuse to write into a tensor whose elements share memory (an
        # expanded out=: "unsupported operation: more than one element ..."), few meta kernels
        # do, and some eager ones (sum.out) do not either: eager's verdict, from a run on zeros.
        # An error there is the overlap's where the same call into a dense copy runs (zeros can
        # fail data checks of their own: a multinomial of zero probabilities).
        state = torch.get_rng_state() if pol.random else None
        try:
            err = _host_call(func, leaves, spec)
            if isinstance(err, BaseException) and not isinstance(
                    _host_call(func, [_dense(x) for x in leaves], spec), BaseException):
                raise rename_device(err, index) from None
        finally:
            if state is not None:
                torch.set_rng_state(state)
    return entry


def _dense(x: Any) -> Any:
    """A contiguous TensorMeta of ``x``'s shape where ``x`` is one with internal overlap."""
    if type(x) is not TensorMeta or not any(
            st == 0 and n > 1 for n, st in zip(x.shape, x.stride, strict=True)):
        return x
    return TensorMeta.of(torch.empty(x.shape, dtype=x.dtype, device="meta"), x.index)


def _overlapping_write(pol: OpPolicy, leaves: list[Any], spec: Any) -> bool:
    """Whether a tensor the op writes has internal overlap as eager's ``has_internal_overlap``
    sees it for sure: a dimension of more than one element with stride 0."""
    args, kwargs = optree.tree_unflatten(spec, leaves)
    for pos in pol.writes:
        a = pol.arg(pos, args, kwargs)
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if type(t) is TensorMeta and any(st == 0 and n > 1
                                             for n, st in zip(t.shape, t.stride, strict=True)):
                return True
    return False


#: The state words entries were made under (the native path's entries copy a class's first
#: entry's): while it holds one, every node of every plan has the same state, and the plan cache
#: skips comparing them (genie.plan_cache).
states_seen: set[int] = set()


#: Factories whose eager kernels resize an ``out=`` only when its element count differs
#: (``if (result.numel() != n) result.resize_({n})``): an ``out=`` of the right count keeps its
#: shape and strides (a non-contiguous view is written in place), where their meta kernels
#: (torch._refs) resize it to ``[n]`` and warn. The value: whether eager warns when it resizes
#: (arange does, in its own words; linspace and logspace resize silently).
_RESIZE_BY_NUMEL = {getattr(packet, name): packet is aten.arange
                    for packet in (aten.arange, aten.linspace, aten.logspace)
                    for name in packet.overloads() if name.endswith("out")}


def _cpu_scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0 and x.device.type == "cpu"


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _infer(func: Any, pol: OpPolicy, leaves: list[Any], spec: Any, index: int) -> MetaEntry:
    state = _state_word()  # the key's (a miss is inferred at once, under the same state)
    if state not in states_seen:
        states_seen.add(state)
    rule = RULES.get(func)
    kw_rule = KW_RULES.get(func) if rule is None else None
    if (rule is not None or kw_rule is not None) and index >= 0 and config.shape_rules:
        args, kwargs = optree.tree_unflatten(spec, leaves)
        if kw_rule is not None:
            m = kw_rule(args, kwargs, index)
        else:
            m = None if kwargs else rule(args, index)
        if m is not None:
            _counts["meta_cache_misses"] += 1
            _counts["shape_rule_hits"] += 1
            if type(m) is TensorMeta:
                metas, out_spec = [m], _LEAF_SPEC
            else:  # several outputs: a tuple or list of them, as the op returns them
                metas, out_spec = list(m), _out_spec(type(m), len(m))
            return MetaEntry(metas, out_spec, [None] * len(metas), output_plan(pol, metas), spec,
                             shape_class(func, spec, leaves, metas, out_spec, state), state)
    mleaves = [meta_tensor(x) if type(x) is TensorMeta else x for x in leaves]
    margs, mkwargs = optree.tree_unflatten(spec, mleaves)
    dev = mkwargs.get("device")
    if isinstance(dev, torch.device) and dev.type == DEVICE_TYPE:
        mkwargs["device"] = torch.device("meta")
    _counts["meta_cache_misses"] += 1
    resize_by_numel = func in _RESIZE_BY_NUMEL
    try:
        with disable_modes(), warnings.catch_warnings():
            if resize_by_numel:  # the refs' words, not eager's (below)
                warnings.simplefilter("ignore", UserWarning)
            out = func(*margs, **mkwargs)
    except NotImplementedError as e:
        raise UnsupportedOpError(func, f"no meta kernel to infer its output shape ({e}). "
                                 "Move the tensor to the CPU for this op, or report it.") from None
    except Exception as e:
        # A meta kernel stricter than eager (abs of a complex tensor into a complex out=): where
        # eager runs the call (on the host, on zeros of the inputs' metadata), its outputs'
        # metadata stand; where eager raises, its error does.
        # (Only where every tensor is the device's: a host tensor's device is part of the call.)
        out = None if pol.dynamic or any(isinstance(x, torch.Tensor) for x in leaves) else \
            _host_call(func, leaves, spec)
        if out is None and torch.Tag.pointwise in func.tags and any(
                _cpu_scalar(x) for x in leaves):
            # a 0-dim host tensor is a scalar to eager's elementwise kernels, on any device; some
            # meta kernels (copysign's) refuse it for its device: ask them with a meta one
            try:
                with disable_modes():
                    out = func(*optree.tree_unflatten(spec, [
                        x.to("meta") if _cpu_scalar(x) else x for x in mleaves])[0],
                        **mkwargs)
            except Exception:  # noqa: BLE001 - the first error is the user's
                out = None
        if out is None or isinstance(out, BaseException):
            raise (out if isinstance(out, BaseException) else rename_device(e, index)) from None
    flat, out_spec = optree.tree_flatten(out, none_is_leaf=True)
    for o in flat:
        if isinstance(o, torch.Tensor) and (o.layout != torch.strided or o.is_quantized):
            raise checks.refusal(func, o)
    if any(type(x) is torch.dtype and x in checks.QUANTIZED for x in leaves):
        raise checks.refuse_kind(func, "quantized")  # quantize_per_tensor's meta kernel: float
    out_index = dev.index if isinstance(dev, torch.device) and dev.type == DEVICE_TYPE and \
        dev.index is not None else index
    metas = [TensorMeta.of(o, out_index) if isinstance(o, torch.Tensor) else None for o in flat]
    if resize_by_numel:
        given = optree.tree_unflatten(spec, leaves)[1].get("out")
        if type(given) is TensorMeta and _numel(given.shape) == _numel(metas[0].shape):
            metas[0] = given
        elif _RESIZE_BY_NUMEL[func] and type(given) is TensorMeta:  # eager's kernel warns
            n = _numel(metas[0].shape)
            warnings.warn(
                f"The number of elements in the out tensor of shape {list(given.shape)} is "
                f"{_numel(given.shape)} which does not match the computed number of elements "
                f"{n}. Note that this may occur as a result of rounding error. The out tensor "
                f"will be resized to a tensor of shape ({n},).", UserWarning, stacklevel=2)
    consts = [None if isinstance(o, torch.Tensor) else o for o in flat]
    return MetaEntry(metas, out_spec, consts, output_plan(pol, metas), spec,
                     shape_class(func, spec, leaves, metas, out_spec, state), state)


def rename_device(e: Exception, index: int) -> Exception:
    """Eager's exception type with our device's name where the meta kernel said ``meta``."""
    msg = str(e).replace("meta", f"{DEVICE_TYPE}:{index}")
    try:
        return type(e)(msg)
    except Exception:
        return e


def output_plan(pol: OpPolicy, metas: list[Any]) -> tuple[tuple[int, str | None, int], ...]:
    """Per tensor output: (flat index, "write"/"view"/None, schema position of its source)."""
    returns = pol.returns
    plan = []
    for k, m in enumerate(metas):
        if m is None:
            continue
        kind = returns[0] if len(returns) == 1 else (returns[k] if k < len(returns) else None)
        plan.append((k, None, -1) if kind is None else (k, kind[0], kind[1]))
    return tuple(plan)


# Inputs larger than this (bytes) are not rebuilt on the host to ask eager for its error type.
_PROBE_LIMIT = 1 << 26


def eager_error(func: Any, leaves: list[Any], spec: Any, err: Exception) -> Exception:
    """The exception eager raises for this call (meta leaves), where the meta kernel raised ``err``.

    Meta kernels check the same things as eager kernels but sometimes raise another type
    (``IndexError`` for eager's ``RuntimeError``, a Python ``AssertionError``). Cold path: the op
    runs on the host on zero-filled tensors with the inputs' metadata (never the user's data), and
    its exception, if any, is the one the user gets; otherwise ``err`` stands.
    """
    out = _host_call(func, leaves, spec)
    if isinstance(out, BaseException):
        return out
    native = _NATIVE_TEXTS.get(func)
    if native is not None and type(err) is RuntimeError:
        m = native[0].fullmatch(str(err))
        if m is not None:  # the host call, all on cpu, cannot see a device mismatch
            return RuntimeError(native[1].format(*m.groups()))
    return err


#: Ops whose meta kernel is torch's Python reference, whose text differs from the native kernel's
#: (eager's on a backend): the reference's message as a pattern, the native one as a template.
_NATIVE_TEXTS: dict[Any, tuple[Any, str]] = {
    torch.ops.aten.block_diag.default: (
        re.compile(r"Input tensors must all be on the same device\. "
                   r"(Input 0 is on device \S+ and input \d+ is on device \S+)\."),
        "torch.block_diag: input tensors must all be on the same device. {0}"),
}


def _host_call(func: Any, leaves: list[Any], spec: Any) -> Any:
    """``func`` run on the host on zero-filled tensors with the meta leaves' metadata: its
    output, or the exception it raised, or None where the inputs exceed ``_PROBE_LIMIT``."""
    lazies = [x for x in leaves if type(x) is TensorMeta]
    size = sum(meta_tensor(m).untyped_storage().nbytes() for m in lazies)
    if size > _PROBE_LIMIT:
        return None

    def host(x: Any) -> Any:
        if type(x) is TensorMeta:
            base = torch.zeros(meta_tensor(x).untyped_storage().nbytes() // x.dtype.itemsize,
                               dtype=x.dtype)
            return base.as_strided(x.shape, x.stride, x.offset)
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, torch.Generator):
            return None
        if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
            return torch.device("cpu")
        return x

    try:
        hargs, hkwargs = optree.tree_unflatten(spec, [host(x) for x in leaves])
        with disable_modes(), torch.no_grad():
            return func(*hargs, **hkwargs)
    except Exception as e:  # noqa: BLE001 - eager's verdict is what we are after
        return e


def static_shape(func: Any, pol: OpPolicy, leaves: list[Any], spec: Any, index: int) -> bool:
    """Whether a ``dynamic_output_shape`` op has a data-independent shape for these meta leaves.

    The tag is per overload: ``aten.index.Tensor`` carries it for boolean masks, yet ``x[long_idx]``
    (every attention-mask lookup in transformers) has a static shape, as has
    ``repeat_interleave(r, output_size=n)``. Meta kernels decide: they raise where the shape needs
    the data (boolean masks, ``nonzero``, ``unique``) and infer it otherwise, so an op whose meta
    kernel succeeds on meta versions of all its tensors (host ones included) is recorded lazily.
    """
    if torch.Tag.data_dependent_output in func.tags:
        return False
    try:
        key = (func, spec, tuple(_static_key(x) for x in leaves))
        hit = _static_cache.get(key)
    except TypeError:
        key, hit = None, None
    if hit is not None:
        return hit
    as_meta = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in leaves]
    try:
        infer(func, pol, as_meta, spec, index)
        static = True
    except Exception:
        static = False
    if key is not None:
        _static_cache[key] = static
    return static


_static_cache: dict[Any, bool] = {}


def _static_key(x: Any) -> Any:
    if type(x) is TensorMeta:
        return x
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.stride(), x.dtype)
    return (type(x), x)
