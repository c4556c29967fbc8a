"""A :class:`~genie.planner.Tape` as plain data, and back: what a server receives (never pickle).

:func:`tape_to_data` turns a tape into a *header* made only of ``None``, ``bool``, ``int``,
``float``, ``str`` and lists/dicts of those (JSON- and msgpack-ready), plus a list of host tensors
the header refers to by position (the raw buffers a transport sends as they are).
:func:`tape_from_data` rebuilds the tape, resolving each op by its schema name
(``aten::add.Tensor``) through ``torch.ops`` against an allowlist, and checks every table index
and every slot reference before use, so a malformed header raises :class:`TapeDataError` and never
runs anything.

Header layout (version 1)::

    {"version": 1, "index": 0,
     "ops":    ["aten::mm.default", "genie.upload", ...],        # table of op names
     "specs":  [[1, [1, 0, 0], [3, [], []]], ...],              # argument trees, see spec_to_data
     "instrs": [[op, spec, leaves, outs, free, rng, device, uid], ...],
     "inputs": [[slot, tensor or None, [shape, stride, offset, dtype]], ...],
     "outputs": [slot, ...], "keep": [slot, ...]}

A leaf is a plain ``None``/``bool``/``int``/``float``/``str``, or a tagged list:
``["slot", id]``, ``["tensor", k]`` (the k-th host tensor), ``["meta", shape, stride, offset,
dtype(, conj, neg)]`` (a metadata-only argument; the math bits only when set),
``["dtype", "float32"]``, ``["device", "cpu"]``, ``["layout", "strided"]``,
``["memory_format", "contiguous_format"]``, ``["size", [..]]``, ``["complex", re, im]``.
Argument trees use the same encoding as :mod:`genie.remote.protocol`: ``0`` a leaf,
``[1, ...]`` a tuple, ``[2, ...]`` a list, ``[3, keys, values]`` a dict.

Example:
    >>> import torch, genie
    >>> from genie.planner import build_tape
    >>> from genie.tape_io import tape_from_data, tape_to_data
    >>> x = torch.ones(3, device="remote_accelerator")
    >>> y = (x * 2).relu()
    >>> header, tensors = tape_to_data(build_tape([(y._node, y._out)]))
    >>> header["ops"]
    ['aten::ones.default', 'aten::mul.Tensor', 'aten::relu.default']
    >>> len(tape_from_data(header, tensors).instrs)
    3
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection
from typing import Any

import optree
import torch

from .errors import GenieError
from .graph import MetaArg, TensorMeta
from .planner import Instr, Slot, Tape
from .remote import allowlist

VERSION = 1
UPLOAD = "genie.upload"

#: Namespaces whose ops a received tape may name.
ALLOWED_NAMESPACES: tuple[str, ...] = ("aten",)

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_DTYPE_NAME = {v: k for k, v in _DTYPES.items()}
_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
            if isinstance(v, torch.layout)}
_MEMFMTS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
            if isinstance(v, torch.memory_format)}


class TapeDataError(GenieError, ValueError):
    """A tape header that is malformed, or names an op the allowlist does not admit."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"[tape_from_data] {msg}")


# --- ops ----------------------------------------------------------------------------------------

def op_to_name(op: Any) -> str:
    """``aten::add.Tensor`` for an ``OpOverload`` (``.default`` spelled out); pseudo-ops as is."""
    if op == UPLOAD:
        return UPLOAD
    if isinstance(op, torch._ops.OpOverload):
        s = op._schema
        return f"{s.name}.{s.overload_name or 'default'}"
    raise TypeError(f"[tape_to_data] op {op!r} is neither an ATen overload nor a Genie pseudo-op; "
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
    raise TypeError(f"[tape_to_data] argument container {t.__name__} cannot be written as data")


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


# --- leaves -------------------------------------------------------------------------------------

def _meta_data(m: TensorMeta) -> list[Any]:
    d = [list(m.shape), list(m.stride), m.offset, _DTYPE_NAME[m.dtype]]
    conj, neg = getattr(m, "conj", False), getattr(m, "neg", False)
    return d + [conj, neg] if conj or neg else d  # math bits of complex views, when set


def _leaf_data(x: Any, tensors: list[torch.Tensor]) -> Any:
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if t is Slot:
        return ["slot", x.id]
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return ["tensor", len(tensors) - 1]
    if t is MetaArg:
        return ["meta", *_meta_data(x.meta)]
    if t is torch.dtype:
        return ["dtype", _DTYPE_NAME[x]]
    if t is torch.device:
        return ["device", str(x)]
    if t is torch.layout:
        return ["layout", str(x).removeprefix("torch.")]
    if t is torch.memory_format:
        return ["memory_format", str(x).removeprefix("torch.")]
    if t is torch.Size:
        return ["size", list(x)]
    if t is complex:
        return ["complex", x.real, x.imag]
    raise TypeError(f"[tape_to_data] a constant of type {t.__name__} ({x!r:.60}) cannot be "
                    "written as data")


def _ints(x: Any, what: str) -> list[int]:
    if not isinstance(x, list) or not all(type(v) is int for v in x):
        raise TapeDataError(f"bad {what}: expected a list of ints, got {x!r:.80}")
    return x


def _dtype(name: Any) -> torch.dtype:
    d = _DTYPES.get(name) if isinstance(name, str) else None
    if d is None:
        raise TapeDataError(f"unknown dtype {name!r}")
    return d


def _meta_from(d: Any, index: int) -> TensorMeta:
    if not isinstance(d, list) or len(d) not in (4, 6) or type(d[2]) is not int or \
            not all(type(b) is bool for b in d[4:]):
        raise TapeDataError(f"bad tensor metadata {d!r:.80}")
    shape, stride = _ints(d[0], "shape"), _ints(d[1], "stride")
    if len(shape) != len(stride) or any(s < 0 for s in shape):
        raise TapeDataError(f"bad tensor metadata {d!r:.80}")
    m = TensorMeta(tuple(shape), tuple(stride), d[2], _dtype(d[3]), index)
    if len(d) == 6:
        m = dataclasses.replace(m, conj=d[4], neg=d[5])
    return m


def _leaf_from(d: Any, tensors: list[torch.Tensor], live: set[int], index: int) -> Any:
    t = type(d)
    if d is None or t is bool or t is int or t is float or t is str:
        return d
    if t is not list or not d or not isinstance(d[0], str):
        raise TapeDataError(f"bad leaf {d!r:.80}")
    tag, rest = d[0], d[1:]
    try:
        if tag == "slot":
            (s,) = rest
            if type(s) is not int or s not in live:
                raise TapeDataError(f"leaf reads slot {s!r}, which is not live there")
            return Slot(s)
        if tag == "tensor":
            (k,) = rest
            if type(k) is not int or not 0 <= k < len(tensors):
                raise TapeDataError(f"leaf names host tensor {k!r}; {len(tensors)} were given")
            return tensors[k]
        if tag == "meta":
            return MetaArg(_meta_from(rest, index))
        if tag == "dtype":
            return _dtype(rest[0])
        if tag == "device":
            return torch.device(rest[0])
        if tag == "layout":
            return _LAYOUTS[rest[0]]
        if tag == "memory_format":
            return _MEMFMTS[rest[0]]
        if tag == "size":
            return torch.Size(_ints(rest[0], "size"))
        if tag == "complex":
            return complex(float(rest[0]), float(rest[1]))
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
        raise TapeDataError(f"bad {tag} leaf {d!r:.80} ({e})") from None
    raise TapeDataError(f"unknown leaf tag {tag!r}")


# --- tapes --------------------------------------------------------------------------------------

def tape_to_data(tape: Tape, *, include_inputs: bool = True) -> tuple[dict[str, Any], list[Any]]:
    """``(header, tensors)`` for ``tape``: plain data plus the host tensors it refers to.

    With ``include_inputs=False`` the input values are left out (a server that holds them as
    resident tensors names them itself); the header still lists each input's slot and metadata.
    """
    tensors: list[torch.Tensor] = []
    ops: dict[str, int] = {}
    specs: dict[Any, int] = {}
    spec_list: list[Any] = []
    inputs = []
    for s in sorted(tape.inputs):
        v = tape.inputs[s]
        k = None
        if include_inputs:
            tensors.append(v)
            k = len(tensors) - 1
        inputs.append([s, k, _meta_data(TensorMeta.of(v, tape.index))])
    rows = []
    for ins in tape.instrs:
        oi = ops.setdefault(op_to_name(ins.op), len(ops))
        si = -1
        if ins.spec is not None:
            si = specs.get(ins.spec, -1)
            if si < 0:
                si = specs[ins.spec] = len(spec_list)
                spec_list.append(spec_to_data(ins.spec))
        rows.append([oi, si, [_leaf_data(x, tensors) for x in ins.leaves], list(ins.outs),
                     list(ins.free), list(ins.rng) if ins.rng is not None else None,
                     ins.device, ins.uid])
    header = {"version": VERSION, "index": tape.index, "ops": list(ops), "specs": spec_list,
              "instrs": rows, "inputs": inputs, "outputs": list(tape.outputs),
              "keep": sorted(tape.keep)}
    return header, tensors


def tape_from_data(header: Any, tensors: list[Any], *, inputs: dict[int, Any] | None = None,
                   allow: Callable[[str, str], bool] | None = None,
                   max_instrs: int = 1 << 22) -> Tape:
    """Rebuild a :class:`Tape` from :func:`tape_to_data`'s output, checking it on the way.

    ``inputs`` supplies input values by slot (for headers written with ``include_inputs=False``,
    or to override them); ``allow`` replaces the op allowlist (see :func:`op_from_name`).
    The tape has no recorded nodes (``nodes == []``): it runs, it does not bind back.
    """
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise TapeDataError(f"not a version-{VERSION} tape header")
    try:
        index, names, spec_ds, rows = (header["index"], header["ops"], header["specs"],
                                       header["instrs"])
        in_rows, outputs, keep = header["inputs"], header["outputs"], header["keep"]
    except KeyError as e:
        raise TapeDataError(f"header lacks {e}") from None
    if type(index) is not int or not isinstance(names, list) or not isinstance(spec_ds, list) \
            or not isinstance(rows, list) or not isinstance(in_rows, list):
        raise TapeDataError("bad header tables")
    if len(rows) > max_instrs:
        raise TapeDataError(f"{len(rows)} instructions (limit {max_instrs})")
    ops = [op_from_name(n, allow) for n in names]
    specs = [spec_from_data(d) for d in spec_ds]
    live: set[int] = set()
    values: dict[int, Any] = {}
    for row in in_rows:
        if not isinstance(row, list) or len(row) != 3 or type(row[0]) is not int or \
                row[0] in live:
            raise TapeDataError(f"bad input row {row!r:.80}")
        s, k, meta = row
        _meta_from(meta, index)
        live.add(s)
        if inputs is not None and s in inputs:
            values[s] = inputs[s]
        elif type(k) is int and 0 <= k < len(tensors):
            values[s] = tensors[k]
        else:
            raise TapeDataError(f"input slot {s} has no value (pass inputs=)")
    instrs = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 8:
            raise TapeDataError(f"bad instruction {i}")
        oi, si, leaf_ds, outs, free, rng, device, uid = row
        if type(oi) is not int or not 0 <= oi < len(ops) or type(si) is not int or \
                not -1 <= si < len(specs) or not isinstance(leaf_ds, list) or \
                type(device) is not int or not isinstance(uid, str):
            raise TapeDataError(f"bad instruction {i}")
        op, spec = ops[oi], (specs[si] if si >= 0 else None)
        if (op == UPLOAD) != (spec is None) or (spec is not None and
                                                spec.num_leaves != len(leaf_ds)):
            raise TapeDataError(f"instruction {i}: argument tree and leaves disagree")
        leaves = [_leaf_from(d, tensors, live, index) for d in leaf_ds]
        if not isinstance(outs, list) or not all(
                o is None or (type(o) is int and o not in live) for o in outs):
            raise TapeDataError(f"instruction {i}: bad outputs {outs!r:.80}")
        live.update(o for o in outs if o is not None)
        free = _ints(free, "free list")
        if not live.issuperset(free):
            raise TapeDataError(f"instruction {i} frees a slot that is not live")
        live.difference_update(free)
        if rng is not None and (not isinstance(rng, list) or len(rng) != 2 or
                                not all(type(v) is int and v >= 0 for v in rng)):
            raise TapeDataError(f"instruction {i}: bad random (seed, offset) {rng!r:.80}")
        instrs.append(Instr(op, leaves, spec, tuple(outs), tuple(rng) if rng else None,
                            tuple(free), uid=uid, device=device))
    outputs, keep = _ints(outputs, "outputs"), _ints(keep, "kept slots")
    if not live.issuperset(outputs) or not live.issuperset(keep):
        raise TapeDataError("outputs or kept slots are not live at the end of the tape")
    return Tape(instrs, values, list(outputs), set(keep), [], {}, index)


def allow_only(names: Collection[str]) -> Callable[[str, str], bool]:
    """An ``allow`` rule admitting exactly the given ``ns::op`` names (e.g. ``aten::mm``)."""
    admitted = frozenset(names)
    return lambda ns, op: f"{ns}::{op}" in admitted
