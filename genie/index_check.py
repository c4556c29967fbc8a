"""Index arguments checked against their bounds on the device, before the indexing kernel runs.

Why: on CUDA an out-of-range index in an indexing kernel (``gather``, ``index_select``, advanced
indexing, ``embedding``, ``scatter``, ``nll_loss`` targets, ...) is a device-side assert, not an
``IndexError``: it poisons the process's CUDA context for good, so every later CUDA call of the
process fails. Meta tensors cannot see it (it depends on index values). A Genie server is shared
by tenants, so it checks such arguments first and refuses the instruction with the exception
eager raises on the CPU (same type, close text); see docs/deployment.md.

Other CUDA kernels device-assert on argument *values* that are not indices (``bernoulli``'s
probabilities, ``binary_cross_entropy``'s input and target, ``multinomial``'s distributions,
``masked_scatter``'s mask against its source, ``repeat_interleave``'s repeats against its
``output_size``): the same table holds a second kind of rule for them, :class:`Values` (listed
with the asserted conditions in :data:`VALUE_ASSERTS`, the audit of PyTorch's CUDA kernels).

What is checked: :data:`RULES`, one table keyed by the op's base name (every overload of the
packet: functional, in-place, ``out=``). A rule names the schema argument that holds the indices
(an integer tensor; for advanced indexing a list of optional tensors), the size it indexes
(:class:`Rule` ``kind``), whether eager wraps negative indices, and eager's CPU error. The
argument is found through the op's schema; only integer tensors are checked (a ``bool``/``uint8``
mask of advanced indexing, or a float target of ``cross_entropy``, holds no indices). Ops whose
schemas take index-like arguments (:data:`INDEX_NAMES`) and have no rule are listed, each with its
reason, in :data:`NOT_INDICES` (the argument is not an index: an output, a value, host data) or
:data:`UNCHECKED` (indices without a rule yet: refused where every rule is checked, so that the
check has no hole); ``tests/unit/test_index_check.py`` fails when an op of the allowlist is in
none of them. ``one_hot``, whose index is its input, is listed by hand.

Where: a server checks every rule on CUDA (scope ``"all"``) and, on a CPU, the rules whose CPU
kernels do not bound their indices themselves (``Rule.cpu_checks``, scope ``"cpu"``), by default
(:func:`server_scope`, ``--index-check``); in process only with ``GENIE_INDEX_CHECK``
(:func:`enabled`), since there an out-of-range index hurts only the user's own process, as eager.

Cost: a check is one ``aminmax`` per index tensor and one device-to-host copy (one sync) for all
the index tensors that exist at that point; a value rule adds one ``aminmax`` per checked tensor
(``multinomial`` also one of its row sums, ``masked_scatter`` a count, ``repeat_interleave`` a sum)
to the same copy. :class:`IndexCheck` (one per tape run) reduces, before the first instruction that
needs a check, every index argument (and ``"range"`` value argument) of the rest of the tape that
already exists (tape inputs: token ids, positions), so a tape whose indices are inputs pays one
sync; an index computed inside the tape is reduced right before the instruction that reads it (with
whatever else exists then). A reduction stays valid until an instruction writes the index's storage
or its slot is written again.

Example:
    >>> import torch
    >>> from genie.index_check import check_call
    >>> x = torch.ones(3)
    >>> check_call(torch.ops.aten.gather.default, (x, 0, torch.tensor([1, 2])), {})
    >>> try:
    ...     check_call(torch.ops.aten.gather.default, (x, 0, torch.tensor([7])), {})
    ... except RuntimeError as e:
    ...     print(e)
    index 7 is out of bounds for dimension 0 with size 3
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import optree
import torch

from .meta import policy
from .planner import Slot, Tape
from .stats import bump

#: names of schema arguments that may hold indices (the completeness test reads them)
INDEX_NAMES = frozenset({"index", "indices", "target", "targets", "offsets", "lengths",
                         "input_lengths", "target_lengths", "offset2bag", "maximum_indices",
                         "tensor_indices_or_sections", "counts", "is_target", "min_indices",
                         "pivots", "LU_pivots", "offs"})

_ANY = 1 << 62  # a bound no index reaches: only the lower one matters
_DIM_MSG = "index {v} is out of bounds for dimension {d} with size {n}"
_SELF_MSG = "index out of range in self (index {v}, dimension {d} with size {n})"
_TAKE_MSG = "out of range: tried to access index {v} on a tensor of {n} elements."
_POOL_MSG = "Found an invalid max index: {v} (output volumes are of size {n})"


@dataclass(frozen=True, slots=True)
class Rule:
    """How one op's index argument is bounded.

    Attributes:
        index: the schema argument holding the indices.
        kind: the size the index is checked against:
            ``"dim"``: ``ref.size(dim)`` (``dim`` names the dimension argument; a ``None``
            dimension means the flattened ``ref``, as in ``take_along_dim``);
            ``"rows"``: ``ref.size(0)``, or ``ref`` itself when it is an int (``num_weights``);
            ``"numel"``: ``ref.numel()`` (``take``, ``put``);
            ``"classes"``: the class dimension of ``ref`` (``size(1)``, ``size(0)`` when 1-D),
            values equal to the ``ignore_index`` argument skipped;
            ``"advanced"``: advanced indexing, each index tensor against the dimension it indexes;
            ``"spatial"``: the product of the last ``dim`` sizes of ``ref`` (pooling indices), or
            of ``ref`` itself when it is a list (``max_unpool``'s ``output_size``).
        ref: the argument whose size bounds the index.
        dim: the dimension argument (``"dim"``), or the spatial rank as a string (``"2"``).
        negative: eager wraps negative indices (the index may be in ``[-n, n)``).
        error: eager's exception type on the CPU.
        message: eager's text (``{v}`` the value, ``{d}`` the dimension, ``{n}`` the size).
        cpu_checks: False where eager's CPU kernel does not bound the indices (it reads or
            writes out of bounds): a CPU server checks these rules by default (``auto``).
    """

    index: str
    kind: str
    ref: str = "self"
    dim: str | None = "dim"
    negative: bool = False
    error: type[Exception] = RuntimeError
    message: str = _DIM_MSG
    cpu_checks: bool = True  # eager's CPU kernel bounds these indices itself (raises cleanly)

    @property
    def arg(self) -> str:
        return self.index


@dataclass(frozen=True, slots=True)
class Values:
    """How one op's value argument is checked: a CUDA kernel asserts on its values.

    Every kernel of the audit asserts with comparisons that NaN fails (``0 <= p && p <= 1``,
    ``!isnan``), and ``aminmax`` propagates NaN, so a NaN is refused as the kernel would.

    Attributes:
        arg: the schema argument holding the values; only a tensor is checked (a number is
            checked by eager's host code, ``bernoulli(x, p=1.5)``), and not a ``bool`` one
            (always in ``[0, 1]``).
        kind: what is reduced and judged:
            ``"range"``: ``lo <= min`` and ``max <= hi`` (one ``aminmax``);
            ``"probs"``: ``multinomial``'s rows: every value finite and ``>= 0``, every row sum
            ``> 0`` (and, with replacement and more than one sample, finite in the input's
            dtype): ``aminmax`` of the values and of the row sums;
            ``"count"``: the ``True`` count of the mask broadcast to ``self`` at most the
            ``ref`` argument's ``numel`` (``masked_scatter``'s source);
            ``"total"``: the repeats ``>= 0`` and summing to the ``ref`` argument
            (``output_size``), where that is given (else eager's host code checks, and syncs).
        lo, hi: the bounds of ``"range"``.
        ref: the argument ``"count"`` and ``"total"`` compare with.
        unless: the rule applies only to the overloads without this argument
            (``bernoulli(self)`` draws with probabilities ``self``; ``bernoulli(self, p)``
            with ``p``).
        error: eager's exception type on the CPU.
        message: eager's CPU text (``{v}``: the value that fails), for ``"range"``.
        cpu_checks: eager's CPU kernel checks these values itself (every rule of the audit).
    """

    arg: str
    kind: str = "range"
    lo: float = 0.0
    hi: float = 1.0
    ref: str | None = None
    unless: str | None = None
    error: type[Exception] = RuntimeError
    message: str = ""
    cpu_checks: bool = True


_GATHER = Rule("index", "dim")
_FILL = Rule("index", "dim", negative=True, error=IndexError)
_SELECT = Rule("index", "dim", error=IndexError, message=_SELF_MSG)
_EMBED = Rule("indices", "rows", ref="weight", dim=None, error=IndexError, message=_SELF_MSG)
_EMBED_BACK = Rule("indices", "rows", ref="num_weights", dim=None, error=IndexError,
                   message=_SELF_MSG, cpu_checks=False)
_TAKE = Rule("index", "numel", dim=None, negative=True, error=IndexError, message=_TAKE_MSG)
_ADVANCED = Rule("indices", "advanced", dim=None, negative=True, error=IndexError)
_NLL = Rule("target", "classes", dim=None, error=IndexError,
            message="Target {v} is out of bounds.")


_P_MSG = ("Expected p_in >= 0 && p_in <= 1 to be true, but got false.  (Could this error message "
          "be improved?  If so, please report an enhancement request to PyTorch.)")
_BERNOULLI = (Values("p", message=_P_MSG), Values("self", unless="p", message=_P_MSG))
_BCE_MSG = "all elements of {w} should be between 0 and 1"
_MASKED_SCATTER = Values("mask", "count", ref="source",
                         message="Number of elements of source < number of ones in mask")


def _pool(rank: int, index: str = "indices", ref: str = "self", cpu_checks: bool = True) -> Rule:
    return Rule(index, "spatial", ref=ref, dim=str(rank), message=_POOL_MSG,
                cpu_checks=cpu_checks)


#: The one table: op base name -> rules of its index arguments (docs/deployment.md lists it).
RULES: dict[str, tuple[Rule | Values, ...]] = {
    "gather": (_GATHER,),
    "gather_backward": (_GATHER,),
    "scatter": (_GATHER,),
    "scatter_": (_GATHER,),
    "scatter_add": (_GATHER,),
    "scatter_add_": (_GATHER,),
    "scatter_reduce": (_GATHER,),
    "scatter_reduce_": (_GATHER,),
    "index_add": (_GATHER,),
    "index_add_": (_GATHER,),
    "take_along_dim": (Rule("indices", "dim", cpu_checks=False),),
    "cummaxmin_backward": (Rule("indices", "dim", ref="input"),),
    "value_selecting_reduction_backward": (Rule("indices", "dim", ref="sizes"),),
    "index_select": (_SELECT,),
    "index_select_backward": (Rule("index", "dim", ref="self_sizes", error=IndexError,
                                   message=_SELF_MSG),),
    "index_reduce": (_SELECT,),
    "index_reduce_": (_SELECT,),
    "index_copy": (Rule("index", "dim", error=IndexError, message="index_copy_(): " + _DIM_MSG),),
    "index_copy_": (Rule("index", "dim", error=IndexError, message="index_copy_(): " + _DIM_MSG),),
    "index_fill": (_FILL,),
    "index_fill_": (_FILL,),
    "index": (_ADVANCED,),
    "index_put": (_ADVANCED,),
    "index_put_": (_ADVANCED,),
    "take": (_TAKE,),
    "put": (_TAKE,),
    "put_": (_TAKE,),
    "embedding": (_EMBED,),
    "embedding_renorm": (Rule("indices", "rows", dim=None, error=IndexError, message=_SELF_MSG),),
    "embedding_renorm_": (Rule("indices", "rows", dim=None, error=IndexError,
                               message=_SELF_MSG),),
    "embedding_backward": (_EMBED_BACK,),
    "embedding_dense_backward": (_EMBED_BACK,),
    "nll_loss": (_NLL,),
    "nll_loss_forward": (_NLL,),
    "nll_loss_backward": (_NLL,),
    "nll_loss2d": (_NLL,),
    "nll_loss2d_forward": (_NLL,),
    "nll_loss2d_backward": (_NLL,),
    "nll_loss_nd": (_NLL,),
    "cross_entropy_loss": (_NLL,),
    "multi_margin_loss": (Rule("target", "classes", dim=None, message="target out of range"),),
    "multi_margin_loss_backward": (Rule("target", "classes", dim=None,
                                        message="target out of range"),),
    "max_pool2d_with_indices_backward": (_pool(2, cpu_checks=False),),
    "max_pool3d_with_indices_backward": (_pool(3, cpu_checks=False),),
    "adaptive_max_pool2d_backward": (_pool(2, cpu_checks=False),),
    "adaptive_max_pool3d_backward": (_pool(3, cpu_checks=False),),
    "fractional_max_pool2d_backward": (_pool(2),),
    "fractional_max_pool3d_backward": (_pool(3),),
    # its input is the index (named self): CUDA skips eager's check when num_classes is given
    "one_hot": (Rule("self", "rows", ref="num_classes", dim=None,
                     message="one_hot: class value {v} is out of range [0, {n})"),),
    "max_unpool2d": (_pool(2, ref="output_size"),),
    "max_unpool3d": (_pool(3, ref="output_size"),),
    # values, not indices (VALUE_ASSERTS says what each CUDA kernel asserts)
    "bernoulli": _BERNOULLI,
    "bernoulli_": _BERNOULLI,
    "binary_cross_entropy": (Values("self", message=_BCE_MSG.format(w="input")),
                             Values("target", message=_BCE_MSG.format(w="target"))),
    "multinomial": (Values("self", "probs"),),
    "masked_scatter": (_MASKED_SCATTER,),
    "masked_scatter_": (_MASKED_SCATTER,),
    "repeat_interleave": (Values("repeats", "total", ref="output_size"),),
}

#: The audit: allowlisted ops whose CUDA kernels assert on (or, for pivots, are unsafe with) the
#: *values* of an argument beyond the index rules above (shapes are meta inference's), with the
#: condition (PyTorch's aten/src/ATen/native/cuda). Each has a :class:`Values` rule in
#: :data:`RULES` or a refusal in :data:`UNCHECKED` (``tests/unit/test_index_check.py`` holds that).
VALUE_ASSERTS: dict[str, str] = {
    **dict.fromkeys(("bernoulli", "bernoulli_"), "DistributionTemplates.h "
                    "bernoulli_tensor_cuda_kernel: CUDA_KERNEL_ASSERT(0 <= p && p <= 1) for a "
                    "tensor p (self where there is no p); NaN fails it"),
    "binary_cross_entropy": "Loss.cu binary_cross_entropy_out_cuda: CUDA_KERNEL_ASSERT(input_val "
                            ">= 0 && input_val <= 1), the same for target_val; NaN fails it",
    "multinomial": "with replacement and more than one sample, MultinomialKernel.cu: "
                   "renormRowsL1 asserts !(val < 0), binarySearchForMultinomial a row's "
                   "cumulative sum > 0 (fails for a zero row, NaN, inf, or a row sum that "
                   "overflows the dtype); else Distributions.cpp's fast path, in recent "
                   "versions: at::_assert_async(min >= 0 && max < inf) and no row summing to 0 "
                   "(a device-side assert on CUDA; older versions checked on the host)",
    **dict.fromkeys(("masked_scatter", "masked_scatter_"), "IndexKernel.cu "
                    "masked_scatter_size_check: CUDA_KERNEL_ASSERT(the mask's True count, "
                    "broadcast to self, <= source.numel())"),
    "repeat_interleave": "Repeat.cu compute_cuda_kernel, where output_size is given (else eager's "
                         "host code checks, with a sync): CUDA_KERNEL_ASSERT_PRINTF(output_size == "
                         "sum(repeats)), CUDA_KERNEL_ASSERT(repeat >= 0)",
    **dict.fromkeys(("lu_unpack", "lu_solve", "linalg_lu_solve", "linalg_ldl_solve"),
                    "pivots (1-based row numbers) index rows: LinearAlgebra.cu "
                    "unpack_pivots_cuda_kernel swaps perm[pivots[i] - 1] unchecked (an "
                    "out-of-bounds write, not even an assert); the solvers pass them to "
                    "the getrs/sytrs of cuSOLVER, cuBLAS or MAGMA (not audited further)"),
    "_grouped_mm": "GroupMMCommon.cuh prepare_grouped_gemm_data (CUTLASS path): "
                   "CUDA_KERNEL_ASSERT on each group's size from offs (a multiple of 16 in some "
                   "versions, >= 0 and ending within the rows in others)",
}

#: Ops with index arguments but no rule yet: refused where the check is on (their reason says why).
UNCHECKED: dict[str, str] = {
    name: "offsets and per-bag indices of embedding_bag are not checked yet"
    for name in ("embedding_bag", "_embedding_bag", "_embedding_bag_forward_only",
                 "_embedding_bag_backward", "_embedding_bag_dense_backward",
                 "_embedding_bag_per_sample_weights_backward")
} | {
    name: "CTC targets and lengths are not checked yet"
    for name in ("ctc_loss", "_ctc_loss", "_ctc_loss_backward")
} | {
    name: "a target list ends at its first -1: its values cannot be bounded by min/max"
    for name in ("multilabel_margin_loss", "multilabel_margin_loss_forward",
                 "multilabel_margin_loss_backward")
} | {
    "_segment_reduce_backward": "segment lengths and offsets are not checked yet",
} | {
    name: "pivots (1-based row numbers) are not checked yet: CUDA swaps or reads rows by them "
          "unchecked"
    for name in ("lu_unpack", "lu_solve", "linalg_lu_solve", "linalg_ldl_solve")
} | {
    "_grouped_mm": "its offs (group ends) are not checked yet: the conditions CUDA's kernel "
                   "asserts on them change between PyTorch versions",
}

#: Ops whose index-like arguments (by name) hold no indices into device memory, with the reason.
NOT_INDICES: dict[str, str] = {
    name: "its indices argument is an output (written, not read)"
    for name in ("_cummax_helper", "_cummin_helper", "cummax", "cummin", "kthvalue", "median",
                 "nanmedian", "min", "mode", "sort", "topk", "max_pool2d_with_indices",
                 "max_pool3d_with_indices", "adaptive_max_pool2d", "adaptive_max_pool3d",
                 "fractional_max_pool2d", "fractional_max_pool3d")
} | {
    name: "its target holds values (regression or probability targets), not class indices"
    for name in ("binary_cross_entropy_backward", "binary_cross_entropy_with_logits",
                 "cosine_embedding_loss", "hinge_embedding_loss", "huber_loss",
                 "huber_loss_backward", "kl_div", "l1_loss", "margin_ranking_loss", "mse_loss",
                 "mse_loss_backward", "poisson_nll_loss", "smooth_l1_loss",
                 "smooth_l1_loss_backward", "soft_margin_loss", "soft_margin_loss_backward")
} | {
    "batch_norm_gather_stats_with_counts": "counts are floating-point statistics",
    "_pack_padded_sequence": "lengths must be a CPU tensor: checked by the host code",
    "tensor_split": "split points must be a CPU tensor: read by the host code",
}


class IndexOutOfRange(Exception):
    """Internal: carries eager's exception for an instruction whose index is out of range."""


def base_name(op: Any) -> str:
    return op._schema.name.split("::", 1)[-1]


def rules_for(op: Any) -> tuple[Rule | Values, ...] | None:
    """The rules of ``op`` (None: it takes no checked argument); cached on the op."""
    try:
        return op._genie_index_rules
    except AttributeError:
        pass
    name = base_name(op) if not isinstance(op, str) else ""
    rules = RULES.get(name)
    if rules is not None:
        args = {a.name for a in op._schema.arguments}
        rules = tuple(r for r in rules if r.arg in args and
                      not (type(r) is Values and r.unless in args)) or None
    try:
        op._genie_index_rules = rules
    except AttributeError:
        pass
    return rules


def unchecked(op: Any) -> str | None:
    """Why ``op``'s index arguments cannot be checked (None: they can, or it has none)."""
    return None if isinstance(op, str) else UNCHECKED.get(base_name(op))


def _entry(op: Any) -> tuple[Any, Any, bool]:
    """(what scope ``"all"`` checks: the op's rules, the reason it cannot be checked, or None;
    what scope ``"cpu"`` checks: the rules whose CPU kernels do not check, or None; whether it
    writes an argument), cached on the op: the per-instruction cost of a tape's plan."""
    try:
        return op._genie_index_entry
    except AttributeError:
        pass
    rules = rules_for(op)
    cpu = tuple(r for r in rules or () if not r.cpu_checks) or None
    e = (unchecked(op) or rules, cpu, bool(policy(op).writes))
    try:
        op._genie_index_entry = e
    except AttributeError:
        pass
    return e


def _bind(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    out = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _is_index(t: Any, advanced: bool) -> bool:
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return False
    dt = t.dtype
    return not (dt.is_floating_point or dt.is_complex or dt is torch.bool or
                (advanced and dt is torch.uint8))


def _sources(rule: Rule, a: dict[str, Any]) -> list[Any]:
    """The values (Slots or tensors) holding ``rule``'s indices in the bound arguments ``a``."""
    v = a.get(rule.index)
    if rule.kind == "advanced":
        return [t for t in (v or ()) if t is not None]
    return [] if v is None else [v]


def _extents(rule: Rule, a: dict[str, Any]) -> list[tuple[torch.Tensor, int, int] | None]:
    """For each index tensor of ``rule`` in the bound real arguments ``a`` (aligned with
    :func:`_sources`): (tensor, size, dim), or None where it holds no indices (a mask, a float
    target, an empty tensor)."""
    ref = a.get(rule.ref)
    k = rule.kind
    if k == "advanced":  # the "dimension" eager's message names: the index tensor's position
        out: list[tuple[torch.Tensor, int, int] | None] = []  # among the defined ones (a mask
        shape, pos, j = ref.shape, 0, 0                      # counts one per dim it covers)
        for t in a.get(rule.index) or ():
            if t is None:
                pos += 1
                continue
            if t.dtype in (torch.bool, torch.uint8):
                out.append(None)
                pos += t.dim()
                j += t.dim()
                continue
            out.append((t, shape[pos], j) if _is_index(t, True) and pos < len(shape)
                       else None)
            pos += 1
            j += 1
        return out
    t = a.get(rule.index)
    if t is None:
        return []
    if not _is_index(t, False):
        return [None]
    shape = tuple(ref.shape) if isinstance(ref, torch.Tensor) else ref
    if k == "dim":
        d = a.get(rule.dim)
        if d is None:
            return [(t, math.prod(shape), 0)]
        if len(shape) == 0:
            return [(t, 1, 0)]
        d = d + len(shape) if d < 0 else d
        return [(t, shape[d], d)] if 0 <= d < len(shape) else [None]
    if k == "rows":
        if isinstance(ref, int):  # a count; one_hot's -1 (as many as the largest value + 1)
            return [(t, ref if ref >= 0 else _ANY, 0)]
        return [(t, shape[0] if shape else 1, 0)]
    if k == "numel":
        return [(t, math.prod(shape), 0)]
    if k == "classes":
        return [(t, shape[1] if len(shape) >= 2 else (shape[0] if shape else 1), 1)]
    if k == "spatial":
        r = int(rule.dim or 0)
        return [(t, math.prod(shape[-r:] if isinstance(ref, torch.Tensor) else shape), 0)]
    raise AssertionError(f"unknown index rule kind {k!r}")


def _ignored(rule: Rule, a: dict[str, Any]) -> int | None:
    return a.get("ignore_index") if rule.kind == "classes" else None


def _judge(rule: Rule, lo: int, hi: int, n: int, d: int) -> None:
    """Raise eager's error when ``[lo, hi]`` leaves the indices' valid range for size ``n``."""
    low = -n if rule.negative else 0
    if low <= lo and hi < n:
        return
    v = hi if hi >= n else lo
    raise IndexOutOfRange(rule.error(rule.message.format(v=v, d=d, n=n)))


def enabled(setting: str, device: torch.device) -> bool:
    """Whether a check setting (``auto``, ``1``/``on``, ``0``/``off``) checks every rule on
    ``device``: ``auto`` does where an out-of-range index is a device-side assert (CUDA)."""
    s = setting.strip().lower()
    if s in ("auto", ""):
        return device.type == "cuda"
    if s in ("1", "on", "true", "yes"):
        return True
    if s in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"index check setting {setting!r}: expected auto, 1 (on) or 0 (off)")


def server_scope(setting: str, device: torch.device) -> str | None:
    """What a server checks: ``"all"`` (every rule; refuses :data:`UNCHECKED` ops), ``"cpu"``
    (``auto`` on a CPU: only the rules whose CPU kernels do not bound their indices, which would
    read or write out of bounds) or None (``0``)."""
    if enabled(setting, device):
        return "all"
    s = setting.strip().lower()
    return "cpu" if s in ("auto", "") and device.type != "cuda" else None


def _index_parts(t: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.aminmax(t))  # integers: :func:`_fetch` copies them as int64


def _value_parts(rule: Values, a: dict[str, Any]) -> list[torch.Tensor] | None:
    """The 0-d tensors ``rule`` reduces its argument to, on its device (None: nothing to check:
    not a tensor, empty, or a path where eager's host code checks)."""
    t = a.get(rule.arg)
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    k = rule.kind
    if k == "range":
        if t.dtype is torch.bool:
            return None
        return list(torch.aminmax(t))
    if k == "probs":
        return [*torch.aminmax(t), *torch.aminmax(t.sum(-1))]
    if k == "count":
        shape = torch.broadcast_shapes(a["self"].shape, t.shape)
        m = t if t.dtype is torch.bool else t != 0
        return [m.expand(shape).sum()]
    if k == "total":
        if a.get(rule.ref) is None:
            return None  # without output_size eager's host code checks (and syncs)
        x = a.get("self")
        if isinstance(x, torch.Tensor) and t.numel() == 1:  # one repeat for every slice
            d = a.get("dim")
            total = t.reshape(()) * (x.numel() if d is None else x.shape[d])
        else:
            total = t.sum()
        return [t.amin().long(), total.long()]
    raise AssertionError(f"unknown value rule kind {k!r}")


def _judge_values(rule: Values, st: list[Any], a: dict[str, Any]) -> None:
    """Raise eager's error when the reduced values ``st`` fail ``rule``'s condition."""
    k = rule.kind
    msg = None
    if k == "range":
        lo, hi = st
        if not (rule.lo <= lo and hi <= rule.hi):  # NaN fails, as in the kernels
            msg = rule.message.format(v=lo if not rule.lo <= lo else hi)
    elif k == "probs" and (not a.get("replacement") or a.get("num_samples") == 1):
        lo, hi, slo, _ = st  # the fast path: _assert_async (a device-side assert on CUDA)
        if not (lo >= 0 and hi < math.inf):
            msg = "probability tensor contains either `inf`, `nan` or element < 0"
        elif not slo > 0:
            msg = "invalid multinomial distribution (sum of probabilities <= 0)"
    elif k == "probs":
        lo, hi, slo, shi = st
        if not lo >= 0:  # NaN included: eager's CPU kernel tests ``>= 0`` first
            msg = "invalid multinomial distribution (encountering probability entry < 0)"
        elif not hi < math.inf:
            msg = "invalid multinomial distribution (encountering probability entry = infinity " \
                  "or NaN)"
        elif not slo > 0:
            msg = "invalid multinomial distribution (sum of probabilities <= 0)"
        elif not shi < math.inf:  # CUDA renormalizes in the dtype: a zero row after all
            msg = (f"invalid multinomial distribution (a row's sum of probabilities, {shi}, "
                   f"overflows {a['self'].dtype}, which CUDA's kernel sums in)")
    elif k == "count":
        if st[0] > a[rule.ref].numel():
            msg = rule.message
    elif k == "total":
        if st[0] < 0:
            msg = "repeats can not be negative"
        elif st[1] != a[rule.ref]:
            msg = "allocated size does not match required size"
    if msg is not None:
        raise IndexOutOfRange(rule.error(msg))


def _as_float(v: int) -> float:
    return struct.unpack("<d", struct.pack("<q", v))[0]


def _fetch(jobs: list[list[torch.Tensor]]) -> list[list[Any]]:
    """The numbers of each job (a list of 0-d tensors: integers exact, floating ones as Python
    floats, NaN kept): all of one device stacked in one tensor, one copy to the host (one sync)
    per device."""
    by_dev: dict[torch.device, list[int]] = {}
    for i, parts in enumerate(jobs):
        by_dev.setdefault(parts[0].device, []).append(i)
    out: list[list[Any]] = [[] for _ in jobs]
    for ids in by_dev.values():
        flat: list[torch.Tensor] = []
        floats: list[bool] = []
        for i in ids:
            for t in jobs[i]:
                fl = t.is_floating_point()
                floats.append(fl)  # a float64's bits travel as an int64: one stack, exact
                flat.append(t.double().view(torch.int64) if fl else
                            t if t.dtype is torch.int64 else t.long())
        vals = torch.stack(flat).tolist()  # the one sync of this batch
        k = 0
        for i in ids:
            n = len(jobs[i])
            out[i] = [_as_float(v) if fl else v
                      for v, fl in zip(vals[k:k + n], floats[k:k + n], strict=True)]
            k += n
    bump("index_checks", len(jobs))
    bump("index_check_syncs", len(by_dev))
    return out


def _masked(t: torch.Tensor, ignore: int | None) -> torch.Tensor:
    return t if ignore is None else t.masked_fill(t == ignore, 0)


def _judge_any(what: tuple, st: list[Any]) -> None:
    """Judge one check: ``(rule, size, dim)`` of an index rule or ``(rule, args)`` of a value
    rule, against its reduced numbers ``st``."""
    if type(what[0]) is Values:
        _judge_values(what[0], st, what[1])
    else:
        _judge(what[0], st[0], st[1], what[1], what[2])


def check_call(op: Any, args: tuple, kwargs: dict) -> None:
    """Check one call's index and value arguments now (one sync); raises eager's error when
    one is out of range. The in-process path for single calls; tapes use :class:`IndexCheck`."""
    rules = rules_for(op)
    if not rules:
        return
    a = _bind(op, args, kwargs)
    jobs: list[list[torch.Tensor]] = []
    whats: list[tuple] = []
    for rule in rules:
        if type(rule) is Values:
            parts = _value_parts(rule, a)
            if parts:
                jobs.append(parts)
                whats.append((rule, a))
            continue
        ign = _ignored(rule, a)
        for e in _extents(rule, a):
            if e is not None:
                jobs.append(_index_parts(_masked(e[0], ign)))
                whats.append((rule, e[1], e[2]))
    if not jobs:
        return
    for what, st in zip(whats, _fetch(jobs), strict=True):
        try:
            _judge_any(what, st)
        except IndexOutOfRange as e:
            raise e.args[0] from None


class IndexCheck:
    """The index and value checks of one tape run (see the module docstring for the batching).

    Call :meth:`step` before each instruction runs: it checks the instruction's index and value
    arguments (raising :class:`IndexOutOfRange`) and forgets the reductions the instruction will
    make stale. Per instruction without checked arguments it costs two set lookups.
    """

    def __init__(self, tape: Tape, scope: str = "all") -> None:
        self.tape = tape
        # reductions by (slot id, ignored value) of indices, (slot id, rule kind) of values ->
        # (their numbers: min, max, ...; the storage id)
        self.known: dict[tuple[int, Any], tuple[list[Any], int]] = {}
        self._slots: set[int] = set()  # the slot ids of ``known``
        self.tensors = 0  # checks reduced (index tensors, value rules)
        self.syncs = 0  # device-to-host copies (one per batch and device)
        self.refused = 0  # instructions refused (an index out of range, or an unchecked op)
        # per instruction with rules: its rules and its arguments bound to schema names (leaves
        # as Slots), or the reason it cannot be checked (an UNCHECKED op)
        self.plan: dict[int, Any] = {}
        self._writers: set[int] = set()  # instructions that write an argument (in place, out=)
        for i, ins in enumerate(tape.instrs):
            if isinstance(ins.op, str):
                continue
            every, cpu, writes = _entry(ins.op)
            what = every if scope == "all" else cpu
            if writes:
                self._writers.add(i)
            if what is None:
                continue
            if type(what) is str:
                self.plan[i] = what
                continue
            args, kwargs = optree.tree_unflatten(ins.spec, list(ins.leaves))
            a = _bind(ins.op, args, kwargs)
            self.plan[i] = [(r, a) for r in what]

    def points(self) -> tuple[list[int], list[int]]:
        """Where a native replay of the tape stops for :meth:`step` (the instructions with
        checked arguments, those that write an argument, those that define a slot a check
        reads), and the slots those calls read: :meth:`step` sees there what it sees between
        the instructions of an interpreted run."""
        reads: set[int] = set()
        for what in self.plan.values():
            if type(what) is not str:
                for _, a in what:
                    reads.update(x.id for x in optree.tree_leaves(a, none_is_leaf=True)
                                 if type(x) is Slot)
        instrs = self.tape.instrs
        for i in self._writers:
            reads.update(x.id for x in instrs[i].leaves if type(x) is Slot)
        at = set(self.plan) | self._writers
        at.update(i for i, ins in enumerate(instrs) if not reads.isdisjoint(ins.outs))
        return sorted(at), sorted(reads)

    def step(self, i: int, ins: Any, env: dict[int, Any]) -> None:
        """Before instruction ``i`` (``ins``) runs: check its index arguments (raises
        :class:`IndexOutOfRange`), then forget what it is about to write."""
        if i in self.plan:
            self.before(i, env)
        if self.known and (i in self._writers or not self._slots.isdisjoint(ins.outs)):
            self.written(ins, env)

    def before(self, i: int, env: dict[int, Any]) -> None:
        """Check instruction ``i``'s index arguments against the values in ``env``."""
        try:
            self._check(i, env)
        except IndexOutOfRange:
            self.refused += 1
            bump("index_check_refusals")
            raise

    def _check(self, i: int, env: dict[int, Any]) -> None:
        plan = self.plan
        if type(plan[i]) is str:
            raise IndexOutOfRange(RuntimeError(
                f"{self.tape.instrs[i].op} is not served where index arguments are checked "
                f"(a Genie server on CUDA): {plan[i]}. Compute it in another way, or run it "
                "where the check is off (in process, or GENIE_SERVER_INDEX_CHECK=0 on a "
                "trusted single-tenant server)"))
        # reductions to make: cached ones by key (a slot's indices, with the ignored value; or
        # a slot's values, by rule kind), and the others (constants, counts, totals)
        todo: dict[tuple[int, Any], list[torch.Tensor]] = {}
        fresh: list[tuple[tuple, list[torch.Tensor]]] = []
        checks: list[tuple[tuple, tuple[int, Any]]] = []
        for rule, a in plan[i]:
            real = {k: _value(v, env) for k, v in a.items()}
            if type(rule) is Values:
                s = a.get(rule.arg)
                if rule.kind == "range" and type(s) is Slot:
                    key = (s.id, rule.kind)
                    if key not in self.known:
                        parts = _value_parts(rule, real)
                        if parts is None:
                            continue
                        todo[key] = parts
                    checks.append(((rule, real), key))
                else:
                    parts = _value_parts(rule, real)
                    if parts is not None:
                        fresh.append(((rule, real), parts))
                continue
            srcs = _sources(rule, a)
            ext = _extents(rule, real)
            ign = _ignored(rule, real)
            for s, e in zip(srcs, ext, strict=True):
                if e is None:
                    continue
                t, n, d = e
                if type(s) is Slot:
                    key = (s.id, ign)
                    if key not in self.known:
                        todo[key] = _index_parts(_masked(t, ign))
                    checks.append(((rule, n, d), key))
                else:
                    fresh.append(((rule, n, d), _index_parts(_masked(t, ign))))
        if not checks and not fresh:
            return
        if todo or fresh:  # reduce every other argument that exists now too: one sync for all
            self._prefetch(i, env, todo)
        jobs = list(todo.values()) + [parts for _, parts in fresh]
        stats = _fetch(jobs)
        self.tensors += len(jobs)
        self.syncs += len({parts[0].device for parts in jobs})
        for key, st in zip(todo, stats, strict=False):
            self.known[key] = (st, env[key[0]].untyped_storage()._cdata)
            self._slots.add(key[0])
        for what, key in checks:
            _judge_any(what, self.known[key][0])
        for (what, _), st in zip(fresh, stats[len(todo):], strict=True):
            _judge_any(what, st)

    def _prefetch(self, i: int, env: dict[int, Any], todo: dict[tuple[int, Any], list]) -> None:
        """Add to ``todo`` the reductions of the later instructions' arguments that exist now
        (tape inputs: token ids, positions): indices, and values of ``"range"`` rules."""
        for j, later in self.plan.items():
            if j <= i or type(later) is str:
                continue
            for rule, a in later:
                if type(rule) is Values:
                    s = a.get(rule.arg)
                    if rule.kind != "range" or type(s) is not Slot or s.id not in env or \
                            (s.id, rule.kind) in self.known or (s.id, rule.kind) in todo:
                        continue
                    parts = _value_parts(rule, {rule.arg: env[s.id]})
                    if parts is not None:
                        todo[(s.id, rule.kind)] = parts
                    continue
                ign = a.get("ignore_index") if rule.kind == "classes" else None
                if ign is not None and type(ign) is not int:
                    continue
                for s in _sources(rule, a):
                    if type(s) is Slot and (s.id, ign) not in self.known and \
                            (s.id, ign) not in todo and s.id in env:
                        t = env[s.id]
                        if _is_index(t, rule.kind == "advanced"):
                            todo[(s.id, ign)] = _index_parts(_masked(t, ign))

    def written(self, ins: Any, env: dict[int, Any]) -> None:
        """Before ``ins`` runs: forget the reductions of the slots it writes (a slot freed
        earlier may be named again) and of the values whose storage it writes."""
        if not self.known:
            return
        slots = set(ins.outs)
        storages: set[int] = set()
        if not isinstance(ins.op, str) and policy(ins.op).writes:
            args, kwargs = optree.tree_unflatten(ins.spec, [_value(x, env) for x in ins.leaves])
            storages = written_storages(ins.op, args, kwargs)
        for key in [k for k, (_, sid) in self.known.items()
                    if k[0] in slots or sid in storages]:
            del self.known[key]
        self._slots = {k[0] for k in self.known}


def _value(x: Any, env: dict[int, Any]) -> Any:
    t = type(x)
    if t is Slot:
        return env[x.id]
    if t is list or t is tuple:
        return type(x)(_value(v, env) for v in x)
    return x


def written_storages(op: Any, args: tuple, kwargs: dict) -> set[int]:
    """Storages (``_cdata``) of the arguments ``op`` writes (in place, ``out=``)."""
    pol = policy(op)
    out: set[int] = set()
    for pos in pol.writes:
        v = pol.arg(pos, args, kwargs)
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                out.add(t.untyped_storage()._cdata)
    return out
