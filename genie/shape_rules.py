"""Shape rules: output metadata of common ops computed directly, before asking a meta kernel.

A meta-cache miss runs the op's meta kernel (~75-90 µs through the dispatcher, measured on GPT-2
decode and generate in ``bench_models.py``). Misses are what new shapes cost: every decode step
(the KV length grows) and every new prompt length. For the ops that miss there (views, pointwise
arithmetic, ``cat``, ``bmm``, ``slice``) the output metadata is a few lines of arithmetic.

Contract: a rule either returns exactly what the meta kernel would (shape, stride, storage offset,
dtype; ``tests/unit/test_shape_rules.py`` checks it over OpInfo samples) or returns None, and the
meta kernel decides, errors included. Rules therefore accept only the plain cases (standard
contiguous inputs where strides matter, one dtype, no math bits) and decline everything else.
Rules take the op's positional arguments with lazy inputs as :class:`~genie.graph.TensorMeta`
and return one TensorMeta, or for an op with several tensor outputs a tuple (``native_layer_norm``)
or list (``split``) of them, as the op returns them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .device import DEVICE_TYPE
from .graph import TensorMeta

aten = torch.ops.aten

Rule = Callable[[tuple, int], "TensorMeta | tuple[TensorMeta, ...] | list[TensorMeta] | None"]
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
    if m.offset != 0:
        return False
    shape, stride = m.shape, m.stride
    acc = 1
    for i in range(len(shape) - 1, -1, -1):  # contiguous_strides(shape) == stride, no list
        s = shape[i]
        if s == 0 or stride[i] != acc:
            return False
        acc *= s
    return True


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

def _view_strides(shape: tuple[int, ...], stride: tuple[int, ...],
                  size: tuple[int, ...]) -> tuple[int, ...] | None:
    """ATen's ``computeStride``: strides of a view of (shape, stride) as ``size`` (same numel,
    no zero-size dim, at least one dim), or None where no view exists (``view`` raises there,
    the meta kernel says how)."""
    new = [0] * len(size)
    view_d = len(size) - 1
    chunk_base = stride[-1]
    tensor_numel = view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and stride[d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or size[view_d] == 1):
                new[view_d] = view_numel * chunk_base
                view_numel *= size[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk_base = stride[d - 1]
                tensor_numel = view_numel = 1
    return tuple(new) if view_d == -1 else None


@rule(aten.view.default, aten._unsafe_view.default)
def _view(args: tuple, index: int) -> TensorMeta | None:
    if len(args) != 2 or not _plain(args[0]):
        return None
    x, size = args[0], _ints(args[1])
    if size is None or 0 in x.shape:
        return None
    if size.count(-1) == 1:
        known = _numel(tuple(s for s in size if s != -1))
        if known <= 0 or _numel(x.shape) % known:
            return None
        size = tuple(_numel(x.shape) // known if s == -1 else s for s in size)
    if any(s <= 0 for s in size) or _numel(size) != _numel(x.shape):
        return None
    if _dense(x):
        return TensorMeta(size, contiguous_strides(size), 0, x.dtype, index)
    if not size or not x.shape:
        return None
    stride = _view_strides(x.shape, x.stride, size)
    if stride is None:
        return None
    return TensorMeta(size, stride, x.offset, x.dtype, index)


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


@rule(aten.slice.Tensor)
def _slice(args: tuple, index: int) -> TensorMeta | None:
    """``x[..., start:end:step]`` (ATen's ``slice``: bounds wrapped once, then clamped); any
    layout. Declines where ATen raises (a 0-dim tensor, a dim out of range, a step below 1)."""
    if not 1 <= len(args) <= 5 or not _plain(args[0]):
        return None
    x = args[0]
    dim, start, end, step = (*args[1:], *(0, None, None, 1)[len(args) - 1:])
    n = len(x.shape)
    d = _dim(dim, n) if n else None
    if d is None or type(step) is not int or step < 1 or \
            any(v is not None and type(v) is not int for v in (start, end)):
        return None
    size = x.shape[d]
    lo = 0 if start is None else start + size if start < 0 else start
    hi = size if end is None else end + size if end < 0 else end
    lo = min(max(lo, 0), size)
    hi = min(max(hi, lo), size)
    shape, stride = list(x.shape), list(x.stride)
    shape[d] = (hi - lo + step - 1) // step
    stride[d] = x.stride[d] * step
    return TensorMeta(tuple(shape), tuple(stride), x.offset + lo * x.stride[d], x.dtype, index)


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


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...], order: Any) -> bool:
    """``Tensor.is_contiguous`` for the dimension ``order`` (fastest first); size-1 dims free."""
    expected = 1
    for d in order:
        if shape[d] != 1:
            if stride[d] != expected:
                return False
            expected *= shape[d]
    return True



def sort_dims(n: int, should_swap: Callable[[int, int], int]) -> list[int]:
    """The logical-to-physical permutation of ``n`` dimensions that TensorIterator and
    ``torch._prims_common.compute_elementwise_output_logical_to_physical_perm`` compute: an
    insertion sort of the dimensions from the last (fastest) by ``should_swap(a, b)`` (> 0: swap,
    < 0: keep and stop, 0: ambiguous, go on), reversed. Shared by the record-time rules and the
    server's vet rules (:mod:`genie.remote.vet_rules`), each with its own comparison."""
    order = list(range(n - 1, -1, -1))
    for i in range(1, n):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(order[d0], order[d1])
            if c > 0:
                order[d0], order[d1] = order[d1], order[d0]
                d1 = d0
            elif c < 0:
                break
    return order[::-1]

def _elementwise_strides(shape: tuple[int, ...], ops: list[TensorMeta]) -> tuple[int, ...] | None:
    """Output strides of an elementwise op over ``ops`` broadcast to ``shape``, as the meta
    kernels PyTorch registers for them compute it (``torch._refs``: operands expanded by
    ``_maybe_broadcast``, then ``torch._prims._prim_elementwise_meta``'s
    ``compute_elementwise_output_logical_to_physical_perm``: contiguous or channels-last
    shortcuts, else an insertion sort of the dimensions by the operands' strides), or None.
    ``shape`` has no zero-size dimension; every operand broadcasts to it (the caller checked)."""
    n = len(shape)
    if n == 0:
        return ()
    if n == 1:
        return (1,)
    ts = []
    for m in ops:
        if m.shape != shape:
            m = _expand((m, list(shape)), m.index)
            if m is None:
                return None
        ts.append(m)
    rev = range(n - 1, -1, -1)
    contiguous = all(_is_contiguous(shape, t.stride, rev) for t in ts)
    channels_last = n == 4 and all(_is_contiguous(shape, t.stride, (1, 3, 2, 0)) for t in ts)
    if contiguous and not channels_last:
        return contiguous_strides(shape)
    if channels_last and not contiguous:
        perm = [0, *range(2, n), 1]
    else:
        def should_swap(a: int, b: int) -> int:
            for t in ts:
                sa, sb = t.stride[a], t.stride[b]
                if sa == 0 or sb == 0:
                    continue
                if sa == sb:
                    if shape[b] >= shape[a]:
                        continue
                    return 1
                return -1 if sb >= sa else 1
            return 0

        perm = sort_dims(n, should_swap)
    out = [0] * n
    acc = 1
    for d in reversed(perm):  # physical order, fastest last: contiguous strides (sizes >= 1)
        out[d] = acc
        acc *= shape[d]
    return tuple(out)


def _pointwise(tensors: list[Any], dtype: torch.dtype, index: int) -> TensorMeta | None:
    """A fresh elementwise output over ``tensors`` (broadcast) of ``dtype``."""
    shape: tuple[int, ...] | None = ()
    for t in tensors:
        if not _plain(t) or t.offset < 0:
            return None
        shape = _broadcast(shape, t.shape)
        if shape is None:
            return None
    if 0 in shape:
        return None
    stride = _elementwise_strides(shape, tensors)
    return None if stride is None else TensorMeta(shape, stride, 0, dtype, index)


def _scalar_dtype(x: TensorMeta, y: Any) -> torch.dtype | None:
    """Result dtype of ``tensor op python scalar`` where no promotion happens, else None."""
    if type(y) is int or type(y) is bool:
        return x.dtype if x.dtype in _ARITH else None
    if type(y) is float:
        return x.dtype if x.dtype in _FLOATS else None
    return None


def _category(dtype: torch.dtype) -> int:
    return 0 if dtype == torch.bool else 2 if dtype.is_floating_point else \
        3 if dtype.is_complex else 1


def _lower_zero_dim(x: TensorMeta, y: TensorMeta) -> bool:
    """Whether ``x op y`` keeps x's dtype though y's differs: y a 0-dim tensor of x's category
    or a lower one, x with dims (a 0-dim tensor promotes only across categories:
    ``input_ids * (~isin(...)).any()``, an int64 mask times a 0-dim bool)."""
    return len(y.shape) == 0 and len(x.shape) > 0 and _plain(y) and \
        _category(y.dtype) <= _category(x.dtype)


def _binary_iter(args: tuple, index: int, compare: bool) -> TensorMeta | None:
    """Two operands of one dtype (or a tensor and a Python scalar of its category), any
    layout. Mixed dtypes (promotion) are left to the meta kernel."""
    if len(args) != 2 or not _plain(args[0]) or args[0].dtype not in _ARITH:
        return None
    x, y = args
    if type(y) is TensorMeta:
        if y.dtype != x.dtype and not _lower_zero_dim(x, y):
            return None
        m = _pointwise([x, y], torch.bool if compare else x.dtype, index)
    else:
        dt = _scalar_dtype(x, y)
        if dt is None:
            return None
        m = _pointwise([x], torch.bool if compare else dt, index)
    return m


@rule(aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor)
def _arith(args: tuple, index: int) -> TensorMeta | None:
    return _binary(args, index, compare=False) or _binary_iter(args, index, compare=False)


@rule(aten.div.Tensor)
def _div(args: tuple, index: int) -> TensorMeta | None:
    """True division: floating operands of one dtype only (integers promote to float)."""
    if len(args) != 2 or not _plain(args[0]) or args[0].dtype not in _FLOATS:
        return None
    return _binary_iter(args, index, compare=False)


@rule(aten.where.self)
def _where(args: tuple, index: int) -> TensorMeta | None:
    """``where(cond, a, b)``: a bool condition, ``a`` and ``b`` of one dtype."""
    if len(args) != 3 or not all(type(a) is TensorMeta for a in args):
        return None
    c, a, b = args
    if c.dtype != torch.bool or a.dtype != b.dtype or a.dtype not in _ARITH:
        return None
    return _pointwise([c, a, b], a.dtype, index)


_UNARY_FLOAT = (aten.tanh.default, aten.exp.default, aten.neg.default, aten.sqrt.default,
                aten.rsqrt.default, aten.sigmoid.default, aten.relu.default)


@rule(*_UNARY_FLOAT)
def _unary(args: tuple, index: int) -> TensorMeta | None:
    if len(args) != 1 or not _plain(args[0]) or args[0].dtype not in _FLOATS:
        return None
    return _pointwise([args[0]], args[0].dtype, index)


@rule(aten.pow.Tensor_Scalar)
def _pow(args: tuple, index: int) -> TensorMeta | None:
    if len(args) != 2 or not _plain(args[0]) or args[0].dtype not in _FLOATS or \
            type(args[1]) not in (int, float):
        return None
    return _pointwise([args[0]], args[0].dtype, index)


@rule(aten._softmax.default, aten._log_softmax.default)
def _softmax(args: tuple, index: int) -> TensorMeta | None:
    """Same shape and dtype, contiguous (dense inputs only; ``half_to_float`` declines)."""
    if len(args) != 3 or not _plain(args[0]) or args[1].__class__ is not int or args[2]:
        return None
    x = args[0]
    if x.dtype not in _FLOATS or not _dense(x) or _dim(args[1], max(len(x.shape), 1)) is None:
        return None
    return TensorMeta(x.shape, x.stride, 0, x.dtype, index)


@rule(aten.mul.Scalar)
def _mul_scalar(args: tuple, index: int) -> TensorMeta | None:
    """``x * number`` spelled with the Scalar overload (SDPA's math path scales q and k with it):
    x's layout as TensorIterator lays it out, no promotion (a number of x's category or
    below)."""
    if len(args) != 2 or not _plain(args[0]) or type(args[1]) is TensorMeta:
        return None
    return _binary_iter(args, index, compare=False)


@rule(aten._safe_softmax.default)
def _safe_softmax(args: tuple, index: int) -> TensorMeta | None:
    """``_safe_softmax(x, dim)`` (SDPA's math path): as ``_softmax`` without ``half_to_float``;
    a ``dtype`` goes to the meta kernel."""
    if not 2 <= len(args) <= 3 or (len(args) == 3 and args[2] is not None):
        return None
    return _softmax((args[0], args[1], False), index)


@rule(aten.tril.default, aten.triu.default)
def _tril(args: tuple, index: int) -> TensorMeta | None:
    """``tril(x, diagonal)``, ``triu`` of a dense row-major x of at least 2 dims (SDPA's causal
    mask): x's shape, strides and dtype. Other layouts go to the meta kernel."""
    if not 1 <= len(args) <= 2 or not _plain(args[0]) or \
            (len(args) == 2 and type(args[1]) is not int):
        return None
    x = args[0]
    if len(x.shape) < 2 or not _dense(x):
        return None
    return TensorMeta(x.shape, x.stride, 0, x.dtype, index)


@rule(aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor, aten.eq.Tensor,
      aten.ne.Tensor, aten.eq.Scalar, aten.ne.Scalar, aten.le.Scalar, aten.lt.Scalar)
def _compare(args: tuple, index: int) -> TensorMeta | None:
    return _binary(args, index, compare=True) or _binary_iter(args, index, compare=True)


# --- cat and the matmul family -----------------------------------------------------------------

def _channels_last_like(m: TensorMeta) -> bool:
    """``suggest_memory_format(m)`` is channels-last (2d or 3d): the strides follow NHWC/NDHWC
    (``torch._prims_common.are_strides_like_channels_last_or_false``)."""
    n = len(m.shape)
    if n not in (4, 5) or m.stride[1] == 0:
        return False
    lo = 0
    for d in ((1, 3, 2, 0) if n == 4 else (1, 4, 3, 2, 0)):
        if m.shape[d] == 0 or m.stride[d] < lo or (d == 0 and lo == m.stride[1]):
            return False
        lo = m.stride[d] * m.shape[d]
    return True


@rule(aten.cat.default)
def _cat(args: tuple, index: int) -> TensorMeta | None:
    """``cat(tensors, dim)`` of one dtype, any layouts, as ``torch._refs.cat`` computes it:
    1-d empty tensors are skipped (the legacy rule: a KV cache's first step), and the output is
    contiguous unless every input is channels-last-like (declined)."""
    if not 1 <= len(args) <= 2 or type(args[0]) not in (list, tuple) or not args[0]:
        return None
    ts = args[0]
    dtype = ts[0].dtype if _plain(ts[0]) else None
    if not all(_plain(t) and t.dtype == dtype for t in ts) or \
            all(_channels_last_like(t) for t in ts):
        return None
    kept = [t for t in ts if t.shape != (0,)]
    if not kept:
        return None
    first = kept[0]
    n = len(first.shape)
    if n == 0:
        return None
    d = _dim(args[1] if len(args) == 2 else 0, n)
    if d is None:
        return None
    total = 0
    for t in kept:
        if len(t.shape) != n or 0 in t.shape or t.shape[:d] != first.shape[:d] or \
                t.shape[d + 1:] != first.shape[d + 1:]:
            return None
        total += t.shape[d]
    shape = first.shape[:d] + (total,) + first.shape[d + 1:]
    return TensorMeta(shape, contiguous_strides(shape), 0, dtype, index)


@rule(aten.mm.default)
def _mm(args: tuple, index: int) -> TensorMeta | None:
    if len(args) != 2 or not (_plain(args[0]) and _plain(args[1])):
        return None
    a, b = args
    if a.dtype != b.dtype or a.dtype not in _FLOATS or len(a.shape) != 2 or len(b.shape) != 2:
        return None
    if a.shape[1] != b.shape[0] or 0 in a.shape or 0 in b.shape:
        return None
    shape = (a.shape[0], b.shape[1])
    return TensorMeta(shape, contiguous_strides(shape), 0, a.dtype, index)


@rule(aten.addmm.default)
def _addmm(args: tuple, index: int) -> TensorMeta | None:
    """``addmm(bias, m1, m2)`` with a bias that broadcasts to the product (no beta/alpha)."""
    if len(args) != 3 or not _plain(args[0]):
        return None
    m = _mm(args[1:], index)
    if m is None or args[0].dtype != m.dtype or len(args[0].shape) > 2 or \
            _broadcast(args[0].shape, m.shape) != m.shape:
        return None
    return m


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


@rule(aten.matmul.default)
def _matmul(args: tuple, index: int) -> TensorMeta | None:
    """``matmul(a, b)`` of one float dtype, any strides (recorded whole: csrc/whole.cpp): the
    shape ``torch.matmul`` documents (1-d operands promoted and their dim removed, batch dims
    broadcast), contiguous, as every branch of its decomposition leaves it (dot, mv, mm, and
    ``_unsafe_view`` of an mm or bmm). Empty operands and mismatched sizes go to the meta
    kernel, which raises eager's error."""
    if len(args) != 2 or not (_plain(args[0]) and _plain(args[1])):
        return None
    a, b = args
    if a.dtype != b.dtype or a.dtype not in _FLOATS or not a.shape or not b.shape or \
            0 in a.shape or 0 in b.shape:
        return None
    sa, sb = a.shape, b.shape
    if sa[-1] != (sb[0] if len(sb) == 1 else sb[-2]):
        return None
    batch = _broadcast(sa[:-2], sb[:-2])
    if batch is None:
        return None
    shape = batch + sa[-2:-1] + sb[-1:] if len(sb) > 1 else batch + sa[-2:-1]
    return TensorMeta(shape, contiguous_strides(shape), 0, a.dtype, index)


@rule(aten.linear.default)
def _linear(args: tuple, index: int) -> TensorMeta | None:
    """``linear(x, w[, b])`` of one float dtype with a 2-d weight and a 1-d bias or none
    (recorded whole: csrc/whole.cpp): ``x``'s leading dims and the weight's output features,
    contiguous (addmm, its flattened 3-d form, or matmul then ``add_``)."""
    if not 2 <= len(args) <= 3 or not (_plain(args[0]) and _plain(args[1])):
        return None
    x, w = args[0], args[1]
    bias = args[2] if len(args) == 3 else None
    if x.dtype != w.dtype or x.dtype not in _FLOATS or not x.shape or len(w.shape) != 2 or \
            0 in x.shape or 0 in w.shape or x.shape[-1] != w.shape[1]:
        return None
    if bias is not None and not (_plain(bias) and bias.dtype == x.dtype and
                                 bias.shape == (w.shape[0],)):
        return None
    shape = x.shape[:-1] + (w.shape[0],)
    return TensorMeta(shape, contiguous_strides(shape), 0, x.dtype, index)


# --- reductions, normalization, indexing (the ops a new prompt length misses on) ---------------

@rule(aten.all.default, aten.any.default)
def _all_any(args: tuple, index: int) -> TensorMeta | None:
    """``all(x)``, ``any(x)``: a 0-dim bool (uint8 inputs keep uint8: declined)."""
    if len(args) != 1 or not _plain(args[0]) or args[0].dtype == torch.uint8:
        return None
    return TensorMeta((), (), 0, torch.bool, index)


_INTEGRAL = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                       torch.int64})


@rule(aten.cumsum.default)
def _cumsum(args: tuple, index: int) -> TensorMeta | None:
    """``cumsum(x, dim)`` of a dense input: its shape, contiguous; integral inputs sum in
    int64 (a ``dtype=`` keyword goes to the meta kernel)."""
    if len(args) != 2 or not _plain(args[0]):
        return None
    x = args[0]
    if not x.shape or not _dense(x) or _dim(args[1], len(x.shape)) is None or \
            not (x.dtype in _INTEGRAL or x.dtype in _FLOATS):
        return None
    dtype = torch.int64 if x.dtype in _INTEGRAL else x.dtype
    return TensorMeta(x.shape, x.stride, 0, dtype, index)


@rule(aten.native_layer_norm.default)
def _layer_norm(args: tuple, index: int) -> tuple[TensorMeta, TensorMeta, TensorMeta] | None:
    """``(out, mean, rstd)``: out contiguous in the input's shape, mean and rstd of the input's
    leading dims with the normalized ones kept as 1 (a dense float32/float64 input, weight and
    bias of its dtype or None)."""
    if len(args) != 5 or not _plain(args[0]):
        return None
    x, norm, w, b, eps = args
    norm = _ints(norm)
    if x.dtype not in (torch.float32, torch.float64) or norm is None or not norm or \
            type(eps) not in (float, int) or not _dense(x) or len(norm) > len(x.shape) or \
            x.shape[len(x.shape) - len(norm):] != norm:
        return None
    for t in (w, b):
        if t is not None and (not _plain(t) or t.dtype != x.dtype or t.shape != norm):
            return None
    stats = x.shape[:len(x.shape) - len(norm)] + (1,) * len(norm)
    st = contiguous_strides(stats)
    return (TensorMeta(x.shape, contiguous_strides(x.shape), 0, x.dtype, index),
            TensorMeta(stats, st, 0, x.dtype, index), TensorMeta(stats, st, 0, x.dtype, index))


@rule(aten.masked_fill.Scalar)
def _masked_fill(args: tuple, index: int) -> TensorMeta | None:
    """``x.masked_fill(mask, number)`` with x and a bool mask of one shape, both dense row-major:
    a new tensor like x (values of x's category or below; any other layout or a broadcast
    mask goes to the meta kernel, whose strides follow size-1 dimensions)."""
    if len(args) != 3 or not _plain(args[0]) or not _plain(args[1]):
        return None
    x, mask, v = args
    if mask.dtype != torch.bool or x.dtype not in _ARITH or type(v) not in (int, float, bool) or \
            (type(v) is float and x.dtype not in _FLOATS) or mask.shape != x.shape or \
            not _dense(x) or not _dense(mask):
        return None
    return TensorMeta(x.shape, x.stride, 0, x.dtype, index)


@rule(aten.embedding.default)
def _embedding(args: tuple, index: int) -> TensorMeta | None:
    """``embedding(weight, ids)``: ``ids.shape + (dim,)``, contiguous, the weight's dtype (the
    other arguments change only the backward)."""
    if not 2 <= len(args) <= 5 or not _plain(args[0]) or not _plain(args[1]):
        return None
    w, ids = args[0], args[1]
    if len(w.shape) != 2 or ids.dtype not in (torch.int64, torch.int32):
        return None
    shape = ids.shape + (w.shape[1],)
    return TensorMeta(shape, contiguous_strides(shape), 0, w.dtype, index)


@rule(aten.split.Tensor)
def _split(args: tuple, index: int) -> list[TensorMeta] | None:
    """``x.split(n, dim)``: views of x, n long along ``dim`` (the last one what is left)."""
    if not 2 <= len(args) <= 3 or not _plain(args[0]) or type(args[1]) is not int:
        return None
    x, n = args[0], args[1]
    d = _dim(args[2] if len(args) == 3 else 0, len(x.shape)) if x.shape else None
    if d is None or n <= 0 or x.shape[d] <= 0:
        return None
    size, step = x.shape[d], x.stride[d]
    out = []
    for start in range(0, size, n):
        shape = x.shape[:d] + (min(n, size - start),) + x.shape[d + 1:]
        out.append(TensorMeta(shape, x.stride, x.offset + start * step, x.dtype, index))
    return out


# --- factories (rules that read keyword arguments) ---------------------------------------------

KwRule = Callable[[tuple, dict, int], TensorMeta | None]
KW_RULES: dict[Any, KwRule] = {}

_ARANGE_DTYPES = (None, torch.int64, torch.int32, torch.float32, torch.float64)


def _factory_index(kwargs: dict, index: int) -> int | None:
    """The output's device index from a factory's keyword arguments (None: decline the call)."""
    if kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory") not in (
            None, False):
        return None
    dev = kwargs.get("device")
    if dev is None:
        return index
    if not isinstance(dev, torch.device) or dev.type != DEVICE_TYPE:
        return None
    return dev.index if dev.index is not None else index


def _arange(args: tuple, kwargs: dict, index: int) -> TensorMeta | None:
    """``arange`` with int bounds (position ids of a decode step: a new ``start`` every step).
    The length is exact integer arithmetic; float bounds, a zero step or bounds inconsistent
    with the step's sign go to the meta kernel (which rounds, or raises eager's error)."""
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    elif len(args) == 2:
        (start, end), step = args, 1
    elif len(args) == 3:
        start, end, step = args
    else:
        return None
    if any(type(v) is not int for v in (start, end, step)) or step == 0 or \
            set(kwargs) - {"dtype", "layout", "device", "pin_memory"}:
        return None
    dtype = kwargs.get("dtype")
    if dtype not in _ARANGE_DTYPES:
        return None
    span = end - start
    if span != 0 and (span > 0) != (step > 0):
        return None
    out = _factory_index(kwargs, index)
    if out is None:
        return None
    n = -(-span // step)  # ceil(span / step): exact for ints
    return TensorMeta((n,), (1,), 0, dtype or torch.int64, out)


for _op in (aten.arange.default, aten.arange.start, aten.arange.start_step):
    KW_RULES[_op] = _arange


def _clone(args: tuple, kwargs: dict, index: int) -> TensorMeta | None:
    """``clone(x, memory_format=...)``: contiguous for ``contiguous_format``; for the default
    (``preserve_format``), x's own layout where it is dense row-major. Others: the meta kernel."""
    if len(args) != 1 or not _plain(args[0]) or set(kwargs) - {"memory_format"}:
        return None
    x, fmt = args[0], kwargs.get("memory_format")
    if fmt is torch.contiguous_format or (fmt in (None, torch.preserve_format) and _dense(x)):
        return TensorMeta(x.shape, contiguous_strides(x.shape), 0, x.dtype, index)
    return None


KW_RULES[aten.clone.default] = _clone


_LIKE_KWARGS = frozenset({"dtype", "layout", "device", "pin_memory", "memory_format"})


def _like(args: tuple, kwargs: dict, index: int) -> TensorMeta | None:
    """``ones_like(x)``, ``zeros_like``, ``empty_like``, ``full_like(x, v)`` of a dense row-major
    x: its shape and strides (``preserve_format`` or ``contiguous_format``), the ``dtype=`` or
    x's dtype."""
    if not 1 <= len(args) <= 2 or not _plain(args[0]) or set(kwargs) - _LIKE_KWARGS:
        return None
    x = args[0]
    dtype = kwargs.get("dtype") or x.dtype
    out = _factory_index(kwargs, x.index)
    if out is None or not _dense(x) or not isinstance(dtype, torch.dtype) or \
            kwargs.get("memory_format") not in (None, torch.preserve_format,
                                                torch.contiguous_format):
        return None
    return TensorMeta(x.shape, x.stride, 0, dtype, out)


for _op in (aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default):
    KW_RULES[_op] = lambda args, kwargs, index: None if len(args) != 1 else \
        _like(args, kwargs, index)
KW_RULES[aten.full_like.default] = lambda args, kwargs, index: None if len(args) != 2 or \
    type(args[1]) not in (int, float, bool) else _like(args, kwargs, index)


_LIKE_LAYOUT: dict[tuple, tuple[int, ...]] = {}  # (shape, stride) -> empty_like's strides


def _flash_attention_for_cpu(args: tuple, kwargs: dict, index: int
                             ) -> tuple[TensorMeta, TensorMeta] | None:
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, ...)`` (SDPA on the CPU,
    csrc/whole.cpp): its meta kernel reads only the query: the output is ``empty_like(q)`` (HF's
    transposed heads keep their layout) and the logsumexp a float (B, Lq, H) transposed to
    (B, H, Lq). The query's layout is asked of ``empty_like`` on meta once per (shape, stride),
    so a decode step's new KV length costs no meta kernel."""
    if not 3 <= len(args) <= 5 or set(kwargs) - {"attn_mask", "scale"} or             not all(_plain(a) for a in args[:3]):
        return None
    q = args[0]
    if len(q.shape) != 4 or q.offset:
        return None
    key = (q.shape, q.stride)
    stride = _LIKE_LAYOUT.get(key)
    if stride is None:
        t = torch.empty_strided(q.shape, q.stride, dtype=torch.float32, device="meta")
        stride = _LIKE_LAYOUT[key] = tuple(torch.empty_like(t).stride())
    b, h, lq, _ = q.shape
    return (TensorMeta(q.shape, stride, 0, q.dtype, index),
            TensorMeta((b, h, lq), (lq * h, 1, h), 0, torch.float32, index))


KW_RULES[aten._scaled_dot_product_flash_attention_for_cpu.default] = _flash_attention_for_cpu


def _empty_strided(args: tuple, kwargs: dict, index: int) -> TensorMeta | None:
    """``empty_strided(size, stride)``: exactly those (non-negative, one per dim), offset 0,
    the ``dtype=`` or the default dtype."""
    if len(args) != 2 or set(kwargs) - {"dtype", "layout", "device", "pin_memory"}:
        return None
    size, stride = _ints(args[0]), _ints(args[1])
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    out = _factory_index(kwargs, index)
    if size is None or stride is None or len(size) != len(stride) or out is None or \
            any(v < 0 for v in size + stride) or not isinstance(dtype, torch.dtype):
        return None
    return TensorMeta(size, stride, 0, dtype, out)


KW_RULES[aten.empty_strided.default] = _empty_strided


def _isin(args: tuple, kwargs: dict, index: int) -> TensorMeta | None:
    """``isin(elements, test_elements)``: a bool tensor of ``elements``' shape. The meta kernel
    lays it out as ``empty_like(elements)``; for ``elements`` contiguous (size-1 dimensions
    free, as ``input_ids[:, -1:]``) that is row-major, as eager's kernel does. Other layouts go
    to the kernel."""
    if len(args) != 2 or set(kwargs) - {"assume_unique", "invert"} or \
            not all(_plain(a) for a in args):
        return None
    x, t = args
    n = len(x.shape)
    if x.dtype not in _ARITH or t.dtype not in _ARITH or not n or 0 in x.shape or \
            not _is_contiguous(x.shape, x.stride, range(n - 1, -1, -1)):
        return None
    return TensorMeta(x.shape, contiguous_strides(x.shape), 0, torch.bool, index)


KW_RULES[aten.isin.Tensor_Tensor] = _isin


_FACTORY_KWARGS = frozenset({"dtype", "layout", "device", "pin_memory"})


def _filled(args: tuple, kwargs: dict, index: int) -> TensorMeta | None:
    """``ones(size)``, ``zeros(size)``: row-major, the ``dtype=`` or the default dtype (the
    causal mask SDPA's math path builds for every new prompt length)."""
    if len(args) != 1 or set(kwargs) - _FACTORY_KWARGS:
        return None
    size = _ints(args[0])
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    out = _factory_index(kwargs, index)
    if size is None or out is None or any(v < 0 for v in size) or \
            not isinstance(dtype, torch.dtype):
        return None
    return TensorMeta(size, contiguous_strides(size), 0, dtype, out)


KW_RULES[aten.ones.default] = KW_RULES[aten.zeros.default] = _filled


def _to_copy(args: tuple, kwargs: dict, index: int) -> TensorMeta | None:
    """``_to_copy(x, dtype=...)`` on x's own device (``.long()``, ``.float()``) of a dense
    row-major x: its shape and strides in the new dtype. Another device, layout or memory
    format goes to the meta kernel."""
    if len(args) != 1 or not _plain(args[0]) or \
            set(kwargs) - {"dtype", "layout", "device", "pin_memory", "non_blocking",
                           "memory_format"} or kwargs.get("non_blocking") not in (None, False) or \
            kwargs.get("memory_format") not in (None, torch.preserve_format):
        return None
    x = args[0]
    dtype = kwargs.get("dtype") or x.dtype
    out = _factory_index(kwargs, x.index)
    if out is None or out != x.index or not _dense(x) or not isinstance(dtype, torch.dtype):
        return None
    return TensorMeta(x.shape, x.stride, 0, dtype, out)


KW_RULES[aten._to_copy.default] = _to_copy
