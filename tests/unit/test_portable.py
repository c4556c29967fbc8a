"""Ops whose kernel (or whose dtype's kernel) only CUDA has, recorded as their portable
decomposition (genie.portable), so they run on any real device with CUDA's results.

``histc`` of an integral tensor: the CPU has no kernel (eager on the CPU raises
``"histogram_cpu" not implemented``), CUDA counts in integer arithmetic. The oracle is eager's
float ``histc`` of the same (small) integers, cast back: bin ``floor((v - min) * bins / (max -
min))`` is the same number in both arithmetics for these values.
"""

from __future__ import annotations

import pytest
import torch

import genie  # noqa: F401

D = "remote_accelerator"
INTEGRAL = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", INTEGRAL)
@pytest.mark.parametrize("bins,lo,hi", [(4, 0, 3), (7, 0, 0), (5, -3, 20), (3, 2, 9), (10, 5, 5),
                                        (6, 1.7, 9.2)])
def test_integral_histc_counts_as_cuda(dtype: torch.dtype, bins: int, lo: float, hi: float) -> None:
    g = torch.Generator().manual_seed(bins)
    if dtype == torch.uint8 and lo < 0:
        with pytest.raises(RuntimeError, match="cannot be converted to type uint8_t"):
            torch.histc(torch.zeros(3, dtype=dtype, device=D), bins=bins, min=lo, max=hi)
        return
    low = 0 if dtype == torch.uint8 else -5
    x = torch.randint(low, 25, (3, 17), generator=g).to(dtype)
    got = torch.histc(x.to(D), bins=bins, min=lo, max=hi)
    # CUDA converts the bounds to the input's type (truncation), as int() does
    expected = torch.histc(x.double(), bins=bins, min=int(lo), max=int(hi)).to(dtype)
    assert got.dtype == dtype and got.shape == (bins,) and got.device.type == D
    assert torch.equal(got.cpu(), expected)


def test_integral_histc_of_one_value_and_of_nothing() -> None:
    x = torch.full((5,), 7, dtype=torch.int32)  # min == max in the data: [6, 8]
    assert torch.equal(torch.histc(x.to(D), bins=4).cpu(),
                       torch.histc(x.float(), bins=4).int())
    empty = torch.zeros(0, dtype=torch.int64)
    assert torch.equal(torch.histc(empty.to(D), bins=3).cpu(), torch.zeros(3, dtype=torch.int64))


def test_integral_histc_is_recorded_not_run() -> None:
    """Explicit bounds: no value is needed at the call (the decomposition records lazily)."""
    x = torch.arange(12, dtype=torch.int32).to(D)
    genie.reset_stats()
    h = torch.histc(x * 2, bins=4, min=0, max=22)
    assert genie.stats().get("materializations", 0) == 0
    assert torch.equal(h.cpu(), torch.histc(torch.arange(12.) * 2, bins=4, min=0, max=22).int())


@pytest.mark.parametrize("kwargs,message", [
    ({"bins": 0}, "bins must be > 0"),
    ({"bins": 3, "min": 4, "max": 1}, "max must be larger than min"),
])
def test_integral_histc_refuses_what_eager_refuses(kwargs: dict, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.histc(torch.tensor([1.0, 2.0]), **kwargs)  # eager's float check, the same words
    with pytest.raises(RuntimeError, match=message):
        torch.histc(torch.tensor([1, 2]).to(D), **kwargs)


def test_float_histc_records_histc_itself() -> None:
    x = torch.randn(50, generator=torch.Generator().manual_seed(0))
    got = torch.histc(x.to(D), bins=6, min=-1, max=1)
    assert torch.equal(got.cpu(), torch.histc(x, bins=6, min=-1, max=1))
    assert got._node.op is torch.ops.aten.histc.default
