"""Meaning on the default path: every recorded node knows its module, region, phase and role.

``genie.capture()`` records rich semantics inside its block (:mod:`genie.capture`,
:mod:`genie.semantics`). This module gives every node of the *default* path (a program that
just uses ``device="remote_accelerator"``) the part of that meaning a runtime acts on, at a cost
of one attribute per node:

- ``Node.ctx`` is an interned :class:`Context`: the ``nn.Module`` path that issued the op
  (``transformer.h.0.attn``; ``""`` for the outermost module, ``None`` outside any module), the
  region (``forward``, ``backward``: recorded by the autograd engine, ``optimizer``: inside
  ``Optimizer.step``) and the phase. Contexts are shared by every node recorded in one module
  call, so recording pays one thread-local read.
- **Phases are found, not labelled.** Each call of an outermost module is a :class:`Call`. A call
  that receives tensors produced by an earlier call of the same module (a KV cache: transformers'
  ``Cache`` objects, legacy ``past_key_values`` tuples, or any state a hand-written decode loop
  feeds back) is ``decode``; the call that produced that state, if not a decode itself, was the
  ``prefill``. ``genie.phase(...)`` and ``genie.annotate_phase(...)`` still override.
  ``genie.stats()`` counts ``phase.prefill.nodes`` and ``phase.decode.nodes`` (ops and
  factories recorded in each phase's calls), and ``phase.prefill.calls`` / ``phase.decode.calls``.
- **Roles**: :func:`role` says what a tensor is: ``weight`` (a parameter), ``kv_cache`` (state
  carried between calls, found as above), ``gradient`` (recorded in the backward region),
  ``optimizer_state`` (recorded by an optimizer step), ``input`` (uploaded host data) or
  ``activation``.

The hooks (a native object in place of ``nn.Module.__call__`` rather than torch's global module
hooks, which would take every module call of the process off its fast path; and global optimizer
step hooks) are installed when the first tensor is put on the device (:func:`activate`, called by
uploads and factories), not at import: programs that never use the device pay nothing, and a
module call that never touches the device is told so natively, before any Python of Genie's
runs (csrc/record.cpp, ``ModuleCall``). ``GENIE_CONTEXT=0`` leaves them off (nodes then have no
context). Measured cost: see docs/semantics.md ("Meaning on the default path").

Example:
    >>> import torch, genie
    >>> from genie import context
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2)).to("remote_accelerator")
    >>> y = m(torch.ones(1, 2, device="remote_accelerator"))
    >>> y._node.ctx.path, y._node.ctx.region, context.role(m[0].weight), context.role(y)
    ('0', 'forward', 'weight', 'activation')
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

import torch

from ._C import _context_init, _lazy_walk, _module_call as _native_module_call, \
    _record_sync_counts
from .graph import current
from .stats import _counts, bump

_on = os.environ.get("GENIE_CONTEXT", "1").strip() != "0"
# nn.Module.__call__ replaced by a native object (csrc/record.cpp, ModuleCall): a call that
# never touches the device goes straight to torch's __call__ and a submodule's context inside a
# module call is pushed natively; everything else comes to _module_call. 0: _module_call itself
# is installed (the reference path, a Python frame on every module call of the process).
_native = os.environ.get("GENIE_NATIVE_CONTEXT", "1").strip() != "0"
_compiling = torch.compiler.is_compiling
_active = False
_lock = threading.Lock()
_handles: list[Any] = []
_hook_keys: list[int] = []  # the optimizer hooks' keys in torch's global hook dicts (see _hook)
_orig_call: Any = torch.nn.Module.__call__
_installed: Any = None  # what activate() put in nn.Module.__dict__["__call__"]


class Call:
    """One call of an outermost module on a thread: its phase, once known, and its size.

    The decode calls of one outermost module on one thread share a single ``Call``: their phase is known when they start, and their module contexts are the same every step, so
    a steady decode interns none (``_decode_call``). ``start`` and ``nodes`` then describe the
    latest of those calls."""

    __slots__ = ("root", "phase", "start", "nodes", "contexts", "__weakref__")

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = weakref.ref(root)
        self.phase: str | None = None
        self.start = _recorded()
        self.nodes: int | None = None  # set when the call returns
        self.contexts: dict[tuple[Any, ...], Context] = {}

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        bump(f"phase.{phase}.calls")
        if self.nodes:
            bump(f"phase.{phase}.nodes", self.nodes)


class Context:
    """Where a node was recorded: module path and class, region, phase (immutable but for the
    phase of its :class:`Call`, which may be found after the call)."""

    __slots__ = ("path", "cls", "region", "explicit", "call")

    def __init__(self, path: str | None, cls: str | None, region: str, explicit: str | None,
                 call: Call | None) -> None:
        self.path = path
        self.cls = cls
        self.region = region
        self.explicit = explicit
        self.call = call

    @property
    def phase(self) -> str | None:
        """The explicit phase (``genie.phase``, ``annotate_phase``), else the detected one."""
        if self.explicit is not None:
            return self.explicit
        return self.call.phase if self.call is not None else None

    def __repr__(self) -> str:
        return (f"Context({self.path!r}, {self.region}, phase={self.phase!r}"
                f"{', ' + self.cls if self.cls else ''})")


BACKWARD = Context(None, None, "backward", None, None)
OPTIMIZER = Context(None, None, "optimizer", None, None)
_phase_contexts: dict[str, Context] = {}


def _recorded() -> int:
    _record_sync_counts()  # the native record's counts (all of sync(): ~1 µs more a call)
    return _counts["ops_recorded"] + _counts["factories_recorded"]


class _Stack(threading.local):
    def __init__(self) -> None:
        # (module, context before the call, {submodule: path} of the outermost module)
        self.modules: list[tuple[Any, Any, dict[Any, str]]] = []
        self.phases: list[str] = []  # genie.phase(...) blocks, innermost last
        # outermost module -> the Call its decode calls on this thread share (weak: a cache
        # entry never keeps a model alive)
        self.decode: weakref.WeakKeyDictionary[Any, Call] = weakref.WeakKeyDictionary()


_tls = _Stack()
# outermost module -> {weakref.ref(submodule): its path}
_names: weakref.WeakKeyDictionary[Any, dict[Any, str]] = weakref.WeakKeyDictionary()


def activate() -> None:
    """Install the module call wrapper and optimizer hooks (idempotent; a no-op with
    ``GENIE_CONTEXT=0``)."""
    global _active, _orig_call, _installed
    if _active or not _on:
        return
    with _lock:
        if _active:
            return
        from torch.optim import optimizer as optim

        # Not torch's global module hooks: with any installed, every module call of the process
        # leaves nn.Module's fast path for the hook-processing one (8.8 µs per call, measured in
        # docs/semantics.md). One wrapper around Module.__call__ keeps the fast path and gets the
        # call's kwargs (where models take their KV cache) without reading a frame; the native
        # one costs a module that never touches the device no Python frame (reading
        # Module.__call__ still gives torch's function: TorchDynamo inlines that one).
        _orig_call = torch.nn.Module.__call__
        _installed = _native_module_call(_orig_call, _module_call) if _native else _module_call
        torch.nn.Module.__call__ = _installed
        _follow_fx_patcher()
        _handles[:] = [_hook(optim.register_optimizer_step_pre_hook(_opt_pre), 0,
                             optim._global_optimizer_pre_hooks),
                       _hook(optim.register_optimizer_step_post_hook(_opt_post), 1,
                             optim._global_optimizer_post_hooks)]
        type(current).backward = BACKWARD
        _active = True


def _hook(handle: Any, k: int, hooks: dict[int, Any]) -> Any:
    """``handle`` (a global optimizer hook just registered in ``hooks``) under the key its first
    registration had: TorchDynamo guards on the keys of torch's global optimizer hook dicts, so a
    compiled optimizer step would recompile after every :func:`deactivate` and :func:`activate`
    (a new key each time; each compiled step that traced ``Optimizer.step``, until its
    recompile limit, then its step ran uncompiled: found in ``bench_compile``'s training row,
    whose CPU variants run deactivated)."""
    if len(_hook_keys) <= k:
        _hook_keys.append(handle.id)
    elif handle.id != _hook_keys[k]:
        hooks[_hook_keys[k]] = hooks.pop(handle.id)
        handle.id = _hook_keys[k]
    return handle


def reinstall() -> None:
    """Put Genie's module call back where a tracer replaced it: torch.fx's patcher (under
    ``torch.compile``, ``make_fx``, ``torch.export``) restores ``nn.Module.__call__`` to what
    reading the class gave it, torch's own function, which silently ended module contexts and
    phase detection for the rest of the process (found by a full CI run: a compiled test before
    the placement tests)."""
    if _active and _installed is not None and \
            torch.nn.Module.__dict__.get("__call__") is not _installed:
        torch.nn.Module.__call__ = _installed


def _follow_fx_patcher() -> None:
    """Have torch.fx's patcher put Genie's module call back when it reverts its own. Its tracer
    (``torch.fx.symbolic_trace``, and what traces with it) replaces ``nn.Module.__call__`` while
    it traces and then sets back what reading the class gave it: torch's function (see
    :data:`_installed`), so one trace anywhere in the process silently ended module contexts,
    phase detection and roles (a KV cache counted as an activation) for the rest of it: found
    as later tests' failures after a test that traced a lambda. Installed with the module call
    (a process that never uses the device keeps torch's patcher as it is); torch versions
    without the class keep :func:`reinstall` at the places Genie gets control."""
    patched = getattr(getattr(torch.fx, "_symbolic_trace", None), "_PatchedFnSetAttr", None)
    revert = getattr(patched, "revert", None)
    if revert is None or getattr(revert, "_genie", False):
        return

    def revert_then_reinstall(self: Any) -> None:
        revert(self)
        if getattr(self, "frame_dict", None) is torch.nn.Module and \
                getattr(self, "fn_name", None) == "__call__":
            reinstall()

    revert_then_reinstall._genie = True  # type: ignore[attr-defined]
    patched.revert = revert_then_reinstall


def deactivate() -> None:
    """Remove the wrapper and hooks (nodes recorded from now on get no context); :func:`activate`
    or the next upload installs them again unless ``GENIE_CONTEXT=0``. For measuring what they
    cost."""
    global _active
    with _lock:
        if _installed is not None and torch.nn.Module.__dict__.get("__call__") is _installed:
            torch.nn.Module.__call__ = _orig_call
        for h in _handles:
            h.remove()
        _handles.clear()
        type(current).backward = None
        current.ctx = None
        _tls.modules.clear()
        _active = False


def _module_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``nn.Module.__call__`` while the context is active: the module's context around the
    original call (popped however the call ends, as an ``always_call`` forward hook would be).
    By default the native ``ModuleCall`` is installed and calls this only for what it does not
    decide itself (its two fast paths are the first two branches below).

    A submodule called inside a module call (55 a token in a GPT-2 decode) takes the inline
    path: its name from the outermost module's names, its :class:`Context` interned on the
    call, no helper calls (~1.5 µs less per module call than :func:`_enter` / :func:`_leave`)."""
    if _compiling():  # first: dynamo traces this wrapper and must see nothing else of it
        return _orig_call(self, *args, **kwargs)
    st = _tls.modules
    if not st and _host_call(args, kwargs):  # an eager model in this process: no context
        return _orig_call(self, *args, **kwargs)
    if st:
        top = st[-1]
        names = top[2]
        outer = current.ctx
        if type(names) is dict and outer is not None and outer.call is not None:
            path = names.get(_ref(self))
            if path is not None:
                explicit = self.__dict__.get("_genie_phase")
                if explicit is None:
                    explicit = _tls.phases[-1] if _tls.phases else outer.explicit
                region = outer.region
                contexts = outer.call.contexts
                key = (path, region, explicit)
                c = contexts.get(key)
                if c is None:
                    c = contexts[key] = Context(path, type(self).__name__, region, explicit,
                                                outer.call)
                entry = (self, outer, names)
                st.append(entry)
                current.ctx = c
                try:
                    return _orig_call(self, *args, **kwargs)
                finally:
                    if st and st[-1] is entry:  # as _leave: popped only if still on top
                        st.pop()
                        current.ctx = outer
    _enter(self, args, kwargs)
    try:
        return _orig_call(self, *args, **kwargs)
    finally:
        _leave(self)


def active() -> bool:
    return _active


def _context(call: Call | None, path: str | None, cls: str | None, region: str,
             explicit: str | None) -> Context:
    if call is None:
        return Context(path, cls, region, explicit, None)
    key = (path, region, explicit)
    c = call.contexts.get(key)
    if c is None:
        c = call.contexts[key] = Context(path, cls, region, explicit, call)
    return c


def _explicit(module: Any, outer: Context | None) -> str | None:
    p = module.__dict__.get("_genie_phase")
    if p is not None:
        return p
    if _tls.phases:
        return _tls.phases[-1]
    return outer.explicit if outer is not None else None


def _enter(module: Any, args: tuple, kwargs: dict) -> None:
    """Push ``module``'s context for its call (an outermost call on host tensors never gets here:
    :func:`_module_call` checks that first)."""
    st = _tls.modules
    if st and type(st[-1][2]) is _StepFrame:
        _drop_ended_steps()
    outer = current.ctx
    if st:
        names = st[-1][2]
        if type(names) is _StepFrame:  # a module called inside an optimizer step (a closure)
            names = _NO_NAMES
        path = names.get(_ref(module))
        if path is None:  # built on the fly, not a submodule of the outermost module
            parent = outer.path if outer is not None else None
            path = f"{parent}.{type(module).__name__}" if parent else type(module).__name__
        call = outer.call if outer is not None else None
    else:
        names = _names.get(module)
        if names is None:  # weak both ways: a cache entry never keeps a model (or its weights);
            # keyed by weak references (no callback: weakref.ref(m) then returns the same one)
            names = _names[module] = {_ref(m): n for n, m in module.named_modules()}
        path = ""
        call = _begin(module, args, kwargs)
    region = outer.region if outer is not None else "forward"
    st.append((module, outer, names))
    current.ctx = _context(call, path, type(module).__name__, region, _explicit(module, outer))


def _host_call(args: tuple, kwargs: dict) -> bool:
    """Whether an outermost call's tensor arguments, positional and keyword (``model(x)``,
    ``model(input_ids=ids, ...)`` as ``generate`` calls it), are all real (none on the device):
    such a call of an eager model in the same process gets no context and costs it no more than
    this scan. A call with no tensor argument at the top level gets one (its tensors may be
    lazy, deeper in its arguments)."""
    seen = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if getattr(a, "_node", None) is not None:
                return False
            seen = True
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                if getattr(a, "_node", None) is not None:
                    return False
                seen = True
    return seen


def _leave(module: Any) -> None:
    st = _tls.modules
    if not st or st[-1][0] is not module:
        return
    _, outer, _ = st.pop()
    ctx = current.ctx
    current.ctx = outer
    if not st and ctx is not None and ctx.call is not None:
        call = ctx.call
        call.nodes = _recorded() - call.start
        # The call's contexts point at it and it interned them: without this, every forward
        # left ~110 objects (55 contexts and their keys) in a cycle only the cyclic collector
        # frees (a full collection of the process's heap every ~600 generated tokens). Nodes
        # keep their contexts (and through them the call) alive as long as they need them.
        # A shared decode Call keeps them for the next step, until its module goes
        # (_decode_call).
        # (only a decode call can be the shared one: no weak-dict lookup for the others)
        if call.phase is None:
            call.contexts.clear()
        else:
            _ended(module, call)


def _ended(module: Any, call: Call) -> None:
    """The end of outermost ``module``'s ``call`` whose phase is known (the native module call
    ends the others itself, as :func:`_leave`)."""
    if call.phase != "decode" or _tls.decode.get(module) is not call:
        call.contexts.clear()
    bump(f"phase.{call.phase}.nodes", call.nodes)


def _begin(module: Any, args: tuple, kwargs: dict) -> Call:
    """A call of an outermost module: a decode if it receives state an earlier call of the same
    module produced (that call, if it was not a decode, was the prefill)."""
    found: list[Any] | None = None
    if not kwargs:  # model(x): no walk (a loop, not all() over a generator: every call)
        found = []
        for a in args:
            if not isinstance(a, torch.Tensor):
                found = None
                break
            if getattr(a, "_node", None) is not None:
                found.append(a)
    if found is None:
        found = _lazy_tensors((args, kwargs))
    if not found:
        return Call(module)
    producers: dict[int, Call] = {}
    for t in found:
        c = t._node.ctx
        p = c.call if c is not None else None
        if p is not None and p.root() is module:
            producers.setdefault(id(p), p)
            n = t._node
            if n.tags is None:
                n.tags = {}
            n.tags["role"] = "kv_cache"
    if producers:
        for p in producers.values():
            if p.phase is None:
                p.set_phase("prefill")
        return _decode_call(module)
    return Call(module)


def _decode_call(module: Any) -> Call:
    """The :class:`Call` of a decode call of outermost ``module`` on this thread: one per module
    and thread, shared by its decode calls (``share_decode_calls``; off: a new one per call, the
    reference), so that the module contexts of a steady decode are interned once."""
    if not share_decode_calls:
        call = Call(module)
        call.set_phase("decode")
        return call
    calls = _tls.decode
    call = calls.get(module)
    if call is None:
        call = calls[module] = Call(module)
        call.phase = "decode"
        # its contexts point at it: break that cycle when the module goes, so that it is freed
        # by reference counting, not left for the cyclic collector
        weakref.finalize(module, call.contexts.clear)
    else:
        call.start = _recorded()
        call.nodes = None
    bump("phase.decode.calls")
    return call


#: Whether the decode calls of an outermost module share one :class:`Call` (the default).
share_decode_calls = True

def caller_kwargs() -> dict:
    """The keyword arguments of the module call that runs a global forward pre-hook.

    Global forward pre-hooks get no kwargs; the root call's kwargs are where models take their KV
    cache (``past_key_values=...``). Read them from ``Module._call_impl``'s frame when it is there.
    """
    f = sys._getframe(2)
    for _ in range(4):
        if f is None:
            break
        if f.f_code.co_name in ("inner", "_call_impl") and "/torch/nn/modules/" in \
                f.f_code.co_filename.replace("\\", "/"):
            kw = f.f_locals.get("kwargs")
            return kw if isinstance(kw, dict) else {}
        f = f.f_back
    return {}


_ATOMS = frozenset({str, bytes, int, float, bool, type(None), torch.device, torch.dtype})

# What _lazy_tensors does with an object, remembered by its type: the classes it tests have no
# __instancecheck__ of their own, so for an object whose __class__ is its type the answer is the
# type's (an object that reports another __class__ is classified each time, as before).
_TENSOR, _SKIP, _SEQ, _DICT, _OBJ = range(5)
_kinds: dict[type, int] = {}


def _kind(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return _TENSOR
    if isinstance(x, (str, bytes, int, float, type, torch.nn.Module)):
        return _SKIP
    if isinstance(x, (list, tuple)):
        return _SEQ
    if isinstance(x, dict):
        return _DICT
    return _OBJ


def _lazy_tensors(obj: Any) -> list[Any]:
    """Lazy tensors (tensors with a recorded node) in a call's arguments: through lists,
    tuples, dicts and the attributes of plain objects (cache objects), a few levels deep
    (depth 6; each container once).

    Runs at every outermost module call (a decode step's KV cache object: ~25 objects), natively
    (``genie._C._lazy_walk``, csrc/walk.cpp: ~13 -> ~1 µs a token of a GPT-2 generate): numbers,
    strings and None are dropped before they are pushed, and what to do with an object is looked
    up by its type (:data:`_kinds`, filled by :func:`_kind`; an object that reports another
    ``__class__`` is classified each time)."""
    return _lazy_walk(obj, _kinds, _kind, _ATOMS)


# the native module call (csrc/record.cpp): submodule contexts, and an outermost call's in the
# common cases (_enter, _begin, _decode_call and _leave's work, with their objects: a call with
# keyword arguments walked by _lazy_tensors; share_decode_calls read in this module's dict)
_context_init({"tls": _tls, "Context": Context, "Call": Call, "names": _names.data,
               "ended": _ended, "walk": _lazy_tensors, "globals": globals()})

_NO_NAMES: dict[Any, str] = {}
_ref = weakref.ref


class _StepFrame:
    """Marks an optimizer's entry on the context stack with the frame that runs its step (torch
    calls step hooks from the frame that wraps ``step``), so an entry whose step raised, which no
    post hook pops, can be told from a step still running."""

    __slots__ = ("frame",)

    def __init__(self, frame: Any) -> None:
        self.frame = frame


def _drop_ended_steps() -> None:
    """Pop optimizer entries whose step has ended without its post hook (the step raised): their
    frame is no longer on this thread's stack. Runs only when such an entry is on top."""
    st = _tls.modules
    while st and type(st[-1][2]) is _StepFrame:
        frame = st[-1][2].frame
        f = sys._getframe(1)
        while f is not None and f is not frame:
            f = f.f_back
        if f is not None:
            return  # still running (a closure calling the model inside ``step``)
        current.ctx = st.pop()[1]


def _opt_pre(opt: Any, args: tuple, kwargs: dict) -> None:
    if _compiling():
        return
    st = _tls.modules
    if st and type(st[-1][2]) is _StepFrame:
        _drop_ended_steps()
    st.append((opt, current.ctx, _StepFrame(sys._getframe(1))))
    current.ctx = OPTIMIZER


def _opt_post(opt: Any, args: tuple, kwargs: dict) -> None:
    st = _tls.modules
    if st and st[-1][0] is opt:
        current.ctx = st.pop()[1]
    if _compiling():
        return
    # a recorded step on the device: its effects join the next materialization's tape
    # (:func:`take_steps`); an optimizer of host tensors is not noted (it costs this check)
    for g in opt.param_groups:
        ps = g["params"]
        if ps:
            if getattr(ps[0], "_node", None) is not None and \
                    not any(r() is opt for r in _steps.pending):
                _steps.pending.append(weakref.ref(opt))
            return


class _Steps(threading.local):
    def __init__(self) -> None:
        self.pending: list[weakref.ref[Any]] = []  # optimizers stepped since the last trigger


_steps = _Steps()


def take_steps() -> list[Any]:
    """The optimizers whose step this thread recorded on the device since the last call, in
    step order (the executor folds their pending effects into the next tape: one tape per
    training step, see docs/semantics.md "A training step is one tape")."""
    refs = _steps.pending
    if not refs:
        return []
    _steps.pending = []
    return [o for o in (r() for r in refs) if o is not None]


def step_tensors(opt: Any) -> list[torch.Tensor]:
    """What an optimizer's step writes that the program holds: each parameter, its ``.grad``
    and its optimizer state tensors (``momentum_buffer``, ``exp_avg``, ``step``, ...), in the
    optimizer's own order (deterministic)."""
    out: list[torch.Tensor] = []
    state = opt.state
    for g in opt.param_groups:
        for p in g["params"]:
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
            st = state.get(p)
            if st:
                out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def push_phase(name: str) -> Any:
    """Enter a ``genie.phase(name)`` block on this thread (returns what :func:`pop_phase`
    restores)."""
    _tls.phases.append(name)
    prev = current.ctx
    if prev is None or prev.call is None:
        c = _phase_contexts.get(name)
        if c is None:
            c = _phase_contexts[name] = Context(None, None, "forward", name, None)
        current.ctx = c if prev is None or prev.region == "forward" else \
            Context(None, None, prev.region, name, None)
    else:
        current.ctx = _context(prev.call, prev.path, prev.cls, prev.region, name)
    return prev


def pop_phase(prev: Any) -> None:
    if _tls.phases:
        _tls.phases.pop()
    current.ctx = prev


def node_role(n: Any, k: int) -> str:
    """The role of output ``k`` of node ``n`` (what :func:`role` says of a tensor, from the node
    alone: a parameter is known by its storage, uploaded from a ``Parameter``; runtimes that
    hold values, not tensors, ask this)."""
    st = n.storage(k) if k < len(n.metas) else None
    if st is not None and st.role is not None:
        return st.role
    return _recorded_role(n)


def role(t: torch.Tensor) -> str:
    """What ``t`` is to the program: ``weight``, ``kv_cache``, ``gradient``,
    ``optimizer_state``, ``input`` or ``activation`` (see the module docstring)."""
    if not isinstance(t, torch.Tensor) or getattr(t, "_node", None) is None:
        raise TypeError(f"genie.context.role() takes a remote_accelerator tensor, got "
                        f"{type(t).__name__}")
    if isinstance(t, torch.nn.Parameter) or t.__dict__.get("_swap_src") is not None:
        return "weight"
    return _recorded_role(t._node)


def _recorded_role(n: Any) -> str:
    """What a node's own record says: a role tag (``kv_cache``), else its region, else whether
    it is an upload."""
    if n.tags is not None and "role" in n.tags:
        return n.tags["role"]
    c = n.ctx
    if c is not None and c.region == "backward":
        return "gradient"
    if c is not None and c.region == "optimizer":
        return "optimizer_state"
    if n.op == "genie.upload":
        return "input"
    return "activation"
