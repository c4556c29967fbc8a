"""Effect rules: what a few hot ops do to metadata, computed without running them on meta.

The server's vet (:mod:`genie.remote.guard`) runs every instruction whose effect it has not
cached on ``meta`` tensors. In torch 2.13 the Meta kernels of the pointwise ops are Python
references (``torch._refs``: type promotion, broadcasting, stride logic), ~150-300 us per call
with the meta tensors the vet builds, and a decode step's or a new prompt's sizes move every
call, so these are what a vet of a moving step pays for (measured on a GPT-2 12x768 decode
step: ~17 misses, ~2.5 ms of its ~5 ms vet). A rule here computes the same effect from the
operands' metadata in a few microseconds.

Invariant: a rule returns exactly the effect meta gives (shape, strides, offset, dtype, storage
and its bytes) or ``None``, and then the vet runs the op on meta as before. It never admits what
meta would refuse: it declines every case it does not prove (shapes that do not broadcast,
conjugate or negative views, operands that are not non-overlapping and dense, host tensors,
in-place and ``out=`` overloads, which have no rule), and the dtype and every dtype- or
value-dependent refusal come from running the op itself on meta once per (op, operand dtypes
and ranks, constants), on one-element tensors (:func:`_probe`). ``tests/unit/test_vet_rules.py``
is the proof: a differential fuzzer against meta over shapes (broadcast, empty, transposed,
expanded, channels-last), every dtype and scalar kind, that fails on a rule made wrong.

The stride logic follows the references this torch runs (``torch._prims_common``:
``compute_elementwise_output_logical_to_physical_perm``, ``torch.empty_permuted``; ``cat``'s
``suggest_memory_format``) and ATen's view geometry (``inferExpandGeometry``,
``inferUnsqueezeGeometry``, ``transpose``, ``slice``); a torch whose references change shows up
as a fuzzer failure, not as a silent difference; the rules are used only on the torch they were
reviewed for (:data:`REVIEWED`), elsewhere the vet runs every op on meta.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..planner import Slot
from ..shape_rules import sort_dims

aten = torch.ops.aten
META = torch.device("meta")
#: the torch whose references the rules follow (and the fuzzer proved them against); on another
#: torch the vet runs every op on meta (its references may compute strides otherwise)
REVIEWED = "2.13."
ACTIVE = torch.__version__.startswith(REVIEWED)


class _Op:
    """A tensor operand: its layout, dtype, its storage's bytes and its leaf index."""

    __slots__ = ("shape", "stride", "offset", "dtype", "nbytes", "leaf")

    def __init__(self, shape: tuple, stride: tuple, offset: int, dtype: torch.dtype,
                 nbytes: int, leaf: int) -> None:
        self.shape, self.stride, self.offset, self.dtype = shape, stride, offset, dtype
        self.nbytes, self.leaf = nbytes, leaf


def _contiguous(shape: Any) -> tuple[int, ...]:
    """``make_contiguous_strides_for`` (ATen's contiguous strides: a size of 0 counts as 1)."""
    out = [0] * len(shape)
    m = 1
    for i in range(len(shape) - 1, -1, -1):
        out[i] = m
        m *= max(shape[i], 1)
    return tuple(out)


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _is_contiguous(shape: Any, stride: Any) -> bool:
    if _numel(shape) < 2:
        return True
    want = 1
    for x, y in zip(reversed(shape), reversed(stride), strict=True):
        if x == 1:
            continue
        if y != want:
            return False
        want *= x
    return True


def _is_channels_last(shape: Any, stride: Any) -> bool:
    """``is_channels_last_contiguous_2d``."""
    if len(shape) != 4:
        return False
    want = 1
    for d in (1, 3, 2, 0):
        if shape[d] == 1:
            continue
        if stride[d] != want:
            return False
        want *= shape[d]
    return True


def _dense(shape: Any, stride: Any) -> bool:
    """``is_non_overlapping_and_dense`` for plain (non-negative) integers."""
    if _numel(shape) < 2:
        return True
    if len(shape) == 1:
        return stride[0] == 1
    want = 1
    for x, y in sorted(((y, x) for x, y in zip(shape, stride, strict=True) if x != 1)):
        if x != want:
            return False
        want *= y
    return True


def _broadcast(shapes: list[Any]) -> list[int] | None:
    """The common shape, or None when they do not broadcast (meta raises then)."""
    out = [1] * max(len(s) for s in shapes)
    for s in shapes:
        for i in range(-1, -1 - len(s), -1):
            a, c = s[i], out[i]
            if a == c or a == 1:
                continue
            if c != 1:
                return None
            out[i] = a
    return out


def _expand(shape: Any, stride: Any, target: Any) -> tuple[list[int], list[int]] | None:
    """ATen's ``inferExpandGeometry`` (``-1`` keeps a size); None where ``expand`` refuses."""
    nd, td = len(target), len(shape)
    if nd < td:
        return None
    sizes, strides = [0] * nd, [0] * nd
    for i in range(nd - 1, -1, -1):
        d = td - 1 - (nd - 1 - i)
        size = shape[d] if d >= 0 else 1
        st = stride[d] if d >= 0 else (sizes[i + 1] * strides[i + 1] if i + 1 < nd else 0)
        t = target[i]
        if type(t) is not int:
            return None
        if t == -1:
            if d < 0:
                return None
            t = size
        if t < 0:
            return None
        if size != t:
            if size != 1:
                return None
            size, st = t, 0
        sizes[i], strides[i] = size, st
    return sizes, strides


def _ge(a: int, b: int) -> bool:
    if b == 0:
        return True
    if a == 0:
        return False
    return a >= b or a % b == 0


def _perm(shape: list[int], strides: list[Any]) -> list[int]:
    """``compute_elementwise_output_logical_to_physical_perm`` of operands (their strides)
    broadcast to ``shape``."""
    nd = len(shape)
    if nd == 0:
        return []
    if nd == 1:
        return [0]
    contig = all(_is_contiguous(shape, st) for st in strides)
    cl = all(_is_channels_last(shape, st) for st in strides)
    if contig and not cl:
        return list(range(nd))
    if cl and not contig:
        return [0, *range(2, nd), 1]

    def swap(a: int, b: int) -> int:
        for st in strides:
            sa, sb = st[a], st[b]
            if sa == 0 or sb == 0:
                continue
            if sa == sb:
                if _ge(shape[b], shape[a]):
                    continue
                return 1
            if _ge(sb, sa):
                return -1
            if _ge(sa, sb):
                return 1
        return 0

    return sort_dims(nd, swap)


def _permuted_strides(shape: list[int], perm: list[int]) -> tuple[int, ...]:
    """The strides of ``torch.empty_permuted(shape, perm)``."""
    phys = _contiguous([shape[p] for p in perm])
    out = [0] * len(shape)
    for i, p in enumerate(perm):
        out[p] = phys[i]
    return tuple(out)


def _fresh(shape: Any, stride: tuple[int, ...], dtype: torch.dtype) -> tuple[tuple, int]:
    """A fresh output's metadata and its storage bytes."""
    n = _numel(shape)
    return (tuple(shape), stride, 0, dtype, False, False), n * dtype.itemsize if n else 0


#: dtype of an op's output, or None where meta refuses, by (op, spec, operand signature)
_probes: dict[Any, torch.dtype | None] = {}
MAX_PROBES = 4096


def _probe(op: Any, spec: Any, vals: list[Any]) -> torch.dtype | None:
    """The output dtype meta gives for these operands' dtypes and ranks and these constants
    (every refusal that depends on them: bool subtraction, a non-bool ``where`` predicate...),
    from running the op once on one-element meta tensors; None when meta refuses them or the op
    does not return one tensor. An int that fits int64 is keyed by its type (a position moves
    every decode step; type promotion and these ops' checks look at no int64's value; larger
    ones convert as uint64 or not at all), every other constant by its value."""
    import optree

    sig = []
    for v in vals:
        if type(v) is _Op:
            sig.append((v.dtype, len(v.shape)))
        else:
            t = type(v)
            if t is float or t is complex:  # exact values (0.0 == -0.0, nan != nan: by repr)
                sig.append((t, repr(v)))
            elif t is int:  # an int64's value decides nothing here; others keyed exactly
                sig.append((t, True) if -(1 << 63) <= v < (1 << 63) else (t, v))
            elif v is None or t is bool or t is torch.dtype or \
                    t is torch.layout or t is torch.memory_format or t is torch.device:
                sig.append((t, v))
            else:
                return None
    key = (op, spec, tuple(sig))
    try:
        return _probes[key]
    except KeyError:
        pass
    except TypeError:
        return None
    leaves = [torch.empty((1,) * len(v.shape), dtype=v.dtype, device=META) if type(v) is _Op
              else v for v in vals]
    args, kwargs = optree.tree_unflatten(spec, leaves)
    try:
        out = op(*args, **kwargs)
        dtype = out.dtype if type(out) is torch.Tensor and out.device == META else None
    except Exception:
        dtype = None
    if len(_probes) >= MAX_PROBES:
        _probes.clear()
    _probes[key] = dtype
    return dtype


def _pointwise(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    """A pointwise op of tensors and numbers: broadcast shape, the references' strides, the
    probed dtype. Operands must be non-overlapping and dense (a conversion to the computation
    dtype then keeps their strides, as ``prims.convert_element_type`` does)."""
    ts = [v for v in vals if type(v) is _Op]
    if not ts:
        return None
    for v in vals:
        if type(v) is not _Op and type(v) not in (int, float, bool, complex):
            return None
    for t in ts:
        if not _dense(t.shape, t.stride):
            return None
    shape = _broadcast([t.shape for t in ts])
    if shape is None:
        return None
    strides = []
    for t in ts:
        e = _expand(t.shape, t.stride, shape)
        if e is None:
            return None
        strides.append(e[1])
    dtype = _probe(op, spec, vals)
    if dtype is None:
        return None
    meta, nbytes = _fresh(shape, _permuted_strides(shape, _perm(shape, strides)), dtype)
    return [(meta, -1, nbytes)]


def _binary(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    """``op(self, other)`` without ``alpha`` (an ``alpha`` scales ``other`` first, another
    stride rule)."""
    if len(vals) != 2:
        return None
    return _pointwise(op, spec, vals)


def _where(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    if len(vals) != 3 or any(type(v) is not _Op for v in vals):
        return None
    return _pointwise(op, spec, vals)


def _view(t: _Op, shape: Any, stride: Any, offset: int) -> list[tuple] | None:
    meta = (tuple(shape), tuple(stride), offset, t.dtype, False, False)
    return [(meta, t.leaf, t.nbytes)]


def _wrap(dim: Any, n: int) -> int | None:
    """``maybe_wrap_dim`` (a 0-dim tensor wraps as 1-dim); None where it refuses."""
    if type(dim) is not int:
        return None
    m = max(n, 1)
    if dim < -m or dim >= m:
        return None
    return dim + m if dim < 0 else dim


def _unsqueeze(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    if len(vals) != 2 or type(vals[0]) is not _Op:
        return None
    t = vals[0]
    shape, stride = list(t.shape), list(t.stride)
    d = _wrap(vals[1], len(shape) + 1)
    if d is None:
        return None
    st = 1 if d >= len(shape) else shape[d] * stride[d]
    shape.insert(d, 1)
    stride.insert(d, st)
    return _view(t, shape, stride, t.offset)


def _transpose(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    if len(vals) != 3 or type(vals[0]) is not _Op or not vals[0].shape:
        return None
    t = vals[0]
    shape, stride = list(t.shape), list(t.stride)
    a, b = _wrap(vals[1], len(shape)), _wrap(vals[2], len(shape))
    if a is None or b is None:
        return None
    shape[a], shape[b] = shape[b], shape[a]
    stride[a], stride[b] = stride[b], stride[a]
    return _view(t, shape, stride, t.offset)


def _expand_op(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    # expand(self, size, implicit=False): the leaves are self, the sizes, and maybe implicit
    if not vals or type(vals[0]) is not _Op or spec.num_leaves != len(vals):
        return None
    import optree

    args, kwargs = optree.tree_unflatten(spec, list(range(len(vals))))
    if kwargs or len(args) != 2 or type(args[1]) is not list:
        return None
    t = vals[0]
    e = _expand(t.shape, t.stride, [vals[i] for i in args[1]])
    if e is None:
        return None
    return _view(t, e[0], e[1], t.offset)


def _cat(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    """``cat(tensors, dim)``: every operand of one rank (the legacy empty 1-D operand
    declines), one of them not channels-last, so the output is contiguous."""
    import optree

    args, kwargs = optree.tree_unflatten(spec, list(range(len(vals))))
    if kwargs or not args or type(args[0]) is not list or len(args) > 2 or not args[0]:
        return None
    ts = [vals[i] for i in args[0]]
    dim = vals[args[1]] if len(args) == 2 else 0
    if any(type(t) is not _Op for t in ts) or type(dim) is not int:
        return None
    nd = len(ts[0].shape)
    if nd == 0 or any(len(t.shape) != nd or t.shape == (0,) for t in ts):
        return None
    d = _wrap(dim, nd)
    if d is None:
        return None
    first = ts[0].shape
    for t in ts:
        if any(t.shape[i] != first[i] for i in range(nd) if i != d):
            return None
    if all(_like_channels_last(t.shape, t.stride) for t in ts):
        return None
    dtype = _probe(op, spec, vals)
    if dtype is None:
        return None
    shape = list(first)
    shape[d] = sum(t.shape[d] for t in ts)
    meta, nbytes = _fresh(shape, _contiguous(shape), dtype)
    return [(meta, -1, nbytes)]


def _slice(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    """``slice.Tensor(self, dim=0, start=None, end=None, step=1)`` (ATen's ``slice``)."""
    import optree

    args, kwargs = optree.tree_unflatten(spec, list(range(len(vals))))
    if kwargs or not args or len(args) > 5:
        return None
    a = [vals[i] for i in args] + [0, None, None, 1][len(args) - 1:]
    t, dim, start, end, step = a
    if type(t) is not _Op or not t.shape or type(step) is not int or step <= 0:
        return None
    if any(x is not None and type(x) is not int for x in (start, end)):
        return None
    d = _wrap(dim, len(t.shape))
    if d is None:
        return None
    n = t.shape[d]
    start = 0 if start is None else start
    end = n if end is None else end
    if start < 0:
        start += n
    if end < 0:
        end += n
    start = min(max(start, 0), n)
    end = min(max(end, start), n)
    shape, stride = list(t.shape), list(t.stride)
    offset = t.offset + start * stride[d]
    shape[d] = (end - start + step - 1) // step
    stride[d] *= step
    return _view(t, shape, stride, offset)


def _softmax(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    """``_softmax(x, dim, half_to_float)``: meta's output is ``empty_like(x)`` contiguous."""
    if len(vals) != 3 or type(vals[0]) is not _Op or type(vals[1]) is not int or \
            type(vals[2]) is not bool:
        return None
    dtype = _probe(op, spec, vals)
    if dtype is None:
        return None
    shape = vals[0].shape
    meta, nbytes = _fresh(shape, _contiguous(shape), dtype)
    return [(meta, -1, nbytes)]


def _arange(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    """``arange(end)`` of a non-negative int with no dtype: ``end`` int64 elements."""
    import optree

    args, kwargs = optree.tree_unflatten(spec, list(range(len(vals))))
    if len(args) != 1 or type(vals[args[0]]) is not int or vals[args[0]] < 0:
        return None
    want = {"dtype": (None,), "layout": (None, torch.strided), "device": (META,),
            "pin_memory": (None, False)}
    for k, i in kwargs.items():
        if not any(vals[i] is x for x in want.get(k, ())):
            return None
    meta, nbytes = _fresh((vals[args[0]],), (1,), torch.int64)
    return [(meta, -1, nbytes)]


def _matmul(op: Any, spec: Any, vals: list[Any]) -> list[tuple] | None:
    """``matmul`` of two batches of matrices (both 3-D or more): ATen's batched path, a fresh
    contiguous output of the broadcast batch and ``n x p`` (``bmm`` then ``_unsafe_view``)."""
    if len(vals) != 2 or any(type(v) is not _Op or len(v.shape) < 3 for v in vals):
        return None
    a, b = vals
    if a.shape[-1] != b.shape[-2]:
        return None
    batch = _broadcast([a.shape[:-2], b.shape[:-2]])
    if batch is None:
        return None
    dtype = _probe(op, spec, vals)
    if dtype is None:
        return None
    shape = [*batch, a.shape[-2], b.shape[-1]]
    meta, nbytes = _fresh(shape, _contiguous(shape), dtype)
    return [(meta, -1, nbytes)]


def _like_channels_last(shape: Any, stride: Any) -> bool:
    """``are_strides_like_channels_last_or_false`` (``suggest_memory_format``'s test)."""
    nd = len(shape)
    if nd == 4:
        order: tuple[int, ...] = (1, 3, 2, 0)
    elif nd == 5:
        order = (1, 4, 3, 2, 0)
    else:
        return False
    if stride[1] == 0:
        return False
    m = 0
    for d in order:
        if shape[d] == 0 or stride[d] < m:
            return False
        if d == 0 and m == stride[1]:
            return False
        m = stride[d] * shape[d]
    return True


#: the reviewed ops and their rules (functional overloads only: in-place and ``out=`` writes
#: have no rule and are vetted on meta)
RULES: dict[Any, Callable[[Any, Any, list[Any]], list[tuple] | None]] = {
    **{op: _binary for op in (
        aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
        aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor,
        aten.ge.Tensor, aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar,
        aten.gt.Scalar, aten.ge.Scalar)},
    aten.where.self: _where,
    aten.unsqueeze.default: _unsqueeze,
    aten.transpose.int: _transpose,
    aten.expand.default: _expand_op,
    aten.cat.default: _cat,
    aten.slice.Tensor: _slice,
    aten._softmax.default: _softmax,
    aten.arange.default: _arange,
    aten.matmul.default: _matmul,
}


_CONSTANTS = (int, float, bool, complex, torch.dtype, torch.layout, torch.memory_format)


def effect(op: Any, ins: Any, env: dict[int, Any], storages: dict[int, list[int]]
           ) -> list[tuple] | None:
    """The outputs of ``ins`` (``(meta, src, nbytes)`` each, as the vet's ``_Out``) from the
    metadata of its operands (``env``: slot -> the vet's tensor values; ``storages``: storage
    id -> [bytes, ...]), or None: no rule, or one that declines (the vet runs it on meta).

    Example (a float ``(2, 1, 4)`` plus an int64 ``(3, 1)``: what ``a + b`` gives on meta; None
    on a torch the rules were not reviewed against, :data:`ACTIVE`):
        >>> import optree, torch
        >>> from genie.planner import Instr, Slot
        >>> from genie.remote.guard import TV
        >>> env = {0: TV(((2, 1, 4), (4, 4, 1), 0, torch.float32, False, False), 7),
        ...        1: TV(((3, 1), (1, 1), 0, torch.int64, False, False), 8)}
        >>> spec = optree.tree_structure(((0, 0), {}))
        >>> ins = Instr(torch.ops.aten.add.Tensor, [Slot(0), Slot(1)], spec, (2,), None)
        >>> out = effect(ins.op, ins, env, {7: [32, 1, 0], 8: [24, 1, 0]})
        >>> out == ([(((2, 3, 4), (12, 4, 1), 0, torch.float32, False, False), -1, 96)]
        ...         if ACTIVE else None)
        True
    """
    rule = RULES.get(op) if ACTIVE else None
    if rule is None:
        return None
    vals: list[Any] = []
    for j, x in enumerate(ins.leaves):
        if type(x) is Slot:
            v = env[x.id]
            m = getattr(v, "meta", None)  # the vet's TV, or a plain value
            if type(m) is not tuple:
                vals.append(v)
                continue
            if m[4] or m[5]:  # a conjugate or negative view
                return None
            vals.append(_Op(m[0], m[1], m[2], m[3], storages[v.sid][0], j))
        elif type(x) is torch.device:
            vals.append(META)  # the vet's device (a factory's)
        elif x is None or type(x) in _CONSTANTS:
            vals.append(x)
        else:
            return None  # host tensors, metadata-only arguments...
    return rule(op, ins.spec, vals)
