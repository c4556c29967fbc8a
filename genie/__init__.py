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

from .device import register as _register
from .errors import DeviceError, ExecutionError, GenieError, UnsupportedOpError
from .executor import materialize
from .lazy_tensor import LazyTensor
from .planner import format_tape
from .stats import reset_stats, stats

_register()

__all__ = [
    "DeviceError", "ExecutionError", "GenieError", "LazyTensor", "UnsupportedOpError",
    "format_tape", "materialize", "reset_stats", "stats",
]


def _autoload() -> None:
    """Entry point of the ``torch.backends`` group: ``import torch`` registers the device."""
    _register()
