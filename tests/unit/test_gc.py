"""Recorded nodes and the cyclic garbage collector (``genie.graph``: untrack_node, retrack_below).

Nodes that cannot close a reference cycle are taken off the collector at record time; a write
(the one edge that can close a cycle: storage -> pending writer -> inputs -> storage) puts back
everything below it: at record (``GENIE_GC_DEFER_WRITES=0``), or by default only if the writer
stays pending until a full collection or until many writers are pending at once
(``genie.graph.defer_writer``). These tests check both halves: untracked where promised, and every
cycle a write closes still collected (no leak) when the program drops it without materializing.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

import genie
from genie import graph
from genie.config import config

DEV = "remote_accelerator:0"


@pytest.fixture(autouse=True)
def _untrack_on():
    saved = config.gc_untrack, config.gc_defer_writes
    config.gc_untrack = True
    yield
    config.gc_untrack, config.gc_defer_writes = saved


@pytest.fixture(params=[True, False], ids=["deferred", "at_record"])
def defer(request: pytest.FixtureRequest) -> bool:
    config.gc_defer_writes = request.param
    return request.param


def test_plain_ops_untracked_writers_tracked(defer: bool) -> None:
    for _ in range(3):  # the first time through the Python path, then the native one
        a = torch.ones(3, device=DEV)
        b = a * 2
        assert not gc.is_tracked(b._node)  # (its arguments are inline: no list, no Ref)
        b.add_(1)
        w = b._node.storages[b._out].pending_writes[-1]
        if defer:  # untracked until it stays pending: a full collection, or many writers
            assert not gc.is_tracked(w) and not gc.is_tracked(b._node)
            assert graph.retrack_writers() >= 1
        # the writer is tracked and has re-tracked what it reads
        assert gc.is_tracked(w)
        assert gc.is_tracked(b._node)
        assert torch.equal(b.cpu(), torch.full((3,), 3.0))


def test_writers_that_ran_are_not_retracked() -> None:
    """The steady state of a training loop: each step's writes run at the next materialization,
    so nothing is ever put back under the collector."""
    config.gc_defer_writes = True
    graph.retrack_writers()
    a = torch.zeros(4, device=DEV)
    for i in range(3):
        a.add_(1)
        b = a * 2
        assert not gc.is_tracked(b._node)
        assert b[0].item() == 2.0 * (i + 1)
    assert graph.retrack_writers() == 0


def test_many_pending_writers_are_put_back_under_the_collector() -> None:
    """A program that writes and drops its tensors without ever materializing (and without a
    full collection): once _DEFER_LIMIT writers are pending, they go back under the collector
    with everything below them, so at most _DEFER_LIMIT dropped writes are ever invisible to
    it; the collector then frees them all (here gc.collect(); in a long loop its own
    collections, as any cyclic garbage)."""
    config.gc_defer_writes = True
    graph.retrack_writers()
    a = torch.ones(4, device=DEV)
    writers = []
    for _ in range(3 * graph._DEFER_LIMIT):
        x = a + 1
        x.mul_(2)
        writers.append(weakref.ref(x._node.storages[x._out].pending_writes[-1]))
    del x
    hidden = sum(1 for w in writers if w() is not None and not gc.is_tracked(w()))
    assert hidden <= graph._DEFER_LIMIT, f"{hidden} dropped writers the collector cannot see"
    gc.collect()
    assert sum(w() is not None for w in writers) == 0, "dropped writers leaked"


def test_untrack_flag_off_keeps_everything_tracked() -> None:
    config.gc_untrack = False
    a = torch.ones(3, device=DEV)
    b = a * 2
    assert gc.is_tracked(b._node)


@pytest.mark.parametrize("case", ["inplace", "view_inplace", "chain_then_write", "index_put"])
def test_dropped_pending_writes_are_collected(case: str, defer: bool) -> None:
    """A write closes a cycle through storage.pending_writes; dropping it all must free it."""
    def build() -> list[weakref.ref]:
        a = torch.randn(4, 4, device=DEV)
        x = a + 1
        refs = [weakref.ref(x._node)]
        if case == "inplace":
            x.mul_(2)
        elif case == "view_inplace":
            v = x[1:3].t()
            refs.append(weakref.ref(v._node))
            v.add_(1)
        elif case == "chain_then_write":
            y = (x * 3).relu().sum(0)
            refs.append(weakref.ref(y._node))
            x.add_(y)
        else:
            x[torch.tensor([0, 2])] = torch.zeros(4, device=DEV)
        w = x._node.storages[x._out].pending_writes[-1]
        refs.append(weakref.ref(w))
        return refs

    refs = build()
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs), "a dropped pending write leaked its nodes"


def test_values_equal_with_and_without_untracking() -> None:
    def run() -> torch.Tensor:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        m = m.to(DEV)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        x = torch.randn(5, 8).to(DEV)
        for _ in range(3):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
        return genie.materialize(m(x)).cpu()

    on = run()
    config.gc_untrack = False
    off = run()
    assert torch.equal(on, off)


def test_live_nodes_counts_untracked_nodes() -> None:
    from genie.graph import live_nodes

    gc.collect()
    base = live_nodes()
    a = torch.ones(3, device=DEV)
    ys = [a * i for i in range(5)]  # 5 untracked nodes, plus a's factory node
    assert not any(gc.is_tracked(y._node) for y in ys)
    assert live_nodes() == base + 6
    del ys, a
    gc.collect()
    assert live_nodes() == base


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_consumer_count_and_reader_list_made_at_the_first_read(native: bool) -> None:
    """A node counts its consumers (a small int, no list) and a storage's ``readers`` are the
    shared empty tuple until a pending node reads it (a value nothing reads makes no list); the
    first read makes a list holding the reader's weak reference, off the collector as its owner
    is. ``consumers`` finds the pending consumers through those readers."""
    saved = config.native_record
    config.native_record = native
    try:
        a = torch.ones(4, device=DEV)
        for _ in range(3):  # the first time through the Python path, then the chosen one
            x = a * 2
            n, s = x._node, x._node.storages[x._out]
            assert n.n_consumers == 0 and n.consumers == ()
            assert s.readers == () and type(s.readers) is tuple
            y = x * 0.5
            z = x + 1.0
        assert n.n_consumers == 2 and type(s.readers) is list
        assert [w() for w in n.consumers] == [y._node, z._node]
        assert [w() for w in s.readers] == [y._node, z._node]
        assert not gc.is_tracked(s.readers)
        assert y._node.n_consumers == 0 and y._node.consumers == ()
        assert y._node.storages[0].readers == ()
        torch.testing.assert_close(z.cpu(), torch.full((4,), 3.0))
    finally:
        config.native_record = saved


def test_a_recorded_value_leaves_one_tracked_object() -> None:
    """Per recorded op, only the LazyTensor itself stays under the collector: its node (its
    outputs' liveness is a count, its arguments are inline: no list and no Refs), its output
    storage (with its two lists) and its instance dict (the Python path's, with its liveness
    token) are untracked."""
    a = torch.ones(4, device=DEV)
    for _ in range(3):  # the first time through the Python path, then (by default) the native one
        x = a * 2
        y = x * 0.5
    n, s = y._node, y._node.storages[y._out]
    assert n._st is s and n._out is n.outputs[0]  # one output's: inline, no lists
    # the leaves are a list made on each read (csrc/node.h): the node holds its producer
    assert n.leaves is not n.leaves and n.refs() == [(x._node, x._out)]
    objs = {"node": n, "output": n._out,
            "wref": n._wref, "storage": s,
            "pending_writes": s.pending_writes, "readers": s.readers,
            "dict": y.__dict__, "input storage": x._node.storages[0]}
    if "_alive" in vars(y):  # the Python path's (or a torch without the native wrapper's) token
        objs["token"] = vars(y)["_alive"]
    assert n.output(y._out) == 1
    assert {k for k, o in objs.items() if gc.is_tracked(o)} == set()
    assert gc.is_tracked(y)
    for _ in range(3):
        vals, idx = y.max(dim=0)
    m = idx._node  # two outputs: lists of storages and counts, untracked too
    assert type(m._st) is list and type(m._out) is list and m.outputs == [1, 1]
    assert not [o for o in (m, m._st, m._out, *m._st, *m._out) if gc.is_tracked(o)]


def test_a_write_tracks_its_storage_again_and_user_attributes_track_the_dict(defer: bool) -> None:
    a = torch.ones(4, device=DEV)
    b = a * 2
    s = b._node.storages[b._out]
    assert not gc.is_tracked(s) and not gc.is_tracked(s.pending_writes)
    b.add_(1)  # a pending writer: the one edge that can close a cycle through the storage
    if defer:
        assert not gc.is_tracked(s) and not gc.is_tracked(s.pending_writes)
        graph.retrack_writers()
    assert gc.is_tracked(s) and gc.is_tracked(s.pending_writes)
    c = a * 3
    assert not gc.is_tracked(c.__dict__)
    c.me = c  # a cycle through the tensor's dict: CPython tracks the dict again
    assert gc.is_tracked(c.__dict__)
    r = weakref.ref(c._node)
    del c
    gc.collect()
    assert r() is None, "a cycle through a LazyTensor's attributes leaked"
    assert torch.equal(b.cpu(), torch.full((4,), 3.0))


@pytest.mark.parametrize("untrack", [True, False], ids=["untracked", "flag_off"])
def test_meta_cache_entries_are_off_the_collector_and_freed_with_the_cache(untrack: bool) -> None:
    """A meta-cache miss leaves its key, entry and output metadata off the collector's lists
    (they live as long as the cache and close no cycle; tracked with ``GENIE_GC_UNTRACK=0``), and
    clearing the caches frees the entry by reference counting alone (nothing else holds it)."""
    import sys

    from genie import meta, plan_cache

    config.gc_untrack = untrack
    n = 7919 + int(untrack)  # a shape no other test records
    a = torch.ones(n, 3, device=DEV)
    b = (a * 2).t()  # two misses: mul, and a view of its output
    torch.testing.assert_close(b.cpu(), torch.ones(n, 3).mul(2).t())
    entry = b._node.entry
    key = next(k for k, v in meta.meta_cache._d.items() if v is entry)
    objects = [key, entry, entry.metas, entry.consts, *entry.metas]
    assert [gc.is_tracked(o) for o in objects] == [not untrack] * len(objects)
    if untrack:  # interned per shape class (another test may have made this one, tracked)
        assert not gc.is_tracked(entry.klass)
    del a, b, key, objects
    gc.disable()
    try:
        plan_cache.clear()
        meta.meta_cache.clear()  # the native path's entries too
        assert sys.getrefcount(entry) == 2  # `entry` and getrefcount's argument
    finally:
        gc.enable()


class _Cyclic:
    """A garbage cycle of the program's own (an object that refers to itself)."""

    def __init__(self) -> None:
        self.me = self


def _young_collections() -> int:
    return gc.get_stats()[0]["collections"]


@pytest.fixture(params=[False, True], ids=["untracked_memory", "memory_tracking"])
def memory_tracking(request: pytest.FixtureRequest):  # noqa: ANN201
    """Memory tracking on or off for one test (on, the executor keeps a run's node list to
    account the peak, and releases it after: in CI's order an earlier test had turned it on for
    good, and then the program's garbage cycles were never collected, as below)."""
    from genie import memory

    was = memory._tracking[0]
    memory._tracking[0] = request.param
    yield request.param
    memory._tracking[0] = was


@pytest.mark.skipif(sys.version_info[:2] not in ((3, 11), (3, 12)),
                    reason="the young generation's count is kept on CPython 3.11 and 3.12")
@pytest.mark.parametrize("step", ["chain", "cse", "dropped"])
def test_recording_does_not_bring_the_collector_closer_but_the_programs_garbage_does(
        memory_tracking: bool, step: str, request: pytest.FixtureRequest) -> None:
    """Recording made ~10 collector-allocated objects per op that live until the value is read
    (untracked, but counted by CPython's young generation): a GPT-2 generate of ~7,000 ops ran
    ~83 young collections per call where eager ran none, and every ~25 calls a full collection
    over the whole heap (~300 ms). genie._C now takes an object it untracks at allocation off
    the count too (csrc/gccount.cpp), and only such an object: the program's own garbage cycles
    are collected as often as without Genie. Freeing those objects lowers the count again, so
    every bulk free of a run's nodes puts it back (``_bind_nodes``, ``_release_nodes``): with
    memory tracking on, the nodes were freed with the dropped tape, uncompensated, and each read
    ate the count the program had built (55 of 60 of its cycles alive against eager's 4). The
    ``cse`` step's reads run a tape the passes made (common subexpressions merged), which holds
    the same nodes and was dropped after the bind the same way. The ``dropped`` step drops its
    pending chain unread every 50 steps: its nodes are freed outside any code of Genie's, with
    its last tensor, and each free lowered the count their allocation never raised (a 100-op
    chain: -620, and its liveness tokens -100 more), so such a program ran no young collection;
    the native node's deallocator now gives that back (csrc/node.cpp)."""
    assert genie._C._gc_count_active(), "setup.py did not find the young generation's count"
    if memory_tracking and step == "cse":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "known gap (session 51): the native record path's liveness token is taken off the "
            "young count at allocation and lowers it when its tensor dies, one per dead "
            "intermediate; the argument list each recorded op took from CPython's list free "
            "list used to offset that by chance, and since the arguments are inline "
            "(docs/node-layout.md step 4b) this churn runs 7 young collections against eager's "
            "8. Counting the token instead cost GPT-2 generate ~6 young collections a call "
            "where eager runs 0.04. Node-layout step 5 (a native token) is where to settle it.")))
    if memory_tracking and step == "chain":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "the same gap: the chain's churn runs 7 young collections against eager's 8 (torch "
            "2.11 on the H200 and the CPU, session 53; torch 2.13 since session 54's steady "
            ".cpu() reads natively: the Python frames of each of its 12 reads, allocated and "
            "freed, used to offset the tokens' count by chance, as the argument lists above)")))
    x = torch.randn(4, 4, device=DEV)
    y = x
    for _ in range(10):
        y = torch.relu(y + 1)
    y.cpu()
    was = gc.isenabled()
    gc.disable()
    try:
        before = gc.get_count()[0]
        y = x
        for _ in range(500):
            y = torch.relu(y + 1)
        per_op = (gc.get_count()[0] - before) / 1000
    finally:
        if was:
            gc.enable()
    assert per_op < 2, per_op  # it was 10
    y.cpu()

    def churn(with_genie: bool) -> tuple[int, list[weakref.ref]]:
        gc.collect()
        n0, refs, z = _young_collections(), [], x
        for i in range(6000):
            c = _Cyclic()
            if i % 100 == 0:
                refs.append(weakref.ref(c))
            del c
            if with_genie:
                z = torch.relu(z + 1) if step != "cse" else torch.relu(z + 1) - (z + 1) + z
                if step == "dropped" and i % 50 == 49:
                    z = x  # the pending chain dropped unread
                elif i % 500 == 499:
                    z.cpu()
        return _young_collections() - n0, refs

    def alive(refs: list[weakref.ref]) -> int:
        return sum(r() is not None for r in refs)

    eager_runs, refs = churn(False)
    eager_alive = alive(refs)
    genie_runs, refs = churn(True)
    assert eager_runs >= 5 and genie_runs >= eager_runs, (eager_runs, genie_runs)
    # (the last ones wait for the next collection, as without Genie: freeing a run's recorded
    # objects, which were never counted, must not lower the count the program's own built)
    from genie import memory
    from genie.config import config

    state = {"alive": [r() is not None for r in refs], "eager_alive": eager_alive,
             "runs": (eager_runs, genie_runs), "threshold": gc.get_threshold(),
             "count": gc.get_count(), "callbacks": len(gc.callbacks),
             "frozen": gc.get_freeze_count(), "tracking": memory._tracking[0],
             "gc_untrack": config.gc_untrack}
    # cycles made since the last young collection wait for the next one: up to a threshold's
    # worth (one in 100 has a reference here), with and without Genie
    assert alive(refs) <= max(eager_alive, gc.get_threshold()[0] // 100 + 1), state


def test_node_is_the_native_type_with_methods_only() -> None:
    """genie.graph.Node subclasses genie._C.Node (csrc/node.cpp) and adds no field: the natives
    read the native struct's fields, and its deallocator is the one a node gets."""
    assert issubclass(graph.Node, genie._C.Node) and graph.Node.__slots__ == ()
    assert graph.Node.__basicsize__ == genie._C.Node.__basicsize__
    y = torch.ones(3, device=DEV) * 2
    n = y._node
    assert type(n) is graph.Node and n._wref() is n and n.executed is False
    m = graph.Node.__new__(graph.Node)
    with pytest.raises(AttributeError):
        m.leaves  # noqa: B018  (an unset field, as an unset slot)


@pytest.mark.skipif(sys.version_info[:2] not in ((3, 11), (3, 12)),
                    reason="the young generation's count is kept on CPython 3.11 and 3.12")
def test_a_dropped_pending_chain_leaves_the_young_count_and_the_stack_alone() -> None:
    """A pending chain dropped unread is freed with its last tensor, outside Genie's code. Its
    nodes' frees lowered the count their allocation never raised (a 100-op chain: -620), so a
    program that only dropped chains ran no young collection; a pending node's deallocator now
    puts the count back and gives back its outputs' liveness tokens. The chain below it is
    freed in a loop, so a long one neither recurses nor leaves frees to the trashcan (outside
    the bracket)."""
    assert genie._C._gc_count_active(), "setup.py did not find the young generation's count"
    x = torch.randn(4, device=DEV)
    x.cpu()
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        keep = [_Cyclic() for _ in range(300)]  # (a count well above 0: a drop could lower it)
        for n_ops in (200, 100_000):
            y = x
            for _ in range(n_ops // 2):
                y = torch.relu(y + 1.0)
            first = weakref.ref(y._node)
            before = gc.get_count()[0]
            del y
            assert first() is None
            assert gc.get_count()[0] >= before, (n_ops, before, gc.get_count())
        del keep
    finally:
        if was:
            gc.enable()
    gc.collect()
