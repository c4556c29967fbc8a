"""The names a tape is written with: the tables that the wire codec and the plan cache share.

One codec turns a tape into data and back: :mod:`genie.remote.protocol` (``encode_tape`` splits a
tape into a skeleton and constants, ``compile_skeleton`` checks and resolves a skeleton,
``fill`` gives a runnable tape). This module holds only what it shares with the plan cache's
structure key (:func:`genie.plan_cache.structure_key`), so that both spell a tape the same way:

- ops by schema name (``aten::add.Tensor``): :func:`op_to_name`, and :func:`op_from_name`,
  which resolves a name through ``torch.ops`` against an allowlist and raises
  :class:`TapeDataError` for a malformed, unknown or refused name;
- dtypes, layouts and memory formats by name (``_DTYPES``, ``_LAYOUTS``, ``_MEMFMTS``);
- argument trees as nested lists (:func:`spec_to_data`, :func:`spec_from_data`): ``0`` a leaf,
  ``[1, ...]`` a tuple, ``[2, ...]`` a list, ``[3, keys, values]`` a dict;
- tensor metadata as a list (:func:`_meta_data`).

Example:
    >>> import torch
    >>> from genie.tape_io import op_from_name, op_to_name
    >>> op_to_name(torch.ops.aten.add.Tensor)
    'aten::add.Tensor'
    >>> op_from_name("aten::relu") is torch.ops.aten.relu.default
    True
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any

import optree
import torch

from .errors import GenieError
from .graph import TensorMeta
from .remote import allowlist

UPLOAD = "genie.upload"

#: Namespaces whose ops a received tape may name.
ALLOWED_NAMESPACES: tuple[str, ...] = ("aten", "genie")  # genie: allowlist.GENIE_OPS only

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_DTYPE_NAME = {v: k for k, v in _DTYPES.items()}
_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
            if isinstance(v, torch.layout)}
_MEMFMTS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
            if isinstance(v, torch.memory_format)}


class TapeDataError(GenieError, ValueError):
    """An op name or argument tree that is malformed, or an op the allowlist does not admit."""


# --- ops ----------------------------------------------------------------------------------------

def op_to_name(op: Any) -> str:
    """``aten::add.Tensor`` for an ``OpOverload`` (``.default`` spelled out); pseudo-ops as is."""
    if op == UPLOAD:
        return UPLOAD
    if isinstance(op, torch._ops.OpOverload):
        s = op._schema
        return f"{s.name}.{s.overload_name or 'default'}"
    raise TypeError(f"op {op!r} is neither an ATen overload nor a Genie pseudo-op; "
                    "it cannot be named in a tape")


def op_from_name(name: Any, allow: Callable[[str, str], bool] | None = None) -> Any:
    """Resolve ``ns::op.overload`` through ``torch.ops``, if the allowlist admits it.

    The default rule is the server's reviewed list (:mod:`genie.remote.allowlist`: the overload
    is listed in ``allowlist.txt`` and the rule still admits it); ``allow(namespace, op)``
    replaces it.
    """
    if name == UPLOAD:
        return UPLOAD
    if not isinstance(name, str) or "::" not in name:
        raise TapeDataError(f"bad op name {name!r}: expected 'namespace::op.overload'")
    ns, _, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    overload = overload or "default"
    if not (_IDENT.fullmatch(ns) and _IDENT.fullmatch(base) and _IDENT.fullmatch(overload)):
        raise TapeDataError(f"bad op name {name!r}")
    full = f"{ns}::{base}.{overload}"
    if allow is not None and not allow(ns, base) or \
            allow is None and ns not in ALLOWED_NAMESPACES:
        raise TapeDataError(f"op {name!r} is not on the allowlist (refused by the "
                            f"{'allow= rule' if allow else 'namespace rule: aten only'})")
    try:
        op = getattr(getattr(getattr(torch.ops, ns), base), overload)
    except (AttributeError, RuntimeError):
        raise TapeDataError(f"op {name!r} does not exist in PyTorch {torch.__version__}") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise TapeDataError(f"{name!r} is not an op overload")
    if allow is None and not allowlist.admitted(full):
        raise TapeDataError(f"op {name!r} is not on the allowlist ({allowlist.why_refused(full)})"
                            "; pass allow= to admit it")
    return op


def allow_only(names: Collection[str]) -> Callable[[str, str], bool]:
    """An ``allow`` rule admitting exactly the given ``ns::op`` names (e.g. ``aten::mm``)."""
    admitted = frozenset(names)
    return lambda ns, op: f"{ns}::{op}" in admitted


# --- argument trees -----------------------------------------------------------------------------

_LEAF = object()
_spec_cache: dict[Any, Any] = {}


def spec_to_data(spec: Any) -> Any:
    """An optree spec as nested lists: ``0`` leaf, ``[1, ...]`` tuple, ``[2, ...]`` list,
    ``[3, keys, values]`` dict (keys in the spec's order)."""
    d = _spec_cache.get(spec)
    if d is None:
        d = _spec_cache[spec] = _tree_data(optree.tree_unflatten(spec, [_LEAF] * spec.num_leaves))
    return d


def _tree_data(x: Any) -> Any:
    if x is _LEAF:
        return 0
    t = type(x)
    if t is tuple:
        return [1, *map(_tree_data, x)]
    if t is list:
        return [2, *map(_tree_data, x)]
    if t is dict:
        return [3, list(x), [_tree_data(v) for v in x.values()]]
    raise TypeError(f"argument container {t.__name__} cannot be written as data")


def spec_from_data(d: Any) -> Any:
    """Inverse of :func:`spec_to_data`."""
    return optree.tree_structure(_tree_from(d, 0), none_is_leaf=True)


def _tree_from(d: Any, depth: int) -> Any:
    if depth > 32:
        raise TapeDataError("argument tree nested deeper than 32")
    if type(d) is int and d == 0:
        return None
    if not isinstance(d, list) or not d or d[0] not in (1, 2, 3):
        raise TapeDataError(f"bad argument tree {d!r:.80}")
    if d[0] == 1:
        return tuple(_tree_from(x, depth + 1) for x in d[1:])
    if d[0] == 2:
        return [_tree_from(x, depth + 1) for x in d[1:]]
    if len(d) != 3 or not isinstance(d[1], list) or not isinstance(d[2], list) or \
            len(d[1]) != len(d[2]) or not all(isinstance(k, str) for k in d[1]):
        raise TapeDataError(f"bad argument map {d!r:.80}")
    return {k: _tree_from(v, depth + 1) for k, v in zip(d[1], d[2], strict=True)}


# --- metadata -------------------------------------------------------------------------------------

def _meta_data(m: TensorMeta) -> list[Any]:
    d = [list(m.shape), list(m.stride), m.offset, _DTYPE_NAME[m.dtype]]
    conj, neg = getattr(m, "conj", False), getattr(m, "neg", False)
    return d + [conj, neg] if conj or neg else d  # math bits of complex views, when set
