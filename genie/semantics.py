"""Semantic metadata of captured nodes, computed only when read (seed 001, "lazy metadata").

At record time a capture graph stores one reference per node: the :class:`Scope` that was current
on the recording thread (module path and class, phase, region). Scopes are shared by every node
recorded in the same module call, so the hot path pays one list append. Everything else is derived
here when a user (or a scheduler) asks, from the node's schema, tags and metadata:

- ``module`` / ``module_class``: the ``nn.Module`` whose ``forward`` issued the op, as a path from
  the outermost module called in the block (``transformer.h.0.attn.c_attn``; ``""`` is that root
  module itself; ``None`` outside any module).
- ``phase``: the innermost ``genie.phase(...)`` block or ``genie.annotate_phase(module, ...)``.
- ``region``: ``forward``, ``backward`` (recorded by the autograd engine) or ``optimizer``
  (inside ``Optimizer.step``).
- ``roles``: one per output: ``parameter``, ``buffer``, ``input``, ``activation``, ``gradient``,
  ``optimizer_state`` or ``kv_cache``.
- ``category``: ``matmul``, ``conv``, ``attention``, ``normalization``, ``softmax``,
  ``elementwise``, ``reduction``, ``view``, ``indexing``, ``copy``, ``factory``, ``transfer``,
  ``other``: from tags and schemas, with a table of op packets for the kernels that tags do not
  describe (matmul, conv, attention, normalization, softmax, indexing).
- ``flops`` / ``bytes``: estimates. FLOPs use ``torch.utils.flop_counter``'s formulas for matmul,
  conv and attention (on metadata only), one per output element for elementwise ops and one per
  input element for reductions; bytes are the distinct tensors read plus fresh tensors written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optree
import torch

from .graph import MetaArg, Node, Ref, Storage, TensorMeta
from .meta import METADATA_ONLY, meta_tensor, policy

if TYPE_CHECKING:
    from .capture import CaptureGraph

aten = torch.ops.aten


# --- scopes (what the recording thread was doing) ------------------------------------------------

class Scope:
    """Where ops are being recorded: module path and class, phase and region (immutable)."""

    __slots__ = ("path", "cls", "phase", "region")

    def __init__(self, path: str | None, cls: str | None, phase: str | None,
                 region: str = "forward") -> None:
        self.path = path
        self.cls = cls
        self.phase = phase
        self.region = region

    def with_phase(self, phase: str | None) -> Scope:
        return Scope(self.path, self.cls, phase, self.region)

    def with_region(self, region: str) -> Scope:
        return Scope(None, None, self.phase, region)

    def __repr__(self) -> str:
        return f"Scope({self.path!r}, {self.cls!r}, phase={self.phase!r}, {self.region})"


TOP = Scope(None, None, None, "forward")


# --- op categories ---------------------------------------------------------------------------

def _packets(*names: str) -> list[Any]:
    out = []
    for n in names:
        p = getattr(aten, n, None)
        if p is not None:
            out.append(p)
    return out


_TABLE: dict[Any, str] = {}
for _cat, _names in (
    ("matmul", ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "dot", "vdot", "mv", "addmv",
                "addbmm", "addr", "outer", "_scaled_mm", "einsum", "_addmm_activation")),
    ("conv", ("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
              "conv_transpose2d", "conv_transpose3d", "convolution_backward",
              "_slow_conv2d_forward", "mkldnn_convolution")),
    ("attention", ("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
                   "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                   "_efficient_attention_forward",
                   "_scaled_dot_product_flash_attention_backward",
                   "_scaled_dot_product_flash_attention_for_cpu_backward",
                   "_scaled_dot_product_efficient_attention_backward")),
    ("normalization", ("native_layer_norm", "layer_norm", "native_layer_norm_backward",
                       "native_batch_norm", "_native_batch_norm_legit",
                       "_native_batch_norm_legit_functional",
                       "_native_batch_norm_legit_no_training",
                       "batch_norm", "_batch_norm_with_update", "_batch_norm_no_update",
                       "native_batch_norm_backward", "batch_norm_backward", "native_group_norm",
                       "group_norm", "native_group_norm_backward", "rms_norm", "_fused_rms_norm",
                       "instance_norm")),
    ("softmax", ("_softmax", "softmax", "_safe_softmax", "_log_softmax", "log_softmax",
                 "_softmax_backward_data", "_log_softmax_backward_data")),
    ("indexing", ("embedding", "embedding_dense_backward", "index_select", "gather", "scatter",
                  "scatter_add", "scatter_reduce", "index", "index_put", "index_put_",
                  "_index_put_impl_",
                  "index_add", "index_copy", "index_fill", "masked_scatter", "take",
                  "slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter",
                  "select_backward", "slice_backward")),
    ("copy", ("copy_", "_to_copy", "clone", "contiguous", "cat", "stack", "_unsafe_view",
              "lift_fresh", "lift_fresh_copy", "lift", "constant_pad_nd", "repeat", "flip",
              "roll")),
    ("elementwise", ("where", "tril", "triu", "masked_fill", "masked_fill_", "tril_", "triu_",
                     "threshold_backward", "gelu_backward", "tanh_backward", "sigmoid_backward",
                     "native_dropout", "native_dropout_backward", "fill_", "zero_")),
):
    for _p in _packets(*_names):
        _TABLE[_p] = _cat

_categories: dict[Any, str] = {}


def category(op: Any) -> str:
    """The category of an op overload (cached): see the module docstring for the list."""
    c = _categories.get(op)
    if c is None:
        c = _categories[op] = _categorize(op)
    return c


def _categorize(op: Any) -> str:
    if op == "genie.upload":
        return "transfer"
    if not isinstance(op, torch._ops.OpOverload):
        return "other"
    c = _TABLE.get(op.overloadpacket)
    if c is not None:
        return c
    if op in METADATA_ONLY:  # zeros_like(x), new_ones(...): a factory that reads x's metadata
        return "factory"
    schema = op._schema
    tensor_args = [a for a in schema.arguments if str(a.type).startswith("Tensor")]
    if not tensor_args and any(a.name == "device" for a in schema.arguments):
        return "factory"
    pol = policy(op)
    if any(r is not None and r[0] == "view" for r in pol.returns):
        return "view"
    tags = op.tags
    if torch.Tag.pointwise in tags:
        return "elementwise"
    if torch.Tag.reduction in tags:
        return "reduction"
    if torch.Tag.nondeterministic_seeded in tags:
        return "factory"
    return "other"


COMPUTE_CATEGORIES = frozenset({"matmul", "conv", "attention", "normalization", "softmax",
                                "elementwise", "reduction", "indexing"})
"""Categories that do arithmetic (the "compute nodes" of coverage figures)."""


# --- FLOPs and bytes -------------------------------------------------------------------------

def _numel(m: TensorMeta) -> int:
    return math.prod(m.shape)


def _nbytes(m: TensorMeta) -> int:
    return _numel(m) * m.dtype.itemsize


def _contraction_flops(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """``matmul`` and ``linear``, recorded whole (csrc/whole.cpp): 2 FLOPs per output element and
    contracted element (``args[0].shape[-1]``), as ``torch.utils.flop_counter`` counts the
    ``mm``/``bmm`` they decompose into (a bias add is not counted, as for ``addmm``)."""
    return 2 * out_val.numel() * args[0].shape[-1]


def flop_formula(op: Any) -> Any:
    """``torch.utils.flop_counter``'s formula for ``op`` (``f(*args, out_val=out, **kwargs)``),
    or :func:`_contraction_flops` for the composites genie records whole; None if neither."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(op, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None and packet in (torch.ops.aten.matmul, torch.ops.aten.linear):
        return _contraction_flops
    return formula


def flops(node: Node, leaves: list[Any] | None) -> int:
    """Estimated floating-point operations of one node (0 for data movement and views)."""
    op = node.op
    cat = category(op)
    outs = [m for m in node.metas if m is not None]
    if cat in ("matmul", "conv", "attention"):
        formula = flop_formula(op)
        if formula is not None and leaves is not None:
            try:
                margs, mkwargs = _meta_args(node, leaves)
                mouts = [meta_tensor(m) if m is not None else None for m in node.metas]
                out = optree.tree_unflatten(node.out_spec, mouts)
                return int(formula(*margs, **mkwargs, out_val=out))
            except Exception:  # a formula that cannot read these args: fall through to the estimate
                pass
        return 2 * sum(_numel(m) for m in outs)
    if cat in ("elementwise",):
        return sum(_numel(m) for m in outs)
    if cat in ("reduction", "softmax", "normalization"):
        ins = [_in_meta(x) for x in (leaves or ()) if type(x) is Ref]
        n = max((_numel(m) for m in ins), default=0)
        return n * (1 if cat == "reduction" else 5)
    return 0


def nbytes(node: Node, leaves: list[Any] | None) -> int:
    """Estimated bytes moved: distinct tensors read plus fresh (non-view) tensors written."""
    pol = policy(node.op) if isinstance(node.op, torch._ops.OpOverload) else None
    seen: set[tuple[int, int]] = set()
    total = 0
    for x in leaves or ():
        if type(x) is Ref:
            key = (x.node.index, x.out)
            if key not in seen:
                seen.add(key)
                total += _nbytes(_in_meta(x))
        elif isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
    if pol is not None and any(r is not None and r[0] == "view" for r in pol.returns):
        return 0 if category(node.op) == "view" else total
    for m in node.metas:
        if m is not None:
            total += _nbytes(m)
    return total


def _in_meta(ref: Ref) -> TensorMeta:
    return ref.node.metas[ref.out]


def _meta_args(node: Node, leaves: list[Any]) -> tuple[tuple, dict]:
    ml = [meta_tensor(_in_meta(x)) if type(x) is Ref else
          (meta_tensor(x.meta) if type(x) is MetaArg else x) for x in leaves]
    return optree.tree_unflatten(node.spec, ml)


# --- roles -------------------------------------------------------------------------------------

ROLES = ("parameter", "buffer", "input", "activation", "gradient", "optimizer_state", "kv_cache")


class RoleMap:
    """Roles known by tensor identity (``(node.index, out)``) and by storage (views and in-place
    writes of a parameter or cache share its role).

    Filled while recording, at a few events (not per op): the first call of each outermost
    module (its parameters and buffers), each optimizer step (gradients and states), each model
    call that passes or returns a KV cache, each upload of a host parameter. Snapshots, so what a
    dump says never depends on which objects are still alive when it is read.
    """

    __slots__ = ("by_key", "by_storage", "version")

    def __init__(self) -> None:
        self.by_key: dict[tuple[int, int], tuple[str, str | None]] = {}
        self.by_storage: dict[Storage, tuple[str, str | None]] = {}
        self.version = 0

    def put(self, t: Any, role: str, name: str | None = None, override: bool = False) -> None:
        """Give LazyTensor ``t`` and its storage ``role`` (first role wins unless ``override``)."""
        key = (t._node.index, t._out)
        if override or key not in self.by_key:
            self.by_key[key] = (role, name)
            self.version += 1
        s = t._node.storage(t._out)
        if s is not None and (override or s not in self.by_storage):
            self.by_storage[s] = (role, name)

    def lookup(self, node: Node, out: int) -> tuple[str, str | None] | None:
        r = self.by_key.get((node.index, out))
        if r is None:
            s = node.storage(out) if out < len(node.metas) else None
            if s is not None:
                r = self.by_storage.get(s)
        return r


# --- kv caches -----------------------------------------------------------------------------

_kv_types: list[type] = []


def register_kv_cache_type(cls: type) -> None:
    """Treat instances of ``cls`` found in a model's arguments or outputs as KV caches: every
    tensor reachable through their attributes is tagged ``kv_cache``."""
    if cls not in _kv_types:
        _kv_types.append(cls)


def _cache_types() -> tuple[type, ...]:
    import sys

    types = list(_kv_types)
    cu = sys.modules.get("transformers.cache_utils")
    if cu is not None:
        for n in ("Cache", "CacheLayerMixin"):
            c = getattr(cu, n, None)
            if isinstance(c, type):
                types.append(c)
    return tuple(types)


def kv_tensors(objs: Any) -> list[torch.Tensor]:
    """Tensors held by KV-cache objects in ``objs`` (args, kwargs, outputs of a model call).

    Caches are instances of registered types (``transformers`` ``Cache`` objects are known), and
    legacy ``past_key_values`` tuples of tensors found as a keyword argument or output attribute.
    """
    types = _cache_types()
    found: list[torch.Tensor] = []
    seen: set[int] = set()  # object identities: only to stop cycles, never part of an id

    def walk(x: Any, in_cache: bool, depth: int) -> None:
        if depth > 8 or id(x) in seen:
            return
        if isinstance(x, torch.Tensor):
            if in_cache:
                found.append(x)
            return
        seen.add(id(x))
        if isinstance(x, (list, tuple)):
            for v in x:
                walk(v, in_cache, depth + 1)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, in_cache or k == "past_key_values", depth + 1)
        elif types and isinstance(x, types):
            for v in vars(x).values():
                walk(v, True, depth + 1)
        elif in_cache and hasattr(x, "__dict__") and not isinstance(x, type):
            for v in vars(x).values():
                walk(v, True, depth + 1)
        elif hasattr(x, "past_key_values") and not isinstance(x, type):
            try:
                walk(x.past_key_values, True, depth + 1)
            except Exception:
                pass

    walk(objs, False, 0)
    return found


# --- the per-node record users read ------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NodeInfo:
    """Everything Genie knows about one captured node (computed on first read, then cached).

    Example:
        >>> import torch, genie
        >>> lin = torch.nn.Linear(4, 2).to("remote_accelerator")
        >>> with genie.capture() as g:
        ...     y = lin(torch.ones(3, 4))
        >>> info = g.info(y)
        >>> info.category, info.module_class, info.role
        ('matmul', 'Linear', 'activation')
    """

    uid: str
    complex_id: str
    op: str
    module: str | None
    module_class: str | None
    phase: str | None
    region: str
    roles: tuple[str | None, ...]
    names: tuple[str | None, ...]
    category: str
    flops: int
    bytes: int
    outputs: tuple[TensorMeta | None, ...]

    @property
    def role(self) -> str | None:
        """Role of the first tensor output."""
        return next((r for r in self.roles if r is not None), None)


def node_info(graph: CaptureGraph, pos: int, roles: RoleMap) -> NodeInfo:
    node = graph.nodes[pos]
    leaves = graph.leaves[pos]
    scope = graph.scopes[pos] or TOP
    cat = category(node.op)
    out_roles: list[str | None] = []
    names: list[str | None] = []
    for k, m in enumerate(node.metas):
        if m is None:
            out_roles.append(None)
            names.append(None)
            continue
        r = roles.lookup(node, k)
        if r is None:
            r = (_derived_role(node, leaves, scope, cat), None)
        out_roles.append(r[0])
        names.append(r[1])
    return NodeInfo(
        uid=node.uid, complex_id=graph.ids.complex_ids[pos], op=str(node.op),
        module=scope.path, module_class=scope.cls, phase=scope.phase, region=scope.region,
        roles=tuple(out_roles), names=tuple(names), category=cat,
        flops=flops(node, leaves), bytes=nbytes(node, leaves), outputs=tuple(node.metas))


def _derived_role(node: Node, leaves: list[Any] | None, scope: Scope, cat: str) -> str:
    if scope.region == "backward":
        return "gradient"
    if scope.region == "optimizer":
        return "optimizer_state"
    has_input = leaves is not None and any(type(x) is Ref for x in leaves)
    if not has_input and scope.cls is None and cat in ("factory", "transfer", "copy", "other"):
        return "input"
    if cat == "transfer":
        return "input"
    return "activation"


def load_role(roles: RoleMap, node: Node, out: int) -> tuple[str, str | None]:
    """Role (and parameter name) of an external input of the graph."""
    return roles.lookup(node, out) or ("input", None)
