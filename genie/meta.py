"""Op policy from schemas and tags, and output metadata from meta tensors behind a cache.

Recording never touches data: the output shape, stride and dtype of an op come from running the
op on ``meta`` tensors built from its inputs' metadata. That costs tens of microseconds, so results
are cached by a key of (op overload, input metadata, scalar arguments, argument tree structure);
a repeated op pays one dict lookup. Errors raised by the meta kernel (shape mismatch, bad dim,
device mismatch) propagate unchanged, so they reach the user's line with eager's exception type.

Policy (what an op mutates, which input its outputs alias, whether it is random or data-dependent)
comes only from ``op._schema`` alias annotations and ``op.tags``, never from names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .factories import METADATA_ONLY
from .graph import TensorMeta
from .portable import portable_kernel

_DYNAMIC = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}


@dataclass(frozen=True, slots=True)
class OpPolicy:
    """What the schema says about one overload.

    Attributes:
        writes: schema positions of arguments the op mutates (``Tensor(a!)`` / ``Tensor(a!)[]``).
        returns: per return, ``(kind, arg_position)`` with kind ``"write"`` (returns its mutated
            argument: ``add_``, ``out=``), ``"view"`` (aliases an input: ``view``, ``unbind``) or
            ``None`` (fresh storage).
        random: tagged ``nondeterministic_seeded``: gets a (seed, offset) at record time.
        dynamic: output shape or value depends on data: must run before recording continues.
        inplace_view: changes its argument's metadata in place (``transpose_``).
        names: argument names by schema position (to find kwargs).
        portable: for ops with only a fused CUDA kernel, the decomposition recorded in their
            place (see :mod:`genie.portable`); None for every other op.
    """

    writes: tuple[int, ...]
    returns: tuple[tuple[str, int] | None, ...]
    random: bool
    dynamic: bool
    inplace_view: bool
    names: tuple[str, ...]
    portable: Any = None
    metadata_only: bool = False  # reads its first argument's metadata only (zeros_like, new_*)
    # Float values can change output metadata only in factories (arange(0, 1.5, 0.5)) and through
    # float-typed arguments (scale_factors); elsewhere a float is a Scalar operand, whose type
    # (not value) decides the result dtype. When False, meta-cache keys hold a float's type only,
    # so a decaying learning rate does not miss the cache every step.
    float_values_matter: bool = True
    key: int = 0  # small unique int standing for the op in meta-cache keys (cheap to hash)

    def arg(self, pos: int, args: tuple, kwargs: dict) -> Any:
        if pos < len(args):
            return args[pos]
        return kwargs.get(self.names[pos])


_policies: dict[Any, OpPolicy] = {}


def policy(op: Any) -> OpPolicy:
    """The (cached) :class:`OpPolicy` of an ``OpOverload``.

    Cached on the op object itself as well: ``OpOverload.__hash__`` is Python code, and the
    recording hot path would otherwise pay it on every op.
    """
    try:
        return op._genie_policy
    except AttributeError:
        pass
    p = _policies.get(op)
    if p is None:
        p = _policies[op] = _analyze(op)
        try:
            op._genie_policy = p
        except AttributeError:  # pseudo-ops (strings) cannot carry attributes
            pass
    return p


def _analyze(op: Any) -> OpPolicy:
    schema = op._schema
    sets: dict[str, int] = {}
    writes = []
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is None:
            continue
        if info.is_write:
            writes.append(i)
        for s in info.before_set:
            sets.setdefault(s, i)
    view_src = next((i for i, a in enumerate(schema.arguments)
                     if a.alias_info is not None and not a.alias_info.is_write), None)
    returns: list[tuple[str, int] | None] = []
    for r in schema.returns:
        info = r.alias_info
        if info is None:
            returns.append(None)
        elif info.is_write:
            src = next((sets[s] for s in info.before_set if s in sets), None)
            returns.append(("write", src) if src is not None else None)
        else:
            src = next((sets[s] for s in info.before_set if s in sets), view_src)
            returns.append(("view", src) if src is not None else None)
    tags = set(op.tags)
    return OpPolicy(
        writes=tuple(writes),
        returns=tuple(returns),
        random=torch.Tag.nondeterministic_seeded in tags,
        dynamic=bool(tags & _DYNAMIC),
        inplace_view=torch.Tag.inplace_view in tags,
        names=tuple(a.name for a in schema.arguments),
        portable=portable_kernel(op),
        metadata_only=op in METADATA_ONLY,
        float_values_matter=_float_values_matter(schema),
        key=len(_policies),
    )


def _float_values_matter(schema: Any) -> bool:
    has_tensor = False
    for a in schema.arguments:
        t = str(a.type)  # e.g. "Tensor", "List[Tensor]", "float", "Optional[List[float]]"
        if "float" in t:
            return True
        if "Tensor" in t:
            has_tensor = True
    return not has_tensor


def meta_tensor(m: TensorMeta) -> torch.Tensor:
    """A meta tensor with ``m``'s shape, stride, offset, dtype and math bits (no data)."""
    if m.offset == 0:
        t = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
    else:
        extent = 1 + sum((s - 1) * st for s, st in zip(m.shape, m.stride) if s > 0)
        if any(s == 0 for s in m.shape):
            extent = 0
        base = torch.empty((m.offset + extent,), dtype=m.dtype, device="meta")
        t = base.as_strided(m.shape, m.stride, m.offset)
    if m.conj:
        torch._C._set_conj(t, True)
    if m.neg:
        torch._C._set_neg(t, True)
    return t


class MetaCache:
    """``key -> (flat output metas, output tree spec)``; counts hits and misses in genie.stats."""

    def __init__(self) -> None:
        self._d: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return self._d.get(key)

    #: Bound on entries: a program whose keys never repeat must not grow memory without limit.
    limit = 1 << 16

    def put(self, key: Any, value: Any) -> None:
        d = self._d
        if len(d) >= self.limit:
            d.clear()  # rare, and cheaper on the hot path than LRU bookkeeping on every hit
        d[key] = value

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


meta_cache = MetaCache()
