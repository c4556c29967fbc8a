"""torch.autocast("remote_accelerator") against CPU autocast: same dtypes, values and grads."""

import pytest
import torch
import torch.nn.functional as F

import genie.autocast
from genie.device import real_device

DEV = "remote_accelerator:0"


def _samples():
    r = torch.randn
    yield "mm", lambda t: torch.mm(t(r(3, 4)), t(r(4, 5)))
    yield "bmm", lambda t: torch.bmm(t(r(2, 3, 4)), t(r(2, 4, 5)))
    yield "matmul", lambda t: t(r(3, 4)) @ t(r(4, 2))
    yield "addmm", lambda t: torch.addmm(t(r(5)), t(r(3, 4)), t(r(4, 5)))
    yield "baddbmm", lambda t: torch.baddbmm(t(r(2, 3, 5)), t(r(2, 3, 4)), t(r(2, 4, 5)))
    yield "linear", lambda t: F.linear(t(r(3, 4)), t(r(5, 4)), t(r(5)))
    yield "conv2d", lambda t: F.conv2d(t(r(1, 2, 6, 6)), t(r(3, 2, 3, 3)))
    yield "conv1d", lambda t: F.conv1d(t(r(1, 2, 6)), t(r(3, 2, 3)))
    yield "prelu", lambda t: F.prelu(t(r(2, 3)), t(r(3)))
    yield "sdpa", lambda t: F.scaled_dot_product_attention(t(r(1, 2, 4, 8)), t(r(1, 2, 4, 8)),
                                                           t(r(1, 2, 4, 8)))
    yield "mse_loss(bf16 in)", lambda t: F.mse_loss(t(r(3, 4)).bfloat16(), t(r(3, 4)))
    yield "l1_loss", lambda t: F.l1_loss(t(r(3, 4)).bfloat16(), t(r(3, 4)).bfloat16())
    yield "prod", lambda t: t(r(3, 4)).bfloat16().prod()
    yield "nll_loss", lambda t: F.nll_loss(t(r(3, 4)).bfloat16(), t(torch.tensor([0, 2, 1])))
    yield "kl_div", lambda t: F.kl_div(t(r(3, 4)).bfloat16(), t(torch.rand(3, 4)).bfloat16())
    yield "cross_entropy", lambda t: F.cross_entropy(t(r(3, 4)).bfloat16(),
                                                     t(torch.tensor([0, 2, 1])))
    yield "bce_logits", lambda t: F.binary_cross_entropy_with_logits(
        t(r(3, 4)).bfloat16(), t(torch.rand(3, 4)).bfloat16())
    # not in either list: runs in its inputs' dtype under both
    yield "add", lambda t: t(r(3)) + t(r(3)).bfloat16()
    yield "relu", lambda t: torch.relu(t(r(3)).bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,fn", list(_samples()), ids=[n for n, _ in _samples()])
def test_op_under_autocast_equals_cpu_autocast(name, fn, dtype):
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=dtype):
        ref = fn(lambda x: x)
    torch.manual_seed(0)
    with torch.autocast("remote_accelerator", dtype=dtype):
        got = fn(lambda x: x.to(DEV))
    assert got.dtype == ref.dtype, name
    assert got.shape == ref.shape
    # same kernels on the same cast inputs: bit-equal; SDPA is Genie's portable decomposition
    # (genie.portable) where CPU runs its flash kernel: equal within the dtype's tolerance. On a
    # CUDA real device the kernels are CUDA's: equal within the result dtype's tolerance.
    if name == "sdpa":
        tol = {"rtol": 1.6e-2, "atol": 8e-3}
    elif real_device(0).type == "cpu":
        tol = {"rtol": 0, "atol": 0}
    else:
        tol = {}
    torch.testing.assert_close(got.cpu(), ref, **tol)


def test_disabled_and_nested_regions_follow_eager():
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    with torch.autocast("remote_accelerator", dtype=torch.bfloat16):
        with torch.autocast("remote_accelerator", enabled=False):
            assert (a.to(DEV) @ b.to(DEV)).dtype == torch.float32
        assert (a.to(DEV) @ b.to(DEV)).dtype == torch.bfloat16
        assert torch.is_autocast_enabled("remote_accelerator")
        # host tensors are not this device's business: CPU autocast is off
        assert (a @ b).dtype == torch.float32


def test_training_step_under_autocast_equals_cpu_autocast():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    lazy = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    lazy.load_state_dict(ref.state_dict())
    lazy.to(DEV)
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    for model, dev, inp, tgt in ((ref, "cpu", x, y), (lazy, "remote_accelerator", x.to(DEV),
                                                      y.to(DEV))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(inp), tgt)
            loss.backward()
            opt.step()
    for p, q in zip(ref.parameters(), lazy.parameters()):
        torch.testing.assert_close(q.cpu(), p.detach())


def test_lists_are_autocast_policy_on_cpu():
    """Every op Genie casts has a CPU autocast kernel too (the lists mirror CPU's)."""
    for name in genie.autocast.LOWER_PRECISION + genie.autocast.FP32:
        packet = getattr(torch.ops.aten, name)
        names = [packet._qualified_op_name + ("" if o == "default" else f".{o}")
                 for o in packet.overloads() if not getattr(packet, o)._schema.is_mutable]
        assert any(torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU")
                   for n in names), name
