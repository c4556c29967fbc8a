"""Recording: every op is recorded with eager's metadata, through a cache; errors at the call site."""

import pytest
import torch

import genie
from genie import _C
from genie.meta import meta_cache

D = "remote_accelerator"


def test_recorded_metadata_equals_eager():
    a = torch.randn(4, 6)
    cases = [
        lambda t: t.t(), lambda t: t[1:, ::2], lambda t: t.sum(0), lambda t: t @ t.t(),
        lambda t: t.to(torch.float64), lambda t: t.view(2, 12), lambda t: t.unsqueeze(1).expand(4, 3, 6),
        lambda t: torch.cat([t, t], 1), lambda t: t.max(dim=1).indices, lambda t: t > 0,
    ]
    for f in cases:
        e = f(a)
        g = f(a.to(D))
        assert (g.shape, g.dtype, g.stride(), g.storage_offset()) == (
            e.shape, e.dtype, e.stride(), e.storage_offset())
        torch.testing.assert_close(g.cpu(), e)


def test_nothing_runs_while_recording():
    x = torch.randn(64, 64, device=D)
    y = (x @ x).relu().sum(0)
    assert y.shape == (64,) and y.dtype == torch.float32 and y.device.type == D
    assert genie.stats().get("nodes_executed", 0) == 0


def test_meta_cache_hits_on_repeated_ops():
    x = torch.randn(5, 5, device=D)
    meta_cache.clear()
    genie.reset_stats()
    for _ in range(10):
        x = x * 2
    s = genie.stats()
    assert s["meta_cache_misses"] == 1 and s["meta_cache_hits"] == 9
    # different scalar arguments are different keys only when the output could differ:
    y = torch.ones(3, device=D)
    genie.reset_stats()
    y.add(1)
    y.add(1)
    y.add(2.5)
    assert genie.stats()["meta_cache_hits"] >= 1


@pytest.mark.parametrize("bad", [
    lambda d: torch.ones(2, 3, device=d) + torch.ones(4, device=d),
    lambda d: torch.ones(2, 3, device=d) @ torch.ones(2, 3, device=d),
    lambda d: torch.ones(2, 3, device=d).view(7),
    lambda d: torch.ones(2, 3, device=d).sum(5),
    lambda d: torch.ones(2, device=d)[torch.tensor([True])],
    lambda d: torch.cat([torch.ones(2, device=d), torch.ones(2, 2, device=d)]),
])
def test_errors_raise_at_call_site_with_eager_type(bad):
    with pytest.raises(Exception) as eager:
        bad("cpu")
    with pytest.raises(type(eager.value)):
        bad(D)


def test_device_mismatch_raises_like_eager_cuda():
    with pytest.raises(RuntimeError, match="device"):
        torch.ones(3, device=D) + torch.ones(3)
    # a 0-dim host tensor is a scalar, allowed by eager on every device
    torch.testing.assert_close((torch.ones(3, device=D) + torch.tensor(2.0)).cpu(),
                               torch.full((3,), 3.0))


def test_graph_stays_usable_after_an_error():
    x = torch.ones(2, 2, device=D)
    with pytest.raises(RuntimeError):
        x @ torch.ones(3, 3, device=D)
    torch.testing.assert_close((x + 1).cpu(), torch.full((2, 2), 2.0))


def test_unknown_argument_garbage_raises_typeerror():
    x = torch.ones(2, device=D)
    with pytest.raises(TypeError):
        torch.add(x, "nope")
    with pytest.raises(TypeError):
        genie.materialize(object())


def test_changing_float_operands_hit_the_meta_cache_but_shapes_still_follow_floats():
    x = torch.ones(4, device=D)
    x.add(0.5)  # warm
    genie.reset_stats()
    for i in range(5):
        x.add(1.0 / (i + 2))  # a decaying learning rate: same structure, new float each step
    assert genie.stats().get("meta_cache_misses", 0) == 0
    # floats that decide shapes (factories, float-typed arguments) are still keyed by value
    a = torch.arange(0, 1.5, 0.5, device=D)
    b = torch.arange(0, 2.5, 0.5, device=D)
    assert a.shape == (3,) and b.shape == (5,)
    img = torch.ones(1, 1, 2, 2, device=D)
    up = [torch.nn.functional.interpolate(img, scale_factor=s).shape for s in (2.0, 3.0)]
    assert up == [(1, 1, 4, 4), (1, 1, 6, 6)]


@pytest.fixture(params=["native", "python"])
def record_path(request):
    from genie.config import config

    saved = config.native_record
    config.native_record = request.param == "native"
    yield request.param
    config.native_record = saved


def test_detach_is_an_alias_of_the_same_value_with_no_node(record_path):
    """detach(x) shares x's node and output, one more holder its output counts
    (genie.lazy_tensor._detach_alias):
    eager's values, metadata and aliasing, on both record paths."""
    a = torch.randn(3, 4)
    x = a.to(D) * 2
    for _ in range(2):  # the second time through a learned native entry, where there is one
        d = x.detach()
        assert d._node is x._node and d._out == x._out and _C._wrapper_counts(d)
        assert (d.shape, d.stride(), d.storage_offset(), d.dtype, d.requires_grad) == (
            x.shape, x.stride(), x.storage_offset(), x.dtype, False)
    e = a * 2
    ed = e.detach()
    ed.add_(1)  # a write through the alias is seen by the original, as in eager
    d.add_(1)
    torch.testing.assert_close(x.cpu(), e)
    x.mul_(3)  # and the other way round
    e.mul_(3)
    torch.testing.assert_close(d.cpu(), ed)


def test_detach_keeps_the_value_after_the_original_dies(record_path):
    a = torch.randn(5)
    x = a.to(D) + 1
    d = x.detach()
    genie.materialize(x)  # x runs; its value is kept for d too (one more holder counted)
    del x
    torch.testing.assert_close(d.cpu(), a + 1)
    y = a.to(D).exp()
    dy = y.detach()
    del y  # dies before it runs: the pending node lives on through dy
    torch.testing.assert_close((dy * 2).cpu(), a.exp() * 2)


def test_a_value_two_tensors_hold_outlives_either(record_path):
    """``p.data = v`` binds p to v's value: both are holders v's output counts (graph.share), so
    the value lives while either does (before the counts, a token of p's own made the next run
    free it after ``del p``)."""
    a = torch.randn(4)
    v = a.to(D) * 2
    p = torch.zeros(4, device=D)
    p.data = v
    del p
    torch.testing.assert_close((v + 1).cpu(), a * 2 + 1)  # runs v's node
    torch.testing.assert_close(v.cpu(), a * 2)
    p = torch.zeros(4, device=D)  # and the other way round: the new value's tensor dies first
    v = a.to(D) * 3
    p.data = v
    del v
    torch.testing.assert_close((p + 1).cpu(), a * 3 + 1)
    torch.testing.assert_close(p.cpu(), a * 3)


def test_detach_of_a_conj_view_and_in_capture_records_the_op(record_path):
    z = torch.randn(3, dtype=torch.complex64)
    zc = z.to(D).conj()
    dz = zc.detach()  # math bits: recorded as an op, eager's bits
    assert dz.is_conj() and dz._node is not zc._node
    torch.testing.assert_close(dz.cpu(), z.conj())
    with genie.capture() as g:
        x = torch.ones(2, device=D)
        x.detach()
    assert any("detach" in str(n.op) for n in g.nodes)


def test_training_step_with_saved_outputs_equals_eager(record_path):
    """The autograd engine's detaches (outputs saved for backward, accumulated gradients)."""
    def run(dev):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1),
                                torch.nn.Sigmoid()).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        x = torch.randn(4, 6).to(dev)
        for _ in range(3):
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()
        return [p.detach().cpu() for p in m.parameters()]

    for g, e in zip(run(D), run("cpu"), strict=True):
        torch.testing.assert_close(g, e)
