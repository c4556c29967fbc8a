"""Leaving the dispatch modes a program has active, cheaply: the bottom of the core (imports
nothing from Genie), so every layer that runs real or meta kernels can use it."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.utils._python_dispatch import _disable_current_modes

_NO_MODES = contextlib.nullcontext()
_len_modes = torch._C._len_torch_dispatch_stack
# torch's pre-dispatch mode stack (one object for the process, torch._ops): its slots read
# directly, where this torch has them, instead of _len_torch_dispatch_stack_pre_dispatch()'s
# list comprehension (~0.8 µs per call)
_pre_state = torch._ops.mode_stack_state_for_pre_dispatch()
_pre_slots = getattr(_pre_state, "_ModeStackStateForPreDispatch__infra_modes", None)
if type(_pre_slots) is not list or not hasattr(_pre_state, "_schema_check_mode"):
    _pre_slots = None


def disable_modes() -> Any:
    """torch's ``_disable_current_modes()`` (run with no ``TorchDispatchMode`` active), with the
    common case - no mode on either stack - a shared no-op context: torch's function imports
    three modules and pops the stacks through a generator on every call (~8 µs), and genie
    enters it per materialization, per forced run (``.item()``) and per meta kernel call."""
    if _len_modes() == 0 and (_pre_state._schema_check_mode is None and not any(_pre_slots)
                              if _pre_slots is not None else
                              _len_torch_dispatch_stack_pre_dispatch() == 0):
        return _NO_MODES
    return _disable_current_modes()
