"""``matmul`` and ``linear`` recorded whole (csrc/whole.cpp) against eager.

Where autograd does not need their decomposition (``no_grad``, ``inference_mode``, inputs that
need no grad) each is one recorded node; where it does (grad mode and an input that requires
grad, a forward-mode tangent) the composite runs as without the kernel. Either way values,
shapes, strides, dtypes, gradients and errors are eager's; ``config.whole_ops = False`` (the
reference) records the decomposition always. Values are bit-equal to eager on the real device
(the same kernels: CUDA's matmul differs from the CPU's in the last bit); metadata is eager's on
the CPU, as everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import genie
from genie.config import config
from genie.device import real_device

D = "remote_accelerator"

# (a, b) shapes and a transform making an operand non-contiguous, as attention's q @ k^T does
MATMUL = [
    ((4,), (4,)), ((3, 4), (4,)), ((4,), (4, 5)), ((3, 4), (4, 5)), ((2, 3, 4), (4,)),
    ((4,), (2, 4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)), ((2, 3, 4), (2, 4, 5)),
    ((1, 4, 7, 32), (1, 4, 32, 7)), ((2, 1, 3, 4), (5, 4, 6)), ((1, 4, 1, 32), (1, 4, 32, 9)),
]
LINEAR = [((5, 4), (3, 4), True), ((5, 4), (3, 4), False), ((2, 5, 4), (3, 4), True),
          ((4,), (3, 4), True), ((2, 1, 5, 4), (3, 4), False), ((1, 1, 128), (1000, 128), False)]


@pytest.fixture(autouse=True)
def _whole_on() -> Iterator[None]:
    config.whole_ops = True
    yield
    config.whole_ops = True


def _ops(f: Callable[[], object]) -> tuple[object, int]:
    """f's result and how many ATen ops genie recorded for it."""
    before = genie.stats().get("ops_recorded", 0)
    out = f()
    return out, genie.stats().get("ops_recorded", 0) - before


def _r(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors on the real device (eager's oracle of values: the kernels Genie runs)."""
    return [None if t is None else t.to(real_device(0)) for t in ts]


def _same(got: torch.Tensor, want: torch.Tensor, real: torch.Tensor) -> None:
    """``got``'s metadata is eager's on the CPU (``want``), its values bit-equal to ``real``:
    eager's on the real device."""
    assert (got.shape, got.stride(), got.dtype, got.requires_grad) == \
        (want.shape, want.stride(), want.dtype, want.requires_grad)
    torch.testing.assert_close(got.cpu(), real.cpu(), rtol=0, atol=0)


def _t(shape: tuple[int, ...], transposed: bool) -> torch.Tensor:
    if transposed and len(shape) >= 2:
        return torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    return torch.randn(shape)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("sa,sb", MATMUL)
def test_matmul_is_one_node_equal_to_eager(sa, sb, transposed) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    a, b = _t(sa, False), _t(sb, transposed)
    la, lb = a.to(D), b.to(D)
    ra, rb = _r(a, b)
    with torch.no_grad():
        got, n = _ops(lambda: la @ lb)
        _same(got, a @ b, ra @ rb)
        assert n == 1, f"matmul recorded as {n} ops"
        config.whole_ops = False
        ref, n_ref = _ops(lambda: torch.matmul(la, lb))
        _same(ref, a @ b, ra @ rb)
        assert n_ref >= 1 and (n_ref > 1 or a.dim() <= 2 and b.dim() <= 2)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("sx,sw,bias", LINEAR)
def test_linear_is_one_node_equal_to_eager(sx, sw, bias, transposed) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    x, w = _t(sx, transposed), torch.randn(sw)
    b = torch.randn(sw[0]) if bias else None
    lx, lw, lb = x.to(D), w.to(D), None if b is None else b.to(D)
    real = F.linear(*_r(x, w, b))
    with torch.no_grad():
        got, n = _ops(lambda: F.linear(lx, lw, lb))
        _same(got, F.linear(x, w, b), real)
        assert n == 1, f"linear recorded as {n} ops"
        config.whole_ops = False
        ref, n_ref = _ops(lambda: F.linear(lx, lw, lb))
        _same(ref, F.linear(x, w, b), real)
        assert n_ref > 1


def test_inputs_that_need_no_grad_record_whole_in_grad_mode() -> None:
    x, w = torch.randn(2, 5, 4), torch.randn(3, 4)
    got, n = _ops(lambda: F.linear(x.to(D), w.to(D)))
    assert n == 3  # two uploads and the linear
    _same(got, F.linear(x, w), F.linear(*_r(x, w)))


def test_inference_mode_records_whole_with_the_kernel_off_too() -> None:
    a, b = torch.randn(2, 3, 4), torch.randn(4, 5)
    la, lb = a.to(D), b.to(D)
    ra, rb = _r(a, b)
    for on in (True, False):
        config.whole_ops = on
        with torch.inference_mode():
            got, n = _ops(lambda: la @ lb)
            assert n == 1
            torch.testing.assert_close(got.cpu(), (ra @ rb).cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("which", ["matmul", "linear"])
def test_gradients_take_the_decomposition_and_equal_eager(which) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 5, 4), torch.randn(3, 4), torch.randn(3)
    cpu = [t.clone().requires_grad_() for t in (x, w, b)]
    real = [t.clone().requires_grad_() for t in _r(x, w, b)]
    lazy = [t.to(D).requires_grad_() for t in (x, w, b)]

    def f(x, w, b):  # noqa: ANN001, ANN202
        return x @ w.t() + b if which == "matmul" else F.linear(x, w, b)

    want = f(*cpu)
    got, n = _ops(lambda: f(*lazy))
    assert n > (2 if which == "matmul" else 1), "autograd needs the decomposition"
    assert type(got.grad_fn).__name__ == type(want.grad_fn).__name__
    wr = f(*real)
    _same(got, want, wr)
    g = torch.randn(want.shape)
    wr.backward(g.to(wr.device))
    got.backward(g.to(D))
    for lz, r in zip(lazy, real):
        torch.testing.assert_close(lz.grad.cpu(), r.grad.cpu(), rtol=0, atol=0)


def test_forward_ad_tangent_equals_eager() -> None:
    a, b, t = torch.randn(3, 4), torch.randn(2, 4, 5), torch.randn(3, 4)
    ra, rb, rt = _r(a, b, t)
    with fwAD.dual_level(), torch.no_grad():
        want = fwAD.unpack_dual(fwAD.make_dual(ra, rt) @ rb)
        got, n = _ops(lambda: fwAD.make_dual(a.to(D), t.to(D)) @ b.to(D))
        got = fwAD.unpack_dual(got)
        assert n > 4, "a tangent needs the decomposition (its forward formulas are the parts')"
        torch.testing.assert_close(got.primal.cpu(), want.primal.cpu(), rtol=0, atol=0)
        torch.testing.assert_close(got.tangent.cpu(), want.tangent.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("f", [
    lambda a, b: a @ b,
    lambda a, b: torch.matmul(a.double(), b),
    lambda a, b: torch.matmul(a, b[0, 0]),
    lambda a, b: F.linear(a, b),
    lambda a, b: F.linear(a, b.t(), torch.zeros(7)),
    lambda a, b: torch.matmul(a.sum(), b),
], ids=["sizes", "dtypes", "1d-mismatch", "linear-sizes", "linear-bias", "0d"])
def test_errors_are_eagers_at_the_call(f) -> None:  # noqa: ANN001
    a, b = torch.randn(2, 3, 4), torch.randn(5, 6)
    with pytest.raises(Exception) as want:
        f(a, b)
    with torch.no_grad(), pytest.raises(type(want.value)) as got:
        f(a.to(D), b.to(D))
    assert str(got.value) == str(want.value)


def test_a_host_operand_behaves_as_in_the_decomposition() -> None:
    """A CPU matrix beside a lazy one: the whole op does what the decomposition does. Both take
    the host operand (its ``mm``/``bmm`` meta kernel does not check devices), where eager on an
    accelerator raises a device mismatch: a known gap of the record path, not of this kernel.
    Where the real device is not the CPU its kernel refuses the host operand, whole or not (an
    error at the download, where eager's comes at the call)."""
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    if real_device(0).type != "cpu":
        for on in (True, False):
            config.whole_ops = on
            with torch.no_grad():
                for f in (lambda: a.to(D) @ b, lambda: F.linear(a.to(D), b.t())):
                    with pytest.raises(RuntimeError, match="same device"):
                        f().cpu()
        return
    outs = []
    for on in (True, False):
        config.whole_ops = on
        with torch.no_grad():
            outs.append(((a.to(D) @ b).cpu(), F.linear(a.to(D), b.t()).cpu()))
    for got, ref in zip(*outs):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        torch.testing.assert_close(got, a @ b, rtol=0, atol=0)
