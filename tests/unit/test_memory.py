"""torch.remote_accelerator's memory and stream API (shaped like torch.cuda), on the embedded CPU.

The figures are checked against the bytes of the same program's eager tensors: what the program
holds, and what eager holds at once while it computes (its peak).
"""

import gc

import pytest
import torch

import genie
from genie.device import real_device

ra = torch.remote_accelerator
DEV = "remote_accelerator:0"

pytestmark = pytest.mark.skipif(real_device(0).type != "cpu",
                                reason="figures of the embedded CPU device (CUDA: torch.cuda's)")


def _nbytes(*ts):
    return sum(t.untyped_storage().nbytes() for t in ts)


def test_allocated_follows_held_values_and_views_count_once():
    gc.collect()
    base = ra.memory_allocated()
    x = torch.randn(256, 256, device=DEV)
    v = x[:10]  # a view: same storage
    genie.materialize(x, v)
    ref = torch.randn(256, 256)
    assert ra.memory_allocated() - base == _nbytes(ref)
    y = x * 2
    genie.materialize(y)
    assert ra.memory_allocated() - base == 2 * _nbytes(ref)
    del x, v
    gc.collect()
    assert ra.memory_allocated() - base == _nbytes(ref)
    del y
    gc.collect()
    assert ra.memory_allocated() == base


def test_peak_counts_values_alive_inside_a_run_as_eager_holds_them():
    gc.collect()
    ra.reset_peak_memory_stats()
    start = ra.memory_allocated()
    assert ra.max_memory_allocated() == start
    x = torch.randn(128, 128, device=DEV)
    s = ((x * 2) + 1).sum()
    s.item()
    # eager: x, x*2 and (x*2)+1 alive at once (the temporary dies after the add)
    e = torch.randn(128, 128)
    assert ra.max_memory_allocated() - start == 3 * _nbytes(e)
    ra.reset_peak_memory_stats()
    assert ra.max_memory_allocated() == ra.memory_allocated()
    del x, s


def test_reserved_info_name_properties():
    assert ra.memory_reserved() >= ra.memory_allocated()
    assert ra.max_memory_reserved() >= ra.memory_reserved()
    free, total = ra.mem_get_info()
    assert 0 < free <= total
    assert ra.get_device_name().startswith("cpu")
    p = ra.get_device_properties(0)
    assert p.total_memory == total and p.real_device == "cpu"
    ra.empty_cache()  # nothing cached on the CPU: a no-op that must not fail


def test_streams_and_events_order_work_like_cuda():
    s = ra.Stream()
    assert ra.current_stream() == ra.default_stream()
    start, end = ra.Event(enable_timing=True), ra.Event(enable_timing=True)
    with ra.stream(s):
        assert ra.current_stream() is s
        start.record()
        y = (torch.ones(4, device=DEV) * 3).sum()
        end.record()
    assert ra.current_stream() == ra.default_stream()
    s.wait_stream(ra.default_stream())
    s.synchronize()
    end.synchronize()
    assert start.query() and s.query()
    assert start.elapsed_time(end) >= 0
    assert y.item() == 12.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        ra.Event().elapsed_time(ra.Event())


def test_bad_device_is_refused_like_cuda():
    with pytest.raises(ValueError, match="remote_accelerator"):
        ra.memory_allocated("cpu")
    with pytest.raises(genie.DeviceError):
        ra.memory_allocated(7)


def test_torch_accelerator_memory_api_gives_torch_remote_accelerators_figures():
    """torch.accelerator's memory functions ask the device type's allocator (it must be a
    c10::DeviceAllocator: Genie's was a plain one and torch's internal assert failed)."""
    acc = torch.accelerator
    assert acc.current_accelerator() == torch.device("remote_accelerator")
    gc.collect()
    acc.reset_peak_memory_stats()
    start = acc.memory_allocated()
    assert start == ra.memory_allocated() and acc.max_memory_allocated() == start
    x = torch.randn(128, 128, device=DEV)
    s = ((x * 2) + 1).sum()
    s.item()
    e = torch.randn(128, 128)
    assert acc.memory_allocated() == ra.memory_allocated() == start + _nbytes(e, s.cpu())
    assert acc.max_memory_allocated() == ra.max_memory_allocated() == start + 3 * _nbytes(e)
    stats = acc.memory_stats()
    assert stats["allocated_bytes.all.current"] == ra.memory_allocated()
    assert stats["allocated_bytes.all.peak"] == ra.max_memory_allocated()
    assert stats["reserved_bytes.all.current"] == acc.memory_reserved() == ra.memory_reserved()
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == acc.memory_allocated()
    acc.reset_accumulated_memory_stats()
    acc.empty_cache()
    free, total = acc.get_memory_info()
    assert 0 < free <= total == ra.mem_get_info()[1]
    del x, s
    with pytest.raises(RuntimeError, match="Invalid device argument 7"):  # as CUDA's allocator
        acc.memory_allocated(7)


def test_native_accounting_counts_live_storages_once_and_follows_resizes() -> None:
    """genie._C._mem_hold (csrc/memory.cpp), on an index no run uses: distinct live storages,
    views once, a storage resized in place at its new size, the dead pruned, non-tensors skipped."""
    from genie import _C

    idx = 63
    base = _C._mem_allocated(idx)
    a, b = torch.zeros(10), torch.zeros(3, dtype=torch.float64)
    assert _C._mem_hold(idx, [a, a[2:], b, "handle", None]) - base == 40 + 24
    a.resize_(100)  # the same storage, grown
    assert _C._mem_hold(idx, [a]) - base == 400 + 24
    del a
    assert _C._mem_allocated(idx) - base == 24
    del b
    assert _C._mem_allocated(idx) == base


def test_native_accounting_keeps_its_index_when_storages_die_in_between() -> None:
    """The held storages are an array pruned in place (csrc/memory.cpp): after storages die
    before, between and after live ones, the survivors are found again (a resize counts once, at
    the new size) and a new storage is added once, whatever moved."""
    from genie import _C

    idx = 62
    base = _C._mem_allocated(idx)
    ts = [torch.zeros(k + 1) for k in range(8)]  # 4, 8, ..., 32 bytes
    assert _C._mem_hold(idx, ts) - base == 4 * sum(range(1, 9))
    for k in (0, 3, 4, 7):  # dead: the first, two in the middle, the last
        ts[k] = None
    live = [t for t in ts if t is not None]
    assert _C._mem_allocated(idx) - base == sum(t.nbytes for t in live)
    live[-1].resize_(50)  # a survivor that moved: found again, counted at its new size
    new = torch.zeros(5)
    assert _C._mem_hold(idx, [live[-1], new, new[1:], live[0]]) - base == \
        sum(t.untyped_storage().nbytes() for t in live) + 20
    del ts, live, new
    assert _C._mem_allocated(idx) == base
