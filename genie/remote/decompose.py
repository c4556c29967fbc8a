"""The client's side of the server's narrow opset: an op a server does not run is decomposed first.

A server runs Core ATen plus a reviewed list (:mod:`genie.remote.allowlist`). Genie records
whatever the program calls, so before a tape goes on the wire each instruction whose op is
outside that set is replaced by its decomposition (``torch._decomp``'s table, else the op's
CompositeImplicitAutograd kernel), traced on meta tensors with the instruction's metadata and
applied recursively until every op is one the server runs. The expansion of one instruction is
traced once per (op, argument tree, argument metadata, constants) and reused. Intermediate values
get fresh slots, freed at their last use inside the expansion; the instruction's outputs keep
their slots, so nothing around it changes.

An op with no such decomposition, a random op outside the set (its stream could not match), or a
decomposition whose results differ from the recorded metadata is refused at the materialization
with :class:`NotServedError`, naming the op and the line that recorded it: nothing runs on this
machine in its place. Decomposed values equal eager's up to the rounding of the decomposition
(what ``torch.compile`` and ``torch.export`` users see for the same ops).
"""

from __future__ import annotations

import functools
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import GenieError
from ..graph import MetaArg, Ref, TensorMeta
from ..meta import meta_tensor
from ..planner import Instr, Slot, Tape
from ..stats import _counts
from ..tape_io import op_to_name
from . import allowlist


class NotServedError(GenieError, NotImplementedError):
    """An op a Genie server does not run, and that Genie cannot decompose into ops it runs."""


_served: dict[Any, bool] = {}
_expansions: dict[Any, Any] = {}
#: bound on remembered expansions (one per op x metadata x constants seen)
MAX_EXPANSIONS = 4096


def served(op: Any) -> bool:
    """Whether a server runs ``op`` as it is (Genie's own protocol ops, like uploads, count)."""
    r = _served.get(op)
    if r is None:
        r = _served[op] = (not isinstance(op, torch._ops.OpOverload) or
                           allowlist.admitted(op_to_name(op)))
    return r


@functools.cache
def _table() -> dict[Any, Any]:
    from torch._decomp import core_aten_decompositions

    return dict(core_aten_decompositions())  # to aten ops (the full table also emits prims)


def _grouped_bounds(offs: torch.Tensor, n: int) -> torch.Tensor:
    """``(G, n)``: whether position ``i < n`` lies in group ``g``, ``[offs[g-1], offs[g])`` (the
    CPU kernel's slices: clamped to ``[0, n]``, empty where an end precedes its start)."""
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    pos = torch.arange(n, device=offs.device)
    return (pos >= starts.unsqueeze(1)) & (pos < ends.unsqueeze(1))


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> Any:
    """``aten._grouped_mm`` (a mixture of experts' matmuls: transformers' MoE layers on any
    non-CPU device, and their backward) in served ops, without reading ``offs`` on the host.

    Every group's product is computed for every row (or column, or contraction slice) and each
    result takes the one of its group (``where``, so an inf or NaN of another group never
    leaks), in the CPU kernel's layouts: 2-D x 3-D (rows of ``mat_a`` grouped), 3-D x 2-D
    (columns of ``mat_b`` grouped), 2-D x 2-D (the contraction grouped: ``(G, M, N)``), 3-D x
    3-D (``bmm``). Rows past ``offs[-1]`` come out zero (the kernels leave them unwritten). The
    cost is G times the grouped kernel's arithmetic and a ``(G, M, N)`` intermediate: correct
    for any tape, slow for wide expert layers; a server that reviews ``_grouped_mm`` into its
    opset runs the kernel itself."""
    if bias is not None or (out_dtype is not None and out_dtype != mat_a.dtype):
        return NotImplemented  # eager refuses both (checked at the call)
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if not a2 and not b2:
        res = torch.bmm(mat_a, mat_b)
        size = res.shape
    elif a2 and not b2:  # (M, K) x (G, K, N) -> (M, N)
        member = _grouped_bounds(offs, mat_a.shape[0]).unsqueeze(-1)  # (G, M, 1)
        res = torch.where(member, torch.matmul(mat_a.unsqueeze(0), mat_b), 0).sum(0)
        size = res.shape
    elif b2 and not a2:  # (G, M, K) x (K, N) -> (M, N)
        member = _grouped_bounds(offs, mat_b.shape[1]).unsqueeze(1)  # (G, 1, N)
        res = torch.where(member, torch.matmul(mat_a, mat_b), 0).sum(0)
        size = res.shape
    else:  # (M, K) x (K, N) -> (G, M, N): out[g] = a[:, K_g] @ b[K_g, :]
        member = _grouped_bounds(offs, mat_a.shape[1])  # (G, K)
        a = torch.where(member.unsqueeze(1), mat_a.unsqueeze(0), 0)  # (G, M, K)
        b = torch.where(member.unsqueeze(2), mat_b.unsqueeze(0), 0)  # (G, K, N)
        res = torch.bmm(a, b)
        size = res.shape
    # the kernel's output layout: the last dim's stride padded to 16 bytes
    align = 16 // res.element_size()
    padded = (size[-1] + align - 1) // align * align
    if padded == size[-1]:
        return res.contiguous()
    stride = (padded, 1) if len(size) == 2 else (size[1] * padded, padded, 1)
    out = torch.empty_strided(size, stride, dtype=res.dtype, device=res.device)
    return out.copy_(res)


def _reshape_alias(self: torch.Tensor, size: Any, stride: Any) -> torch.Tensor:
    """``_reshape_alias`` as the served ``view``: ``reshape`` calls it, with the strides ``view``
    gives, for a tensor that is not subclass-like (eager's path on the CPU, and a key-free
    LazyTensor's: docs/architecture.md, "Key-free LazyTensors"); other strides fail the
    expansion's metadata check and are refused."""
    return torch.ops.aten.view.default(self, size)


#: Genie's own decompositions, for ops torch has none for
_OWN = {torch.ops.aten._grouped_mm.default: _grouped_mm,
        torch.ops.aten._reshape_alias.default: _reshape_alias}


def _decomposition(op: torch._ops.OpOverload) -> Any:
    fn = _OWN.get(op) or _table().get(op)
    if fn is None and torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "CompositeImplicitAutograd"):
        fn = op.decompose
    return fn


class _Refuse(Exception):
    def __init__(self, why: str) -> None:
        self.why = why


class _Trace(TorchDispatchMode):
    """Runs a decomposition on meta tensors and records the served ops it reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if served(func):
            out = func(*args, **kwargs)
            self.rows.append((func, args, kwargs, out))
            return out
        fn = _decomposition(func)
        if fn is None:
            raise _Refuse(f"{op_to_name(func)} has no decomposition")
        with self:
            out = fn(*args, **kwargs)
        if out is NotImplemented:
            raise _Refuse(f"{op_to_name(func)} has no decomposition")
        return out


def _same_layout(g: tuple[Any, Any, int, torch.dtype], m: TensorMeta) -> bool:
    """Whether a traced output's (shape, stride, offset, dtype) is ``m``'s layout (strides
    compared where a dimension has more than one element; a view's offset included)."""
    shape, stride, offset, dtype = g
    if tuple(shape) != m.shape or dtype != m.dtype or offset != m.offset:
        return False
    return all(n <= 1 or a == b for n, a, b in zip(m.shape, stride, m.stride, strict=True))


def _leaf_key(x: Any, m: TensorMeta | None) -> Any:
    if m is not None:
        return ("T", m)
    if type(x) is MetaArg:
        return ("M", x.meta)
    if isinstance(x, torch.Tensor):  # a host constant: its values may decide the expansion
        small = x.device.type == "cpu" and x.numel() <= 64
        return ("H", x.dtype, tuple(x.shape), tuple(x.stride()),
                x.resolve_conj().resolve_neg().contiguous().flatten().view(torch.uint8).numpy()
                .tobytes() if small else id(x))
    return (type(x), x)


def _trace(ins: Instr, metas: list[TensorMeta | None]) -> Any:
    """The expansion of ``ins`` as a template: rows of (op, spec, leaf codes, out codes).

    Leaf codes: ``("in", j)`` the instruction's ``j``-th leaf, ``("v", k)`` the ``k``-th value
    made inside the expansion, ``("c", x)`` a constant. Out codes: the value number or None.
    The template's results: per output of ``ins``, the value number, or ``("in", j)``.
    """
    op = ins.op
    fn = _decomposition(op)
    if fn is None:
        raise _Refuse(f"{op_to_name(op)} has no decomposition")
    dev = torch.device("remote_accelerator", ins.device)
    placeholders: list[Any] = []
    code_of: dict[int, Any] = {}  # id(tensor) -> code
    for j, (x, m) in enumerate(zip(ins.leaves, metas, strict=True)):
        if m is not None or type(x) is MetaArg:
            t = meta_tensor(m if m is not None else x.meta)
            code_of[id(t)] = ("in", j)
            placeholders.append(t)
        else:
            if isinstance(x, torch.Tensor):
                code_of[id(x)] = ("in", j)
            placeholders.append(x)
    args, kwargs = optree.tree_unflatten(ins.spec, placeholders)
    mode = _Trace()
    with mode:
        out = fn(*args, **kwargs)
    if out is NotImplemented:
        raise _Refuse(f"{op_to_name(op)} has no decomposition")
    alive = [out, placeholders]  # keep every traced tensor alive: ids stay unique
    rows = []
    n = 0
    for func, a, kw, res in mode.rows:
        alive.append(res)
        leaves, spec = optree.tree_flatten((a, kw), none_is_leaf=True)
        codes: list[Any] = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                c = code_of.get(id(x))
                if c is None:
                    if x.device.type != "cpu":
                        raise _Refuse(f"its decomposition uses a {x.device.type} tensor it did "
                                      "not make")
                    c = ("c", x)  # a host constant the decomposition made
                codes.append(c)
            elif isinstance(x, torch.device):
                codes.append(("c", dev if x.type in ("meta", "remote_accelerator") else x))
            else:
                codes.append(("c", x))
        outs: list[int | None] = []
        for r in optree.tree_leaves(res, none_is_leaf=True):
            if isinstance(r, torch.Tensor) and id(r) not in code_of:
                code_of[id(r)] = ("v", n)
                outs.append(n)
                n += 1
            else:
                outs.append(None)  # an in-place op's self (already named), or not a tensor
        rows.append((func, spec, codes, outs))
    results: list[Any] = []
    for r in optree.tree_leaves(out, none_is_leaf=True):
        results.append(code_of.get(id(r)) if isinstance(r, torch.Tensor) else None)
    del alive
    return rows, results, _result_metas(out)


def _result_metas(out: Any) -> list[Any]:
    return [(tuple(r.shape), tuple(r.stride()), r.storage_offset(), r.dtype)
            if isinstance(r, torch.Tensor) else None
            for r in optree.tree_leaves(out, none_is_leaf=True)]


def _expansion(ins: Instr, metas: list[TensorMeta | None], out_metas: list[Any]) -> Any:
    key = (ins.op, ins.spec, tuple(_leaf_key(x, m) for x, m in zip(ins.leaves, metas,
                                                                     strict=True)))
    hit = _expansions.get(key)
    if hit is None:
        try:
            rows, results, got = _trace(ins, metas)
        except _Refuse as e:
            hit = e.why
        except Exception as e:  # noqa: BLE001 (a decomposition that fails on these arguments)
            hit = f"its decomposition failed on these arguments ({type(e).__name__}: {e})"
        else:
            hit = (rows, results)
            for k, (m, g) in enumerate(zip(out_metas, got, strict=False)):
                if m is None or k >= len(ins.outs) or ins.outs[k] is None:
                    continue
                if g is None or not _same_layout(g, m):
                    hit = (f"its decomposition gives output {k} other metadata than the op "
                           f"({g} for {m})")
                    break
                if results[k][0] == "in":  # an input returned as is: it needs a new name
                    hit = "its decomposition returns an input as an output"
                    break
        if len(_expansions) >= MAX_EXPANSIONS:
            _expansions.clear()
        _expansions[key] = hit
    if type(hit) is str:
        where = f" (recorded at {ins.where})" if ins.where else ""
        name = op_to_name(ins.op)
        raise NotServedError(
            f"[genie] the server does not run {name}{where} ({allowlist.why_refused(name)}), "
            f"and Genie cannot decompose it: {hit}. Compute this value on this machine instead (move its inputs with "
            ".cpu()), or ask the server's operator to review the op into the server's opset "
            "(genie/remote/allowlist.py, REVIEWED_GROUPS).")
    return hit


def _metas_of(ins: Instr, node: Any) -> list[TensorMeta | None]:
    metas: list[TensorMeta | None] = []
    for x, y in zip(ins.leaves, node.leaves, strict=True):
        if type(x) is Slot:
            if type(y) is not Ref:
                raise NotServedError(f"[genie] internal: instruction leaves of {ins.op} do not "
                                     "match its node's")
            metas.append(y.node.metas[y.out])
        else:
            metas.append(None)
    return metas


def for_server(tape: Tape, origin: list[int] | None = None) -> list[Instr]:
    """``tape.instrs`` with every op a server does not run replaced by its decomposition.

    ``origin``, when given, receives for each returned instruction the index of the tape's
    instruction it comes from (a server names a failing instruction by its index on the wire).
    """
    instrs = tape.instrs
    if all(served(ins.op) for ins in instrs):
        if origin is not None:
            origin.extend(range(len(instrs)))
        return instrs
    top = max([*tape.inputs, *(o for ins in instrs for o in ins.outs if o is not None), -1])
    nodes = tape.nodes
    if len(nodes) != len(instrs):  # a segment of a tape (several devices): match by uid
        by_uid = {n.uid: n for n in nodes}
        nodes = [by_uid.get(ins.uid) for ins in instrs]
    out: list[Instr] = []
    for i, ins in enumerate(instrs):
        if served(ins.op):
            out.append(ins)
            if origin is not None:
                origin.append(i)
            continue
        if ins.rng is not None:
            where = f" (recorded at {ins.where})" if ins.where else ""
            raise NotServedError(
                f"[genie] the server does not run the random op {op_to_name(ins.op)}{where}, "
                "and a decomposition would not draw eager's random stream. Compute this value "
                "on this machine (.cpu() its inputs), or ask the server's operator to review the "
                "op into the server's opset (genie/remote/allowlist.py, REVIEWED_GROUPS).")
        node = nodes[i]
        if node is None:
            raise NotServedError(f"[genie] internal: no recorded node for {op_to_name(ins.op)}")
        rows, results = _expansion(ins, _metas_of(ins, node), list(node.metas))
        _counts["ops_decomposed_for_server"] += 1
        names: dict[int, int] = {}
        for k, r in enumerate(results):  # the op's outputs keep their slots
            if type(r) is tuple and r[0] == "v" and k < len(ins.outs) and \
                    ins.outs[k] is not None and r[1] not in names:
                names[r[1]] = ins.outs[k]
        last: dict[int, int] = {}
        for ri, (_f, _s, codes, _o) in enumerate(rows):
            for c in codes:
                if c[0] == "v":
                    last[c[1]] = ri
        made: list[Instr] = []
        for ri, (func, spec, codes, outs) in enumerate(rows):
            leaves = []
            for c in codes:
                if c[0] == "in":
                    leaves.append(ins.leaves[c[1]])
                elif c[0] == "v":
                    leaves.append(Slot(names[c[1]]))
                else:
                    leaves.append(c[1])
            o: list[int | None] = []
            free: list[int] = []
            for v in outs:
                if v is None:
                    o.append(None)
                    continue
                if v not in names:
                    if v not in last:  # made, never read, not an output of the op
                        o.append(None)
                        continue
                    top += 1
                    names[v] = top
                o.append(names[v])
            for v, at in last.items():
                if at == ri and names[v] not in ins.outs:
                    free.append(names[v])
            made.append(Instr(func, leaves, spec, tuple(o), None, tuple(free), ins.uid,
                              ins.where, ins.device))
        if not made:
            raise NotServedError(f"[genie] internal: {op_to_name(ins.op)} decomposed to nothing")
        made[-1].free = tuple(made[-1].free) + tuple(ins.free)
        out.extend(made)
        if origin is not None:
            origin.extend([i] * len(made))
    return out
