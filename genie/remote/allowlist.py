"""The ops a server runs for its clients: a list, derived from schemas by one rule, checked in.

A tape names ops by schema (``aten::add.Tensor``). A server resolves a name only if it is in
``allowlist.txt`` (next to this module, reviewed, one overload a line) **and** the rule below
still admits the op in the installed PyTorch. So a PyTorch upgrade can narrow what runs, never
widen it: an op that a new PyTorch adds, or one whose schema changes, is refused until someone
regenerates the list (``python -m genie.remote.allowlist > genie/remote/allowlist.txt``) and
reviews the diff; ``tests/unit/test_allowlist.py`` fails until then.

The rule (:func:`refusal`) admits functional, view, in-place and ``out=`` ATen overloads over
dense strided tensors whose every argument is a tensor, a number, a bool, a dtype, a layout, a
memory format, a device (checked and rewritten by the server), ``Generator?`` (the wire format
cannot carry a generator, so only ``None`` arrives) or a string from a closed set of enum-like
arguments (:data:`STR_ENUMS`: ``gelu(approximate="tanh")``; the value is checked per call). It
refuses everything that takes another string (paths: ``save``, ``from_file``), a storage, a
stream, a required generator, a script object; everything that returns something else than
tensors and numbers; and, by name with a reason (:data:`REFUSED_NAMES`, :data:`REFUSED_PATTERNS`),
unchecked constructors (``_reshape_alias``, ``set_``, ``*unsafe*``), sparse, quantized, nested
and backend-private layouts, host-process state (seeds, pinned memory) and test-only ops.

Ops with unusual memory behaviour stay admitted only because the server's checks cover them
(see :mod:`genie.remote.guard`): ``as_strided`` (storage bounds checked on meta tensors before it
runs), ``resize_``/``resize_as_`` (growth accounted in the quota and zeroed) and the ``empty``
family (zeroed). Genie's client records all of them.

Example:
    >>> from genie.remote.allowlist import admitted
    >>> admitted("aten::add.Tensor"), admitted("aten::_reshape_alias.default")
    (True, False)
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

#: Version of the rule; bump it when the rule changes (the data file records it).
RULE_VERSION = 1
LIST_FILE = Path(__file__).with_name("allowlist.txt")

#: String arguments admitted, by argument name, with the values a call may give them.
STR_ENUMS: dict[str, frozenset[str]] = {
    "approximate": frozenset({"none", "tanh"}),  # gelu
    "rounding_mode": frozenset({"trunc", "floor"}),  # div
    "reduce": frozenset({"sum", "prod", "mean", "amax", "amin", "add", "multiply", "max",
                         "min"}),  # scatter, scatter_reduce, index_reduce, segment_reduce
    "side": frozenset({"left", "right"}),  # searchsorted
    "interpolation": frozenset({"linear", "lower", "higher", "midpoint", "nearest"}),  # quantile
    "padding": frozenset({"same", "valid"}),  # convolution
    "norm": frozenset({"backward", "forward", "ortho"}),  # fft
    "UPLO": frozenset({"L", "U"}),  # eigh
    "ord": frozenset({"fro", "nuc"}),  # matrix norm
    "driver": frozenset({"gels", "gelsy", "gelsd", "gelss", "gesvd", "gesvdj", "gesvda"}),
    "mode": frozenset({"constant", "reflect", "replicate", "circular", "reduced", "complete",
                       "r"}),  # pad, qr
    "pad_mode": frozenset({"constant", "reflect", "replicate", "circular"}),  # stft
}

#: Argument types (``str(arg.real_type)``) a tape may pass; ``str``/``str?`` only as STR_ENUMS.
ARG_TYPES = frozenset({
    "Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]",
    "int", "Optional[int]", "List[int]", "Optional[List[int]]",
    "SymInt", "Optional[SymInt]", "List[SymInt]", "Optional[List[SymInt]]",
    "float", "Optional[float]", "List[float]", "Optional[List[float]]",
    "bool", "Optional[bool]", "List[bool]", "complex",
    "number", "Optional[number]", "List[number]",
    "ScalarType", "Optional[ScalarType]", "Layout", "Optional[Layout]",
    "MemoryFormat", "Optional[MemoryFormat]", "Device", "Optional[Device]",
    "Optional[Generator]",
})
#: Return types an admitted op may have (values that stay on the server or come back as tensors).
RETURN_TYPES = frozenset({"Tensor", "List[Tensor]", "int", "SymInt", "float", "bool", "number"})

#: Refused by name (the base name, any overload), each with its reason.
REFUSED_NAMES: dict[str, str] = {
    "resize": "functional resize (Genie records resize_; only that one is accounted)",
    "resize_as": "functional resize (Genie records resize_as_; only that one is accounted)",
    "set": "points a tensor at another storage",
    "_backward": "runs autograd on the server",
    "_foobar": "a test op",
    "_spsolve": "sparse", "_spdiags": "sparse", "hspmm": "sparse", "sspaddmm": "sparse",
    "smm": "sparse", "_rowwise_prune": "sparse",
    "set_": "points a tensor at another storage",
    "set_data": "swaps a tensor's storage",
    "_efficientzerotensor": "a tensor without storage (ZeroTensor)",
    "from_file": "reads a file", "save": "writes a file", "load": "reads a file",
    "_print": "writes to the server's stdout",
    "_fused_sdp_choice": "probes the server's kernels",
    "manual_seed": "process random state", "seed": "process random state",
    "initial_seed": "process random state", "get_rng_state": "process random state",
    "set_rng_state": "process random state",
    "pin_memory": "page-locked host memory, outside the device quota",
    "_pin_memory": "page-locked host memory, outside the device quota",
    "is_pinned": "queries the host allocator",
    "record_stream": "stream state",
    "_index_put_impl_": "its unsafe flag skips index checks",
    "_copy_from_and_resize": "resizes outside the accounting rule",
    "_resize_output_": "resizes outside the accounting rule",
    "lift": "no use in a tape",
}

#: Refused by a pattern of the base name, each with its reason (reviewed: see the module doc).
REFUSED_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"_reshape_alias", "a view with client-chosen strides and no storage bounds check"),
    (r"batch_dim|_fw_primal|_make_dual|_unpack_dual", "autograd/functorch wrappers"),
    (r"unsafe", "unchecked by name (only _unsafe_view, a checked view, is admitted)"),
    (r"sparse|_coo|coo_|csr|csc|bsr|bsc|to_dense|_to_cpu|coalesce|_nnz|_dimI|_dimV|"
     r"dense_dim|^(_?indices|_?values|c?col_indices|crow_indices|row_indices)(_copy)?$",
     "sparse layouts (constructors take unchecked indices)"),
    (r"quantiz|^q_|qscheme|qparams|int_repr|_per_tensor|_per_channel|fbgemm|_make_per|"
     r"_saturate_weight|_weight_int|_convert_weight|_fused_moving_avg|"
     r"_dyn_quant|prepack",
     "quantized tensors"),
    (r"nested|jagged|padded_tensor", "nested tensors"),
    (r"mkldnn|onednn|mkl_|mps|cudnn|miopen|vulkan|xnnpack|nnpack|cufft|_cslt|cutlass|"
     r"^_cuda|cuda_|^_triton|_mixed_dtypes|_scaled_mm|_scaled_grouped_mm|_int_mm",
     "backend-private layouts and kernels"),
    (r"^_test_|^_debug_|_assert_|^_functional_assert", "test and debugging ops"),
    (r"^_set_|^set_|_rng_state|^seed$", "process state"),
)
_REFUSED_RE = [(re.compile(p), why) for p, why in REFUSED_PATTERNS]
_ADMITTED_BY_NAME = frozenset({"_unsafe_view"})


def refusal(op: torch._ops.OpOverload) -> str | None:
    """Why the rule refuses ``op`` (None: the rule admits it). The rule itself, as code."""
    s = op._schema
    ns, _, base = s.name.partition("::")
    if ns != "aten":
        return f"namespace {ns!r}: only aten ops run on a server"
    if base in REFUSED_NAMES:
        return REFUSED_NAMES[base]
    if base not in _ADMITTED_BY_NAME:
        for pat, why in _REFUSED_RE:
            if pat.search(base):
                return why
    for a in s.arguments:
        t = str(a.real_type)
        if t in ("str", "Optional[str]"):
            if a.name not in STR_ENUMS:
                return f"takes a string argument {a.name!r} (a path or free text)"
        elif t not in ARG_TYPES:
            return f"takes an argument {a.name!r} of type {t}"
        if a.name == "unsafe":
            return "has an 'unsafe' flag"
    for r in s.returns:
        t = str(r.real_type)
        if t not in RETURN_TYPES:
            return f"returns a {t}"
    return None


def all_aten_overloads() -> list[torch._ops.OpOverload]:
    """Every aten overload registered with the dispatcher of the installed PyTorch."""
    ops = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[len("aten::"):].partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, base), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if isinstance(op, torch._ops.OpOverload):
            ops.append(op)
    return ops


def op_name(op: torch._ops.OpOverload) -> str:
    s = op._schema
    return f"{s.name}.{s.overload_name or 'default'}"


def derive() -> list[str]:
    """The names the rule admits in the installed PyTorch, sorted (what the data file holds)."""
    return sorted({op_name(op) for op in all_aten_overloads() if refusal(op) is None})


@functools.cache
def checked_in() -> frozenset[str]:
    """The reviewed list (``allowlist.txt``)."""
    lines = LIST_FILE.read_text().splitlines()
    return frozenset(ln.strip() for ln in lines if ln.strip() and not ln.startswith("#"))


#: ops a server admits beyond the list: only the test kernels of a worker started with
#: ``GENIE_SERVER_TEST_KERNELS=1`` (:func:`genie.remote.worker.register_test_kernels`)
TEST_OPS: set[str] = set()

#: Genie's own ops a server runs: ``genie::graph``, a compiled graph the client sends as data
#: (each op of the graph must itself be admitted here: checked when the graph arrives,
#: :meth:`genie.remote.worker.Worker._add_graphs`)
GENIE_OPS = frozenset({"genie::graph.default"})


def admitted(name: str) -> bool:
    """Whether the server runs the op named ``name`` (``aten::mm.default``): listed, and the
    rule still admits it in this PyTorch."""
    if name in TEST_OPS or name in GENIE_OPS:
        return True
    if name not in checked_in():
        return False
    return _rule_admits(name)


@functools.cache
def _rule_admits(name: str) -> bool:
    base, _, overload = name.removeprefix("aten::").partition(".")
    try:
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
    except (AttributeError, RuntimeError):
        return False
    return isinstance(op, torch._ops.OpOverload) and refusal(op) is None


def why_refused(name: str) -> str:
    """A sentence for an error message: why ``name`` does not run on a server."""
    base, _, overload = name.removeprefix("aten::").partition(".")
    try:
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
    except (AttributeError, RuntimeError):
        op = None
    reason = refusal(op) if isinstance(op, torch._ops.OpOverload) else None
    if reason is None:
        reason = ("not in the reviewed list genie/remote/allowlist.txt (new in this PyTorch? "
                  "regenerate and review it: python -m genie.remote.allowlist)")
    return reason


def render(names: list[str]) -> str:
    head = [f"# Genie server op allowlist: rule version {RULE_VERSION}, PyTorch "
            f"{torch.__version__}, {len(names)} overloads.",
            "# Generated by `python -m genie.remote.allowlist` from the rule in allowlist.py;",
            "# review every added line before committing (tests/unit/test_allowlist.py)."]
    return "\n".join(head + names) + "\n"


def main() -> None:
    import sys

    sys.stdout.write(render(derive()))


if __name__ == "__main__":
    main()

