"""Tensors built on received frames (issue 27, finding 2).

ZeroMQ places a frame at any offset (8 mod 16 is common); a kernel may assume its dtype's
alignment (a complex128 copy from 8 mod 16 bytes crashed the server, and Genie's own client on
``.item()``). :func:`genie.remote.protocol.frame_tensor` must give eager's values for every wire
dtype, element count and byte offset, on memory aligned as torch's allocator aligns it.
"""

from __future__ import annotations

import pytest
import torch

from genie.remote.protocol import ALIGN, WIRE_DTYPES, FrameRef, frame_tensor, tensor_frame


def _values(dtype: torch.dtype, n: int) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.arange(n) % 2 == 0
    x = torch.arange(n, dtype=torch.float64) * 3 + 1
    if dtype.is_complex:
        return (x + 1j * (x + 0.5)).to(dtype)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES, key=str), ids=str)
def test_every_dtype_count_and_offset(dtype: torch.dtype) -> None:
    for n in (1, 2, 3, 5, 7, 33):
        x = _values(dtype, n)
        raw = bytes(tensor_frame(x)[0])
        for offset in range(16):
            buf = bytearray(offset + len(raw) + ALIGN)
            # the frame starts ``offset`` bytes past a 64-byte boundary of the buffer
            base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
            start = (-base) % ALIGN + offset
            buf[start:start + len(raw)] = raw
            view = memoryview(buf)[start:start + len(raw)]
            for copy in (False, True):
                t = frame_tensor(view, FrameRef(0, dtype, (n,), None), copy=copy)
                assert t.data_ptr() % ALIGN == 0 or offset == 0, (dtype, n, offset)
                assert t.dtype == dtype and t.shape == (n,)
                assert torch.equal(t.view(torch.uint8), x.view(torch.uint8)), (dtype, n, offset)
                try:
                    want = x.sum()
                except (RuntimeError, NotImplementedError):  # eager has no sum for this dtype
                    continue
                got = t.sum()  # a reduction reads the frame's memory with the dtype's loads
                assert got.reshape(1).view(torch.uint8).equal(want.reshape(1).view(torch.uint8)), \
                    (dtype, n, offset)


@pytest.mark.parametrize("view", ["diag1", "col1", "row_of_t", "every_other1", "dense_t"])
def test_views_whose_size_one_dims_have_any_stride(view: str) -> None:
    """A contiguous tensor may have any stride on a size-1 dimension (one element of a diagonal:
    shape (1,), stride (4,)); its frame is still its bytes (OpInfo diagonal-out through a server
    failed with "stride(-1) must be 1 to view Float as Byte")."""
    x = torch.arange(24.0).view(4, 6)
    v = {"diag1": torch.diagonal(x)[:1], "col1": x[:1, 2:3], "row_of_t": x.t()[1:2, :1],
         "every_other1": x[::2, ::3][:1, :1], "dense_t": x.t()}[view]
    buf, (dt, shape, stride) = tensor_frame(v)
    got = frame_tensor(memoryview(bytes(buf)), FrameRef(0, v.dtype, tuple(shape),
                                                         tuple(stride) if stride else None),
                       copy=True)
    assert torch.equal(got, v) and got.shape == v.shape


@pytest.mark.parametrize("n", [1, 3, 4096], ids=["scalar", "three", "4096"])
def test_a_copy_is_a_tensor_of_its_own_as_eagers(n: int) -> None:
    """A copied frame (a downloaded value a program reads) owns fresh, writable, resizable
    memory of torch's allocator, as a tensor eager made: the frame's memory may be reused."""
    x = _values(torch.float64, n)
    buf = bytearray(bytes(tensor_frame(x)[0]))
    t = frame_tensor(memoryview(buf), FrameRef(0, torch.float64, (n,), None), copy=True)
    buf[:] = bytes(len(buf))
    assert torch.equal(t, x) and t.data_ptr() % ALIGN == 0
    t.add_(1)
    t.resize_(2 * n)  # eager's tensors may grow (a bytearray's storage may not)
    assert t.untyped_storage().nbytes() == 2 * n * 8
