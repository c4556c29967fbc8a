"""How ``torch.compile`` sees Genie: Dynamo never traces Genie's own code.

``torch.compile(f)`` over ``remote_accelerator`` tensors compiles ``f``'s Python as usual; each op
on a LazyTensor reaches Genie's ``__torch_dispatch__`` and is recorded, as in eager mode, and
values still materialize only when the program asks for them. Genie's entry points (the dispatch
hook, the factory and copy kernels, the materialization triggers) are marked for Dynamo's frame
evaluator as "skip, recursively": Dynamo runs them as plain Python instead of trying to compile
Genie's internals frame by frame (which would warn about ``_make_wrapper_subclass``, an untraceable
builtin, and spend seconds compiling recording code). To compile the *kernels*, use Genie's
``compiled`` backend (``GENIE_BACKENDS=compiled,eager``, see docs/backends.md): it applies
``torch.compile`` to each recorded tape.

Invariant: marking uses ``torch._C._dynamo.eval_frame`` (part of ``torch._C``), so it costs no
``import torch._dynamo`` at ``import genie``; it is idempotent.
"""

from __future__ import annotations

from typing import Any

_done = False


def install() -> None:
    """Mark Genie's entry points as skipped (recursively) by Dynamo's frame evaluator."""
    global _done
    if _done:
        return
    try:
        from torch._C._dynamo import eval_frame as ef
    except ImportError:  # a torch without Dynamo: nothing to steer
        return
    from . import factories, lazy_tensor

    skip = ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.SKIP)
    lt = lazy_tensor.LazyTensor
    # __torch_dispatch__ is native (csrc/record.cpp) where the build has it: its Python code
    # starts at lazy_tensor._dispatch.
    dispatch = getattr(lt.__torch_dispatch__, "__func__", lt.__torch_dispatch__)
    fns: list[Any] = [lazy_tensor._dispatch, lt.__repr__, lt.__format__, lt.numpy,
                      lt.tolist, lt.__reduce_ex__, lt.data.fget, lt.data.fset,
                      lazy_tensor.record_factory, lazy_tensor.copy_from, lazy_tensor.materialize]
    if hasattr(dispatch, "__code__"):
        fns.append(dispatch)
    for fn in fns:
        ef.set_code_exec_strategy(fn.__code__, skip)
    _done = True
