"""OpInfo conformance: PyTorch's op database, eagerly on the CPU against ``remote_accelerator``.

Eager is the oracle. For each op of ``op_db`` (float32) and each of its sample inputs, the same
call runs eagerly on CPU copies of the sample and on ``remote_accelerator`` copies (every tensor
in input, args and kwargs moved with ``.to("remote_accelerator")``; a ``cpu`` device argument
becomes ``remote_accelerator``). One test per ``(op, variant)``:

- ``out``: the function variant, then its ``error_inputs``;
- ``inplace``: ``op.inplace_variant`` when the op has one;
- ``grad``: for ``op.supports_autograd``, ``torch.autograd.grad`` of the outputs that require
  grad against a fixed random cotangent, on both; the input gradients are compared.

What "conforms" means, per output tensor (see docs/conformance.md):

- same pytree structure, shape, dtype and device kind (``cpu`` -> ``remote_accelerator``);
- strides equal to eager's on every dimension of size > 1 (strides of size-1 dims and of empty
  tensors are not defined the same by eager kernels and meta kernels, so they are not compared),
  on the LazyTensor's recorded metadata and, for dense outputs, on the materialized value. Where
  PyTorch's own meta kernel gives the same call a different layout than its CPU kernel (LAPACK's
  column-major results, FFT layouts), the layout is a kernel detail, not part of the op's
  contract: an output that reports exactly the meta layout is noted (in the pass-rate report and
  docs/conformance.md), not failed;
- values equal within ``torch.testing.assert_close``'s float32 tolerances (NaN == NaN);
- aliasing as eager: an output shares storage with exactly the inputs whose storage the eager
  output shares (views are views, fresh results are fresh), an in-place op returns its input
  object, and every input (mutated or not) ends with eager's values;
- an error raised eagerly is raised on the device too, with the same exception type (at the call
  or when the outputs are materialized; never Genie's UnsupportedOpError).

Random ops (any ATen op the eager call dispatches is tagged ``nondeterministic_seeded``) and ops
whose outputs OpInfo marks "not comparable" (``empty*``: uninitialized memory) are compared on
structure, shapes, dtypes and strides only; random ops must also give the same values twice under
the same ``torch.manual_seed`` on the device (Genie's per-op (seed, offset) contract).

A curated fast subset runs by default; ``GENIE_FULL_OPINFO=1`` runs the whole database.
Known failures live in one table, ``expected_failures.py``, marked ``xfail(strict=True)``.
The pass rate is printed at the end of the run (``conftest.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.testing._internal import common_methods_invocations as _cmi
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import genie

from .expected_failures import EXPECTED_FAILURES

DEVICE = "remote_accelerator"
DTYPE = torch.float32
FULL = os.environ.get("GENIE_FULL_OPINFO", "0") == "1"
# Per-test wall-clock limit (seconds), so that one pathological op cannot stall a full run.
TIMEOUT_S = float(os.environ.get("GENIE_OPINFO_TIMEOUT", "600"))
VARIANTS = ("out", "inplace", "grad")

# The default (CI) subset: representative of what models use, cheap enough for a 2-core machine.
FAST_OPS = frozenset({
    # elementwise, unary and binary (incl. type promotion and broadcasting)
    "abs", "add", "sub", "mul", "div.no_rounding_mode", "div.floor_rounding", "pow", "exp",
    "log", "sqrt", "rsqrt", "sigmoid", "tanh", "sin", "neg", "clamp", "maximum", "lerp",
    "addcmul", "nan_to_num", "round", "eq", "lt", "logical_and", "isnan", "fmod", "erf",
    "where", "masked_fill",
    # activations and losses
    "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.leaky_relu",
    "nn.functional.softplus", "nn.functional.hardtanh", "nn.functional.cross_entropy",
    "nn.functional.mse_loss", "nn.functional.nll_loss",
    # reductions, scans, sorting
    "sum", "mean", "prod", "amax", "argmax", "max.reduction_with_dim", "std", "var_mean",
    "logsumexp", "all", "cumsum", "linalg.vector_norm", "topk", "sort",
    # matmul, linear, conv, pooling, attention
    "mm", "bmm", "matmul", "addmm", "baddbmm", "einsum", "outer", "nn.functional.linear",
    "nn.functional.conv2d", "nn.functional.adaptive_max_pool2d", "nn.functional.avg_pool2d",
    "nn.functional.adaptive_avg_pool2d", "nn.functional.scaled_dot_product_attention",
    # normalization
    "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.batch_norm",
    "nn.functional.group_norm", "nn.functional.rms_norm",
    # indexing, gather/scatter, data-dependent shapes
    "gather", "scatter", "scatter_add", "scatter_reduce.sum", "index_select", "index_add",
    "index_copy", "index_put", "__getitem__", "take_along_dim", "masked_select", "nonzero",
    "nn.functional.embedding",
    # views and layout
    "view", "reshape", "permute", "transpose", "t", "expand", "squeeze", "unsqueeze", "narrow",
    "select", "split", "chunk", "unbind", "diagonal", "as_strided", "flatten", "movedim",
    "contiguous", "clone", "flip", "roll", "repeat", "tril", "nn.functional.pad.constant",
    # joining
    "cat", "stack",
    # factories, conversions, fills, random
    "zeros_like", "full", "arange", "new_zeros", "to", "fill", "zero_", "empty", "randn",
    "nn.functional.dropout",
    # multi-tensor (what optimizers and clip_grad_norm_ call on LazyTensors)
    "_foreach_add", "_foreach_sub", "_foreach_mul", "_foreach_div", "_foreach_addcdiv",
    "_foreach_addcmul", "_foreach_lerp", "_foreach_sqrt", "_foreach_neg", "_foreach_maximum",
    "_foreach_pow", "_foreach_norm", "_foreach_max", "_foreach_copy", "_foreach_zero",
})


# op_db and the _foreach_* OpInfos, which PyTorch keeps in databases of their own
op_db = _cmi.op_db + [op for name in ("foreach_unary_op_db", "foreach_binary_op_db",
                                      "foreach_pointwise_op_db", "foreach_reduce_op_db",
                                      "foreach_other_op_db")
                      for op in getattr(_cmi, name, ())]


def op_name(op: Any) -> str:
    """OpInfo's name plus its variant test name: ``div.trunc_rounding``."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _variants(op: Any) -> list[str]:
    return ["out"] + (["inplace"] if op.inplace_variant is not None else []) + \
        (["grad"] if op.supports_autograd else [])


def _params() -> Iterator[Any]:
    for op in op_db:
        name = op_name(op)
        if not FULL and name not in FAST_OPS:
            continue
        no_f32 = DTYPE not in op.supported_dtypes("cpu")
        for variant in _variants(op):
            marks = []
            if no_f32:
                marks.append(pytest.mark.skip(reason="op does not support float32 on the CPU"))
            reason = EXPECTED_FAILURES.get((name, variant))
            if reason is not None:
                marks.append(pytest.mark.xfail(reason=reason, strict=True))
            yield pytest.param(op, variant, id=f"{name}-{variant}", marks=marks)


# --- moving samples ---------------------------------------------------------------------------

def _copy_sample(sample: Any, fn: Any, device: Any = None) -> tuple:
    """``(input, args, kwargs)`` with each CPU tensor mapped by ``fn`` and, when ``device`` is
    given, each ``cpu`` device argument replaced by it. Aliasing is kept: one tensor, one copy."""
    memo: dict[int, Any] = {}

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":  # error inputs may hold meta
            if id(x) not in memo:
                memo[id(x)] = fn(x)
            return memo[id(x)]
        if device is not None and (isinstance(x, torch.device) and x.type == "cpu" or
                                   isinstance(x, str) and x == "cpu"):
            return device if isinstance(x, torch.device) else str(device)
        return x

    return pytree.tree_map(leaf, (sample.input, sample.args, sample.kwargs))


def _eager_copy(sample: Any, requires_grad: bool = False) -> tuple:
    # clone() lays a copy out exactly as .to(device) does (preserve_format), so both sides see
    # the same strides.
    def f(t: torch.Tensor) -> torch.Tensor:
        c = t.detach().clone()
        return c.requires_grad_(t.requires_grad) if requires_grad else c
    return _copy_sample(sample, f)


def _device_copy(sample: Any, requires_grad: bool = False) -> tuple:
    def f(t: torch.Tensor) -> torch.Tensor:
        d = t.detach().to(DEVICE)
        return d.requires_grad_(t.requires_grad) if requires_grad else d
    return _copy_sample(sample, f, torch.device(DEVICE))


def _meta_copy(sample: Any, requires_grad: bool = False) -> tuple:
    def f(t: torch.Tensor) -> torch.Tensor:
        m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return m.requires_grad_(t.requires_grad) if requires_grad else m
    return _copy_sample(sample, f, torch.device("meta"))


def _uses_device(sample: Any) -> bool:
    return any(isinstance(x, (torch.Tensor, torch.device)) or isinstance(x, str) and x == "cpu"
               for x in pytree.tree_leaves((sample.input, sample.args, sample.kwargs)))


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


# --- what the eager call did ------------------------------------------------------------------

class _Tags(TorchDispatchMode):
    """Notes whether any dispatched ATen op is random (``Tag.nondeterministic_seeded``)."""

    def __init__(self) -> None:
        super().__init__()
        self.random = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random = True
        return func(*args, **(kwargs or {}))


def _not_comparable(op: Any) -> bool:
    """OpInfo marks the op's outputs as not comparable (``empty*``: uninitialized memory)."""
    for d in op.decorators:
        if getattr(d, "cls_name", None) not in ("TestCommon", "TestCompositeCompliance"):
            continue
        for dec in getattr(d, "decorators", ()):
            for cell in getattr(dec, "__closure__", None) or ():
                try:
                    v = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(v, str) and v.endswith("is not comparable"):
                    return True
    return False


def _run(fn: Any, tree: tuple, random: bool = False) -> tuple[Any, BaseException | None, bool]:
    """``fn(input, *args, **kwargs)`` -> (result, exception, dispatched a random op)."""
    inp, args, kwargs = tree
    mode = _Tags()
    try:
        with mode:
            return fn(inp, *args, **kwargs), None, mode.random
    except Exception as e:  # noqa: BLE001 - eager's error is part of what we compare
        return None, e, mode.random


# --- comparison -------------------------------------------------------------------------------

def _materialize(tree: Any) -> None:
    lazies = [t.detach() for t in _tensor_leaves(tree) if isinstance(t, genie.LazyTensor)]
    if lazies:
        genie.materialize(*lazies)


def _expect_same_error(eager: BaseException, run_device: Any) -> None:
    """The device raises eager's exception type, at the call or at materialization."""
    try:
        _materialize(run_device())
    except Exception as e:  # noqa: BLE001
        if isinstance(e, type(eager)) and not isinstance(e, genie.UnsupportedOpError):
            return
        raise AssertionError(f"eager raised {type(eager).__name__}: {eager}\n"
                             f"device raised {type(e).__name__}: {e}") from e
    raise AssertionError(f"eager raised {type(eager).__name__}: {eager}\ndevice raised nothing")


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides on every dimension where a stride means something (size > 1)."""
    if b.layout != torch.strided or b.numel() <= 1:
        return True
    return all(n <= 1 or a.stride(d) == b.stride(d) for d, n in enumerate(b.shape))


def _check_strides(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert _same_strides(got, want), (
        f"{what}: stride {got.stride()} != eager's {want.stride()} (shape {tuple(want.shape)})")


class MetaReference:
    """PyTorch's own meta kernels on the same call, computed only when strides disagree.

    Where the meta kernel's output layout differs from the CPU kernel's, the layout is not defined
    the same by PyTorch itself (a kernel detail: LAPACK's column-major results, FFT layouts), and a
    LazyTensor reports the meta layout; such outputs are noted, not failed. ``run`` returns the
    flat outputs of the call on meta tensors, or None when the call cannot run on meta.
    """

    def __init__(self, run: Any) -> None:
        self._run = run
        self._flat: list[Any] | None = None
        self._done = False
        self.deviations: list[str] = []

    def explains(self, i: int, got: torch.Tensor) -> bool:
        if not self._done:
            self._done = True
            try:
                out = self._run()
                self._flat = None if out is None else pytree.tree_leaves(out)
            except Exception:  # noqa: BLE001 - data-dependent ops cannot run on meta
                self._flat = None
        flat = self._flat
        if flat is None or i >= len(flat) or not isinstance(flat[i], torch.Tensor):
            return False
        m = flat[i]
        return tuple(m.shape) == tuple(got.shape) and _same_strides(got, m)


def _same_scalar(a: Any, e: Any) -> bool:
    if isinstance(e, float) and isinstance(a, float) and e != e:
        return a != a
    return type(a) is type(e) and a == e


def compare(actual: Any, expected: Any, *, values: bool, what: str,
            dev_inputs: list[torch.Tensor] = (), cpu_inputs: list[torch.Tensor] = (),
            meta: MetaReference | None = None) -> None:
    """Assert ``actual`` (device) conforms to ``expected`` (eager), as the module doc says."""
    a_flat, a_spec = pytree.tree_flatten(actual)
    e_flat, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"{what}: structure {a_spec} != eager's {e_spec}"
    for i, (a, e) in enumerate(zip(a_flat, e_flat, strict=True)):
        w = f"{what}[{i}]"
        if not isinstance(e, torch.Tensor):
            assert not isinstance(a, torch.Tensor), f"{w}: a tensor where eager has {e!r}"
            if values:
                assert _same_scalar(a, e), f"{w}: {a!r} != eager's {e!r}"
            continue
        assert isinstance(a, torch.Tensor), f"{w}: {a!r} where eager has a tensor"
        want_dev = DEVICE if e.device.type == "cpu" else e.device.type
        assert a.device.type == want_dev, f"{w}: on {a.device}, expected {want_dev}"
        assert a.shape == e.shape, f"{w}: shape {tuple(a.shape)} != eager's {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"{w}: dtype {a.dtype} != eager's {e.dtype}"
        assert a.layout == e.layout, f"{w}: layout {a.layout} != eager's {e.layout}"
        if e.layout != torch.strided:  # sparse results: no strides or storage; compare densely
            if values:
                torch.testing.assert_close(a.detach().cpu().to_dense(), e.detach().to_dense(),
                                           equal_nan=True, msg=lambda m, w=w: f"{w}: {m}")
            continue
        meta_layout = False
        if not _same_strides(a, e):
            if meta is None or not meta.explains(i, a):
                _check_strides(a, e, f"{w} (recorded)")
            meta.deviations.append(f"{w}: {tuple(a.stride())} (meta) vs {tuple(e.stride())}")
            meta_layout = True
        if cpu_inputs and e.numel() > 0:
            _check_aliasing(a, e, dev_inputs, cpu_inputs, w)
        got = a.detach().cpu()
        if torch._prims_common.is_non_overlapping_and_dense_or_false(e) and not (
                meta_layout and _same_strides(got, a)):  # the value has the layout it reports
            _check_strides(got, e, f"{w} (materialized)")
        if values:
            torch.testing.assert_close(got, e.detach(), equal_nan=True, check_device=False,
                                       msg=lambda m, w=w: f"{w}: {m}")


def _check_aliasing(a: torch.Tensor, e: torch.Tensor, dev_inputs: list[torch.Tensor],
                    cpu_inputs: list[torch.Tensor], what: str) -> None:
    if not isinstance(a, genie.LazyTensor):
        return
    ptr = e.untyped_storage().data_ptr()
    want = [j for j, t in enumerate(cpu_inputs) if t.numel() > 0 and t.layout == torch.strided
            and t.untyped_storage().data_ptr() == ptr]
    got = [j for j, t in enumerate(dev_inputs)
           if isinstance(t, genie.LazyTensor) and t.numel() > 0 and t._storage is a._storage]
    assert got == want, (f"{what}: shares storage with inputs {got}, eager's output with {want} "
                         "(a view must alias its base, a fresh result must not)")
    # and the wrappers say so, as eager's tensors do (csrc/storage.cpp): the same storage object
    # and address for an alias, another for a fresh result
    ptr = a.untyped_storage().data_ptr()
    by_ptr = [j for j, t in enumerate(dev_inputs)
              if isinstance(t, genie.LazyTensor) and t.numel() > 0
              and t.untyped_storage().data_ptr() == ptr]
    assert by_ptr == want, f"{what}: data_ptr aliases inputs {by_ptr}, eager's {want}"


# --- the three variants -----------------------------------------------------------------------

def _call(fn: Any, tree: tuple, seed: int | None = None) -> Any:
    """``fn(input, *args, **kwargs)`` on a copied sample, under ``torch.manual_seed(seed)``."""
    if seed is not None:
        torch.manual_seed(seed)
    return fn(tree[0], *tree[1], **tree[2])


def check_forward(op: Any, inplace: bool, deviations: list[str]) -> int:
    """Run every float32 sample of ``op`` (or its in-place variant); returns samples tried.

    Outputs whose strides differ from eager's only as PyTorch's meta kernels do are appended to
    ``deviations``.
    """
    fn = op.inplace_variant if inplace else op.op
    not_comparable = _not_comparable(op)
    tried = 0
    for k, sample in enumerate(op.sample_inputs("cpu", DTYPE, requires_grad=False)):
        what = f"{'inplace' if inplace else 'out'} sample {k} ({sample.summary()[:300]})"
        if not _uses_device(sample):
            continue  # no tensor, no device argument: the call never reaches the device
        cpu, dev = _eager_copy(sample), _device_copy(sample)
        torch.manual_seed(k)
        expected, err, random = _run(fn, cpu)
        tried += 1
        if err is not None:
            _expect_same_error(err, functools.partial(_call, fn, dev))
            continue
        actual = _call(fn, dev, seed=k)
        values = not (random or not_comparable)
        cpu_in, dev_in = _tensor_leaves(cpu), _tensor_leaves(dev)
        meta = MetaReference(functools.partial(_call, fn, _meta_copy(sample), k))
        compare(actual, expected, values=values, what=what, dev_inputs=dev_in, cpu_inputs=cpu_in,
                meta=meta)
        deviations.extend(meta.deviations)
        if inplace:
            assert (actual is dev[0]) == (expected is cpu[0]), \
                f"{what}: in-place result is{'' if actual is dev[0] else ' not'} its input"
        compare(dev_in, cpu_in, values=values, what=f"{what} inputs after the call")
        if random and not not_comparable:
            _check_reproducible(fn, sample, actual, k, what)
    if not inplace:
        tried += _check_error_inputs(op)
    return tried


def _check_reproducible(fn: Any, sample: Any, first: Any, seed: int, what: str) -> None:
    """The same seed gives the same values on the device (random ops)."""
    again = _call(fn, _device_copy(sample), seed=seed)
    a = [t.detach().cpu() for t in _tensor_leaves(first)]
    b = [t.detach().cpu() for t in _tensor_leaves(again)]
    assert len(a) == len(b), f"{what}: {len(b)} outputs the second time, {len(a)} the first"
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, equal_nan=True, rtol=0, atol=0,
                                   msg=lambda m: f"{what}: not reproducible under "
                                                 f"torch.manual_seed: {m}")


def _check_error_inputs(op: Any) -> int:
    """OpInfo's error inputs: where eager raises, the device raises the same type."""
    if op.error_inputs_func is None:
        return 0
    tried = 0
    try:
        errors = list(op.error_inputs("cpu"))
    except Exception:  # noqa: BLE001 - a generator that cannot build its inputs on this torch
        return 0
    for ei in errors:
        s = ei.sample_input
        _, err, _ = _run(op.op, _eager_copy(s))
        if err is None:
            continue  # this torch build accepts it eagerly: nothing to compare
        tried += 1
        _expect_same_error(err, functools.partial(_call, op.op, _device_copy(s)))
    return tried


def _grad_fn(op: Any, sample: Any, inp: Any, *args: Any, **kwargs: Any) -> Any:
    return sample.output_process_fn_grad(op.gradcheck_wrapper(op.get_op(), inp, *args, **kwargs))


def _vjp(fn: Any, tree: tuple, seed: int, mask: list[bool], cots: list[torch.Tensor]) -> list:
    """Input gradients of ``fn`` on ``tree`` against the cotangents of the ``mask``ed outputs."""
    flat = pytree.tree_leaves(_call(fn, tree, seed))
    outs = [o for o, m in zip(flat, mask, strict=True) if m]
    ins = [t for t in _tensor_leaves(tree) if t.requires_grad]
    dev = outs[0].device
    return list(torch.autograd.grad(outs, ins, [c.to(dev) for c in cots], allow_unused=True))


def check_grad(op: Any, deviations: list[str]) -> int:
    """Compare input gradients (VJP with a fixed random cotangent); returns samples tried."""
    not_comparable = _not_comparable(op)
    tried = 0
    for k, sample in enumerate(op.sample_inputs("cpu", DTYPE, requires_grad=True)):
        what = f"grad sample {k} ({sample.summary()[:300]})"
        fn = functools.partial(_grad_fn, op, sample)
        cpu, dev = _eager_copy(sample, True), _device_copy(sample, True)
        torch.manual_seed(k)
        e_out, err, random = _run(fn, cpu)
        if err is not None:
            tried += 1
            _expect_same_error(err, functools.partial(_call, fn, dev))
            continue
        e_flat = pytree.tree_leaves(e_out)
        mask = [isinstance(o, torch.Tensor) and o.requires_grad for o in e_flat]
        e_outs = [o for o, m in zip(e_flat, mask, strict=True) if m]
        e_ins = [t for t in _tensor_leaves(cpu) if t.requires_grad]
        if not e_outs or not e_ins:
            continue
        tried += 1
        d_flat = pytree.tree_leaves(_call(fn, dev, seed=k))
        assert len(d_flat) == len(e_flat), f"{what}: {len(d_flat)} outputs, eager {len(e_flat)}"
        for o, m in zip(d_flat, mask, strict=True):
            assert not m or isinstance(o, torch.Tensor) and o.requires_grad, \
                f"{what}: an output that requires grad eagerly does not on the device"
        gen = torch.Generator().manual_seed(1000 + k)
        cots = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in e_outs]
        try:
            e_grads = torch.autograd.grad(e_outs, e_ins, cots, allow_unused=True)
        except Exception as e:  # noqa: BLE001
            _expect_same_error(e, functools.partial(_vjp, fn, dev, k, mask, cots))
            continue
        d_grads = _vjp(fn, dev, k, mask, cots)
        meta = MetaReference(functools.partial(_vjp, fn, _meta_copy(sample, True), k, mask, cots))
        compare(d_grads, list(e_grads), values=not (random or not_comparable),
                what=f"{what} input grads", meta=meta)
        deviations.extend(meta.deviations)
    return tried


# --- the tests --------------------------------------------------------------------------------

@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise TimeoutError(f"test took longer than {seconds:.0f} s (GENIE_OPINFO_TIMEOUT)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize(("op", "variant"), list(_params()))
def test_opinfo(op: Any, variant: str, request: pytest.FixtureRequest) -> None:
    request.node.user_properties.append(("opinfo", (op_name(op), variant)))
    deviations: list[str] = []
    request.node.user_properties.append(("meta_strides", deviations))
    with _deadline(TIMEOUT_S):
        tried = (check_grad(op, deviations) if variant == "grad" else
                 check_forward(op, variant == "inplace", deviations))
    if tried == 0:
        pytest.skip("no float32 sample to try")


def test_expected_failures_name_real_tests() -> None:
    """Every table entry names an op and variant that exist, with a reason."""
    known = {(op_name(op), v) for op in op_db for v in _variants(op)}
    for key, reason in EXPECTED_FAILURES.items():
        assert key in known, f"expected_failures.py: {key} is not an (op, variant) of op_db"
        assert key[1] in VARIANTS and len(reason.strip()) > 15, f"{key}: give a real reason"


def test_fast_subset_names_exist() -> None:
    missing = FAST_OPS - {op_name(op) for op in op_db}
    assert not missing, f"FAST_OPS names not in op_db: {sorted(missing)}"
