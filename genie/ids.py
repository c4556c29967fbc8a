"""Deterministic operation ids and the structural fingerprint of a capture graph (seed 000).

Every node of a :class:`~genie.capture.CaptureGraph` has two ids:

- the **unique id** ``op*N`` (``Node.uid``): N is the node's record position in its graph;
- the **complex id** ``{op}*{index}|{input id}|{input id}...``: the op's short name, the index of
  this call among earlier calls with the same name *and* the same inputs, then the unique ids of
  the values it reads (``op*3``, or ``op*3:1`` for the second output of a multi-output node).

A value that enters the graph from outside (a LazyTensor recorded before the block, or in another
graph) gets a **load** id ``load*K`` the first time a node reads it; loads are not nodes (nothing
runs for them), they name the graph's external inputs. Host tensors that ops inside the block
read are uploaded by ``genie.capture`` and show up as ``upload`` nodes.

The **fingerprint** is a running BLAKE2b digest fed one record per node (and per load), in
record order: op schema string, argument tree, input ids, constants (type and value; tensor
constants by metadata only), output shapes/strides/dtypes/device indices. It never sees ``id()``,
object hashes, set order, clocks, random seeds or tensor values, so the same program gives the
same fingerprint in any process; a different shape or dtype changes it, different input values do
not.

Cost: ids and digest are incremental (each node is processed once, in order) but deferred to the
first read after the node was recorded: processing a node costs 3-5 µs (string building and
hashing), which would be a fifth of the recording cost if paid per op; recording pays only the
capture graph's list appends. Expensive texts (schemas, specs, tensor metadata) are memoized.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .graph import MetaArg, Node, Ref, TensorMeta
from .shape_rules import contiguous_strides

if TYPE_CHECKING:
    from .graph import Graph

_DIGEST_SIZE = 16


@dataclass(frozen=True, slots=True)
class Load:
    """An external input of a capture graph: output ``out`` of ``node`` (from another graph)."""

    id: str
    node: Node
    out: int
    meta: TensorMeta


class IdState:
    """Per-graph id bookkeeping: complex ids by record position, loads, and the running digest.

    Recording only appends the node to ``nodes``/``leaves`` (owned by the capture graph); every
    reader first calls :meth:`sync`, which feeds the nodes recorded since the last read, in
    record order, into the running digest and the id tables. Each node is processed exactly once,
    so the result is the one a per-creation update would give, without its cost on the hot path.
    """

    __slots__ = ("graph", "nodes", "leaves", "_done", "_complex", "_loads", "_by_key", "_counts",
                 "_h")

    def __init__(self, graph: Graph, nodes: list[Node], leaves: list[list[Any] | None]) -> None:
        self.graph = graph
        self.nodes = nodes
        self.leaves = leaves
        self._done = 0
        self._complex: list[str] = []
        self._loads: list[Load] = []
        self._by_key: dict[tuple[int, int], Load] = {}  # (node.index, out) -> Load; in-process only
        self._counts: dict[str, int] = {}
        self._h = hashlib.blake2b(b"genie-graph-v1", digest_size=_DIGEST_SIZE)

    def sync(self) -> None:
        """Process the nodes recorded since the last read."""
        n = len(self.nodes)
        while self._done < n:
            i = self._done
            self._add(self.nodes[i], self.leaves[i])
            self._done = i + 1

    def _add(self, node: Node, leaves: list[Any] | None) -> None:
        graph = self.graph
        op = node.op
        parts = [_op_text(op), _spec_text(node.spec)]
        inputs: list[str] = []
        if leaves is not None:
            for x in leaves:
                if type(x) is Ref:
                    src = x.node
                    if src.graph is graph:
                        iid = src.uid if x.out == 0 else f"{src.uid}:{x.out}"
                    else:
                        iid = self._load(src, x.out).id
                    inputs.append(iid)
                    parts.append("@" + iid)
                else:
                    parts.append(const_text(x))
        for m in node.metas:
            parts.append(meta_text(m) if m is not None else "-")
        short = short_name(op)
        sig = short + "|" + "|".join(inputs) if inputs else short
        k = self._counts.get(sig, 0)
        self._counts[sig] = k + 1
        self._complex.append(f"{short}*{k}|" + "|".join(inputs) if inputs else f"{short}*{k}")
        self._h.update(("\x1f".join(parts) + "\x1e").encode())

    def _load(self, node: Node, out: int) -> Load:
        key = (node.index, out)
        ld = self._by_key.get(key)
        if ld is None:
            meta = node.metas[out]
            ld = Load(f"load*{len(self._loads)}", node, out, meta)
            self._loads.append(ld)
            self._by_key[key] = ld
            self._h.update(f"{ld.id}={meta_text(meta)}\x1e".encode())
        return ld

    # --- reading -------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """Hex digest of everything recorded so far (reading it does not stop the stream)."""
        self.sync()
        return self._h.copy().hexdigest()

    @property
    def complex_ids(self) -> list[str]:
        """Complex id of every node, by record position."""
        self.sync()
        return self._complex

    @property
    def loads(self) -> list[Load]:
        """External inputs, in first-use order."""
        self.sync()
        return self._loads

    def load_of(self, node: Node, out: int) -> Load | None:
        """The load for an external value, if a node of this graph has read it."""
        self.sync()
        return self._by_key.get((node.index, out))

    def input_id(self, ref: Ref) -> str:
        """The id a node of this graph uses for ``ref``: ``op*N[:k]`` or ``load*K``."""
        src = ref.node
        if src.graph is self.graph:
            return src.uid if ref.out == 0 else f"{src.uid}:{ref.out}"
        ld = self.load_of(src, ref.out)
        return ld.id if ld is not None else "<external>"


def position(node: Node) -> int:
    """Record position of ``node`` in its graph (N of its unique id ``op*N``)."""
    return node.seq


def position_of_uid(uid: str) -> int:
    """Record position named by a unique id ``op*N``."""
    if not uid.startswith("op*") or not uid[3:].isdigit():
        raise KeyError(f"[ids] {uid!r} is not a unique id (expected 'op*N')")
    return int(uid[3:])


# --- canonical texts (memoized; all deterministic across processes) -------------------------------

_op_texts: dict[Any, str] = {}
_short_names: dict[Any, str] = {}
_spec_texts: dict[Any, str] = {}
_meta_texts: dict[TensorMeta, str] = {}


def _op_text(op: Any) -> str:
    t = _op_texts.get(op)
    if t is None:
        schema = getattr(op, "_schema", None)
        t = _op_texts[op] = str(schema) if schema is not None else str(op)
    return t


def short_name(op: Any) -> str:
    """``add`` for ``aten.add.Tensor``, ``upload`` for the pseudo-op ``genie.upload``."""
    t = _short_names.get(op)
    if t is None:
        name = getattr(op, "_opname", None)
        t = _short_names[op] = name if name is not None else str(op).rsplit(".", 1)[-1]
    return t


def _spec_text(spec: Any) -> str:
    if spec is None:
        return ""
    t = _spec_texts.get(spec)
    if t is None:
        t = _spec_texts[spec] = str(spec)
    return t


def dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def meta_text(m: TensorMeta) -> str:
    """``float32[8, 128]`` plus stride/offset/device when they are not the defaults."""
    t = _meta_texts.get(m)
    if t is None:
        shape = ", ".join(map(str, m.shape))
        t = f"{dtype_text(m.dtype)}[{shape}]"
        if m.stride != contiguous_strides(m.shape):
            t += f"s({', '.join(map(str, m.stride))})"
        if m.offset:
            t += f"+{m.offset}"
        if m.index:
            t += f"@{m.index}"
        if len(_meta_texts) < 1 << 16:
            _meta_texts[m] = t
    return t



_SIMPLE = (bool, int, float, str, type(None))


def const_text(x: Any) -> str:
    """Canonical text of a non-tensor-input argument: type and value, tensors by metadata only."""
    t = type(x)
    if t in _SIMPLE:
        return repr(x)
    if t is torch.dtype:
        return dtype_text(x)
    if t is torch.device:
        return f"device({x})"
    if t is MetaArg:
        return "meta:" + meta_text(x.meta)
    if isinstance(x, torch.Tensor):
        return "tensor:" + meta_text(TensorMeta.of(x, 0))
    if isinstance(x, (torch.layout, torch.memory_format)):
        return str(x)
    if t is torch.Size or t is tuple or t is list:
        return f"{t.__name__}(" + ", ".join(const_text(v) for v in x) + ")"
    r = repr(x)
    if " at 0x" in r:  # default object repr: an address, never deterministic
        return f"<{t.__module__}.{t.__qualname__}>"
    return f"{t.__qualname__}:{r}"
