"""Compiled graphs as data: the ``genie::graph`` op, one recorded node per graph call.

``torch.compile`` on the device (:mod:`genie.dynamo`) turns each graph AOTAutograd produces
(forward, backward or inference; ATen ops only) into :class:`GraphData`: plain data (op names,
constants, references between values), content-addressed by the SHA-256 of its canonical
encoding. A call of the graph is one op, ``genie::graph(key, tensors, ints) -> Tensor[]``, recorded
on LazyTensors like any other op: planning, liveness, the plan cache and the backends see one
node. Its kernels:

- ``Meta`` (output metadata at record time): the graph interpreted on meta tensors (then cached
  by Genie's meta cache, per input metadata);
- the real device (``CompositeExplicitAutograd``): the graph compiled once per shape class
  (device, input shapes, strides, dtypes and ints) by :func:`genie.backends.compiled.compiler`
  (Inductor where it can build kernels), its first run checked against the op-by-op run of the
  same graph (eager is the oracle). A compilation that fails or disagrees is dropped (one
  warning) and that shape class runs op by op from then on.

A graph is data, never code: decoding resolves each op name through a ``resolve`` function
(locally any ``torch.ops`` ATen overload; a server resolves against its admitted opset) and a
short table of Python operators on sizes (:data:`PY_OPS`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import torch
from torch._ops import _len_torch_dispatch_stack_pre_dispatch as _len_pre_dispatch_stack
from torch.utils._python_dispatch import _disable_current_modes

from .config import logger
from .meta import policy
from .progress import waiting
from .stats import bump

#: Python operators a graph may apply to sizes (dynamic shapes), by name
PY_OPS: dict[str, Callable[..., Any]] = {
    f"operator.{n}": getattr(operator, n)
    for n in ("add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt",
              "le", "gt", "ge", "getitem")
}
_PY_NAMES = {fn: name for name, fn in PY_OPS.items()}

_DEVICE_TYPE = "remote_accelerator"


class GraphError(RuntimeError):
    """A graph that cannot be encoded, decoded or admitted."""


# --- encoding -------------------------------------------------------------------------------

def op_name(op: Any) -> str:
    """``aten::add.Tensor``: an OpOverload's name as graph data (and the wire) spell it."""
    s = op._schema
    return f"{s.name}.{s.overload_name}" if s.overload_name else f"{s.name}.default"


def _enc(x: Any, refs: dict[Any, int]) -> Any:
    if isinstance(x, torch.fx.Node):
        return {"r": refs[x]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return [_enc(v, refs) for v in x]
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": x.type}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    raise GraphError(f"a graph argument of type {type(x).__name__} ({x!r:.80}) is not data")


_SIZE_OPS = {"sym_size": "size", "sym_stride": "stride", "sym_numel": "numel",
             "sym_storage_offset": "storage_offset"}


def host_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose values the caller's host computes without the device: inputs that are
    not device tensors (sizes, 0-dim CPU tensors such as an optimizer's step counts), sizes of
    any tensor, and what is computed from those alone (``step + 1``)."""
    host: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "call_function"):
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.device.type != "cpu":
            continue
        if n.op == "call_function":
            t = n.target
            size_op = isinstance(t, torch._ops.OpOverload) and \
                t._schema.name.removeprefix("aten::") in _SIZE_OPS
            if not size_op and any(a not in host for a in n.all_input_nodes):
                continue
        host.add(n)
    return host


def input_views(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes that are views of a device tensor input: view ops (by schema: an output aliasing
    an argument, not written) applied to an input or to such a view (and items of such a view's
    list, ``split``). The caller records them on its input (a lazy view, nothing copied), so a
    graph does not return them: a compiled graph's output that aliases an input is copied on
    every call (the node's outputs are fresh tensors), and a training graph's forward returns
    views of its weights (``permute(weight)`` saved for the backward: every weight copied every
    step)."""
    views: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], torch.fx.Node):
            continue
        base, t = n.args[0], n.target
        if t is operator.getitem:
            ok = base in views
        else:
            ok = isinstance(t, torch._ops.OpOverload) and t.is_view and \
                (base in views or (base.op == "placeholder"
                                   and isinstance(base.meta.get("val"), torch.Tensor)
                                   and base.meta["val"].device.type == _DEVICE_TYPE))
        if ok and all(a is base or a.op == "placeholder" and not isinstance(
                a.meta.get("val"), torch.Tensor) for a in n.all_input_nodes):
            views.add(n)
    return views


_LIFT_COPY = torch.ops.aten.lift_fresh_copy.default
_TO_COPY = torch.ops.aten._to_copy.default


def constants_as_inputs(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Each tensor constant of ``gm`` that the graph only copies to the device made an input
    of its own, after the others, in place; their values on the device (uploads, made here),
    in the order of those inputs. That is what ``torch.tensor(data, device=...)`` traces to
    (``_to_copy(lift_fresh_copy(constant), device=...)``: transformers' ``DynamicCache`` makes
    its first keys so): a graph holding it was refused (a constant is not data). The copies
    stay in the graph, so its outputs never alias the constant. Any other constant stays, and
    :func:`encode` refuses it."""
    def device_copies(n: torch.fx.Node) -> torch.device | None:
        devs = {w.kwargs.get("device") for u in n.users for w in u.users} \
            if n.users and all(u.target is _LIFT_COPY and u.users for u in n.users) and \
            all(w.target is _TO_COPY and not w.args[1:] for u in n.users for w in u.users) \
            else set()
        d = next(iter(devs)) if len(devs) == 1 else None
        return d if isinstance(d, torch.device) and d.type == _DEVICE_TYPE else None

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    last = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not last:
        return []
    last_ph = last[-1]
    values: list[torch.Tensor] = []
    for n in list(gm.graph.nodes):
        if n.op != "get_attr":
            continue
        v = getattr(gm, n.target, None) if "." not in n.target else None
        d = device_copies(n) if type(v) is torch.Tensor and v.device.type == "cpu" else None
        if d is None:
            continue
        with unset_fake_temporarily():
            dv = v.to(d)  # an upload: resident with the compiled graph
        with gm.graph.inserting_after(last_ph):
            p = gm.graph.placeholder(f"{n.name}_input")
        p.meta["val"] = dv
        n.replace_all_uses_with(p)
        gm.graph.erase_node(n)
        delattr(gm, n.target)
        last_ph = p
        values.append(dv)
    if values:
        gm.recompile()
    return values


def caller_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose values the caller of a ``genie::graph`` node computes itself: host values
    (:func:`host_nodes`) and views of its device inputs (:func:`input_views`)."""
    return host_nodes(gm) | input_views(gm)


def graph_outputs(gm: torch.fx.GraphModule) -> list[Any]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def node_outputs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph outputs a ``genie::graph`` node returns, in order: the device tensors computed
    in the graph (the caller passes through outputs that are graph inputs and constants, and
    computes host values and views of its inputs itself, see :func:`caller_nodes`)."""
    own = caller_nodes(gm)
    return [o for o in graph_outputs(gm)
            if isinstance(o, torch.fx.Node) and o.op != "placeholder" and o not in own]


def host_module(gm: torch.fx.GraphModule, outs: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """A module computing the caller's values ``outs`` of ``gm`` (:func:`caller_nodes`; sizes
    read with ``Tensor.size``, which a LazyTensor answers without running anything; views
    recorded on the inputs)."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name)
    need: set[torch.fx.Node] = set()
    stack = list(outs)
    while stack:
        n = stack.pop()
        if n not in need and n.op != "placeholder":
            need.add(n)
            stack.extend(n.all_input_nodes)
    for n in gm.graph.nodes:
        if n not in need:
            continue
        t = n.target
        args = torch.fx.map_arg(n.args, env.__getitem__)
        kwargs = torch.fx.map_arg(n.kwargs, env.__getitem__)
        name = t._schema.name.removeprefix("aten::") if isinstance(t, torch._ops.OpOverload) \
            else None
        if name in _SIZE_OPS:
            env[n] = g.call_method(_SIZE_OPS[name], args, kwargs)
        else:
            env[n] = g.call_function(t, args, kwargs)
    g.output([env[o] for o in outs])
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _input_writes(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(node, input)`` for each input a node writes in place (an argument its op writes,
    :meth:`genie.meta.OpPolicy.call_writes`: AOTAutograd's ``copy_`` into an input whose
    mutation it kept in the graph)."""
    out = []
    for n, pol in _writers(gm):
        for i in pol.call_writes(n.args, n.kwargs):
            v = pol.arg(i, n.args, n.kwargs)
            if isinstance(v, torch.fx.Node) and v.op == "placeholder":
                out.append((n, v))
    return out


def _writers(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, Any]]:
    """The graph's nodes that write an argument, with their op's policy (whose writes include
    those the schema does not mark: a training ``native_batch_norm``'s running statistics)."""
    out = []
    for n in gm.graph.nodes:
        t = n.target
        if n.op == "call_function" and isinstance(t, torch._ops.OpOverload):
            pol = policy(t)
            if pol.writes and pol.call_writes(n.args, n.kwargs):
                out.append((n, pol))
    return out


def _only_input_copies(gm: torch.fx.GraphModule) -> None:
    """Raise :class:`GraphError` unless the graph's only writes are ``copy_`` into its inputs
    (AOTAutograd's epilogue for the input mutations it keeps; the rest of a graph it makes is
    functional). Then what a graph writes is what its data says (:func:`_input_writes`): an op
    that writes anything else could reach an input through a view, even one whose schema does
    not say it aliases (``_unsafe_view``), and write what the graph does not declare."""
    for n, _ in _writers(gm):
        t = n.target
        if t is not _COPY_ or not n.args or not isinstance(n.args[0], torch.fx.Node) or \
                n.args[0].op != "placeholder":
            raise GraphError(f"it writes with {op_name(t)} ({n.name}): a graph writes only its "
                             "inputs, each with aten::copy_.default into the input itself (as "
                             "AOTAutograd keeps an input mutation)")


_COPY_ = torch.ops.aten.copy_.default


def host_writes(gm: torch.fx.GraphModule) -> list[tuple[int, torch.fx.Node]]:
    """The writes of host inputs (0-dim CPU tensors: an optimizer's step counts) that the graph
    keeps: ``(input position, its copy_ node)``. The caller makes them on the host (the value
    written is a host value, :func:`host_nodes`) and the graph's data leaves them out
    (:func:`encode`'s ``skip``): the node would write a snapshot of the host tensor. Raises
    :class:`GraphError` for another write of a host input."""
    host = host_nodes(gm)
    pos = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    out = []
    for n, v in _input_writes(gm):
        if v not in host:
            continue
        if n.target is not torch.ops.aten.copy_.default or n.users or \
                not isinstance(n.args[1], torch.fx.Node) or n.args[1] not in host:
            raise GraphError(f"it writes a host input ({v.name}) with {n.target} of a value the "
                             "host does not compute")
        out.append((pos[v], n))
    return out


def encode(gm: torch.fx.GraphModule, example_inputs: list[Any],
           skip: set[torch.fx.Node] = frozenset()) -> tuple[bytes, list[str]]:  # type: ignore
    """``gm`` (an ATen graph) as canonical bytes, and its placeholders' kinds (``"t"``: tensor,
    ``"m"``: a tensor the graph writes in place, ``"i"``: int) from ``example_inputs``; without
    the nodes ``skip`` (unused: :func:`host_writes`)."""
    refs: dict[Any, int] = {}
    kinds = ["t" if isinstance(x, torch.Tensor) else "i" for x in example_inputs]
    written = {v for n, v in _input_writes(gm) if n not in skip}
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(ph[:len(kinds)]):
        if n in written and kinds[i] == "t":
            kinds[i] = "m"
    nodes: list[Any] = []
    out: Any = None
    for n in gm.graph.nodes:
        if n in skip:
            continue
        if n.op == "placeholder":
            refs[n] = len(refs)
        elif n.op == "call_function":
            t = n.target
            if isinstance(t, torch._ops.OpOverload):
                name = op_name(t)
            elif t in _PY_NAMES:
                name = _PY_NAMES[t]
            else:
                raise GraphError(f"{t} is not an ATen op")
            nodes.append([name, _enc(list(n.args), refs),
                          {k: _enc(v, refs) for k, v in sorted(n.kwargs.items())}])
            refs[n] = len(refs)
        elif n.op == "output":
            out = _enc(node_outputs(gm), refs)
        else:
            raise GraphError(f"graph node {n.op} {n.target} is not data (constants must be "
                             "graph inputs)")
    n_in = sum(n.op == "placeholder" for n in gm.graph.nodes)
    if n_in != len(kinds):
        raise GraphError(f"the graph has {n_in} inputs, {len(kinds)} example inputs given")
    data = {"v": 1, "in": kinds, "nodes": nodes, "out": out}
    return msgpack.packb(data, use_bin_type=True), kinds


def content_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- decoding -------------------------------------------------------------------------------

def aten_resolve(name: str) -> Any:
    """An ATen op by its graph name (``aten::add.Tensor``); anything else is refused."""
    ns, _, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    if ns != "aten" or not base or not overload:
        raise GraphError(f"{name!r} is not an ATen op name")
    try:
        return getattr(getattr(torch.ops.aten, base), overload)
    except AttributeError:
        raise GraphError(f"no ATen op {name!r} in this PyTorch") from None


def _dec(x: Any, vals: list[Any], device: torch.device) -> Any:
    if isinstance(x, list):
        return [_dec(v, vals, device) for v in x]
    if isinstance(x, dict):
        if len(x) != 1:
            raise GraphError(f"bad graph value {x!r:.80}")
        (k, v), = x.items()
        if k == "r":
            if type(v) is not int or not 0 <= v < len(vals):
                raise GraphError(f"graph reference {v!r} is out of range")
            return vals[v]
        if k == "dtype":
            d = getattr(torch, str(v), None)
            if not isinstance(d, torch.dtype):
                raise GraphError(f"bad dtype {v!r}")
            return d
        if k == "device":
            return device if v == _DEVICE_TYPE else torch.device(str(v))
        if k == "layout":
            d = getattr(torch, str(v), None)
            if not isinstance(d, torch.layout):
                raise GraphError(f"bad layout {v!r}")
            return d
        if k == "memory_format":
            d = getattr(torch, str(v), None)
            if not isinstance(d, torch.memory_format):
                raise GraphError(f"bad memory format {v!r}")
            return d
        raise GraphError(f"bad graph value tag {k!r}")
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise GraphError(f"bad graph value {x!r:.80}")


def decode(data: bytes, device: torch.device,
           resolve: Callable[[str], Any] = aten_resolve) -> torch.fx.GraphModule:
    """Graph data as a ``GraphModule`` running on ``device`` (its device arguments map there);
    every op name goes through ``resolve`` (which raises for ops it does not admit)."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise GraphError(f"graph data does not decode: {e}") from None
    if not isinstance(d, dict) or d.get("v") != 1 or not isinstance(d.get("nodes"), list) \
            or not isinstance(d.get("in"), list):
        raise GraphError("graph data is not a version-1 graph")
    g = torch.fx.Graph()
    vals: list[Any] = []
    for i, k in enumerate(d["in"]):
        if k not in ("t", "m", "i"):
            raise GraphError(f"bad input kind {k!r}")
        vals.append(g.placeholder(f"in{i}"))
    for entry in d["nodes"]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and isinstance(entry[2], dict)):
            raise GraphError("bad graph node")
        name, args, kwargs = entry
        fn = PY_OPS.get(name) or resolve(name)
        vals.append(g.call_function(fn, tuple(_dec(args, vals, device)),
                                    {str(k): _dec(v, vals, device) for k, v in kwargs.items()}))
    g.output(_dec(d["out"], vals, device))
    return torch.fx.GraphModule(torch.nn.Module(), g)


# --- the registry ---------------------------------------------------------------------------

@dataclass
class GraphData:
    """A registered graph: its bytes, placeholder kinds and, per device, the decoded module and
    compiled callables by shape class (the decoded module itself where compiling failed or
    disagreed: the graph's ops run in order, op by op)."""

    key: str
    data: bytes
    kinds: list[str]
    ops: int
    modules: dict[str, torch.fx.GraphModule] = field(default_factory=dict)
    compiled: dict[Any, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # Inductor's, from torch.compile
    # the last call's shape class as a native check and its compiled entry (see _last)
    last: tuple[int, Any, Any] | None = None
    # per device: the graph compiled with dynamic shapes, where it takes sizes (see _dynamic);
    # False where that compilation failed or disagreed (each shape class then its own)
    dynamic: dict[str, Any] = field(default_factory=dict)
    resolve: Callable[[str], Any] = aten_resolve  # a server's admits only its opset
    writes: bool = False  # whether it writes inputs ("m" kinds: genie::graph_mut only)

    @property
    def all_tensors(self) -> bool:
        """Whether every input is a tensor read only (then the op's tensor list is the inputs, in
        order)."""
        return "i" not in self.kinds and "m" not in self.kinds

    @functools.cached_property
    def written(self) -> tuple[int, ...]:
        """The positions of the inputs the graph writes in place (``genie::graph_mut``'s first
        list)."""
        return tuple(i for i, k in enumerate(self.kinds) if k == "m")

    @functools.cached_property
    def written_set(self) -> frozenset[int]:
        return frozenset(self.written)

    @functools.cached_property
    def tensor_inputs(self) -> tuple[int, ...]:
        """The positions of the tensor inputs (read or written)."""
        return tuple(i for i, k in enumerate(self.kinds) if k != "i")

    def module(self, device: torch.device) -> torch.fx.GraphModule:
        k = str(device)
        gm = self.modules.get(k)
        if gm is None:
            gm = self.modules[k] = decode(self.data, device, self.resolve)
        return gm


_graphs: dict[str, GraphData] = {}
_lock = threading.Lock()

#: where Inductor cannot write its files itself (a server's sandboxed worker): a callable that has
#: them built for a graph and its arguments' shape class before the compile here loads them
#: (:mod:`genie.remote.compiler`); ``dynamic=True``: its compilation with dynamic shapes
builder: Callable[..., None] | None = None


#: whether genie::graph_mut's kernel checks the written inputs of every call
#: (:func:`check_written`, ~1 µs an input): a server's worker sets it, since aliasing is no part
#: of a shape class (its vet's cached effects and replayed programs do not see it); a process's
#: own calls come from torch.compile, whose AOTAutograd never passes written inputs that share
#: memory (the meta kernel checks each new input metadata all the same)
check_calls = False


def register(data: bytes, kinds: list[str] | None = None,
             resolve: Callable[[str], Any] = aten_resolve) -> GraphData:
    """The graph whose encoding is ``data`` (registered once per content). Decoded once here, so
    a graph with an op ``resolve`` refuses (or bad data) raises :class:`GraphError` (or
    ``resolve``'s error) now, before any call."""
    key = content_key(data)
    with _lock:
        g = _graphs.get(key)
        if g is None:
            meta = decode(data, torch.device("meta"), resolve)
            ph = [n for n in meta.graph.nodes if n.op == "placeholder"]
            d = msgpack.unpackb(data, raw=False)
            if kinds is None:
                kinds = list(d["in"])
            if len(kinds) != len(ph):
                raise GraphError(f"{len(kinds)} input kinds for a graph of {len(ph)} inputs")
            # the inputs it writes are the ones it declares ("m"), and no other: genie::graph
            # runs only graphs that write no input, genie::graph_mut writes the declared ones
            _only_input_copies(meta)
            writes = {ph.index(v) for _, v in _input_writes(meta)}
            declared = {i for i, k in enumerate(kinds) if k == "m"}
            if writes != declared:
                raise GraphError(f"graph {key[:16]} writes its inputs {sorted(writes)} but "
                                 f"declares {sorted(declared)} as written")
            g = _graphs[key] = GraphData(key, data, kinds, len(d["nodes"]), resolve=resolve,
                                         writes=bool(declared))
            g.modules["meta"] = meta
            bump("graphs")
    return g


def forget(key: str) -> None:
    """Drop a registered graph and its compilations (a server evicting a session's graph)."""
    with _lock:
        _graphs.pop(key, None)


def is_key(v: Any) -> bool:
    """Whether ``v`` is a graph key (64 lowercase hex digits: a SHA-256)."""
    return type(v) is str and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def keys_of(instrs: Any) -> list[str]:
    """The graph keys the ``genie::graph`` (and ``genie::graph_mut``) instructions of a tape
    call, in order, once each."""
    out: dict[str, None] = {}
    for ins in instrs:
        if ins.op is GRAPH_OP or ins.op is GRAPH_MUT_OP:
            out[ins.leaves[0]] = None
    return list(out)


def lookup(key: str) -> GraphData:
    g = _graphs.get(key)
    if g is None:
        raise GraphError(f"no graph {key[:16]}... is registered in this process")
    return g


def _inputs(g: GraphData, tensors: list[Any], ints: list[Any],
            written: list[Any] = ()) -> list[Any]:  # type: ignore[assignment]
    """The placeholders' values in order, from the op's lists: the tensors it writes
    (``genie::graph_mut``), the tensors it reads, the ints."""
    ti, ii, wi = iter(tensors), iter(ints), iter(written)
    try:
        out = [next(ti) if k == "t" else next(wi) if k == "m" else next(ii) for k in g.kinds]
    except StopIteration:
        out = []
    if len(out) != len(g.kinds) or len(out) != len(tensors) + len(ints) + len(written):
        raise GraphError(f"graph {g.key[:16]} takes {g.kinds.count('m')} tensors it writes, "
                         f"{g.kinds.count('t')} tensors and {g.kinds.count('i')} ints, got "
                         f"{len(written)}, {len(tensors)} and {len(ints)}")
    return out


def _tensor_outs(out: Any) -> list[torch.Tensor]:
    outs = out if isinstance(out, (list, tuple)) else [out]
    return [o for o in outs if isinstance(o, torch.Tensor)]


def interpret(gm: torch.fx.GraphModule, args: list[Any],
              writes: bool = False) -> list[torch.Tensor]:
    """The graph run op by op (the oracle); its tensor outputs. With ``writes``, each write of
    an input is checked first (:class:`_Writes`)."""
    return _tensor_outs((_Writes if writes else torch.fx.Interpreter)(gm).run(*args))


class _Writes(torch.fx.Interpreter):
    """The graph run op by op, each write of an input checked as an in-place op's first: the
    value written has the input's shape and dtype (an input mutation AOTAutograd keeps writes
    the input's new value; a broadcast into a larger tensor, or a cast, is not one)."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is _COPY_:
            dst, src = args[0], args[1]
            if not isinstance(src, torch.Tensor) or src.shape != dst.shape or \
                    src.dtype != dst.dtype:
                what = f"{tuple(src.shape)} {src.dtype}" if isinstance(src, torch.Tensor) \
                    else type(src).__name__
                raise GraphError(
                    f"genie::graph_mut writes an input of {tuple(dst.shape)} {dst.dtype} with a "
                    f"value of {what}: a graph writes each input with a value of its shape and "
                    "dtype (the inputs given do not have the shapes the graph was made for)")
        return super().call_function(target, args, kwargs)


def _meta(key: str, tensors: list[torch.Tensor], ints: list[int]) -> list[torch.Tensor]:
    g = _reading(key)
    return interpret(g.module(torch.device("meta")), _inputs(g, tensors, ints))


def _reading(key: str) -> GraphData:
    """The graph ``key`` for ``genie::graph``, whose schema writes nothing: one that writes an
    input runs as ``genie::graph_mut`` only."""
    g = lookup(key)
    if g.writes:
        raise GraphError(f"graph {key[:16]} writes its inputs {list(g.written)}: "
                         "genie::graph runs only graphs that write no input")
    return g


def _meta_mut(key: str, written: list[torch.Tensor], tensors: list[torch.Tensor],
              ints: list[int]) -> list[torch.Tensor]:
    g = lookup(key)
    args = _inputs(g, tensors, ints, written)
    check_written(g, args)
    return interpret(g.module(torch.device("meta")), args, writes=True)


def check_written(g: GraphData, args: list[Any]) -> None:
    """Raise :class:`GraphError` unless the inputs ``genie::graph_mut`` writes (``args``: the
    graph's inputs in order) are distinct memory, as an in-place op's output must be: none
    overlaps itself (an expanded view: eager's in-place ops refuse it), another input it writes
    (a tensor named twice) or an input it reads. ``torch.compile`` never passes such inputs
    (AOTAutograd merges aliased inputs it mutates into one); a compiled graph's code would write
    them in an order of its own. Works on real and on meta tensors (their storages alias as the
    real ones do). A server runs this on every call (:data:`check_calls`)."""
    written = g.written
    if not written:
        return
    for i in written:
        t = args[i]
        if not t.is_contiguous() and t.numel() > 1 and not _apart(t):
            raise GraphError(
                f"genie::graph_mut: graph {g.key[:16]} writes input {i}, a tensor whose "
                f"elements share memory (shape {tuple(t.shape)}, strides {t.stride()}): a "
                "graph writes only tensors whose elements are distinct (clone() it first)")
    # the bytes each tensor spans: by address on a real device (distinct storages never share
    # one), by storage and offset on meta (no addresses); then one sweep in address order
    meta = args[written[0]].is_meta
    spans = []
    for i in g.tensor_inputs:
        t = args[i]
        if t.is_contiguous():
            size = t.nbytes
        else:
            size = t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))\
                if t.numel() else 0
        if size:
            if meta:
                st, lo = t.untyped_storage()._cdata, t.storage_offset() * t.element_size()
            else:
                st, lo = 0, t.data_ptr()
            spans.append((st, lo, lo + size, i))
    spans.sort()
    w = g.written_set
    at = None
    for st, lo, hi, i in spans:
        if st != at:  # a new storage: nothing before it overlaps
            at, top, top_w = st, (lo, -1), (lo, -1)  # the highest end so far (all, written)
        j = top[1] if i in w and top[0] > lo else top_w[1] if top_w[0] > lo else -1
        if j >= 0:
            a, b = (i, j) if i in w else (j, i)
            raise GraphError(
                f"genie::graph_mut: graph {g.key[:16]} writes input {a}, whose memory overlaps "
                f"input {b} (which it {'writes' if b in w else 'reads'}): a graph's written "
                "inputs must be distinct tensors that share no memory with its other inputs, "
                "as torch.compile passes them")
        if hi > top[0]:
            top = (hi, i)
        if i in w and hi > top_w[0]:
            top_w = (hi, i)


def _apart(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory: eager's internal-overlap test, and where
    that cannot tell (a non-dense view), each dimension's stride past the reach of the ones
    below it (sufficient; a tensor it cannot prove apart counts as overlapping)."""
    o = torch._debug_has_internal_overlap(t)
    if o != 2:
        return o == 0
    reach = 0
    for s, n in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if s <= reach:
            return False
        reach += (n - 1) * s
    return True


def _unaliased(outs: list[torch.Tensor], inputs: list[Any]) -> list[torch.Tensor]:
    """``outs`` with fresh storages: a compiled graph may return views of its inputs or several
    views of one buffer, but the op promises new, distinct tensors (as its recorded node says)."""
    res = list(outs)
    for k in _aliased(outs, inputs):
        res[k] = outs[k].clone(memory_format=torch.preserve_format)
    return res


def _aliased(outs: list[torch.Tensor], inputs: list[Any]) -> tuple[int, ...]:
    """The positions of ``outs`` whose storage is an input's or an earlier output's (not empty)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    found = []
    for k, t in enumerate(outs):
        p = t.untyped_storage().data_ptr()
        if p in seen and t.untyped_storage().nbytes():
            found.append(k)
        else:
            seen.add(p)
    return tuple(found)


def _shape_class(device: torch.device, args: list[Any]) -> tuple[Any, ...]:
    return (device,) + tuple(
        (a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def _run_mut(key: str, written: list[torch.Tensor], tensors: list[torch.Tensor],
             ints: list[int]) -> list[torch.Tensor]:
    """``genie::graph_mut``: the graph's run, writing ``written`` in place."""
    g = lookup(key)
    args = _inputs(g, tensors, ints, written)
    if check_calls:
        check_written(g, args)
    return _run(key, args, [], g)


def _run(key: str, tensors: list[torch.Tensor], ints: list[int],
         g: GraphData | None = None) -> list[torch.Tensor]:
    """``genie::graph`` (and ``genie::graph_mut`` with ``g``, its inputs in order in
    ``tensors``)."""
    mut = g is not None
    if g is None:
        g = _reading(key)
    last = g.last
    if last is not None and len(tensors) == last[0] and last[1].check(*tensors):
        entry, args = last[2], tensors  # the shape class of the last call (checked natively)
    else:
        device = next((t.device for t in tensors if isinstance(t, torch.Tensor)
                       and t.device.type != "cpu"), _CPU)
        plain = mut or g.all_tensors and not ints and len(tensors) == len(g.kinds)
        args = tensors if plain else _inputs(g, tensors, ints)
        sk = _shape_class(device, args)
        entry = g.compiled.get(sk)
        if entry is None:
            with _no_modes(), torch.no_grad():
                return _unaliased(_first_run(g, device, args, sk), args)
        g.last = _last(args, entry) if plain and "i" not in g.kinds else None
    bump("graph_cache_hits")
    fn, restride, clone = entry
    # torch.no_grad() inline (the executor has it off already: then nothing to set)
    grad = torch.is_grad_enabled()
    if grad:
        torch._C._set_grad_enabled(False)
    try:
        with _no_modes():
            outs = _tensor_outs(fn(*args))
            for k, st in restride:
                o = outs[k]
                outs[k] = torch.empty_strided(o.shape, st, dtype=o.dtype,
                                              device=o.device).copy_(o)
            for k in clone:
                outs[k] = outs[k].clone(memory_format=torch.preserve_format)
            return outs
    finally:
        if grad:
            torch._C._set_grad_enabled(True)


_CPU = torch.device("cpu")


def direct(key: str, *lists: list[Any]
           ) -> tuple[Callable[..., Any], tuple[tuple[int, int], ...]] | None:
    """For a native replay (csrc/replay.cpp, ``Program.direct_last``), after a ``genie::graph``
    (``lists``: its tensors and ints) or ``genie::graph_mut`` call (its written inputs, tensors,
    ints) ran through the dispatcher: the callable :func:`_run` called for this shape class, and
    where each of the graph's placeholders is among the op's arguments (``(argument, element)``,
    the key being argument 0). The replay calls it directly for later calls whose arguments have
    the same shape class (it checks each one natively). None where :func:`_run` does more than
    call it: outputs it restrides or clones, a server checking every call's written inputs
    (:data:`check_calls`), a graph not compiled for this shape class."""
    g = _graphs.get(key)
    mut = len(lists) == 3
    if g is None or g.writes != mut or (mut and check_calls):
        return None
    written, tensors, ints = lists if mut else ([], *lists)
    try:
        args = _inputs(g, tensors, ints, written)
    except GraphError:
        return None
    device = next((t.device for t in args if isinstance(t, torch.Tensor)
                   and t.device.type != "cpu"), _CPU)
    entry = g.compiled.get(_shape_class(device, args))
    if entry is None or entry[1] or entry[2]:
        return None
    first = 1 + mut  # the op's argument holding the tensors it reads
    at = {"m": [1, 0], "t": [first, 0], "i": [first + 1, 0]}
    order = []
    for k in g.kinds:
        a = at[k]
        order.append((a[0], a[1]))
        a[1] += 1
    return entry[0], tuple(order)


def _last(args: list[torch.Tensor], entry: Any) -> tuple[int, Any, Any] | None:
    """``(count, guard, entry)``: a native check that tensors have ``args``' shape class (device,
    dtype, sizes, strides; and ``requires_grad``, dispatch keys: a stricter check, a miss only
    costs the lookup by shape class) for the next call, which then skips building its key."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        guard = TensorGuards(*args, dynamic_dims_sizes=[list(a.shape) for a in args],
                             dynamic_dims_strides=[list(a.stride()) for a in args])
    except Exception:  # noqa: BLE001 - torch without it: every call builds its key
        return None
    return len(args), guard, entry


def _no_modes() -> Any:
    """``_disable_current_modes()`` where a dispatch mode is on (a kernel run inside a mode's
    handler), else nothing to leave (most runs: entering it costs as much as a small kernel)."""
    if _len_dispatch_stack() or _len_pre_dispatch_stack():
        return _disable_current_modes()
    return _NOTHING


_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_NOTHING = contextlib.nullcontext()  # reentrant, reusable: entering it costs no allocation


def _first_run(g: GraphData, device: torch.device, args: list[Any],
               sk: tuple[Any, ...]) -> list[torch.Tensor]:
    """Compile ``g`` for this shape class, run it and the op-by-op oracle; keep the compilation
    only if they agree. Returns the oracle's values."""
    from .backends import compiled as cb

    gm = g.module(device)
    written = g.written
    # each run writes copies of the inputs the graph writes (the oracle's, each candidate's),
    # compared as outputs after the graph's own; the chosen run's are copied into the inputs
    seen: dict[str, Any] = {}
    # (a graph that writes inputs checks each write's shape first: once per shape class)
    want = _probe(lambda *a: interpret(gm, list(a), bool(written)), args, written, seen)
    n = len(want) - len(written)
    name = cb.compiler()
    reason = None
    dyn, new = _dynamic(g, gm, device, name, args)
    if dyn is not None:
        # a graph that takes sizes: its dynamic compilation (made now, or by another shape
        # class: Dynamo's guards recompile it where this class's shapes do not fit), checked
        # on this class as any compilation
        with waiting(f"compiling a graph of {g.ops} ops with {name} for {device}, dynamic "
                     "shapes" if new else f"checking a graph of {g.ops} ops, compiled with "
                     "dynamic shapes, on a new shape class"):
            try:
                reason, got = _disagreement(lambda *a: _probe(dyn, a, written, seen), args,
                                            want, cb._agrees)
            except Exception as e:  # noqa: BLE001 - any failure: this class compiles its own
                reason = f"{type(e).__name__}: {str(e).strip()[:200]}"
        if reason is None:
            return _keep(g, sk, dyn, got, want, n, seen, written, args,
                         None if new else "graph_shape_reuses")
        g.dynamic[str(device)] = False
        logger.info("genie: graph %s...: its dynamic-shape compilation is not used (%s); each "
                    "shape class compiles its own", g.key[:12], reason)
        reason = None
    try:
        with waiting(f"compiling a graph of {g.ops} ops with {name} for {device}"):
            if name == "inductor" and builder is not None:
                builder(g, args)
            fns = _compile(gm, args, name, g.options)
            # the first candidate that agrees with the oracle (the compiled code called
            # directly, else through its compiler's wrappers); a compiler that compiles at the
            # first call (torch.compile) fails here
            for i, fn in enumerate(fns):
                try:
                    reason, got = _disagreement(
                        lambda *a, fn=fn: _probe(fn, a, written, seen), args, want, cb._agrees)
                except Exception:
                    if i == len(fns) - 1:
                        raise
                    continue
                if reason is None:
                    break
        bump("graph_compiles")
    except Exception as e:  # a compiler failure: the graph runs op by op instead
        reason = f"{name} failed: {type(e).__name__}: {str(e).strip()[:200]}"
    if reason is None:
        return _keep(g, sk, fn, got, want, n, seen, written, args)
    # op by op: the graph module's own code (the graph's ops called in order, as the oracle
    # ran them, without the interpreter's per-node bookkeeping); its aliasing is the oracle's
    g.compiled[sk] = (gm, (), _aliased(want[:n], args))
    logger.warning("genie: compiled graph %s... runs op by op on %s (%s)", g.key[:12],
                   device, reason)
    for i, v in zip(written, want[n:]):
        args[i].copy_(v)
    return want[:n]


def _keep(g: GraphData, sk: tuple[Any, ...], fn: Callable[..., Any], got: list[torch.Tensor],
          want: list[torch.Tensor], n: int, seen: dict[str, Any], written: tuple[int, ...],
          args: list[Any], counter: str | None = None) -> list[torch.Tensor]:
    """Keep ``fn``, which agreed with the oracle ``want`` on this shape class ``sk``; the
    oracle's written inputs copied into ``args``. Returns the oracle's values."""
    # outputs the compiler laid out otherwise than the graph's op-by-op run (whose strides
    # the recorded node carries) are copied into that layout on every call
    restride = tuple((k, b.stride()) for k, (a, b) in enumerate(zip(got[:n], want[:n]))
                     if a.stride() != b.stride() and b.numel() > 1)
    # outputs the compiled code returns as views of its inputs or of another output (where
    # a buffer lives is fixed by the code, not by the values) are cloned on every call;
    # restrided ones are copies already
    copied = {k for k, _ in restride}
    clone = tuple(k for k in seen["aliased"] if k not in copied)
    g.compiled[sk] = (fn, restride, clone)
    bump("graph_verified")
    if counter is not None:
        bump(counter)
    for i, v in zip(written, want[n:]):
        args[i].copy_(v)
    return want[:n]


#: Inductor with dynamic shapes over a decoded graph (compiled at its first call)
_compile_dynamic = functools.partial(torch.compile, backend="inductor", dynamic=True,
                                     fullgraph=True)


def _dynamic(g: GraphData, gm: torch.fx.GraphModule, device: torch.device, name: str,
             args: list[Any]) -> tuple[Callable[..., Any] | None, bool]:
    """For a graph that takes sizes (Dynamo made some of its dimensions dynamic: a KV cache's
    length, a prompt's), one Inductor compilation with dynamic shapes per device, made at its
    first shape class's call and then checked on every new class, where compiling each class
    on its own took seconds for each new length (a generate with transformers' default cache
    compiled 8 graphs for 3 Dynamo graphs, 31 s against the CPU's 16 s). Dynamo's guards
    recompile it where a class does not fit (a size of 0 or 1). Where Inductor's files are
    built elsewhere (a server's sandboxed worker: :data:`builder`), the builder compiles it
    first, so the compilation here finds them. None where the graph takes no sizes, the
    compiler is not Inductor, or that compilation failed or disagreed before. The second
    value: whether it is made now (it compiles at its first call)."""
    if name != "inductor" or "i" not in g.kinds:
        return None, False
    k = str(device)
    fn = g.dynamic.get(k)
    if fn is None:
        if builder is not None:
            try:
                builder(g, args, dynamic=True)
            except Exception as e:  # noqa: BLE001 - each shape class compiles its own
                g.dynamic[k] = False
                logger.info("genie: graph %s...: no dynamic-shape compilation (%s)", g.key[:12],
                            e)
                return None, False
        fn = g.dynamic[k] = _compile_dynamic(gm, options=dict(_INDUCTOR_DEFAULTS)
                                             if builder is not None else
                                             {**_INDUCTOR_DEFAULTS, **(g.options or {})})
        bump("graph_compiles")
        return fn, True
    return (None if fn is False else fn), False


def _probe(fn: Callable[..., Any], args: Any, written: tuple[int, ...],
           seen: dict[str, Any]) -> list[torch.Tensor]:
    """``fn``'s tensor outputs on ``args`` with the inputs at ``written`` replaced by copies
    (``args`` stay as they are), then those copies as ``fn`` left them. ``seen["aliased"]``:
    the outputs that are views of an input (or of an earlier output), see :func:`_aliased`."""
    a = list(args)
    for i in written:
        a[i] = a[i].clone(memory_format=torch.preserve_format)
    outs = _tensor_outs(fn(*a))
    seen["aliased"] = _aliased(outs, a)
    return outs + [a[i] for i in written]


def _disagreement(fn: Callable[..., Any], args: list[Any], want: list[torch.Tensor],
                  agrees: Callable[[torch.Tensor, torch.Tensor], bool]
                  ) -> tuple[str | None, list[torch.Tensor]]:
    """``fn``'s outputs on ``args``, and why they are not the oracle's ``want`` by ``agrees``
    (None when they are). What ``fn`` raises propagates (a compiler failure)."""
    got = _tensor_outs(fn(*args))
    if len(got) != len(want):
        return f"it returned {len(got)} tensors, the graph {len(want)}", got
    for k, (a, b) in enumerate(zip(got, want)):
        if not agrees(a, b):
            return f"output {k} differs from the op-by-op run", got
    return None, got


def _compile(gm: torch.fx.GraphModule, args: list[Any], name: str,
             options: dict[str, Any]) -> list[Callable[..., Any]]:
    """Callables running ``gm`` compiled by ``name``, best first (each is checked against the
    oracle before it is kept)."""
    if name == "inductor":
        return _inductor(gm, args, options)
    if name in ("eager", "aot_eager"):
        return [gm]
    return [torch.compile(gm, backend=name, fullgraph=True, dynamic=False)]


#: Inductor's options for a graph here, under the ones given to ``torch.compile``. No size
#: asserts: the generated code checked every input's sizes and strides on every call
#: (``assert_size_stride``, ~0.2 µs an input: 7 µs of a 6-layer MLP's 56 µs call, 37 inputs),
#: which the kernel has done already: a compilation is called only for its own shape class
#: (:func:`_run`: the last call's native check, else the lookup by shape class)
_INDUCTOR_DEFAULTS: dict[str, Any] = {"size_asserts": False}


def _inductor(gm: torch.fx.GraphModule, args: list[Any],
              options: dict[str, Any]) -> list[Callable[..., Any]]:
    """``torch._inductor.compile(gm, args, options)``, and first, where AOTAutograd's runtime
    wrapper around the generated code has nothing to do, the generated code itself.

    A graph here is already functional Core ATen, yet Inductor traces it again with AOTAutograd,
    whose runtime wrapper (with ``torch._dynamo.disable``'s and the compiled graph's own) costs
    ~8 µs a call around a ~3 µs call of a small graph's code. That wrapper does nothing when
    the inference graph mutates no input, returns no alias (of an input or an intermediate), no
    effect tokens, no subclass, and AOTAutograd kept every input (no deduplicated or merged
    inputs); then the code is called directly, as the wrapper would."""
    from torch._guards import TracingContext
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    seen: list[tuple[Any, Any, int, dict[str, Any]]] = []

    def inner(gm_: torch.fx.GraphModule, inputs: Any, *a: Any, **kw: Any) -> Any:
        out = compile_fx_inner(gm_, inputs, *a, **kw)
        ctx = TracingContext.try_get()
        seen.append((out, ctx.fw_metadata if ctx is not None else None, len(inputs), kw))
        return out

    fn = compile_fx(gm, list(args), inner_compile=inner,
                    config_patches={**_INDUCTOR_DEFAULTS, **(options or {})})
    direct = _direct(seen, args)
    return [fn] if direct is None else [direct, fn]


def _direct(seen: list[tuple[Any, Any, int, dict[str, Any]]],
            args: list[Any]) -> Callable[..., Any] | None:
    """The generated code of the one inference graph Inductor compiled, as a callable of the
    graph's inputs, where AOTAutograd's wrapper around it is the identity (see
    :func:`_inductor`); else None."""
    try:
        from torch._functorch._aot_autograd.schemas import OutputType, SubclassCreationMeta
    except ImportError:  # another torch: keep the wrapper
        return None
    if len(seen) != 1:
        return None
    out, m, n_in, kw = seen[0]
    if m is None or not kw.get("is_inference") or kw.get("cudagraphs") or n_in != len(args) \
            or len(m.input_info) != len(args) or not getattr(out, "_boxed_call", False):
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len({id(t) for t in tensors}) != len(tensors) or \
            len({t.untyped_storage().data_ptr() for t in tensors if t.numel()}) != \
            sum(1 for t in tensors if t.numel()):
        return None  # inputs AOTAutograd would merge (duplicates, views of one base)
    if m.num_mutated_inp_runtime_indices or m.num_intermediate_bases or m.tokens or \
            m.grad_enabled_mutation is not None or \
            any(o.output_type != OutputType.non_alias for o in m.output_info) or \
            any(isinstance(s, SubclassCreationMeta)
                for s in (*m.subclass_inp_meta, *m.subclass_fw_graph_out_meta)):
        return None
    call = getattr(out, "current_callable", None) or out

    def direct(*a: Any) -> Any:
        return call(list(a))

    return direct


# --- the op ---------------------------------------------------------------------------------

_lib = torch.library.Library("genie", "DEF")
_lib.define("graph(str key, Tensor[] tensors, SymInt[] ints) -> Tensor[]")
_lib.impl("graph", _meta, "Meta")
_lib.impl("graph", _run, "CompositeExplicitAutograd")
# a graph that writes some of its inputs in place (the first list): an optimizer's step, a static
# KV cache's update, kept in the graph (AOTAutograd's keep_inference_input_mutations) instead of
# returned and copied back, one recorded copy_ each (genie.dynamo)
_lib.define("graph_mut(str key, Tensor(a!)[] written, Tensor[] tensors, SymInt[] ints) "
            "-> Tensor[]")
_lib.impl("graph_mut", _meta_mut, "Meta")
_lib.impl("graph_mut", _run_mut, "CompositeExplicitAutograd")

GRAPH_OP = torch.ops.genie.graph.default
GRAPH_MUT_OP = torch.ops.genie.graph_mut.default
