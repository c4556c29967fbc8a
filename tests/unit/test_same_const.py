"""One equality of constants (genie.graph.same_const) for the plan cache and the wire protocol."""

import math

import pytest
import torch

import genie
from genie import plan_cache
from genie.graph import same_const

NAN = float("nan")


@pytest.mark.parametrize(("a", "b", "same"), [
    (NAN, NAN, True),  # a NaN that repeats is not a change
    (NAN, float("nan"), True),
    (-NAN, NAN, True),
    (NAN, 0.0, False),
    (0.0, NAN, False),
    (0.0, -0.0, False),
    (-0.0, -0.0, True),
    (0.0, 0.0, True),
    (1, True, False),
    (True, 1, False),
    (1, 1.0, False),
    (1.0, True, False),
    (1, 1, True),
    (True, True, True),
    (math.inf, math.inf, True),
    (math.inf, -math.inf, False),
    ("a", "a", True),
    (None, None, True),
    (torch.float32, torch.float32, True),
    (torch.float32, torch.float64, False),
    (complex(NAN, 0), complex(NAN, 0), False),  # complex NaN: no special case (rare; re-sent)
])
def test_same_const(a, b, same):
    assert same_const(a, b) is same
    assert same_const(b, a) is same


def test_tensors_are_the_same_only_when_they_are_the_same_object():
    t = torch.ones(3)
    assert same_const(t, t)
    assert not same_const(t, torch.ones(3))


def test_plan_cache_and_protocol_use_the_one_function():
    from genie.passes import pipeline

    assert plan_cache._same_const is same_const
    assert pipeline.same_const is same_const
    protocol = pytest.importorskip("genie.remote.protocol")
    assert protocol.same_const is same_const
    # a constant delta does not re-send a repeated NaN, and does send a changed sign of zero
    assert protocol.const_delta([NAN, 0.0, 1, 2.0, 3], [NAN, -0.0, True, 2.0, 3]) == \
        [1, -0.0, 2, True]


def test_a_repeated_nan_constant_is_not_a_float_parameter():
    plan_cache.clear()
    x = torch.randn(4, device="remote_accelerator")
    genie.materialize(x)
    xc = x.cpu()
    genie.reset_stats()
    for _ in range(3):
        got = x.mul(2.0).add(NAN).clamp(max=NAN).cpu()
        torch.testing.assert_close(got, xc.mul(2.0).add(NAN).clamp(max=NAN), equal_nan=True)
    s = genie.stats()
    assert (s["plan_cache_misses"], s["plan_cache_hits"]) == (1, 2)
    assert not plan_cache.cache().plans()[-1].floats  # no constant was seen to change
