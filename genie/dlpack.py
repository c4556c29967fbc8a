"""DLPack of ``remote_accelerator`` tensors, within PyTorch: an alias, as on any device.

``torch.utils.dlpack.to_dlpack(t)``, ``t.__dlpack__()`` and ``torch.from_dlpack(t)`` of a
LazyTensor make the capsule torch makes for any PrivateUse1 tensor: device type ``kDLExtDev``,
and as data pointer the tensor's fake address (csrc/storage.cpp), which no consumer but PyTorch
accepts (NumPy, CuPy and JAX refuse an ``kDLExtDev`` device; none dereferences the address).
PyTorch's importer (``torch.from_dlpack(capsule)``, ``torch.asarray(capsule)``) builds from it a
*plain* PrivateUse1 tensor over that address: torch's C++ code, no Python hook. That tensor is
resolved here to what it stands for: eager's alias of the exported tensor. Each export notes the
exported LazyTensor (weakly: the capsule, and then the imported tensor, keep it alive) under its
address; an op that meets the imported tensor gets instead a view of the exported tensor at the
same offset, sizes and strides (:func:`alias_of`), so reads see its values and writes change it,
as eager's shared memory does.

Where the imported tensor reaches Genie:

- an op that also takes a LazyTensor (``torch.isclose(t, imported)``, ``lazy.copy_(imported)``,
  ``imported.to(dtype)``, which copies into a new LazyTensor): ``lazy_tensor.record``;
- host copies (``imported.cpu()``) and ``.item()``: the backend's ``_copy_from`` and
  ``_local_scalar_dense`` kernels (genie.factories);
- every other op on imported tensors only (``imported + 1``, ``imported[0] = 5``): the
  PrivateUse1 backend fallback below, which torch reaches for ops with no PrivateUse1 kernel
  (aten's LazyTensor calls never get there: genie's kernel takes them at the Python key, or at
  PrivateUse1 for key-free LazyTensors, and passes an aten call without a LazyTensor on to this
  fallback; a custom operator's call on a key-free LazyTensor reaches it and is recorded). It
  re-raises torch's own NotImplementedError for a PrivateUse1 tensor that is no DLPack import.

``to_dlpack`` is torch's C function, so ``torch.utils.dlpack.to_dlpack`` and ``torch.to_dlpack``
are wrapped to note LazyTensors (every other tensor goes straight to torch's function).
tests/unit/test_device_semantics.py (test_dlpack_*), PyTorch's test_tensor_creation_ops.py
(TestAsArray::test_{alias,copy}_from_dlpack_*).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import optree
import torch

from . import lazy_tensor
from .device import DEVICE_TYPE
from .lazy_tensor import LazyTensor

aten = torch.ops.aten

#: fake address of an exported tensor's first element -> the exported LazyTensor (weakly)
_exported: dict[int, weakref.ref] = {}

_lib: torch.library.Library | None = None


def note_export(t: torch.Tensor) -> None:
    """Remember ``t`` (a LazyTensor about to be exported) under its address."""
    for p in [p for p, w in _exported.items() if w() is None]:
        del _exported[p]
    _exported[t.data_ptr()] = weakref.ref(t)


def is_import(x: Any) -> bool:
    """Whether ``x`` is a plain (not LazyTensor) tensor on the device: a DLPack import."""
    return isinstance(x, torch.Tensor) and type(x) is not LazyTensor and \
        x.device.type == DEVICE_TYPE


def _base_of(x: torch.Tensor) -> torch.Tensor:
    """The exported LazyTensor that the DLPack import ``x`` shares memory with, viewed as
    ``x``'s dtype: x's storage starts at its first element."""
    w = _exported.get(x.untyped_storage().data_ptr())
    owner = w() if w is not None else None
    if owner is None:
        raise RuntimeError(
            f"a {x.device} tensor that Genie did not make (a DLPack import of a tensor not "
            "exported by torch.utils.dlpack.to_dlpack, Tensor.__dlpack__ or torch.from_dlpack "
            "in this process, or a tensor built by a C++ extension): Genie cannot name its "
            "value. Import a CPU tensor and move it with .to(device) instead.")
    return owner if owner.dtype == x.dtype else owner.view(x.dtype)


def alias_of(x: torch.Tensor) -> torch.Tensor:
    """The LazyTensor view that the DLPack import ``x`` stands for (recorded: no data moves)."""
    base = _base_of(x)
    offset = base.storage_offset() + x.storage_offset()
    return aten.as_strided.default(base, list(x.shape), list(x.stride()), offset)


def swap_imports(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` with each DLPack import replaced by :func:`alias_of` it, or None when
    they hold none."""
    leaves, spec = optree.tree_flatten((args, kwargs))
    if not any(is_import(x) for x in leaves):
        return None
    return optree.tree_unflatten(spec, [alias_of(x) if is_import(x) else x for x in leaves])


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """PrivateUse1 fallback: an op with no PrivateUse1 kernel, on DLPack imports only, or an
    operator genie's kernel is not registered for (not aten: a library's custom op) on a
    key-free LazyTensor, which never reaches the Python key: recorded as there."""
    if any(type(x) is LazyTensor for x in optree.tree_leaves((args, kwargs))):
        return LazyTensor.__torch_dispatch__(op, (LazyTensor,), args, kwargs)
    swapped = swap_imports(args, kwargs)
    names = [a.name for a in op._schema.arguments]
    if swapped is not None and "storage_offset" in names and is_import(args[0]):
        # as_strided(import, size, stride, offset): an offset into the import's storage, which
        # starts where the exported tensor's first element is in the alias's storage
        i = names.index("storage_offset")
        delta = _base_of(args[0]).storage_offset()
        sargs, skwargs = list(swapped[0]), dict(swapped[1])
        # (None: the tensor's own offset, which its alias has already)
        if i < len(sargs) and sargs[i] is not None:
            sargs[i] = sargs[i] + delta
        elif skwargs.get("storage_offset") is not None:
            skwargs["storage_offset"] = skwargs["storage_offset"] + delta
        swapped = (tuple(sargs), skwargs)
    if swapped is None:  # torch's own error for a backend without the kernel
        raise NotImplementedError(
            f"Could not run '{op._schema.name}' with arguments from the '{DEVICE_TYPE}' "
            "backend: this tensor was not made by Genie (only tensors made on "
            f"{DEVICE_TYPE} by torch's factories, .to() and DLPack imports are).")
    out = op(*swapped[0], **swapped[1])
    # an in-place or out= op returns the tensor it wrote, as eager (the import, not its alias)
    rets = op._schema.returns
    if len(rets) == 1 and rets[0].alias_info is not None and rets[0].alias_info.is_write:
        for a, x in zip(op._schema.arguments, args, strict=False):
            if a.alias_info is not None and a.alias_info.is_write:
                return x
        for a in op._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write and a.name in kwargs:
                return kwargs[a.name]
    return out


def _note_lazy(to_dlpack: Any) -> Any:
    @functools.wraps(to_dlpack)
    def wrapped(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if type(tensor) is LazyTensor:
            note_export(tensor)
        return to_dlpack(tensor, *args, **kwargs)

    wrapped.__genie_wraps__ = to_dlpack
    return wrapped


def register() -> None:
    """Wrap torch's ``to_dlpack`` and register the PrivateUse1 fallback (once per process)."""
    global _lib
    if _lib is not None:
        return
    import torch.utils.dlpack as dl

    original = dl.to_dlpack
    if getattr(original, "__genie_wraps__", None) is None:
        wrapped = _note_lazy(original)
        dl.to_dlpack = wrapped
        if getattr(torch, "to_dlpack", None) is original:
            torch.to_dlpack = wrapped
    lazy_tensor.alias_import = alias_of
    lazy_tensor._note_export = note_export
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(_fallback, "PrivateUse1")
    _lib = lib
