"""PyTorch fast paths that need tensor kinds Genie does not record, steered to dense equivalents.

``nn.TransformerEncoder`` in inference (eval, no grad, ``batch_first``, a ``src_key_padding_mask``)
takes a nested-tensor fast path on every PrivateUse1 device: it packs the unpadded tokens into a
nested tensor (``aten._nested_tensor_from_mask``), runs the layers on it, and pads the result back
with zeros (``to_padded_tensor(0.0)``) before the final norm. ``remote_accelerator`` tensors are
dense and strided only, so for them the same result is computed densely: the layers run on the
padded batch with the padding mask (padded keys never reach a valid token's attention, and every
other sublayer is per token), the padded positions are then set to zero, and the norm follows,
exactly where eager applies it.

Invariants: the steer applies only when the input is a ``LazyTensor`` and eager would take the
nested path (the same conditions, checked in the same order); every other call runs PyTorch's own
``forward`` unchanged. Installing is idempotent.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from .lazy_tensor import LazyTensor

_installed = False


def install() -> None:
    """Wrap ``nn.TransformerEncoder.forward`` with the dense steer (idempotent)."""
    global _installed
    if _installed:
        return
    cls = torch.nn.TransformerEncoder
    original = cls.forward

    def forward(self: Any, src: torch.Tensor, mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None,
                is_causal: bool | None = None) -> torch.Tensor:
        if type(src) is LazyTensor and _takes_nested_path(self, src, mask, src_key_padding_mask):
            return _dense_encoder(self, src, src_key_padding_mask, is_causal)
        return original(self, src, mask, src_key_padding_mask, is_causal)

    forward.__doc__ = original.__doc__
    forward.__wrapped__ = original  # type: ignore[attr-defined]
    cls.forward = forward
    _installed = True


def _takes_nested_path(enc: Any, src: torch.Tensor, mask: Any, pad: Any) -> bool:
    """Whether ``TransformerEncoder.forward`` (torch 2.13) would convert ``src`` to nested."""
    if pad is None or mask is not None or src.dim() != 3:
        return False
    if not torch.backends.mha.get_fastpath_enabled() or \
            not getattr(enc, "use_nested_tensor", False):
        return False
    first = enc.layers[0]
    if first.training or torch.is_autocast_enabled() or torch.compiler.is_compiling():
        return False
    canon = _canonical(pad, src)
    if getattr(enc, "mask_check", True) and \
            not torch._nested_tensor_from_mask_left_aligned(src, canon.logical_not()):
        return False
    params = (first.self_attn.in_proj_weight, first.self_attn.in_proj_bias,
              first.self_attn.out_proj.weight, first.self_attn.out_proj.bias,
              first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
              first.linear1.weight, first.linear1.bias, first.linear2.weight, first.linear2.bias)
    return not (torch.is_grad_enabled() and
                (src.requires_grad or any(p is not None and p.requires_grad for p in params)))


def _canonical(pad: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return F._canonical_mask(mask=pad, mask_name="src_key_padding_mask",
                             other_type=None, other_name="", target_type=src.dtype)


def _dense_encoder(enc: Any, src: torch.Tensor, pad: torch.Tensor,
                   is_causal: bool | None) -> torch.Tensor:
    canon = _canonical(pad, src)
    out = src
    for layer in enc.layers:
        out = layer(out, src_mask=None, is_causal=bool(is_causal),
                    src_key_padding_mask=canon)
    # to_padded_tensor(0.0): a padded position of the nested result is zero
    out = out.masked_fill((canon != 0).unsqueeze(-1), 0.0)
    if enc.norm is not None:
        out = enc.norm(out)
    return out
