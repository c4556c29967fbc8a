"""Genie: run unmodified PyTorch programs on an accelerator that sits somewhere else.

``import genie`` registers the ``remote_accelerator`` device. Tensors on it are
:class:`LazyTensor` s: every op is recorded, and values are computed (on the real device: CUDA if
present, else the CPU) only when the program needs them::

    >>> import torch, genie
    >>> x = torch.randn(4, 4, device="remote_accelerator:0")   # recorded, not run
    >>> y = (x @ x).relu().sum()
    >>> isinstance(y.item(), float)                              # runs randn, matmul, relu, sum
    True
"""

from __future__ import annotations


def _autoload() -> None:
    """Entry point of the ``torch.backends`` group: ``import torch`` registers the device.

    Defined before anything imports torch: when ``import genie`` comes first, torch's own import
    runs this entry point while this package is still initializing, and must find it.
    """
    from .device import register

    register()


import atexit  # noqa: E402

import torch  # noqa: E402,F401  (first import of torch happens after _autoload exists)

from .capture import CaptureError, CaptureGraph, annotate_phase, capture, phase
from . import device as _device
from .device import register as _register
from .errors import DeviceError, ExecutionError, GenieError, UnsupportedOpError
from .factories import register_factories as _register_factories
from .fastpaths import install as _install_fastpaths
from .autocast import register as _register_autocast
from .storages import register as _register_storages
from .dlpack import register as _register_dlpack
from .dynamo import install as _install_dynamo_skips
from .distributed import register as _register_distributed
from .lazy_tensor import LazyTensor, install_key_free as _install_key_free, materialize
from .memory import install as _install_memory_api
from .planner import format_tape
from .stats import reset_stats, stats
from .backends.remote import connect, connect_from_env as _connect_from_env, disconnect
from .remote import (QuotaExceededError, RemoteError, RunTimeoutError, ServerUnavailableError,
                     SessionLostError)
from .shutdown import drain_device_threads as _drain_device_threads

_install_memory_api(_device)  # torch.remote_accelerator.memory_allocated, Stream, ... (genie.memory)
_register()
_register_factories()  # the PrivateUse1 factory kernels record through genie.lazy_tensor
_install_fastpaths()  # nn fast paths that need nested tensors run densely (genie.fastpaths)
_register_autocast()  # torch.autocast("remote_accelerator") (genie.autocast)
_register_storages()  # torch.load(..., map_location="remote_accelerator") (genie.storages)
_register_dlpack()  # DLPack imports of device tensors are aliases (genie.dlpack)
_install_key_free()  # LazyTensors without the Python key (genie.lazy_tensor.install_key_free)
_install_dynamo_skips()  # torch.compile runs Genie's own code as plain Python (genie.dynamo)
_register_distributed()  # torch.distributed backend "genie" for remote_accelerator
atexit.register(_drain_device_threads)  # no abort at exit right after backward (genie.shutdown)
_connect_from_env()  # GENIE_SERVER=tcp://host:port: lazily, the session opens at first use

__all__ = [
    "CaptureError", "CaptureGraph", "DeviceError", "ExecutionError", "GenieError", "LazyTensor",
    "QuotaExceededError", "RemoteError", "RunTimeoutError", "ServerUnavailableError",
    "SessionLostError",
    "UnsupportedOpError", "annotate_phase", "capture", "connect", "disconnect", "format_tape",
    "materialize", "phase", "reset_stats", "stats",
]
