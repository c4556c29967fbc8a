"""Factories are lazy, one node per call, and equal eager."""

import pytest
import torch

import genie

D = "remote_accelerator"

FACTORIES = [
    ("zeros", lambda d: torch.zeros(2, 3, device=d)),
    ("ones", lambda d: torch.ones(2, 3, dtype=torch.float64, device=d)),
    ("full", lambda d: torch.full((2, 2), 3.5, device=d)),
    ("empty_shape", lambda d: torch.empty(4, 5, device=d).shape),
    ("eye", lambda d: torch.eye(3, 4, device=d)),
    ("arange", lambda d: torch.arange(0, 10, 3, device=d)),
    ("linspace", lambda d: torch.linspace(0, 1, 7, device=d)),
    ("logspace", lambda d: torch.logspace(0, 2, 5, device=d)),
    ("tensor", lambda d: torch.tensor([[1, 2], [3, 4]], device=d)),
    ("as_tensor", lambda d: torch.as_tensor([1.5, 2.5], device=d)),
    ("scalar_tensor", lambda d: torch.scalar_tensor(2.0, device=d)),
    ("zeros_like", lambda d: torch.zeros_like(torch.ones(2, 3, device=d))),
    ("ones_like", lambda d: torch.ones_like(torch.ones(2, 3, device=d), dtype=torch.int64)),
    ("full_like", lambda d: torch.full_like(torch.ones(2, 3, device=d), 7)),
    ("new_zeros", lambda d: torch.ones(2, device=d).new_zeros(3, 2)),
    ("tril_indices", lambda d: torch.tril_indices(3, 3, device=d)),
]


@pytest.mark.parametrize("name,make", FACTORIES, ids=[f[0] for f in FACTORIES])
def test_factory_equals_eager(name, make):
    expected = make("cpu")
    got = make(D)
    if isinstance(expected, torch.Size):
        assert got == expected
        return
    assert got.device.type == D
    out = got.cpu()
    torch.testing.assert_close(out, expected)
    assert out.dtype == expected.dtype and out.stride() == expected.stride()


def test_factories_are_lazy_and_one_node_each():
    genie.reset_stats()
    x = torch.randn(8, 8, device=D)
    assert genie.stats()["factories_recorded"] == 1
    assert genie.stats().get("nodes_executed", 0) == 0
    assert x._node.name == "aten.randn.default"  # not empty + normal_
    assert not x._node.executed


def test_like_factories_do_not_depend_on_input_values():
    x = torch.randn(4, 4, device=D)
    y = torch.zeros_like(x)
    y.cpu()
    assert not x._node.executed  # only the metadata of x was needed


def test_random_factories_shapes_and_dtypes():
    for make in (lambda d: torch.rand(3, 2, device=d), lambda d: torch.randn(5, device=d),
                 lambda d: torch.randint(0, 10, (4,), device=d),
                 lambda d: torch.randperm(6, device=d),
                 lambda d: torch.normal(0.0, 1.0, (3,), device=d)):
        e, g = make("cpu"), make(D).cpu()
        assert e.shape == g.shape and e.dtype == g.dtype
    p = torch.randperm(50, device=D).cpu()
    assert sorted(p.tolist()) == list(range(50))
    r = torch.randint(3, 7, (1000,), device=D).cpu()
    assert r.min() >= 3 and r.max() < 7


def test_upload_is_one_node_holding_a_snapshot():
    src = torch.arange(6.0).reshape(2, 3)
    genie.reset_stats()
    t = src.to(D)
    src.add_(100)  # eager .to() copied already: later host writes must not leak in
    assert t._node.name == "genie.upload"
    torch.testing.assert_close(t.cpu(), torch.arange(6.0).reshape(2, 3))
    assert genie.stats()["nodes_executed"] == 1


def test_copy_into_device_tensor():
    t = torch.zeros(2, 3, device=D)
    t.copy_(torch.ones(3))  # broadcast copy, as eager
    torch.testing.assert_close(t.cpu(), torch.ones(2, 3))
    with pytest.raises(RuntimeError):
        t.copy_(torch.ones(4))  # eager's broadcast error, at the call site
