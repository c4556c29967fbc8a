"""``torch.backends`` entry point of the genie-remote-accelerator distribution.

``import torch`` imports every ``torch.backends`` entry point and turns any exception into
``RuntimeError: Failed to load the backend extension``. This module has a name no other project
uses, so torch always finds it; it then registers the device only if the ``genie`` that Python
would import is the package installed beside it. A different ``genie`` (a folder named ``genie`` in
the working directory, another distribution) gets a warning and is left alone: ``import torch``
never breaks because of Genie. Beside another accelerator (a CUDA GPU) it registers nothing:
see :func:`accelerator_beside`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings


def accelerator_beside() -> str | None:
    """The accelerator this process could also use, found without initializing it (its
    driver's device node, for a torch built for it), or None.

    Registering ``remote_accelerator`` (PyTorch's PrivateUse1) makes it torch's one accelerator
    (``at::getAccelerator()`` prefers PrivateUse1 whenever it is named), and PyTorch's autograd
    engine then cannot run a backward over that other device's tensors in the process (an
    internal assert, ``opt_ready_stream && opt_parent_stream``: pytorch/pytorch#161129). So
    ``import torch`` does not register the device beside one (see :func:`autoload`)."""
    import torch

    # (a process that hides every GPU, CUDA_VISIBLE_DEVICES empty or -1, has none in reach)
    shown = os.environ.get("CUDA_VISIBLE_DEVICES", "all").strip() not in ("", "-1")
    if shown and getattr(torch.version, "cuda", None) and any(
            os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version")):
        return "cuda"
    if shown and getattr(torch.version, "hip", None) and os.path.exists("/dev/kfd"):
        return "cuda"  # ROCm's torch device type
    mps = getattr(torch.backends, "mps", None)
    if sys.platform == "darwin" and mps is not None and mps.is_built():
        return "mps"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and getattr(xpu, "_is_compiled", lambda: False)():
        return "xpu"
    return None


def _wanted() -> bool:
    """Whether ``import torch`` registers the device (``GENIE_AUTOLOAD``: ``1`` always, ``0``
    never, unset or ``auto``: unless :func:`accelerator_beside` finds another accelerator, whose
    eager autograd the registration would break; ``import genie`` registers it in any case)."""
    v = os.environ.get("GENIE_AUTOLOAD", "") or "auto"
    if v not in ("0", "1", "auto"):
        warnings.warn(f"genie-remote-accelerator: GENIE_AUTOLOAD={v!r} is not 0, 1 or auto; "
                      "using auto", RuntimeWarning, stacklevel=3)
        v = "auto"
    return v == "1" or (v == "auto" and accelerator_beside() is None)


def autoload() -> None:
    """Register ``remote_accelerator`` when ``genie`` is this distribution's package, unless
    another accelerator is in reach (:func:`_wanted`): a CUDA program on a GPU machine where Genie
    is installed must run as without it, its backward included. There ``import genie`` (or
    ``GENIE_AUTOLOAD=1``) registers the device."""
    if not _wanted():
        return
    here = os.path.dirname(os.path.abspath(__file__))
    mine = os.path.join(here, "genie", "__init__.py")
    mod = sys.modules.get("genie")
    try:
        spec = mod.__spec__ if mod is not None else importlib.util.find_spec("genie")
        origin = spec.origin if spec is not None else None
        if origin is None and spec is not None:  # a folder without __init__.py
            origin = ", ".join(spec.submodule_search_locations or ())
    except (ImportError, ValueError):
        origin = None
    if not origin or not os.path.isfile(origin) or not os.path.exists(mine) or \
            not os.path.samefile(origin, mine):
        warnings.warn(
            f"genie-remote-accelerator: the 'genie' Python would import ({origin}) is not the "
            f"package installed with this entry point ({mine}); remote_accelerator is not "
            "registered on 'import torch'. Rename or move that 'genie', or run from another "
            "directory.", RuntimeWarning, stacklevel=2)
        return
    import genie

    genie._autoload()
