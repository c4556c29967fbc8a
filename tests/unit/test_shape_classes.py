"""genie.remote.shape_class in process: what makes a class, what a class admits (eager's checks).

The server-side tests (tests/integration/test_shape_class.py) play the attacker over the wire;
these check the pieces on tapes built here: which integers may become symbols, that a class
admits exactly the calls whose concrete vet passes (against the meta kernels' own refusals on a
sweep of sizes), and that its working-set bound is never below the concrete vet's peak.
"""

from __future__ import annotations

import optree
import pytest
import torch

from genie.planner import Instr, Slot, Tape
from genie.remote.guard import vet_tape
from genie.remote.shape_class import NotAClass, build, moved, shape_params


def _tape(x: torch.Tensor, a: int, b: int) -> Tape:
    """``(x.view(a, b) * 2).sum(0)`` of an input ``x``."""
    def ins(op, args, outs, free=()):
        leaves, spec = optree.tree_flatten((args, {}), none_is_leaf=True)
        return Instr(op, leaves, spec, outs, None, free)

    aten = torch.ops.aten
    return Tape([ins(aten.view.default, (Slot(0), [a, b]), (1,)),
                 ins(aten.mul.Scalar, (Slot(1), 2.0), (2,), (1,)),
                 ins(aten.sum.dim_IntList, (Slot(2), [0]), (3,), (2,))],
                {0: x}, [3], {3}, [], {})


def _class(n0: int, n1: int):
    t0, t1 = _tape(torch.zeros(2 * n0), 2, n0), _tape(torch.zeros(2 * n1), 2, n1)
    (k0, i0), (k1, i1) = shape_params(b"k", t0), shape_params(b"k", t1)
    assert k0 == k1
    pos = moved(i0, i1)
    assert pos is not None
    return build(t1, i1, pos, i0)


def test_only_integers_of_at_least_two_that_moved_become_symbols() -> None:
    assert moved((4, 8, 3), (4, 9, 3)) == [1]
    assert moved((4, 8), (4, 8)) is None  # nothing moved
    assert moved((1, 8), (2, 8)) is None  # a 1 broadcasts: not one class with a 2
    assert moved((0, 8), (5, 8)) is None
    assert moved((4, 8), (4, 8, 1)) is None
    assert moved((4, -8), (4, -9)) == [1]  # x[-n:]: the negation of a symbol
    assert moved((4, -8), (4, 8)) is None and moved((4, -1), (4, -2)) is None


def test_a_class_admits_exactly_what_the_concrete_vet_passes() -> None:
    cls = _class(3, 4)
    for n in range(2, 9):
        for a, b in ((2, n), (n, 2), (2, n + 1), (1, 2 * n), (2 * n, 1), (4, n)):
            tape = _tape(torch.zeros(2 * n), a, b)
            key, ints = shape_params(b"k", tape)
            try:
                peak = vet_tape(tape, 1 << 30).peak
            except Exception:  # noqa: BLE001 - the meta kernel refuses: the class must too
                peak = None
            bound = cls.admit(ints)
            if peak is None:
                assert bound is None, (a, b, n)
            elif bound is not None:
                assert bound >= peak, (a, b, n, bound, peak)
    # the calls of the class's own shape family are all admitted
    for n in range(2, 64):
        assert cls.admit(shape_params(b"k", _tape(torch.zeros(2 * n), 2, n))[1]) is not None


def test_a_class_keys_what_is_not_an_integer() -> None:
    base = shape_params(b"k", _tape(torch.zeros(8), 2, 4))[0]
    assert shape_params(b"k", _tape(torch.zeros(8, dtype=torch.float64), 2, 4))[0] != base
    assert shape_params(b"k", _tape(torch.zeros(16)[::2], 2, 4))[0] != base  # not dense
    assert shape_params(b"k2", _tape(torch.zeros(8), 2, 4))[0] != base


def test_a_structure_that_resizes_is_not_a_class() -> None:
    aten = torch.ops.aten
    leaves, spec = optree.tree_flatten(((Slot(0), [7]), {}), none_is_leaf=True)
    tapes = [Tape([Instr(aten.resize_.default, leaves[:1] + [n], spec, (1,), None)],
                  {0: torch.zeros(4)}, [1], {1}, [], {}) for n in (6, 7)]
    (_, i0), (_, i1) = shape_params(b"k", tapes[0]), shape_params(b"k", tapes[1])
    with pytest.raises(NotAClass):
        build(tapes[1], i1, moved(i0, i1), i0)


def test_a_negative_integer_that_moves_is_the_negation_of_a_symbol() -> None:
    """``x[-k:] * 2``: the slice's start moves as -k; the class admits other k with the bound
    at least the concrete vet's peak, and only those."""
    aten = torch.ops.aten

    def tape(x: torch.Tensor, k: int) -> Tape:
        args = ((Slot(0), 0, -k, 2 ** 62), {})
        leaves, spec = optree.tree_flatten(args, none_is_leaf=True)
        mleaves, mspec = optree.tree_flatten(((Slot(1), 2.0), {}), none_is_leaf=True)
        return Tape([Instr(aten.slice.Tensor, leaves, spec, (1,), None),
                     Instr(aten.mul.Scalar, mleaves, mspec, (2,), None, (1,))],
                    {0: x}, [2], {2}, [], {})

    (_, i0), (_, i1) = shape_params(b"k", tape(torch.zeros(16), 3)), \
        shape_params(b"k", tape(torch.zeros(16), 4))
    cls = build(tape(torch.zeros(16), 4), i1, moved(i0, i1), i0)
    assert cls.signs is not None and -1 in cls.signs
    for k in (2, 5, 9, 16):
        t = tape(torch.zeros(16), k)
        bound = cls.admit(shape_params(b"k", t)[1])
        assert bound is not None and bound >= vet_tape(t, 1 << 30).peak, k
    assert cls.admit(shape_params(b"k", tape(torch.zeros(16), 1))[1]) is None  # -1: 0/1 rule


def test_whatever_goes_wrong_in_a_build_is_not_a_class(monkeypatch) -> None:
    """A class is an optimization: an error anywhere in building one (here PyTorch's guard
    printer failing, as an AttributeError did on a foreach gradient tape through a server) is
    NotAClass, never the request's error."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def broken(self, *a, **k):
        raise AttributeError("'int' object has no attribute 'node'")

    monkeypatch.setattr(ShapeEnv, "produce_guards_expression", broken)
    with pytest.raises(NotAClass, match="AttributeError"):
        _class(3, 4)
