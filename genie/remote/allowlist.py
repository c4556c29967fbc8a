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
RULE_VERSION = 2
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

#: The server's opset beyond Core ATen: ops kept whole because a client needs them (what Genie's
#: client sends for the model suite, autograd's backward kernels of admitted ops that have no
#: decomposition, optimizers, fused kernels worth a round of review), by base name (an in-place
#: ``x_`` and the ``out=`` overloads share ``x``'s kernels and checks), each group with its
#: reason. Everything else the schema rule admits is *not* run by a server: Genie's client
#: decomposes it into ops that are (:mod:`genie.remote.decompose`, ``torch._decomp``) before
#: sending, or refuses it at the materialization with the op's name. A private ``_`` op is here
#: only when reviewed. Adding an op: add it to a group, regenerate ``allowlist.txt``, and run the
#: per-op fuzzer (``tests/integration/test_opset_fuzz.py``) on it.
REVIEWED_GROUPS: dict[str, tuple[str, ...]] = {
    "a view or alias (metadata only; every view is bounded against its storage on meta first)": (
        "t", "transpose", "_unsafe_view", "detach", "lift_fresh", "split", "unbind", "unfold",
        "view_as_real", "view_as_complex", "_conj", "_neg_view", "resolve_conj", "resolve_neg",
        "conj_physical", "narrow", "movedim", "swapaxes", "chunk", "split_with_sizes_copy",
        "expand_as", "view_as", "reshape", "flatten", "unflatten", "squeeze_copy", "real", "imag",
    ),
    "a factory (the quota accounts its output before it runs; random ops take the tape's seed)": (
        "zeros", "ones", "zeros_like", "ones_like", "empty_like", "new_ones", "new_zeros",
        "new_empty", "new_full", "new_empty_strided", "eye", "linspace", "logspace",
        "tril_indices", "triu_indices", "randint", "randint_like", "rand_like", "randn_like",
        "normal", "bernoulli", "uniform", "random", "exponential", "multinomial", "zero",
        "empty_permuted", "full", "scalar_tensor", "rrelu_with_noise",
    ),
    "a backward kernel of an admitted op, as autograd emits it (no decomposition)": (
        "_log_softmax_backward_data", "_softmax_backward_data", "gelu_backward",
        "hardtanh_backward", "leaky_relu_backward", "mse_loss_backward",
        "native_batch_norm_backward", "native_dropout_backward", "nll_loss_backward",
        "nll_loss2d_backward", "select_backward", "slice_backward", "diagonal_backward",
        "sigmoid_backward", "softplus_backward", "tanh_backward", "threshold_backward",
        "adaptive_max_pool2d_backward", "silu_backward", "elu_backward",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_flash_attention_backward", "max_pool3d_with_indices_backward",
        "avg_pool3d_backward", "upsample_nearest2d_backward", "upsample_bilinear2d_backward",
        "reflection_pad1d_backward", "reflection_pad2d_backward", "replication_pad2d_backward",
        "grid_sampler_2d_backward", "log_sigmoid_backward", "smooth_l1_loss_backward",
        "huber_loss_backward", "binary_cross_entropy_backward", "index_select_backward",
        "glu_backward", "mish_backward", "hardswish_backward", "hardsigmoid_backward",
        "cumprod_backward", "_cdist_backward", "_pdist_backward", "hardshrink_backward",
        "softshrink_backward", "logit_backward", "adaptive_max_pool3d_backward",
        "upsample_bicubic2d_backward", "upsample_linear1d_backward",
        "upsample_nearest1d_backward", "upsample_nearest3d_backward",
        "upsample_trilinear3d_backward", "_upsample_nearest_exact1d_backward",
        "_upsample_nearest_exact2d_backward", "_upsample_nearest_exact3d_backward",
        "replication_pad1d_backward", "replication_pad3d_backward", "grid_sampler_3d_backward",
        "masked_scatter_backward", "rrelu_with_noise_backward", "multi_margin_loss_backward",
        "batch_norm_backward",
    ),
    "a fused kernel worth keeping whole (one kernel instead of its decomposition)": (
        "linear", "matmul", "_safe_softmax", "_transformer_encoder_layer_fwd",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention", "native_batch_norm", "mse_loss",
        "nll_loss_forward", "nll_loss2d_forward", "silu", "mish", "softplus", "logsumexp",
        "linalg_vector_norm", "addcmul", "addcdiv", "baddbmm", "addbmm", "addmv", "addr",
        "lerp", "dot", "vdot", "mv", "cumprod", "std", "std_mean", "var_mean", "nan_to_num",
        "masked_fill", "index_add", "index_copy", "index_fill", "isin", "roll", "rsub", "sgn",
        "tril", "triu", "stack", "hstack", "vstack", "all", "glu", "hardswish", "hardsigmoid",
        "log_sigmoid_forward", "binary_cross_entropy", "binary_cross_entropy_with_logits",
        "smooth_l1_loss", "huber_loss", "_fused_rms_norm", "clamp_min", "clamp_max", "xlogy",
        "erfinv", "lgamma", "digamma", "frac", "logit", "hypot", "logaddexp", "copysign",
        "floor_divide", "bitwise_left_shift", "bitwise_right_shift", "heaviside", "fmin",
        "fmax", "signbit", "isfinite", "isneginf", "isposinf", "angle", "complex", "polar",
        "cross", "outer", "kron", "diag_embed", "masked_select", "count_nonzero",
        "adaptive_max_pool2d", "embedding_renorm", "_native_multi_head_attention",
        "_masked_softmax",
    ),
    "an elementwise kernel with no decomposition (shapes and dtypes checked on meta)": (
        "erfc", "exp2", "i0", "igamma", "igammac", "lcm", "gcd", "ldexp", "nextafter",
        "polygamma", "frexp", "__lshift__", "__rshift__", "__ilshift__", "__irshift__",
        "softmax", "log_softmax", "special_airy_ai", "special_bessel_j0", "special_bessel_j1",
        "special_bessel_y0", "special_bessel_y1", "special_chebyshev_polynomial_t",
        "special_chebyshev_polynomial_u", "special_chebyshev_polynomial_v",
        "special_chebyshev_polynomial_w", "special_erfcx", "special_hermite_polynomial_h",
        "special_hermite_polynomial_he", "special_i0e", "special_i1", "special_i1e",
        "special_laguerre_polynomial_l", "special_legendre_polynomial_p",
        "special_modified_bessel_i0", "special_modified_bessel_i1",
        "special_modified_bessel_k0", "special_modified_bessel_k1", "special_ndtri",
        "special_scaled_modified_bessel_k0", "special_scaled_modified_bessel_k1",
        "special_shifted_chebyshev_polynomial_t", "special_shifted_chebyshev_polynomial_u",
        "special_shifted_chebyshev_polynomial_v", "special_shifted_chebyshev_polynomial_w",
        "special_spherical_bessel_j0", "special_zeta", "dist", "allclose", "equal",
    ),
    "pooling, upsampling and sampling forward kernels (sizes checked on meta)": (
        "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool3d",
        "upsample_bicubic2d", "upsample_nearest1d", "upsample_nearest3d",
        "upsample_trilinear3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
        "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
        "grid_sampler_3d", "_fft_c2c", "_logcumsumexp",
    ),
    "linear algebra (LAPACK on shapes the meta kernels check; pivot-taking solvers stay out)": (
        "cholesky", "cholesky_solve", "cholesky_inverse", "linalg_cholesky_ex",
        "linalg_inv_ex", "linalg_qr", "_linalg_svd", "_linalg_eigh", "_linalg_det",
        "_linalg_slogdet", "_linalg_solve_ex", "linalg_lu_factor_ex", "linalg_lu",
        "triangular_solve", "linalg_solve_triangular", "linalg_eig", "linalg_eigvals",
        "_linalg_eigvals", "linalg_householder_product", "geqrf", "ormqr", "linalg_lstsq",
        "linalg_matrix_exp", "linalg_pinv",
    ),
    "a copy of a view (functional views, as functionalization and export write them)": (
        "view_copy", "permute_copy", "select_copy", "slice_copy", "detach_copy", "split_copy",
        "unbind_copy", "narrow_copy", "expand_copy", "transpose_copy", "t_copy",
        "unsqueeze_copy", "diagonal_copy", "alias_copy", "view_as_real_copy",
        "view_as_complex_copy", "lift_fresh_copy",
    ),
    "a window or range factory (sizes from arguments, accounted before they run)": (
        "bartlett_window", "blackman_window", "hamming_window", "hann_window",
        "kaiser_window", "range", "fft_fftfreq", "fft_rfftfreq",
    ),
    "a random distribution (the tape's seed; sizes from its arguments)": (
        "cauchy", "geometric", "log_normal", "poisson", "binomial", "_standard_gamma",
    ),
    "a resize (growth accounted in the quota and zeroed; resize_ is Core ATen)": (
        "resize_as",
    ),
    "an optimizer step (torch.optim's foreach path; list lengths and shapes checked on meta)": (
        "_foreach_add", "_foreach_sub", "_foreach_mul", "_foreach_div", "_foreach_addcdiv",
        "_foreach_addcmul", "_foreach_lerp", "_foreach_sqrt", "_foreach_neg",
        "_foreach_maximum", "_foreach_minimum", "_foreach_pow", "_foreach_reciprocal",
        "_foreach_norm", "_foreach_clamp_max", "_foreach_clamp_min", "_foreach_copy",
        "_foreach_zero", "_foreach_abs", "_foreach_exp", "_foreach_sign", "_foreach_clone",
        "_foreach_acos", "_foreach_asin", "_foreach_atan", "_foreach_ceil", "_foreach_cos",
        "_foreach_cosh", "_foreach_erf", "_foreach_erfc", "_foreach_expm1", "_foreach_floor",
        "_foreach_frac", "_foreach_lgamma", "_foreach_log", "_foreach_log10",
        "_foreach_log1p", "_foreach_log2", "_foreach_round", "_foreach_rsqrt",
        "_foreach_sigmoid", "_foreach_sin", "_foreach_sinh", "_foreach_tan", "_foreach_tanh",
        "_foreach_trunc", "_foreach_max", "_amp_foreach_non_finite_check_and_unscale",
        "_amp_update_scale",
    ),
    "a sort, search or count whose result depends on data (no decomposition)": (
        "searchsorted", "bucketize", "_unique2", "unique_consecutive", "unique_dim", "median",
        "nanmedian", "kthvalue", "mode", "histc", "bincount", "logcumsumexp", "argsort",
        "msort", "repeat_interleave", "cummax", "cummin", "unique_dim_consecutive", "_unique",
        "index_reduce", "put", "take",
    ),
}
REVIEWED: dict[str, str] = {name: why for why, names in REVIEWED_GROUPS.items()
                            for name in names}


@functools.cache
def core_bases() -> frozenset[str]:
    """Base names of the Core ATen ops (``torch.Tag.core``) in the installed PyTorch."""
    return frozenset(op._schema.name.removeprefix("aten::") for op in all_aten_overloads()
                     if torch.Tag.core in op.tags)


def _family(base: str) -> str:
    """The op an overload's kernels belong to: ``add_`` and ``add`` share ``add``'s."""
    return base[:-1] if base.endswith("_") and not base.endswith("__") else base


@functools.cache
def _is_core(base: str) -> bool:
    """Whether an overload of ``aten::base`` is Core ATen (one op looked up, not all of them:
    a server resolves a session's first ops in microseconds)."""
    try:
        packet = getattr(torch.ops.aten, base)
    except (AttributeError, RuntimeError):
        return False
    return any(torch.Tag.core in getattr(packet, ov).tags for ov in packet.overloads())


def outside_opset(base: str) -> str | None:
    """Why the op named ``base`` (no namespace, no overload) is outside the server's opset, or
    None when it is in (Core ATen or :data:`REVIEWED`)."""
    fam = _family(base)
    if base in REVIEWED or fam in REVIEWED or _is_core(base) or _is_core(fam):
        return None
    return ("outside the server's opset (Core ATen plus the reviewed ops in genie/remote/"
            "allowlist.py): Genie's client decomposes it into ops the server runs before "
            "sending")
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
    return outside_opset(base)


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
#: :meth:`genie.remote.worker.Worker._add_graphs`), and ``genie::graph_mut``, one that writes
#: some of its inputs in place (which ones its data says; each call's written inputs checked as
#: an in-place op's: :func:`genie.graphs.check_written`, :func:`genie.remote.protocol
#: .compile_skeleton`)
GENIE_OPS = frozenset({"genie::graph.default", "genie::graph_mut.default"})


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

