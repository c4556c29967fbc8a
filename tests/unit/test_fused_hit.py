"""The fused hit path (genie.executor._run_hit): a read whose slice a cached plan serves as it is
runs from the column match itself (no tape, no backend dispatch), with the general path
(run_tape) as its reference: the same values, the same nodes bound, the same counters, the same
errors."""

import gc
import traceback

import pytest
import torch

import genie
from genie import executor, passes, plan_cache
from genie.device import real_device
from genie.passes import pipeline

D = "remote_accelerator"
_OFF = "the settings turn the fused path off (GENIE_NATIVE_BIND/REPLAY, index checks)"


@pytest.fixture(autouse=True)
def _no_memory_tracking(monkeypatch):
    """Runs compute their high-water marks once a peak was asked for anywhere in the process
    (max_memory_allocated: the device-generic tests, test_step_tape), and the fused path then
    steps aside (executor._fusing): each test here starts from a process that asked for none."""
    from genie import memory

    monkeypatch.setattr(memory, "_tracking", [False])


@pytest.fixture(params=[True, False], ids=["fused", "general"])
def fused(request, monkeypatch):
    """Each test runs with the fused path allowed and without it (the reference)."""
    if not executor._fuse[0] and request.param:
        pytest.skip(_OFF)
    monkeypatch.setattr(executor, "_fuse", [request.param])
    plan_cache.clear()
    return request.param


def _adamw_steps(dev, steps=16):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).to(dev)
    x, t = torch.randn(4, 8).to(dev), torch.randn(4, 8).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)  # new floats every step (bias corrections)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(m(x), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in m.parameters()]


def test_a_training_step_runs_fused_with_eagers_values(fused):
    before = genie.stats()
    losses, params = _adamw_steps(D)
    s = genie.stats()
    got = {k: s.get(k, 0) - before.get(k, 0) for k in ("fused_hits", "plan_cache_hits")}
    want_losses, want_params = _adamw_steps("cpu")
    assert losses == pytest.approx(want_losses, rel=1e-5)
    for p, q in zip(params, want_params, strict=True):
        torch.testing.assert_close(p, q)
    if fused:
        assert got["fused_hits"] >= 4, got  # the steady steps, once its passes are settled (verified, timed)
    else:
        assert got["fused_hits"] == 0


def test_both_paths_bind_and_count_alike(monkeypatch):
    """The same program read through each path: bit-equal values, the same nodes executed and
    holding values, the same counters but the fused path's own."""
    if not executor._fuse[0]:
        pytest.skip(_OFF)
    seen = {}
    for on in (False, True):
        monkeypatch.setattr(executor, "_fuse", [on])
        plan_cache.clear()
        genie.reset_stats()
        torch.manual_seed(0)
        w = torch.randn(6, 6, device=D)
        genie.materialize(w)
        vals, states = [], []
        for step in range(6):
            lr = 0.5 / (step + 1)  # a float parameter that changes every step
            mid = (w * lr).exp()  # held: bound with its value
            y = (mid @ w + torch.rand(6, 6, device=D)).sum()  # rng: a new (seed, offset) a step
            vals.append(y.item())
            states.append((mid._node.executed, mid._node.values[0] is not None,
                           y._node.executed, len(mid._node.leaves or ())))
            w.add_(mid, alpha=-0.01)  # a pending write, run by the next read
        s = genie.stats()
        seen[on] = (vals, states, w.cpu(), {k: s.get(k, 0) for k in (
            "plan_cache_hits", "plan_cache_misses", "nodes_executed", "values_freed",
            "native_replays", "materializations", "step_tapes")}, s.get("fused_hits", 0))
    assert seen[True][4] >= 3 and seen[False][4] == 0
    assert seen[True][0] == seen[False][0]  # bit-equal
    assert seen[True][1] == seen[False][1]
    assert torch.equal(seen[True][2], seen[False][2])
    assert seen[True][3] == seen[False][3]


def _growing(step, w):
    """A decode step's kind of read: an input one row longer every step (a hit of other
    shapes)."""
    x = torch.arange(float(4 * (step + 2)), device=D).view(step + 2, 4)
    genie.materialize(x)
    return ((x * 0.5).exp().sum(0) + w).sum()


def _uploading(step, w):
    """A read that uploads a host tensor it made this step (a parameter of the plan)."""
    return (torch.tensor([float(step), 1.0, 2.0, 3.0], device=D) * w).sum()


@pytest.mark.parametrize("read", [_growing, _uploading], ids=["other-shapes", "host-tensor"])
def test_hits_of_other_shapes_and_host_tensors_run_fused_as_the_general_path(monkeypatch, read):
    if not executor._fuse[0]:
        pytest.skip(_OFF)
    keys = ("plan_cache_hits", "plan_cache_generic_hits", "plan_cache_misses", "nodes_executed",
            "values_freed", "native_replays", "passes_waiting", "uploads")
    seen = {}
    for on in (False, True):
        monkeypatch.setattr(executor, "_fuse", [on])
        plan_cache.clear()
        w = torch.ones(4, device=D)
        genie.materialize(w)
        genie.reset_stats()
        vals = [read(step, w).item() for step in range(8)]
        s = genie.stats()
        seen[on] = (vals, {k: s.get(k, 0) for k in keys}, s.get("fused_hits", 0))
    assert seen[True][2] >= 4 and seen[False][2] == 0
    assert seen[True][0] == seen[False][0]  # bit-equal
    assert seen[True][1] == seen[False][1]
    cpu = torch.ones(4)
    want = [(torch.arange(float(4 * (k + 2))).view(k + 2, 4) * 0.5).exp().sum(0).add(cpu).sum()
            if read is _growing else (torch.tensor([float(k), 1.0, 2.0, 3.0]) * cpu).sum()
            for k in range(8)]
    assert seen[True][0] == pytest.approx([v.item() for v in want], rel=1e-6)


def _failing_reads(runs):
    """Reads of ``a`` and ``y`` whose sixth fails in its second op (an index only the data
    shows is out of range): what it raised, and the state it left; ``runs`` is emptied before
    each read."""
    x = torch.arange(5.0, device=D)
    genie.materialize(x)
    for k in range(6):
        i = torch.tensor([k], device=D)
        genie.materialize(i)  # an input of the read, not a host tensor of it
        a = x * 3  # runs before the failing op: bound
        y = x.index_select(0, i) * 2  # the failing op, and one after it: left pending
        runs.clear()
        try:
            genie.materialize(a, y)
        except Exception as e:  # noqa: BLE001 - compared between the paths below
            return e, a, y
    pytest.fail("no read failed")


@pytest.mark.kernel_error  # an out-of-range index only the data shows, on the device
def test_an_error_in_a_fused_replay_is_the_general_paths(fused, monkeypatch):
    runs = []
    run_tape = executor.run_tape
    monkeypatch.setattr(executor, "run_tape", lambda *a: runs.append(1) or run_tape(*a))
    e, a, y = _failing_reads(runs)
    with pytest.raises(IndexError) as eager:
        torch.arange(5.0).index_select(0, torch.tensor([5]))
    assert isinstance(e, genie.ExecutionError) and isinstance(e, IndexError)
    assert str(eager.value) in str(e) and e.op == torch.ops.aten.index_select.default
    assert e.index == 1 and e.partial is None and type(e.__cause__) is IndexError
    assert e.__cause__.__traceback__ is None
    frames = traceback.extract_tb(e.__traceback__)
    assert frames[-1].filename.endswith("executor.py")
    assert not any("/backends/" in f.filename for f in frames)
    # the failing read's run: the fused one (no tape run) or the general one
    assert len(runs) == (0 if fused else 1)
    # nothing half-bound: the op before ran once and is bound; the failing op and the one
    # after it stay pending, and a read of them fails again
    assert a._node.executed and torch.equal(a._node.values[0], torch.arange(5.0) * 3)
    assert not y._node.executed and not y._node.leaves[0].node.executed
    torch.testing.assert_close(a.cpu(), torch.arange(5.0) * 3)
    with pytest.raises(IndexError):
        y.cpu()


@pytest.mark.usefixtures("fresh_passes")
def test_a_settled_edit_script_runs_fused(fused, monkeypatch):
    """A plan whose passes are on (fold: its constants computed once) runs fused through its
    edit script, a step's float reaching the optimized program."""
    monkeypatch.setenv("GENIE_PASSES_GATE", "0")  # on after its verified run, no timing
    passes.set_passes(["fold"])
    try:
        w = torch.ones(6, device=D)
        genie.materialize(w)
        got = []
        for step in range(6):
            lr = 1.0 / (step + 1)
            got.append((w * torch.arange(6, device=D).float().exp() * lr).sum().item())
        (rep,) = passes.report()
        assert rep.passes == ("fold",) and rep.instrs_after < rep.instrs_before
        want = [(torch.arange(6).float().exp() / (s + 1)).sum().item() for s in range(6)]
        assert got == pytest.approx(want, rel=1e-6)
        (plan,) = [p for p in plan_cache.cache().plans()
                   if isinstance(p.artifacts.get("passes"), pipeline.Script)]
        f = plan.artifacts.get("fused")
        if fused:  # its program: the optimized tape's, reading the step's float
            assert f.program is not None and f.at is not None and f.consts
            assert genie.stats()["fused_hits"] >= 3
        else:
            assert f is None
    finally:
        passes.set_passes(None)


def assert_same_peaks(got, want):
    """``_peaks`` of two runs: values equal, and the memory figures too; on CUDA they are the
    caching allocator's own (not Genie's accounting), which a fused and a general run of one
    step can leave one 512-byte block apart."""
    if real_device(0).type == "cpu":
        assert got == want
        return
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert all(abs(a - b) <= 512 for g, w in zip(got, want, strict=True)
               for a, b in zip(g[2:], w[2:], strict=True)), (got, want)


def _peaks(steps=16):
    """A training step's loss and the device's peak after each step, from a peak reset before
    the first: the peak counts the values alive inside each run (memory tracking on)."""
    gc.collect()  # (what an earlier call left in cycles is not held during this one)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).to(D)
    x, t = torch.randn(4, 8).to(D), torch.randn(4, 8).to(D)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    big = torch.linspace(0, 1, 4096).to(D)  # its transients: 16 KiB each, alive only in a run
    dev = torch.device(D)
    torch.remote_accelerator.reset_peak_memory_stats(dev)
    base = torch.remote_accelerator.memory_allocated(dev)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(m(x), t)
        loss.backward()
        opt.step()
        out.append((loss.item(), (big * 2).exp().sum().item(),
                    torch.remote_accelerator.max_memory_allocated(dev) - base,
                    torch.remote_accelerator.memory_allocated(dev) - base))
    return out


def test_memory_tracking_keeps_the_fused_path_with_the_general_paths_peaks(monkeypatch):
    """Once a peak was asked for, a hit of its plan's own shapes still runs fused, and the peaks
    it reports are the general path's (the run's high-water mark, known once per plan)."""
    if not executor._fuse[0]:
        pytest.skip(_OFF)
    from genie import memory

    monkeypatch.setattr(memory, "_tracking", [True])
    seen = {}
    for on in (False, True):
        monkeypatch.setattr(executor, "_fuse", [on])
        plan_cache.clear()
        before = genie.stats().get("fused_hits", 0)
        seen[on] = (_peaks(), genie.stats().get("fused_hits", 0) - before)
    assert seen[False][1] == 0 and seen[True][1] >= 3, (seen[False][1], seen[True][1])
    assert_same_peaks(seen[True][0], seen[False][0])
    assert seen[True][0][-1][2] >= seen[True][0][-1][3] + (16 << 10)  # a run's transients


def test_memory_tracking_sends_a_hit_of_other_shapes_to_the_general_path(monkeypatch):
    if not executor._fuse[0]:
        pytest.skip(_OFF)
    from genie import memory

    monkeypatch.setattr(memory, "_tracking", [True])
    plan_cache.clear()
    w = torch.ones(4, device=D)
    genie.materialize(w)
    genie.reset_stats()
    got = [_growing(step, w).item() for step in range(6)]
    s = genie.stats()
    assert s.get("plan_cache_generic_hits", 0) >= 4 and s.get("fused_hits", 0) == 0
    want = [(torch.arange(float(4 * (k + 2))).view(k + 2, 4) * 0.5).exp().sum(0).add(1).sum()
            .item() for k in range(6)]
    assert got == pytest.approx(want, rel=1e-6)
