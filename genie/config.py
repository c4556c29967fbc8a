"""Genie's in-process settings, read from ``GENIE_*`` environment variables once at import.

``GENIE_DEVICE``, ``GENIE_DEVICE_COUNT``, ``GENIE_META_CACHE``, ``GENIE_RECORD_SOURCE``,
``GENIE_GC_UNTRACK``, ``GENIE_NATIVE_RECORD``, ``GENIE_NATIVE_RECORD_MISS``, ``GENIE_GENERIC_META``, ``GENIE_NATIVE_BIND``,
``GENIE_NATIVE_MATCH``, ``GENIE_NATIVE_SLICE``, ``GENIE_NATIVE_REPLAY``, ``GENIE_FOREACH``,
``GENIE_NATIVE_DISPATCH_RULE``, ``GENIE_PYTHON_KEY``, ``GENIE_STACK_RECORD``,
``GENIE_STACK_RECORD_CHECK``, ``GENIE_WHOLE_OPS``, ``GENIE_INDEX_CHECK``,
``GENIE_CALLER_BACKWARD``, ``GENIE_CPU_RETAIN`` and ``GENIE_DEBUG`` live here; the engine and
remote modules read their own (``GENIE_BACKENDS``, ``GENIE_PLAN_CACHE``, ``GENIE_COMPILER``,
``GENIE_SERVER``, ...). docs/env.md is the one table of all of them, with meanings and defaults.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass


def _flag(name: str, default: str) -> str:
    return os.environ.get(name, default).strip()


def whole(name: str, what: str) -> int | None:
    """``name``'s value, a whole number >= 0 (None: unset); a ValueError saying ``what`` it
    counts otherwise."""
    v = _flag(name, "")
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{name}={v!r}: expected {what}")
    return n


def _mib(name: str) -> int | None:
    """``name``'s value, a whole number of MiB (None: unset), checked at import so that a bad
    setting fails at ``import genie`` (or a server's start), not at a first run."""
    return whole(name, "the MiB of freed host memory to keep for reuse, a whole number >= 0 "
                       "(0 turns it off)")


@dataclass
class Config:
    """Mutable process-wide settings (tests and users may change them at run time)."""

    device: str | None = _flag("GENIE_DEVICE", "") or None
    device_count: int | None = int(_flag("GENIE_DEVICE_COUNT", "0")) or None
    meta_cache: bool = _flag("GENIE_META_CACHE", "1") != "0"
    record_source: bool = _flag("GENIE_RECORD_SOURCE", "0") == "1"
    debug: int = int(_flag("GENIE_DEBUG", "0") or 0)
    # Output metadata of common ops from genie.shape_rules before meta kernels (0: kernels only).
    shape_rules: bool = _flag("GENIE_SHAPE_RULES", "1") != "0"
    # Take recorded nodes that cannot close a reference cycle off the cyclic GC (genie.graph).
    gc_untrack: bool = _flag("GENIE_GC_UNTRACK", "1") != "0"
    # With gc_untrack: record writers untracked too and put them back under the collector only
    # if they stay pending (genie.graph.defer_writer); 0: every write re-tracks what it reaches.
    gc_defer_writes: bool = _flag("GENIE_GC_DEFER_WRITES", "1") != "0"
    # Bind a run's values to its nodes and collect a step's targets natively (csrc/bind.cpp; 0:
    # the Python loops, the reference).
    native_bind: bool = _flag("GENIE_NATIVE_BIND", "1") != "0"
    # Find a plan-cache hit's wire constants that are the last call's natively (csrc/wire.cpp;
    # 0: genie.remote.protocol.encode_tape's Python loop, the reference).
    native_wire: bool = _flag("GENIE_NATIVE_WIRE", "1") != "0"
    # torch's per-op lookup of registered __torch_dispatch__ rules natively (genie.lazy_tensor;
    # 0: torch's own Python function). Read once at import.
    native_dispatch_rule: bool = _flag("GENIE_NATIVE_DISPATCH_RULE", "1") != "0"
    # Check a plan-cache hit's nodes natively (csrc/match.cpp; 0: genie.plan_cache's columns in
    # Python, the reference).
    native_match: bool = _flag("GENIE_NATIVE_MATCH", "1") != "0"
    # Slice a materialization's graph and match the slice against cached plans natively
    # (csrc/slice.cpp; 0: planner.slice_nodes and plan_cache.instantiate in Python, the reference).
    native_slice: bool = _flag("GENIE_NATIVE_SLICE", "1") != "0"
    # Take the steady embedded read (the fused hit path's: lookup, run and bind) in one native
    # call (csrc/read.cpp; 0: genie.executor's Python steps, the reference).
    native_read: bool = _flag("GENIE_NATIVE_READ", "1") != "0"
    # Read a remote client's steady run reply (header checks, outputs into host tensors) and
    # book its handles and residency records, each in one native call (csrc/client_run.cpp; 0:
    # genie.remote.client's Python steps, the reference).
    client_native: bool = _flag("GENIE_CLIENT_NATIVE", "1") != "0"
    # Record the common case of an op natively (csrc/record.cpp); 0: every op takes the Python
    # path, the reference (genie.lazy_tensor.record).
    native_record: bool = _flag("GENIE_NATIVE_RECORD", "1") != "0"
    # A call the native record path has no entry for takes its meta-cache entry from Python
    # (lazy_tensor.entry_for) and is recorded natively; 0: it takes the whole Python path, which
    # the native path then learns the entry from.
    native_record_miss: bool = _flag("GENIE_NATIVE_RECORD_MISS", "1") != "0"
    # A meta-cache miss of a shape class whose first miss a shape rule answered calls the rule
    # from the native record path and makes the entry there (csrc/record.cpp, "shape-generic
    # entries"); 0: every miss takes lazy_tensor.entry_for (the reference).
    generic_meta: bool = _flag("GENIE_GENERIC_META", "1") != "0"
    # LazyTensor calls reach genie's record from a C++ kernel on the Python dispatch key
    # (csrc/python_key.cpp), without PyTorch's Python fallback and its round trip into
    # __torch_dispatch__; 0: PyTorch's fallback calls LazyTensor.__torch_dispatch__ (the reference).
    python_key: bool = _flag("GENIE_PYTHON_KEY", "1") != "0"
    # LazyTensors the native record path makes carry no Python dispatch key: their ops reach
    # genie's kernel at PrivateUse1, as a backend's do, and autograd tracks their views as a
    # backend's (csrc/python_key.cpp, "PrivateUse1"); 0: every LazyTensor carries the Python key.
    # Read once, when genie is imported (a process's tensors are made one way).
    key_free: bool = _flag("GENIE_KEY_FREE", "1") != "0"
    # That kernel records a call of a learned meta-cache entry from the dispatcher's IValues
    # directly (csrc/record.cpp, record_stack: no args tuple, no Python object per argument);
    # 0: every call's arguments become Python ones first and take record_call (the reference).
    stack_record: bool = _flag("GENIE_STACK_RECORD", "1") != "0"
    # Check every call record_stack takes against flatten() of its Python arguments (the key
    # words, leaves and aliased arguments; a difference raises). For tests: costs a conversion.
    stack_record_check: bool = _flag("GENIE_STACK_RECORD_CHECK", "0") == "1"
    # Run a repeated plan's tape as a native program (csrc/replay.cpp): "1" from a plan's
    # second use, "always" every tape, "0" never (generated Python or the interpreter).
    native_replay: str = _flag("GENIE_NATIVE_REPLAY", "1").lower() or "1"
    # Replay a steady native program's longest window without per-step parameters as one CUDA
    # graph (genie/backends/cuda_graphs.py): "1" on CUDA devices, "0" never, "emulate" the same
    # bookkeeping on any device with the window run again in place of a graph's replay (tests).
    cuda_graphs: str = _flag("GENIE_CUDA_GRAPHS", "1").lower() or "1"
    # Record matmul and linear as one node where autograd does not need their decomposition
    # (csrc/whole.cpp, genie.meta.WHOLE); 0: always their decomposition, as eager's autograd key
    # runs it (the reference).
    whole_ops: bool = _flag("GENIE_WHOLE_OPS", "1") != "0"
    # Optimizers and clip_grad_norm_ take their multi-tensor _foreach_ path on LazyTensors
    # (genie.lazy_tensor: ~8 recorded ops per AdamW step instead of ~10 per parameter).
    foreach: bool = _flag("GENIE_FOREACH", "1") != "0"
    # Check index arguments (gather, embedding, ...) on the device before their kernels run, in
    # process (genie.index_check): "0" (as eager: on CUDA an out-of-range index is a device-side
    # assert that breaks only this process), "1", or "auto" (on for CUDA). Tapes then run in the
    # interpreter (no generated or native replay). A server has its own switch,
    # GENIE_SERVER_INDEX_CHECK (default auto).
    index_check: str = _flag("GENIE_INDEX_CHECK", "0").lower() or "0"
    # LazyTensor.backward runs the autograd engine on the calling thread, as for CPU tensors
    # (0: on the engine's worker thread for the device, PyTorch's default for non-CPU devices).
    caller_backward: bool = _flag("GENIE_CALLER_BACKWARD", "1") != "0"
    # MiB of freed host memory kept for reuse once the device has run on the CPU (None: 1 GiB
    # or an eighth of RAM; 0: glibc's defaults): genie.memory.retain_host_memory
    cpu_retain: int | None = _mib("GENIE_CPU_RETAIN")

    def on_change(self, listener: Callable[[Config], None]) -> None:
        """Call ``listener(self)`` now and after every change of a setting (native code that
        mirrors some settings: the record path, csrc/record.cpp)."""
        _listeners.append(listener)
        listener(self)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        for listener in _listeners:
            listener(self)


_listeners: list[Callable[[Config], None]] = []


config = Config()

logger = logging.getLogger("genie")
if config.debug:
    logging.basicConfig()
    logger.setLevel(logging.DEBUG if config.debug >= 2 else logging.INFO)
