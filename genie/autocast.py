"""``torch.autocast("remote_accelerator")``: the AutocastPrivateUse1 dispatch key's kernels.

PyTorch registers autocast kernels for CPU and CUDA in C++ only; a PrivateUse1 device gets none,
so every op under ``torch.autocast("remote_accelerator", ...)`` found no kernel. Genie registers,
through ``torch.library``:

- a fallthrough for every op (ops autocast leaves alone run as usual);
- a casting kernel for the ops on which CPU's and CUDA's autocast policies agree: the matmul and
  convolution family runs in the autocast dtype (``lower_precision_fp``), the losses and
  reductions listed in :data:`FP32` in float32. Tensors on ``remote_accelerator`` with a floating
  dtype are cast (recorded ``_to_copy`` nodes), others pass through, as autocast's ``cached_cast``
  does. The weight cast cache of CUDA autocast is not kept: a cast is recorded per call.

Invariants: the lists below are checked against CPU autocast by ``tests/unit/test_autocast.py``
(same output dtypes and values); registration is idempotent.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import config

#: run in the autocast dtype (torch.get_autocast_dtype("remote_accelerator")); CPU ∩ CUDA lists
LOWER_PRECISION = ("conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
                   "addbmm", "linear", "matmul", "conv_tbc", "conv_transpose1d",
                   "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention")
#: run in float32; CPU ∩ CUDA lists
FP32 = ("prod", "cdist", "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "l1_loss", "huber_loss",
        "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits",
        # CPU's; CUDA reaches the same float32 result through log_softmax and nll_loss (both
        # float32 there), so the two agree on what cross_entropy computes
        "cross_entropy_loss")

_KEY = "AutocastPrivateUse1"
_libs: list[Any] = []


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.dtype != dtype and x.device.type == "remote_accelerator":
            return x.to(dtype)
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _kernel(op: Any, fp32: bool) -> Any:
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def autocast_kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.float32 if fp32 else torch.get_autocast_dtype("remote_accelerator")
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})

    return autocast_kernel


def default_dtype() -> torch.dtype:
    """The autocast dtype of the real device the embedded default runs on (``GENIE_DEVICE``,
    else CUDA where present, else the CPU): float16 on CUDA, bfloat16 on the CPU, torch's own
    defaults for those devices, so ``torch.autocast("remote_accelerator")`` computes in the dtype
    the same program would on the real device."""
    real = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.get_autocast_dtype(torch.device(real).type)


def register() -> None:
    """Register the fallthrough and the casting kernels, and set the default autocast dtype of
    ``remote_accelerator`` to :func:`default_dtype` (idempotent)."""
    if _libs:
        return
    torch.set_autocast_dtype("remote_accelerator", default_dtype())
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, _KEY)
    lib = torch.library.Library("aten", "IMPL")
    for names, fp32 in ((LOWER_PRECISION, False), (FP32, True)):
        for name in names:
            packet = getattr(torch.ops.aten, name)
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if op._schema.is_mutable:  # out= variants: autocast registers functional ones
                    continue
                lib.impl(name if overload == "default" else f"{name}.{overload}",
                         _kernel(op, fp32), _KEY)
    _libs.extend((fallback, lib))
