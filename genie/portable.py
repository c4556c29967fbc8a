"""Portable implementations of ops (or dtypes of ops) that only have a CUDA kernel.

PyTorch's composite RNN code (``aten::lstm``, ``aten::gru``) picks its fused cell kernels
(``_thnn_fused_lstm_cell`` and friends) for every non-CPU device, ``PrivateUse1`` included. Those
ops have kernels for CUDA only (and meta), so a recorded graph holding them could not run on a
CPU, wherever the values are computed. Genie records such an op as its portable decomposition
into ordinary ATen ops instead: :func:`~genie.lazy_tensor.record` calls the function registered
here on the LazyTensors, below autograd, so each op it issues is recorded as usual and the graph
runs on any real device. Autograd still sees the fused op (its backward formula calls the fused
backward op, which is decomposed the same way), so gradients follow eager CUDA's formulas.

The decompositions reproduce the CUDA kernels' arithmetic and their workspace layouts
(``aten/src/ATen/native/cuda/RNN.cu``), so the fused forward and backward ops stay consistent.
Libraries also pick dtypes only CUDA's kernels take when the device is not the CPU (``histc`` of
integers): a portable kernel returns ``NotImplemented`` for the calls whose dtypes every device
runs, and those record the op itself.

Registry: :func:`register` (refuses duplicates); :func:`portable_kernel` looks an op up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

_KERNELS: dict[Any, Callable[..., Any]] = {}


def register(op: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register the portable implementation of the ``OpOverload`` ``op``."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if op in _KERNELS:
            raise RuntimeError(f"[genie.portable] {op} already has a portable kernel "
                               f"({_KERNELS[op].__name__}); remove one of the registrations.")
        _KERNELS[op] = fn
        return fn
    return wrap


def portable_kernel(op: Any) -> Callable[..., Any] | None:
    """The portable implementation recorded in place of ``op``, or None (record ``op`` itself)."""
    return _KERNELS.get(op)


@register(aten._thnn_fused_lstm_cell.default)
def _lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
               input_bias: torch.Tensor | None = None,
               hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    # workspace: the activated gates, which the backward kernel reads
    return hy, cy, torch.cat([i, f, g, o], 1)


@register(aten._thnn_fused_lstm_cell_backward_impl.default)
def _lstm_cell_backward(grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None,
                        cx: torch.Tensor, cy: torch.Tensor, workspace: torch.Tensor,
                        has_bias: bool) -> tuple[torch.Tensor | None, ...]:
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    go = grad_hy if grad_hy is not None else torch.zeros_like(cy)
    gcx = go * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        gcx = gcx + grad_cy
    grad_gates = torch.cat([gcx * g * (1 - i) * i, gcx * cx * (1 - f) * f,
                            gcx * i * (1 - g * g), go * tanh_cy * (1 - o) * o], 1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, gcx * f, grad_bias


@register(aten._thnn_fused_gru_cell.default)
def _gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
              input_bias: torch.Tensor | None = None,
              hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if input_bias is not None:
        input_gates = input_gates + input_bias
        hidden_gates = hidden_gates + hidden_bias
    ir, ii, in_ = input_gates.chunk(3, 1)
    hr, hi, hn = hidden_gates.chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (ii + hi).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    # workspace: r, z, the hidden part of the new gate, hx and n (the backward kernel's inputs)
    return hy, torch.cat([r, z, hn, hx, n], 1)


@register(aten._thnn_fused_gru_cell_backward.default)
def _gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor,
                       has_bias: bool) -> tuple[torch.Tensor | None, ...]:
    r, z, hn, hx, n = workspace.chunk(5, 1)
    gz = grad_hy * (hx - n) * (1 - z) * z
    ghx = grad_hy * z
    gin = grad_hy * (1 - z) * (1 - n * n)
    ghn = gin * r
    gr = gin * hn * (1 - r) * r
    grad_input_gates = torch.cat([gr, gz, gin], 1)
    grad_hidden_gates = torch.cat([gr, gz, ghn], 1)
    if has_bias:
        return (grad_input_gates, grad_hidden_gates, ghx, grad_input_gates.sum(0),
                grad_hidden_gates.sum(0))
    return grad_input_gates, grad_hidden_gates, ghx, None, None


_C_TYPE = {torch.uint8: "uint8_t", torch.int8: "int8_t", torch.int16: "int16_t",
           torch.int32: "int32_t", torch.int64: "int64_t"}
_HISTC_INTEGRAL = frozenset(_C_TYPE)


@register(aten.histc.default)
def _histc(x: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0) -> Any:  # noqa: A002
    """``histc`` of an integral tensor, which CUDA computes and the CPU has no kernel for
    (``"histogram_cpu" not implemented for 'Int'``). Libraries call it on any non-CPU device:
    transformers' mixture-of-experts layers count tokens per expert with
    ``histc(ids.int(), ...)`` everywhere but on ``cpu``/``mps``. Recorded as CUDA's arithmetic
    (``SummaryOps.cu``): the bounds converted to the input's type, the data's own extremes when
    they are equal, widened by one when those are equal too; a value ``v`` in ``[min, max]``
    counts in bin ``(v - min) * bins // (max - min)`` (integer arithmetic; ``max`` in the last
    bin), in the input's dtype. Floating inputs record ``histc`` itself."""
    if x.dtype not in _HISTC_INTEGRAL:
        return NotImplemented
    # the meta kernel's checks (bins > 0, max > min), with eager's messages, at the call
    aten.histc.default(torch.empty(x.shape, dtype=x.dtype, device="meta"), bins, min, max)
    lo, hi = int(min), int(max)
    info = torch.iinfo(x.dtype)
    for bound in (lo, hi):  # c10's checked Scalar conversion, as CUDA's kernel takes its bounds
        if not info.min <= bound <= info.max:
            raise RuntimeError(f"value cannot be converted to type {_C_TYPE[x.dtype]} without "
                               "overflow")
    v = x.reshape(-1).long()
    if lo == hi and v.numel() > 0:  # a sync, as CUDA's kernel reads the extremes back too
        lo, hi = int(v.min().item()), int(v.max().item())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    counted = (v >= lo) & (v <= hi)
    b = torch.div((v - lo) * bins, hi - lo, rounding_mode="floor").clamp_(0, bins - 1)
    b = torch.where(counted, b, bins)  # outside [min, max]: one bin past the end, dropped
    out = torch.zeros(bins + 1, dtype=x.dtype, device=x.device)
    out.scatter_add_(0, b, torch.ones_like(b, dtype=x.dtype))
    return out[:bins].clone()
