"""Type stub for ``genie._C``, Genie's native remote_accelerator (PrivateUse1) runtime.

Importing the module installs the device guard, PrivateUse1 hooks, generators and the
storage-refusing allocator. The functions are private: use ``torch.remote_accelerator``.
"""

import torch

_max_devices: int
"""Upper bound accepted by :func:`_set_device_count` (64)."""

def _set_device_count(count: int) -> None:
    """Set how many devices exist; ValueError unless ``1 <= count <= _max_devices``.

    Call it before the first ``backward()``: the autograd engine sizes its device threads once.
    """

def _device_count() -> int:
    """Number of remote_accelerator devices (1 until set)."""

def _current_device() -> int:
    """This thread's current device index (per thread, like CUDA)."""

def _set_device(index: int) -> None:
    """Make ``index`` this thread's current device; IndexError outside ``0 .. count-1``."""

def _exchange_device(index: int) -> int:
    """Make ``index`` current and return the previous index; IndexError when out of range."""

def _default_generator(index: int) -> torch.Generator:
    """The default generator of device ``index`` (-1: current); the same object on every call."""
