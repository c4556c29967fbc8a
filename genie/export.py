"""Exports of a capture graph: ``torch.fx``, Graphviz, a summary table and a stable text dump.

All four read the graph as recorded (``CaptureGraph.leaves`` keeps each node's arguments even
after the node has run). None of them records anything; :func:`to_fx` and :func:`example_inputs`
materialize the graph's external inputs (parameters, inputs), nothing else.

``to_fx`` turns each node into one ``call_function`` of its ATen overload, in record order, on a
real device: running the same ATen calls in the same order on real tensors is what Genie's
executor does, so the module computes what eager computed (aliasing and in-place writes included).

- External inputs (``load*K``) and uploads of host tensors become placeholders, in load order
  then upload order; :func:`example_inputs` gives their current values. Those that are parameters
  or buffers of the modules called in the block become attributes of the module instead.
- ``torch.tensor(...)`` literals created in the block and data-dependent results become constant
  attributes; random ops run under the same ``(seed, offset)`` as in Genie, so the values match.
- Outputs: the given LazyTensors (any pytree of them), else every value a live tensor still holds
  that no later node of the graph reads.
"""

from __future__ import annotations

import operator
import weakref
from typing import TYPE_CHECKING, Any

import optree
import torch

from . import ids as _ids
from .errors import GenieError
from .backends.rng import generator_for, seed_from
from .executor import run_tape
from .graph import MetaArg, Node, Ref
from .lazy_tensor import LazyTensor, materialize
from .meta import policy
from .planner import build_tape

if TYPE_CHECKING:
    from .capture import CaptureGraph

_UPLOAD = "genie.upload"
_RESULT = "genie.result"


class ExportError(GenieError):
    """A capture graph that cannot be exported as asked."""


# --- text dump ---------------------------------------------------------------------------------

def dump(g: CaptureGraph) -> str:
    """One line per load and per node; stable across runs and processes (golden tests).

    Example line::

        op*4 = aten.addmm.default(load*1, op*2, op*3) -> float32[2, 4]  # addmm*0|load*1|op*2|op*3
            module=net.0 (Linear) role=activation cat=matmul flops=96
    """
    lines = [f"# genie capture: {len(g.nodes)} nodes, {len(g.ids.loads)} loads",
             f"# fingerprint {g.fingerprint}"]
    for ld in g.ids.loads:
        role, name = g.load_role(ld)
        lines.append(f"{ld.id} = load -> {_ids.meta_text(ld.meta)}  # role={role}"
                     + (f" name={name}" if name else ""))
    for pos, node in enumerate(g.nodes):
        info = g._info_at(pos)
        outs = ", ".join(_ids.meta_text(m) if m is not None else "-" for m in node.metas)
        sem = [f"module={_module_text(info.module, info.module_class)}"]
        if info.phase is not None:
            sem.append(f"phase={info.phase}")
        if info.region != "forward":
            sem.append(f"region={info.region}")
        sem.append("role=" + ",".join(r or "-" for r in info.roles))
        names = [n for n in info.names if n]
        if names:
            sem.append("name=" + ",".join(names))
        sem.append(f"cat={info.category}")
        if info.flops:
            sem.append(f"flops={info.flops}")
        lines.append(f"{node.uid} = {node.op}({_args_text(g, pos)}) -> {outs}  "
                     f"# {info.complex_id}  {' '.join(sem)}")
    return "\n".join(lines) + "\n"


def _module_text(path: str | None, cls: str | None) -> str:
    if cls is None:
        return "-"
    return f"{path or '<root>'} ({cls})"


def _args_text(g: CaptureGraph, pos: int) -> str:
    node, leaves = g.nodes[pos], g.leaves[pos]
    if leaves is None:
        return ""
    texts = [g.ids.input_id(x) if type(x) is Ref else _ids.const_text(x) for x in leaves]
    if node.spec is None:
        return ", ".join(texts)
    args, kwargs = optree.tree_unflatten(node.spec, texts)
    parts = [_fmt(a) for a in args] + [f"{k}={_fmt(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _fmt(x: Any) -> str:
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in x.items()) + "}"
    return str(x)


# --- summary -----------------------------------------------------------------------------------

def summary(g: CaptureGraph, depth: int | None = None) -> str:
    """Nodes, FLOPs and bytes per module (paths cut to ``depth`` parts), per phase, per category."""
    infos = g.infos()
    classes = g.module_classes
    by_module: dict[str, list[Any]] = {}
    by_phase: dict[str, list[Any]] = {}
    by_cat: dict[str, list[Any]] = {}
    for i in infos:
        if i.module_class is None:
            key = "(no module)"
        elif not i.module:
            key = f"<root> ({i.module_class})"
        else:
            path = i.module if depth is None else ".".join(i.module.split(".")[:depth])
            cls = i.module_class if path == i.module else classes.get(path)
            key = f"{path} ({cls})" if cls else path
        for table, k in ((by_module, key), (by_phase, i.phase or "-"), (by_cat, i.category)):
            row = table.setdefault(k, [0, 0, 0])
            row[0] += 1
            row[1] += i.flops
            row[2] += i.bytes
    total_flops = sum(i.flops for i in infos)
    total_bytes = sum(i.bytes for i in infos)
    out = [f"capture: {len(infos)} nodes, {len(g.ids.loads)} loads, {_si(total_flops)}FLOP, "
           f"{_si(total_bytes)}B, fingerprint {g.fingerprint[:16]}"]
    for title, table in (("module", by_module), ("phase", by_phase), ("category", by_cat)):
        width = max([len(title)] + [len(k) for k in table])
        out.append("")
        out.append(f"{title:<{width}}  {'nodes':>6}  {'FLOPs':>9}  {'bytes':>9}")
        out.append("-" * (width + 32))
        for k, (n, f, b) in table.items():
            out.append(f"{k:<{width}}  {n:>6}  {_si(f):>9}  {_si(b):>9}")
    return "\n".join(out) + "\n"


def _si(x: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(x) < 1000:
            return f"{x:.0f}{unit}" if unit == "" else f"{x:.1f}{unit}"
        x /= 1000
    return f"{x:.1f}P"


# --- graphviz ----------------------------------------------------------------------------------

def to_dot(g: CaptureGraph, path: str | None = None) -> str:
    """Graphviz ``digraph``: a cluster per module path (nested), labels with ids, ops and shapes."""
    infos = g.infos()
    members: dict[str | None, list[str]] = {}
    classes: dict[str, str] = dict(g.module_classes)
    node_lines: dict[str, str] = {}
    for node, info in zip(g.nodes, infos, strict=True):
        outs = ", ".join(_ids.meta_text(m) for m in node.metas if m is not None)
        label = f"{node.uid}\\n{_ids.short_name(node.op)}\\n{outs}"
        node_lines[node.uid] = f'"{node.uid}" [label="{_esc(label)}"];'
        key = None if info.module_class is None else (info.module or "")
        if key is not None:
            classes.setdefault(key, info.module_class)
        members.setdefault(key, []).append(node.uid)
    lines = ["digraph genie {", "  rankdir=TB;", '  node [shape=box, fontsize=10];']
    for ld in g.ids.loads:
        role, name = g.load_role(ld)
        label = f"{ld.id}\\n{name or role}\\n{_ids.meta_text(ld.meta)}"
        lines.append(f'  "{ld.id}" [shape=ellipse, label="{_esc(label)}"];')
    for uid in members.get(None, []):
        lines.append("  " + node_lines[uid])
    # clusters: every module path with nodes, and its ancestors, nested by path components;
    # top-level clusters are the root ("") and further roots ("[1]", ...)
    tree: dict[str, list[str]] = {}
    tops: list[str] = []
    for p in sorted((k for k in members if k is not None), key=_path_key):
        cur = p
        while True:
            parent = _parent(cur)
            if parent is None:
                if cur not in tops:
                    tops.append(cur)
                break
            kids = tree.setdefault(parent, [])
            if cur in kids:
                break
            kids.append(cur)
            cur = parent
    counter = [0]

    def emit(p: str, indent: str) -> None:
        counter[0] += 1
        cls = classes.get(p)
        title = (p or "<root>") + (f" ({cls})" if cls else "")
        lines.append(f"{indent}subgraph cluster_{counter[0]} {{")
        lines.append(f'{indent}  label="{_esc(title)}"; style=rounded; color=gray50;')
        for uid in members.get(p, []):
            lines.append(f"{indent}  " + node_lines[uid])
        for child in sorted(tree.get(p, []), key=_path_key):
            emit(child, indent + "  ")
        lines.append(f"{indent}}}")

    for top in sorted(tops, key=_path_key):
        emit(top, "  ")
    for node, leaves in zip(g.nodes, g.leaves, strict=True):
        seen: list[str] = []
        for x in leaves or ():
            if type(x) is Ref:
                src = g.ids.input_id(x)
                if src not in seen:
                    seen.append(src)
                    lines.append(f'  "{src.split(":")[0]}" -> "{node.uid}";')
    lines.append("}")
    text = "\n".join(lines) + "\n"
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


def _parent(p: str) -> str | None:
    """Enclosing module path; None for a root ("" or "[k]")."""
    if "." in p:
        return p.rsplit(".", 1)[0]
    if p == "" or p.startswith("["):
        return None
    return ""


def _path_key(p: str) -> list[Any]:
    return [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.split(".")]


def _esc(s: str) -> str:
    return s.replace('"', '\\"')


# --- torch.fx ----------------------------------------------------------------------------------

class SeededOp(torch.nn.Module):
    """Runs a random op with the generator seeded as Genie's executor seeds it, then restores it."""

    def __init__(self, op: Any, rng: tuple[int, int]) -> None:
        super().__init__()
        self.op = op
        self.rng = rng

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dev = next((x.device for x in optree.tree_leaves((args, kwargs))
                    if isinstance(x, torch.Tensor)), None) or kwargs.get("device") \
            or torch.device("cpu")
        gen = generator_for(torch.device(dev))
        saved = gen.get_state()
        gen.manual_seed(seed_from(*self.rng))
        try:
            return self.op(*args, **kwargs)
        finally:
            gen.set_state(saved)


def flat_output(x: Any, k: int) -> Any:
    """The ``k``-th flat output of an op's (nested) return value."""
    return optree.tree_leaves(x, none_is_leaf=True)[k]


def _inputs(g: CaptureGraph) -> list[tuple[str, Any]]:
    """Placeholders of :func:`to_fx`: ``(name, load or upload position)`` in order."""
    out: list[tuple[str, Any]] = []
    for ld in g.ids.loads:
        role, _ = g.load_role(ld)
        if role not in ("parameter", "buffer"):
            out.append((ld.id.replace("*", "_"), ld))
    for pos, node in enumerate(g.nodes):
        if node.op == _UPLOAD and pos not in g.literals:
            role = g._info_at(pos).role
            if role not in ("parameter", "buffer"):
                out.append((f"upload_{pos}", pos))
    return out


def _followed(r: Any) -> Any:
    """The tensor a capture graph's node follows for an output (its weak reference's), or None
    (dead; or a node of the default graph, which counts its outputs' holders instead)."""
    return r() if type(r) is weakref.ref else None


def _value(node: Node, out: int) -> torch.Tensor:
    t = _followed(node.output(out)) if out < len(node.metas) else None
    if isinstance(t, LazyTensor) and t._node is node and t._out == out:
        return materialize(t, trigger="export")
    if node.executed:
        v = node.values[out] if node.values is not None else None
        if v is None:
            raise ExportError(f"[to_fx] the value of {node.uid} ({node.op}) was freed: no live "
                              "tensor holds it. Keep a reference to it until the export.")
        return v
    return run_tape(build_tape([(node, out)]), node.metas[out].index)[0]


def example_inputs(g: CaptureGraph, device: Any = "cpu") -> list[torch.Tensor]:
    """Current values of the placeholders of :func:`to_fx`, on ``device``."""
    dev = torch.device(device)
    vals = []
    for _, src in _inputs(g):
        if isinstance(src, int):
            vals.append(g.leaves[src][0].to(dev))
        else:
            vals.append(_value(src.node, src.out).to(dev))
    return vals


def to_fx(g: CaptureGraph, outputs: Any = None, device: Any = "cpu") -> torch.fx.GraphModule:
    """A ``torch.fx.GraphModule`` computing ``outputs`` from the graph's inputs on ``device``.

    Example:
        >>> import torch, genie
        >>> lin = torch.nn.Linear(4, 2)              # a host module: its weights get uploaded
        >>> x = torch.randn(3, 4)
        >>> with genie.capture() as g:
        ...     y = lin(x.to("remote_accelerator"))   # the input: an upload, a placeholder
        >>> gm = g.to_fx(y)
        >>> torch.allclose(gm(*g.example_inputs()), lin(x))
        True
    """
    dev = torch.device(device)
    fg = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[tuple[int, int], Any] = {}  # (node.index, out) -> fx node
    fx_of: dict[int, Any] = {}  # position -> fx node of the call
    used_names: set[str] = set()

    def attr(name: str, value: torch.Tensor, param: bool = False) -> Any:
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "c"
        if base[0].isdigit():
            base = "_" + base
        n, i = base, 1
        while n in used_names:
            n, i = f"{base}_{i}", i + 1
        used_names.add(n)
        v = value.detach().to(dev)
        if param:
            root.register_parameter(n, torch.nn.Parameter(v, requires_grad=False))
        else:
            root.register_buffer(n, v)
        return fg.get_attr(n)

    placeholders: dict[Any, str] = {src if isinstance(src, int) else src.id: name
                                    for name, src in _inputs(g)}
    for ld in g.ids.loads:
        name = placeholders.get(ld.id)
        if name is not None:
            env[(ld.node.index, ld.out)] = fg.placeholder(name)
        else:
            role, pname = g.load_role(ld)
            env[(ld.node.index, ld.out)] = attr(pname or ld.id, _value(ld.node, ld.out),
                                                param=role == "parameter")
    for pos, node in enumerate(g.nodes):
        if node.op == _UPLOAD and pos not in g.literals and pos in placeholders:
            env[(node.index, 0)] = fg.placeholder(placeholders[pos])

    def value_of(ref: Ref) -> Any:
        key = (ref.node.index, ref.out)
        v = env.get(key)
        if v is None:
            p = fx_of.get(_pos_in(g, ref.node))
            if p is None:
                raise ExportError(f"[to_fx] {g.ids.input_id(ref)} is used before it is defined")
            v = env[key] = _select(fg, p, ref.node, ref.out)
        return v

    for pos, node in enumerate(g.nodes):
        leaves = g.leaves[pos]
        if node.op == _UPLOAD:
            if (node.index, 0) not in env:
                info = g._info_at(pos)
                env[(node.index, 0)] = attr(info.names[0] or f"const_{pos}", leaves[0],
                                            param=info.role == "parameter")
            continue
        if node.op == _RESULT or leaves is None:
            for k, m in enumerate(node.metas):
                if m is not None:
                    v = node.values[k] if node.values is not None else None
                    if v is None:
                        raise ExportError(f"[to_fx] {node.uid} ({node.op}) has no recorded "
                                          "arguments and its value was freed")
                    env[(node.index, k)] = attr(f"result_{pos}_{k}", v)
            continue
        if not isinstance(node.op, torch._ops.OpOverload):
            raise ExportError(f"[to_fx] {node.uid}: cannot export the pseudo-op {node.op!r}")
        mapped = []
        for j, x in enumerate(leaves):
            t = type(x)
            if t is Ref:
                mapped.append(value_of(x))
            elif t is MetaArg:
                m = x.meta
                mapped.append(fg.call_function(torch.empty_strided, (m.shape, m.stride),
                                               {"dtype": m.dtype, "device": dev}))
            elif t is torch.device and x.type == "remote_accelerator":
                mapped.append(dev)
            elif isinstance(x, torch.Tensor):
                mapped.append(attr(f"const_{pos}_{j}", x))
            else:
                mapped.append(x)
        if policy(node.op).inplace_view:
            # x.t_() was recorded as a new view of x: apply it to an alias, as the executor does
            mapped[0] = fg.call_function(torch.ops.aten.alias.default, (mapped[0],))
        args, kwargs = optree.tree_unflatten(node.spec, mapped)
        if node.rng is not None:
            name = f"rng_{pos}"
            root.add_module(name, SeededOp(node.op, node.rng))
            call = fg.call_module(name, tuple(args), dict(kwargs))
        else:
            call = fg.call_function(node.op, tuple(args), dict(kwargs))
        fx_of[pos] = call

    if outputs is None:
        outputs = _default_outputs(g)
    flat, spec = optree.tree_flatten(outputs, none_is_leaf=True)
    fx_outs = []
    for t in flat:
        if not isinstance(t, LazyTensor):
            raise ExportError(f"[to_fx] outputs must be remote_accelerator tensors of the graph, "
                              f"got {type(t).__name__}")
        fx_outs.append(value_of(Ref(t._node, t._out)))
    result = optree.tree_unflatten(spec, fx_outs)
    fg.output(result if isinstance(result, (tuple, list, dict)) else result)
    gm = torch.fx.GraphModule(root, fg, class_name="GenieCapture")
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _pos_in(g: CaptureGraph, node: Node) -> int:
    if not g.owns(node):
        raise ExportError(f"[to_fx] {node.uid} ({node.op}) belongs to another graph and was never "
                          "read inside the block; only values of this capture can be outputs")
    return _ids.position(node)


def _select(fg: torch.fx.Graph, call: Any, node: Node, out: int) -> Any:
    spec = node.out_spec
    if spec is None or spec.num_leaves == 1 and spec.num_nodes == 1:
        return call
    if spec.num_nodes == spec.num_leaves + 1 and spec.type in (tuple, list):
        return fg.call_function(operator.getitem, (call, out))
    return fg.call_function(flat_output, (call, out))


def _default_outputs(g: CaptureGraph) -> tuple[Any, ...]:
    read: set[tuple[int, int]] = set()
    for leaves in g.leaves:
        for x in leaves or ():
            if type(x) is Ref:
                read.add((x.node.index, x.out))
    outs = []
    for node in g.nodes:
        for k, ref in enumerate(node.outputs):
            t = _followed(ref)
            if isinstance(t, LazyTensor) and t._node is node and t._out == k \
                    and (node.index, k) not in read:
                outs.append(t)
    return tuple(outs)
