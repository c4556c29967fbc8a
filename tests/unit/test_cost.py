"""The cost model (genie.remote.cost): priors, measurements, FLOPs from schemas and shapes."""

from __future__ import annotations

import pytest
import torch

import genie  # noqa: F401  (registers remote_accelerator)
from genie.remote import cost
from genie.remote.cost import CLIENT, CostModel, Work, flops_of, op_flops

aten = torch.ops.aten
M = torch.device("meta")


def test_priors_by_link_kind_and_device() -> None:
    m = CostModel()
    assert m.link_bytes_per_s(CLIENT, "tcp://a:1") == cost.CLIENT_LINK_PRIOR[0]
    assert m.link_bytes_per_s("tcp://a:1", "tcp://b:1") == cost.PEER_LINK_PRIOR[0]
    assert m.server_flops_per_s("tcp://a:1") == cost.DEVICE_PRIORS["cpu"][0]
    m.set_device("tcp://g:1", "cuda:0")
    assert m.server_flops_per_s("tcp://g:1") == cost.DEVICE_PRIORS["cuda"][0]
    assert m.transfer_s(0, CLIENT, "tcp://a:1") == cost.CLIENT_LINK_PRIOR[1]


def test_measured_bandwidth_and_latency_move_the_estimate() -> None:
    m = CostModel()
    for _ in range(30):
        m.observe_transfer(100, 2e-4, CLIENT, "s")           # small: latency
        m.observe_transfer(100 << 20, 1.0, CLIENT, "s")      # large: bandwidth
    assert m.link_latency_s(CLIENT, "s") == pytest.approx(2e-4, rel=1e-3)
    assert m.link_bytes_per_s(CLIENT, "s") == pytest.approx((100 << 20) / (1.0 - 2e-4),
                                                            rel=1e-2)
    # the reverse direction, unmeasured, uses the measured one
    assert m.link_bytes_per_s("s", CLIENT) == m.link_bytes_per_s(CLIENT, "s")
    # a peer link is its own
    assert m.link_bytes_per_s("s", "t") == cost.PEER_LINK_PRIOR[0]


def test_measured_flop_rate_and_op_cost() -> None:
    m = CostModel()
    m.set_compute("s", op_s=0.0, pin=False)
    for _ in range(30):
        m.observe_run(10**9, 1, 0.1, "s")
    assert m.server_flops_per_s("s") == pytest.approx(1e10, rel=1e-3)
    for _ in range(30):
        m.observe_run(0, 100, 0.01, "s")
    assert m.server_op_s("s") == pytest.approx(1e-4, rel=1e-3)
    assert m.compute_s(10**10, "s", ops=10) == pytest.approx(1.0 + 1e-3, rel=1e-3)


def test_pinned_values_ignore_measurements() -> None:
    m = CostModel()
    m.set_link(CLIENT, "s", bytes_per_s=1e3, latency_s=0.0)
    m.observe_transfer(10 << 20, 1e-3, CLIENT, "s")
    assert m.link_bytes_per_s(CLIENT, "s") == 1e3
    m.set_compute("s", flops_per_s=1.0)
    m.observe_run(10**9, 1, 0.1, "s")
    assert m.server_flops_per_s("s") == 1.0


def test_choice_follows_the_figures() -> None:
    m = CostModel()
    m.set_link(CLIENT, "s", bytes_per_s=1e6, latency_s=0.0)
    m.set_compute("s", flops_per_s=1e12, op_s=0.0)
    c = m.choose_recompute_or_transfer(nbytes=1 << 20, flops=10**9, ops=4, server="s")
    assert c.kind == "recompute" and c.recompute_s < c.transfer_s
    m.set_compute("s", flops_per_s=1e6, op_s=0.0)
    c = m.choose_recompute_or_transfer(nbytes=1 << 20, flops=10**9, ops=4, server="s")
    assert c.kind == "transfer" and c.transfer_s < c.recompute_s
    # what a recompute itself must upload counts against it
    m.set_compute("s", flops_per_s=1e12, op_s=0.0)
    c = m.choose_recompute_or_transfer(nbytes=1 << 20, flops=10**9, ops=4, server="s",
                                       recompute_bytes=2 << 20)
    assert c.kind == "transfer"


def test_bad_settings_are_refused_with_the_reason() -> None:
    m = CostModel()
    with pytest.raises(ValueError, match="bytes_per_s must be > 0"):
        m.set_link(CLIENT, "s", bytes_per_s=0)
    with pytest.raises(ValueError, match="flops_per_s must be > 0"):
        m.set_compute("s", flops_per_s=-1)


def test_op_flops_from_formulas_tags_and_schemas() -> None:
    a, b = torch.empty(8, 16, device=M), torch.empty(16, 4, device=M)
    assert op_flops(aten.mm.default, (a, b), {}, torch.empty(8, 4, device=M)) == 2 * 8 * 16 * 4
    x = torch.empty(3, 8, 16, device=M)
    y = torch.empty(3, 16, 5, device=M)
    assert op_flops(aten.bmm.default, (x, y), {}, torch.empty(3, 8, 5, device=M)) == \
        2 * 3 * 8 * 16 * 5
    assert op_flops(aten.add.Tensor, (a, a), {}, a) == 128              # pointwise
    assert op_flops(aten.sum.default, (a,), {}, torch.empty((), device=M)) == 128  # reduction
    assert op_flops(aten.view.default, (a, [128]), {}, torch.empty(128, device=M)) == 0  # view
    assert op_flops(aten.t.default, (a,), {}, a.t()) == 0
    assert op_flops(aten.add_.Tensor, (a, a), {}, a) == 128             # in place: computes


def test_flops_of_a_recorded_tape_matches_eager_shapes() -> None:
    from genie import planner

    w = torch.randn(32, 64, device="remote_accelerator")
    x = torch.randn(16, 64, device="remote_accelerator")
    y = torch.relu(x @ w.t()).sum()
    tape = planner.build_tape([(y._node, 0)])
    work = flops_of(tape)
    mm = 2 * 16 * 64 * 32
    assert work.flops >= mm + 16 * 32 + 16 * 32
    assert work.flops <= mm + 4 * (16 * 64 + 32 * 64 + 16 * 32)
    assert work.ops == len([i for i in tape.instrs if i.op != "genie.upload"])
    assert float(y.cpu()) == pytest.approx(float(torch.relu(x.cpu() @ w.cpu().t()).sum()),
                                           rel=1e-4)


def test_work_adds() -> None:
    assert Work(3, 1) + Work(4, 2) == Work(7, 3)


def test_shared_model() -> None:
    assert cost.model() is cost.model()


def test_an_unmeasured_server_uses_what_its_peers_of_one_device_type_measured() -> None:
    """A pool of twins, one measured: the other is estimated alike, not at the prior (a
    measured server faster than the prior looked faster than its unmeasured twin, and placement
    kept work off it); never across device types, never over a server's own figures."""
    m = CostModel()
    a, b, c, g = "tcp://a:1", "tcp://b:1", "tcp://c:1", "tcp://g:1"
    for s in (a, b, c):
        m.set_device(s, "cpu")
    m.set_device(g, "cuda:0")
    for _ in range(3):
        m.observe_run(0, 100, 100 * 16e-6, a)  # op-bound: 16 us per op
    assert m.server_op_s(a) == pytest.approx(16e-6)
    assert m.server_op_s(b) == m.server_op_s(a)
    assert m.compute_s(10**6, b, 137) == m.compute_s(10**6, a, 137)
    assert m.server_flops_per_s(b) == cost.DEVICE_PRIORS["cpu"][0]  # measured nowhere
    assert m.server_op_s(g) == cost.DEVICE_PRIORS["cuda"][1]  # another device type
    m.observe_run(0, 100, 100 * 30e-6, c)  # a second measured twin: the mean of both
    assert m.server_op_s(b) == pytest.approx(23e-6)
    assert m.server_op_s(c) == pytest.approx(30e-6) and m.server_op_s(a) == pytest.approx(16e-6)
    m.set_compute(b, op_s=5e-5, pin=False)  # a figure set for a server is its own
    assert m.server_op_s(b) == 5e-5
    # the first sample of a server splits its time by the figures it was estimated with (the
    # twins' 23 us per op)
    m.observe_run(10**8, 100, 100 * 23e-6 + 10**8 / 1e10, "tcp://d:1")
    assert m.server_flops_per_s("tcp://d:1") == pytest.approx(1e10, rel=1e-6)
