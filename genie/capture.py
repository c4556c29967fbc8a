"""``genie.capture()``: record a block of a program into an inspectable, deterministic graph.

::

    with genie.capture() as g:
        x = torch.randn(8, 128)                 # no device given: lazy, on remote_accelerator
        with genie.phase("prefill"):
            logits = model(x)                   # recorded with module paths and the phase
    print(g.summary()); g.to_dot("graph.dot"); gm = g.to_fx()

The block pushes a ``TorchDispatchMode`` (per thread, popped even when the block raises) and a
:class:`CaptureGraph` on the thread's graph stack. Inside it:

- factories whose device is the default one (``torch.randn(3)``, ``torch.tensor([1, 2])``,
  ``torch.zeros(2, device="cpu")``) produce LazyTensors on ``remote_accelerator:<device>``;
  factories on ``remote_accelerator`` are recorded as usual; other devices run eagerly;
- every op on LazyTensors is recorded into ``g``, including ops on LazyTensors created before the
  block (their values enter the graph as ``load*K`` inputs) and backward ops that the autograd
  engine runs on its own thread for this block;
- host tensors created outside the block that an op mixes with LazyTensors are uploaded once
  per capture (and again only if modified: ``_version``) as ``upload`` nodes holding a snapshot;
  ops that read only host tensors run eagerly on the host (printing and ``.cpu()`` results
  stay ordinary tensors); an op that would write into such a host tensor raises
  :class:`CaptureError` (eager would raise a device mismatch; move the tensor first), unless
  its only lazy operands are ``torch.tensor(...)`` literals of the block: then it runs on the
  host with their data, as eager does (the foreach optimizers' CPU step counters:
  ``_foreach_add_(steps, torch.tensor(1.0, device="cpu"))``);
- nested blocks record into the innermost graph; values from an outer block are loads there.

Leaving the block executes nothing. Only the usual triggers (``.item()``, ``.cpu()``, ``print``)
run anything, inside or after the block.

Module paths, phases and regions are tracked by global ``nn.Module`` forward hooks and optimizer
step hooks, installed while at least one capture is open in the process and inert on threads
without one; each node stores a reference to the current :class:`~genie.semantics.Scope`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import optree
import torch
from torch.nn import Parameter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from . import context as _context
from . import device as _device
from . import export as _export
from . import ids as _ids
from . import semantics
from .errors import GenieError
from .factories import factory_overloads
from .graph import Graph, Node
from .lazy_tensor import (
    DEVICE_TYPE,
    LazyTensor,
    device_of,
    record,
    record_factory,
    upload,
)
from .lazy_tensor import (
    _tls as _graph_tls,
)
from .meta import policy
from .semantics import TOP, NodeInfo, Scope

aten = torch.ops.aten


class CaptureError(GenieError):
    """An op inside ``genie.capture()`` that Genie cannot record faithfully."""


# --- per-thread recording state ------------------------------------------------------------------

class ThreadState:
    """What one thread is doing: its current scope, module stack and open captures."""

    __slots__ = ("scope", "stack", "captures", "opt_stack")

    def __init__(self) -> None:
        self.scope: Scope = TOP
        self.stack: list[tuple[Any, Scope, dict[Any, str]]] = []  # (module, scope before, names)
        self.captures: list[CaptureGraph] = []
        self.opt_stack: list[tuple[Any, Scope]] = []


class _TLS(threading.local):
    def __init__(self) -> None:
        self.state = ThreadState()


_tls = _TLS()


def thread_state() -> ThreadState:
    return _tls.state


# --- the graph a block yields ----------------------------------------------------------------

class Recorder(Graph):
    """The :class:`~genie.graph.Graph` that a capture's nodes point to (``Node.graph``).

    It holds only a weak reference to its :class:`CaptureGraph`, which holds the nodes: no
    reference cycle, so a dropped capture graph is freed by reference counting at once instead of
    waiting for (slow) cyclic garbage collection.
    """

    def __init__(self, owner: CaptureGraph) -> None:
        super().__init__("capture", keep_nodes=True)
        self.owner = weakref.ref(owner)

    def on_node(self, node: Node) -> None:  # hot path: every node recorded in the block
        g = self.owner()
        if g is not None:
            g.nodes.append(node)
            # (a value run at once, as an op with no meta kernel is, is adopted with no leaves)
            g.leaves.append(node.leaves if node.n_leaves else [])
            g.scopes.append(_tls.state.scope if g.semantics_on else None)


class CaptureGraph:
    """The graph recorded by one ``genie.capture()`` block, with ids, semantics and exports.

    Attributes:
        nodes: recorded nodes in record order (``nodes[N].uid == f"op*{N}"``).
        leaves: each node's recorded arguments (kept here: nodes drop theirs once they run).
        scopes: each node's :class:`~genie.semantics.Scope` at record time.
        ids: the :class:`~genie.ids.IdState` (complex ids, loads, fingerprint).
        index: the ``remote_accelerator`` index that device-less factories use.
        recorder: the :class:`Recorder` graph the nodes belong to.
    """

    def __init__(self, index: int, semantics_on: bool = True) -> None:
        self.index = index
        self.semantics_on = semantics_on
        self.recorder = Recorder(self)
        self.nodes: list[Node] = []
        self.leaves: list[list[Any] | None] = []
        self.scopes: list[Scope | None] = []
        self.ids = _ids.IdState(self.recorder, self.nodes, self.leaves)
        self.roles = semantics.RoleMap()
        self.host_roles: WeakIdKeyDictionary = WeakIdKeyDictionary()  # host param -> (role, name)
        self._roots: list[weakref.ref[Any]] = []
        self._names: list[dict[Any, str]] = []  # per root, while recording (dropped at exit)
        self._optimizers: list[weakref.ref[Any]] = []
        self.uploads: WeakIdKeyDictionary = WeakIdKeyDictionary()  # host tensor -> (version, lazy)
        self.literals: set[int] = set()  # positions of uploads of torch.tensor(...) in the block
        self.module_classes: dict[str, str] = {}  # module path -> class name, in first-call order
        self._info: dict[int, NodeInfo] = {}
        self._info_stamp = 0

    def __len__(self) -> int:
        return len(self.nodes)

    def owns(self, node: Node) -> bool:
        """True if ``node`` was recorded in this capture."""
        return node.graph is self.recorder

    # --- ids -----------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """Structural digest of the graph: same program, same fingerprint, in any process."""
        return self.ids.fingerprint

    @property
    def loads(self) -> list[_ids.Load]:
        """External inputs (values recorded before the block), in first-use order."""
        return list(self.ids.loads)

    def node_of(self, x: Any) -> Node:
        """The node for a LazyTensor produced in this graph, a node, or a unique id."""
        if isinstance(x, LazyTensor):
            x = x._node
        elif isinstance(x, str):
            x = self.nodes[_ids.position_of_uid(x)]
        if not isinstance(x, Node) or x.graph is not self.recorder:
            raise KeyError(f"[capture] {x!r} was not recorded in this capture graph")
        return x

    def complex_id(self, x: Any) -> str:
        """Complex id (``add*0|op*1|load*0``) of a node or of the LazyTensor it produced."""
        return self.ids.complex_ids[_ids.position(self.node_of(x))]

    # --- semantics (computed on read) ----------------------------------------------------------
    def info(self, x: Any) -> NodeInfo:
        """:class:`~genie.semantics.NodeInfo` of a node, its LazyTensor or its unique id."""
        pos = _ids.position(self.node_of(x))
        return self._info_at(pos)

    def infos(self) -> list[NodeInfo]:
        """:class:`~genie.semantics.NodeInfo` of every node, in record order."""
        return [self._info_at(i) for i in range(len(self.nodes))]

    def _info_at(self, pos: int) -> NodeInfo:
        if self._info_stamp != self.roles.version:  # roles learnt since: recompute on read
            self._info.clear()
            self._info_stamp = self.roles.version
        info = self._info.get(pos)
        if info is None:
            info = self._info[pos] = semantics.node_info(self, pos, self.roles)
        return info

    def load_role(self, load: _ids.Load) -> tuple[str, str | None]:
        """``(role, parameter name or None)`` of an external input."""
        return semantics.load_role(self.roles, load.node, load.out)

    def modules(self) -> list[Any]:
        """The outermost modules called in the block (still alive), in first-call order."""
        return [m for m in (r() for r in self._roots) if m is not None]

    def optimizers(self) -> list[Any]:
        """Optimizers stepped in the block (still alive)."""
        return [o for o in (r() for r in self._optimizers) if o is not None]

    def lazy_for(self, t: Any) -> Any:
        """``t`` itself if lazy; the upload made for host tensor ``t`` in this block if any."""
        if isinstance(t, LazyTensor):
            return t
        if isinstance(t, torch.Tensor):
            hit = self.uploads.get(t)
            return hit[1] if hit is not None else None
        return None

    def _root_names(self, module: Any) -> dict[Any, str]:
        """``{submodule: path}`` for an outermost module called in the block (while recording).

        The first root's paths are its ``named_modules`` names (the root itself is ``""``); a
        k-th distinct root (k >= 1) gets the prefix ``[k]``.
        """
        for k, r in enumerate(self._roots):
            if r() is module:
                return self._names[k]
        k = len(self._roots)
        self._roots.append(weakref.ref(module))
        pre = f"[{k}]" if k else ""
        names: dict[Any, str] = {}
        for n, m in module.named_modules(remove_duplicate=False):  # one walk: paths and roles
            path = (f"{pre}.{n}" if pre else n) if n else pre
            names.setdefault(m, path)
            dot = path + "." if path else ""
            for role, items in (("parameter", m._parameters), ("buffer", m._buffers)):
                for name, t in items.items():
                    if t is not None:
                        self._note_role(t, role, dot + name)
        self._names.append(names)
        return names

    def _note_role(self, t: Any, role: str, name: str | None, override: bool = False) -> None:
        if isinstance(t, LazyTensor):
            self.roles.put(t, role, name, override)
        elif isinstance(t, torch.Tensor):
            if override or t not in self.host_roles:
                self.host_roles[t] = (role, name)
            up = self.uploads.get(t)
            if up is not None:
                self.roles.put(up[1], role, name, override)

    def _note_optimizer(self, opt: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._note_role(p.grad, "gradient", None)
        for state in opt.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    self._note_role(v, "optimizer_state", k)

    def _add_optimizer(self, opt: Any) -> None:
        for r in self._optimizers:
            if r() is opt:
                return
        self._optimizers.append(weakref.ref(opt))

    def _tag_kv(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._note_role(t, "kv_cache", None, override=True)

    # --- export (genie.export) -----------------------------------------------------------------
    def summary(self, depth: int | None = None) -> str:
        """A table of nodes, FLOPs and bytes per module, per phase and per category."""
        return _export.summary(self, depth)

    def dump(self) -> str:
        """A stable, line-per-node text of the graph (golden tests diff it)."""
        return _export.dump(self)

    def to_dot(self, path: str | None = None) -> str:
        """Graphviz text with one cluster per module; written to ``path`` when given."""
        return _export.to_dot(self, path)

    def to_fx(self, outputs: Any = None, device: Any = "cpu") -> torch.fx.GraphModule:
        """A ``torch.fx.GraphModule`` that recomputes ``outputs`` eagerly (see genie.export)."""
        return _export.to_fx(self, outputs, device)

    def example_inputs(self, device: Any = "cpu") -> list[torch.Tensor]:
        """Real values for the placeholders of :meth:`to_fx` (materializes external inputs)."""
        return _export.example_inputs(self, device)

    def __repr__(self) -> str:
        return f"CaptureGraph({len(self.nodes)} nodes, {len(self.ids.loads)} loads, " \
               f"fingerprint={self.fingerprint[:12]})"


# --- the dispatch mode -----------------------------------------------------------------------

_FACTORIES = frozenset(factory_overloads())
_lift_fresh = aten.lift_fresh.default
_lift = aten.lift.default
_to_copy = aten._to_copy.default
_copy = aten.copy_.default
_TRANSFERS = frozenset({_to_copy, _copy})


class CaptureMode(TorchDispatchMode):
    """Routes every op of the block into ``graph`` (see the module docstring for the rules)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps subclasses' __torch_dispatch__ in torch._disable_dynamo when
        # this is True: one more Python frame and checks per recorded op. This handler only
        # records (it never runs compiled code), so it needs no such guard.
        return False

    def __init__(self, graph: CaptureGraph, owner: ThreadState) -> None:
        super().__init__()
        self.graph = graph
        self.recorder = graph.recorder
        self.owner = owner
        self.default_type = torch.get_default_device().type
        # torch.tensor(data) literals of the block -> their host data (see _literals_on_host)
        self.literal_data: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        graphs = _graph_tls.graphs
        if not graphs or graphs[-1] is not self.recorder:
            return self._foreign(func, args, kwargs)
        if func in _FACTORIES:
            return self._factory(func, args, kwargs)
        kinds = _scan(args) | _scan(kwargs.values()) if kwargs else _scan(args)
        has_lazy = kinds & _LAZY
        has_host = kinds & _HOST
        if has_host:
            if func is _lift_fresh or func is _lift:
                if not has_lazy:  # torch.tensor(data) inside the block: a new tensor, captured
                    up = upload(args[0], self.graph.index)
                    self.graph.literals.add(_ids.position(up._node))
                    self.literal_data[up] = args[0]
                    return up
            elif func is _to_copy and not has_lazy:
                return self._to_device(args, kwargs)
            elif not has_lazy or func in _TRANSFERS:
                return func(*args, **kwargs)
            else:
                host = self._literals_on_host(func, args, kwargs)
                if host is not None:
                    return func(*host[0], **host[1])
                args, kwargs = self._upload_host(func, args, kwargs)
        elif not has_lazy:
            return func(*args, **kwargs)
        return record(func, args, kwargs)

    def _to_device(self, args: tuple, kwargs: dict) -> Any:
        """``host.to("remote_accelerator")`` in the block: one upload node (no empty + copy)."""
        src = args[0]
        dev = kwargs.get("device")
        if (len(args) == 1 and isinstance(dev, torch.device) and dev.type == DEVICE_TYPE
                and kwargs.get("dtype") in (None, src.dtype)
                and kwargs.get("layout") in (None, torch.strided)
                and kwargs.get("memory_format") in (None, torch.preserve_format)
                and src.layout == torch.strided and src.is_contiguous()):
            index = _device._index(dev)
            _device.check_index(index)
            return upload(src.detach(), index)
        return _to_copy(*args, **kwargs)

    def _factory(self, func: Any, args: tuple, kwargs: dict) -> Any:
        dev = kwargs.get("device")
        if dev is None or (isinstance(dev, torch.device) and dev.type in ("cpu", self.default_type)
                           and dev.type != DEVICE_TYPE):
            kwargs = {**kwargs, "device": device_of(self.graph.index)}
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return record_factory(func, args, kwargs)
        if isinstance(dev, torch.device) and dev.type == DEVICE_TYPE:
            return record_factory(func, args, kwargs)
        return func(*args, **kwargs)

    def _literals_on_host(self, func: Any, args: tuple, kwargs: dict
                          ) -> tuple[tuple, dict] | None:
        """``(args, kwargs)`` with the block's literals as their host data, when ``func``
        writes into a host tensor and every LazyTensor among its arguments is such a literal
        (the op then stays on the host, as eagerly); None otherwise."""
        pol = policy(func)
        if not any(isinstance(t, torch.Tensor) and not isinstance(t, LazyTensor)
                   for pos in pol.call_writes(args, kwargs)
                   for t in _as_list(pol.arg(pos, args, kwargs))):
            return None
        data = self.literal_data
        lazy = [x for x in optree.tree_leaves((args, kwargs), none_is_leaf=True)
                if isinstance(x, LazyTensor)]
        if not all(x in data for x in lazy):
            return None
        return optree.tree_map(lambda x: data[x] if isinstance(x, LazyTensor) else x,
                               (args, kwargs), none_is_leaf=True)

    def _upload_host(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        pol = policy(func)
        for pos in pol.call_writes(args, kwargs):
            a = pol.arg(pos, args, kwargs)
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and not isinstance(t, LazyTensor):
                    raise CaptureError(
                        f"[capture] {func} would write into a host tensor ({t.device}, shape "
                        f"{tuple(t.shape)}) created outside the block, using remote_accelerator "
                        "values. Move it first (t = t.to('remote_accelerator')) or run this op "
                        "outside genie.capture().")
        index = _first_lazy_index(args, kwargs, self.graph.index)
        uploads = self.graph.uploads

        def lift(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not isinstance(x, LazyTensor):
                hit = uploads.get(x)
                if hit is not None and hit[0] == x._version:
                    return hit[1]
                up = upload(x.detach(), index)
                uploads[x] = (x._version, up)
                role = self.graph.host_roles.get(x)
                if role is not None:
                    self.graph.roles.put(up, *role)
                return up
            return x

        return optree.tree_map(lift, (args, kwargs), none_is_leaf=True)

    def _foreign(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op of this block run on another thread (the autograd engine's device thread)."""
        st = _tls.state
        prev = st.scope
        region = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        st.scope = Scope(None, None, self.owner.scope.phase, region)
        _graph_tls.graphs.append(self.recorder)
        try:
            return self.__torch_dispatch__(func, (), args, kwargs)
        finally:
            _graph_tls.graphs.pop()
            st.scope = prev


_LAZY, _HOST = 1, 2


def _as_list(a: Any) -> Any:
    return a if isinstance(a, (list, tuple)) else (a,)
_Tensor = torch.Tensor


def _scan(xs: Any) -> int:
    """Bit set of the tensor kinds among ATen arguments (tensors or lists of tensors)."""
    kinds = 0
    for x in xs:
        t = type(x)
        if t is LazyTensor:
            kinds |= _LAZY
        elif t is list or t is tuple:
            kinds |= _scan(x)
        elif isinstance(x, _Tensor):
            if isinstance(x, LazyTensor):
                kinds |= _LAZY
            else:
                kinds |= _HOST
                if isinstance(x, Parameter):  # a host model's weights: bound for the device
                    kinds |= _LAZY
    return kinds


def _first_lazy_index(args: tuple, kwargs: dict, default: int) -> int:
    for x in optree.tree_leaves((args, kwargs), none_is_leaf=True):
        if isinstance(x, LazyTensor):
            return x._node.metas[x._out].index
    return default


# --- module and optimizer hooks (installed while any capture is open) --------------------------

_hooks_lock = threading.Lock()
_hook_users = 0
_hook_handles: list[Any] = []


def _install_hooks() -> None:
    global _hook_users
    with _hooks_lock:
        _hook_users += 1
        if _hook_users == 1:
            from torch.nn.modules import module as nn_module
            from torch.optim import optimizer as optim

            _hook_handles.extend([
                nn_module.register_module_forward_pre_hook(_module_pre),
                nn_module.register_module_forward_hook(_module_post, with_kwargs=True,
                                                       always_call=True),
                optim.register_optimizer_step_pre_hook(_opt_pre),
                optim.register_optimizer_step_post_hook(_opt_post),
            ])


def _remove_hooks() -> None:
    global _hook_users
    with _hooks_lock:
        _hook_users -= 1
        if _hook_users == 0:
            from torch.nn.modules import module as nn_module

            for h in _hook_handles:
                h.remove()
                # the handle of a global forward hook registered with_kwargs leaves that flag
                # behind (torch's handle does not remove it): nn.Module's "any global hook" test
                # would then stay true for good, and every later torch.compile(module) call
                # warns of global hooks. Handle ids are unique, so this drops only ours.
                nn_module._global_forward_hooks_with_kwargs.pop(h.id, None)
            _hook_handles.clear()


def _active(st: ThreadState) -> CaptureGraph | None:
    caps = st.captures
    if not caps:
        return None
    g = caps[-1]
    return g if g.semantics_on else None


def _module_pre(module: Any, args: tuple) -> None:
    st = _tls.state
    g = _active(st)
    if g is None:
        return
    cls = type(module).__name__
    if st.stack:
        names = st.stack[-1][2]
        path = names.get(module)
        if path is None:  # a module that is not a submodule of the root (built on the fly)
            parent = st.scope.path
            path = f"{parent}.{cls}" if parent else cls
    else:
        names = g._root_names(module)
        path = names[module]
        kwargs = _context.caller_kwargs()
        g._tag_kv(semantics.kv_tensors((args, kwargs)))
    if path not in g.module_classes:
        g.module_classes[path] = cls
    phase = module.__dict__.get("_genie_phase") or st.scope.phase
    st.stack.append((module, st.scope, names))
    st.scope = Scope(path, cls, phase, st.scope.region)


_RAISED = object()


def _module_post(module: Any, args: tuple, kwargs: Any, output: Any = _RAISED) -> None:
    # When forward raised, torch calls always_call hooks as hook(module, args, result).
    st = _tls.state
    if not st.stack or st.stack[-1][0] is not module:
        return
    _, prev, _ = st.stack.pop()
    st.scope = prev
    if not st.stack and output is not _RAISED:
        g = _active(st)
        if g is not None:
            g._tag_kv(semantics.kv_tensors((args, kwargs, output)))


def _opt_pre(opt: Any, args: tuple, kwargs: dict) -> None:
    st = _tls.state
    g = _active(st)
    if g is None:
        return
    g._add_optimizer(opt)
    g._note_optimizer(opt)
    st.opt_stack.append((opt, st.scope))
    st.scope = st.scope.with_region("optimizer")


def _opt_post(opt: Any, args: tuple, kwargs: dict) -> None:
    st = _tls.state
    if st.opt_stack and st.opt_stack[-1][0] is opt:
        st.scope = st.opt_stack.pop()[1]
        g = _active(st)
        if g is not None:
            g._note_optimizer(opt)  # states created by this (first) step


# --- public API ---------------------------------------------------------------------------------

@contextlib.contextmanager
def capture(device: int | str | torch.device | None = None, *,
            metadata: bool = True) -> Iterator[CaptureGraph]:
    """Record the block into a new :class:`CaptureGraph` (yielded); executes nothing on exit.

    Args:
        device: ``remote_accelerator`` index (or device) that factories without a device use;
            default: the current ``remote_accelerator`` device.
        metadata: track module paths, phases and regions (global module and optimizer hooks).
            With ``False`` nodes still get ids and the fingerprint, but no scopes (module, phase
            and region read as ``None``/``forward``); for measuring what the tracking costs.

    Example:
        >>> import torch, genie
        >>> with genie.capture() as g:
        ...     x = torch.ones(2, 3)
        ...     y = (x * 2).sum()
        >>> y.device.type, len(g.nodes), g.complex_id(y)
        ('remote_accelerator', 3, 'sum*0|op*1')
        >>> y.item()
        12.0
    """
    index = _device._index(device)
    _device.check_index(index)
    st = _tls.state
    graph = CaptureGraph(index, semantics_on=metadata)
    mode = CaptureMode(graph, st)
    if metadata:
        _install_hooks()
    saved_scope, saved_depth, saved_opt = st.scope, len(st.stack), len(st.opt_stack)
    st.captures.append(graph)
    rec = graph.recorder
    _graph_tls.graphs.append(rec)
    try:
        with mode:
            yield graph
    finally:
        # pop exactly what we pushed, even if an exception left module or phase scopes open
        if _graph_tls.graphs and _graph_tls.graphs[-1] is rec:
            _graph_tls.graphs.pop()
        elif rec in _graph_tls.graphs:
            _graph_tls.graphs.remove(rec)
        st.captures.remove(graph)
        del st.stack[saved_depth:]
        del st.opt_stack[saved_opt:]
        st.scope = saved_scope
        graph._names = [{} for _ in graph._names]
        if metadata:
            _remove_hooks()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the ops recorded in this block (on this thread) with phase ``name``.

    Phases nest (the innermost wins) and work inside or around ``genie.capture()``; a module
    annotated with :func:`annotate_phase` overrides the surrounding phase for its own ops.

    Example:
        >>> import torch, genie
        >>> with genie.capture() as g:
        ...     with genie.phase("prefill"):
        ...         y = torch.ones(2) + 1
        >>> g.info(y).phase
        'prefill'
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"genie.phase(name): name must be a non-empty str, got {name!r}")
    st = _tls.state
    prev = st.scope
    st.scope = prev.with_phase(name)
    saved = _context.push_phase(name)  # the default path's nodes too (genie.context)
    try:
        yield
    finally:
        _context.pop_phase(saved)
        st.scope = prev


def annotate_phase(module: torch.nn.Module, name: str | None) -> torch.nn.Module:
    """Record every op that ``module`` (and its submodules) issues with phase ``name``.

    The annotation lives on the module (it survives captures; ``None`` removes it). An explicit
    ``genie.phase(...)`` inside the module's forward still takes precedence.

    Example:
        >>> import torch, genie
        >>> enc = genie.annotate_phase(torch.nn.Linear(2, 2).to("remote_accelerator"), "encode")
        >>> with genie.capture() as g:
        ...     y = enc(torch.ones(1, 2))
        >>> g.info(y).phase
        'encode'
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"genie.annotate_phase(module, name): module must be an nn.Module, got "
                        f"{type(module).__name__}")
    if name is None:
        module.__dict__.pop("_genie_phase", None)
    elif not isinstance(name, str) or not name:
        raise TypeError(f"genie.annotate_phase(module, name): name must be a non-empty str or "
                        f"None, got {name!r}")
    else:
        module.__dict__["_genie_phase"] = name
    return module
