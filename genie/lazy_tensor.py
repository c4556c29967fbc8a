"""LazyTensor: a storage-less tensor on ``remote_accelerator`` whose ops are recorded, not run.

``LazyTensor`` is a ``torch.Tensor`` wrapper subclass. Autograd, ``nn.Module`` and optimizers work
above it unchanged; every ATen op that reaches it lands in :func:`record` through
``__torch_dispatch__`` and becomes one :class:`~genie.graph.Node`. Output metadata comes from
:mod:`genie.meta` (cached), so recording never touches data.

Hot path (every op pays it): policy lookup, one ``optree`` flatten, one cache key, one ``Node``,
one wrapper per output. Everything else (meta inference on a miss, materialization) is cold. The
common case of that path runs in C++ (``csrc/record.cpp``, ``LazyTensor.__torch_dispatch__``);
the Python functions here are its reference and take every other call.

What forces a value to exist (the "triggers", see docs/semantics.md): copying to another device
(``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``.numpy()``), ops tagged ``data_dependent_output``
(``.item()``, ``bool()``, ``torch.equal``) and ``dynamic_output_shape`` (``nonzero``,
``masked_select``), printing, ``torch.save`` and :func:`genie.materialize`.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import sys
import threading
import weakref
from typing import Any

import optree
import torch
import torch.autograd.profiler as _profiler
from torch.utils.dlpack import DLDeviceType

from . import _C, checks, context, device, executor, storages
from .config import config
from .device import DEVICE_TYPE, real_device
from .errors import UnsupportedOpError
from .executor import real_dispatch
from .graph import (DEFAULT_GRAPH, Graph, MetaArg, Node, Ref, Storage, TensorMeta,
                    _record_counter, defer_writer, pending_total, retrack_below, share,
                    track, untrack_node)
from .graph import current as graph_current
from .meta import (MetaEntry, WarnedEntry, disable_modes, eager_error, infer, meta_cache,
                   meta_tensor, policy, static_shape)
from .profiling import phase
from .shape_rules import KW_RULES, RULES
from .stats import _counts, _syncs, bump

_compile_id = torch._guards.CompileContext.current_compile_id  # not None inside a Dynamo compile

_state_word = _C._state_word
_note_reads = _C._note_reads

aten = torch.ops.aten

_devices: dict[int, torch.device] = {}


def device_of(index: int) -> torch.device:
    d = _devices.get(index)
    if d is None:
        d = _devices[index] = torch.device(DEVICE_TYPE, index)
    return d


class _TLS(threading.local):
    def __init__(self) -> None:
        self.graphs: list[Graph] = []


_tls = _TLS()

#: Set by genie.dlpack: ``alias_import(x)`` is the LazyTensor view that ``x``, a plain tensor
#: on the device made by PyTorch's DLPack import of a LazyTensor, aliases; ``_note_export(t)``
#: notes a LazyTensor about to be exported.
alias_import: Any = None
_note_export: Any = None


def current_graph() -> Graph:
    """The graph new nodes go to: the innermost ``genie.capture()`` block's, else the default."""
    g = _tls.graphs
    return g[-1] if g else DEFAULT_GRAPH


_TENSOR_DATA = torch.Tensor.data


class LazyTensor(torch.Tensor):
    """A tensor on ``remote_accelerator:N``: metadata now, values on demand.

    ``_node``/``_out`` name the recorded value this tensor holds; its data exists only after
    materialization, on the real device, in ``_node.values[_out]``.
    """

    _node: Node
    _out: int

    __torch_function__ = torch._C._disabled_torch_function_impl

    def backward(self, gradient: Any = None, retain_graph: bool | None = None,
                 create_graph: bool = False, inputs: Any = None) -> None:
        """``torch.Tensor.backward``, with the autograd engine running on the calling thread.

        The engine runs the backward of a device that is not the CPU on a worker thread of its
        own, and the caller waits: each step hands the whole backward to another thread and
        back (in an MLP 4 x Linear(256) step 370 µs on this thread against 520-640 on the
        engine's, docs/benchmarks.md). ``torch._lazy``'s device runs there too. With
        ``config.caller_backward`` (``GENIE_CALLER_BACKWARD``, default on), this runs it as the
        engine runs CPU tensors' backward: on this thread (``set_multithreading_enabled(False)``),
        with the recording context the engine's thread would have (no module, the backward
        region). Not under a ``TorchDispatchMode`` (``genie.capture()`` labels what other
        threads record), and not for ``torch.autograd.backward``/``grad`` called directly.
        """
        if not config.caller_backward or torch._C._len_torch_dispatch_stack():
            return super().backward(gradient, retain_graph, create_graph, inputs)
        prev = graph_current.ctx
        graph_current.ctx = None  # as on the engine's thread: outside any module
        try:
            with torch.autograd.set_multithreading_enabled(False):
                return super().backward(gradient, retain_graph, create_graph, inputs)
        finally:
            graph_current.ctx = prev

    @staticmethod
    def __new__(cls, node: Node, out: int, meta: TensorMeta,
                base: LazyTensor | None = None) -> LazyTensor:
        r = _wrapper(cls, meta, base)
        r._node = node
        r._out = out
        track(r, node, out)
        return r

    # nn.Module.to() swaps the converted value into the existing Parameter object
    # (torch.utils.swap_tensors) when the value is a traceable wrapper subclass, instead of making
    # a new Parameter per module: tied weights stay tied (GPT-2's lm_head and wte) and optimizers
    # built before .to() keep their parameters, as .to("cuda") does with `param.data = ...`.
    # swap_tensors raises where eager would not (the old parameter has weak references or is
    # held by a live autograd graph; capture graphs keep a weak reference to every tensor for
    # genie.export), so the protocol shows only on the upload of a CPU parameter (the swap's
    # other side is known) and only where the swap will succeed; elsewhere Module.to() makes new
    # Parameter objects, as it does without the protocol.
    @property
    def __tensor_flatten__(self):  # noqa: ANN204
        old = self.__dict__.get("_swap_src")  # the CPU parameter Module.to() would swap
        if old is None or weakref.getweakrefcount(self) or weakref.getweakrefcount(old) or \
                old._use_count() > 1:
            raise AttributeError("__tensor_flatten__")
        return self._flatten

    def _flatten(self) -> tuple[list[str], Any]:
        return [], self  # no inner tensors: the value lives in the graph

    @staticmethod
    def __tensor_unflatten__(inner: Any, ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        return aten.alias.default(ctx)

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: Any,
                                            expected_type: Any = None) -> LazyTensor | None:
        # torch.compile traces a LazyTensor as a plain device tensor (genie.dynamo); the
        # gradients AOTAutograd's backward receives are LazyTensors standing for plain tensors
        if expected_metadata is None and expected_type in (None, torch.Tensor):
            return self
        return None

    # `param.data = new` (nn.Module.half()/.double()/.to(dtype) on device parameters) replaces the
    # TensorImpl's metadata in C++; the wrapper must follow it to the new value's node, or it
    # would report the new dtype while its recorded value (and every op on it) keeps the old one.
    @property
    def data(self) -> torch.Tensor:
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        if type(new) is not LazyTensor:
            raise RuntimeError(
                f"cannot set .data of a {self.device} tensor to a tensor on {new.device}; "
                f"move the new value to {self.device} first (new.to('{self.device}')).")
        _TENSOR_DATA.__set__(self, new)
        self._node, self._out = new._node, new._out
        share(self, new)

    def __format__(self, format_spec: str) -> str:
        # as torch.Tensor.__format__: a 0-dim tensor formats as its Python number (f"{loss:.4f}")
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    @property
    def _meta(self) -> TensorMeta:
        return self._node.metas[self._out]

    @property
    def _storage(self) -> Storage:
        return self._node.storage(self._out)

    # Replaced by the native record path at import (csrc/record.cpp, see _install_native_record),
    # which calls _dispatch for every op it does not handle itself.
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        return _dispatch(func, args, kwargs)

    # --- materialization triggers that Tensor does not route through an ATen op -----------------
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002
        if _compile_id() is not None:
            # Dynamo building its guards (torch 2.11's ID_MATCH puts a repr of the guarded value
            # in a hint): what the tensor is, without running the program for its values
            return (f"tensor(..., size={tuple(self.shape)}, dtype={self.dtype}, "
                    f"device='{self.device}')")
        real = materialize_one(self, "repr")
        body = repr(real.detach().cpu())
        suffix = f", device='{self.device}'"
        return body[:-1] + suffix + body[-1:] if body.endswith(")") else body + suffix

    def __deepcopy__(self, memo: dict) -> LazyTensor:
        """torch.Tensor.__deepcopy__'s way for a tensor whose bytes are not on this host (a lazy
        or storage-less device's): a ``clone()``, recorded here, so the copy holds the value of
        this point of the program whatever is written to the original later; then the grad and
        the subclass's attributes deep-copied (a Parameter: a new Parameter of the clone, as
        ``Parameter.__deepcopy__`` makes, without them). torch's own would deep-copy the whole instance
        dict over the clone's, Genie's record of the original (its node and what it reads)
        included: the copy then stood for the original's pending writes, and a later write to
        the original, read in one materialization with the copy, showed through it."""
        if id(self) in memo:
            return memo[id(self)]
        if self.__dict__.get("_is_param"):  # a Parameter on the device: Parameter.__deepcopy__'s
            new = torch.nn.Parameter(self.data.clone(memory_format=torch.preserve_format),
                                     self.requires_grad)
            memo[id(self)] = new
            return new
        if not self.is_leaf:
            return super().__deepcopy__(memo)  # eager's error
        with torch.no_grad():
            new = self.clone()
        if self.requires_grad:
            new.requires_grad_()
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        own = new.__dict__  # the clone's own attributes (its record is its impl's or in here)
        state = {k: v for k, v in self.__dict__.items() if k not in own and k not in _RECORD}
        if state:  # hooks, the user's attributes
            own.update(copy.deepcopy(state, memo))
        memo[id(self)] = new
        return new

    def is_set_to(self, tensor: torch.Tensor) -> bool:
        """As eager's: the same storage, offset, sizes and strides; decided from the wrappers'
        storages (csrc/storage.cpp), never from the values (a server's are copies)."""
        if not isinstance(tensor, torch.Tensor):
            return super().is_set_to(tensor)  # eager's TypeError
        return (torch.Tensor.untyped_storage(self)._cdata ==
                torch.Tensor.untyped_storage(tensor)._cdata
                and self.storage_offset() == tensor.storage_offset()
                and self.shape == tensor.shape and self.stride() == tensor.stride())

    def untyped_storage(self) -> torch.UntypedStorage:
        """The tensor's storage: eager's size, a fake address, no bytes (genie.storages);
        ``set_`` onto it records a view of this tensor's value."""
        s = super().untyped_storage()
        storages.note_owner(s, self)
        return s

    def numpy(self, *, force: bool = False):  # noqa: ANN201
        """Materialize and return a NumPy array (a copy on the host); as eager, a tensor that
        requires grad needs ``force=True`` or ``detach()`` first."""
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. "
                               "Use tensor.detach().numpy() instead.")
        return self.detach().cpu().numpy(force=force)

    def __bool__(self) -> bool:
        # A value computed already (``all(t)`` iterates t's unbind, whose first element's run
        # computed every element): read it without recording an ``item`` and planning a run.
        node = self._node
        if node.executed and node.values is not None and \
                not node.storage(self._out).pending_writes:
            real = node.values[self._out]
            if _plain(real):
                _counts["forced_materializations"] += 1
                return bool(real)
        return super().__bool__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        """torch's capsule (device ``kDLExtDev``, the fake address), the tensor noted so that
        PyTorch's import of it is an alias of this tensor (genie.dlpack)."""
        if _note_export is not None:
            _note_export(self)
        return super().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return (DLDeviceType.kDLExtDev, self.device.index or 0)

    def tolist(self):  # noqa: ANN201
        """Materialize and return nested Python lists (as ``torch.Tensor.tolist``)."""
        return self.detach().cpu().tolist()

    def __reduce_ex__(self, proto: int):  # noqa: ANN204
        # torch.save: store the value as a CPU tensor and rebuild it on this device at load time.
        cpu = self.detach().cpu()
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (cpu, self.dtype, str(self.device), self.requires_grad))


_RECORD = ("_node", "_out", "_alive")

# A wrapper's record (`_node`, `_out`): data descriptors that read the tensor's impl for the native
# record path's wrappers (no instance dict, no token: the impl is counted by its node's output),
# the instance dict for the others, which also holds their liveness token `_alive`
# (csrc/wrapper.cpp, graph.track).
_C._install_wrapper_fields(LazyTensor)


# --- materialization ------------------------------------------------------------------------

def materialize(*tensors: Any, trigger: str = "explicit") -> Any:
    """Compute the given LazyTensors in one execution and return their real device values.

    Only the nodes the values depend on run; each runs at most once; values that live tensors
    hold stay on the device for later use.

    Example:
        >>> import torch, genie
        >>> x = torch.ones(2, device="remote_accelerator")
        >>> a, b = genie.materialize(x + 1, x * 3)
        >>> a.tolist(), b.tolist()
        ([2.0, 2.0], [3.0, 3.0])
    """
    if not tensors:
        raise TypeError("genie.materialize() needs at least one tensor")
    for t in tensors:
        if not isinstance(t, LazyTensor):
            raise TypeError(f"genie.materialize() takes remote_accelerator tensors, got "
                            f"{type(t).__name__}" + (f" on {t.device}" if isinstance(
                                t, torch.Tensor) else ""))
    _counts["materializations"] += 1
    _counts[_TRIGGER_KEYS.get(trigger) or _trigger_key(trigger)] += 1
    if len(tensors) == 1:  # the common case (.item(), .cpu(), print): one device, one target
        t = tensors[0]
        return executor.run_targets([(t._node, t._out)], t._node.metas[t._out].index)[0]
    by_device: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t._node.metas[t._out].index, []).append(i)
    results: list[Any] = [None] * len(tensors)
    for index, positions in by_device.items():
        targets = [(tensors[i]._node, tensors[i]._out) for i in positions]
        for i, v in zip(positions, executor.run_targets(targets, index)):
            results[i] = v
    return results[0] if len(tensors) == 1 else tuple(results)


_TRIGGER_KEYS: dict[str, str] = {}


def _trigger_key(trigger: str) -> str:
    k = _TRIGGER_KEYS[trigger] = f"materializations.{trigger}"
    return k


def materialize_one(t: Any, trigger: str) -> torch.Tensor:
    return materialize(t, trigger=trigger)


# --- recording --------------------------------------------------------------------------------

def _dispatch(func: Any, args: tuple, kwargs: dict | None) -> Any:
    """The Python record path of ``LazyTensor.__torch_dispatch__`` (the reference)."""
    if func in _LIFTS:
        lifted = _lift_under_modes(args, kwargs)
        if lifted is not None:
            return lifted
    if _profiler._is_profiler_enabled:  # a genie.record range, only under torch.profiler
        with _profiler.record_function("genie.record"):
            return record(func, args, kwargs or {})
    return record(func, args, kwargs or {})


_copy = aten.copy_.default
_to_copy = aten._to_copy.default
_item = aten._local_scalar_dense.default
_detach = aten.detach.default
_UPLOAD = "genie.upload"


def _where() -> str | None:
    f = sys._getframe(3)
    while f is not None:
        fn = f.f_code.co_filename
        if ("/torch/" not in fn and "/genie/" not in fn) or "/tests/" in fn:
            return f"{fn}:{f.f_lineno}"
        f = f.f_back
    return None


def _same_device(leaves: list[Any], index: int, func: Any) -> None:
    for x in leaves:
        if isinstance(x, LazyTensor) and x._node.metas[x._out].index != index:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{DEVICE_TYPE}:{index} and {x.device}! (in {func}). Move one with .to().")


def record(func: Any, args: tuple, kwargs: dict) -> Any:
    """Record one ATen call on LazyTensors and return LazyTensor outputs (never computes)."""
    if func is _item and len(args) == 1 and not kwargs and type(args[0]) is LazyTensor:
        return _item_now(args[0])  # .item(), bool(), int(): what _run_now does for it
    if func is _detach and len(args) == 1 and not kwargs and type(args[0]) is LazyTensor:
        d = _detach_alias(args[0])
        if d is not None:
            return d
    pol = policy(func)
    if pol.implicit:  # inference mode skips the autograd keys that decompose these
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    leaves, spec = _flatten(args, kwargs)
    index = -1
    real_inputs = False
    for x in leaves:
        if type(x) is LazyTensor:
            i = x._node.metas[x._out].index
            if index < 0:
                index = i
            elif i != index and func is not _copy:
                _same_device(leaves, index, func)
        elif isinstance(x, torch.Tensor):
            real_inputs = True
    if real_inputs or func is _to_copy or func is _copy:
        if alias_import is not None and any(
                type(x) is not LazyTensor and isinstance(x, torch.Tensor)
                and x.device.type == DEVICE_TYPE for x in leaves):
            # a DLPack import of a LazyTensor: its alias (genie.dlpack)
            return record(func, *optree.tree_unflatten(spec, [
                alias_import(x) if type(x) is not LazyTensor and isinstance(x, torch.Tensor)
                and x.device.type == DEVICE_TYPE else x for x in leaves]))
        special = _transfer(func, args, kwargs, leaves, index)
        if special is not _NOT_HANDLED:
            return special
    where = False
    if func in checks.INDEX or func in checks.INDEX_PUT:
        # before a data-dependent run too (a mask's index): the kernel must never see a host-known
        # index out of range (on CUDA a device-side assert, not eager's IndexError)
        where = _check_indices(func, pol, args, kwargs, leaves, spec, index)
    if pol.dynamic and not static_shape(func, pol, _meta_leaves(leaves), spec, index):
        return _run_now(func, args, kwargs, leaves, spec, index)
    if pol.inplace_view:
        return _record_inplace_view(func, pol, args, kwargs, leaves, spec, index)
    if pol.random and func in checks.NORMAL_STD:  # a check of std's values, as eager's (a sync)
        checks.check_normal_std(args, kwargs)
    if pol.portable is not None:  # a CUDA-only kernel: record its decomposition (genie.portable)
        out = pol.portable(*args, **kwargs)
        if out is not NotImplemented:  # NotImplemented: this call's dtypes have a kernel
            return out
    try:
        return _record(func, pol, args, kwargs, leaves, spec, index, current_graph(), where=where)
    except checks.MaskNeedsData:  # index_put with a mask: see genie.checks
        return record(func, *_index_put_masks(args, kwargs))
    except UnsupportedOpError as e:
        if pol.writes or any(r is not None for r in pol.returns) or type(e) is checks.Refused:
            raise  # a mutation or a view must be recorded to keep aliasing: cannot run it now
        # No meta kernel (geqrf, histogram, *_backward of some losses): run it now on the device,
        # a forced materialization, rather than refuse an op that eager runs.
        return _run_now(func, args, kwargs, leaves, spec, index, trigger="no_meta_kernel")
    except Exception as e:
        eager = eager_error(func, _meta_leaves(leaves), spec, e)
        if eager is e:
            raise
        raise eager from None


def _check_indices(func: Any, pol: Any, args: tuple, kwargs: dict, leaves: list[Any], spec: Any,
                   index: int) -> bool:
    """Advanced indexing's bounds check at the call where the host holds the indices' values
    (:func:`genie.checks.check_known_indices`; eager's metadata errors first, as eager checks
    them first). Returns whether an index is computed on the device: its out-of-range error
    stays deferred to the kernel, as on CUDA, and its node keeps the line that recorded it, so
    the deferred ``IndexError`` names that line."""
    try:
        return checks.check_known_indices(func, args, kwargs, _host_value)
    except IndexError:
        try:  # a metadata error of the call is eager's first: _record raises it
            infer(func, pol, _meta_leaves(leaves), spec, index)
        except UnsupportedOpError:
            pass  # no meta kernel for a mask's data-dependent shape (the check saw its shapes)
        except Exception:
            return False
        raise


def _host_value(x: torch.Tensor) -> torch.Tensor | None:
    """The values of ``x`` if the host knows them now (no sync, no transfer), else None: a host
    tensor; a LazyTensor that is a pending upload's snapshot (``a[[10]]``, ``t.to(D)``; through
    ``lift_fresh``) with no write after it; or a small pending value made on the device from
    constants (``torch.ones(20, dtype=torch.long, device=D)``, then ``ind[-1] = 10``), evaluated
    on the host (:func:`genie.executor.host_value`). Alike for every backend: an executed value
    is not read, even where the backend keeps it on the host."""
    if type(x) is not LazyTensor:
        return x if x.device.type == "cpu" else None
    n, o = x._node, x._out
    while True:
        if n.executed:
            return None  # (an executed value is the device's, even where it is a host tensor)
        if n.storage(o).pending_writes:
            break
        if n.op is _UPLOAD:
            return n.leaf(0) if n.n_leaves else None
        if n.op not in _LIFTS or not n.n_leaves or type(ref := n.leaf(0)) is not Ref:
            break
        n, o = ref.node, ref.out  # a list index: an upload, then lift_fresh
    return executor.host_value(x._node, x._out)


_LIFTS = (aten.lift_fresh.default, aten.lift_fresh_copy.default)


def _lift_under_modes(args: tuple, kwargs: dict | None) -> Any:
    """``lift_fresh`` of a fresh upload that a dispatch mode declined, or None.
    ``torch.tensor(data, device="remote_accelerator")`` builds its value on the device with the
    Python key and the modes excluded (Genie records an upload of ``data``) and then lifts it
    where the modes see it; a mode that does not know a tensor subclass (``FakeTensorMode`` in
    Dynamo's fake run, the functionalization and proxy modes AOTAutograd traces with) declines
    the LazyTensor, and the LazyTensor it got back mixed with their values: the trace failed on
    the next op. As the modes see the same call on CUDA (a host constant lifted, then on the
    device): the upload's host value lifted, then copied to the device, under the modes."""
    if not _dispatch_modes() or len(args) != 1 or kwargs or type(args[0]) is not LazyTensor:
        return None
    t = args[0]
    node = t._node
    if node.op != _UPLOAD or node.executed or t._out != 0:
        return None
    return _to_copy(aten.lift_fresh_copy.default(node.leaves[0]), device=t.device)


_dispatch_modes = torch._C._len_torch_dispatch_stack


def _index_put_masks(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``index_put(self, indices, values, ...)`` with its uint8 masks as bool ones (eager's
    deprecation warning emitted) and, where ``values`` could mismatch a mask's count, each mask
    as the indices of its true elements (``nonzero``: run now, as eager's kernel does), so that
    :func:`genie.checks.check_index_put` sees known shapes (genie.checks)."""
    args = list(args)
    where = 1 if len(args) > 1 else None
    indices = args[1] if where is not None else kwargs["indices"]
    values = args[2] if len(args) > 2 else kwargs.get("values")
    new: list[Any] = []
    for ix in indices:
        if isinstance(ix, torch.Tensor) and ix.dtype in (torch.uint8, torch.bool):
            if ix.dtype == torch.uint8:
                _warn_at_user(_uint8_warning())
                ix = aten._to_copy.default(ix, dtype=torch.bool)
            if not checks.trivial_value(values):
                new.extend(aten.unbind.int(aten.nonzero.default(ix), 1))
                continue
        new.append(ix)
    if where is not None:
        args[1] = new
    else:
        kwargs = {**kwargs, "indices": new}
    return tuple(args), kwargs


def _uint8_warning() -> str:
    """Eager's uint8-mask deprecation warning, word for word (taken from a host kernel once)."""
    global _UINT8_WARNING
    if _UINT8_WARNING is None:
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.zeros(1)[torch.zeros(1, dtype=torch.uint8)]
        _UINT8_WARNING = next((str(x.message) for x in w if "uint8" in str(x.message)),
                              "indexing with dtype torch.uint8 is now deprecated, please use a "
                              "dtype torch.bool instead.")
    return _UINT8_WARNING


_UINT8_WARNING: str | None = None


def _warn_at_user(msg: str) -> None:
    """A UserWarning attributed to the first frame outside genie and torch (where eager's
    C++ warning would point: the user's call)."""
    import warnings
    f = sys._getframe(1)
    while f is not None and (f.f_globals.get("__name__", "").startswith(("genie.", "torch.")) or
                             f.f_globals.get("__name__") in ("genie", "torch")):
        f = f.f_back
    if f is None:
        warnings.warn(msg, UserWarning, stacklevel=2)
        return
    registry = f.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(msg, UserWarning, f.f_code.co_filename, f.f_lineno,
                           f.f_globals.get("__name__"), registry)


def _meta_leaves(leaves: list[Any]) -> list[Any]:
    """``leaves`` with each LazyTensor replaced by its metadata (what :mod:`genie.meta` takes)."""
    return [x._node.metas[x._out] if isinstance(x, LazyTensor) else x for x in leaves]


_FLAT_TYPES = frozenset({int, float, bool, type(None), torch.dtype})
_flat_specs: dict[Any, Any] = {}


def _flatten(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """``optree.tree_flatten((args, kwargs))``, with a fast path for the common call shapes.

    Most ops get only tensors and scalars positionally (``mul(x, 2.0)``, ``addmm(b, x, w)``):
    their leaves are the args themselves and the spec depends only on how many there are. Views
    and reshapes add one list of ints (``view(x, [1, 12, 64])``): its elements are leaves, and
    the spec depends on the list's length and position too. Specs are cached by that signature.
    """
    if not kwargs:
        sig: Any = len(args)
        leaves = None
        for i, a in enumerate(args):
            ta = type(a)
            if ta is LazyTensor or ta in _FLAT_TYPES:
                continue
            if (ta is list or ta is tuple) and sig.__class__ is int and \
                    all(type(e) is int for e in a):
                sig = (sig, i, ta, len(a))
                leaves = [*args[:i], *a, *args[i + 1:]]
                continue
            break
        else:
            spec = _flat_specs.get(sig)
            if spec is None:
                spec = _flat_specs[sig] = optree.tree_flatten((args, {}), none_is_leaf=True)[1]
            return (list(args) if leaves is None else leaves), spec
    return optree.tree_flatten((args, kwargs), none_is_leaf=True)


def record_known(func: Any, args: tuple, rec: list[Any], entry: MetaEntry) -> Any:
    """Record ``func(*args)`` over LazyTensors with its meta-cache entry and its recorded leaves
    already known (no flattening, no key): for a caller whose guards fix the inputs' metadata, a
    call of a compiled graph (genie.dynamo), whose key over many inputs would cost more than the
    rest of the record.

    ``rec`` is what :func:`_record` would record for ``args``: the leaves of ``_flatten(args,
    {})`` with each LazyTensor as its :class:`Ref`. ``entry`` must be one this op's calls with the
    same input metadata got from :func:`record`. Only for ops that draw no random numbers and
    whose writes are their schema's alone (``genie::graph``, ``genie::graph_mut``): no resize
    of an ``out=`` argument, no in-place view.
    """
    return _record(func, policy(func), args, {}, rec, entry.spec, -1, current_graph(), entry)


def _record(func: Any, pol: Any, args: tuple, kwargs: dict, leaves: list[Any], spec: Any,
            index: int, graph: Graph, known: MetaEntry | None = None, where: bool = False) -> Any:
    _counts["ops_recorded"] += 1
    # One pass over the leaves builds both the cache key and the recorded arguments (entry_for
    # builds the same key; test_native_record's native_cold mode compares the entries found).
    # The global state word (default dtype, deterministic flags: csrc/state.cpp) is in the key.
    # record_known: the leaves are the recorded ones already, no key to build
    key_parts: list[Any] = [pol.key, spec, _state_word()] if known is None else []
    rec: list[Any] = [] if known is None else leaves
    for x in (leaves if known is None else ()):
        t = type(x)
        if t is LazyTensor:
            n = x._node
            o = x._out
            key_parts.append(n.metas[o])
            rec.append(Ref(n, o))
        elif t is float:
            key_parts.append(t)
            if pol.float_values_matter:
                key_parts.append(x)
            rec.append(x)
        elif t is int or t is bool:
            key_parts.append(t)
            key_parts.append(x)
            rec.append(x)
        elif isinstance(x, torch.Tensor):
            key_parts.append(("T", x.device.type, tuple(x.shape), x.stride(), x.dtype))
            rec.append(x.detach().clone())  # a host constant: snapshot it, as eager reads it now
        elif isinstance(x, torch.Generator):
            key_parts.append(torch.Generator)
            rec.append(None)  # random ops carry (seed, offset) instead; see _draw_rng
        else:
            key_parts.append(t)
            key_parts.append(x)
            rec.append(x)
    entry = _entry(func, pol, key_parts, leaves, spec, index)[0] if known is None else known
    metas = entry.metas
    out_spec = entry.out_spec
    plan = entry.plan
    # the cached spec equals this call's: nodes share one spec object instead of keeping their own
    spec = entry.spec

    if pol.metadata_only and type(rec[0]) is Ref:
        rec[0] = MetaArg(metas_of(rec[0]))

    writes: tuple[Storage, ...] = ()
    if pol.writes:
        ws = []
        for pos in (pol.writes if pol.write_flag < 0 else pol.call_writes(args, kwargs)):
            a = pol.arg(pos, args, kwargs)
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, LazyTensor):
                    ws.append(t._node.storage(t._out))
        writes = tuple(ws)

    storages: list[Storage | None] = [None] * len(metas)
    results: list[Any] = list(entry.consts)
    fresh: list[int] = []
    bases: dict[int, LazyTensor] = {}  # a view's wrapper shares its base's storage
    for k, kind, pos in plan:
        if kind is None:
            storages[k] = Storage()
            fresh.append(k)
            continue
        src = pol.arg(pos, args, kwargs)
        if isinstance(src, (list, tuple)):
            src = src[k] if kind == "write" else src[0]
        storages[k] = src._node.storage(src._out)
        if kind == "write":
            if metas[k].shape != src._node.metas[src._out].shape and \
                    func._schema.arguments[pos].is_out:
                # an out= argument of the wrong size: eager resizes it first (resize_output)
                aten.resize_.default(src, metas[k].shape)
                return record(func, args, kwargs)
            results[k] = src  # in-place and out=: the op returns its mutated argument itself
        else:
            fresh.append(k)
            bases[k] = src
    # drawn once the call is sure to be recorded (an out= resized above records it again)
    rng = _draw_rng(leaves, index) if pol.random else None

    # A writer (or capture node) may close a cycle: what it reaches goes back under the
    # collector now, or, for a writer of the default graph, if it stays pending (defer_writer).
    deferred = bool(writes) and config.gc_untrack and config.gc_defer_writes \
        and not graph.keep_nodes
    untracked = config.gc_untrack and (not writes or deferred) and not graph.keep_nodes
    if not untracked and config.gc_untrack:
        retrack_below(rec)
    node = Node(func, rec, spec, metas, out_spec, storages, writes, graph, rng)
    node.entry = entry  # interned per meta-cache key: the plan cache compares nodes by identity
    if type(entry) is WarnedEntry:  # eager's warning of this call (std with no degrees of freedom)
        for msg in entry.warnings:
            _warn_at_user(msg)
        checks.DOF_PENDING.append(node._wref)  # its kernel's own is dropped (executor.run_tape)
    if where or config.record_source or graph.keep_nodes:
        node.where = _where()
    wref = node._wref
    # record_known (a compiled graph call: one Ref per graph input) notes its reads natively
    for x in (rec if known is None or not _note_reads(rec, wref) else ()):
        if type(x) is Ref:
            xn = x.node
            if not xn.executed:  # consumers only decide what a run of xn keeps
                xn.n_consumers += 1
            s = xn.storage(x.out)  # Storage.add_reader, inlined (once per lazy input)
            readers = s.readers
            if type(readers) is tuple:  # the shared empty tuple until a first reader
                readers = s.readers = list(readers)
                if not gc.is_tracked(s):
                    _C._gc_untrack(readers)
            readers.append(wref)
            if len(readers) >= s._prune_at:
                s.prune_grown()
    if writes:
        for s in writes:
            s.add_writer(node, deferred)
        pending_total[0] += len(writes)
        if deferred:
            defer_writer(wref)
    for k in fresh:
        results[k] = LazyTensor(node, k, metas[k], bases.get(k))
    if untracked:
        untrack_node(node, rec)
    if len(results) == 1 and plan_single(out_spec):
        return results[0]
    return optree.tree_unflatten(out_spec, results)


def _entry(func: Any, pol: Any, key_parts: list[Any], leaves: list[Any], spec: Any,
           index: int) -> tuple[MetaEntry, bool]:
    """The meta-cache entry of a call with key ``key_parts`` (inferred and cached on a miss,
    counted as a hit or a miss), and whether the cache holds it."""
    entry = None
    key: Any = None
    if config.meta_cache:
        try:
            key = tuple(key_parts)
            entry = meta_cache.get(key)
        except TypeError:  # an unhashable argument: no caching for this call
            key = None
    if entry is None:
        entry = infer(func, pol, _meta_leaves(leaves), spec, index)
        if key is not None:
            meta_cache.put(key, entry)
    else:
        _counts["meta_cache_hits"] += 1
        if pol.random and func in checks.WARNS_EVERY_CALL:
            checks.warn_again(func, _meta_leaves(leaves), spec)
    return entry, key is not None


_MISS_COUNTERS = ("meta_cache_misses", "shape_rule_hits")


def entry_for(func: Any, args: tuple, kwargs: dict | None) -> tuple[MetaEntry, list[Any]] | None:
    """What :func:`_record` does for a call up to having its meta-cache entry, recording nothing:
    the entry and the flat leaves it was found for (the native record path's miss: it records
    the node itself, after checking the leaves are its own flattening of the call).

    Only for calls :func:`record` takes straight to :func:`_record` (the native path checks the
    op's policy and the argument types first). Counts the meta-cache hit or miss as ``_record``
    does, but not the op (the caller records it, or falls back to :func:`record`, which counts
    it). None, with nothing counted, where the entry is not cacheable or its inference raises:
    :func:`record` then raises eager's error as usual.

    Example:
        >>> import torch, genie
        >>> from genie.lazy_tensor import entry_for
        >>> x = torch.ones(2, 3, device="remote_accelerator")
        >>> entry, leaves = entry_for(torch.ops.aten.view.default, (x, [3, 2]), None)
        >>> entry.metas[0].shape, leaves[1:]
        ((3, 2), [3, 2])
    """
    pol = policy(func)
    leaves, spec = _flatten(args, kwargs or {})
    key_parts: list[Any] = [pol.key, spec, _state_word()]
    index = -1
    for x in leaves:  # the key as _record builds it, for the leaf types the native path takes
        t = type(x)
        if t is LazyTensor:
            m = x._node.metas[x._out]
            key_parts.append(m)
            if index < 0:
                index = m.index
        elif t is float:
            key_parts.append(t)
            if pol.float_values_matter:
                key_parts.append(x)
        elif t is int or t is bool or not isinstance(x, (torch.Tensor, torch.Generator)):
            key_parts.append(t)
            key_parts.append(x)
        else:
            return None  # host tensors and generators: record() handles them
    if index < 0:  # a factory: its device, as record_factory passes it (the native path's
        dev = (kwargs or {}).get("device")  # factories always name one, index included)
        if isinstance(dev, torch.device) and dev.index is not None:
            index = dev.index
    before = [_counts.get(k, 0) for k in _MISS_COUNTERS]
    try:
        entry, cached = _entry(func, pol, key_parts, leaves, spec, index)
    except Exception:  # noqa: BLE001 - record() raises eager's error for it, and counts it
        cached = False
    if not cached:  # record() infers again: its miss is the one counted
        for k, v in zip(_MISS_COUNTERS, before):
            if v:
                _counts[k] = v
            else:
                _counts.pop(k, None)
        return None
    return entry, leaves


# Inplace-view ops that change *storage* (not just the view's metadata): not a re-view of the
# same storage, so they cannot be recorded as one.
_STORAGE_CHANGING = frozenset(
    getattr(p, o) for p in (aten.set_,) for o in p.overloads())


def _record_inplace_view(func: Any, pol: Any, args: tuple, kwargs: dict, leaves: list[Any],
                         spec: Any, index: int) -> Any:
    """``x.t_()``, ``x.unsqueeze_(0)``: x becomes a new view of its own storage.

    Recorded as one node whose output is a view of x's old value (the executor applies the op to
    a fresh alias, so no other tensor's real value changes shape); x is rebound to that output,
    and the wrapper's own sizes/strides are updated by running the op's meta kernel on it, as
    ``torch.utils._python_dispatch.return_and_correct_aliasing`` does for wrapper subclasses.
    """
    target = pol.arg(pol.writes[0], args, kwargs)
    if func in _STORAGE_CHANGING:
        # set_: target becomes the value eager's set_ makes it a view of (genie.storages)
        return _rebind(target, storages.set_value(func, args, kwargs))
    view_pol = dataclasses.replace(pol, writes=(), returns=(("view", pol.writes[0]),))
    fresh = _record(func, view_pol, args, kwargs, leaves, spec, index, current_graph())
    node = fresh._node
    target._node, target._out = node, 0
    track(target, node, 0)
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            if func in _RESIZE:
                # resize_ may need more storage than the wrapper's (data-less) one has, and its
                # meta kernel wants a meta tensor: grow the storage (every view of it sees the new
                # address, as eager's reallocation) and take a wrapper's metadata on it.
                m = node.metas[0]
                w = torch.Tensor._make_wrapper_subclass(
                    LazyTensor, m.shape, strides=m.stride, storage_offset=m.offset,
                    dtype=m.dtype, device=target.device)
                _C._grow_storage(target, w.untyped_storage().nbytes())
                _C._set_storage(w, target)
                torch.Tensor.set_(target, w)
            else:
                func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    return target


def _rebind(target: LazyTensor, v: LazyTensor) -> LazyTensor:
    """``target`` becomes ``v`` (its node, metadata and storage), as ``set_`` makes it."""
    from torch.utils._mode_utils import no_dispatch

    target._node, target._out = v._node, v._out
    share(target, v)
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            torch.Tensor.set_(target, v)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    return target


# resize_/resize_as_ are recorded as a re-view of their argument's storage (see
# _record_inplace_view): the executor resizes a fresh alias of the real value, which grows the
# shared real storage as eager does, so every view keeps seeing the same bytes.
_RESIZE = frozenset(getattr(p, o) for p in (aten.resize_, aten.resize_as_) for o in p.overloads())


_LEAF_SPEC = optree.tree_structure(0, none_is_leaf=True)


def plan_single(out_spec: Any) -> bool:
    return out_spec == _LEAF_SPEC


def metas_of(ref: Ref) -> TensorMeta:
    return ref.node.metas[ref.out]


def _draw_rng(leaves: list[Any], index: int) -> tuple[int, int]:
    """Take (seed, offset) from the op's generator (or the device's default) and advance it."""
    gen = next((x for x in leaves if isinstance(x, torch.Generator)), None)
    if gen is None or gen.device.type != DEVICE_TYPE:
        if gen is not None:
            raise RuntimeError(f"Expected a '{DEVICE_TYPE}' generator device but found "
                               f"'{gen.device.type}'")
        gen = device.default_generator(max(index, 0))
    seed, off = gen.initial_seed(), gen.get_offset()
    gen.set_offset(off + 1)
    return seed, off


# --- factories (called from the PrivateUse1 kernels in genie.factories) ----------------------

def record_factory(func: Any, args: tuple, kwargs: dict) -> Any:
    """Record a factory call (``randn(..., device="remote_accelerator")``) as one node.

    The reference of the native factory path (``genie._C._record_factory``, csrc/record.cpp),
    which the PrivateUse1 kernels call first: it records the common case (a device with its
    index, a meta-cache entry, outside ``genie.capture()``) node for node as this function does
    and calls it for everything else (``GENIE_NATIVE_RECORD=0``: every call)."""
    dev = kwargs.get("device")
    index = dev.index if isinstance(dev, torch.device) and dev.index is not None else \
        device.current_device()
    device.check_index(index)
    if dev is None or dev.index is None:
        kwargs = {**kwargs, "device": device_of(index)}
    bump("factories_recorded")
    if not context._active:
        context.activate()  # module/optimizer hooks: meaning on the default path
    leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
    return _record(func, policy(func), args, kwargs, leaves, spec, index, current_graph())


# --- transfers between the host and the device --------------------------------------------------

_NOT_HANDLED = object()


def _transfer(func: Any, args: tuple, kwargs: dict, leaves: list[Any], index: int) -> Any:
    """Device <-> host copies: uploads are recorded, downloads materialize."""
    if func is _to_copy:
        dev = kwargs.get("device")
        if isinstance(dev, torch.device) and dev.type != DEVICE_TYPE:
            real = materialize_one(args[0], "cpu" if dev.type == "cpu" else "to")
            if dev.type == "cpu" and _own_download(real, kwargs):
                return real  # already the fresh host tensor eager's copy would be
            with real_dispatch(), phase("transfer"):
                return func(real, *args[1:], **kwargs)
        return _NOT_HANDLED
    if func is _copy:
        dst, src = args[0], args[1]
        if not isinstance(dst, LazyTensor):  # host_tensor.copy_(lazy): a download
            real = materialize_one(src, "cpu")
            with real_dispatch(), phase("transfer"):
                return func(dst, real, *args[2:], **kwargs)
        if isinstance(src, LazyTensor):
            return _NOT_HANDLED
        return _upload_into(dst, src, kwargs.get("non_blocking", False))
    return _NOT_HANDLED


#: A backend's way to send a host tensor now instead of snapshotting it (set by the remote
#: backend while connected): ``upload_now(src, meta, graph)`` returns the device value ``src``
#: has now (the transfer done: later writes to ``src`` cannot reach it), or None to record the
#: upload as usual. Saves the host copy of a large upload.
upload_now: Any = None


def _own_download(real: torch.Tensor, kwargs: dict) -> bool:
    """Whether ``real`` is a download of its own (marked ``_genie_own`` by the remote client,
    once) that a device-to-host ``_to_copy`` with ``kwargs`` would only copy again."""
    if not real.__dict__.pop("_genie_own", False):
        return False
    return all(k in ("device", "non_blocking") or v is None or
               (k == "dtype" and v == real.dtype) or (k == "layout" and v == torch.strided) or
               (k == "memory_format" and v == torch.preserve_format) or
               (k == "pin_memory" and not v) for k, v in kwargs.items())


def upload(src: torch.Tensor, index: int, like: TensorMeta | None = None) -> LazyTensor:
    """Record an upload node holding a snapshot of the host tensor ``src`` (one node); or, when
    :data:`upload_now` sends it at once, an executed upload node holding the device value."""
    if not context._active:
        context.activate()  # module/optimizer hooks: meaning on the default path
    meta = like or TensorMeta.of(src, index)
    graph = current_graph()
    value = upload_now(src, meta, graph) if upload_now is not None else None
    if value is not None:
        node = Node(_UPLOAD, [], None, [meta], None, [Storage()], (), graph)
        node.values, node.executed, node.leaves = [value], True, None
        bump("uploads")
        return LazyTensor(node, 0, meta)
    snap = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype)
    snap.copy_(src)
    node = Node(_UPLOAD, [snap], None, [meta], None, [Storage()], (), graph)
    bump("uploads")
    return LazyTensor(node, 0, meta)


def _upload_into(dst: LazyTensor, src: torch.Tensor, non_blocking: bool) -> LazyTensor:
    dmeta = dst._node.metas[dst._out]
    if src.device.type != "cpu":
        raise RuntimeError(f"copy_ into {dst.device} from {src.device} is not supported; copy "
                           "from a CPU tensor or from another remote_accelerator tensor.")
    # broadcasting/dtype errors exactly as eager: check on meta
    meta_tensor(dmeta).copy_(src.to("meta"))
    node = dst._node
    fresh_empty = (not node.executed and node.op in _EMPTY_FACTORIES and not node.n_consumers
                   and not node.storage(dst._out).pending_writes
                   and tuple(src.shape) == dmeta.shape and dmeta.offset == 0)
    up = upload(src.expand(dmeta.shape) if tuple(src.shape) != dmeta.shape else src,
                dmeta.index, like=dmeta)
    if isinstance(src, torch.nn.Parameter):
        up._node.storage(0).role = "weight"  # its in-place updates and views stay weights
    if fresh_empty:
        # `cpu.to(device)` is empty_strided + copy_: rebind the fresh empty to the upload, so the
        # transfer is one node and the empty is never run.
        dst._node, dst._out = up._node, 0
        track(dst, up._node, 0)
        if isinstance(src, torch.nn.Parameter):
            dst._swap_src = src  # Module.to() may swap dst into src: see __tensor_flatten__
        return dst
    return record(_copy, (dst, up, non_blocking), {})


def copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """PrivateUse1 kernel of ``aten::_copy_from`` (copies that reach the backend directly)."""
    if type(src) is not LazyTensor and src.device.type == DEVICE_TYPE:
        src = _import_alias(src)
    if type(dst) is not LazyTensor and dst.device.type == DEVICE_TYPE:
        _copy(_import_alias(dst), src, non_blocking)
        return dst
    if isinstance(dst, LazyTensor) and not isinstance(src, LazyTensor):
        return _upload_into(dst, src, non_blocking)
    return record(_copy, (dst, src, non_blocking), {})


_EMPTY_FACTORIES = frozenset({aten.empty.memory_format, aten.empty_strided.default})


# --- data-dependent ops: run now --------------------------------------------------------------

def _run_now(func: Any, args: tuple, kwargs: dict, leaves: list[Any], spec: Any,
             index: int, trigger: str | None = None) -> Any:
    """Ops whose output shape or value depends on data run at once on the device."""
    lazies = [x for x in leaves if isinstance(x, LazyTensor)]
    _same_device(leaves, index, func)
    if trigger is None:
        trigger = "item" if func is _item else "data_dependent"
    reals = materialize(*lazies, trigger=trigger) if lazies else ()
    if len(lazies) == 1:
        if func is _item and len(leaves) == 1 and _plain(reals):
            # ``.item()`` (a training loop's one sync per step): the value read directly. The
            # general path below (modes off, no_grad, the math-bit keys back on) only matters
            # for a real tensor with a math bit or under a dispatch mode (~50 µs in a step)
            bump("forced_materializations")
            return func(reals)
        reals = (reals,)
    it = iter(reals)
    rleaves = [next(it) if isinstance(x, LazyTensor) else x for x in leaves]
    rargs, rkwargs = optree.tree_unflatten(spec, rleaves)
    dev = rkwargs.get("device")
    if isinstance(dev, torch.device) and dev.type == DEVICE_TYPE:
        rkwargs["device"] = real_device(index)
    with disable_modes(), torch.no_grad(), real_dispatch():
        out = func(*rargs, **rkwargs)
    bump("forced_materializations")
    flat, out_spec = optree.tree_flatten(out, none_is_leaf=True)
    if not any(isinstance(o, torch.Tensor) for o in flat):
        return out
    for o in flat:
        if isinstance(o, torch.Tensor) and o.is_nested:
            raise UnsupportedOpError(func, "it returns a nested tensor; remote_accelerator "
                                     "tensors are dense and strided only. Run it on the CPU.")
        if isinstance(o, torch.Tensor) and (o.layout != torch.strided or o.is_quantized):
            raise checks.refusal(func, o)
    return optree.tree_unflatten(out_spec, [adopt(o, index) if isinstance(o, torch.Tensor) else o
                                            for o in flat])


def _plain(real: Any) -> bool:
    """A real tensor whose ``_local_scalar_dense`` needs none of :func:`_run_now`'s dispatch
    state: no math bit (conjugate, negative, zero: keys a ``__torch_dispatch__`` call excludes)
    and no ``TorchDispatchMode`` on the stack (which would see the real op)."""
    return (type(real) is torch.Tensor and not real.is_neg() and not real.is_conj()
            and not real._is_zerotensor() and not torch._C._len_torch_dispatch_stack())


def _wrapper(cls: type, meta: TensorMeta, base: LazyTensor | None = None) -> Any:
    """A data-less ``cls`` tensor on the device with ``meta``'s metadata, math bits included
    (the dispatcher's Conjugate/Negative fallbacks then act as eager); not yet bound to a node.
    Its storage is ``base``'s (it aliases base's value) or a fresh one at a fake address of its
    own (``csrc/storage.cpp``): ``data_ptr()`` and ``untyped_storage()`` answer as eager's.
    An alias of a normal tensor taken in ``inference_mode`` is a normal tensor, as eager's
    views: autograd's view tracking gives it base's version counter, which an inference tensor
    cannot take."""
    if _key_free[0] and cls is LazyTensor and not (meta.conj or meta.neg) and \
            not torch._C._len_torch_dispatch_stack():
        # the native path's kind of wrapper (a key-free LazyImpl; its inference-mode alias too;
        # under a TorchDispatchMode, with the Python key: csrc/record.cpp make_wrapper)
        return _C._make_lazy_wrapper(meta.shape, meta.stride, meta.offset, meta.dtype,
                                     meta.index, base)
    if base is not None and torch.is_inference_mode_enabled() and not base.is_inference():
        with torch.inference_mode(False):
            return _wrapper(cls, meta, base)
    r = torch.Tensor._make_wrapper_subclass(
        cls, meta.shape, strides=meta.stride, storage_offset=meta.offset, dtype=meta.dtype,
        device=device_of(meta.index), requires_grad=False)
    _C._set_storage(r, base)
    if meta.conj or meta.neg:
        torch._C._set_conj(r, meta.conj)
        torch._C._set_neg(r, meta.neg)
    return r


def _detach_alias(x: LazyTensor) -> LazyTensor | None:
    """``detach(x)`` of a LazyTensor of the default graph: a new LazyTensor of x's very value, with
    no node of its own: x's node and output and its metadata, one more holder the node's output
    counts (the node keeps the value while either tensor lives). None where that does not apply
    (a capture graph keeps every op; math bits; x not among the holders its output counts): the
    op is then recorded.

    ``detach`` computes nothing: it is the same value under a tensor that autograd does not
    track. The autograd engine makes one for every output an op saves for backward (and again
    when backward unpacks it) and for every gradient it accumulates, so a training step recorded
    16 ``detach`` nodes for a 4-layer MLP: each cost a record, a slot in the plan and a replay.
    Aliasing is unchanged: both tensors share the node's storage, whose writes both see.
    """
    node = x._node
    if node.graph is not DEFAULT_GRAPH or current_graph() is not DEFAULT_GRAPH or \
            not _C._wrapper_counts(x):
        return None
    out = x._out
    meta = node.metas[out]
    if meta.conj or meta.neg:
        return None
    r = _wrapper(LazyTensor, meta, x)
    r._node = node
    r._out = out
    track(r, node, out)
    return r


def _import_alias(x: torch.Tensor) -> LazyTensor:
    """:data:`alias_import` of ``x``, or materialize's TypeError where there is none."""
    if alias_import is None:
        return materialize(x)  # its TypeError
    return alias_import(x)


def item_kernel(x: torch.Tensor) -> Any:
    """PrivateUse1 kernel of ``_local_scalar_dense``: reached with the Python key excluded
    (``torch.tensor([t0, t1])``) or by a DLPack import (genie.dlpack)."""
    return _item_now(x if type(x) is LazyTensor else _import_alias(x))


def _item_now(x: LazyTensor) -> Any:
    """:func:`_run_now` for ``_local_scalar_dense(x)`` (``.item()``, ``bool()``: once per token
    in a generate loop, once per training step), without its generic argument handling: one
    input, a Python number out, read directly where the real tensor needs no dispatch state.
    On a device a server runs, a small exact value the host can compute from constants is read
    without a round trip (:func:`genie.executor.host_read`; its nodes stay pending)."""
    served = device.remote_served
    if served is not None and not x._node.executed and served(x._node.metas[x._out].index):
        _C._record_ahead_reset()  # a read: the next piece sent ahead counts from here
        real = executor.host_read(x._node, x._out)
        if real is not None:
            _counts["forced_materializations"] += 1
            bump("host_reads")
            return _item(real)
    # materialize(x, trigger="item"), inline: once per token or step
    _counts["materializations"] += 1
    _counts["materializations.item"] += 1
    node = x._node
    real = executor.run_targets([(node, x._out)], node.metas[x._out].index)[0]
    out = _item_of(real)
    _counts["forced_materializations"] += 1
    return out


def _item_of(real: torch.Tensor) -> Any:
    """``_local_scalar_dense`` of the real value ``real`` (:func:`_item_now`'s, and csrc/read.cpp's
    where it does not read the scalar itself)."""
    if _plain(real):
        return _item._op(real)  # (the C++ op itself: OpOverload.__call__ is only a frame to it)
    with disable_modes(), torch.no_grad(), real_dispatch():
        return _item(real)


def adopt(real: torch.Tensor, index: int) -> LazyTensor:
    """Wrap an already computed device tensor as a materialized LazyTensor (an executed node)."""
    meta = TensorMeta.of(real, index)
    node = Node("genie.result", None, None, [meta], None, [Storage()], (), current_graph())
    node.executed = True
    node.values = [real]
    return LazyTensor(node, 0, meta)


# --- the native record path -----------------------------------------------------------------

def _install_native_record() -> bool:
    """Make ``LazyTensor.__torch_dispatch__`` the native record path (``csrc/record.cpp``).

    It records the common case (a call whose meta-cache entry it has learned for these exact
    arguments, outside ``genie.capture()``) as :func:`_record` would, field for field, and calls
    :func:`_dispatch` for everything else; ``config.native_record`` (``GENIE_NATIVE_RECORD=0``)
    sends every op to :func:`_dispatch`. False where this build of ``genie._C`` has no native
    path (torch older than 2.13): the Python path stays.
    """
    objects = dict(
        LazyTensor=LazyTensor, Node=Node, Ref=Ref, Storage=Storage, MetaArg=MetaArg,
        TensorMeta=TensorMeta, MetaEntry=MetaEntry, Graph=Graph, fallback=_dispatch,
        entry_for=entry_for,
        counts=_counts, profiler=vars(_profiler), tls=_tls,
        current=graph_current,
        default_graph=DEFAULT_GRAPH, counter=_record_counter, leaf_spec=_LEAF_SPEC,
        # ops that always take the fallback: copy_, and index_put, whose indices the host may
        # hold (record's _check_indices reads their values at every call, not once per key)
        copy_ops=(_copy, *checks.INDEX_PUT),
        device_ops=(_to_copy,), detach=_detach, pending_total=pending_total,
        retrack_below=_C._gc_retrack_below, defer_writer=defer_writer, limit=meta_cache.limit,
        factory_fallback=record_factory, context=context, rules=RULES, kw_rules=KW_RULES,
        meta_cache_dict=meta_cache._d)
    if not _C._record_init(objects):
        return False
    # .item() and .cpu() of a pending value on the steady embedded path, read natively
    # (csrc/read.cpp's read_op_steady: _item_now's and _transfer's counts, read and answer,
    # without their Python frames)
    _C._read_item_init(_item, _to_copy, LazyTensor, torch.Tensor, executor._READ_CTX,
                       sys.modules[__name__])
    config.on_change(_C._record_config)
    _syncs.append(_C._record_sync_counts)
    # A staticmethod: torch calls it on LazyTensors only, and no method object is bound per op.
    LazyTensor.__torch_dispatch__ = staticmethod(_C._record_dispatch)  # type: ignore[assignment]
    return True


_native_record_installed = _install_native_record()


def _install_dispatch_rule_lookup() -> bool:
    """Replace torch's ``find_torch_dispatch_rule`` with the same lookups done natively.

    torch calls it (from C++, ``dispatch_on_subclass``) for every op that reaches a
    ``__torch_dispatch__`` subclass, so once per op Genie records; as Python it is three calls.
    The native one reads the same registry (``singleton._data``, then the entry's
    ``torch_dispatch_rules._data``) and returns the same rule, or None. torch looks the function
    up once, at its first subclass dispatch, so this holds only when it runs before that (as at
    ``import genie``); otherwise torch keeps its own, and nothing changes but the speed. Declined
    (torch's stays) where the registry does not have the expected shape (another torch version)
    or ``GENIE_NATIVE_DISPATCH_RULE=0``.
    """
    if not config.native_dispatch_rule:
        return False
    try:
        from torch._library import simple_registry
    except ImportError:
        return False
    data = getattr(getattr(simple_registry, "singleton", None), "_data", None)
    holder = getattr(simple_registry, "GenericTorchDispatchRuleHolder", None)
    if type(data) is not dict or holder is None or not hasattr(holder("genie::probe"), "_data"):
        return False
    _C._set_dispatch_rule_data(data)
    simple_registry.find_torch_dispatch_rule = _C._find_torch_dispatch_rule
    return True


_install_dispatch_rule_lookup()


def _follow_python_key(cfg: Any) -> None:
    """Record LazyTensor calls from genie's C++ kernel on the Python dispatch key.

    PyTorch's Python fallback reaches ``LazyTensor.__torch_dispatch__`` through a generic round
    trip (the IValue stack boxed into Python arguments, the overloaded types collected into a
    tuple, ``__torch_dispatch__`` looked up by name and called with four arguments, the result
    unboxed): for a small op about as much work as Genie's own record. ``csrc/python_key.cpp``
    registers a kernel on the Python key for the aten operators that reach it, which calls the
    native record directly for calls only ``LazyTensor.__torch_dispatch__`` would see (no
    ``TorchDispatchMode``, every subclass argument a LazyTensor, no registered dispatch rule) and
    hands every other call to PyTorch's fallback unchanged. Installed the first time
    ``config.python_key`` is on (``GENIE_PYTHON_KEY``, default on) where the native record path
    and this build's kernel exist (torch >= 2.11); switching the setting off hands every call to
    PyTorch's fallback again.
    """
    if not getattr(_C, "_python_key_kernel", False) or not _native_record_installed:
        return
    if cfg.python_key:
        _C._python_key_install()  # once; later calls return -1
    _C._python_key_enable(cfg.python_key, LazyTensor.__dict__["__torch_dispatch__"])
    # torch's bindings look __torch_function__ up on every subclass argument of every call, by a
    # C string made into a str each time; LazyTensor's tp_getattr answers that lookup as
    # getattr() does without the str (csrc/python_key.cpp).
    _C._fast_torch_function_check(LazyTensor, cfg.python_key)


config.on_change(_follow_python_key)


def _under_modes(func: Any, args: tuple, kwargs: dict) -> Any:
    """A call with a key-free LazyTensor argument under a TorchDispatchMode (csrc/python_key.cpp,
    ``under_modes``): what torch's Python fallback does for a tensor subclass with the Python key,
    LazyTensor among the overloaded types. The innermost mode first (popped while it runs); if it
    declines (``NotImplemented``: FakeTensorMode and AOTAutograd's modes do for a subclass they
    do not know), ``LazyTensor.__torch_dispatch__``, the modes still active, as torch calls it."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    with _pop_mode_temporarily() as mode:
        out = mode.__torch_dispatch__(func, (LazyTensor,), args, kwargs)
    if out is NotImplemented:
        return LazyTensor.__torch_dispatch__(func, (LazyTensor,), args, kwargs)
    return out


#: whether natively made wrappers are key-free (install_key_free): the Python path's then too
_key_free = [False]


def key_free_wanted() -> bool:
    """Whether :func:`install_key_free` will make natively made LazyTensors key-free
    (``GENIE_KEY_FREE``, default on, where the native record path, this build's kernel and its
    native wrappers exist: a build whose wrappers ``torch.Tensor._make_wrapper_subclass`` makes
    gives every LazyTensor the Python key)."""
    return bool(config.key_free and getattr(_C, "_python_key_kernel", False)
                and _native_record_installed and hasattr(_C, "_pu1_install")
                and _C._make_lazy_wrapper((0,), (1,), 0, torch.float32, 0, None) is not None)


def install_key_free() -> None:
    """Natively made LazyTensors without the Python dispatch key (``csrc/python_key.cpp``,
    "PrivateUse1"): their ops reach genie's kernel at PrivateUse1, and autograd treats their
    views as a backend's (no view function and reverse-view function per view: ~5-8% of a
    GPT-2 generate token, docs/node-layout.md section 7 step 4). Called once at import, after
    genie's other PrivateUse1 kernels and genie.dlpack's fallback (what an operator had at
    PrivateUse1 takes the calls without a LazyTensor: ``.item()`` of a DLPack import reaches
    genie.dlpack's fallback, which reads its alias)."""
    if key_free_wanted() and _C._pu1_install() >= 0:
        _key_free[0] = True


# --- optimizers: the multi-tensor (foreach) path ------------------------------------------------

def _declare_foreach_capable(cfg: Any) -> None:
    """Let optimizers and ``clip_grad_norm_`` take their ``_foreach_*`` path on LazyTensors.

    PyTorch picks the multi-tensor implementation only when ``type(p)`` is listed in
    ``torch.optim.optimizer._foreach_supported_types`` and
    ``torch.utils._foreach_utils._foreach_supported_types`` (the device check already admits
    PrivateUse1). DTensor declares itself the same way (``torch/distributed/tensor/__init__.py``).
    Without it an AdamW step of 8 parameters records ~80 per-tensor ops instead of ~8 foreach
    ops, each paying record, plan and replay on the host. Idempotent; follows
    ``config.foreach`` (``GENIE_FOREACH=0``: the per-tensor path, as before).
    """
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for types in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if cfg.foreach and LazyTensor not in types:
            types.append(LazyTensor)
        elif not cfg.foreach and LazyTensor in types:
            types.remove(LazyTensor)


config.on_change(_declare_foreach_capable)
