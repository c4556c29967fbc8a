"""PrivateUse1 kernels for factory functions: ``torch.randn(..., device="remote_accelerator")``.

Factories have no tensor input, so they reach the ``PrivateUse1`` dispatch key (not the Python
key a LazyTensor carries). Each overload below gets a kernel that records exactly one node for
the call (``randn`` stays ``randn``: registering at PrivateUse1 overrides the composite
``empty`` + ``normal_`` decomposition). Ops that take a tensor only for its metadata
(``zeros_like``, ``new_zeros``) are listed in :data:`genie.meta.METADATA_ONLY` so that their
node does not depend on that tensor's values. Registered by ``import genie`` (after the device).
The kernels call ``genie._C._record_factory``: the common case is recorded natively
(csrc/record.cpp), the rest by :func:`~genie.lazy_tensor.record_factory`, the reference. With the
native record path and ``config.python_key`` on at import (``GENIE_PYTHON_KEY``, the default),
each is a C++ kernel (csrc/python_key.cpp, ``factory_kernel``) that converts the dispatcher's
stack as torch converts it for a Python kernel and calls the same function; otherwise a Python
``torch.library`` kernel does.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _C
from .checks import refuse_kind
from .config import config
from .lazy_tensor import copy_from, item_kernel, key_free_wanted, record_factory

aten = torch.ops.aten

FACTORY_PACKETS = (
    aten.empty, aten.empty_strided, aten.empty_permuted, aten.zeros, aten.ones, aten.full,
    aten.scalar_tensor, aten.eye, aten.arange, aten.linspace, aten.logspace,
    aten.rand, aten.randn, aten.randint, aten.randperm, aten.normal,
    aten.tril_indices, aten.triu_indices,
)

_lib: torch.library.Library | None = None


def factory_overloads() -> list[Any]:
    """Every overload of the factory packets that takes a ``device`` and no tensor."""
    ops = []
    for packet in FACTORY_PACKETS:
        for name in packet.overloads():
            op = getattr(packet, name)
            args = op._schema.arguments
            if any(a.name == "names" for a in args):  # named tensors: not supported
                continue
            if any(a.name == "device" for a in args) and not any(
                    str(a.type).startswith("Tensor") for a in args):
                ops.append(op)
    return ops


def _impl_name(op: Any) -> str:
    """``name.overload`` as ``torch.library.Library.impl`` takes it (``name`` for default)."""
    name = op._schema.name.split("::")[1]
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def register_factories() -> None:
    """Register the PrivateUse1 factory kernels once per process."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    ops = factory_overloads()
    if _C._record_native and config.python_key and getattr(_C, "_python_key_kernel", False):
        # a C++ kernel (csrc/python_key.cpp): the stack converted to (args, kwargs) as torch
        # converts it for a Python kernel, then _record_factory, without the Python frame
        _C._factory_kernels_install([_impl_name(op) for op in ops])
        ops = []
    # natively where it can (csrc/record.cpp: the common case, else it calls record_factory)
    factory = _C._record_factory if _C._record_native else record_factory
    for op in ops:
        def kernel(*args: Any, _op: Any = op, **kwargs: Any) -> Any:
            return factory(_op, args, kwargs)

        lib.impl(_impl_name(op), kernel, "PrivateUse1")
    # Autograd formulas build zero gradients with ``_efficientzerotensor`` (a ZeroTensor: all
    # zeros, immutable, skipped by some kernels). A LazyTensor cannot carry the ZeroTensor key, so
    # record plain zeros: the same values, and mutable as the rest of the graph expects.
    def zero_tensor(*args: Any, **kwargs: Any) -> Any:
        return record_factory(aten.zeros.default, args, kwargs)

    lib.impl("_efficientzerotensor", zero_tensor, "PrivateUse1")
    # Host -> device copies that bypass the Python key (``torch.tensor(data, device=...)``
    # constructs with the Python key excluded) reach the backend's ``_copy_from``.
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    # And ``.item()`` of each element of a list of device tensors (``torch.tensor([t0, t1])``,
    # ``torch.tensor(list(itertools.product(a, b)))``) reaches the backend's
    # ``_local_scalar_dense``, with the Python key excluded the same way.
    # (key-free LazyTensors take genie's kernel there, which passes the other calls to it:
    # lazy_tensor.install_key_free)
    if not key_free_wanted():
        lib.impl("_local_scalar_dense", item_kernel, "PrivateUse1")
    else:
        # Autograd's index backward calls _index_put_impl_ (unsafe: a kernel may skip its index
        # checks) for tensors that are not subclass-like, as a key-free LazyTensor is not (eager's
        # path on the CPU); a server's opset has index_put_ only. Recorded as index_put_: the
        # same values, the checks kept.
        lib.impl("_index_put_impl_", _index_put_impl, "PrivateUse1")
    _register_refusals(lib)
    _lib = lib


def _index_put_impl(self: Any, indices: Any, values: Any, accumulate: bool = False,
                    unsafe: bool = False) -> Any:
    return aten.index_put_.default(self, indices, values, accumulate)


def _register_refusals(lib: Any) -> None:
    """Kernels that refuse, at the call, what the device cannot hold (genie.checks.refusal):
    quantized and sparse tensors made for it directly (``_empty_affine_quantized(...,
    device=D)``, ``torch.empty(..., layout=torch.sparse_coo, device=D)``), which torch would
    dispatch to the device's Quantized/Sparse keys, where nothing is registered."""
    for key, kind, names in (
            ("QuantizedPrivateUse1", "quantized",
             ("_empty_affine_quantized", "_empty_per_channel_affine_quantized",
              "empty.memory_format", "empty_strided", "empty_like")),
            ("SparsePrivateUse1", "sparse",
             ("empty.memory_format", "_sparse_coo_tensor_with_dims",
              "_sparse_coo_tensor_with_dims_and_tensors", "empty_like", "zeros_like")),
            ("SparseCsrPrivateUse1", "sparse",
             ("empty.memory_format", "empty_like", "zeros_like"))):
        for name in names:
            op = getattr(getattr(aten, name.split(".")[0]),
                         name.split(".")[1] if "." in name else "default")

            def kernel(*args: Any, _op: Any = op, _kind: str = kind, **kwargs: Any) -> Any:
                raise refuse_kind(_op, _kind)

            try:
                lib.impl(name, kernel, key)
            except RuntimeError:  # a torch without this key or kernel: torch's own error stands
                pass
