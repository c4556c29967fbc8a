"""The device behaves as a PyTorch device (issue 29, families 1, 2 and 4), each case against eager.

1. Global state that decides an op's result (default dtype, deterministic algorithms, default
   device, grad and inference mode, autocast) is in the meta-cache key, and a tape runs under the
   state its ops were recorded under.
2. Checks eager does from metadata raise at the call, with eager's exception type and message
   (``out=`` dtypes, index and value shapes of ``index_put``, ``alpha`` of integral ``add``,
   ``frexp``, the matmul family's dtypes, the uint8-mask deprecation warning).
3. What the device cannot hold (sparse, quantized tensors; ``set_`` onto a storage no live tensor
   owns) is refused at the call with a message that says what to do (``set_`` onto a tensor's
   storage runs as eager's); ``abs`` of a complex tensor into a complex
   ``out=`` runs as eager runs it.

Found by PyTorch's device-generic files (tests/device_generic): ``out=`` of factories, random
ops' checks, overlapping writes, DLPack (an import of a device tensor is eager's alias),
``randperm``'s dtype bound and ``normal``'s std elements at the call.
"""

import contextlib
import inspect
import warnings

import pytest
import torch

import genie
from genie._C import _state_word
from genie.config import config

DEV = "remote_accelerator:0"


@pytest.fixture(params=["native", "python"])
def record_path(request):
    """Every family-1 case on the native record path and on Python's (GENIE_NATIVE_RECORD=0)."""
    saved = config.native_record
    config.native_record = request.param == "native"
    try:
        yield request.param
    finally:
        config.native_record = saved


@contextlib.contextmanager
def default_dtype(d):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(d)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextlib.contextmanager
def deterministic(on, fill=None):
    saved = torch.are_deterministic_algorithms_enabled()
    saved_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    saved_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(on)
    if fill is not None:
        torch.utils.deterministic.fill_uninitialized_memory = fill
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved, warn_only=saved_warn)
        torch.utils.deterministic.fill_uninitialized_memory = saved_fill


def both(fn):
    """``fn(device)`` on the CPU and on the device: (eager's, the device's downloaded)."""
    ref = fn("cpu")
    out = fn(DEV)
    return ref, (out.cpu() if isinstance(out, torch.Tensor) else out)


def same(ref, got):
    assert got.dtype == ref.dtype
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, equal_nan=True)


# --- family 1: global state in the key ----------------------------------------------------------

def test_default_dtype_is_in_the_key(record_path):
    """The issue's case: ``a / a`` of integers under float32, then float64 (values included)."""
    for first, second in ((torch.float32, torch.float64), (torch.float64, torch.float32)):
        for d in (first, second, first):
            with default_dtype(d):
                ref, got = both(lambda dev: torch.arange(1, 6, device=dev) /
                                torch.arange(1, 6, device=dev))
                a = torch.arange(1, 6, device=DEV)
                assert (a / a).dtype == ref.dtype == d
                same(ref, got)
                # an int tensor times a Python float, and a factory without dtype=
                ref, got = both(lambda dev: torch.arange(3, device=dev) * 1.5)
                same(ref, got)
                ref, got = both(lambda dev: torch.ones(2, 3, device=dev) + 1)
                same(ref, got)


def test_default_dtype_of_the_recording_decides_the_run(record_path):
    """Recorded under float64, downloaded under float32: eager's float64 values."""
    a = torch.arange(1, 6, device=DEV)
    with default_dtype(torch.float64):
        y = a / 3
        z = torch.full((2,), 1 / 3, device=DEV)
        ref_y = torch.arange(1, 6) / 3
        ref_z = torch.full((2,), 1 / 3)
    assert y.dtype == torch.float64
    same(ref_y, y.cpu())
    same(ref_z, z.cpu())


def test_several_states_in_one_run(record_path):
    """One tape whose ops were recorded under different default dtypes runs each under its own."""
    a = torch.arange(1, 6, device=DEV)
    with default_dtype(torch.float64):
        y = a / 3
    with default_dtype(torch.float32):
        z = a / 7
        w = y + z  # float64 + float32: float64
    ref = (torch.arange(1, 6).double() / 3) + (torch.arange(1, 6) / 7)
    assert w.dtype == ref.dtype
    same(ref, w.cpu())
    assert torch.get_default_dtype() == torch.float32


def test_deterministic_algorithms_are_in_the_key(record_path):
    """Under ``use_deterministic_algorithms(True)`` (fill_uninitialized_memory on), eager fills
    new empty float tensors with NaN: recorded then and run after, the device does too."""
    before = _state_word()
    with deterministic(True, fill=True):
        assert _state_word() != before
        e = torch.empty(4, device=DEV)
        ref = torch.empty(4)
    assert torch.isnan(ref).all()
    assert torch.isnan(e.cpu()).all()
    with deterministic(False):
        assert torch.are_deterministic_algorithms_enabled() is False
        x = torch.ones(3, device=DEV)
        same(torch.ones(3) * 2, (x * 2).cpu())
    assert _state_word() == before


def test_default_device(record_path):
    """``torch.set_default_device`` puts factories on the device, as on the CPU."""
    torch.set_default_device(DEV)
    try:
        t = torch.ones(2, 2) * 3
        assert t.device == torch.device(DEV)
    finally:
        torch.set_default_device(None)
    same(torch.ones(2, 2) * 3, t.cpu())
    assert torch.ones(1).device.type == "cpu"


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "enable_grad"])
def test_grad_and_inference_mode(record_path, mode):
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
           "enable_grad": torch.enable_grad}[mode]
    w = torch.randn(4, 4)
    x = torch.randn(2, 4)
    lw = w.to(DEV).requires_grad_()
    lx = x.to(DEV)
    rw = w.clone().requires_grad_()
    with ctx():
        ref = torch.nn.functional.linear(x, rw).relu()
        got = torch.nn.functional.linear(lx, lw).relu()
    assert got.requires_grad == ref.requires_grad
    assert got.is_inference() == ref.is_inference()
    same(ref.detach(), got.detach().cpu())


def test_autocast_state(record_path):
    """Autocast on the device casts before the op reaches it (its input dtypes are in the key);
    a download inside the CPU's autocast runs the recorded float32 op as float32."""
    a = torch.randn(4, 4)
    b = torch.randn(4, 4)
    la, lb = a.to(DEV), b.to(DEV)
    plain = la @ lb
    with torch.autocast("remote_accelerator", dtype=torch.bfloat16):
        cast = la @ lb
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_cast = a @ b
    assert plain.dtype == torch.float32
    assert cast.dtype == ref_cast.dtype == torch.bfloat16
    same(ref_cast, cast.cpu())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = plain.cpu()  # the recorded float32 mm, not the CPU's autocast of it
    same(a @ b, got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the precision flags are in the key "
                    "where the real device is CUDA")
def test_tf32_flag_is_in_the_key():
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        w0 = _state_word()
        torch.backends.cuda.matmul.allow_tf32 = True
        assert _state_word() != w0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


# --- family 2: metadata checks at the call ------------------------------------------------------

def raises_as_eager(fn, *, warns=None):
    """``fn(device)`` raises on the device what it raises on the CPU (type and message), at the
    call: the device's traceback ends in ``fn``'s own line, not at a later download."""
    with pytest.raises(Exception) as ref:
        fn("cpu")
    with pytest.raises(Exception) as got:
        fn(DEV)
    assert type(got.value) is type(ref.value), (got.value, ref.value)
    assert str(got.value) == str(ref.value)
    assert not isinstance(got.value, genie.errors.ExecutionError)
    frames = [f for f in inspect.getinnerframes(got.tb) if f.filename == __file__]
    assert frames and frames[-1].function == fn.__name__
    return got.value


def test_out_of_the_wrong_dtype():
    def neg_out(d):
        torch.neg(torch.ones(3, device=d), out=torch.empty(0, dtype=torch.float64, device=d))
    raises_as_eager(neg_out)

    def add_out(d):  # float into an int out=: eager's "can't be cast"
        torch.add(torch.ones(3, device=d), 1, out=torch.empty(3, dtype=torch.long, device=d))
    raises_as_eager(add_out)
    # out= that eager allows still records
    ref, got = both(lambda d: torch.add(torch.ones(3, device=d), 1,
                                        out=torch.empty(3, dtype=torch.float64, device=d)))
    same(ref, got)


def test_bool_mask_assignment_of_the_wrong_length():
    def assign(d):
        a = torch.arange(5.0, device=d)
        a[a > -1] = torch.tensor([1.0, 2, 3], device=d)
    raises_as_eager(assign)
    before = genie.stats().get("forced_materializations", 0)

    def right(d):
        a = torch.arange(5.0, device=d)
        a[a > 1] = torch.tensor([7.0, 8, 9], device=d)
        return a
    ref, got = both(right)
    same(ref, got)
    assert genie.stats().get("forced_materializations", 0) > before  # the mask's count

    def scalar(d):  # a single value broadcasts to any count: recorded lazily, no count needed
        a = torch.arange(5.0, device=d)
        a[a > 1] = torch.tensor(4.0, device=d)
        return a
    genie.reset_stats()
    ref, got = both(scalar)
    same(ref, got)

    def mask_shape(d):
        a = torch.arange(5.0, device=d)
        a[torch.ones(3, dtype=torch.bool, device=d)] = torch.tensor([1.0, 2, 3], device=d)
    raises_as_eager(mask_shape)


def test_index_tensors_of_mismatched_shapes():
    def assign(d):
        a = torch.zeros(3, 3, device=d)
        a[[0, 1], [0, 1, 2]] = 0
    raises_as_eager(assign)

    def value(d):
        a = torch.zeros(5, 2, device=d)
        a[torch.tensor([0, 1], device=d)] = torch.ones(3, 2, device=d)
    raises_as_eager(value)

    def many(d):
        torch.zeros(3, device=d).index_put_((torch.tensor([0], device=d),
                                             torch.tensor([0], device=d)), torch.tensor(1.0))
    raises_as_eager(many)

    def dtype(d):
        torch.zeros(3, device=d).index_put_((torch.tensor([0], device=d),),
                                            torch.tensor(1.0, dtype=torch.float64, device=d))
    raises_as_eager(dtype)

    def float_index(d):
        torch.zeros(3, device=d).index_put_((torch.tensor([0.0], device=d),),
                                            torch.tensor(1.0, device=d))
    raises_as_eager(float_index)
    ref, got = both(lambda d: torch.zeros(3, 3, device=d).index_put_(
        (torch.tensor([0, 2], device=d), torch.tensor([1, 0], device=d)),
        torch.tensor([5.0, 6.0], device=d), accumulate=True))
    same(ref, got)


def test_index_put_accumulate_on_empty_inputs():
    def scalar_input(d):  # PyTorch's test_index_put_accumulate_empty
        torch.rand([], device=d).index_put([], torch.tensor([1.0], device=d), True)
    raises_as_eager(scalar_input)

    def empty_index(d):
        torch.zeros(5, device=d).index_put_((torch.tensor([], dtype=torch.long, device=d),),
                                            torch.tensor([1.0, 2.0], device=d), accumulate=True)
    raises_as_eager(empty_index)
    ref, got = both(lambda d: torch.zeros(0, device=d).index_put_(
        (torch.tensor([], dtype=torch.long, device=d),), torch.tensor([1.0], device=d),
        accumulate=True))
    same(ref, got)


def test_add_float_alpha_with_bool_tensors():
    def add(d):
        t = torch.ones(3, dtype=torch.bool, device=d)
        torch.add(t, t, alpha=1.5)
    raises_as_eager(add)

    def add_int(d):
        t = torch.ones(3, dtype=torch.long, device=d)
        torch.add(t, t, alpha=0.5)
    raises_as_eager(add_int)
    ref, got = both(lambda d: torch.add(torch.ones(3, dtype=torch.long, device=d),
                                        torch.ones(3, dtype=torch.long, device=d), alpha=2))
    same(ref, got)


def test_frexp_argument_checks():
    def ints(d):
        torch.frexp(torch.ones(3, dtype=torch.int32, device=d))
    raises_as_eager(ints)

    def out_dtype(d):
        torch.frexp(torch.ones(3, device=d),
                    out=(torch.empty(3, device=d), torch.empty(3, device=d)))
    raises_as_eager(out_dtype)

    def mantissa_dtype(d):
        torch.frexp(torch.ones(3, device=d), out=(torch.empty(3, dtype=torch.float64, device=d),
                                                 torch.empty(3, dtype=torch.int32, device=d)))
    raises_as_eager(mantissa_dtype)
    ref = torch.frexp(torch.tensor([3.0, 0.5, -8.0]))
    got = torch.frexp(torch.tensor([3.0, 0.5, -8.0], device=DEV))
    same(ref.mantissa, got.mantissa.cpu())
    same(ref.exponent, got.exponent.cpu())


def test_uint8_mask_warns_as_eager():
    def assign(d):
        a = torch.arange(4.0, device=d)
        m = torch.tensor([1, 0, 1, 0], dtype=torch.uint8, device=d)
        a[m] = torch.tensor([7.0, 8.0], device=d)
        return a

    def read(d):
        a = torch.arange(4.0, device=d)
        return a[torch.tensor([1, 0, 1, 0], dtype=torch.uint8, device=d)]

    for fn in (assign, read):
        seen = {}
        for d in ("cpu", DEV):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                out = fn(d).cpu()
            seen[d] = (out, [(x.category, str(x.message)) for x in w])
        same(seen["cpu"][0], seen[DEV][0])
        assert seen[DEV][1] == seen["cpu"][1]
        assert any("uint8 is now deprecated" in m for _, m in seen["cpu"][1])


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("op", ["mm", "matmul", "linear", "bmm", "addmm"])
def test_matmul_family_dtypes_raise_at_the_call(op, grad):
    def call(d):
        a = torch.ones(2, 2, device=d, requires_grad=grad)
        b = torch.ones(2, 2, dtype=torch.float64, device=d)
        if op == "mm":
            torch.mm(a, b)
        elif op == "matmul":
            torch.matmul(a, b)
        elif op == "linear":
            torch.nn.functional.linear(a, b)
        elif op == "bmm":
            torch.bmm(a[None], b[None])
        else:
            torch.addmm(torch.ones(2, device=d), a, b)
    call.__name__ = "call"
    raises_as_eager(call)


@pytest.mark.parametrize("op", ["bmm", "baddbmm", "addbmm"])
def test_batch_matmul_dtypes_are_probed_on_operands_that_are_not_empty(op):
    """Where the meta kernel does not compare the dtypes (torch 2.11's bmm), the host probe
    raises eager's error: on operands of size 1, not 0 (eager's CPU kernel checks the dtypes
    only where the product is not empty)."""
    import optree

    from genie import checks
    from genie.graph import TensorMeta

    x, y = torch.ones(3, 2, 2), torch.ones(3, 2, 2, dtype=torch.float64)
    args = {"bmm": (x, y), "baddbmm": (torch.ones(3, 2, 2), x, y),
            "addbmm": (torch.ones(2, 2), x, y)}[op]
    func = getattr(torch.ops.aten, op).default
    with pytest.raises(RuntimeError) as want:
        func(*args)
    leaves, spec = optree.tree_flatten((tuple(TensorMeta.of(a, 0) for a in args), {}))
    with pytest.raises(RuntimeError) as got:
        checks.probe(func, leaves, spec, object())
    assert str(got.value) == str(want.value)


# --- family 4: what the device cannot hold, and abs into a complex out= -------------------------

def test_sparse_tensors_are_refused_at_the_call():
    sp = torch.ones(2, 2).to_sparse()
    with pytest.raises(NotImplementedError, match="sparse tensors are not supported on "
                       "remote_accelerator; keep them on the CPU or call .to_dense"):
        sp.to(DEV)
    with pytest.raises(NotImplementedError, match="sparse tensors are not supported"):
        torch.ones(2, 2, device=DEV).to_sparse()
    with pytest.raises(NotImplementedError, match="sparse tensors are not supported"):
        torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([1.0]), (2, 2), device=DEV)
    with pytest.raises(NotImplementedError, match="sparse tensors are not supported"):
        torch.empty(2, 2, layout=torch.sparse_coo, device=DEV)
    # what the message says to do works
    same(sp.to_dense(), sp.to_dense().to(DEV).cpu())


def test_quantized_tensors_are_refused_at_the_call():
    with pytest.raises(NotImplementedError, match="quantized tensors are not supported on "
                       "remote_accelerator"):
        torch._empty_affine_quantized([2], scale=0.1, zero_point=0, dtype=torch.quint8,
                                      device=DEV)
    with pytest.raises(NotImplementedError, match="quantized tensors are not supported"):
        torch.quantize_per_tensor(torch.ones(2, device=DEV), 0.1, 0, torch.quint8)
    q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    same(q.dequantize(), q.dequantize().to(DEV).cpu())


def test_set_with_a_storage_equals_eager():
    """set_ onto a tensor's storage is supported (genie.storages; tests/unit/test_first_use.py);
    onto a storage no live tensor owns it is refused at the call."""
    def f(d):
        src = torch.arange(4., device=d)
        t = torch.empty(0, device=d).set_(src.untyped_storage())
        src.add_(1)
        return t
    same(*both(f))
    with pytest.raises(NotImplementedError, match=r"set_.*belongs to no live tensor"):
        torch.empty(0, device=DEV).set_(torch.ones(4, device=DEV).untyped_storage()[4:8])


def test_abs_of_complex_into_complex_out():
    ref, got = both(lambda d: torch.abs(torch.tensor([3 + 4j, -1j], device=d),
                                        out=torch.empty(2, dtype=torch.complex64, device=d)))
    same(ref, got)
    ref, got = both(lambda d: torch.abs(torch.tensor([3 + 4j, -1j], device=d),
                                        out=torch.empty(2, dtype=torch.float32, device=d)))
    same(ref, got)


def test_plain_cpu_programs_are_untouched():
    """None of the checks above runs for tensors that never touch the device."""
    before = dict(genie.stats())
    a = torch.arange(5.0)
    a[a > 1] = torch.tensor([7.0, 8, 9])
    torch.abs(torch.tensor([3 + 4j]), out=torch.empty(1, dtype=torch.complex64))
    assert genie.stats() == before


# An op that reports, when it runs, the global state it runs under: a tape must run under the
# state its ops were recorded under, whatever the state is when the value is downloaded.
@torch.library.custom_op("genie_test::read_state", mutates_args=())
def read_state(x: torch.Tensor) -> torch.Tensor:
    flags = [torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cuda.matmul.fp32_precision == "tf32",
             torch.backends.cudnn.benchmark,
             torch.get_default_dtype() == torch.float64]
    return x + torch.tensor([float(f) for f in flags], dtype=x.dtype, device=x.device)


@read_state.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_tape_runs_under_the_state_it_was_recorded_under(record_path):
    """Each flag set at the call, cleared before the download: the op saw it set."""
    from genie._C import _state_mask

    x = torch.zeros(5, device=DEV)
    _state_mask(True)  # the precision group, as where the real device is CUDA
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.benchmark)
    try:
        with deterministic(True):
            det = read_state(x)
        torch.use_deterministic_algorithms(True, warn_only=True)
        warn = read_state(x)
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        tf32 = read_state(x)
        torch.backends.cuda.matmul.fp32_precision = saved[0]
        torch._C._set_cudnn_benchmark(True)  # (the setter torch.backends.cudnn.flags uses: the
        bench = read_state(x)                # attribute refuses after disable_global_flags())
        torch._C._set_cudnn_benchmark(saved[1])
        with default_dtype(torch.float64):
            f64 = read_state(x)
        plain = read_state(x)
        assert torch.backends.cuda.matmul.fp32_precision == saved[0]
        got = [t.cpu().tolist() for t in (det, warn, tf32, bench, f64, plain)]
        # one tape of several states, op by op; then each alone
        alone = [read_state(x).cpu().tolist()]
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved[0]
        torch._C._set_cudnn_benchmark(saved[1])
        torch.use_deterministic_algorithms(False)
        _state_mask(torch.cuda.is_available())
    assert got == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0],
                   [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]]
    assert alone == [[0, 0, 0, 0, 0]]
    with deterministic(True):
        one = read_state(x)
    assert one.cpu().tolist() == [1, 0, 0, 0, 0]  # a tape of one state, not the current one
    assert torch.are_deterministic_algorithms_enabled() is False


def test_an_index_into_a_dimension_of_size_0():
    """Every element of a non-empty index into a size-0 dim is out of range: eager's IndexError
    at the call (PyTorch's test_empty_ndim_index)."""
    def read(d):
        torch.empty(10, 0, device=d)[:, [0, 1]]
    raises_as_eager(read)

    def write(d):
        torch.zeros(0, device=d).index_put_((torch.tensor([0], device=d),), torch.tensor(1.0))
    raises_as_eager(write)
    ref, got = both(lambda d: torch.empty(10, 0, device=d)[[1, 2]])
    same(ref, got)
    ref, got = both(lambda d: torch.empty(10, 0, device=d)[:, torch.tensor([], dtype=torch.long,
                                                                          device=d)])
    same(ref, got)


def test_probe_verdicts_follow_int_constants():
    """pow of an int tensor: exponent 2 runs, -1 raises (eager's check on the constant), in
    either order; the shape class holds ints by type only, the verdict by value."""
    for order in ((2, -1), (-1, 2)):
        for e in order:
            shape = (3,) if order[0] == 2 else (2, 2)  # a class new to each order

            def power(d, e=e, shape=shape):
                return torch.full(shape, 3, device=d) ** e
            if e < 0:
                power.__name__ = "power"
                raises_as_eager(power)
            else:
                ref, got = both(power)
                same(ref, got)


# --- found by PyTorch's device-generic files (tests/device_generic) ----------------------------

@pytest.mark.parametrize("factory", ["arange", "linspace", "logspace"])
def test_factory_out_into_a_non_contiguous_view(factory):
    """arange/linspace/logspace(out=) resize the out= only when its element count differs (eager's
    kernels); a non-contiguous view of the right count is written in place, without a warning
    (test_arange, test_linspace_*: the meta kernels resize it to [n] and warn)."""
    def call(d, rows):
        x = torch.zeros(rows, 4, device=d)
        out = x.narrow(1, 1, 2)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            if factory == "arange":
                r = torch.arange(0, 6, out=out)
            else:
                r = getattr(torch, factory)(0, 1, 6, out=out)
        assert r is out
        return x, out.shape, out.stride(), [str(m.message) for m in w]
    for rows in (3, 2):  # 6 elements (written in place), 4 (resized, as eager resizes it)
        (xr, shape_r, stride_r, warned_r), (xg, shape_g, stride_g, warned_g) = (
            call("cpu", rows), call(DEV, rows))
        same(xr, xg.cpu())
        assert (shape_g, stride_g) == (shape_r, stride_r)
        # the same warnings; when resized, eager's says it in other words than the meta kernel's
        assert (warned_g == warned_r) if rows == 3 else (len(warned_g) == len(warned_r))


def test_random_argument_checks_at_the_call():
    """random_/uniform_/randint check their bounds and dtypes from the arguments: eager's error at
    the call (test_random_from_to_*, test_uniform_from_to_*, test_tensor_factories_empty); the
    check runs on the host with a generator of its own, so the host's stream does not move."""
    def random_int8(d):
        torch.empty(3, dtype=torch.int8, device=d).random_(0, 300)
    raises_as_eager(random_int8)

    def uniform_reversed(d):
        torch.empty(3, device=d).uniform_(2, 1)
    raises_as_eager(uniform_reversed)

    def uniform_too_wide(d):
        torch.empty(3, dtype=torch.float64, device=d).uniform_(-1e308, 1e308)
    raises_as_eager(uniform_too_wide)

    def randint_complex(d):
        torch.randint(0, 10, (3,), dtype=torch.cfloat, device=d)
    raises_as_eager(randint_complex)
    # the float arguments' values decide (uniform_(1, 2) after uniform_(2, 1) in the same class)
    got = torch.empty(1000, device=DEV).uniform_(1, 2).cpu()
    assert got.min() >= 1 and got.max() < 2
    # the checks do not draw from the host's generator
    torch.manual_seed(5)
    torch.empty(4, dtype=torch.int8, device=DEV).random_(0, 100)
    torch.empty(4, device=DEV).uniform_(0, 1)
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))


def test_random_beyond_a_floats_exact_integers_warns_as_eager():
    """random_(to) past 2**53 into float64 warns (eager's UserWarning), at the call, on every
    call (a meta-cache hit too: test_random_from_to_*)."""
    for d in ("cpu", DEV):
        for _ in range(2):
            with pytest.warns(UserWarning, match="out of bounds"):
                torch.empty(3, dtype=torch.float64, device=d).random_(2 ** 60)


def test_checks_of_in_place_and_complex_forms():
    """heaviside_ (whose in-place form lacks the pointwise tag), maximum of complex tensors,
    complex(out=) of another dtype: eager's error at the call (test_heaviside_*,
    test_maximum_minimum_complex_*, test_torch_complex_same_dtype_error_*)."""
    def heaviside_complex(d):
        x = torch.tensor([1j, 2], device=d)
        x.heaviside_(x)
    raises_as_eager(heaviside_complex)

    def heaviside_mixed(d):
        torch.ones(3, dtype=torch.int64, device=d).heaviside_(torch.ones(3, dtype=torch.int8,
                                                                         device=d))
    raises_as_eager(heaviside_mixed)

    def maximum_complex(d):
        torch.maximum(torch.ones(1, dtype=torch.cfloat, device=d),
                      torch.ones(1, dtype=torch.cfloat, device=d))
    raises_as_eager(maximum_complex)

    def complex_out(d):
        torch.complex(torch.ones(3, device=d), torch.ones(3, device=d),
                      out=torch.empty(3, dtype=torch.complex128, device=d))
    raises_as_eager(complex_out)
    ref, got = both(lambda d: torch.ones(3, device=d).heaviside_(torch.zeros(3, device=d)))
    same(ref, got)


@pytest.mark.parametrize("op", ["cat", "linspace", "add", "copy_"])
def test_out_with_internal_overlap_raises_at_the_call(op):
    """Writing into an expanded tensor: eager's "unsupported operation" at the call, decided by
    eager itself on zeros (test_cat_mem_overlap, test_linlogspace_mem_overlap); an op eager lets
    write there (sum.out) still records."""
    def write(d):
        out = torch.empty(1, 3, device=d).expand(6, 3)
        if op == "cat":
            torch.cat([torch.ones(3, 3, device=d)] * 2, out=out)
        elif op == "linspace":
            torch.linspace(0, 1, 6, out=out[:, 0])
        elif op == "add":
            torch.add(torch.ones(6, 3, device=d), 1, out=out)
        else:
            out.copy_(torch.ones(6, 3, device=d))
    write.__name__ = "write"
    raises_as_eager(write)
    ref, got = both(lambda d: torch.sum(torch.ones(6, 3, device=d), 1,
                                        out=torch.zeros(1, device=d).expand(6)))
    same(ref, got)


def test_copysign_with_a_0_dim_cpu_tensor():
    """A 0-dim CPU tensor is a scalar to eager's elementwise kernels on any device (copysign's
    meta kernel refuses it for its device): test_copysign_*."""
    ref, got = both(lambda d: torch.copysign(torch.arange(-2.0, 3.0, device=d),
                                             torch.tensor(-1.0)))
    same(ref, got)

    with pytest.raises(RuntimeError):  # a 1-dim CPU tensor is refused, as by eager on CUDA
        torch.copysign(torch.ones(3, device=DEV), torch.ones(3))


def _dlpack_program(d, route):
    """An export and an import of a tensor on ``d`` by one of DLPack's routes, then what eager
    promises: the import aliases the original (address, reads, writes both ways, in-place
    returns the import), copies and conversions do not."""
    from torch.utils.dlpack import to_dlpack

    t = torch.arange(12.0, device=d).reshape(3, 4)
    src = t[1:, 1:3]  # a view: offset and strides go through the capsule
    imp = {"to_dlpack": lambda: torch.from_dlpack(to_dlpack(src)),
           "asarray": lambda: torch.asarray(to_dlpack(src)),
           "from_dlpack": lambda: torch.from_dlpack(src),
           "torch.to_dlpack": lambda: torch.from_dlpack(torch.to_dlpack(src))}[route]()
    facts = [imp.data_ptr() == src.data_ptr(), imp.shape, imp.stride(), imp.dtype,
             imp.device.type == t.device.type]
    imp[0, 0] = -1                 # an op on the import alone writes the original
    same_obj = imp.mul_(2) is imp  # in-place: the import itself, as eager
    t.add_(1)                      # a write to the original is seen through the import
    imp[1:].t()[1].fill_(-7)       # views of the import (offsets are into its own storage)
    strided = imp.as_strided((2,), (1,), 1)
    copy = torch.asarray(to_dlpack(src), copy=True)
    as64 = torch.asarray(to_dlpack(src), dtype=torch.float64)
    copy.zero_()
    mixed = torch.isclose(src, imp).all()
    vals = [t, imp, imp + 1, imp.sum(), as64, copy, mixed, strided]
    return facts, same_obj, copy.data_ptr() != src.data_ptr(), \
        [v.cpu() for v in vals], imp.sum().item()


@pytest.mark.parametrize("route", ["to_dlpack", "asarray", "from_dlpack", "torch.to_dlpack"])
def test_dlpack_import_aliases_as_eager(route):
    """torch's DLPack round trip of a device tensor gives eager's alias (genie.dlpack)."""
    ref = _dlpack_program("cpu", route)
    got = _dlpack_program(DEV, route)
    assert got[:3] == ref[:3]
    for r, g in zip(ref[3], got[3], strict=True):
        same(r, g)
    assert got[4] == ref[4]


def test_dlpack_refusals_and_other_consumers():
    """What eager refuses to export it refuses on the device (BufferError); a consumer other
    than torch refuses the capsule's device (kDLExtDev) instead of reading a fake address; a
    plain device tensor Genie never exported names what to do."""
    from torch.utils.dlpack import DLDeviceType

    def grad(d):
        torch.ones(2, device=d, requires_grad=True).__dlpack__()
    raises_as_eager(grad)
    t = torch.arange(4.0, device=DEV)
    assert t.__dlpack_device__() == (DLDeviceType.kDLExtDev, 0)
    np = pytest.importorskip("numpy")
    # numpy's own refusal of a device it cannot read: its type changed between numpy releases
    # (RuntimeError in 2.4, BufferError on the GPU machine's)
    with pytest.raises((RuntimeError, BufferError), match="^Unsupported device in DLTensor"):
        np.from_dlpack(t)
    assert torch.equal(torch.from_dlpack(t.cpu()), torch.arange(4.0))
    # a capsule whose tensor Genie did not note (its address alone names nothing)
    from genie import dlpack
    imp = torch.from_dlpack(t)
    dlpack._exported.clear()
    with pytest.raises(RuntimeError, match="Genie did not make"):
        imp + 1
    with pytest.raises(RuntimeError, match="Genie did not make"):
        imp.cpu()


@pytest.mark.parametrize("case", ["65_dims_sum", "65_dims_std", "65_dims_argmax",
                                  "65_dims_logsumexp", "all_out_float", "any_out_long",
                                  "mode_out_dtype", "max_of_an_empty_dim", "argmax_of_an_empty_dim",
                                  "median_of_an_empty_dim", "bucketize_2d_boundaries"])
def test_reduction_checks_at_the_call(case):
    """Checks eager's reduction kernels make and the meta kernels skip (PyTorch's
    test_reductions: at most 64 dims, out= dtypes of all/any/mode, an empty reduced dim): at the
    call, eager's type and message (genie.checks, the shrunk-zeros probe)."""
    def call(d):
        x65 = torch.ones([1] * 65, device=d)
        if case == "65_dims_sum":
            torch.sum(x65, dim=-1)
        elif case == "65_dims_std":
            torch.std(x65, dim=64)
        elif case == "65_dims_argmax":
            torch.argmax(x65, dim=0)
        elif case == "65_dims_logsumexp":
            torch.logsumexp(x65, dim=3)
        elif case == "all_out_float":
            torch.all(torch.ones(3, 2, device=d), 1, out=torch.empty(0, device=d))
        elif case == "any_out_long":
            torch.any(torch.ones(3, device=d), 0, out=torch.empty(0, dtype=torch.long, device=d))
        elif case == "mode_out_dtype":
            torch.mode(torch.ones(10, device=d), -1, True,
                       out=(torch.empty(0, dtype=torch.long, device=d),
                            torch.empty(0, dtype=torch.long, device=d)))
        elif case == "max_of_an_empty_dim":
            torch.max(torch.ones(2, 0, device=d), dim=1)
        elif case == "median_of_an_empty_dim":
            torch.median(torch.ones(2, 0, 4, device=d), dim=1)
        elif case == "bucketize_2d_boundaries":
            torch.bucketize(torch.ones(3, device=d), torch.ones(2, 2, device=d))
        else:
            torch.argmax(torch.ones(2, 0, device=d), dim=1)
    raises_as_eager(call)


def test_reduction_checks_pass_what_eager_passes():
    """The probe never refuses, nor warns about, what eager takes: std over dims of 2+
    elements (a probe of one element would warn of its degrees of freedom), an empty dim that
    is not reduced, uint8 out= of any on uint8, 64 dims."""
    x = torch.arange(24.0).reshape(2, 3, 4)
    cases = [
        lambda d: torch.std(x.to(d), dim=1),
        lambda d: torch.var_mean(x.to(d), dim=(0, 2))[0],
        lambda d: torch.amax(torch.ones(0, 4, device=d), dim=1),
        lambda d: torch.any(torch.ones(3, dtype=torch.uint8, device=d), 0,
                            out=torch.empty(0, dtype=torch.uint8, device=d)),
        lambda d: torch.sum(torch.ones([1] * 64, device=d), dim=-1),
        lambda d: torch.mode(torch.tensor([1.0, 2, 2, 3], device=d)).values,
        lambda d: torch.median(x.to(d), dim=2).values,
        lambda d: torch.bucketize(x.to(d), torch.tensor([1.0, 5.0, 9.0], device=d)),
        lambda d: torch.searchsorted(torch.arange(6.0, device=d).reshape(2, 3),
                                     torch.ones(2, 5, device=d)),
    ]
    for fn in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ref, got = both(fn)
        same(ref, got)


_DOF_CASES = {  # name: (input shape, dtype, call); eager warns where (reduced - correction) <= 0
    "std_all_of_one": ((1,), torch.float32, lambda x: x.std()),
    "var_dim_of_one": ((1, 3), torch.float32, lambda x: x.var(0)),
    "var_keepdim": ((3, 1), torch.float64, lambda x: torch.var(x, 1, keepdim=True)),
    "std_mean_dim_of_one": ((3, 1), torch.float32, lambda x: torch.std_mean(x, 1)[0]),
    "var_mean_correction_past_n": ((2, 3), torch.float32,
                                   lambda x: torch.var_mean(x, (0, 1), correction=6)[1]),
    "correction_equal_to_n": ((2, 3), torch.float32, lambda x: x.var(0, correction=2)),
    "correction_2_of_10": ((10, 3), torch.float32, lambda x: x.var(0, correction=2)),
    "fractional_correction": ((2, 3), torch.float32, lambda x: x.std(0, correction=1.5)),
    "biased_of_one": ((1, 3), torch.float32, lambda x: x.std(0, unbiased=False)),
    "empty_reduced_dim": ((0, 3), torch.float32, lambda x: x.var(0)),
    "empty_output": ((3, 0), torch.float32, lambda x: x.var(0)),
    "biased_empty": ((0,), torch.float32, lambda x: torch.var_mean(x, correction=0)[0]),
    "complex_of_one": ((1,), torch.complex64, lambda x: x.std()),
    "out": ((3, 1), torch.float32,
            lambda x: torch.var(x, 1, out=torch.empty(3, device=x.device))),
    "dims_of_two": ((2, 3), torch.float32, lambda x: x.std(0)),
}


@pytest.mark.parametrize("case", sorted(_DOF_CASES))
@pytest.mark.parametrize("action", ["always", "default"])
def test_std_with_no_degrees_of_freedom_warns_as_eager(case, action):
    """std/var/std_mean/var_mean of a reduction with no degrees of freedom: eager's warning,
    word for word, at the call's line, once per call (every call under "always"; once per line
    under "default"), on the meta cache's miss and its hits alike, and not again when the
    kernel runs at the download (nor where eager does not warn: a correction the reduction
    exceeds); eager's values (NaN and inf)."""
    shape, dtype, call = _DOF_CASES[case]

    def run(d):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter(action)
            out = []
            for _ in range(3):
                x = torch.ones(shape, dtype=dtype, device=d) * torch.arange(
                    shape[-1] if shape else 1, device=d)
                out.append(call(x))
            vals = [o.cpu() for o in out]
        return vals, [(str(m.message), m.category, m.filename, m.lineno) for m in w
                      if "degrees of freedom" in str(m.message)]
    ref_vals, ref_warned = run("cpu")
    got_vals, got_warned = run(DEV)
    assert got_warned == ref_warned
    for r, g in zip(ref_vals, got_vals, strict=True):
        same(r, g)


@pytest.mark.parametrize("std", [[1.0, -1.0, 1.0], [1.0, float("nan")], -1.0, [0.0, 2.0], []])
@pytest.mark.parametrize("form", ["tensor_tensor", "float_tensor", "out"])
def test_normal_with_a_negative_std_element_raises_at_the_call(std, form):
    """normal(mean, std_tensor) checks std's elements at the call, as eager on every device
    (a sync: std.min() >= 0); NaN fails it too; an empty std passes."""
    def normal(d):
        s = torch.tensor(std, device=d)
        if form == "tensor_tensor":
            return torch.normal(torch.zeros_like(s), s).isfinite().sum()
        if form == "float_tensor":
            return torch.normal(0.0, s).isfinite().sum()
        return torch.normal(torch.zeros_like(s), s, out=torch.empty_like(s)).isfinite().sum()
    if isinstance(std, float) or float("nan") in std or any(x < 0 for x in std) or \
            any(x != x for x in std):
        raises_as_eager(normal)
    else:
        same(*both(normal))


@pytest.mark.parametrize("dtype,n", [(torch.float16, 2 ** 11 + 2), (torch.float32, 2 ** 24 + 2),
                                     (torch.float64, 2 ** 53 + 2), (torch.uint8, 2 ** 8 + 1),
                                     (torch.int16, 2 ** 15 + 1)])
def test_randperm_beyond_the_dtypes_integers_raises_at_the_call(dtype, n):
    """randperm(n, out=) into a dtype whose exact integers stop below n: eager's error at the
    call (PyTorch's test_randperm), without allocating n elements on the host."""
    def randperm_out(d):
        torch.randperm(n, out=torch.empty(0, dtype=dtype, device=d))
    raises_as_eager(randperm_out)
    ref, got = both(lambda d: torch.randperm(300, dtype=torch.int16, device=d).sort().values)
    same(ref, got)


def test_bool_of_computed_elements_reads_them():
    """all(t) iterates t's elements: after the first element's run computed them all, each
    bool() reads its value (no recorded item, no plan): test_linspace_*'s all(cond) over a
    million elements."""
    for d in ("cpu", DEV):
        cond = torch.linspace(0, 1, 1000, device=d) >= 0.5
        assert all(cond[500:]) and not all(cond)
    c = torch.arange(1000, device=DEV) >= 0
    genie.reset_stats()
    assert all(c)
    assert genie.stats().get("ops_recorded", 0) <= 2  # unbind, and one item for the first


def test_rand_into_an_out_to_resize_draws_once():
    """rand(out=) of another size: the out= is resized and the call recorded again; its numbers
    are drawn once, so the stream equals rand()'s (test_rand_*)."""
    for d in ("cpu", DEV):
        torch.manual_seed(123456)
        a = torch.rand(10, 10, device=d)
        b = torch.tensor([], device=d)
        torch.manual_seed(123456)
        torch.rand(10, 10, out=b)
        assert torch.equal(a.cpu(), b.cpu())
        assert not torch.equal(torch.rand(3, device=d).cpu(), torch.rand(3, device=d).cpu())


def test_tensor_of_a_list_of_device_scalars():
    """torch.tensor() of device 0-dim tensors reads each with the Python key excluded: the
    backend's _local_scalar_dense (test_cartesian_prod, test_combinations)."""
    from itertools import combinations, product

    def build(d):
        a = torch.tensor([1, 2], device=d)
        b = torch.tensor([1, 2, 3], device=d)
        return torch.cat([torch.tensor(list(product(a, b)), device=d),
                          torch.tensor(list(combinations(b, r=2)), device=d)])
    ref, got = both(build)
    same(ref, got)
    assert torch.tensor([torch.tensor(2.5, device=DEV)]).tolist() == [2.5]


@pytest.mark.parametrize("op", ["fmod", "remainder", "floor_divide", "div_floor"])
def test_integer_division_by_zero_raises_eagers_type(op):
    """Integer division by zero is data-dependent: deferred (as on CUDA), then raised as eager's
    RuntimeError('ZeroDivisionError') (Genie's ExecutionError is one), naming the op."""
    if genie.device.real_device(0).type == "cuda":
        pytest.skip("CUDA's integer division by zero does not raise (eager on CUDA neither): "
                    "the oracle here is eager on the CPU")
    def divide(d):
        x = torch.arange(1, 5, device=d)
        z = torch.zeros(4, dtype=torch.long, device=d)
        r = torch.div(x, z, rounding_mode="floor") if op == "div_floor" else \
            getattr(torch, op)(x, z)
        return r.cpu()
    with pytest.raises(RuntimeError, match="ZeroDivisionError") as ref:
        divide("cpu")
    with pytest.raises(RuntimeError, match="ZeroDivisionError") as got:
        divide(DEV)
    assert isinstance(got.value, type(ref.value))
    assert isinstance(got.value, genie.errors.ExecutionError) and "failed on the device" in \
        str(got.value)


# --- advanced indexing out of range: at the call where the host holds the index's values -------

_X = (3, 4, 5)


@pytest.mark.parametrize("case", [
    "list", "negative", "uploaded", "cpu_index", "none_first", "first_in_row_major",
    "broadcast", "mask_then_list", "second_call_same_shapes",
    "set_list", "set_uploaded", "set_second_call_same_shapes", "put_accumulate"])
def test_a_host_known_index_out_of_range_raises_at_the_call(case):
    """An index whose values the host holds (a list, a host tensor uploaded with ``.to(D)``, a CPU
    index tensor): eager's IndexError at the call, with eager's text (the first bad element in
    eager's order, the index tensor's position as its "dimension"); PyTorch's
    test_advancedindex's ``reference[[10]]`` / ``reference[torch.LongTensor([10]).to(D)]``."""
    def t(v, d):
        return torch.tensor(v).to(d)

    def fn(d):
        x = torch.zeros(_X, device=d)
        if case == "list":
            x[[1, 3]]
        elif case == "negative":
            x[[-4]]
        elif case == "uploaded":
            x[t([1, 2, 10], d)]
        elif case == "cpu_index":
            x[torch.tensor([0, 5])]
        elif case == "none_first":  # eager names the index tensor's position: 1, not dim 2
            x[:, [0], [7]]
        elif case == "first_in_row_major":  # 5 comes before 9
            x[t([5, 9], d)]
        elif case == "broadcast":  # (1, 9) is the first element: the second index's 9
            x[[[1], [7]], [9, 1]]
        elif case == "mask_then_list":  # a mask counts one index per dim
            x[t([True, False, True], d), [9]]
        elif case == "second_call_same_shapes":
            x[[1, 2]]
            x[[1, 3]]
        elif case == "set_list":
            x[[1, 3]] = 1.0
        elif case == "set_uploaded":
            x[t([0, 1], d), t([2, -5], d)] = torch.ones(2, 5, device=d)
        elif case == "set_second_call_same_shapes":  # the native record path must not skip it
            x[t([1], d)] = 2.0
            x[t([1], d)] = 2.0
            x[t([4], d)] = 2.0
        elif case == "put_accumulate":
            x.index_put_((t([1, 7], d), t([0, 9], d)), torch.tensor(1.0, device=d),
                         accumulate=True)
    e = raises_as_eager(fn)
    assert type(e) is IndexError and "out of bounds" in str(e)
    # refused by the host's check, nothing ran: the kernel never sees the index (on CUDA it
    # would be a device-side assert, not eager's error; a mask's data-dependent run included)
    assert not genie.stats().get("nodes_executed"), genie.stats()


def test_host_known_indices_in_range_and_empty_results_record_as_eager():
    """What eager does not refuse still records: in-range and negative indices, an index whose
    result is empty (eager's kernel reads no index: no error), a metadata error before a value
    error (eager's order), and an index written after its upload (its snapshot is stale: the
    check stays the kernel's, which sees the written value)."""
    def t(v, d):
        return torch.tensor(v).to(d)

    ref, got = both(lambda d: torch.arange(60.0, device=d).view(_X)[[2, -3], :, t([4, -5], d)])
    same(ref, got)
    ref, got = both(lambda d: torch.zeros(0, 5, device=d)[:, [10]])
    same(ref, got)
    ref, got = both(lambda d: torch.zeros(3, 0, device=d)[[5]])
    same(ref, got)

    def written(d):
        i = t([9], d)
        i[0] = 1
        return torch.arange(3.0, device=d)[i]
    ref, got = both(written)
    same(ref, got)

    def dtype_first(d):  # the value's dtype is eager's first error
        torch.zeros(3, device=d).index_put_((t([7], d),), torch.ones(1, dtype=torch.float64,
                                                                     device=d))
    raises_as_eager(dtype_first)

    def shapes_first(d):
        torch.zeros(3, 3, device=d)[[0, 7], [0, 1, 2]]
    raises_as_eager(shapes_first)


def _lineage(d, case):
    """An index tensor made on ``d`` from constants (values known without running the device)."""
    if case in ("get_last", "set_last", "put_accumulate"):  # PyTorch's test_trivial_fancy_...
        ind = torch.ones(20, dtype=torch.int64, device=d)
        ind[-1] = 10
    elif case == "get_first":
        ind = torch.ones(20, dtype=torch.int64, device=d)
        ind[0] = 11
    elif case == "arithmetic":  # 0 - 3 * (arange + 1): -6 is out of range, eager names it
        ind = 0 - (torch.arange(4, device=d) + 1) * 3
    elif case == "view_of_a_written_base":
        base = torch.zeros(4, 5, dtype=torch.int32, device=d)
        base[1].fill_(2)
        base[1, 3] = 7
        ind = base[1]
    elif case == "upload_written":  # a pending upload, then written on the device
        ind = torch.tensor([1, 2, 3]).to(d)
        ind.add_(torch.tensor([0, 6, 0], device=d))
    elif case == "written_through_an_alias":
        ind = torch.zeros(6, dtype=torch.long, device=d)
        ind.view(2, 3).t()[2, 1] = 8
    elif case == "second_index":
        ind = torch.full((2,), 4, device=d)
        ind += torch.tensor(1, device=d)  # 5: out of range of dim 1 (size 5)
    return ind


_MADE = ["get_last", "set_last", "get_first", "arithmetic", "view_of_a_written_base",
         "upload_written", "written_through_an_alias", "second_index", "put_accumulate"]


@pytest.mark.parametrize("case", _MADE)
def test_a_small_index_made_on_the_device_from_constants_raises_at_the_call(case):
    """An index made on the device from constants (PyTorch's test_trivial_fancy_out_of_bounds:
    ``torch.ones(20, dtype=long, device=D)``, then ``ind[-1] = 10``): its lineage is small and
    known to the host, so the host evaluates it (genie.executor.host_value) and eager's
    IndexError, eager's text, comes at the call; nothing runs on the device."""
    def fn(d):
        x = torch.zeros(5, 5, device=d)
        ind = _lineage(d, case)
        if case == "set_last":
            x[ind] = 0.0
        elif case == "put_accumulate":
            x.index_put_((ind,), torch.ones(5, device=d), accumulate=True)
        elif case == "second_index":
            x[[0, 1], ind]
        else:
            x[ind]
    before = genie.stats()
    e = raises_as_eager(fn)
    assert type(e) is IndexError and "out of bounds" in str(e)
    after = genie.stats()
    assert after.get("nodes_executed", 0) == before.get("nodes_executed", 0)
    assert after.get("materializations", 0) == before.get("materializations", 0)
    assert after.get("host_evaluations", 0) > before.get("host_evaluations", 0)


@pytest.mark.parametrize("case", ["in_range", "masks", "twice", "lifted"])
def test_small_indices_made_on_the_device_give_eagers_values_and_stay_pending(case):
    """In range, the host's evaluation changes nothing: the values are eager's, the index's
    nodes stay pending and run on the device with the indexing (one materialization, at the
    download); a mask made from constants and an index read twice (the same lineage, evaluated
    at each call: a write in between is seen) too, and an index that ``lift_fresh`` took from a
    value computed on the device (its lineage walked through the lift: an AttributeError
    before)."""
    def fn(d):
        x = torch.arange(30.0, device=d).view(6, 5)
        ind = torch.ones(8, dtype=torch.int64, device=d)
        ind[-1] = 5
        if case == "lifted":
            lifted = torch.ops.aten.lift_fresh.default(ind + 0)
            return torch.cat([x[lifted].flatten(),
                              x[torch.ops.aten.lift_fresh_copy.default(ind[:3] - 1)].flatten()])
        if case == "in_range":
            y = torch.cat([x[ind].flatten(), x[ind.view(2, 4), ind[:4] - 2].flatten()])
            x[ind[:2]] = 0.5
            return torch.cat([y, x.flatten()])
        if case == "masks":
            m = torch.arange(6, device=d) % 2 == 0
            x[m] = -1.0
            x[m, ind[:3] - 1] = 2.0  # (x[m, ...] would run now: its shape is the mask's count)
            return x
        r = x[ind]
        ind[0] = 4
        return torch.cat([r, x[ind]])
    ref, got = both(fn)
    same(ref, got)
    before = genie.stats()
    y = fn(DEV)
    mid = genie.stats()
    assert mid.get("materializations", 0) == before.get("materializations", 0)
    assert mid.get("host_evaluations", 0) > before.get("host_evaluations", 0)
    assert not y._node.executed
    y.cpu()
    assert genie.stats().get("nodes_executed", 0) > mid.get("nodes_executed", 0)


def _device_made(d, case):
    """An index whose values only a run gives: each rule of genie.executor.host_value."""
    if case == "float_lineage":  # float arithmetic: rounding is the device's
        ind = (torch.ones(20, device=d) * 10).long()
    elif case == "random":
        ind = torch.randint(10, 11, (20,), device=d)
    elif case == "uninitialized":
        ind = torch.empty(20, dtype=torch.int64, device=d).fill_(10)
    elif case == "large":
        ind = torch.full((5000,), 10, device=d)
    elif case == "long_lineage":
        ind = torch.zeros(20, dtype=torch.int64, device=d)
        for _ in range(40):
            ind = ind + 1
        ind = ind - 30
    elif case == "ran":  # a value that ran is the device's: not read back for a check
        ind = torch.ones(20, dtype=torch.int64, device=d)
        ind.cpu()
        ind[-1] = 10
    return ind


@pytest.mark.kernel_error  # an out-of-range index computed on the device
@pytest.mark.parametrize("case", ["float_lineage", "random", "uninitialized", "large",
                                  "long_lineage", "ran"])
@pytest.mark.parametrize("op", ["get", "set"])
def test_a_device_computed_index_out_of_range_is_deferred_as_eagers_error_naming_its_line(
        op, case):
    """An index whose values only running it gives (float arithmetic, random, uninitialized
    memory, past the host evaluation's bounds, a value that ran): the check stays the kernel's,
    as on CUDA; the error is eager's type and text and names the line that recorded the
    indexing, without GENIE_RECORD_SOURCE."""
    ind = _device_made("cpu", case)
    with pytest.raises(IndexError) as ref:
        torch.zeros(5)[ind]
    a = torch.zeros(5, device=DEV)
    ind = _device_made(DEV, case)
    if op == "get":
        y, line = a[ind], inspect.currentframe().f_lineno
    else:
        a[ind], line = 0.0, inspect.currentframe().f_lineno
        y = a
    with pytest.raises(IndexError) as got:
        y.cpu()
    assert isinstance(got.value, genie.ExecutionError)
    assert str(ref.value) in str(got.value)
    assert f"(recorded at {__file__}:{line})" in str(got.value)


@pytest.mark.parametrize("order", ["cpu_first", "device_first"])
def test_block_diag_of_a_cpu_and_a_device_tensor_raises_the_native_kernels_text(order):
    """block_diag's native kernel (eager's on any backend: CompositeExplicitAutograd) checks the
    inputs' devices with its own text; the meta kernel is torch's Python reference, whose text
    differs (PyTorch's test_block_diag asserts the native one). Eager cannot show it on one
    device: the text is the kernel's (TensorShape.cpp, in libtorch_cpu)."""
    a, b = torch.ones(2, 2), torch.ones(2, 3, device=DEV)
    first, second = (a, b) if order == "cpu_first" else (b, a)
    with pytest.raises(RuntimeError) as e:
        torch.block_diag(first, torch.ones(1, device=first.device), second)
    assert type(e.value) is RuntimeError
    assert str(e.value) == ("torch.block_diag: input tensors must all be on the same device. "
                            f"Input 0 is on device {first.device} and input 2 is on device "
                            f"{second.device}")
    # what eager allows still records: every input on the device
    ref, got = both(lambda d: torch.block_diag(torch.ones(2, 2, device=d),
                                               torch.arange(3.0, device=d)))
    same(ref, got)


@pytest.mark.parametrize("base", ["int", "complex"])
@pytest.mark.parametrize("out_dtype", [torch.long, torch.float, torch.double, torch.cdouble])
def test_float_power_out_and_in_place_dtypes_as_eager(base, out_dtype):
    """PyTorch's test_float_power_exceptions, without its helper's ``type(i) == torch.Tensor``
    (false for a device tensor, a torch.Tensor subclass): every form raises or computes as
    eager does."""
    def make(d):
        return (torch.tensor([-2, -1, 0, 1, 2], device=d) if base == "int" else
                torch.tensor([-1.0j, 0j, 1.0j, 1.0 + 1.0j], device=d))
    exp = -0.25 if base == "int" else 2.0
    required = torch.double if base == "int" else torch.cdouble
    for form in ("out", "exponent_out", "in_place"):
        def fn(d, form=form):
            if form == "in_place":
                return make(d).to(out_dtype).float_power_(exp)
            out = torch.empty(1, device=d, dtype=out_dtype)
            if form == "out":
                return torch.float_power(make(d), exp, out=out)
            return torch.float_power(exp, make(d), out=out)
        try:
            fn("cpu")
        except RuntimeError:
            assert form == "in_place" or out_dtype != required
            raises_as_eager(fn)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # out= of one element resized
                ref, got = both(fn)
            same(ref, got)


@pytest.mark.parametrize("op", ["pow_", "atan2_", "clamp_", "copysign_", "eq_", "fmod_",
                                "hypot_", "remainder_", "xlogy_", "float_power_", "mul_"])
@pytest.mark.parametrize("shapes", [((2, 1), (2, 2)), ((), (3,)), ((2, 2), (2, 1, 1))])
def test_in_place_ops_whose_inputs_broadcast_beyond_self_raise_at_the_call(op, shapes):
    """PyTorch's test_pow_inplace_resizing_exception: the meta kernels of many in-place ops
    resize self where eager raises "output with shape [2, 1] doesn't match the broadcast shape
    [2, 2]"; on the device too, at the call. In-place broadcasting that eager allows records."""
    def bad(d):
        getattr(torch.rand(shapes[0], dtype=torch.float64, device=d),
                op)(torch.rand(shapes[1], dtype=torch.float64, device=d))
    raises_as_eager(bad)

    def good(d):
        torch.manual_seed(0)
        x = torch.rand(2, 3, dtype=torch.float64).to(d)
        getattr(x, op)(torch.rand(3, dtype=torch.float64).to(d))
        return x
    ref, got = both(good)
    same(ref, got)
