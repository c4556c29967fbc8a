"""A worker's reply frames (``genie.remote.protocol.tensor_frames``): one native pass
(``genie._C._frames_of``) for contiguous CPU tensors, ``tensor_frame`` one by one otherwise;
either way the metadata and bytes ``tensor_frame`` gives, and a buffer that holds its tensor.
"""

from __future__ import annotations

import gc

import pytest
import torch

from genie import _C
from genie.remote.protocol import (
    _DTYPE_NAME,
    FrameRef,
    dtype_of,
    frame_tensor,
    frame_view,
    tensor_frame,
    tensor_frames,
)

DENSE = [
    torch.arange(12, dtype=torch.float32).view(3, 4),
    torch.arange(10, dtype=torch.int64)[3:],  # an offset into its storage
    torch.tensor([True, False, True]),
    torch.randn(2, 3, dtype=torch.complex64),
    torch.randn(5, dtype=torch.bfloat16),
    torch.tensor(3.5, dtype=torch.float64),  # 0-d
    torch.zeros(1, 1).expand(1, 1),  # one element, any strides
    torch.randn(4, 1, 3).transpose(0, 1),  # contiguous by a size-1 dimension's stride
]
OTHERS = [
    torch.randn(3, 4).t(),  # dense, not contiguous: strides sent
    torch.randn(4, 4)[:, ::2],  # not dense: copied
    torch.zeros(0, 3),  # no elements
    torch.randn(3, dtype=torch.complex64).conj(),  # a conj bit
    torch.randn(3).requires_grad_(),
]


def _same(vals: list[torch.Tensor]) -> None:
    metas, bufs = tensor_frames(vals)
    assert len(metas) == len(bufs) == len(vals)
    for v, meta, buf in zip(vals, metas, bufs, strict=True):
        want_buf, want_meta = tensor_frame(v)
        assert meta == want_meta and type(meta) is list
        assert frame_view(buf).tobytes() == frame_view(want_buf).tobytes()
        dt, shape, stride = meta
        back = frame_tensor(buf, FrameRef(0, dtype_of(dt), tuple(shape),
                                          None if stride is None else tuple(stride)), copy=True)
        torch.testing.assert_close(back, v.detach().resolve_conj(), rtol=0, atol=0)


def test_contiguous_values_are_framed_in_one_native_pass() -> None:
    assert _C._frames_of(DENSE, _DTYPE_NAME) is not None
    _same(DENSE)


@pytest.mark.parametrize("other", range(len(OTHERS)))
def test_any_other_value_frames_them_all_as_tensor_frame_does(other: int) -> None:
    vals = [*DENSE[:2], OTHERS[other], DENSE[3]]
    if other != len(OTHERS) - 1:  # (requires_grad alone is no reason to leave the native pass)
        assert _C._frames_of(vals, _DTYPE_NAME) is None
    _same(vals)


def test_not_a_tensor_or_an_unnamed_dtype_is_left_to_python() -> None:
    assert _C._frames_of([torch.ones(2), 3.0], _DTYPE_NAME) is None
    assert _C._frames_of([torch.ones(2)], {}) is None
    with pytest.raises(TypeError):
        _C._frames_of([torch.ones(2)], [])


def test_a_buffer_holds_its_tensor_and_is_read_only() -> None:
    _, (buf,) = tensor_frames([torch.arange(100_000, dtype=torch.int32) * 3])
    gc.collect()
    m = memoryview(buf)
    assert m.readonly and m.nbytes == 400_000 and m.format == "B"
    assert torch.frombuffer(bytearray(m), dtype=torch.int32)[-1].item() == 299_997
