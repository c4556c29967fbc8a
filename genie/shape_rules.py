"""Shape rules: output metadata of common ops computed directly, before asking a meta kernel.

A meta-cache miss runs the op's meta kernel (~75-90 µs through the dispatcher, measured on GPT-2
decode and generate in ``bench_models.py``). Misses are what new shapes cost: every decode step
(the KV length grows) and every new prompt length. For the ops that miss there (views, pointwise
arithmetic, ``cat``, ``bmm``) the output metadata is a few lines of arithmetic.

Contract: a rule either returns exactly what the meta kernel would (shape, stride, storage offset,
dtype; ``tests/unit/test_shape_rules.py`` checks it over OpInfo samples) or returns None, and the
meta kernel decides, errors included. Rules therefore accept only the plain cases (standard
contiguous inputs where strides matter, one dtype, no math bits) and decline everything else.
Rules take the op's positional arguments with lazy inputs as :class:`~genie.graph.TensorMeta`
and return one TensorMeta (single-output ops only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .graph import TensorMeta

aten = torch.ops.aten

Rule = Callable[[tuple, int], TensorMeta | None]
RULES: dict[Any, Rule] = {}


def rule(*ops: Any) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the shape rule of ``ops`` (each overload once)."""
    def deco(fn: Rule) -> Rule:
        for op in ops:
            if op in RULES:
                raise ValueError(f"shape rule for {op} registered twice")
            RULES[op] = fn
        return fn

    return deco


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _plain(m: Any) -> bool:
    return type(m) is TensorMeta and not m.conj and not m.neg


def _dense(m: TensorMeta) -> bool:
    """Standard contiguous from offset 0, no empty dims (strides exactly the row-major ones)."""
    return m.offset == 0 and 0 not in m.shape and m.stride == contiguous_strides(m.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _ints(size: Any) -> tuple[int, ...] | None:
    if type(size) not in (list, tuple) or any(type(s) is not int for s in size):
        return None
    return tuple(size)


def _dim(d: Any, ndim: int) -> int | None:
    if type(d) is not int or not -ndim <= d < ndim:
        return None
    return d + ndim if d < 0 else d


# --- views ------------------------------------------------------------------------------------

@rule(aten.view.default, aten._unsafe_view.default)
def _view(args: tuple, index: int) -> TensorMeta | None:
    if len(args) != 2 or not _plain(args[0]):
        return None
    x, size = args[0], _ints(args[1])
    if size is None or not _dense(x):
        return None
    if size.count(-1) == 1:
        known = _numel(tuple(s for s in size if s != -1))
        if known <= 0 or _numel(x.shape) % known:
            return None
        size = tuple(_numel(x.shape) // known if s == -1 else s for s in size)
    if any(s <= 0 for s in size) or _numel(size) != _numel(x.shape):
        return None
    return TensorMeta(size, contiguous_strides(size), 0, x.dtype, index)


@rule(aten.expand.default)
def _expand(args: tuple, index: int) -> TensorMeta | None:
    """ATen's ``inferExpandGeometry``, declining where it would raise."""
    if len(args) != 2 or not _plain(args[0]):
        return None
    x, size = args[0], _ints(args[1])
    n = len(size) if size is not None else 0
    if size is None or n < len(x.shape):
        return None
    shape, stride = [0] * n, [0] * n
    for i in range(n - 1, -1, -1):
        d = len(x.shape) - n + i
        if d >= 0:
            sz, st = x.shape[d], x.stride[d]
        else:
            sz, st = 1, (shape[i + 1] * stride[i + 1] if i + 1 < n else 1)
        target = size[i]
        if target == -1:
            if d < 0:
                return None
            target = sz
        if target < 0 or (sz != target and sz != 1):
            return None
        if sz != target:
            sz, st = target, 0
        shape[i], stride[i] = sz, st
    return TensorMeta(tuple(shape), tuple(stride), x.offset, x.dtype, index)


@rule(aten.unsqueeze.default)
def _unsqueeze(args: tuple, index: int) -> TensorMeta | None:
    if len(args) != 2 or not _plain(args[0]):
        return None
    x = args[0]
    n = len(x.shape)
    d = _dim(args[1], n + 1)
    if d is None:
        return None
    st = 1 if d >= n else x.shape[d] * x.stride[d]
    return TensorMeta(x.shape[:d] + (1,) + x.shape[d:], x.stride[:d] + (st,) + x.stride[d:],
                      x.offset, x.dtype, index)


@rule(aten.transpose.int)
def _transpose(args: tuple, index: int) -> TensorMeta | None:
    if len(args) != 3 or not _plain(args[0]):
        return None
    x = args[0]
    n = len(x.shape)
    if n == 0:
        return None
    a, b = _dim(args[1], n), _dim(args[2], n)
    if a is None or b is None:
        return None
    shape, stride = list(x.shape), list(x.stride)
    shape[a], shape[b] = shape[b], shape[a]
    stride[a], stride[b] = stride[b], stride[a]
    return TensorMeta(tuple(shape), tuple(stride), x.offset, x.dtype, index)


# --- pointwise (one dtype, dense or broadcast-dense inputs) -----------------------------------

_FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_ARITH = frozenset(_FLOATS | {torch.int64, torch.int32})


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + a
    b = (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(out)


def _binary(args: tuple, index: int, compare: bool) -> TensorMeta | None:
    if len(args) != 2 or not _plain(args[0]):
        return None
    x, y = args
    if x.dtype not in _ARITH or not _dense(x) or len(x.shape) == 0:
        return None
    if type(y) is TensorMeta:
        # same dtype, both dense with at least one dim: no promotion, no 0-dim special case;
        # TensorIterator then lays the output out row-major over the broadcast shape
        if not _plain(y) or y.dtype != x.dtype or not _dense(y) or len(y.shape) == 0:
            return None
        shape = _broadcast(x.shape, y.shape)
    elif type(y) is int or (type(y) is float and x.dtype in _FLOATS):
        shape = x.shape  # a Python scalar of the tensor's category keeps its dtype
    else:
        return None
    if shape is None:
        return None
    dtype = torch.bool if compare else x.dtype
    return TensorMeta(shape, contiguous_strides(shape), 0, dtype, index)


@rule(aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor)
def _arith(args: tuple, index: int) -> TensorMeta | None:
    return _binary(args, index, compare=False)


@rule(aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor, aten.eq.Tensor,
      aten.ne.Tensor, aten.eq.Scalar, aten.ne.Scalar, aten.le.Scalar, aten.lt.Scalar)
def _compare(args: tuple, index: int) -> TensorMeta | None:
    return _binary(args, index, compare=True)


# --- cat and the matmul family -----------------------------------------------------------------

@rule(aten.cat.default)
def _cat(args: tuple, index: int) -> TensorMeta | None:
    if not 1 <= len(args) <= 2 or type(args[0]) not in (list, tuple) or not args[0]:
        return None
    ts = args[0]
    first = ts[0]
    if not all(_plain(t) and _dense(t) and t.dtype == first.dtype for t in ts):
        return None
    n = len(first.shape)
    if n == 0:
        return None
    d = _dim(args[1] if len(args) == 2 else 0, n)
    if d is None:
        return None
    total = 0
    for t in ts:
        if len(t.shape) != n or t.shape[:d] != first.shape[:d] or \
                t.shape[d + 1:] != first.shape[d + 1:]:
            return None
        total += t.shape[d]
    shape = first.shape[:d] + (total,) + first.shape[d + 1:]
    return TensorMeta(shape, contiguous_strides(shape), 0, first.dtype, index)


@rule(aten.bmm.default)
def _bmm(args: tuple, index: int) -> TensorMeta | None:
    if len(args) != 2 or not (_plain(args[0]) and _plain(args[1])):
        return None
    a, b = args
    if a.dtype != b.dtype or a.dtype not in _FLOATS or len(a.shape) != 3 or len(b.shape) != 3:
        return None
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1] or 0 in a.shape or 0 in b.shape:
        return None
    shape = (a.shape[0], a.shape[1], b.shape[2])
    return TensorMeta(shape, contiguous_strides(shape), 0, a.dtype, index)
