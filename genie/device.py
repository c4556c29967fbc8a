"""The ``remote_accelerator`` device: registration and the ``torch.remote_accelerator`` module.

``remote_accelerator`` is PyTorch's PrivateUse1 slot renamed. This module is registered as
``torch.remote_accelerator`` and is shaped like ``torch.cuda``::

    >>> import torch, genie
    >>> torch.remote_accelerator.device_count() >= 1
    True
    >>> with torch.remote_accelerator.device(0):
    ...     torch.remote_accelerator.current_device()
    0

The native half (device guard, PrivateUse1 hooks, generators) lives in ``csrc/`` and is loaded as
``genie._C``. Registration is idempotent; it runs on ``import genie`` and, through the
``torch.backends`` entry point, on ``import torch`` when Genie is installed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .config import config
from .errors import DeviceError

DEVICE_TYPE = "remote_accelerator"
_registered = False


def _native() -> Any:
    from . import _C

    return _C


def register() -> None:
    """Register ``remote_accelerator`` with PyTorch (idempotent)."""
    global _registered
    if _registered:
        return
    import sys

    name = torch._C._get_privateuse1_backend_name()
    if name != "remote_accelerator":
        if name != "privateuseone":
            raise DeviceError(
                f"PyTorch's PrivateUse1 device is already registered as '{name}' by another "
                "extension; Genie needs it for 'remote_accelerator'. Import only one of them.")
        torch.utils.rename_privateuse1_backend("remote_accelerator")
    me = sys.modules[__name__]
    if getattr(torch, "remote_accelerator", None) is not me:
        torch._register_device_module("remote_accelerator", me)
    _native()._set_device_count(_initial_device_count())
    _native()._set_sdp_runs_on_cpu(sdp_runs_on_cpu)
    if not hasattr(torch.Tensor, "is_remote_accelerator"):
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
    other = _accelerator_beside()
    if other is not None:
        _explain_other_backward(other)
    _registered = True


def _accelerator_beside() -> str | None:
    try:
        from _genie_autoload import accelerator_beside
    except ImportError:  # genie without its distribution's entry point module (vendored)
        return None
    return accelerator_beside()


#: the autograd engine's assert when a backward runs over another accelerator's tensors in a
#: process where PrivateUse1 is registered (pytorch/pytorch#161129)
_OTHER_BACKWARD_ASSERT = "opt_ready_stream && opt_parent_stream"


def _explain_other_backward(other: str) -> None:
    """Beside another accelerator (``other``: ``cuda``), registering ``remote_accelerator`` makes
    it torch's accelerator, and PyTorch's autograd engine then fails a backward over ``other``'s
    tensors with an internal assert (pytorch/pytorch#161129). Nothing on Genie's side can lift
    that; ``torch.autograd.backward`` and ``torch.autograd.grad`` (``Tensor.backward`` calls the
    former) say what happened and what to do instead, the original error chained."""
    import functools

    import torch.autograd as ag

    why = (f"PyTorch's autograd cannot run a backward over {other} tensors in a process where "
           "the 'remote_accelerator' device (PrivateUse1) is registered: torch then takes it as "
           f"its one accelerator and finds no {other} stream for the backward's nodes "
           "(pytorch/pytorch#161129). Run the eager "
           f"{other} training in a process that does not import genie (`import torch` alone "
           f"does not register it on a machine with a {other} device), or move the model and "
           "its inputs to 'remote_accelerator', whose backward runs on that same device.")
    for name in ("backward", "grad"):
        fn = getattr(ag, name)
        if getattr(fn, "_genie_explains", False):
            continue

        def explained(*args: Any, _fn: Callable[..., Any] = fn, **kwargs: Any) -> Any:
            try:
                return _fn(*args, **kwargs)
            except RuntimeError as e:
                if _OTHER_BACKWARD_ASSERT not in str(e):
                    raise
                raise RuntimeError(why) from e

        functools.update_wrapper(explained, fn)
        explained._genie_explains = True  # type: ignore[attr-defined]
        setattr(ag, name, explained)


#: the connected servers' clients (genie.backends.remote sets it: it sits above this module)
sessions: list[Callable[[], list[Any]]] = [list]


def runs_remotely() -> bool:
    """Whether recorded work goes to a Genie server (one connected, or ``GENIE_SERVER`` set)."""
    return bool(sessions[0]() or os.environ.get("GENIE_SERVER"))


def sdp_runs_on_cpu(index: int) -> bool:
    """Whether ``scaled_dot_product_attention`` on ``remote_accelerator:index`` replays on a CPU
    (the embedded default on the CPU, no server): it then takes the fused kernel eager's CPU
    would (csrc/whole.cpp), not the math path. Asked by the native stub at each call."""
    return not runs_remotely() and real_device(max(index, 0)).type == "cpu"


def _initial_device_count() -> int:
    if config.device_count:
        return config.device_count
    if (config.device or "cuda").startswith("cuda") and torch.cuda.is_available():
        return max(1, torch.cuda.device_count()) if config.device in (None, "cuda") else 1
    return 1


# --- the torch.cuda-shaped API -----------------------------------------------------------------

def is_available() -> bool:
    """True: the embedded default can always run on the CPU when no server is configured."""
    return True


def is_initialized() -> bool:
    return _registered


def _lazy_init() -> None:
    register()


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """Number of ``remote_accelerator`` indices (``GENIE_DEVICE_COUNT``, default: CUDA count or 1)."""
    return int(_native()._device_count())


def current_device() -> int:
    """Index of the current ``remote_accelerator`` device (per thread, like CUDA)."""
    return int(_native()._current_device())


def check_index(index: int) -> None:
    """Raise a clear error for an index outside ``0 .. device_count()-1``."""
    n = device_count()
    if not 0 <= index < n:
        raise DeviceError(
            f"remote_accelerator:{index} does not exist: this process has {n} remote_accelerator "
            f"device(s) (indices 0..{n - 1}). Set GENIE_DEVICE_COUNT to expose more.")


def _index(d: Any) -> int:
    if d is None:
        return current_device()
    if isinstance(d, int):
        return d
    d = torch.device(d)
    if d.type != "remote_accelerator":
        raise ValueError(f"Expected a remote_accelerator device, got '{d}'")
    return current_device() if d.index is None else d.index


def set_device(device: Any) -> None:
    """Make ``device`` (index, string or torch.device) the current device of this thread."""
    index = _index(device)
    check_index(index)
    _native()._set_device(index)


class device:  # noqa: N801 (the torch.cuda.device spelling)
    """Context manager that changes the current device, like ``torch.cuda.device``."""

    def __init__(self, device: Any) -> None:
        self.idx = _index(device) if device is not None else -1
        self.prev = -1

    def __enter__(self) -> None:
        if self.idx >= 0:
            self.prev = current_device()
            set_device(self.idx)

    def __exit__(self, *exc: object) -> None:
        if self.idx >= 0:
            _native()._set_device(self.prev)


@contextlib.contextmanager
def _device_ctx(d: Any) -> Iterator[None]:
    with device(d):
        yield


# --- the map to real devices ---------------------------------------------------------------------

_real_devices: dict[int, torch.device] = {}

def real_device(index: int) -> torch.device:
    """The real device that ``remote_accelerator:index`` runs on in this process."""
    d = _real_devices.get(index)
    if d is None:
        spec = config.device
        if spec is None:
            spec = "cuda" if torch.cuda.is_available() else "cpu"
        if spec == "cuda":
            if index >= torch.cuda.device_count():
                raise DeviceError(f"remote_accelerator:{index} maps to cuda:{index}, but this "
                                  f"machine has {torch.cuda.device_count()} CUDA device(s).")
            d = torch.device("cuda", index)
        else:
            d = torch.device(spec)
        _real_devices[index] = d
    return d


def reset_device_map() -> None:
    _real_devices.clear()


#: set by :mod:`genie.backends.remote`: ``remote_sync(index)`` waits for the server of device
#: ``index`` and says whether there is one
remote_sync: Any = None
#: set by :mod:`genie.backends.remote`: ``remote_served(index)``, whether a server runs device
#: ``index``'s tapes (a value read from it costs a round trip)
remote_served: Any = None


def synchronize(device: Any = None) -> None:
    """Wait until the real device has finished the work Genie gave it.

    Recording is lazy, so this does not force pending values (use ``genie.materialize``); it waits
    for work already sent, as ``torch.cuda.synchronize`` does.
    """
    i = _index(device)
    if remote_sync is not None and remote_sync(i):  # a server's worker may run a step's rest
        return
    dev = real_device(i)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# --- random number generation --------------------------------------------------------------------

def default_generator(index: int) -> torch.Generator:
    """The default generator of ``remote_accelerator:index`` (a native ``torch.Generator``)."""
    check_index(index)
    return _native()._default_generator(index)


class _DefaultGenerators:
    def __getitem__(self, i: int) -> torch.Generator:
        return default_generator(i)

    def __len__(self) -> int:
        return device_count()

    def __iter__(self) -> Iterator[torch.Generator]:
        return (default_generator(i) for i in range(device_count()))


default_generators = _DefaultGenerators()


def manual_seed(seed: int) -> None:
    """Seed the current device's generator (random ops record (seed, offset) at their call)."""
    default_generator(current_device()).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator; ``torch.manual_seed`` calls this."""
    for i in range(device_count()):
        default_generator(i).manual_seed(int(seed))


def seed() -> None:
    default_generator(current_device()).seed()


def seed_all() -> None:
    for i in range(device_count()):
        default_generator(i).seed()


def initial_seed() -> int:
    return default_generator(current_device()).initial_seed()


def get_rng_state(device: Any = "remote_accelerator") -> torch.Tensor:
    """The generator state (a uint8 tensor) of ``device``."""
    return default_generator(_index(device)).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "remote_accelerator") -> None:
    default_generator(_index(device)).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [g.get_state() for g in default_generators]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for g, s in zip(default_generators, new_states):
        g.set_state(s)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]
