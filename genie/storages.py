"""Storages of ``remote_accelerator``: ``set_`` onto one, and ``torch.load`` onto the device.

A LazyTensor's storage holds no bytes (its value lives in the graph) but has eager's size and a
fake address of its own (``csrc/storage.cpp``); views share their base's. Two kinds of device
storage reach Python:

- a LazyTensor's own (``t.untyped_storage()``): :meth:`LazyTensor.untyped_storage` notes the
  tensor on it (a weak reference), so ``x.set_(t.untyped_storage(), offset, size, stride)``
  records the view of t's value that eager's ``set_`` makes;
- a *host-backed* one, made by ``torch.load(..., map_location="remote_accelerator")`` (the
  deserializer below) or ``storage.remote_accelerator()``: a fake-address storage that keeps the
  host storage it stands for. The first ``set_`` onto it records one upload of the host bytes in
  the dtype read (kept on the storage), and every tensor made from it in that dtype is a view of
  that upload: tensors that shared a storage in the checkpoint share one on the device, as they
  do when loaded onto CUDA (torch.load reads each storage in one dtype).

``set_`` with another tensor (``x.set_(y)``) records an alias of y; ``x.set_()`` an empty tensor.
Nothing here touches bytes at record time; nothing runs for a program that never uses the device
(the deserializer answers only for ``remote_accelerator`` locations).
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import torch

from . import _C
from .device import DEVICE_TYPE, current_device, device_count
from .errors import UnsupportedOpError

aten = torch.ops.aten

_LOCATION = re.compile(rf"{DEVICE_TYPE}(:(\d+))?$")


def note_owner(storage: torch.UntypedStorage, t: torch.Tensor) -> None:
    """Remember (weakly) a LazyTensor whose storage ``storage`` is, for a later ``set_``."""
    d = storage.__dict__
    w = d.get("_genie_owner")
    if w is None or w() is None:
        d["_genie_owner"] = weakref.ref(t)


def host_backed(host: torch.UntypedStorage, index: int) -> torch.UntypedStorage:
    """A storage on ``remote_accelerator:index`` standing for the host storage ``host``."""
    if host.device.type != "cpu":
        host = host.cpu()
    s = _C._new_storage(host.nbytes(), index)
    s.__dict__["_genie_host"] = host  # no cycle: the host storage never refers back
    return s


def _storage_base(storage: torch.UntypedStorage, dtype: torch.dtype, func: Any) -> torch.Tensor:
    """A 1-d LazyTensor of ``dtype`` over the whole of ``storage`` (offset 0), aliasing the value
    the storage holds."""
    d = storage.__dict__
    up = None
    if "_genie_host" in d:
        # one upload per storage, in the dtype it is read as (torch.load reads each in one), so
        # a server needs no reinterpreting view; a second dtype gets its own upload (not aliased)
        ups = d.setdefault("_genie_uploads", {})
        up = ups.get(dtype)
        if up is None:
            if storage.nbytes() % dtype.itemsize:
                raise RuntimeError(
                    f"set_: a storage of {storage.nbytes()} bytes cannot be viewed as {dtype} "
                    f"(itemsize {dtype.itemsize})")
            cpu = torch.empty(0, dtype=dtype).set_(d["_genie_host"])
            up = ups[dtype] = cpu.to(storage.device)
    if up is None:
        w = d.get("_genie_owner")
        owner = w() if w is not None else None
        if owner is None or owner.untyped_storage()._cdata != storage._cdata:
            raise UnsupportedOpError(
                func, "this remote_accelerator storage belongs to no live tensor that Genie can "
                "name (a storage made by torch.UntypedStorage(..., device=...), or one whose "
                "tensors are all gone); set_ onto a tensor's own untyped_storage() while the "
                "tensor lives, or build the tensor on the CPU and move it with .to().")
        n = storage.nbytes() // owner.element_size()
        up = aten.as_strided.default(owner, [n], [1], 0)
    if up.dtype != dtype:
        if up.dtype != torch.uint8:
            up = aten.view.dtype(up, torch.uint8)
        if storage.nbytes() % dtype.itemsize:
            raise RuntimeError(
                f"set_: a storage of {storage.nbytes()} bytes cannot be viewed as {dtype} "
                f"(itemsize {dtype.itemsize})")
        up = aten.view.dtype(up, dtype)
    return up


def _view_args(rest: list, kwargs: dict) -> tuple[int, list, list | None]:
    """(storage_offset, size, stride) of a set_ overload that takes them, after its source."""
    vals = rest[1:] + [kwargs[k] for k in ("storage_offset", "size", "stride")
                       if k in kwargs]
    return vals[0], vals[1], (vals[2] if len(vals) > 2 else None)


def set_value(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """The value ``set_`` gives its first argument: a LazyTensor aliasing what eager's ``set_``
    would make it a view of (a storage, another tensor), or a fresh empty one."""
    self = args[0]
    rest = list(args[1:])
    if func is aten.set_.default:
        return torch.empty(0, dtype=self.dtype, device=self.device)
    if func is aten.set_.source_Tensor or func is aten.set_.source_Tensor_storage_offset:
        src = rest[0] if rest else kwargs["source"]
        if not isinstance(src, torch.Tensor) or src.device != self.device:
            raise RuntimeError(f"set_: expected a source on {self.device}, got "
                               f"{getattr(src, 'device', type(src).__name__)}")
        if src.dtype != self.dtype:
            raise RuntimeError(f"Could not set tensor of type {src.dtype} as a storage of a "
                               f"tensor of type {self.dtype}")
        if func is aten.set_.source_Tensor:
            return aten.alias.default(src)
        offset, size, stride = _view_args(rest, kwargs)
        storage = src.untyped_storage()
        note_owner(storage, src)
    else:  # source_Storage, source_Storage_storage_offset
        storage = rest[0] if rest else kwargs["source"]
        if func is aten.set_.source_Storage:
            offset, size, stride = 0, [storage.nbytes() // self.element_size()], None
        else:
            offset, size, stride = _view_args(rest, kwargs)
    if storage.device != self.device:
        raise RuntimeError(f"Attempted to set the storage of a tensor on device "
                           f"\"{self.device}\" to a storage on different device "
                           f"\"{storage.device}\".  This is no longer allowed; the devices must "
                           "match.")
    size = list(size)
    if not stride:
        stride = list(torch.empty(size, device="meta").stride())
    base = _storage_base(storage, self.dtype, func)
    return aten.as_strided.default(base, size, list(stride), offset)


def _tag(storage: Any) -> str | None:
    return None  # saving goes through the tensor (LazyTensor.__reduce_ex__), never its storage


def _deserialize(obj: Any, location: str) -> Any:
    """``torch.load``'s restore_location for ``remote_accelerator[:N]``: a host-backed storage."""
    m = _LOCATION.match(location) if isinstance(location, str) else None
    if m is None:
        return None

    index = int(m.group(2) or 0)
    if index >= device_count():
        raise RuntimeError(f"Attempting to deserialize object on {DEVICE_TYPE} device {index} "
                           f"but torch.{DEVICE_TYPE}.device_count() is {device_count()}. Please "
                           "use torch.load with map_location to map your storages to an "
                           "existing device.")
    return host_backed(obj, index)


def _storage_to_device(self: Any, device: Any = None, non_blocking: bool = False,
                       **kwargs: Any) -> Any:
    """``storage.remote_accelerator(device)``: the callable ``map_location`` of torch.load's
    docs (``lambda storage, loc: storage.remote_accelerator()``) and a storage's own move."""

    if isinstance(device, torch.device):
        index = device.index
    elif isinstance(device, str):
        index = torch.device(device).index
    else:
        index = device
    index = current_device() if index is None else int(index)
    if self.device.type == DEVICE_TYPE and self.device.index == index:
        return self
    untyped = self._untyped_storage if isinstance(self, torch.TypedStorage) else self
    s = host_backed(untyped, index)
    if isinstance(self, torch.TypedStorage):
        return torch.TypedStorage(wrap_storage=s, dtype=self.dtype, _internal=True)
    return s


_registered = False


def register() -> None:
    """torch.load's deserializer for ``remote_accelerator`` locations (before PrivateUse1's
    generic one, which would allocate device bytes) and ``storage.remote_accelerator()``."""
    global _registered
    if _registered:
        return
    torch.serialization.register_package(19, _tag, _deserialize)
    for cls in (torch.UntypedStorage, torch.TypedStorage):
        setattr(cls, DEVICE_TYPE, _storage_to_device)
    _registered = True
