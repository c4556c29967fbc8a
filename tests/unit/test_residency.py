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
