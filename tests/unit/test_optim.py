"""Optimizers on the device: the multi-tensor (``_foreach_*``) path, equal to eager.

Genie lists ``LazyTensor`` among PyTorch's foreach-capable tensor types (as DTensor does), so
``torch.optim`` and ``clip_grad_norm_`` run their multi-tensor implementation on the device: a
handful of ``_foreach_*`` ops per step instead of several ops per parameter. On the CPU build the
device runs the same per-tensor kernels as eager CPU's ``foreach=True``, so the values are equal
exactly; against eager's default (the for-loop implementation) they differ only in the rounding
order of a few scalar factors. On CUDA (other kernels) only the tolerances hold.
"""

import copy

import pytest
import torch
from torch import nn

import genie
from genie.config import config
from genie.device import real_device

D = "remote_accelerator"
STEPS = 5

OPTIMIZERS = {
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2, **kw),
    "adam amsgrad": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, **kw),
    "sgd momentum": lambda ps, **kw: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, nesterov=True,
                                                     **kw),
}


@pytest.fixture(autouse=True)
def _foreach_on():
    before = config.foreach
    config.foreach = True
    yield
    config.foreach = before


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))  # 8 parameters


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(100 + step)
    return torch.randn(8, 16), torch.randn(8, 4)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, dev: str, counts: list[int] | None = None
           ) -> list[float]:
    """``STEPS`` training steps; the losses, and in ``counts`` the ops each ``opt.step()``
    recorded."""
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
        loss.backward()
        before = genie.stats()["ops_recorded"]
        opt.step()
        if counts is not None:
            counts.append(genie.stats()["ops_recorded"] - before)
        losses.append(loss.item())
    return losses


def test_lazy_tensor_is_declared_foreach_capable():
    from torch.optim import optimizer
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils import _foreach_utils

    from genie.lazy_tensor import LazyTensor

    params = list(_mlp().to(D).parameters())
    assert all(type(p) is LazyTensor for p in params)
    assert _default_to_fused_or_foreach(params, differentiable=False, use_fused=False) == \
        (False, True)
    config.foreach = False
    assert _default_to_fused_or_foreach(params, differentiable=False, use_fused=False) == \
        (False, False)
    config.foreach = True  # idempotent: listed once
    config.foreach = True
    assert optimizer._foreach_supported_types.count(LazyTensor) == 1
    assert _foreach_utils._foreach_supported_types.count(LazyTensor) == 1


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_equal_eager(name):
    """Losses and parameters after ``STEPS`` steps: equal to eager CPU with ``foreach=True``
    (the same kernels, on the embedded CPU device), close to eager's default for-loop
    implementation."""
    make = OPTIMIZERS[name]
    ref, ref_loop = _mlp(), _mlp()
    model = copy.deepcopy(ref).to(D)
    want = _steps(ref, make(ref.parameters(), foreach=True), "cpu")
    want_loop = _steps(ref_loop, make(ref_loop.parameters()), "cpu")
    counts: list[int] = []
    got = _steps(model, make(model.parameters()), D, counts)
    exact = real_device(0).type == "cpu"
    rtol, atol = (1e-5, 1e-7) if exact else (1e-4, 1e-5)  # CUDA: other kernels, other rounding
    assert got == want if exact else got == pytest.approx(want, rel=rtol, abs=atol)
    assert got == pytest.approx(want_loop, rel=rtol, abs=atol)
    for p, q, r in zip(ref.parameters(), model.parameters(), ref_loop.parameters(), strict=True):
        if exact:
            assert torch.equal(q.cpu(), p)
        torch.testing.assert_close(q.cpu(), r, rtol=rtol, atol=max(atol, 1e-6))
    # the foreach path: a few _foreach_ ops per step (the first also creates the state)
    assert max(counts[1:]) <= 12, counts


@pytest.mark.parametrize("name", ["adamw", "sgd momentum"])
def test_foreach_records_fewer_ops_than_the_loop(name):
    make = OPTIMIZERS[name]
    per_step = {}
    for foreach in (True, False):
        config.foreach = foreach
        model = _mlp().to(D)
        counts: list[int] = []
        _steps(model, make(model.parameters()), D, counts)
        per_step[foreach] = counts[-1]
    assert per_step[True] * 4 <= per_step[False], per_step


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_equals_eager(norm_type):
    ref = _mlp()
    model = copy.deepcopy(ref).to(D)
    x, y = _batch(0)
    for m, dev in ((ref, "cpu"), (model, D)):
        nn.functional.mse_loss(m(x.to(dev)) * 50, y.to(dev)).backward()
    want = nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type, foreach=True)
    before = genie.stats()["ops_recorded"]
    got = nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type)
    recorded = genie.stats()["ops_recorded"] - before
    assert recorded <= 10, recorded  # _foreach_norm, stack, norm, the clip factor, _foreach_mul_
    check = torch.equal if real_device(0).type == "cpu" else \
        lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert check(got.cpu(), want)
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert check(q.grad.cpu(), p.grad)


def test_captured_step_records_foreach_ops_and_counts_steps_on_the_host():
    """``genie.capture()`` of a training step: the optimizer region is a few ``_foreach_`` ops;
    the CPU step counters (``_foreach_add_(steps, torch.tensor(1.0))``, a literal of the block)
    are incremented on the host, as eagerly."""
    model = _mlp().to(D)
    opt = OPTIMIZERS["adamw"](model.parameters())
    _steps(model, opt, D)
    x, y = _batch(0)
    with genie.capture() as g:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    ops = [str(i.op) for i in g.infos() if i.region == "optimizer"]
    ops = [op for op in ops if op != "genie.upload"]  # the literal 1.0 (its upload is unused)
    assert 0 < len(ops) <= 12 and all("_foreach_" in op for op in ops), ops
    steps = [s["step"] for s in opt.state.values()]
    assert all(type(t) is torch.Tensor and t.item() == STEPS + 1 for t in steps)
