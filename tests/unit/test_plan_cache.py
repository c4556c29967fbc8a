"""Plan cache: repeated structure plans once; per-step values are parameters; memory stays flat."""

import contextlib
import gc
import os
import subprocess
import sys

import pytest
import torch

import genie
from genie import plan_cache
from genie.config import config
from genie.graph import Node, live_nodes
from genie.lazy_tensor import LazyTensor

D = "remote_accelerator"


@pytest.fixture(autouse=True)
def _fresh_cache():
    plan_cache.clear()
    plan_cache.enable(True)
    yield
    plan_cache.enable(True)


def _count(cls) -> int:
    gc.collect()
    if cls is Node:
        return live_nodes()  # recorded nodes are mostly untracked: not in gc.get_objects()
    return sum(type(o) is cls for o in gc.get_objects())


def test_a_thousand_identical_training_steps_plan_once_and_stay_flat():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ref.load_state_dict(model.state_dict())
    model.to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    genie.materialize(*model.parameters())
    genie.reset_stats()
    counts = {}
    for step in range(1000):
        x, y = torch.randn(16, 4), torch.randn(16, 1)  # new values each step: parameters
        for m, o, dev in ((model, opt, D), (ref, ref_opt, "cpu")):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x.to(dev)), y.to(dev))
            loss.backward()
            o.step()
            if dev == D:
                genie.materialize(loss, *model.parameters())
        if step in (10, 500, 999):
            counts[step] = (_count(Node), _count(LazyTensor))
    s = genie.stats()
    assert (s["plan_cache_misses"], s["plan_cache_hits"]) == (1, 999)
    assert counts[10] == counts[500] == counts[999], counts  # no graph that grows with steps
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q)


def test_hits_use_this_steps_inputs_uploads_and_random_offsets():
    w = torch.randn(3, 3, device=D)
    genie.materialize(w)
    wc = w.cpu()
    for step in range(5):
        x = torch.full((3, 3), float(step))
        torch.manual_seed(step)
        noise = torch.randn(3, 3, device=D)
        got = (x.to(D) @ w + noise).cpu()
        torch.manual_seed(step)
        want_noise = torch.randn(3, 3, device=D).cpu()
        torch.testing.assert_close(got, x @ wc + want_noise)
    assert genie.stats()["plan_cache_hits"] >= 4


@pytest.mark.parametrize("change", ["shape", "dtype", "op", "int_vs_float"])
def test_a_different_structure_is_a_miss(change):
    x = torch.randn(4, 4, device=D)
    genie.materialize(x)

    def prog(variant: bool):
        a = x
        if change == "shape":
            a = x[:2] if variant else x[:3]
        if change == "dtype":
            a = x.double() if variant else x.float()
        k = 2 if change == "int_vs_float" and variant else 2.0
        b = (a * k).relu() if not (change == "op" and variant) else (a * k).sigmoid()
        return b.sum().item()

    assert prog(False) == prog(False)
    genie.reset_stats()
    with _shape_generic(False):  # shapes as parameters (below) would make "shape" a hit
        prog(True)
        assert genie.stats()["plan_cache_misses"] == 1
        prog(True)  # and that new structure hits from then on
        assert genie.stats()["plan_cache_hits"] == 1


@contextlib.contextmanager
def _shape_generic(on: bool):
    was = plan_cache.shape_generic()
    plan_cache.set_shape_generic(on)
    try:
        yield
    finally:
        plan_cache.set_shape_generic(was)


def test_shapes_are_plan_parameters():
    """A slice that differs from a cached plan only in shapes (a KV cache one token longer, a
    new batch size) reuses the plan: ints, metadata arguments and host tensors of the new
    shapes come from the step; values equal eager's; other differences still miss."""
    w = torch.randn(8, 8, device=D)
    genie.materialize(w)
    wc = w.cpu()
    genie.reset_stats()
    with _shape_generic(True):  # on by default; GENIE_SHAPE_GENERIC=0 runs of the suite too
        _shape_steps(w, wc)
    s = genie.stats()
    assert (s["plan_cache_misses"], s["plan_cache_hits"], s["plan_cache_generic_hits"]) == \
        (1, 3, 3)
    x = torch.arange(16.0).reshape(2, 8).to(D)
    with _shape_generic(True):
        (x @ w).view(8, 2).sum(0).cpu()  # another view rank: a different structure
    assert genie.stats()["plan_cache_misses"] == 2


def _shape_steps(w, wc):
    for n in (3, 5, 2, 7):
        x = torch.arange(n * 8.0).reshape(n, 8)
        xd = x.to(D)
        got = (xd @ w).view(n * 2, 4).sum(0) + torch.zeros_like(xd).sum() + xd.new_ones(n).sum()
        want = (x @ wc).view(n * 2, 4).sum(0) + 0 + n
        torch.testing.assert_close(got.cpu(), want)


def test_shape_generic_hits_off_and_on_give_equal_tapes():
    """The tape a shape-generic hit builds is the one a fresh plan would (slots, frees, ops,
    every constant), for the column match and instantiate."""
    from genie.planner import build_tape, slice_nodes

    w = torch.randn(4, 4, device=D)
    genie.materialize(w)
    for n in (2, 3):
        y = torch.cat([w[:n], w[:n] * 2.0]).view(n * 2, 4, 1).expand(n * 2, 4, 3).sum(-1)
        targets = [(y._node, y._out)]
        nodes = slice_nodes(targets)
        ref = build_tape(targets, nodes)
        if n == 2:
            plan = plan_cache.Plan(ref, nodes)
            continue
        for tape in (plan_cache.match(plan, targets, True),
                     plan_cache.instantiate(plan, targets, nodes, True)):
            assert tape is not None and tape.generic
            _assert_same_tape(tape, ref)
        assert plan_cache.match(plan, targets, False) is None
        assert plan_cache.instantiate(plan, targets, nodes, False) is None
        y.cpu()


def test_float_arguments_are_parameters():
    x = torch.randn(4, 4, device=D)
    genie.materialize(x)
    xc = x.cpu()
    genie.reset_stats()
    for lr in (0.1, 0.05, 0.025, -0.0, 0.0):  # a decaying learning rate; the sign of zero too
        got = torch.add(x, x.exp(), alpha=lr).mul(1.0 + lr).cpu()
        torch.testing.assert_close(got, torch.add(xc, xc.exp(), alpha=lr).mul(1.0 + lr))
    s = genie.stats()
    assert (s["plan_cache_misses"], s["plan_cache_hits"]) == (1, 4)
    plan = plan_cache.cache().plans()[-1]
    assert len(plan.floats) == 2  # alpha and the multiplier were seen to change


def test_what_the_program_holds_is_part_of_the_plan():
    x = torch.randn(8, device=D)
    genie.materialize(x)
    for _ in range(2):
        (x.exp() * 2).sum().item()  # exp's value is freed inside the run
    genie.reset_stats()
    e = x.exp()  # same ops, but now the program holds exp's value: it must survive the run
    (e * 2).sum().item()
    assert genie.stats()["plan_cache_misses"] == 1
    n = genie.stats()["nodes_executed"]
    torch.testing.assert_close(e.cpu(), x.cpu().exp())
    assert genie.stats()["nodes_executed"] == n  # kept, not recomputed


def test_in_place_updates_of_held_values_hit_and_stay_exact():
    p = torch.zeros(5, device=D)
    genie.materialize(p)
    ref = torch.zeros(5)
    for step in range(6):
        g = torch.full((5,), float(step))
        p.add_(g.to(D), alpha=-0.5)
        p.mul_(0.9)
        ref.add_(g, alpha=-0.5).mul_(0.9)
        torch.testing.assert_close(p.cpu(), ref)
    assert genie.stats()["plan_cache_hits"] >= 4


@contextlib.contextmanager
def _column_only(monkeypatch):
    """Hits must come from the column match: slicing (the path of a miss, or of a plan the
    column match cannot take) fails the test."""
    with monkeypatch.context() as m:
        m.setattr(plan_cache, "slice_nodes", lambda *a: pytest.fail("sliced: not a column hit"))
        yield


def _python_read(monkeypatch) -> None:
    """Reads take the Python path, whose :func:`plan_cache.match` (and what it calls) a test
    observes: the native read (csrc/read.cpp) makes the same calls natively
    (tests/unit/test_native_read.py holds the two paths equal)."""
    monkeypatch.setattr(config, "native_read", False)


def _column_hits(monkeypatch) -> list[bool]:
    """What each :func:`plan_cache.match` call answered (True: a tape)."""
    _python_read(monkeypatch)
    seen: list[bool] = []
    real = plan_cache.match
    monkeypatch.setattr(plan_cache, "match", lambda *a, **k: seen.append(
        (t := real(*a, **k)) is not None) or t)
    return seen


def test_a_writing_plan_hits_through_the_column_match(monkeypatch):
    """``loss.item()`` of a training step runs the previous step's update (a write recorded
    before the read): the column match finds the update through the weight's pending writes, so
    the steady loop hits without slicing; a read with nothing pending takes the forward's plan."""
    w, x = torch.ones(4, device=D), torch.arange(4.0, device=D)
    rw, rx = torch.ones(4), torch.arange(4.0)

    def step(update: bool) -> float:
        loss, ref = (w * x).sum(), (rw * rx).sum()
        if update:
            w.sub_(x, alpha=0.1)
            rw.sub_(rx, alpha=0.1)
        # bit-equal on the CPU; CUDA's reduction kernels round differently
        if genie.device.real_device(0).type == "cpu":
            assert loss.item() == ref.item()
        else:
            assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
        return loss

    for _ in range(4):  # the forward alone (no write pending), then the loop's steady state
        step(False)
    for _ in range(3):  # the first slice with the update pending is a miss, the next hits
        step(True)
    plan = next(p for p in plan_cache.cache().plans() if p.writes)
    assert plan.fast and plan.uses >= 2
    with _column_only(monkeypatch):
        for _ in range(3):
            step(True)
    step(False)  # the last update is pending: its slice writes, a column hit
    hits = genie.stats()["plan_cache_hits"]
    step(False)  # nothing pending now: the forward's plan, which does not write
    assert genie.stats()["plan_cache_hits"] == hits + 1
    torch.testing.assert_close(w.cpu(), rw)


def test_a_writing_plan_hit_drops_the_readers_that_ran_from_what_it_checks():
    """A writing plan's column match reads the reader list of every storage its writes update
    (a pending reader before a write must be in the slice); the readers of earlier steps, which
    ran, are dropped there (as ``Storage.prune_readers``), so a weight's list holds about one
    step's readers instead of growing to binding's pruning size (16), and the next match reads
    only those. Values stay eager's."""
    w, x = torch.ones(4, device=D), torch.arange(4.0, device=D)
    rw, rx = torch.ones(4), torch.arange(4.0)
    lengths = []
    for _ in range(12):
        loss = (w * x).sum() + (w * 2.0).sum()  # three readers of w's storage a step
        w.sub_(x, alpha=0.1)
        ref = (rw * rx).sum() + (rw * 2.0).sum()
        rw.sub_(rx, alpha=0.1)
        torch.testing.assert_close(loss.cpu(), ref)
        lengths.append(len(w._node.storages[w._out].readers))
    assert genie.stats()["plan_cache_hits"] >= 8
    assert max(lengths[4:]) <= 6, lengths
    torch.testing.assert_close(w.cpu(), rw)


def test_a_read_before_a_pending_write_hits_through_the_column_match(monkeypatch):
    """``loss.item()`` while the update recorded after the loss waits (``opt.step()`` before the
    read, no step tape): the write is not the read's, so the forward's plan (which does not
    write) hits without slicing; a step whose update comes before the read must not."""
    seen = _column_hits(monkeypatch)
    w, x = torch.ones(4, device=D), torch.arange(4.0, device=D)
    rw, rx = torch.ones(4), torch.arange(4.0)
    genie.materialize(w, x)
    at = 0
    for step in range(6):
        if step == 5:  # the update before the loss: the loss reads it
            at = len(seen)
            w.sub_(x, alpha=0.1)
            rw.sub_(rx, alpha=0.1)
        loss, ref = (w * x).sum(), (rw * rx).sum()
        w.sub_(x, alpha=0.1)
        rw.sub_(rx, alpha=0.1)
        if step in (3, 4):
            with _column_only(monkeypatch):
                torch.testing.assert_close(loss.cpu(), ref)
        else:
            torch.testing.assert_close(loss.cpu(), ref)
        torch.testing.assert_close(w.cpu(), rw)
    assert not seen[at]


def test_a_plan_that_does_not_write_never_skips_a_write_before_a_read(monkeypatch):
    """``r = (x * 2) * 3`` hits its plan; a step that updates the intermediate in place before
    the read (``h.add_(1)``) has the same nodes around that write, which the plan does not hold:
    the column match must not hit."""
    seen = _column_hits(monkeypatch)
    x, rx = torch.arange(4.0, device=D), torch.arange(4.0)
    genie.materialize(x)
    at = 0
    for step in range(5):
        h, rh = x * 2.0, rx * 2.0
        if step == 4:
            at = len(seen)
            h.add_(1.0)
            rh.add_(1.0)
        torch.testing.assert_close((h * 3.0).cpu(), rh * 3.0)
    assert seen[at - 2:at] == [True, True] and not seen[at]


def test_a_writing_plan_with_a_node_only_a_write_reaches_goes_through_the_slice(monkeypatch):
    """A value read before an update (``y = w * 3``, held) joins the slice of a later read of
    ``w`` only as a reader before a write: no reference or pending write leads to it, so the
    column match cannot find it. Such a plan is not tried there (``writes_last``) and hits
    through the slice, with eager's values."""
    w, rw = torch.ones(4, device=D), torch.ones(4)
    genie.materialize(w)
    seen = _column_hits(monkeypatch)
    for step in range(5):
        y, ry = w * 3.0, rw * 3.0
        w.add_(1.0)
        rw.add_(1.0)
        s = w.sum()
        torch.testing.assert_close(s.cpu(), rw.sum())
        torch.testing.assert_close(y.cpu(), ry)  # computed before the update, as eager's
        if step >= 2:
            assert plan_cache.cache().writes_last([(s._node, s._out)])
    plan = next(p for p in plan_cache.cache().plans() if p.writes)
    assert not plan.fast and plan.uses >= 3
    assert not any(seen)


def _update_steps(seen: list[bool], steps: int, twist, first: bool = False) -> int:  # noqa: ANN001
    """Steady ``p.add_(g)`` then a read of ``p * 2``, which hit through the column match, then
    one step changed by ``twist(p, rp)`` (recorded between the update and the read, or
    ``first``, before the update), whose values must stay eager's whatever path serves it.
    Returns where in ``seen`` (the column match's answers) the changed step starts."""
    at = 0
    p = torch.zeros(4, device=D)
    rp = torch.zeros(4)
    genie.materialize(p)
    for step in range(steps + 1):
        g = torch.full((4,), float(step + 1))
        if step == steps:
            at = len(seen)
        late = twist(p, rp) if step == steps and first else None
        p.add_(g.to(D))
        rp.add_(g)
        if step == steps and not first:
            late = twist(p, rp)
        r, rr = p * 2.0, rp * 2.0
        torch.testing.assert_close(r.cpu(), rr)
        if late is not None:
            torch.testing.assert_close(late[0].cpu(), late[1])
    torch.testing.assert_close(p.cpu(), rp)
    assert seen[at - 2:at] == [True, True]  # the steady steps hit through the column match
    return at


def test_a_writing_plan_never_skips_another_write_before_a_read(monkeypatch):
    """The plan reads ``p`` after one update; a step that updates it twice before the read must
    not hit it (the second write is in the slice): every pending write before a read is the
    plan's, or the column match refuses."""
    seen = _column_hits(monkeypatch)
    at = _update_steps(seen, 4, lambda p, rp: (p.mul_(0.5), rp.mul_(0.5)) and None)
    assert not seen[at]


def test_a_writing_plan_runs_every_pending_write_of_a_requested_value(monkeypatch):
    """Steady ``p.add_(g)`` then ``materialize(p)`` (a requested value that ran, updated by the
    plan): a step that also scales ``p`` has two pending writes on it, and the plan's one must
    not serve it."""
    seen = _column_hits(monkeypatch)
    p, rp = torch.zeros(4, device=D), torch.zeros(4)
    genie.materialize(p)
    at = 0
    for step in range(5):
        at = len(seen)
        g = torch.full((4,), float(step + 1))
        p.add_(g.to(D))
        rp.add_(g)
        if step == 4:
            p.mul_(0.5)
            rp.mul_(0.5)
        genie.materialize(p)
        torch.testing.assert_close(p.cpu(), rp)
    assert seen[at - 2:at] == [True, True] and not seen[at]


def test_a_writing_plan_never_leaves_out_a_read_before_its_write(monkeypatch):
    """A pending reader of ``p`` recorded before the plan's update (``y = p * 3``, held) joins
    the slice (write after read): the column match must not hit without it (``y`` would read
    the updated ``p``)."""
    seen = _column_hits(monkeypatch)
    at = _update_steps(seen, 4, lambda p, rp: (p * 3.0, rp * 3.0), first=True)
    assert not seen[at]


def test_a_writing_plan_never_hits_a_tensor_aliased_otherwise(monkeypatch):
    """The plan updates two distinct tensors ``a`` and ``b`` the same way, then reads ``b``; in
    the last step ``b`` is a view of ``a`` (same metadata): both updates are writes before the
    read of one storage, which the plan's sites do not expect, so it must not hit; eager's
    values."""
    seen = _column_hits(monkeypatch)
    a0 = torch.zeros(4, device=D)
    b0 = torch.zeros(4, device=D)
    alias = a0.view(4)
    genie.materialize(a0, b0, alias)
    ra0, rb0 = torch.zeros(4), torch.zeros(4)
    ralias = ra0.view(4)
    at = 0
    for step in range(5):
        at = len(seen)
        a, b, ra, rb = (a0, b0, ra0, rb0) if step < 4 else (a0, alias, ra0, ralias)
        a.add_(1.0)
        b.add_(1.0)
        ra.add_(1.0)
        rb.add_(1.0)
        torch.testing.assert_close((b * 2.0).cpu(), rb * 2.0)
        torch.testing.assert_close(a.cpu(), ra)
    assert seen[at - 2:at] == [True, True] and not seen[at]


def test_disabled_cache_counts_nothing_and_still_computes():
    plan_cache.enable(False)
    x = torch.ones(3, device=D)
    for _ in range(3):
        assert (x * 2).sum().item() == 6.0
    s = genie.stats()
    assert "plan_cache_hits" not in s and "plan_cache_misses" not in s


_KEYED_PROGRAM = """
import torch, genie
from genie import plan_cache
x = torch.arange(6.0).to('remote_accelerator')
y = (x.reshape(2, 3) * 2.5).softmax(-1)
genie.materialize(y)
print(plan_cache.cache().plans()[-1].key)
"""


def test_plan_key_is_deterministic_across_processes():
    for _ in range(3):  # a different recording history in this process
        torch.ones(7, device=D).exp().sum().item()
    exec(compile(_KEYED_PROGRAM.replace("print(", "here = ("), "<program>", "exec"), g := {})
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    there = subprocess.run([sys.executable, "-c", _KEYED_PROGRAM], capture_output=True,
                           text=True, env=env, check=True).stdout.strip()
    assert g["here"] == there and len(there) == 32


def _instr_view(tape):
    return [(i.op, [x if not isinstance(x, torch.Tensor) else ("host", x.tolist())
                    for x in i.leaves], i.outs, i.rng, i.free) for i in tape.instrs]


def _step(wiring: str, c: int, a, b):
    u = a * 2.0 + b
    v = u * b if wiring == "ub" else u * u  # same ops, same metadata, other wiring
    return (v + c).sum()


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("other", [("uu", 1), ("ub", 2)])
def test_same_op_sequence_other_wiring_or_constant_is_a_miss(other, generic):
    """Other wiring is always a miss; another int constant is one unless shapes are plan
    parameters (ints then are, as they may be shapes): a hit that runs the step's constant."""
    a = torch.randn(4, device=D)
    b = torch.randn(4, device=D)
    genie.materialize(a, b)
    with _shape_generic(generic):
        first = _step("ub", 1, a, b).item()
        genie.reset_stats()
        got = _step(*other, a, b).item()
    st = genie.stats()
    if generic and other[0] == "ub":
        assert st.get("plan_cache_generic_hits", 0) == 1 and st.get("plan_cache_misses", 0) == 0
    else:
        assert st.get("plan_cache_misses", 0) == 1 and st.get("plan_cache_hits", 0) == 0
    ra, rb = genie.materialize(a, b)
    ra, rb = ra.cpu(), rb.cpu()
    u = ra * 2.0 + rb
    v = u * rb if other[0] == "ub" else u * u
    assert got == pytest.approx((v + other[1]).sum().item(), rel=1e-5)
    assert first != got


def _shared(a, b, step: str):
    """Same ops and metadata, other sharing: "one" reads one exp twice, "two" reads two exps
    (of other inputs), "dead" records both exps and reads the first twice."""
    u = a.exp()
    if step == "one":
        return u * u
    w = b.exp()
    return u * (w if step == "two" else u)


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("first,then", [("one", "two"), ("two", "one"), ("two", "dead")])
def test_a_plan_never_reads_one_node_where_it_read_two_or_two_where_it_read_one(first, then,
                                                                                 generic):
    """The match finds each instruction's node through the argument references of later ones:
    a node two references name must be one node in the slice too (two nodes there: not this
    plan), and two instructions must be two nodes (one node reached twice: not this plan). A
    wrong hit would multiply exp(a) by itself instead of by exp(b), or the reverse."""
    a = torch.randn(4, device=D)
    b = torch.randn(4, device=D)
    genie.materialize(a, b)
    ra, rb = a.cpu(), b.cpu()
    with _shape_generic(generic):
        for _ in range(2):  # a plan, and a hit on it
            genie.materialize(_shared(a, b, first))
        genie.reset_stats()
        got = _shared(a, b, then).cpu()
    st = genie.stats()
    assert st.get("plan_cache_misses", 0) == 1 and st.get("plan_cache_hits", 0) == 0, st
    real = genie.device.real_device(0)  # eager on the real device's kernels: bit-equal
    torch.testing.assert_close(got, _shared(ra.to(real), rb.to(real), then).cpu(), rtol=0, atol=0)


def _assert_same_tape(a, b) -> None:
    """Two tapes for the same slice: same instructions, wiring, nodes, inputs and kept slots."""
    assert a is not None and b is not None
    assert _instr_view(a) == _instr_view(b)
    assert a.slots == b.slots and a.outputs == b.outputs
    assert [n.index for n in a.nodes] == [n.index for n in b.nodes]
    assert a.inputs.keys() == b.inputs.keys() and a.keep == b.keep


def test_match_builds_the_tape_instantiate_builds():
    a = torch.randn(4, device=D)
    genie.materialize(a)
    for step in range(3):
        x = torch.full((4,), float(step)).to(D)
        y = (a * x + 0.5 * step).relu()
        z = y * y + torch.randn(4, device=D)
        targets = [(z._node, z._out)]
        nodes = plan_cache.slice_nodes(targets)
        if step == 0:
            plan_cache.plan(targets)
            continue
        plan = plan_cache.cache().plans()[-1]
        fast = plan_cache.match(plan, targets)
        slow = plan_cache.instantiate(plan, targets, nodes)
        _assert_same_tape(fast, slow)
        assert [n.index for n in fast.nodes] == [n.index for n in nodes]
        assert {s: v.tolist() for s, v in fast.inputs.items()} == \
            {s: v.tolist() for s, v in slow.inputs.items()}
        genie.materialize(z)


def test_column_match_agrees_with_instantiate():
    a = torch.randn(4, device=D)
    genie.materialize(a)
    for step in range(3):
        y = (a * 0.5 + 1.0).relu()
        held = y * 2  # a live tensor holds it: kept
        z = held - a + torch.randn(4, device=D)  # an input read twice; a random op
        targets = [(z._node, z._out)]
        nodes = plan_cache.slice_nodes(targets)
        if step == 0:
            plan_cache.plan(targets)
            continue
        plan = plan_cache.cache().plans()[-1]
        fast = plan_cache.match(plan, targets)
        _assert_same_tape(fast, plan_cache.instantiate(plan, targets, nodes))
        if step < 2:
            genie.materialize(z)
    del held
    assert plan_cache.match(plan, targets) is None  # a kept value no longer held: not this plan


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("kind", ["view", "multi-output"])
@pytest.mark.parametrize("outside", ["pending", "dead", "reader"])
def test_a_consumer_outside_the_slice_decides_what_the_run_keeps(monkeypatch, native, kind,
                                                                   outside):
    """A node counts its consumers; a run keeps an output no tensor holds only while a pending
    consumer outside the slice reads it. A consumer that died keeps nothing, nor does a pending
    node that reads the same storage without naming the node (``reader``: the base of a view; a
    view of a multi-output node's output), nor the slice's own consumers once they ran. The
    planner, the column match and instantiate find them through the storages' readers, and the
    steps after the first hit the plan."""
    from genie.config import config

    monkeypatch.setattr(config, "native_match", native)
    monkeypatch.setattr(config, "native_slice", native)
    a = torch.randn(4, 4, device=D)
    genie.materialize(a)
    ac = a.cpu()
    genie.reset_stats()
    for step in range(3):
        s = float(step + 1)
        b = a * s
        if kind == "view":
            t = b[1:]  # the node whose output the slice reads: a view of b's storage
            w = t * 2.0
            reader = b + 1.0  # reads that storage too, through b
            want_t, want_r = (ac * s)[1:], ac * s + 1.0
        else:
            vals, t = b.max(dim=1)  # the node's second output
            iv = t[1:]  # in the slice, a view of t's storage
            w = vals * 2.0 + iv.sum()
            reader = iv + 1  # reads t's storage, through iv
            want_t, want_r = (ac * s).max(dim=1)[1], (ac * s).max(dim=1)[1][1:] + 1
            del vals, iv  # (a view holds its base tensor: t)
        _ = t * 3  # a consumer that dies at once: counted, so the readers are looked at
        del _
        c = t + 5 if outside == "pending" else None
        if outside != "reader":
            del reader
        n, k = t._node, t._out
        del t
        targets = [(w._node, w._out)]
        if step:
            _assert_same_tape(plan_cache.match(plan, targets),
                              plan_cache.instantiate(plan, targets, plan_cache.slice_nodes(targets)))
        genie.materialize(w)
        plan = plan_cache.cache().plans()[-1] if not step else plan
        assert n.executed and (n.values[k] is not None) == (outside == "pending")
        if c is not None:
            torch.testing.assert_close(c.cpu(), want_t + 5)
        if outside == "reader":
            torch.testing.assert_close(reader.cpu(), want_r)
    reads = outside != "dead"  # (the read of c or of the reader each step: a plan of its own)
    assert (genie.stats()["plan_cache_misses"], genie.stats()["plan_cache_hits"]) == \
        (1 + reads, 2 + 2 * reads)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_requested_output_is_no_consumer_of_its_node(monkeypatch, native):
    """A read of one output of a multi-output node is not an argument reference: counted as one
    (the planner did, session 48), it stood for the pending consumer of the node's other output
    outside the run, whose value the run then freed (OpInfo's prelu-grad: "value ... was freed
    but is still needed"). Values against eager, the first call and the plan's hits."""
    from genie.config import config

    monkeypatch.setattr(config, "native_match", native)
    monkeypatch.setattr(config, "native_slice", native)
    x0 = torch.randn(4, 3)
    x = x0.to(D)
    for step in range(3):
        s = float(step + 1)
        lo, hi = torch.aminmax(x * s, dim=1)
        y = hi * 2  # the other output's one consumer, outside the run of lo's read
        del hi  # no tensor holds it: only y's pending node keeps it
        want_lo, want_hi = torch.aminmax(x0 * s, dim=1)
        torch.testing.assert_close(lo.cpu(), want_lo)
        torch.testing.assert_close(y.cpu(), want_hi * 2)


@pytest.mark.parametrize("generic", [False, True], ids=["exact", "shape-generic"])
def test_column_match_takes_uploads_and_host_constants(generic):
    """A decode step's slice holds uploads (the new token), host constants (a 0-dim CPU tensor)
    and floats that change: the column path matches it, with this step's values, and builds the
    tape instantiate builds; values equal eager's."""
    a = torch.randn(4, device=D)
    genie.materialize(a)
    ac = a.cpu()
    with _shape_generic(generic):
        for step, n in enumerate((3, 3, 5, 5) if generic else (3, 3, 3)):
            x = torch.arange(n * 4.0).reshape(n, 4) + step
            c = torch.tensor(0.5 + step)  # a host constant, a new value every step
            z = (x.to(D) * a * c).sum(0) + (1.0 + step)  # a float parameter too
            targets = [(z._node, z._out)]
            nodes = plan_cache.slice_nodes(targets)
            if step == 0:
                plan_cache.plan(targets, generic)
            else:
                plan = plan_cache.cache().plans()[-1]
                fast = plan_cache.match(plan, targets, generic)
                _assert_same_tape(fast, plan_cache.instantiate(plan, targets, nodes, generic))
                assert fast.generic == (generic and n != 3)
            torch.testing.assert_close(z.cpu(), (x * ac * c).sum(0) + (1.0 + step))


def _bind_program() -> tuple[list, list]:
    """A program whose repeated steps hit the plan cache's column match (so binding takes the
    plan's slots; such slices never write): views, a multi-output op, a weight read by 20
    pending nodes (its reader list is pruned), a value held after the run."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, device=D)
    genie.materialize(w)
    snaps, outs = [], []
    for step in range(3):
        x = torch.full((4, 4), float(step), device=D)
        reads = [w * float(k) for k in range(20)]  # 20 readers of w's storage: pruned
        v = x.t()[1:] * 2.0
        vals, idx = (x @ w + sum(reads)).max(dim=1)
        nodes = [t._node for t in (x, v, vals, idx, *reads)]
        outs.append(genie.materialize(vals, idx, x))
        snaps.append([(n.executed, n.leaves and [type(x).__name__ for x in n.leaves],
                       n.n_consumers, type(n.values).__name__,
                       [t.tolist() if isinstance(t, torch.Tensor) else type(t).__name__
                        for t in (n.values or [])],  # (server handles through a server)
                       [None if s is None else (type(s.pending_writes).__name__,
                                                len(s.pending_writes), len(s.readers))
                        for s in n.storages]) for n in nodes])
    return snaps, [[t.tolist() for t in o] for o in outs]


def test_native_bind_leaves_the_graph_as_the_python_loop_does(monkeypatch) -> None:
    from genie import executor
    from genie.graph import pending_total

    from genie.config import config

    calls = []
    native = executor._bind_nodes
    monkeypatch.setattr(executor, "_bind_nodes", lambda *a: calls.append(1) or native(*a))
    monkeypatch.setattr(config, "native_bind", True)
    before = pending_total[0]
    got = _bind_program()
    got_pending = pending_total[0] - before
    assert calls, "the native bind never ran: the test no longer covers it"
    monkeypatch.setattr(config, "native_bind", False)
    before = pending_total[0]
    want = _bind_program()
    assert got == want
    assert got_pending == pending_total[0] - before


def _match_programs() -> None:
    """Programs whose repeated steps reach the column match in every outcome: hits (exact and
    shape-generic, uploads, host constants, changing floats, random ops, held and dropped
    values, two outputs of one node, several targets, in-place updates) and refusals (a kept
    value no longer held, another wiring, a read or a write the plan's updates do not
    expect)."""
    a = torch.randn(4, 4, device=D)
    genie.materialize(a)
    kept = []
    for step in range(4):
        x = torch.full((4, 4), float(step)).to(D)
        y = (a @ x * (0.5 + step)).relu()
        v, i = y.max(dim=0)
        z = v * 2 + torch.randn(4, device=D)
        if step % 2:
            kept.append(y * 3)  # held by a live tensor on odd steps only
        genie.materialize(z, i)
        genie.materialize(z.sum())
    kept.clear()
    with _shape_generic(True):
        cache = torch.randn(1, 3, 4, device=D)
        for _ in range(5):  # a decode loop: the cache grows by one row per step
            tok = torch.randn(1, 1, 4).to(D)
            cache = torch.cat([cache, tok], dim=1)
            s = torch.softmax(cache @ a / 2.0, dim=-1).sum(1)
            genie.materialize(s)
    for step in range(3):  # same ops, other wiring every step: the plan's wiring must refuse
        p, q = torch.randn(4, device=D), torch.randn(4, device=D)
        r = (p + q) * (q if step % 2 else p)
        genie.materialize(r)
    w = torch.zeros(4, device=D)
    genie.materialize(w)
    held = []
    for step in range(7):  # updates: hits of plans that write, then a read before the update
        if step == 4:      # and a second write before the read: refused
            held.append(w * 3.0)
        w.add_(1.0)
        if step == 5:
            w.mul_(0.5)
        genie.materialize(w * 2.0)
        genie.materialize(w)


def test_native_match_core_agrees_with_python(monkeypatch) -> None:
    """csrc/match.cpp against its reference (plan_cache._match_core_py): for every column match
    the programs make, the same outcome (no plan / a hit) and the same tape."""
    from genie.config import config

    outcomes = []
    real = plan_cache.match

    def both(plan, targets, generic=False, found=False):  # noqa: ANN001, ANN202
        # the reference: the Python columns, and instructions rebuilt in Python
        monkeypatch.setattr(config, "native_match", False)
        monkeypatch.setattr(config, "native_slice", False)
        want = real(plan, targets, generic)
        monkeypatch.setattr(config, "native_match", True)
        monkeypatch.setattr(config, "native_slice", True)
        got = real(plan, targets, generic, found)
        if want is None:
            assert got is None
        else:  # (a hit the executor runs from the match: the tape it would make)
            tape = plan_cache._tape_of(plan, targets, generic, got[1]) \
                if type(got) is tuple else got
            _assert_same_tape(tape, want)
            assert tape.generic == want.generic
            assert [id(v) for v in tape.inputs.values()] == [id(v) for v in want.inputs.values()]
            fields = ("op", "spec", "outs", "rng", "free", "uid", "where", "device")
            assert [(i.leaves, *(getattr(i, f) for f in fields)) for i in tape.instrs] == \
                [(i.leaves, *(getattr(i, f) for f in fields)) for i in want.instrs]
            rebuilt = [k for k, (a, b) in enumerate(zip(tape.instrs, plan.instrs)) if a is not b]
            assert rebuilt == [k for k, (a, b) in enumerate(zip(want.instrs, plan.instrs))
                               if a is not b]
        outcomes.append("hit" if got is not None else "none")
        if plan.writes:
            outcomes.append("writes " + outcomes[-1])
        return got

    _python_read(monkeypatch)
    monkeypatch.setattr(plan_cache, "match", both)
    rebuilds = []
    native_rebuild = plan_cache._rebuild_instrs
    monkeypatch.setattr(plan_cache, "_rebuild_instrs",
                        lambda *a: rebuilds.append(1) or native_rebuild(*a))
    core = []
    native = plan_cache._match_core
    monkeypatch.setattr(plan_cache, "_match_core", lambda *a: core.append(r := native(*a)) or r)
    _match_programs()
    assert outcomes.count("hit") >= 8 and "none" in outcomes, outcomes
    assert "writes hit" in outcomes and "writes none" in outcomes, outcomes
    assert rebuilds, "no hit rebuilt an instruction: the test no longer covers _rebuild_instrs"
    assert any(type(r) is tuple for r in core) and any(r is None or r is False for r in core)


def test_more_plans_than_the_native_match_keeps_converted_hit_in_turn() -> None:
    """csrc/match.cpp converts a plan's integer columns once and keeps the last few plans'
    (columns_of); a loop over more structures than it keeps evicts and converts again: every
    round after the first still hits, with eager's values."""
    x = torch.randn(4, device=D)
    genie.materialize(x)
    xc = x.cpu()

    def prog(t: torch.Tensor, k: int) -> torch.Tensor:  # k + 1 steps: 11 structures
        for _ in range(k + 1):
            t = (t * 0.5 + 1.0).relu()
        return t

    genie.reset_stats()
    for _ in range(3):
        for k in range(11):
            torch.testing.assert_close(prog(x, k).cpu(), prog(xc, k), rtol=0, atol=0)
    s = genie.stats()
    assert s["plan_cache_hits"] >= 2 * 11, s


def test_plans_for_the_same_requested_ops_are_tried_at_their_span_first(monkeypatch):
    """A generate's prefill and decode steps end in the same requested ops: the most recently
    used plan first would try the decode plan at every prefill and the prefill plan at the first
    decode after it, each a walk of the slice before it fails. Plans last used at the same span
    (nodes recorded since the previous lookup) are tried first; values stay eager's."""
    tried, failed = [], []
    real_match = plan_cache.match

    def counting(*a, **k):
        tape = real_match(*a, **k)
        tried.append(1)
        if tape is None:
            failed.append(1)
        return tape

    _python_read(monkeypatch)
    monkeypatch.setattr(plan_cache, "match", counting)
    x, rx = torch.arange(6.0, device=D), torch.arange(6.0)
    genie.materialize(x)

    def prefill(t):  # noqa: ANN001, ANN202 - five ops, then the ending both share
        return ((t.relu() * 3 - 1 + t) * 2).sum()

    def decode(t):  # noqa: ANN001, ANN202 - two ops, then the same ending
        return (t * 2).sum()

    def call() -> None:
        for f in (prefill, decode, decode, decode):
            assert f(x).item() == f(rx).item()

    call()
    call()  # every plan cached and used once at its span
    tried.clear()
    failed.clear()
    for _ in range(3):
        call()
    assert len(tried) == 12 and not failed, (len(tried), len(failed))
    cache = plan_cache.cache()
    assert len(cache) == len(cache.plans()) >= 2  # the prefill's and the decode's, at least
