"""genie.remote.worker.Session's accounting in process: what a session holds and counts.

A run's kept values are put, a request's frees dropped and its held inputs resolved in bulk
(``put_many``, ``drop_many``, ``Worker._held_inputs``: one native pass over the session's dicts
each, ``genie._C._put_handles``, ``_drop_handles``, ``_held_inputs``); the
counts must be the ones :meth:`Session.put` and :meth:`Session.drop` reach one value at a time
(views of one storage counted once, a storage uncounted with its last value), and a bulk put
that :meth:`Session.put` would refuse puts nothing. A run recounts what it read only when its
skeleton has an op that writes.
"""

from __future__ import annotations

import hashlib
import re

import msgpack
import pytest
import torch

from genie import graphs
from genie.remote import protocol
from genie.remote.worker import HANDLE_COST, Config, Refused, Session, Worker


def _state(s: Session) -> tuple:
    return (sorted(s.store), s.nbytes, sorted(map(tuple, s.storages.values())), s.used())


def test_bulk_puts_and_drops_count_as_one_at_a_time() -> None:
    base = torch.zeros(64)
    values = [base, base[8:], torch.ones(3, 5), base.view(8, 8), torch.zeros(0),
              torch.arange(7), torch.ones(3, 5).t()]
    one, bulk = Session(b"a", 1 << 30), Session(b"b", 1 << 30)
    for i, v in enumerate(values):
        one.put(10 + i, v)
    bulk.put_many(list(range(10, 10 + len(values))), values)
    assert _state(one) == _state(bulk)
    assert bulk.nbytes == 64 * 4 + 15 * 4 + 7 * 8 + 15 * 4
    assert bulk.used() == bulk.nbytes + HANDLE_COST * len(values)
    for ids in ([10, 12, 99], [11], [13, 13, 16, -1], [14, 15]):
        for i in ids:
            one.drop(i)
        bulk.drop_many(ids)
        assert _state(one) == _state(bulk), ids
    assert bulk.store == {} and bulk.nbytes == 0 and bulk.storages == {}


@pytest.mark.parametrize("case", ["held", "not a tensor", "twice"])
def test_a_bulk_put_that_put_refuses_puts_nothing(case: str) -> None:
    s = Session(b"a", 1 << 30)
    s.put(1, torch.zeros(4))
    before = _state(s)
    ids, values = [2, 3], [torch.ones(2), torch.ones(3)]
    if case == "held":
        ids = [2, 1]
    elif case == "not a tensor":
        values = [torch.ones(2), 3.0]
    with pytest.raises(Refused):
        s.put_many(ids, values) if case != "twice" else s.put_many([2, 2], values)
    assert _state(s) == before


def _worker(monkeypatch: pytest.MonkeyPatch) -> Worker:
    """An in-process session worker. A Worker turns on the server's check of every graph_mut
    call for its (own) process: restored after the test, or later tests in this process run as
    a server would (no direct calls)."""
    monkeypatch.setattr(graphs, "check_calls", graphs.check_calls)
    return Worker(b"tok", Config("cpu", 1 << 30, 60.0, None, 1))


def _run(w: Worker, sk: bytes, consts: list, frames: list, id0: int) -> dict:
    h = {"t": "run", "k": hashlib.blake2b(sk, digest_size=16).digest(), "sk": sk, "c": consts,
         "id0": id0}
    reply, _, _ = w.handle(protocol.unpack(protocol.pack(h)), frames)  # as it arrives
    assert reply["t"] == "ok", reply
    return reply


def _host(t: torch.Tensor, index: int) -> msgpack.ExtType:
    return msgpack.ExtType(protocol.EXT_HOST, protocol.pack(
        [index, protocol.dtype_name(t.dtype), list(t.shape), None]))


def test_only_a_tape_that_writes_recounts_what_it_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run recounts the storages of its inputs (a ``resize_``, ``out=`` or ``set_`` of a
    resident value grows it: test_security's test_6_resize...) when an op of its skeleton writes
    an argument; a skeleton of ops that write nothing (a decode step's 519) cannot resize one."""
    recounts = []
    monkeypatch.setattr(Session, "refresh", lambda self, ts: recounts.append(len(list(ts))))
    w = _worker(monkeypatch)
    x, y = torch.ones(4), torch.full((4,), 2.0)
    neg = protocol.pack([1, ["aten::neg.default"], [[1, [1, 0], [3, [], []]]],
                         [[0, 0, [-1], [0], [], False]], [], [0], [0]])
    _run(w, neg, [_host(x, 0)], [protocol.tensor_frame(x)[0]], 100)  # keeps -x as handle 100
    assert recounts == [] and protocol.compile_skeleton(neg).writes is False
    assert protocol.compile_skeleton(neg).graph_calls is False  # (nor looks for graphs)
    add_ = protocol.pack([1, ["aten::add_.Tensor"], [[1, [1, 0, 0], [3, [], []]]],
                          [[0, 0, [5, -1], [6], [], False]], [5], [6], []])
    assert protocol.compile_skeleton(add_).writes is True
    _run(w, add_, [100, _host(y, 0)], [protocol.tensor_frame(y)[0]], 200)
    assert recounts == [1]
    torch.testing.assert_close(w.sess.store[100], -x + y)
    _run(w, neg, [_host(y, 0)], [protocol.tensor_frame(y)[0]], 300)
    assert recounts == [1]


def test_a_structure_without_instructions_gets_no_class_build(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """Uploads kept as values (a model's weights moved to the device) are one structure without
    instructions whose sizes move with each weight's shape: each call is vetted concretely (for
    next to nothing), never by a class whose build would fork the worker (its CPU, and the
    child's page faults, for a vet of nothing). The values are the uploads."""
    monkeypatch.setenv("GENIE_SERVER_CLASS_BUILD", "background")
    monkeypatch.setenv("GENIE_SERVER_CLASS_BUILD_COST", "0")
    w = _worker(monkeypatch)
    assert w.build_mode == "background"
    sk = protocol.pack([1, [], [], [], [0], [], [0]])  # slot 0: an input upload, kept
    assert protocol.compile_skeleton(sk).templates == []
    hows = []
    for k, n in enumerate((4, 6, 9, 12)):
        x = torch.arange(float(n))
        up = msgpack.ExtType(protocol.EXT_INPUT, protocol.pack([[0, "float32", [n], None],
                                                                  100 + k]))
        reply = _run(w, sk, [up], [protocol.tensor_frame(x)[0]], 200 + k)
        hows.append(reply["vt"])
        w.after_reply()  # where a background build would start
        assert not any(b.busy for b in w.builds), k
        assert torch.equal(w.sess.store[100 + k], x)
    assert hows == ["guarded", "vetted", "vetted", "vetted"] and w.class_tries == {}


def test_bulk_drops_take_only_the_held_ints_a_client_names() -> None:
    """A request's frees are a client's list (``free``, ``ids``): only exact ints the session
    holds are dropped, each once, as :meth:`Session.drop` one at a time would (a bool or a float
    equal to a held id is not that id; huge, negative and repeated ids are skipped or dropped
    once); roles and last uses go with their value."""
    junk = [True, 1.0, "1", None, [1], b"1", 2 ** 80, -(2 ** 80), -1, 2, 2, 3]
    one, bulk = Session(b"a", 1 << 30), Session(b"b", 1 << 30)
    base = torch.zeros(16)
    for s in (one, bulk):
        for hid, v in ((1, base), (2, base[4:]), (3, torch.ones(5)), (2 ** 70, torch.ones(2))):
            s.put(hid, v)
            s.roles[hid] = 1
    for i in junk:
        one.drop(i)
    bulk.drop_many(junk)
    assert _state(one) == _state(bulk)
    assert sorted(bulk.store) == [1, 2 ** 70] and sorted(bulk.roles) == [1, 2 ** 70]
    assert sorted(bulk.used_at) == [1, 2 ** 70] and bulk.nbytes == 16 * 4 + 2 * 4
    bulk.drop_many([2 ** 70, 1])
    assert bulk.store == {} and bulk.storages == {} and bulk.nbytes == 0 and bulk.roles == {}


def test_bulk_puts_take_any_int_ids_and_count_the_handle_limit(monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """A run's new ids may be any non-negative ints a client chose (``id0``, ``ids``): a huge one
    is stored as it is; a bulk put past the session's handle limit is refused by :meth:`put`,
    naming it, with nothing put."""
    from genie.remote import worker

    s = Session(b"a", 1 << 30)
    s.put_many([2 ** 70, 5], [torch.ones(3), torch.ones(3)[1:]])
    assert sorted(s.store) == [5, 2 ** 70] and s.nbytes == 24 and s.used_at == {5: 0, 2 ** 70: 0}
    monkeypatch.setattr(worker, "MAX_HANDLES", 3)
    before = _state(s)
    with pytest.raises(Refused, match="the most a session may hold"):
        s.put_many([6, 7], [torch.ones(1), torch.ones(1)])
    assert _state(s) == before
    monkeypatch.setattr(worker, "MAX_HANDLES", 4)
    with pytest.raises(Refused, match="already in use"):
        s.put_many([6, 2 ** 70], [torch.ones(1), torch.ones(1)])
    assert _state(s) == before
    s.put_many([6, 7][:1], [torch.ones(1)])
    assert sorted(s.store) == [5, 6, 2 ** 70]


def test_held_inputs_resolve_only_held_ints(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's inputs are the first constants (handle ids a client names): resolved in bulk only
    when each is an int (None: the one-by-one path refuses what is not), refused naming the
    first that the session does not hold; nothing is marked used unless all resolve."""
    import types

    w = _worker(monkeypatch)
    sess = w.sess
    a, b = torch.ones(2), torch.zeros(3)
    sess.put(10, a)
    sess.put(11, b)
    sess.tick = 7
    c = types.SimpleNamespace(inputs=[3, 5])
    for consts, why in (([True, 11, 1.5], None), ([10, 11.0], None), ([10], None),
                        ([12, 10.5], None), ([10, 12, 3], "12"), ([2 ** 80, 10], str(2 ** 80)),
                        ([-1, 10], "-1")):
        protect: set[int] = set()
        if why is None:
            assert w._held_inputs(c, consts, protect) is None, consts
        else:
            with pytest.raises(Refused, match=f"no tensor with handle id {why} "):
                w._held_inputs(c, consts, protect)
        assert protect == set() and sess.used_at == {10: 0, 11: 0}, consts
    protect = set()
    got = w._held_inputs(c, [11, 10, 99], protect)
    assert list(got) == [3, 5] and got[3] is b and got[5] is a
    assert protect == {10, 11} and sess.used_at == {10: 7, 11: 7}


def _upload_neg() -> bytes:
    """A skeleton that uploads a host value (slot 0, not kept) and keeps its negation (slot 1):
    a prefill's shape (its prompt an upload of a new length each call)."""
    return protocol.pack([1, ["genie.upload", "aten::neg.default"], [[1, [1, 0], [3, [], []]]],
                          [[0, -1, [-1], [0], [], False], [1, 0, [0], [1], [0], False]], [], [1],
                          [1]])


def _delta(w: Worker, sk: bytes, d: list, frames: list, id0: int) -> dict:
    h = {"t": "run", "k": hashlib.blake2b(sk, digest_size=16).digest(), "d": d, "id0": id0}
    return w.handle(protocol.unpack(protocol.pack(h)), frames)[0]


def test_an_upload_of_a_new_length_refills(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tape that uploads a value of a new length each call (a prefill) is patched from the
    last call's (``protocol.refill``), the upload read from its own frame as a fill reads it;
    an upload frame that does not hold what its constant describes is refused as a fill refuses
    it, and the next call fills anew."""
    w = _worker(monkeypatch)
    sk = _upload_neg()
    x = torch.arange(4.0)
    _run(w, sk, [_host(x, 0)], [protocol.tensor_frame(x)[0]], 100)
    assert torch.equal(w.sess.store[100], -x) and w.refills == 0
    for k, n in enumerate((6, 9, 3)):
        y = torch.arange(float(n)) * (k + 2)
        reply = _delta(w, sk, [0, _host(y, 0)], [protocol.tensor_frame(y)[0]], 101 + k)
        assert reply["t"] == "ok", reply
        assert torch.equal(w.sess.store[101 + k], -y) and w.refills == k + 1
    short = torch.arange(2.0)
    with pytest.raises(protocol.ProtocolError, match="frame"):
        _delta(w, sk, [0, _host(torch.arange(8.0), 0)], [protocol.tensor_frame(short)[0]], 200)
    with pytest.raises(protocol.ProtocolError, match="upload needs a tensor frame"):
        _delta(w, sk, [0, 7], [], 201)  # (not a tensor frame)
    with pytest.raises(protocol.ProtocolError, match="upload needs a tensor frame"):
        _delta(w, sk, [0, _host(short, 1)], [protocol.tensor_frame(short)[0]], 202)  # no frame 1
    assert not {200, 201, 202} & set(w.sess.store)
    for k, n in enumerate((5, 7)):  # a fill anew after the refusals, then refills again
        z = torch.arange(float(n))
        reply = _delta(w, sk, [0, _host(z, 0)], [protocol.tensor_frame(z)[0]], 300 + k)
        assert reply["t"] == "ok" and torch.equal(w.sess.store[300 + k], -z)
        assert w.refills == 3 + k


def test_a_delta_names_only_positions_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's delta (``d``: position, constant, ...) is checked in bulk: a position that is not
    an exact int within the skeleton's constants (a bool, a float, a string, a huge or negative
    int, one past the end) is refused naming the first bad one, and nothing of the call is kept:
    the next good delta patches the last good call's constants."""
    w = _worker(monkeypatch)
    sk = _upload_neg()
    x = torch.arange(4.0)
    _run(w, sk, [_host(x, 0)], [protocol.tensor_frame(x)[0]], 100)
    y = torch.arange(3.0)
    fy = [protocol.tensor_frame(y)[0]]
    for d, named in (([True, _host(y, 0)], "True"), ([0.0, _host(y, 0)], "0.0"),
                     (["0", _host(y, 0)], "'0'"), ([-1, _host(y, 0)], "-1"),
                     ([1, _host(y, 0)], "1"), ([2 ** 64 - 1, _host(y, 0)], str(2 ** 64 - 1)),
                     ([0, _host(y, 0), 5, 1], "5"), ([0, _host(y, 0), None, 1], "None")):
        with pytest.raises(protocol.ProtocolError, match=f"bad constant position {named}$"):
            _delta(w, sk, d, fy, 200)
        assert 200 not in w.sess.store
    reply = _delta(w, sk, [0, _host(y, 0)], fy, 300)
    assert reply["t"] == "ok" and torch.equal(w.sess.store[300], -y)


def test_residency_hints_are_checked_in_bulk() -> None:
    """``ev`` (handle id, role code, ...) from a client: pairs of exact non-negative ints, each
    code a role's; anything else refused naming the first bad pair."""
    from genie.remote.worker import _hints

    assert _hints(None) == [] and _hints([]) == []
    assert _hints([5, 0, 2 ** 70, len(protocol.ROLES) - 1]) == [
        (5, 0), (2 ** 70, len(protocol.ROLES) - 1)]
    for ev, named in (([True, 0], "True, 0"), ([5, False], "5, False"), ([5, 0.0], "5, 0.0"),
                      ([-1, 0], "-1, 0"), ([5, -1], "5, -1"),
                      ([5, len(protocol.ROLES)], f"5, {len(protocol.ROLES)}"),
                      ([5, 0, 6, "weight"], "6, 'weight'"), ([5, 0, [6], 0], "[6], 0"),
                      ([1.5, 0], "1.5, 0")):
        with pytest.raises(protocol.ProtocolError, match=rf"bad residency hint \[{re.escape(named)}\]"):
            _hints(ev)
    for ev in ("x", [5], [5, 0, 6], list(range(2 * protocol.MAX_HINTS + 2))):
        with pytest.raises(protocol.ProtocolError, match="flat list"):
            _hints(ev)


def test_a_requests_frees_are_deallocated_after_its_reply(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The values a request frees leave the store and the accounting at once (the request
    cannot read them, the quota no longer counts them) and are deallocated once its reply is
    out (``Worker.after_reply``); a free of more than ``FREES_LATER_MAX`` bytes (or an eighth
    of the quota) is deallocated at once."""
    import weakref

    from genie.remote import worker

    w = _worker(monkeypatch)
    sess = w.sess
    small, big = torch.ones(4), torch.ones(256)
    sess.put(10, small)
    sess.put(11, big)
    sess.put(12, small[1:])  # shares 10's storage
    refs = [weakref.ref(small), weakref.ref(big)]
    del small, big
    reply, _, _ = w.handle({"t": "ping", "free": [10, 12, 99, True]}, [])
    assert reply["t"] == "ok" and sorted(sess.store) == [11]
    assert sess.nbytes == 256 * 4 and sess.used() == 256 * 4 + HANDLE_COST
    assert refs[0]() is not None  # held until the reply is out
    w.after_reply()
    assert refs[0]() is None and w.freed == []
    monkeypatch.setattr(worker, "FREES_LATER_MAX", 512)
    w.handle({"t": "ping", "free": [11]}, [])
    assert refs[1]() is None and sess.store == {} and sess.nbytes == 0  # 1 KiB: at once
    # a run that fails still frees, later
    t = torch.ones(4)
    sess.put(20, t)
    ref = weakref.ref(t)
    del t
    with pytest.raises(protocol.ProtocolError):
        w.handle({"t": "run", "k": b"k" * 16, "id0": -1, "free": [20]}, [])
    assert 20 not in sess.store and ref() is not None
    w.after_reply()
    assert ref() is None
