"""RNG contract: (seed, offset) per random op, fixed at record time.

Values are reproducible under ``torch.manual_seed`` and do not depend on which values are
materialized first. They are not bit-equal to eager CPU's stream (docs/semantics.md says why).
"""

import torch

D = "remote_accelerator"


def _draw():
    return [torch.randn(5, device=D), torch.rand(3, device=D),
            torch.nn.functional.dropout(torch.ones(100, device=D), 0.5, training=True)]


def test_reproducible_under_manual_seed():
    torch.manual_seed(1)
    a = [t.cpu() for t in _draw()]
    torch.manual_seed(1)
    b = [t.cpu() for t in _draw()]
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_independent_of_materialization_order():
    torch.manual_seed(2)
    a = [t.cpu() for t in _draw()]
    torch.manual_seed(2)
    ts = _draw()
    b = [t.cpu() for t in reversed(ts)][::-1]
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_different_draws_differ_and_distribution_is_sane():
    torch.manual_seed(3)
    x, y = torch.randn(10000, device=D), torch.randn(10000, device=D)
    xc, yc = x.cpu(), y.cpu()
    assert not torch.equal(xc, yc)
    assert abs(xc.mean().item()) < 0.05 and abs(xc.std().item() - 1) < 0.05
    d = torch.nn.functional.dropout(torch.ones(10000, device=D), 0.3, training=True).cpu()
    assert abs((d == 0).float().mean().item() - 0.3) < 0.03


def test_explicit_generator():
    g = torch.Generator(device=D).manual_seed(9)
    a = torch.randn(4, device=D, generator=g).cpu()
    g.manual_seed(9)
    b = torch.randn(4, device=D, generator=g).cpu()
    assert torch.equal(a, b)


def test_does_not_disturb_the_host_generator():
    torch.manual_seed(5)
    expected = torch.randn(3)
    torch.manual_seed(5)
    torch.randn(4, device=D).cpu()
    assert torch.equal(torch.randn(3), expected)
