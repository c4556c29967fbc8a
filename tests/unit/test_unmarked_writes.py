"""Writes a schema does not mark: the batch norms' running statistics (genie.meta.UNMARKED_WRITES).

torch's schema of ``native_batch_norm`` says ``Tensor? running_mean`` where a training call
updates it in place. Genie's op policy declares such writes, so that a read of a running
statistic waits for the step that updates it, and the passes' verification run (which copies the
inputs a plan writes) does not apply an update twice. Every test compares with eager.
"""

from __future__ import annotations

import copy

import pytest
import torch

import genie
from genie import passes
from genie.meta import UNMARKED_WRITES, policy

pytestmark = pytest.mark.usefixtures("fresh_passes")

DEV = "remote_accelerator:0"
aten = torch.ops.aten


def test_policy_declares_what_torch_schema_info_says_is_mutable():
    """Every argument torch's SchemaInfo calls mutable is among the policy's writes (unmarked
    where the schema does not say so), and a call with ``training=False`` writes none of them."""
    from genie.remote.allowlist import all_aten_overloads

    info_t, arg = torch._C._SchemaInfo, torch._C._SchemaArgument
    found = set()
    for op in all_aten_overloads():
        s = op._schema
        info = info_t(s)
        mutable = {i for i in range(len(s.arguments))
                   if info.is_mutable(arg(torch._C._SchemaArgType.input, i))}
        pol = policy(op)
        assert mutable <= set(pol.writes), op
        if pol.unmarked:
            found.add(op)
    nbn = aten.native_batch_norm.default
    assert {nbn, aten.native_batch_norm.out, aten.cudnn_batch_norm.default,
            *UNMARKED_WRITES} <= found
    p = policy(nbn)
    assert p.writes == p.unmarked == (3, 4) and p.names[p.write_flag] == "training"
    x, m, v = (torch.empty(0),) * 3
    assert p.call_writes((x, None, None, m, v, True, 0.1, 1e-5), {}) == (3, 4)
    assert p.call_writes((x, None, None, m, v, False, 0.1, 1e-5), {}) == ()
    assert policy(aten.native_batch_norm.out).call_writes(
        (x, None, None, m, v, False, 0.1, 1e-5), {"out": x}) == (8, 9, 10)


def test_batch_norm_update_stats_kernel_writes_what_the_table_says():
    """UNMARKED_WRITES's entries that the CPU build can run: their kernels do write."""
    x = torch.randn(4, 3, 5)
    rm, rv = torch.zeros(3), torch.ones(3)
    aten.batch_norm_update_stats(x, rm, rv, 0.5)
    assert not rm.eq(0).all() and not rv.eq(1).all()
    assert policy(aten.batch_norm_update_stats.default).writes == (1, 2)


def test_batch_norm_update_stats_on_the_device_is_refused_not_run_past_its_readers():
    """It has no meta kernel: an op that writes must be recorded, and running it now would
    write the statistics under a pending reader (``y`` below would see the update). A known
    gap (docs/architecture.md, "Writes a schema does not mark"), refused with the reason."""
    rm = torch.zeros(3, device=DEV)
    y = rm + 1
    with pytest.raises(genie.UnsupportedOpError, match="no meta kernel"):
        torch.batch_norm_update_stats(torch.randn(4, 3, device=DEV), rm, torch.ones(3, device=DEV),
                                      0.5)
    torch.testing.assert_close(y.cpu(), torch.ones(3))
    torch.testing.assert_close(rm.cpu(), torch.zeros(3))


def _nets(kind: str, **bn: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    if kind == "2d":
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, **bn),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    else:
        m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5, **bn),
                                torch.nn.ReLU(), torch.nn.Linear(5, 2))
    return m, copy.deepcopy(m).to(DEV)


def _buffers(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in m.named_buffers()}


def train_against_eager(kind: str, steps: int = 5, **bn: object) -> None:
    """``steps`` SGD steps on the CPU and the device, the running statistics read after each
    (they must be the step's: a read waits for the update), then an eval forward."""
    cpu, lazy = _nets(kind, **bn)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (cpu, lazy)]
    g = torch.Generator().manual_seed(1)
    shape = (5, 3, 8, 8) if kind == "2d" else (7, 6)
    for step in range(steps):
        x = torch.randn(*shape, generator=g)
        losses = []
        for m, opt, xx in ((cpu, opts[0], x), (lazy, opts[1], x.to(DEV))):
            opt.zero_grad()
            loss = m(xx).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss)
        if step % 2:  # the buffers read between steps (before the loss, then after it)
            torch.testing.assert_close(_buffers(lazy), _buffers(cpu), rtol=1e-5, atol=1e-6,
                                       msg=lambda s: f"step {step}: {s}")
        torch.testing.assert_close(losses[1].cpu(), losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_buffers(lazy), _buffers(cpu), rtol=1e-5, atol=1e-6)
    for m in (cpu, lazy):
        m.eval()
    x = torch.randn(*shape, generator=g)
    with torch.no_grad():
        for _ in range(3):  # a plan's first optimized run too: eval writes nothing
            torch.testing.assert_close(lazy(x.to(DEV)).cpu(), cpu(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_buffers(lazy), _buffers(cpu), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.parametrize("names", [None, ["fold"], ["cse"], ["dce"], ["recompute"],
                                   ["split_foreach"], []])
def test_batch_norm_training_matches_eager_under_each_pass(kind, names, monkeypatch):
    monkeypatch.setenv("GENIE_PASSES_GATE", "0")  # kept after verification (no timing noise)
    passes.set_passes(names)
    train_against_eager(kind)


@pytest.mark.parametrize("bn", [{"momentum": None}, {"track_running_stats": False},
                                {"affine": False}])
def test_batch_norm_variants_match_eager(bn, monkeypatch):
    """A cumulative average (``momentum=None``), no running statistics (a guard: nothing is
    written there), no affine parameters."""
    monkeypatch.setenv("GENIE_PASSES_GATE", "0")
    train_against_eager("2d", **bn)


def test_a_read_of_the_running_mean_waits_for_the_forward_that_updates_it():
    """No step, no optimizer: the forward alone updates the statistics, and nothing else reads
    them before ``running_mean`` is read."""
    torch.manual_seed(0)
    cpu = torch.nn.BatchNorm1d(3)
    lazy = torch.nn.BatchNorm1d(3).to(DEV)
    x = torch.randn(8, 3)
    for _ in range(3):
        cpu(x)
        lazy(x.to(DEV))
        torch.testing.assert_close(lazy.running_mean.cpu(), cpu.running_mean)
        torch.testing.assert_close(lazy.running_var.cpu(), cpu.running_var)
    assert int(lazy.num_batches_tracked.cpu()) == 3



def test_only_a_training_batch_norm_is_a_pending_write_of_its_statistics():
    """Recorded (by Python, then natively: the loop's later calls), a training call is a pending
    write on the running statistics' storages, and an eval call (``training=False``) is not: it
    reads them, and an eval forward's plan writes nothing."""
    f = torch.nn.functional.batch_norm
    for _ in range(3):
        x = torch.randn(4, 3, device=DEV)
        rm, rv = torch.zeros(3, device=DEV), torch.ones(3, device=DEV)
        genie.materialize(x, rm, rv)
        stats = [t._node.storages[t._out] for t in (rm, rv)]
        f(x, rm, rv, training=False)
        assert [len(s.pending_writes) for s in stats] == [0, 0]
        f(x, rm, rv, training=True)
        assert [len(s.pending_writes) for s in stats] == [1, 1]


def test_instance_norm_with_running_statistics_matches_eager():
    """``instance_norm`` updates them through a batch norm of a repeated copy, then ``copy_``."""
    torch.manual_seed(0)
    cpu = torch.nn.InstanceNorm2d(3, track_running_stats=True)
    lazy = copy.deepcopy(cpu).to(DEV)
    for _ in range(3):
        x = torch.randn(2, 3, 4, 4)
        torch.testing.assert_close(lazy(x.to(DEV)).cpu(), cpu(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_buffers(lazy), _buffers(cpu), rtol=1e-5, atol=1e-6)
