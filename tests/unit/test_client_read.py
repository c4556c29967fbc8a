"""A downloaded value read into a host tensor (``genie.remote.client._host_tensor``): a
one-element value of a plain dtype is read as its number (one ``torch.full``), everything else
as bytes (``genie.remote.protocol.frame_tensor``). Both must give the tensor eager's bytes give:
the same bits (``-0.0``, infinities, extremes; NaN and subnormals take the bytes' way), dtype,
shape and strides; a reply's bad metadata is a protocol error, not a wrong tensor."""

from __future__ import annotations

import math
import struct

import pytest
import torch

client = pytest.importorskip("genie.remote.client")
protocol = pytest.importorskip("genie.remote.protocol")
from genie.remote import ProtocolError  # noqa: E402

_VALUES = {
    torch.bool: [False, True],
    torch.uint8: [0, 1, 255],
    torch.int8: [-128, 0, 127],
    torch.int16: [-32768, 7, 32767],
    torch.int32: [-2**31, -1, 2**31 - 1],
    torch.int64: [-2**63, 0, 2**63 - 1],
    torch.float16: [0.0, -0.0, 1.5, -65504.0, math.inf, -math.inf, math.nan, 6e-8],
    torch.float32: [0.0, -0.0, 3.25, 3.4028234663852886e38, -math.inf, math.nan, 1e-45, 1e-40],
    torch.float64: [0.0, -0.0, 0.1, 1.7976931348623157e308, math.inf, math.nan, 5e-324],
    torch.bfloat16: [0.0, -0.0, 1.5, math.nan],
    torch.complex64: [complex(1.5, -0.0)],
}


def _bits(t: torch.Tensor) -> bytes:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))
    return bytes(flat.view(torch.uint8).tolist())


def _expected(want: torch.Tensor) -> torch.Tensor:
    """What the bytes' way reads (the reference): the frame as the server sends it."""
    buf = memoryview(bytearray(_bits(want)))
    ref = protocol.FrameRef(0, want.dtype, tuple(want.shape), tuple(want.stride()))
    return protocol.frame_tensor(buf, ref, True)


@pytest.mark.parametrize("dtype", list(_VALUES), ids=str)
@pytest.mark.parametrize("shape,stride", [((), ()), ((1,), (1,)), ((1, 1), (1, 1)),
                                          ((1, 1), (4, 1)), ((1, 1, 1), (7, 0, 3))])
def test_one_element_reads_are_the_bytes(dtype, shape, stride):
    for v in _VALUES[dtype]:
        want = torch.empty_strided(shape, stride, dtype=dtype)
        want.fill_(v)
        m = [protocol.dtype_name(dtype), list(shape), list(stride)]
        got = client._host_tensor(memoryview(bytearray(_bits(want))), m)
        ref = _expected(want)
        assert got.dtype == dtype and got.shape == want.shape and got.stride() == want.stride()
        assert _bits(got) == _bits(want) == _bits(ref), (dtype, v)
        assert got._genie_own
        # without strides (a dense frame): the contiguous tensor
        got = client._host_tensor(memoryview(bytearray(_bits(want))),
                                  [protocol.dtype_name(dtype), list(shape), None])
        assert got.stride() == torch.empty(shape).stride() and _bits(got) == _bits(want)


@pytest.mark.parametrize("fmt,dtype", [("<e", torch.float16), ("<f", torch.float32),
                                       ("<d", torch.float64)])
def test_a_subnormal_keeps_its_bits_where_denormals_flush(fmt, dtype):
    """A subnormal goes the bytes' way: in flush-denormal mode (where the CPU has it) the
    unpacking reads it as 0.0, which is not taken for a zero unless its bits are one."""
    tiny = torch.finfo(dtype).tiny
    cases = [struct.pack(fmt, tiny / 4), struct.pack(fmt, -tiny / 4), struct.pack(fmt, 0.0),
             struct.pack(fmt, -0.0), struct.pack(fmt, tiny)]
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        got = [client._host_tensor(memoryview(bytearray(b)), [protocol.dtype_name(dtype), [], None])
               for b in cases]
    finally:
        torch.set_flush_denormal(False)
    assert [_bits(t) for t in got] == cases


def test_one_element_reads_refuse_bad_metadata():
    b = memoryview(bytearray(struct.pack("<f", 2.0)))
    for stride in ([-1], [1, 1], [1.5]):  # negative, of another rank, not ints
        with pytest.raises(ProtocolError):
            client._host_tensor(b, ["float32", [1], stride])
    with pytest.raises(ProtocolError):  # the frame's size is not the dtype's: the bytes' check
        client._host_tensor(memoryview(bytearray(8)), ["float32", [1], None])
    with pytest.raises(ProtocolError):
        client._host_tensor(b, ["no-such-dtype", [1], None])
