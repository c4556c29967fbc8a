"""torch.compile over Genie (genie/dynamo.py): equal to eager, lazy, and without warnings."""

import logging
import warnings

import torch

import genie

DEV = "remote_accelerator:0"


def test_compiled_function_over_lazy_tensors_equals_eager_without_warnings(caplog):
    torch._dynamo.reset()  # a fresh compile: Dynamo traces f here, inside the checks below

    def f(x, w):
        h = (x @ w).relu()
        return torch.nn.functional.layer_norm(h, h.shape[-1:]) * 2 + 1

    cf = torch.compile(f, backend="eager")
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")  # Dynamo's _make_wrapper_subclass warning fails the test
        genie.reset_stats()
        out = cf(x.to(DEV), w.to(DEV))
        assert type(out) is genie.LazyTensor
        assert genie.stats().get("materializations", 0) == 0  # still lazy
        torch.testing.assert_close(out.cpu(), f(x, w))
        again = cf(x.to(DEV), w.to(DEV))
        torch.testing.assert_close(again.cpu(), f(x, w))
        assert f"{again.sum():.3f}" == f"{f(x, w).sum():.3f}"
    # Dynamo reports through logging too (graph breaks, recompiles): none of that either
    assert not [r for r in caplog.records if r.name.startswith("torch")], \
        [r.getMessage()[:200] for r in caplog.records]


def test_compiled_training_step_equals_eager():
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 3)
    lazy = torch.nn.Linear(6, 3)
    lazy.load_state_dict(ref.state_dict())
    lazy.to(DEV)
    x = torch.randn(5, 6)

    def step(m, inp):
        loss = m(inp).square().mean()
        loss.backward()
        return loss

    cstep = torch.compile(step, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lz = cstep(lazy, x.to(DEV))
    rl = step(ref, x)
    torch.testing.assert_close(lz.cpu(), rl.detach())
    torch.testing.assert_close(lazy.weight.grad.cpu(), ref.weight.grad)
