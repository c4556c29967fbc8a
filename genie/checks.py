"""Record-time checks that eager does before touching data and torch's meta kernels skip.

Shapes, dtypes and strides of outputs come from meta kernels (:mod:`genie.meta`), and most of
them check what eager checks. Some do not: the meta kernels of ``neg.out`` or ``frexp.out`` accept
an ``out=`` of any dtype, ``add`` takes a float ``alpha`` with integral tensors, ``mm``/``matmul``
/``linear`` multiply float32 by float64, and ``index_put_`` (``a[idx] = v``) checks neither the
index shapes nor the value's. Eager raises for each at the call; recorded lazily, the op would fail
only when it runs. The checks here run on a meta-cache miss (:func:`genie.meta.infer`): a hit has
the same metadata and constants, so it passed them already.

Two kinds:

* **probe**: ops whose checks depend on dtypes and scalar types only (pointwise ops, the matmul
  family): the op runs eagerly on the host on *empty* tensors of the inputs' dtypes and ranks
  (every size 0, so broadcasting never fails and nothing is computed); an exception there is
  eager's own, raised at the call. Verdicts are cached per shape class (dtypes, ranks, scalar
  types) and int constants, so a class pays the probe once. Exceptions saying a kernel is not implemented for a
  dtype on the host are ignored (the real device may be CUDA, whose kernels differ).
* **index_put**: index dtypes, the number of indexed dims, mask shapes, the broadcast of the index
  tensors, the value's broadcast to the indexing result, and the value's dtype, with eager's
  exception types and messages. A boolean mask's count needs its data: where the value could
  mismatch it (not a single element), :func:`genie.lazy_tensor.record` replaces the mask by the
  indices of its true elements (``nonzero``, run at once: a forced materialization, as eager's
  kernel synchronizes there on CUDA), so the check runs on known shapes; a ``uint8`` mask is
  recorded as a ``bool`` one, with eager's deprecation warning, at the call.
"""

from __future__ import annotations

import math
import re
import warnings
import weakref
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import _disable_current_modes

from ._C import _without_warning
from .errors import UnsupportedOpError
from .graph import TensorMeta, meta_tensor
from .modes import disable_modes

aten = torch.ops.aten

_MATMULS = (aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm, aten.mv, aten.addmv,
            aten.dot, aten.vdot, aten.matmul, aten.linear, aten.addr, aten.outer, aten.ger,
            aten.inner, aten.tensordot)
# ``complex``/``polar`` are elementwise without the pointwise tag (complex(out=) of another dtype)
_PROBED = frozenset(op for packet in (*_MATMULS, aten.complex, aten.polar) for op in
                    (getattr(packet, name) for name in packet.overloads()))
#: Reductions whose eager kernels check what their meta kernels do not (at most 64 dims, the
#: ``out=`` dtypes of ``all``/``any``/``mode``, an empty reduced dim of ``max(dim)``, the rank of
#: ``bucketize``'s boundaries): probed on
#: host zeros whose every dim is min(size, 1), not 0 (argmax of an empty tensor raises): a
#: reduction that takes a dim of size n takes one of size 1, and an empty dim stays empty.
_SHRINK_PROBED = frozenset(op for packet in (
    aten.sum, aten.nansum, aten.mean, aten.nanmean, aten.std, aten.var, aten.std_mean,
    aten.var_mean, aten.logsumexp, aten.norm, aten.linalg_vector_norm, aten.argmax, aten.argmin,
    aten.amax, aten.amin, aten.aminmax, aten.max, aten.min, aten.all, aten.any, aten.prod,
    aten.mode, aten.median, aten.nanmedian, aten.searchsorted, aten.bucketize,
    # batch matrix products: eager's CPU kernels compare the operands' dtypes only where the
    # product is not empty, and torch 2.11's meta kernels not at all (bmm(float, double))
    aten.bmm, aten.baddbmm, aten.addbmm)
    for op in (getattr(packet, name) for name in packet.overloads()))
#: Of those, the ones that warn where a reduction has no degrees of freedom (std, var): probed
#: with every dim min(size, 2) instead, where that stays small, and their probe's warning
#: dropped (eager's is :func:`dof_warning`'s, decided on the call's own sizes).
_TWO_PROBED = frozenset(op for packet in (aten.std, aten.var, aten.std_mean, aten.var_mean)
                        for op in (getattr(packet, name) for name in packet.overloads()))
#: What eager's std/var kernels warn where a reduction has no degrees of freedom (the number of
#: elements reduced per output, less the correction, is <= 0): Genie warns it at the call
#: (:func:`dof_warning`), so the same C++ warning of a probe or of the device's kernel is dropped
#: (genie._C._without_warning).
DOF_TEXT = "degrees of freedom is <= 0"
#: Pending nodes whose call warned :data:`DOF_TEXT` (weakly): while one is, a tape runs with that
#: warning of its kernels dropped (genie.executor.run_tape).
DOF_PENDING: list[weakref.ref[Any]] = []
_DOF_MESSAGES: dict[str, str] = {}


def dof_warning(func: Any, leaves: list[Any], spec: Any, out: Any) -> tuple[str, ...]:
    """Eager's warnings for a :data:`_TWO_PROBED` call (``std``, ``var``, ``std_mean``,
    ``var_mean``) whose reduction has no degrees of freedom, word for word, or none: eager's
    condition on metadata (elements reduced per output, 0 where the output is empty, less the
    correction, <= 0), the text from a host call of the same function (it names it, and where
    in ATen it was raised); twice for a complex input (eager reduces its real and imaginary
    parts, each warning). ``out``: the call's first output's :class:`TensorMeta`."""
    args, kwargs = optree.tree_unflatten(spec, leaves)
    self = args[0] if args else kwargs.get("self")
    if type(self) is not TensorMeta or type(out) is not TensorMeta:
        return ()
    n_out = math.prod(out.shape)
    reduced = 0 if n_out == 0 else math.prod(self.shape) // n_out
    correction: Any = 1
    for i, a in enumerate(func._schema.arguments):
        if a.name not in ("correction", "unbiased"):
            continue
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name, None)
        if a.name == "unbiased":
            correction = 1 if v is None or v else 0
        elif v is not None:
            correction = v
    if reduced - correction > 0:
        return ()
    name = func._schema.name.split("::")[-1]
    msg = _DOF_MESSAGES.get(name)
    if msg is None:
        with warnings.catch_warnings(record=True) as w, _disable_current_modes():
            warnings.simplefilter("always")
            getattr(torch, name)(torch.zeros(1))  # a binding: its warning is issued on return
        msg = _DOF_MESSAGES[name] = next(
            (str(x.message) for x in w if DOF_TEXT in str(x.message)),
            f"{name}(): {DOF_TEXT}. Correction should be strictly less than the reduction "
            "factor (input numel divided by output numel).")
    return (msg, msg) if self.dtype.is_complex else (msg,)


def dof_pending() -> bool:
    """Whether a node in :data:`DOF_PENDING` is still pending (the others are dropped)."""
    DOF_PENDING[:] = [w for w in DOF_PENDING if (n := w()) is not None and not n.executed]
    return bool(DOF_PENDING)


DOF_WARNED = _TWO_PROBED  # the ops dof_warning judges


#: Random ops whose checks are of dtypes and scalar arguments only (``random_(from, to)`` in the
#: dtype's range, ``uniform_(from, to)`` with ``from <= to``, ``normal_`` with ``std >= 0``,
#: ``randint`` of a complex dtype): probed like pointwise ops, with a generator of their own where
#: the op takes one, the host's default generator's state restored after, and, for the
#: factories, every size 0 (nothing is drawn).
_RANDOM_PROBED = frozenset(op for packet in (
    aten.random_, aten.random, aten.uniform_, aten.uniform, aten.normal_, aten.cauchy_,
    aten.cauchy, aten.log_normal_, aten.log_normal, aten.exponential_, aten.exponential,
    aten.geometric_, aten.geometric, aten.randint, aten.randint_like, aten.rand, aten.rand_like,
    aten.randn, aten.randn_like, aten.normal, aten.bernoulli_)
    for op in (getattr(packet, name) for name in packet.overloads()))
# ATen's dispatch macros' "kernel not compiled for this dtype": "max_all" not implemented for
# 'ComplexFloat'. The host's kernels are not the device's (CUDA has others): never eager's verdict
# for the device. A check's own message ("maximum not implemented for complex tensors") is.
_NO_KERNEL_FOR_DTYPE = re.compile(r"\"[^\"]+\" not implemented for '")
INDEX_PUT = frozenset(op for packet in (aten.index_put_, aten.index_put, aten._index_put_impl_,
                                        aten._unsafe_index_put)
                      for op in (getattr(packet, name) for name in packet.overloads()))

INDEX = frozenset(op for packet in (aten.index, aten._unsafe_index)
                  for op in (getattr(packet, name) for name in packet.overloads()))

_verdicts: dict[tuple[int, tuple], tuple[Any, BaseException | None]] = {}

RANDPERM = frozenset(getattr(aten.randperm, name) for name in aten.randperm.overloads())
#: the largest n eager's randperm takes for a dtype (its check, before it allocates)
_RANDPERM_BOUND = {torch.float16: 2 ** 11 + 1, torch.float32: 2 ** 24 + 1,
                   torch.float64: 2 ** 53 + 1, torch.uint8: 2 ** 8, torch.int8: 2 ** 7,
                   torch.int16: 2 ** 15}


class Refused(UnsupportedOpError):
    """A call whose result Genie cannot represent (a sparse or quantized tensor): refused at the
    call, never run on the device instead (``genie.lazy_tensor.record`` re-raises it)."""


_SPARSE = "sparse tensors are not supported on remote_accelerator; keep them on the CPU or call " \
    ".to_dense() first"
_QUANTIZED = "quantized tensors are not supported on remote_accelerator; keep them on the CPU, " \
    "or dequantize() them before moving them to the device"


QUANTIZED = frozenset({torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def refuse_kind(func: Any, kind: str) -> Refused:
    """The refusal of ``func`` making a ``kind`` ("sparse", "quantized") tensor on the device."""
    return Refused(func, _QUANTIZED if kind == "quantized" else _SPARSE)


def refusal(func: Any, t: torch.Tensor) -> Refused:
    """The refusal of ``func`` returning ``t``, a tensor of a kind the device does not hold."""
    if t.is_quantized:
        return refuse_kind(func, "quantized")
    if t.layout != torch.strided and t.layout != torch.jagged and t.layout != torch._mkldnn:
        return refuse_kind(func, "sparse")
    return Refused(func, f"it returns a {t.layout} tensor; remote_accelerator tensors are dense "
                   "and strided only: keep it on the CPU")


class MaskNeedsData(Exception):  # noqa: N818 - a signal, not an error the user sees
    """``index_put`` with a boolean or uint8 mask that :func:`genie.lazy_tensor.record` must
    rewrite first (see the module docstring); inference declines the call."""


def probed(func: Any) -> bool:
    """Whether :func:`probe` checks ``func`` (decided once per overload)."""
    try:
        return func._genie_probed
    except AttributeError:
        pass
    tags = func.tags  # random ops are not probed: a host run must not touch the host's generator
    p = func in _RANDOM_PROBED or func in _SHRINK_PROBED or (
        (func in _PROBED or torch.Tag.pointwise in tags or _pointwise_inplace(func)) and
        torch.Tag.nondeterministic_seeded not in tags)
    try:
        func._genie_probed = p
    except AttributeError:
        pass
    return p


def _pointwise_inplace(func: Any) -> bool:
    """An in-place op whose functional form is pointwise (``heaviside_``: the in-place forms do
    not all carry the tag their functional forms do)."""
    name = func._schema.name.split("::")[-1]
    if not _in_place(func) or name.endswith("__"):
        return False
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    functional = getattr(packet, func._overloadname, None) if packet is not None else None
    return functional is not None and torch.Tag.pointwise in functional.tags


def checked(func: Any) -> bool:
    """Whether :func:`check` has checks for ``func`` (cached on the op as ``_genie_checked``)."""
    c = func in INDEX_PUT or func in INDEX or func in RANDPERM or probed(func)
    try:
        func._genie_checked = c
    except AttributeError:
        pass
    return c


def check(func: Any, leaves: list[Any], spec: Any, klass: Any) -> None:
    """The checks of ``func`` for a call with meta leaves ``leaves`` (raises eager's error)."""
    if func in INDEX_PUT:
        check_index_put(func, leaves, spec)
    elif func in INDEX:
        args, kwargs = optree.tree_unflatten(spec, leaves)
        self = args[0]
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        if type(self) is TensorMeta and indices is not None:
            _into_empty_dims(self, indices)
    elif func in RANDPERM:
        check_randperm(func, leaves, spec)
    elif probed(func):
        if _in_place(func):
            check_in_place_broadcast(func, leaves, spec)
        probe(func, leaves, spec, klass)


def _in_place(func: Any) -> bool:
    """Whether ``func`` writes its first argument in place (``pow_``; not an ``out=`` form), by
    schema, not by ``torch.Tag.inplace`` (a tag torch 2.11 does not have)."""
    try:
        return func._genie_in_place
    except AttributeError:
        pass
    args = func._schema.arguments
    r = bool(func._schema.name.endswith("_") and args and args[0].alias_info is not None and
             args[0].alias_info.is_write)
    try:
        func._genie_in_place = r
    except AttributeError:
        pass
    return r


def check_in_place_broadcast(func: Any, leaves: list[Any], spec: Any) -> None:
    """An in-place elementwise op whose inputs broadcast to more than ``self``'s shape: eager's
    ``output with shape [2, 1] doesn't match the broadcast shape [2, 2]`` at the call (the meta
    kernels of ``pow_``, ``atan2_``, ``clamp_``, the comparisons' ``eq_``... resize instead).
    Eager's verdict comes from the op run on host zeros of the same broadcasting (every size
    above 1 mapped to a small one, equal sizes to equal ones): only its shape error is taken
    (the text made of the real shapes); any other error is left to the usual paths."""
    args = optree.tree_unflatten(spec, leaves)[0]
    self = args[0] if args else None
    if type(self) is not TensorMeta:
        return
    shapes = [tuple(x.shape) for x in leaves if type(x) is TensorMeta]
    try:
        b = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return  # the meta kernel's error
    if b == tuple(self.shape):
        return
    small = {n: i + 2 for i, n in enumerate(sorted({n for sh in shapes for n in sh if n > 1}))}
    if math.prod(small.get(n, n) for n in b) > 4096:
        return
    try:
        with disable_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
            hargs, hkwargs = optree.tree_unflatten(spec, [
                torch.zeros([small.get(n, n) for n in x.shape], dtype=x.dtype)
                if type(x) is TensorMeta else x for x in leaves])
            func(*hargs, **hkwargs)
    except Exception as e:  # noqa: BLE001 - eager's verdict is what we are after
        if "doesn't match the broadcast shape" in str(e):
            raise RuntimeError(f"output with shape {_shape(self.shape)} doesn't match the "
                               f"broadcast shape {_shape(b)}") from None


#: ``normal`` with a std tensor: eager checks its elements (``std.min() >= 0``, read with a sync
#: on every device, CUDA's included): :func:`check_normal_std` at the call, as eager.
NORMAL_STD = frozenset(getattr(aten.normal, n) for n in (
    "Tensor_Tensor", "Tensor_Tensor_out", "float_Tensor", "float_Tensor_out"))


def check_normal_std(args: tuple, kwargs: dict) -> None:
    """Eager's ``normal expects all elements of std >= 0.0`` (NaN fails it too), from the
    device's values of std: a forced materialization, as eager's sync."""
    std = args[1] if len(args) > 1 else kwargs.get("std")
    if not isinstance(std, torch.Tensor) or std.numel() == 0 or std.is_complex():
        return  # (complex: the meta kernel's own check, without data)
    if not bool(std.min().ge(0)):
        raise RuntimeError("normal expects all elements of std >= 0.0")


def check_randperm(func: Any, leaves: list[Any], spec: Any) -> None:
    """``randperm(n)`` into a dtype whose exact integers stop below ``n - 1`` (half beyond 2049,
    uint8 beyond 256): eager's error, from eager's own check on an empty host tensor of that
    dtype. Only then: the check comes before eager's kernel allocates n elements, and a call it
    accepts would allocate them (randperm of 2^53 doubles), so the probe runs only past the
    dtype's bound (each float's 2^digits + 1, each integer's maximum + 1)."""
    args, kwargs = optree.tree_unflatten(spec, leaves)
    n = args[0] if args else kwargs.get("n")
    out = kwargs.get("out")
    dtype = out.dtype if out is not None else kwargs.get("dtype") or torch.int64
    if type(n) is not int or dtype == torch.bool:
        return
    bound = _RANDPERM_BOUND.get(dtype)
    if bound is None:  # int32/int64: beyond any n a device holds; bfloat16: eager checks none
        return
    if n <= bound:
        return
    try:
        torch.randperm(n, out=torch.empty(0, dtype=dtype), generator=torch.Generator())
    except Exception as e:  # noqa: BLE001 - eager's verdict
        raise type(e)(*e.args).with_traceback(None) from None


def _empty(x: Any) -> Any:
    """A probe's host tensor for ``x``: every dim empty. A 0-dim tensor holds one element: one,
    a value no check refuses (not uninitialized memory: a 0-dim std of ``normal`` read as
    negative, a 0-dim integer divisor as zero, made the verdict a matter of chance)."""
    if type(x) is TensorMeta or isinstance(x, torch.Tensor):
        if len(x.shape) == 0:
            try:
                return torch.ones((), dtype=x.dtype)
            except RuntimeError:  # a dtype without fill_ (bits8): no value to read either
                return torch.empty((), dtype=x.dtype)
        return torch.empty((0,) * len(x.shape), dtype=x.dtype)
    if isinstance(x, torch.device):
        return torch.device("cpu")
    if isinstance(x, torch.Generator):
        return None
    return x


class _NotProbed(Exception):  # noqa: N818 - a signal inside probe()
    """A call too large to probe (:func:`_shrunk_leaves`)."""


def _small(x: Any, most: int = 1) -> Any:
    """Host zeros of ``x``'s dtype, every dim min(size, most) (:data:`_SHRINK_PROBED`)."""
    if type(x) is TensorMeta or isinstance(x, torch.Tensor):
        return torch.zeros([min(s, most) for s in x.shape], dtype=x.dtype)
    return _empty(x)


def _shrunk_leaves(func: Any, leaves: list[Any]) -> list[Any] | None:
    """The probe's leaves of a :data:`_SHRINK_PROBED` call, or None where those of a
    :data:`_TWO_PROBED` op would hold more than 4096 elements (not probed)."""
    if func not in _TWO_PROBED:
        return [_small(x) for x in leaves]
    for x in leaves:
        if type(x) is TensorMeta and math.prod(min(s, 2) for s in x.shape) > 4096:
            return None
    return [_small(x, 2) for x in leaves]


def probe(func: Any, leaves: list[Any], spec: Any, klass: Any) -> None:
    """Run ``func`` on empty host tensors of the leaves' dtypes and ranks; raise what it raises.
    (What it warns reaches the user where the call returns, as eager's warning.)"""
    # by the class's identity (hashing the class tuple hashes the op: Python code) and the int
    # constants' values, which the class holds by type only (pow(x, -1) raises, pow(x, 2) not);
    # the value holds the class, so its id is not reused while the verdict lives. A random op's
    # float arguments are checked by value (uniform_(2, 1) raises, uniform_(1, 2) not).
    random = func in _RANDOM_PROBED
    shrink = func in _SHRINK_PROBED
    key = (id(klass), tuple(x for x in leaves if type(x) is int or type(x) is bool or
                            (random and type(x) is float)))
    if shrink:  # which dims are empty decides too (a class may hold sizes by rank)
        key += (tuple(tuple(s == 0 for s in x.shape) for x in leaves if type(x) is TensorMeta),)
    got = _verdicts.get(key)
    if got is not None and got[0] is klass:
        err = got[1]
    else:
        err = None
        try:
            # the probe's own host tensors too are made outside any dispatch mode (a
            # genie.capture() block around the call would record them as the program's)
            with disable_modes():
                small = _shrunk_leaves(func, leaves) if shrink else None
                if shrink and small is None:
                    raise _NotProbed
                args, kwargs = optree.tree_unflatten(
                    spec, small if shrink else [_empty(x) for x in leaves])
                if random:
                    args, kwargs = _private_rng(func, list(args), dict(kwargs))
            state = torch.get_rng_state() if random else None
            try:
                with disable_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
                    if func in _TWO_PROBED:  # its degrees-of-freedom warning: dof_warning's
                        _without_warning(DOF_TEXT, lambda: func(*args, **kwargs))
                    else:
                        func(*args, **kwargs)  # (the host's autocast is no part of the call)
            finally:
                if state is not None:
                    torch.set_rng_state(state)
        except _NotProbed:
            pass
        except NotImplementedError as e:
            if random:  # (below)
                err = e
        except Exception as e:  # noqa: BLE001 - eager's verdict is what we are after
            # (the random kernels cover the same dtypes on every device: rand of an integer
            # dtype is refused everywhere)
            if random or not _NO_KERNEL_FOR_DTYPE.search(str(e)):
                err = e
        if len(_verdicts) >= 1 << 16:
            _verdicts.clear()
        _verdicts[key] = (klass, err)
    if err is not None:
        raise type(err)(*err.args).with_traceback(None) from None


#: ``random_`` into a floating tensor warns, on every call, where its bounds exceed the dtype's
#: exact integers ("to - 1 is out of bounds [-(2^24), 2^24] ..."): eager's kernel warns, also on
#: an empty tensor, and a C++ warning reaches Python only where the user's call returns, so the
#: probe cannot keep it with its verdict: a call whose verdict is cached runs the probe again.
WARNS_EVERY_CALL = frozenset(getattr(p, n) for p in (aten.random_, aten.random)
                             for n in p.overloads())


def warn_again(func: Any, leaves: list[Any], spec: Any) -> None:
    """The probe of a :data:`WARNS_EVERY_CALL` call of a floating tensor run again, uncached,
    for its warnings (its verdict, cached, stands)."""
    if not any(type(x) is TensorMeta and x.dtype.is_floating_point for x in leaves[:1]):
        return
    args, kwargs = optree.tree_unflatten(spec, [_empty(x) for x in leaves])
    args, kwargs = _private_rng(func, list(args), dict(kwargs))
    try:
        with disable_modes(), torch.no_grad():
            func(*args, **kwargs)
    except Exception:  # noqa: BLE001, S110 - raised (once) by the cached verdict's probe
        pass


def _private_rng(func: Any, args: list[Any], kwargs: dict[str, Any]) -> tuple[list, dict]:
    """A random op's probe call with a generator of its own and, for a factory, every size 0."""
    for i, a in enumerate(func._schema.arguments):
        target: Any = (args, i) if i < len(args) else (kwargs, a.name)
        if a.name == "generator":
            if i < len(args):
                args[i] = torch.Generator()
            else:
                kwargs["generator"] = torch.Generator()
        elif a.name == "size" and (i < len(args) or a.name in kwargs):
            c, k = target
            c[k] = [0] * len(c[k])
    return args, kwargs


_INDEX_DTYPES = (torch.long, torch.int, torch.uint8, torch.bool)


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, s)) + "]"


def trivial_value(v: Any) -> bool:
    """A value that broadcasts to any indexing result of a mask (one element, rank <= 1)."""
    return not isinstance(v, (TensorMeta, torch.Tensor)) or \
        (len(v.shape) <= 1 and all(s == 1 for s in v.shape))


def _into_empty_dims(self: TensorMeta, indices: Any) -> None:
    """An integer index tensor with elements into a dimension of size 0: every element is out
    of range, which eager's kernel reports as an IndexError before reading any index."""
    dims = 0
    for ix in indices:
        if ix is None:
            dims += 1
            continue
        if ix.dtype in (torch.uint8, torch.bool):
            dims += len(ix.shape)
            continue
        n = 1
        for s in ix.shape:
            n *= s
        if dims < len(self.shape) and self.shape[dims] == 0 and n > 0:
            raise IndexError("index is out of bounds for dimension with size 0")
        dims += 1


def check_known_indices(func: Any, args: tuple, kwargs: dict, host: Any) -> bool:
    """Eager's bounds check of advanced indexing (``index``, ``index_put``) at the call, for
    index tensors whose values the host holds (``host(ix)``: the values, or None where they are
    computed on the device): ``a[[10]]``, ``a[torch.tensor([10]).to(D)]``. Raises eager's
    ``IndexError`` with eager's text: the first out-of-range element in the order eager's kernel
    reads them (row-major over the broadcast indices, then index tensor by index tensor; the
    "dimension" eager names is the index tensor's position among the defined ones, a mask
    counting one per dim). Nothing is checked where the indexing result is empty (eager's kernel
    reads no index) or where the metadata is wrong (the meta kernels raise eager's error).

    Returns whether an integer index is computed on the device: its check stays deferred to the
    kernel, as on CUDA (the caller records the line, so the deferred error names it)."""
    self = args[0]
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    if not isinstance(self, torch.Tensor) or not isinstance(indices, (list, tuple)):
        return False
    if not any(isinstance(ix, torch.Tensor) and ix.dtype not in (torch.bool, torch.uint8)
               for ix in indices):
        return False  # masks alone: their true elements are in range by their shapes
    shape = tuple(self.shape)
    parts: list[tuple[torch.Tensor, int | None]] = []  # (values, size); a mask's: None
    rest, pos, deferred = 1, 0, False
    for ix in indices:
        if ix is None:
            rest *= shape[pos] if pos < len(shape) else 1
            pos += 1
            continue
        if not isinstance(ix, torch.Tensor):
            return deferred
        h = host(ix)
        if ix.dtype in (torch.bool, torch.uint8):
            if h is None:  # a mask on the device: its true elements are in range by its shape
                return deferred
            if pos + ix.dim() > len(shape) or any(
                    s != shape[pos + j] for j, s in enumerate(ix.shape)):
                return deferred  # eager's mask-shape error (its host code's, on every device)
            parts.extend((c, None) for c in h.nonzero().unbind(1))  # in range: not judged
            pos += ix.dim()
            continue
        if ix.is_floating_point() or ix.is_complex():
            return deferred  # eager's dtype error: the meta kernel's
        if h is None:
            deferred = True
        elif pos < len(shape):
            parts.append((h, shape[pos]))
        pos += 1
    if deferred or all(n is None for _, n in parts) or pos > len(shape):
        return deferred
    for s in shape[pos:]:
        rest *= s
    try:
        ts = torch.broadcast_tensors(*(t for t, _ in parts))
    except RuntimeError:
        return False  # eager's shape-mismatch error: the meta kernel's
    if rest == 0 or ts[0].numel() == 0:
        return False
    sizes = [n for _, n in parts]
    bad = torch.stack([torch.zeros_like(t, dtype=torch.bool) if n is None else (t < -n) | (t >= n)
                       for t, n in zip(ts, sizes, strict=True)], -1).reshape(-1)
    first = bad.nonzero()
    if first.numel():
        e, j = divmod(int(first[0, 0]), len(parts))
        v = int(ts[j].reshape(-1)[e])
        raise IndexError(f"index {v} is out of bounds for dimension {j} with size {sizes[j]}")
    return False


def check_index_put(func: Any, leaves: list[Any], spec: Any) -> None:
    """eager's metadata checks of ``index_put(self, indices, values, accumulate)``."""
    args, kwargs = optree.tree_unflatten(spec, leaves)
    self = args[0]
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    values = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if type(self) is not TensorMeta or indices is None or not isinstance(values, (TensorMeta,
                                                                                   torch.Tensor)):
        return
    rank = len(self.shape)
    dims = 0
    masks = False
    for ix in indices:
        if ix is None:
            dims += 1
            continue
        if ix.dtype not in _INDEX_DTYPES:
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        if ix.dtype in (torch.uint8, torch.bool):
            for j, s in enumerate(ix.shape):
                if dims + j < rank and s != self.shape[dims + j]:
                    raise IndexError(
                        f"The shape of the mask {_shape(ix.shape)} at index {j} does not match "
                        f"the shape of the indexed tensor {_shape(self.shape)} at index {dims + j}")
            masks = True
            if ix.dtype == torch.uint8 or not trivial_value(values):
                raise MaskNeedsData()
            dims += len(ix.shape)
        else:
            dims += 1
    if dims > rank:
        raise IndexError(f"too many indices for tensor of dimension {rank} (got {dims})")
    if not masks:
        tensors = [ix for ix in indices if ix is not None]
        if tensors:
            try:
                torch.broadcast_shapes(*(tuple(t.shape) for t in tensors))
            except RuntimeError:
                raise IndexError("shape mismatch: indexing tensors could not be broadcast together "
                                 "with shapes " + ", ".join(_shape(t.shape) for t in tensors)
                                 ) from None
            _into_empty_dims(self, indices)
            meta = [None if ix is None else (meta_tensor(ix) if type(ix) is TensorMeta
                                             else ix.to("meta")) for ix in indices]
            result = tuple(aten.index.Tensor(meta_tensor(self), meta).shape)
        elif accumulate:
            result = tuple(self.shape)
        else:
            result = None
        if result is not None:
            v = tuple(values.shape)
            if len(v) > len(result) or any(a != b and a != 1
                                           for a, b in zip(v[::-1], result[::-1])):
                raise RuntimeError(f"shape mismatch: value tensor of shape {_shape(v)} cannot be "
                                   f"broadcast to indexing result of shape {_shape(result)}")
    if values.dtype != self.dtype:  # eager's message, from the host kernel on empty tensors
        try:
            torch.empty(0, dtype=self.dtype).index_put_(
                (torch.empty(0, dtype=torch.long),), torch.empty(0, dtype=values.dtype),
                bool(accumulate))
        except RuntimeError as e:
            raise RuntimeError(str(e)) from None
