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

from eager_oracle import EXACT, assert_equal_eager

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
    # the backward on the real device (bit-equal), or on the CPU where that is CUDA (eager_oracle)
    ref, oracle = (wr, real) if EXACT else (want, cpu)
    ref.backward(g.to(ref.device))
    got.backward(g.to(D))
    assert_equal_eager([lz.grad.cpu() for lz in lazy], [r.grad.cpu() for r in oracle])


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


# --- scaled_dot_product_attention: the device answers the fused-kernel choice as its real device --

def _heads(b: int, h: int, seq: int, d: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """(b, h, seq, d); ``hf``: a view of (b, seq, h, d) as HF's attention makes its heads."""
    if layout == "hf":
        return torch.randn(b, seq, h, d, dtype=dtype).transpose(1, 2)
    return torch.randn(b, h, seq, d, dtype=dtype)


SDPA = [  # (kwargs, whether eager's CPU kernel choice is flash)
    ({"is_causal": True}, True),
    ({}, True),
    ({"scale": 0.3}, True),
    ({"mask": "float"}, True),
    ({"mask": "bool"}, True),
    ({"enable_gqa": True}, True),
]


def _sdpa_args(kw: dict, layout: str, dtype: torch.dtype, lq: int = 7
               ) -> tuple[list[torch.Tensor], dict]:
    kw = dict(kw)
    hk = 2 if kw.get("enable_gqa") else 4
    q = _heads(2, 4, lq, 16, layout, dtype)
    k, v = _heads(2, hk, 9, 16, layout, dtype), _heads(2, hk, 9, 16, layout, dtype)
    mask = kw.pop("mask", None)
    if mask == "float":
        kw["attn_mask"] = torch.randn(lq, 9, dtype=dtype)
    elif mask == "bool":
        kw["attn_mask"] = torch.rand(lq, 9) > 0.3
    return [q, k, v], kw


def _on(xs: list[torch.Tensor], kw: dict, to: Callable[[torch.Tensor], torch.Tensor]
        ) -> tuple[list[torch.Tensor], dict]:
    return [to(x) for x in xs], {k: to(v) if isinstance(v, torch.Tensor) else v
                                 for k, v in kw.items()}


@pytest.mark.skipif(real_device(0).type != "cpu", reason="the CPU's fused kernel choice")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("kw,flash", SDPA, ids=["causal", "plain", "scale", "float-mask",
                                                 "bool-mask", "gqa"])
def test_sdpa_takes_the_cpus_fused_kernel_as_eager_does(kw, flash, layout, dtype) -> None:  # noqa: ANN001
    """Values bit-equal to eager's, its strides (HF's transposed heads: the query's layout), the
    same kernel choice (one recorded node for flash), and eager's gradients."""
    torch.manual_seed(0)
    xs, kw = _sdpa_args(kw, layout, dtype)
    assert (torch._fused_sdp_choice(*xs, **kw) == 1) == flash
    want = F.scaled_dot_product_attention(*xs, **kw)
    lx, lkw = _on(xs, kw, lambda t: t.to(D))
    with torch.no_grad():
        got, n = _ops(lambda: F.scaled_dot_product_attention(*lx, **lkw))
    _same(got, want, want)
    if flash:  # (a bool mask is made a float one first, as in eager: 3 ops more)
        bool_mask = kw.get("attn_mask") is not None and kw["attn_mask"].dtype == torch.bool
        assert n == 1 + 3 * bool_mask, f"SDPA recorded as {n} ops (eager's CPU: one kernel)"
    # gradients: flash's own backward, as eager's
    cx = [x.clone().requires_grad_() for x in xs]
    gx = [x.clone().to(D).requires_grad_() for x in xs]
    want = F.scaled_dot_product_attention(*cx, **kw)
    got = F.scaled_dot_product_attention(*gx, **lkw)
    assert type(got.grad_fn).__name__ == type(want.grad_fn).__name__
    g = torch.randn(want.shape, dtype=dtype)
    want.backward(g)
    got.backward(g.to(D))
    for a, b in zip(gx, cx):
        assert a.grad.stride() == b.grad.stride()
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=0, atol=0)


@pytest.mark.skipif(real_device(0).type != "cpu", reason="the CPU's fused kernel choice")
def test_sdpa_follows_sdpa_kernel_and_dropout_to_the_math_path() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    xs, kw = _sdpa_args({"is_causal": True}, "hf", torch.float32)
    lx = [x.to(D) for x in xs]
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        want = F.scaled_dot_product_attention(*xs, **kw)
        got, n = _ops(lambda: F.scaled_dot_product_attention(*lx, **kw))
        assert n > 1
        _same(got, want, want)
    with torch.no_grad():  # dropout: the math path on eager's CPU too (values: random)
        got, n = _ops(lambda: F.scaled_dot_product_attention(*lx, dropout_p=0.5))
        assert n > 1 and got.stride() == F.scaled_dot_product_attention(*xs, dropout_p=0.5).stride()


def test_sdpa_through_a_server_keeps_the_math_path(monkeypatch) -> None:  # noqa: ANN001
    """Where the work goes to a server the client cannot know the server's kernels: math, as
    before (values checked against eager to tolerance: a different summation order)."""
    from genie import device

    monkeypatch.setattr(device, "runs_remotely", lambda: True)
    torch.manual_seed(0)
    xs, kw = _sdpa_args({"is_causal": True}, "hf", torch.float32)
    with torch.no_grad():
        got, n = _ops(lambda: F.scaled_dot_product_attention(*[x.to(D) for x in xs], **kw))
    assert n > 1
    torch.testing.assert_close(got.cpu(), F.scaled_dot_product_attention(*xs, **kw))


def test_sdpa_errors_are_eagers_at_the_call() -> None:
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 4, 9, 8)
    with pytest.raises(Exception) as want:
        F.scaled_dot_product_attention(q, k, k)
    with torch.no_grad(), pytest.raises(type(want.value)) as got:
        F.scaled_dot_product_attention(q.to(D), k.to(D), k.to(D))
    assert str(got.value) == str(want.value)
