"""A LazyTensor's record (`_node`, `_out`) held by its impl (csrc/wrapper.cpp), and its liveness.

The native record path makes each output's wrapper with a ``LazyImpl`` that holds the two
references and is counted by its node's output while it holds them (no liveness token); the
Python path (and torch builds without the native wrapper) keeps them in the instance dict with a
liveness token ``_alive`` (``genie._C.Alive``) that the output counts while it lives. Both are
read through the same descriptors and the same count, so every reader sees one record. Eager
PyTorch is the oracle for the values; the record's own invariants (liveness, rebinding, swaps,
copies) are checked directly.
"""
from __future__ import annotations

import copy
import gc
import sys
import threading
import weakref

import pytest
import torch

import genie
from genie import _C, lazy_tensor
from genie.config import config
from genie.lazy_tensor import _RECORD, LazyTensor

DEV = "remote_accelerator"

pytestmark = pytest.mark.skipif(not getattr(_C, "_record_native", False) or
                                _C._record_wrap != "native",
                                reason="the native wrapper needs torch >= 2.13")


def _steady(f):
    """f() after two calls: the first records through Python, the later ones natively."""
    for _ in range(2):
        f()
    return f()


def test_a_natively_recorded_output_keeps_its_record_in_its_impl() -> None:
    a = torch.randn(4, 6)
    x = a.to(DEV)
    y = _steady(lambda: (x * 2).view(-1))
    assert _C._wrapper_in_impl(y)
    assert not any(k in vars(y) for k in _RECORD)
    n, k = y._node, y._out
    assert type(n).__name__ == "Node" and k == 0
    assert n.output(k) == 1 and n.live(k) and _C._wrapper_counts(y)  # the impl is the holder
    assert not hasattr(y, "_alive")  # no token
    torch.testing.assert_close(y.cpu(), (a * 2).view(-1))


def _plus_one_by_python(x: torch.Tensor) -> torch.Tensor:
    """``x + 1`` recorded by the Python path with a wrapper of ``_make_wrapper_subclass`` (its
    record in the instance dict, with a token): what that path makes for outputs with math bits,
    and for every output where the wrappers are not key-free (``GENIE_KEY_FREE=0``, a build
    without native wrappers); key-free, its other outputs are the native path's kind."""
    saved, key_free = config.native_record, lazy_tensor._key_free[0]
    config.native_record = False
    lazy_tensor._key_free[0] = False
    try:
        return x + 1
    finally:
        config.native_record = saved
        lazy_tensor._key_free[0] = key_free


def test_the_python_path_makes_the_native_kind_of_wrapper_where_key_free() -> None:
    if not lazy_tensor._key_free[0]:
        pytest.skip("key-free wrappers are off (GENIE_KEY_FREE=0)")
    x = torch.randn(3, device=DEV)
    saved = config.native_record
    config.native_record = False
    try:
        y = x + 1
    finally:
        config.native_record = saved
    assert _C._wrapper_in_impl(y) and not any(k in vars(y) for k in _RECORD)
    assert not torch._C._dispatch_keys(y).has(torch._C.DispatchKey.Python)
    n, k = y._node, y._out
    assert n.output(k) == 1 and _C._wrapper_counts(y)
    torch.testing.assert_close(y.cpu(), x.cpu() + 1)


def test_the_python_path_keeps_its_record_in_the_dict_and_reads_the_same() -> None:
    y = _plus_one_by_python(torch.randn(3, device=DEV))
    assert not _C._wrapper_in_impl(y)
    assert all(k in vars(y) for k in _RECORD)
    assert y._node is vars(y)["_node"] and y._out == vars(y)["_out"]
    a = vars(y)["_alive"]
    assert type(a) is _C.Alive and a.node is y._node and a.out == y._out
    n, k = y._node, y._out
    assert n.output(k) == 1 and _C._wrapper_counts(y)  # the token is the holder
    del y, a
    assert n.output(k) == 0 and not n.live(k)  # its free counts the output down


def test_a_token_counts_only_its_own_output() -> None:
    y = _plus_one_by_python(torch.randn(3, device=DEV))
    with pytest.raises(TypeError, match="genie.graph.Node"):
        _C.Alive(object(), 0)
    n = y._node
    extra = _C.Alive(n, 0)
    assert n.output(0) == 2
    stray = _C.Alive(n, 5)  # no such output: counts nothing, and its free nothing
    assert n.output(0) == 2
    del extra, stray
    assert n.output(0) == 1
    y._alive = _C.Alive(n, 1)  # a token of another output: y is no longer counted
    assert not _C._wrapper_counts(y) and n.output(0) == 0


def test_an_output_dies_with_its_wrapper() -> None:
    x = torch.randn(5, device=DEV)
    y = _steady(lambda: x * 3)
    n, k = y._node, y._out
    assert n.live(k)
    del y
    # the wrapper's finalizer releases its record (or, where the impl dies later without the
    # GIL, the next read or wrapper bound), before that read decides which values are alive
    genie.materialize(x + 0)
    assert not n.live(k) and n.output(k) == 0, "the node still counts a dead wrapper's output"


def test_a_detached_alias_is_one_more_holder_of_the_output() -> None:
    a = torch.randn(5)
    x = a.to(DEV)
    y = _steady(lambda: x * 3)
    n, k = y._node, y._out
    d = _steady(lambda: y.detach())
    assert d._node is n and d._out == k and _C._wrapper_counts(d)
    assert n.output(k) == 2
    del y  # the value lives while the alias does
    assert n.output(k) == 1 and n.live(k)
    torch.testing.assert_close(d.cpu(), a * 3)
    del d
    assert n.output(k) == 0


def test_the_record_is_released_when_another_thread_drops_the_wrapper() -> None:
    x = torch.randn(5, device=DEV)
    y = _steady(lambda: x * 3)
    r = weakref.ref(y._node)
    holder = [y]
    del y
    t = threading.Thread(target=holder.clear)
    t.start()
    t.join()
    gc.collect()
    assert r() is None


def test_an_impl_destroyed_without_the_gil_queues_its_record_for_the_next_read() -> None:
    """An impl that outlives its wrapper and dies on a thread without the GIL cannot touch
    Python objects: its references wait for the next thread that holds the GIL (a read)."""
    x = torch.randn(5, device=DEV)
    y = _steady(lambda: x * 3)
    n, base = y._node, sys.getrefcount(y._node)
    assert _C._wrapper_drop_without_gil(y) == 1  # its record (node, output number) queued
    assert sys.getrefcount(n) == base + 1  # still held by the queue
    assert n.output(y._out) == 2  # and still counted
    torch.testing.assert_close(y.cpu(), x.cpu() * 3)  # a read releases the queue first
    assert sys.getrefcount(n) == base
    assert n.output(y._out) == 1
    with pytest.raises(TypeError):
        _C._wrapper_drop_without_gil(torch.zeros(1))


def test_user_attributes_live_beside_the_record() -> None:
    x = torch.randn(2, 3, device=DEV)
    y = _steady(lambda: x.t())
    y.note = "kept"
    assert vars(y) == {"note": "kept"} and y._node is not None
    c = copy.deepcopy(y)
    assert c.note == "kept" and c._node is not y._node
    torch.testing.assert_close(c.cpu(), y.cpu())


def test_rebinding_a_wrapper_replaces_its_record() -> None:
    a, b = torch.randn(4), torch.randn(4)
    p = torch.nn.Parameter(a.to(DEV))
    q = _steady(lambda: b.to(DEV) * 1)
    old, ok = p._node, p._out
    was, now = old.output(ok), q._node.output(q._out)
    p.data = q
    assert p._node is q._node and p._out == q._out
    # the old record counted down, the new one up: the value lives while p or q does
    assert old.output(ok) == was - 1 and q._node.output(q._out) == now + 1
    torch.testing.assert_close(p.cpu(), b)


def test_module_to_swaps_a_parameter_with_its_record() -> None:
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    m = copy.deepcopy(ref)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = m.weight
    m.to(DEV)
    assert m.weight is w  # swapped in place (swap_tensors), as .to("cuda") keeps it
    assert isinstance(m.weight, LazyTensor) and m.weight._node is not None
    x = torch.randn(2, 4)
    for mod, xin in ((ref, x), (m, x.to(DEV))):
        loss = mod(xin).square().sum()
        loss.backward()
    torch.testing.assert_close(m.weight.grad.cpu(), ref.weight.grad)
    opt.step()
    torch.testing.assert_close(m.weight.cpu(), ref.weight - 0.1 * ref.weight.grad)


def test_deleting_a_field_twice_raises_attribute_error() -> None:
    x = torch.randn(2, device=DEV)
    y = _steady(lambda: x + 1)
    n, keep = y._node, y._out
    del y._out
    assert n.output(keep) == 0  # a record without its output number counts nothing
    with pytest.raises(AttributeError):
        y._out
    with pytest.raises(AttributeError):
        del y._out
    y._out = keep
    assert n.output(keep) == 1 and _C._wrapper_counts(y)
    assert not hasattr(torch.zeros(1), "_node")
    torch.testing.assert_close(y.cpu(), x.cpu() + 1)
