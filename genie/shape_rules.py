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

The rules of the ops a decode step misses on every step (views, pointwise arithmetic and
compares, ``where``, softmax, ``cat``, the matmul family, ``arange``) and a generate's per-token
misses (``clone``, ``isin``, ``any.dim``, SDPA's CPU flash kernel) are native
(``csrc/shape_rules.cpp``, registered here like the others; one implementation per op): a decode
step's 17 misses paid ~5-16 µs each for the Python rules, well under 1 µs each natively.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _C
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


def _ints(size: Any) -> tuple[int, ...] | None:
    if type(size) not in (list, tuple) or any(type(s) is not int for s in size):
        return None
    return tuple(size)


def _dim(d: Any, ndim: int) -> int | None:
    if type(d) is not int or not -ndim <= d < ndim:
        return None
    return d + ndim if d < 0 else d


# --- native rules (csrc/shape_rules.cpp) -------------------------------------------------------

_C._shape_rules_init(TensorMeta)
rule(aten.view.default, aten._unsafe_view.default)(_C._rule_view)
rule(aten.expand.default)(_C._rule_expand)
rule(aten.unsqueeze.default)(_C._rule_unsqueeze)
rule(aten.transpose.int)(_C._rule_transpose)
rule(aten.slice.Tensor)(_C._rule_slice)
rule(aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor)(_C._rule_arith)
rule(aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor, aten.eq.Tensor,
     aten.ne.Tensor, aten.eq.Scalar, aten.ne.Scalar, aten.le.Scalar, aten.lt.Scalar)(
    _C._rule_compare)
rule(aten.div.Tensor)(_C._rule_true_divide)
rule(aten.mul.Scalar)(_C._rule_mul_scalar)
rule(aten.where.self)(_C._rule_where)
rule(aten.tanh.default, aten.exp.default, aten.neg.default, aten.sqrt.default,
     aten.rsqrt.default, aten.sigmoid.default, aten.relu.default)(_C._rule_unary)
rule(aten.pow.Tensor_Scalar)(_C._rule_pow_scalar)
rule(aten._softmax.default, aten._log_softmax.default)(_C._rule_softmax)
rule(aten._safe_softmax.default)(_C._rule_safe_softmax)
rule(aten.any.dim, aten.all.dim)(_C._rule_any_dim)
rule(aten.cat.default)(_C._rule_cat)
rule(aten.mm.default)(_C._rule_mm)
rule(aten.addmm.default)(_C._rule_addmm)
rule(aten.bmm.default)(_C._rule_bmm)
rule(aten.matmul.default)(_C._rule_matmul)
rule(aten.linear.default)(_C._rule_linear)


# --- Python rules ------------------------------------------------------------------------------

_FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_ARITH = frozenset(_FLOATS | {torch.int64, torch.int32})


def sort_dims(n: int, should_swap: Callable[[int, int], int]) -> list[int]:
    """The logical-to-physical permutation of ``n`` dimensions that TensorIterator and
    ``torch._prims_common.compute_elementwise_output_logical_to_physical_perm`` compute: an
    insertion sort of the dimensions from the last (fastest) by ``should_swap(a, b)`` (> 0: swap,
    < 0: keep and stop, 0: ambiguous, go on), reversed: the server's vet rules
    (:mod:`genie.remote.vet_rules`); the record-time rules' copy is csrc/shape_rules.cpp's
    ``elementwise_strides``."""
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
for _op in (aten.arange.default, aten.arange.start, aten.arange.start_step):
    KW_RULES[_op] = _C._rule_arange  # int bounds (a decode step's position ids), natively
KW_RULES[aten.clone.default] = _C._rule_clone
KW_RULES[aten.isin.Tensor_Tensor] = _C._rule_isin
KW_RULES[aten._scaled_dot_product_flash_attention_for_cpu.default] = \
    _C._rule_flash_attention_for_cpu


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
