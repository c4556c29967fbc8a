"""The client's half of residency (genie.remote.residency) and roles from nodes (genie.context)."""

from __future__ import annotations

import pytest
import torch

import genie  # noqa: F401  (registers remote_accelerator)
from genie import context
from genie.graph import TensorMeta
from genie.remote.protocol import DECODE_PINNED, ROLE_CODE, ROLES

pytest.importorskip("zmq")
from genie.remote.residency import dense  # noqa: E402


def _meta(shape: tuple, stride: tuple, offset: int = 0) -> TensorMeta:
    return TensorMeta(shape, stride, offset, torch.float32, 0)


def test_dense_layouts_are_those_a_reupload_reproduces() -> None:
    assert dense(_meta((4, 8), (8, 1)))
    assert dense(_meta((4, 8), (1, 4)))            # a transposed contiguous tensor
    assert dense(_meta((4, 1, 8), (8, 99, 1)))     # a size-1 dimension's stride is free
    assert not dense(_meta((4, 8), (8, 1), offset=8))   # a view past its storage's start
    assert not dense(_meta((4, 8), (16, 1)))       # every other row of a larger storage
    assert not dense(_meta((4, 8), (0, 1)))        # expanded: elements overlap
    assert not dense(None)


def test_role_codes_order_eviction() -> None:
    assert ROLES[0] == "activation" and ROLES[-1] == "kv_cache"
    assert ROLE_CODE["activation"] < ROLE_CODE["gradient"] < ROLE_CODE["weight"]
    assert DECODE_PINNED == {ROLE_CODE["weight"], ROLE_CODE["kv_cache"]}


def test_node_roles_follow_the_tensor_roles() -> None:
    lin = torch.nn.Linear(4, 4).to("remote_accelerator")
    x = torch.randn(2, 4).to("remote_accelerator")
    y = lin(x)
    w = lin.weight
    assert context.node_role(w._node, w._out) == "weight"
    assert context.node_role(x._node, x._out) == "input"
    assert context.node_role(y._node, y._out) == "activation"
    with torch.no_grad():
        w.mul_(2)  # an in-place update keeps the storage, and so the role
    assert context.node_role(w._node, w._out) == "weight"
    assert context.node_role(w.t()._node, 0) == "weight"  # a view of it too


def test_ran_hints_by_each_metadata_objects_layout_and_size(monkeypatch) -> None:
    """``Residency.ran`` notes every dense value a run made, with its size, and never one a
    re-upload would not reproduce; a metadata object met before (a step's nodes share theirs
    with the steps before) is not measured again, one equal to it but new is."""
    from genie.remote import residency
    from genie.remote.handle import Handle

    class FakeClient:
        def _release(self, hid: int) -> None:
            pass

    class FakeTape:
        inputs: dict = {}
        nodes: list = []

    measured = []
    real = residency.dense
    monkeypatch.setattr(residency, "dense", lambda m: measured.append(m) or real(m))
    res = residency.Residency(FakeClient())
    a, b, view = _meta((4, 8), (8, 1)), _meta((2, 2), (2, 1)), _meta((4, 8), (16, 1))
    c = FakeClient()
    for step in range(3):
        kept = {1: Handle(10 * step + 1, c, a), 2: Handle(10 * step + 2, c, b),
                3: Handle(10 * step + 3, c, view), 4: Handle(10 * step + 4, c, _meta((4,), (1,)))}
        res.ran(FakeTape(), kept, {}, [], [])
        assert [h.res.nbytes if h.res else None for h in kept.values()] == [128, 16, None, 16]
        assert sorted(res.live) == sorted(h.id for h in kept.values() if h.res)
        res.live.clear()
    # a, b and view once each; the new (4,) metadata of every step each time
    assert len(measured) == 3 + 3 and [sum(x is m for x in measured) for m in (a, b, view)] == \
        [1, 1, 1]
