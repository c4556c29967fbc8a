"""The native slice and instantiate (csrc/slice.cpp) against their Python references.

Every program below runs with both implementations side by side: each slice the plan cache
takes is computed natively and in Python (``config.native_slice`` off) and must be the same
node list; each plan the cache holds is instantiated against that slice natively and in Python,
shape-generic and not, and must give the same tape (every field) or None in both, with the
same floats recorded into ``Plan.floats``. The values are compared with eager PyTorch on the
CPU (random programs: with the Python path's values under the same seed).
"""

import contextlib
import math
import struct

import pytest
import torch
import torch.nn.functional as F

import genie
from genie import _C, plan_cache, planner
from genie.config import config

D = "remote_accelerator"


@pytest.fixture(autouse=True)
def _fresh_cache():
    plan_cache.clear()
    plan_cache.enable(True)
    yield
    plan_cache.enable(True)


@contextlib.contextmanager
def _native(on: bool):
    before = config.native_slice
    config.native_slice = on
    try:
        yield
    finally:
        config.native_slice = before


def _leaf(x):
    if type(x) is float:
        return ("float", struct.pack("<d", x))  # by bits: -0.0 and NaN as they are
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x))
    if type(x) is plan_cache._HostMeta:
        return ("host", id(x))  # the plan's own
    return (type(x).__name__, x)


def _fields(tape, plan):
    """Everything a tape says, comparable (values and template objects by identity)."""
    if tape is None:
        return None
    instrs = [(ins.op, [_leaf(x) for x in ins.leaves], ins.spec, ins.outs, ins.rng, ins.free,
               ins.uid, ins.where, ins.device, ins is plan.instrs[i])
              for i, ins in enumerate(tape.instrs)]
    return (instrs, {s: id(v) for s, v in tape.inputs.items()}, list(tape.outputs),
            set(tape.keep), dict(tape.slots), tape.generic, tape.index, tape.plan is plan,
            [id(n) for n in tape.nodes])


class _Both:
    """Stands in for the plan cache's slice_nodes and instantiate: runs both implementations,
    compares them, and returns the native answer."""

    def __init__(self, monkeypatch) -> None:
        self.slices = self.tapes = self.nones = self.generic_tapes = self.float_changes = 0
        self._slice = planner.slice_nodes
        self._instantiate = plan_cache.instantiate
        monkeypatch.setattr(plan_cache, "slice_nodes", self.slice)
        monkeypatch.setattr(plan_cache, "instantiate", self.instantiate)
        # every lookup slices (the column match, which now takes training steps too, would
        # leave these two with the programs' first steps only)
        monkeypatch.setattr(plan_cache.PlanCache, "match", lambda *a, **k: None)
        monkeypatch.setattr(config, "native_read", False)  # (its column match is native)

    def slice(self, targets):
        got = _C._slice_nodes(targets)
        assert got is not NotImplemented, "the native slice did not take this graph"
        with _native(False):
            want = self._slice(targets)
        assert [n.index for n in got] == [n.index for n in want]
        assert all(a is b for a, b in zip(got, want, strict=True))
        self.slices += 1
        for plan in plan_cache.cache().plans():  # every cached plan: many must give None
            for generic in (False, True):
                self.compare(plan, targets, got, generic)
        return got

    def compare(self, plan, targets, nodes, generic):
        before = set(plan.floats)
        got = _C._instantiate(plan, targets, nodes, generic)
        assert got is not NotImplemented, "the native instantiate did not take this slice"
        native_floats = set(plan.floats)
        plan.floats.clear()
        plan.floats.update(before)
        with _native(False):
            want = self._instantiate(plan, targets, nodes, generic)
        assert plan.floats == native_floats
        assert _fields(got, plan) == _fields(want, plan)
        if got is None:
            self.nones += 1
        else:
            self.tapes += 1
            self.generic_tapes += got.generic
            self.float_changes += native_floats != before
        return got

    def instantiate(self, plan, targets, nodes, generic=False):
        return self.compare(plan, targets, nodes, generic)


def _mlp_adamw(dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)  # a learning rate that changes
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(6):
        x = torch.randn(8, 16, generator=g).to(dev)  # host uploads
        y = torch.randn(8, 1, generator=g).to(dev)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.append(loss.item())
    return out + [p.detach().cpu().clone() for p in model.parameters()]


def _writes_and_views(dev):
    x = torch.arange(12.0).reshape(3, 4).to(dev)
    out, kept = [], []
    for step in range(5):
        y = x * 2.0  # read, then written over: write-after-read
        x.add_(1.0)
        v = x[1:]  # a view of the written storage, written through
        v.mul_(0.5 + step)  # a float that changes
        z = x + y  # read after the writes
        if step % 2 == 0:
            kept.append(y * 3.0)  # held across steps (pending, reads y)
        out.append(z.sum().item())
        out.append(x.cpu().clone())
    return out + [k.cpu().clone() for k in kept]


def _held_or_dropped(dev):
    w = torch.ones(4, 4).to(dev)
    out, held = [], []
    for step in range(6):
        h = w * float(step % 2)
        w.add_(h)
        s = (h + 1.0).sum()
        if step % 3 == 0:
            held.append(h)
        del h  # held by the list in some steps only: another plan (its frees differ)
        out.append(s.item())
    return out + [h.cpu().clone() for h in held] + [w.cpu().clone()]


def _two_outputs_many_targets(dev):
    w = torch.linspace(-1, 1, 16).reshape(4, 4).to(dev)
    out = []
    for step in range(4):
        x = torch.full((4, 4), float(step)).to(dev)
        w.mul_(1.0 - 0.1 * step)
        vals, idx = (x @ w + w * float(step)).max(dim=1)  # two outputs of one node
        e = (x - 1.0).abs()
        if dev == D:
            vals, idx, e, x = genie.materialize(vals, idx, e, x)  # several targets at once
        out += [vals.cpu().clone(), idx.cpu().clone(), e.cpu().clone(), x.cpu().clone()]
    return out


def _constants(dev):
    x = torch.ones(3).to(dev)
    out = []
    nan = float("nan")
    # Each op's first step after the warm-up makes its plan; the next compare with it by bits:
    # -0.0 against 0.0 is a changed float, NaN against NaN is not.
    for op, c in [(torch.sub, 1.0), (torch.mul, 0.0), (torch.mul, -0.0), (torch.mul, 0.0),
                  (torch.add, nan), (torch.add, nan), (torch.add, 1.0), (torch.mul, 2),
                  (torch.mul, 2.0), (torch.mul, True), (torch.mul, 3), (torch.mul, 3)]:
        x.mul_(1.0)  # a write: the slice never takes the column match
        out.append((op(x, c) + 1).cpu().clone())
    return out


def _decode_like(dev):
    torch.manual_seed(0)
    w = torch.randn(8, 8).to(dev)
    cache = torch.randn(1, 3, 8).to(dev)
    steps = torch.zeros(1).to(dev)
    g = torch.Generator().manual_seed(2)
    out = []
    with torch.no_grad():
        for _ in range(5):  # the cache grows by one per step: same structure, new shapes
            q = torch.randn(1, 1, 8, generator=g).to(dev)
            cache = torch.cat([cache, q @ w], dim=1)
            att = torch.softmax(q @ cache.transpose(1, 2) / math.sqrt(8), -1)
            steps.add_(1.0)  # a write
            out.append((att @ cache + steps).cpu().clone())
    return out


def _prefill_like(dev):
    torch.manual_seed(0)
    w = torch.randn(8, 8).to(dev)
    out = []
    with torch.no_grad():
        for n in (5, 7, 5, 9, 11):  # a new prompt length: a miss, or a shape-generic hit
            x = torch.arange(n * 8.0).reshape(n, 8).to(dev) / 10.0
            h = torch.relu(x @ w) @ w.t()
            out.append(h.sum(0).cpu().clone())
    return out


PROGRAMS = [_mlp_adamw, _writes_and_views, _held_or_dropped, _two_outputs_many_targets,
            _constants, _decode_like, _prefill_like]


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda f: f.__name__.strip("_"))
def test_native_slice_and_instantiate_equal_python(program, monkeypatch) -> None:
    both = _Both(monkeypatch)
    got = program(D)
    want = program("cpu")
    for a, b in zip(got, want, strict=True):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, equal_nan=True)
        else:
            assert a == pytest.approx(b, nan_ok=True)
    assert both.slices > 0
    assert both.tapes + both.nones > 0


def test_the_programs_cover_hits_misses_generic_tapes_and_changed_floats(monkeypatch) -> None:
    both = _Both(monkeypatch)
    for program in PROGRAMS:
        program(D)
    assert both.tapes > 20 and both.nones > 20
    assert both.generic_tapes > 0
    assert both.float_changes > 0


def test_random_ops_give_the_python_paths_values(monkeypatch) -> None:
    def program():
        torch.manual_seed(0)
        x = torch.ones(4, 4).to(D)
        out = []
        for step in range(4):
            r = torch.rand(4, 4, device=D)
            d = F.dropout(x, 0.5, training=True)
            x.add_(r * float(step))
            out.append((d + x).cpu().clone())
        return out

    both = _Both(monkeypatch)
    got = program()
    assert both.slices > 0 and both.tapes > 0
    monkeypatch.undo()
    plan_cache.clear()
    with _native(False):
        want = program()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_instantiate_is_none_where_the_structure_differs(monkeypatch) -> None:
    """Slices that differ from a cached plan of the same length in one detail each."""
    both = _Both(monkeypatch)
    x = torch.ones(4).to(D)
    genie.materialize(x)

    def step(fn):
        x.add_(0.0)  # a write: the slice never takes the column match
        return fn(x).sum().item()

    step(lambda t: t * 2.0)
    for variant in (lambda t: t * 2,  # an int where the plan has a float
                    lambda t: t + 2.0,  # another op
                    lambda t: t.double() * 2.0,  # other dtypes
                    lambda t: t[:2] * 2.0,  # another shape and another op
                    lambda t: t * 2.0):  # the plan itself again: a tape
        step(variant)
    assert both.nones > 0 and both.tapes > 0


def test_the_default_path_is_native() -> None:
    if not config.native_slice:
        pytest.skip("GENIE_NATIVE_SLICE=0: the default path is the Python one in this run")
    x = torch.ones(4).to(D)
    held = []
    for _ in range(3):
        held.append(x * 3.0)  # read before the update: only the slice finds it
        x.add_(1.0)
        (x * 2.0).sum().item()
    stats = genie.stats()
    assert stats.get("native_slices", 0) >= 3
    assert stats.get("native_instantiates", 0) >= 1
    assert stats.get("plan_cache_hits", 0) >= 1


def test_the_native_path_declines_what_it_does_not_know() -> None:
    """Not a Node where one should be: NotImplemented, and slice_nodes runs the Python loop."""
    assert _C._slice_nodes([(object(), 0)]) is NotImplemented
    x = torch.ones(2).to(D) + 1.0
    n = x._node
    got = _C._slice_nodes([(n, 0)])
    with _native(False):
        assert planner.slice_nodes([(n, 0)]) == got
    assert got[-1] is n and len(got) == 2  # the upload, then the add


def test_inputs_differ_equals_the_python_check() -> None:
    """genie._C._inputs_differ (a shape-generic hit's inputs against the plan's metadata) gives
    plan_cache.any_input_differs's answer: same shapes and strides, another shape, the same shape
    with other strides (a transposed copy), a view with an offset; NotImplemented where the
    metadata is not a TensorMeta; values that are not plain tensors read as in Python."""
    from genie.graph import TensorMeta

    base = torch.randn(4, 6)
    cases = {"same": torch.randn(4, 6), "shape": torch.randn(4, 7),
             "strides": torch.randn(6, 4).t(), "offset view": torch.randn(5, 6)[1:]}
    pin = {0: TensorMeta.of(torch.randn(3), 0), 1: TensorMeta.of(base, 0)}
    for name, v in cases.items():
        inputs = {0: torch.randn(3), 1: v}
        want = plan_cache.any_input_differs(inputs, pin)
        assert want == (name in ("shape", "strides")), name
        assert _C._inputs_differ(inputs, pin) is want, name
        sub = {0: torch.randn(3), 1: torch.nn.Parameter(v)}  # (not a plain Tensor: by attribute)
        assert _C._inputs_differ(sub, pin) is plan_cache.any_input_differs(sub, pin), name
    assert _C._inputs_differ({0: base}, {0: (4, 6)}) is NotImplemented
    assert _C._inputs_differ({}, pin) is False
