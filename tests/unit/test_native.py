"""The native runtime (``genie._C``): device guard, PrivateUse1 hooks, generators, allocator.

These check the C++ integration points PyTorch itself calls: ``torch.Generator(device=...)``,
``torch.accelerator``, the autograd engine's per-device threads, storage allocation. Genie's
Python op interception is not involved except where noted (``torch.manual_seed``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from torch.utils._pytree import tree_map

import genie  # noqa: F401  (registers remote_accelerator)
from genie import _C

DEVICE = "remote_accelerator"


@pytest.fixture(autouse=True)
def _restore_runtime() -> Iterator[None]:
    """Each test may change the device count and current device; put them back."""
    count, current = _C._device_count(), _C._current_device()
    yield
    _C._set_device_count(count)
    _C._set_device(current)


# --- device count and current device -----------------------------------------------------------


def test_device_count_set_get() -> None:
    _C._set_device_count(3)
    assert _C._device_count() == 3
    assert torch.accelerator.device_count() == 3  # through the PrivateUse1 hooks
    _C._set_device_count(1)
    assert _C._device_count() == 1


@pytest.mark.parametrize("count", [0, -1, _C._max_devices + 1])
def test_device_count_out_of_range_raises(count: int) -> None:
    with pytest.raises(ValueError, match="device count must be in"):
        _C._set_device_count(count)


def test_set_device_and_range_error() -> None:
    _C._set_device_count(2)
    _C._set_device(1)
    assert _C._current_device() == 1
    assert torch.accelerator.current_device_index() == 1
    for bad in (2, -1, 300):  # 300 must not wrap around int8
        with pytest.raises(IndexError, match=f"device index {bad} is out of range"):
            _C._set_device(bad)
    assert _C._current_device() == 1


def test_exchange_device_returns_previous() -> None:
    _C._set_device_count(2)
    _C._set_device(0)
    assert _C._exchange_device(1) == 0
    assert _C._current_device() == 1


def test_current_device_is_per_thread() -> None:
    _C._set_device_count(2)
    _C._set_device(1)
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(_C._current_device()))
    t.start()
    t.join()
    assert seen == [0]
    assert _C._current_device() == 1


def test_accelerator_is_remote_accelerator() -> None:
    acc = torch.accelerator.current_accelerator()
    assert acc is not None and acc.type == DEVICE
    assert torch.accelerator.is_available()


def test_accelerator_device_index_context_uses_guard() -> None:
    _C._set_device_count(2)
    _C._set_device(0)
    with torch.accelerator.device_index(1):
        assert _C._current_device() == 1
    assert _C._current_device() == 0


# --- generators ----------------------------------------------------------------------------------


def test_new_generator_defaults() -> None:
    g = torch.Generator(device=DEVICE)
    assert g.device == torch.device(DEVICE, 0)
    assert g.initial_seed() == 67280421310721  # c10::default_rng_seed_val, as on CPU
    assert g.get_offset() == 0


def test_generator_on_current_device() -> None:
    _C._set_device_count(2)
    _C._set_device(1)
    assert torch.Generator(device=DEVICE).device == torch.device(DEVICE, 1)


def test_generator_bad_index_raises() -> None:
    with pytest.raises(IndexError, match="out of range"):
        torch.Generator(device=f"{DEVICE}:{_C._device_count()}")


def test_manual_seed_initial_seed() -> None:
    assert torch.Generator(device=DEVICE).manual_seed(5).initial_seed() == 5


def test_offset_set_get_and_reset_by_seed() -> None:
    g = torch.Generator(device=DEVICE).manual_seed(5)
    g.set_offset(40)
    assert g.get_offset() == 40
    g.manual_seed(6)  # a new seed starts a new stream
    assert g.get_offset() == 0


def test_seed_is_nondeterministic() -> None:
    g = torch.Generator(device=DEVICE)
    seeds = {g.seed() for _ in range(4)}
    assert len(seeds) > 1
    assert g.initial_seed() in seeds


def test_state_layout() -> None:
    g = torch.Generator(device=DEVICE).manual_seed(0x0102030405060708)
    g.set_offset(9)
    state = g.get_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.numel() == 16
    assert state.tolist() == [8, 7, 6, 5, 4, 3, 2, 1, 9, 0, 0, 0, 0, 0, 0, 0]


def test_state_roundtrip_clones() -> None:
    g = torch.Generator(device=DEVICE).manual_seed(2**63 + 11)
    g.set_offset(2**40)
    h = torch.Generator(device=DEVICE)
    h.set_state(g.get_state())
    assert (h.initial_seed(), h.get_offset()) == (2**63 + 11, 2**40)
    h.set_offset(1)  # independent copies
    assert g.get_offset() == 2**40


def test_clone_state() -> None:
    g = torch.Generator(device=DEVICE).manual_seed(7)
    g.set_offset(3)
    c = g.clone_state()
    assert c is not g and c.device == g.device
    assert (c.initial_seed(), c.get_offset()) == (7, 3)


def test_bad_state_size_raises() -> None:
    g = torch.Generator(device=DEVICE)
    with pytest.raises(RuntimeError, match="expected a uint8 tensor of 16 bytes"):
        g.set_state(torch.zeros(8, dtype=torch.uint8))


def test_bad_state_dtype_raises() -> None:
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.Generator(device=DEVICE).set_state(torch.zeros(16, dtype=torch.float32))


def test_default_generator_identity_per_index() -> None:
    _C._set_device_count(2)
    g0, g1 = _C._default_generator(0), _C._default_generator(1)
    assert isinstance(g0, torch.Generator)
    assert _C._default_generator(0) is g0 and _C._default_generator(1) is g1
    assert g0 is not g1
    assert (g0.device, g1.device) == (torch.device(DEVICE, 0), torch.device(DEVICE, 1))
    _C._set_device(1)
    assert _C._default_generator(-1) is g1


def test_default_generator_is_shared_state() -> None:
    _C._default_generator(0).manual_seed(123)
    assert _C._default_generator(0).initial_seed() == 123


def test_torch_manual_seed_seeds_device() -> None:
    torch.manual_seed(4321)  # calls torch.remote_accelerator.manual_seed_all
    assert _C._default_generator(0).initial_seed() == 4321


# --- allocator -----------------------------------------------------------------------------------


def test_storage_allocation_refused() -> None:
    with pytest.raises(RuntimeError, match="have no host storage"):
        torch.UntypedStorage(16, device=DEVICE)


def test_zero_byte_storage_allowed() -> None:
    assert torch.UntypedStorage(0, device=DEVICE).device == torch.device(DEVICE, 0)


# --- autograd engine device threads --------------------------------------------------------------


class _MetaWrapper(torch.Tensor):
    """A storage-less tensor on remote_accelerator that runs every op on an inner meta tensor."""

    meta: torch.Tensor

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device, requires_grad: bool = False):
        r = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride(), dtype=meta.dtype, device=device,
            requires_grad=requires_grad)
        r.meta = meta
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        device = next(a.device for a in args if isinstance(a, _MetaWrapper))
        out = func(*tree_map(lambda t: t.meta if isinstance(t, _MetaWrapper) else t, args),
                   **tree_map(lambda t: t.meta if isinstance(t, _MetaWrapper) else t,
                              kwargs or {}))
        return tree_map(
            lambda t: _MetaWrapper(t, device) if isinstance(t, torch.Tensor) else t, out)


def test_backward_runs_on_device_thread() -> None:
    """The engine runs remote_accelerator nodes on its device thread, pinned by our guard."""
    x = _MetaWrapper(torch.empty(3, 4, device="meta"), torch.device(DEVICE, 0), True)
    seen: dict[str, object] = {}

    def hook(grad: torch.Tensor) -> None:
        seen["main_thread"] = threading.current_thread() is threading.main_thread()
        seen["device"] = _C._current_device()

    x.register_hook(hook)
    (x * 2).sum().backward()
    assert isinstance(x.grad, _MetaWrapper)
    assert x.grad.device == torch.device(DEVICE, 0) and x.grad.shape == (3, 4)
    assert seen == {"main_thread": False, "device": 0}
