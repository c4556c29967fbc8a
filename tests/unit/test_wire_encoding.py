"""A steady step's wire encoding (issue 27): a tape a plan-cache hit instantiated re-encodes only
the instructions the hit rebuilt (``genie.remote.protocol._PlanWire``), read from the hit's nodes
without building its instructions (``Plan.replay_source``), and the client finds its
kept values' nodes from the plan (``genie.remote.client._kept_at``). Both must give exactly what
encoding and searching the tape from scratch gives, every step: floats that move (parameters),
host tensors (frames), random ops (their seed and offset), several plans of one structure; with
the entries whose values are the last call's found natively (``genie._C._wire_same``) and by the
Python loop (``GENIE_NATIVE_WIRE=0``)."""

from __future__ import annotations

import pytest
import torch

import genie
from genie import _C, plan_cache
from genie.config import config
from genie.planner import PendingSlots, Tape

protocol = pytest.importorskip("genie.remote.protocol")
client = pytest.importorskip("genie.remote.client")

DEV = "remote_accelerator:0"


def _bare(tape: Tape) -> Tape:
    """``tape`` without its plan: encoded from its instructions alone."""
    return Tape(tape.instrs, tape.inputs, tape.outputs, tape.keep, tape.nodes, tape._slots,
                tape.index, None, tape.generic)


def _encode(tape: Tape) -> tuple[bytes, list, list[bytes]]:
    enc = protocol.encode_tape(tape, lambda s, v, frames: ("input", s))
    return enc.key, enc.consts, [bytes(memoryview(f).cast("B")) for f in enc.frames]


def _steady(tape: Tape) -> bool:
    """Whether ``tape``'s plan has its encoding (:class:`~genie.remote.protocol._PlanWire`)."""
    return tape.plan is not None and \
        isinstance(tape.plan.artifacts.get(protocol._WIRE), protocol._PlanWire)


def _kept_from_slots(tape: Tape) -> list[tuple[int, int, int]]:
    slots = PendingSlots(tape._slots.outs, tape._slots.inputs).build(tape.nodes)
    return [(i, k, s) for i, n in enumerate(tape.nodes) for k in range(len(n.metas))
            if (s := slots.get((n.index, k))) is not None and s in tape.keep]


def _step(w: torch.Tensor, step: int, scale: float) -> torch.Tensor:
    x = torch.full((4,), float(step) + 0.25).to(DEV)  # a new host tensor: a frame
    r = torch.rand(4, device=DEV)  # a random op: its seed and offset move
    return ((w @ x) * scale + r * (step + 0.5)).sum(), x


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_steady_steps_encode_as_from_scratch(monkeypatch, native):
    monkeypatch.setattr(config, "native_wire", native)
    plan_cache.clear()
    torch.manual_seed(0)
    w = torch.randn(4, 4).to(DEV)
    genie.materialize(w)
    seen_plan_wire = unbuilt = 0
    for step in range(6):
        # two call sites of one structure: two plans whose tapes share one skeleton
        for scale in (1.5 + step, -2.0 * step):
            y, x = _step(w, step, scale)
            tape = plan_cache.plan([(y._node, 0)], True)
            stale, steady = tape._stale, _steady(tape)
            got = _encode(tape)
            if steady:  # a hit's instructions are not built to encode it: read from its nodes
                assert tape._stale is stale
                unbuilt += stale is not None
            want = _encode(_bare(tape))
            assert got[0] == want[0]
            assert got[1] == want[1], step
            assert got[2] == want[2], step
            if tape.plan is not None and type(tape._slots) is PendingSlots:
                assert client._kept_at(tape) == _kept_from_slots(tape)
                # each kept slot's node, output and place in the server's numbering
                enc = protocol.encode_tape(tape, lambda s, v, frames: 0)
                at = {s: (i, k) for i, k, s in _kept_from_slots(tape)}
                want_rows = [(s, -1, 0, 0) if s in tape.inputs else
                             (s, *at[s], enc.order.index(s)) for s in sorted(tape.keep)]
                assert client._kept_rows(tape, enc.order) == want_rows
                assert client._kept_rows(tape, enc.order) is \
                    client._kept_rows(tape, enc.order)  # kept on the plan
            pw = tape.plan.artifacts.get(protocol._WIRE) if tape.plan is not None else None
            seen_plan_wire += isinstance(pw, protocol._PlanWire)
            y.item()  # runs it (the plan matches again), so the next step starts clean
    assert seen_plan_wire >= 6  # the steady path ran (not only encodings from scratch)
    assert unbuilt >= 6  # hits whose instructions were never built were encoded


def _same_consts(a: list, b: list) -> bool:
    """Constant lists equal as the wire tells them apart (``0.0`` from ``-0.0``, ``1`` from
    ``True``), not as ``==`` does."""
    from genie.graph import same_const

    return len(a) == len(b) and all(type(x) is type(y) and same_const(x, y)
                                    for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_moving_shape_reencodes_only_constants_that_changed(monkeypatch, native):
    """A shape-generic plan rebuilds every instruction whose shapes moved (a KV cache growing
    by a token), though most of their constants are the last call's: those are taken from the
    last encoding (``_PlanWire.seen``), the others encoded again, exactly (a float that turns
    from ``0.0`` to ``-0.0`` is a change, though ``==`` says it is not); an entry whose
    constants changed twice is encoded every call without comparing (a length that grows)."""
    monkeypatch.setattr(config, "native_wire", native)
    plan_cache.clear()
    torch.manual_seed(0)
    w = torch.randn(4).to(DEV)
    h = w[:2].clone()
    genie.materialize(h)
    leaf_calls = []
    real = protocol._leaf_consts
    monkeypatch.setattr(protocol, "_leaf_consts",
                        lambda ins, js, frames: leaf_calls.append(ins) or real(ins, js, frames))
    steady = rebuilt = steps = 0
    for step, scale in enumerate([1.5, 1.5, 1.5, 0.0, -0.0, -0.0, 0.0, 2.0, 2.0]):
        h = torch.cat([h, w[:1]])  # grows: the plan's shapes move every step
        y = (h.view(-1, 1) * scale).sum() + h.narrow(0, 0, step + 2).sum()
        tape = plan_cache.plan([(y._node, 0)], True)
        del leaf_calls[:]
        stale, steady = tape._stale, _steady(tape)
        got = _encode(tape)
        n_got = len(leaf_calls)
        if steady:  # encoded from the hit's nodes, its instructions not built
            assert stale is not None and tape._stale is stale
        want = _encode(_bare(tape))
        assert got[0] == want[0]
        assert _same_consts(got[1], want[1]), (step, got[1], want[1])
        pw = tape.plan.artifacts.get(protocol._WIRE) if tape.plan is not None else None
        if step >= 3 and steady:
            steady += n_got  # encoded again, of the entries the plan-cache hit rebuilt
            rebuilt += sum(tape.instrs[i] is not o for i, o in zip(pw.at, pw.own, strict=True))
            steps += 1
        y.item()
        genie.materialize(h)
    # the view's constants (-1, 1) never change: taken from the last encoding every step
    assert steps and steady <= rebuilt - steps, (steady, rebuilt, steps)
    assert protocol._MOVES in pw.seen  # the narrow's length


def test_wire_same_takes_only_entries_whose_values_are_the_last_calls():
    """``genie._C._wire_same`` places an entry's last constants only where it is a 4-tuple
    without floats whose values compare equal now (``==``, as the Python loop: ``(2, 3)`` equals
    ``(2, 3)`` made anew); the others (own instruction: skipped; first sight, encoded every
    call, floats, values that moved) are handed back in order; bad columns are refused."""
    import operator

    class Src:
        def __init__(self, leaves):
            self.leaves = leaves

    own = Src([0, 1])
    src = [own, Src([5, (2, 3)]), Src([7, 8]), Src([1.5]), Src([9]), Src([4, 4])]
    at = [0, 1, 2, 3, 4, 5]
    owns = [own, None, None, None, None, None]
    gets = [operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(0, 1),
            operator.itemgetter(0), operator.itemgetter(0), operator.itemgetter(0, 1)]
    c23 = ["c23"]
    seen = [None, ((2, 3), c23, None, 0), ((7, 9), ["x", "y"], None, 0), (1.5, ["f"], -1, 0),
            protocol._MOVES, ((4, 4), ["a", "b"], None, 1)]
    starts = [0, 1, 2, 4, 5, 6]
    part = list(range(8))
    slow = _C._wire_same(src, at, owns, gets, seen, starts, part)
    assert slow == [2, 3, 4]  # moved, floats, every call
    assert part == [0, "c23", 2, 3, 4, 5, "a", "b"] and part[1] is c23[0]
    with pytest.raises(ValueError):
        _C._wire_same(src, at, owns[:-1], gets, seen, starts, part)
    with pytest.raises(IndexError):
        _C._wire_same(src, [0, 1, 2, 3, 4, 99], owns, gets, seen, starts, part)
    with pytest.raises(IndexError):  # constants past the end of the part
        _C._wire_same(src, at, owns, gets, seen, [0, 1, 2, 4, 5, 7], part)
    with pytest.raises(AttributeError):  # a source without leaves: as the Python loop
        _C._wire_same([own, object()], [0, 1], [own, None], gets[:2],
                      [None, ((2, 3), c23, None, 0)], [0, 1], part)


def test_const_delta_native_is_the_python_loop(monkeypatch):
    """``genie._C._const_delta`` gives what the Python loop gives (``GENIE_NATIVE_WIRE=0``) on
    constants of every kind a request holds: ints (big ones too), bools against ints, floats
    (``-0.0``, NaN), strings, lists, the same objects, values whose ``==`` raises."""
    import random

    class Raises:
        def __eq__(self, other):
            raise RuntimeError("no ==")

    rng = random.Random(0)
    r = Raises()
    pool = [0, 1, True, False, 2**40, 2**40 + 1, -5, 0.0, -0.0, float("nan"), 1.5, "a", "b",
            None, [1, 2], [1, 2.0], (3,), r, Raises()]
    for _ in range(300):
        n = rng.randrange(0, 12)
        old = [rng.choice(pool) for _ in range(n)]
        new = [x if rng.random() < 0.5 else rng.choice(pool) for x in old]
        if rng.random() < 0.1:
            new.append(1)
        # equal big ints that are different objects
        old += [int("7" * 25)]
        new += [int("7" * 25)]
        monkeypatch.setattr(config, "native_wire", True)
        got = protocol.const_delta(old, new)
        monkeypatch.setattr(config, "native_wire", False)
        want = protocol.const_delta(old, new)
        assert (got is None) == (want is None)
        if want is not None:
            assert got[0::2] == want[0::2]
            assert all(a is b for a, b in zip(got[1::2], want[1::2], strict=True))
