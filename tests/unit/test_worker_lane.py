"""A session worker's native lane (``genie._C._WorkerLane``, csrc/worker_replay.cpp): a vetted
skeleton's steady requests in one native call, and every request it does not take checked on
the Python path as before.

The oracle is eager PyTorch for the values, and a worker without lanes
(``GENIE_SERVER_NATIVE_LANE=0``) for everything else: the same requests give the same replies,
values, refusals and accounting with lanes on and off. The attacker's requests (a client with a
valid key) name a vetted skeleton's key with parameters the lane must not take: a handle of
another shape or dtype, a handle the session does not hold (another session's, freed, never
made), integers outside the class, a size past the quota, a delta that is malformed or changes
a constant the lane does not patch; each is passed to the Python path, which refuses it (or
vets and runs it) exactly as a worker without lanes does, and the lane takes the next good
request again.
"""

from __future__ import annotations

import hashlib
import random
import select
import socket
import time
from typing import Any

import pytest
import torch

from genie import _C, graphs
from genie.remote import protocol, shape_class
from genie.remote.protocol import _DTYPE_NAME
from genie.remote.wire import REPLY, Channel, read_status, status
from genie.remote.worker import SENT, Config, Refused, Worker

# x (slot 0) + w (slot 1) -> 2; 2 * a -> 3; narrow(3, dim, start, k) -> 4; repeat(3, [r]) -> 5;
# rand_like(4) -> 6 (a random op: seed and offset are constants). Constants: 0 x, 1 w, 2 a,
# 3 dim, 4 start, 5 k, 6 r, 7 seed, 8 offset.
_SK = protocol.pack([
    1, ["aten::add.Tensor", "aten::mul.Scalar", "aten::narrow.default", "aten::repeat.default",
        "aten::rand_like.default"],
    [[1, [1, 0, 0], [3, [], []]], [1, [1, 0, 0, 0, 0], [3, [], []]],
     [1, [1, 0, [2, 0]], [3, [], []]], [1, [1, 0], [3, [], []]]],
    [[0, 0, [0, 1], [2], [], False], [1, 0, [2, -1], [3], [2], False],
     [2, 1, [3, -1, -1, -1], [4], [], False], [3, 2, [3, -1], [5], [3], False],
     [4, 3, [4], [6], [], True]],
    [0, 1], [4, 5, 6], [4, 5, 6]])
_KEY = hashlib.blake2b(_SK, digest_size=16).digest()


def _worker(monkeypatch: pytest.MonkeyPatch, lanes: bool = True, quota: int = 1 << 30) -> Worker:
    monkeypatch.setattr(graphs, "check_calls", graphs.check_calls)
    monkeypatch.setenv("GENIE_SERVER_CLASS_BUILD", "inline")
    monkeypatch.setenv("GENIE_SERVER_CLASS_BUILD_COST", "0")
    monkeypatch.setenv("GENIE_SERVER_NATIVE_LANE", "1" if lanes else "0")
    return Worker(b"tok", Config("cpu", quota, 60.0, None, 1))


def _send(w: Worker, h: dict[str, Any]) -> dict[str, Any]:
    """A request as it arrives; a refusal as the reply serve_session sends for it."""
    try:
        reply = w.handle(protocol.unpack(protocol.pack(h)), [])[0]
        if reply is SENT:  # written natively (w.reply_native: the test's front reads it)
            reply = {"t": "ok", "sent": 1}
    except Refused as e:
        reply = {"t": "err", "kind": e.kind, "msg": str(e)}
    except protocol.ProtocolError as e:
        reply = {"t": "err", "kind": "protocol", "msg": str(e)}
    w.after_reply()
    return reply


class Client:
    """Sends the lane's skeleton's calls as a client does: the full constants first, then what
    changed (a delta)."""

    def __init__(self, w: Worker) -> None:
        self.w = w
        self.last: list[Any] | None = None
        self.next_id = 1000

    def hold(self, t: torch.Tensor) -> int:
        self.next_id += 1
        self.w.sess.put(self.next_id, t)
        return self.next_id

    def run(self, consts: list[Any], free: list[int] | None = None) -> dict[str, Any]:
        h: dict[str, Any] = {"t": "run", "k": _KEY, "id0": self.next_id + 1}
        if self.last is None:
            h.update(sk=_SK, c=consts)
        else:
            h["d"] = [x for p, (a, b) in enumerate(zip(self.last, consts, strict=True))
                      if type(a) is not type(b) or a != b for x in (p, b)]
        if free:
            h["free"] = free
        reply = _send(self.w, h)
        self.last = list(consts) if reply["t"] == "ok" else None  # (then: send them all)
        if reply["t"] == "ok":
            self.next_id += 3
        return reply

    def send_raw(self, h: dict[str, Any]) -> dict[str, Any]:
        self.last = None  # (the next call sends every constant)
        reply = _send(self.w, {"t": "run", "k": _KEY, "id0": self.next_id + 1, **h})
        if reply["t"] == "ok":
            self.next_id += 3
        return reply


def _call(c: Client, n: int, k: int, r: int, a: float = 2.0, seed: int = 7
          ) -> tuple[list[Any], torch.Tensor, torch.Tensor]:
    x, w = torch.arange(float(n)), torch.full((n,), 0.5)
    consts = [c.hold(x), c.hold(w), a, 0, 0, k, r, seed, 3]
    y = (x + w) * a
    return consts, y.narrow(0, 0, k), y.repeat(r)


def _steady(w: Worker) -> Client:
    """A client whose calls' shapes moved: guarded, vetted, a class built, admitted by the
    class (the lane built), then the lane's."""
    c = Client(w)
    for n, k, r in ((6, 3, 2), (8, 4, 3), (10, 5, 2), (12, 6, 3)):
        consts, nar, rep = _call(c, n, k, r)
        reply = c.run(consts)
        assert reply["t"] == "ok", reply
        assert torch.equal(w.sess.store[c.next_id - 2], nar)
        assert torch.equal(w.sess.store[c.next_id - 1], rep)
    return c


def test_a_vetted_structure_runs_in_its_lane_as_on_the_python_path(monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """After a class admits a call, the skeleton's next calls are the lane's (one native call
    each), with eager's values and the Python path's random values and accounting."""
    on, off = _worker(monkeypatch), _worker(monkeypatch, lanes=False)
    assert on.lanes and not off.lanes
    a, b = _steady(on), _steady(off)
    (c, _), = [v for v in on.sess.skeletons.values()]
    assert c.lane and on.lane_runs >= 1, on.lane_passes
    assert off.lane_runs == 0
    runs = on.lane_runs
    for n, k, r, s in ((14, 7, 2, 9), (14, 7, 2, 9), (9, 2, 4, 11), (30, 30, 2, 12)):
        for cl in (a, b):
            consts, nar, rep = _call(cl, n, k, r, a=1.5, seed=s)
            reply = cl.run(consts)
            assert reply["t"] == "ok", reply
            assert torch.equal(cl.w.sess.store[cl.next_id - 2], nar)
            assert torch.equal(cl.w.sess.store[cl.next_id - 1], rep)
        assert torch.equal(on.sess.store[a.next_id], off.sess.store[b.next_id])  # rand_like
        assert on.sess.used() == off.sess.used() and on.sess.residency() == off.sess.residency()
    assert on.lane_runs == runs + 4, on.lane_passes
    assert on.how in ("hit", "class")


def _front(w: Worker, rid: int, st: float) -> tuple[Channel, list[Any]]:
    """``w``'s lane replies written natively (``genie._C._send_reply``, as serve_session sets
    it) to a socket the returned channel (the front's end) reads; the list: what each call of
    the writer returned."""
    a, b = socket.socketpair()
    wrote: list[Any] = []

    def native(vals: list[torch.Tensor], how: str) -> bool:
        sess = w.sess
        wrote.append(_C._send_reply(a.fileno(), sess.used(), sess.residency(), sess.peer_bytes,
                                    rid, st, how, vals, _DTYPE_NAME))
        return wrote[-1] is not None

    w.reply_native = native
    w._test_socks = (a, b)  # (held while the channel is read)
    return Channel(b, 1 << 10, 1 << 30), wrote


def test_a_lanes_reply_written_natively_is_the_python_paths(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """serve_session writes a lane's reply in one native call: the front reads the status,
    header and frames that serve_session's Python path writes for the same request (a worker
    whose lane replies go that path), with eager's values; a reply the writer does not take (a
    ``rid`` past int64) goes that path having written nothing."""
    on, py = _worker(monkeypatch), _worker(monkeypatch)
    a, b = _steady(on), _steady(py)
    front, wrote = _front(on, 77, 0.5)
    for n, k, r, s in ((14, 7, 2, 9), (9, 2, 4, 11), (30, 30, 2, 12)):
        replies = []
        for cl in (a, b):
            consts, nar, rep = _call(cl, n, k, r, a=1.5, seed=s)
            replies.append(cl.run(consts))
            assert torch.equal(cl.w.sess.store[cl.next_id - 2], nar)
            assert torch.equal(cl.w.sess.store[cl.next_id - 1], rep)
        got, want = replies
        assert got == {"t": "ok", "sent": 1} and wrote[-1] is True, got
        assert want["t"] == "ok" and "sent" not in want, want
        msgs: list[Any] = []
        while not msgs:
            msgs = front.take()
        (msg,) = msgs
        # as serve_session's Python path writes `want`: its rid and st, its status
        assert read_status(msg[0]) == read_status(status(REPLY, py.sess.used(),
                                                         py.sess.residency(),
                                                         py.sess.peer_bytes))
        head = protocol.unpack(msg[1])
        assert head == {**want, "rid": 77, "st": 0.5}, (head, want)
        assert msg[1] == protocol.pack({**want, "rid": 77, "st": 0.5})
        outs = [protocol.frame_tensor(f, protocol.FrameRef(0, protocol.dtype_of(m[0]),
                                                             tuple(m[1]), None), copy=True)
                for f, m in zip(msg[2:], head["o"], strict=True)]
        assert len(outs) == 3
        assert torch.equal(outs[0], on.sess.store[a.next_id - 2])
        assert torch.equal(outs[1], on.sess.store[a.next_id - 1])
        assert torch.equal(outs[2], py.sess.store[b.next_id])  # rand_like: the same stream
        assert on.sess.used() == py.sess.used() and on.sess.residency() == py.sess.residency()
    assert on.native_replies == 3 and py.native_replies == 0
    runs = on.lane_runs
    front, wrote = _front(on, 1 << 63, 0.5)  # (a rid the native writer does not take)
    consts, nar, rep = _call(a, 16, 5, 3)
    got = a.run(consts)
    assert wrote == [None] and got["t"] == "ok" and "sent" not in got, got
    assert on.lane_runs == runs + 1 and on.native_replies == 3
    assert not select.select([front.sock], [], [], 0)[0]  # (nothing written)
    assert [o[1] for o in got["o"]] == [[5], [48], [5]]


def _refused_alike(monkeypatch: pytest.MonkeyPatch, bad: Any, passed: str) -> None:
    """``bad(client)`` sends an attacker's request to a worker whose lane is built and to one
    without lanes: the replies agree (a refusal, or a vetted run), the lane passed it to the
    Python path (``passed``), and both take a good call afterwards (the lane again)."""
    on, off = _worker(monkeypatch, quota=1 << 24), _worker(monkeypatch, lanes=False,
                                                           quota=1 << 24)
    a, b = _steady(on), _steady(off)
    runs = on.lane_runs
    ra, rb = bad(a), bad(b)
    assert on.lane_runs == runs and on.lane_passes[passed] >= 1, (on.lane_passes, ra)
    assert ra["t"] == rb["t"] and ra.get("kind") == rb.get("kind"), (ra, rb)
    assert ra.get("msg") == rb.get("msg")
    assert sorted(on.sess.store) == sorted(off.sess.store)
    assert on.sess.used() == off.sess.used()
    for cl in (a, b):  # then good calls: the lane takes them again
        for n, k, r in ((16, 8, 2), (18, 9, 3)):
            consts, nar, rep = _call(cl, n, k, r)
            reply = cl.run(consts)
            assert reply["t"] == "ok", reply
            assert torch.equal(cl.w.sess.store[cl.next_id - 2], nar)
    assert on.lane_runs >= runs + 1, on.lane_passes


def test_a_handle_of_another_shape_is_not_the_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    def bad(c: Client) -> dict:  # w of 5 elements beside x of 12: not broadcastable
        assert c.last is not None
        return c.run([c.last[0], c.hold(torch.ones(5)), *c.last[2:]])

    _refused_alike(monkeypatch, bad, "shapes")


def test_a_handle_of_another_dtype_is_not_the_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    def bad(c: Client) -> dict:
        assert c.last is not None
        return c.run([c.last[0], c.hold(torch.ones(12, dtype=torch.float64)), *c.last[2:]])

    _refused_alike(monkeypatch, bad, "layout")


def test_a_view_handle_is_not_the_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    def bad(c: Client) -> dict:  # a strided view of a larger storage: another layout
        assert c.last is not None
        return c.run([c.last[0], c.hold(torch.ones(24)[::2]), *c.last[2:]])

    _refused_alike(monkeypatch, bad, "layout")


@pytest.mark.parametrize("which", ["never made", "freed", "another session's"])
def test_a_handle_the_session_does_not_hold_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                       which: str) -> None:
    def bad(c: Client) -> dict:
        assert c.last is not None
        if which == "freed":  # freed by this very request, before it runs
            return c.send_raw({"d": [], "free": [c.last[0]]})
        hid = 99999 if which == "never made" else 1 << 40  # (ids are per session)
        return c.send_raw({"d": [1, hid]})

    _refused_alike(monkeypatch, bad, "input")


@pytest.mark.parametrize("d", [[5, 40], [3, 1], [4, 11]])
def test_integers_outside_the_class_are_vetted(monkeypatch: pytest.MonkeyPatch, d: list) -> None:
    def bad(c: Client) -> dict:  # narrow past the end, along another dimension, from past the
        assert c.last is not None  # end: the class's guard refuses, the vet too
        return c.send_raw({"d": d})

    _refused_alike(monkeypatch, bad, "shapes")


def test_a_passed_request_patches_the_lanes_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the lane passes is patched on the Python path from the instructions the lane
    ran last (``worker._drop_lane`` hands them back as the skeleton's ``Filled``), not filled
    anew (a tape filled anew holds none of the objects the program was compiled from, so its
    every run patches every baked leaf)."""
    w = _worker(monkeypatch)
    c = _steady(w)
    refills, passes = w.refills, w.lane_passes["shapes"]
    reply = c.send_raw({"d": [5, 40]})  # narrow past the end: passed, patched, vetted, refused
    assert reply["t"] == "err" and w.lane_passes["shapes"] == passes + 1
    assert w.refills == refills + 1


def test_a_size_past_the_quota_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def bad(c: Client) -> dict:  # repeat 2**22 times: a bound past the 16 MiB quota
        assert c.last is not None
        return c.send_raw({"d": [6, 1 << 22]})

    _refused_alike(monkeypatch, bad, "budget")


@pytest.mark.parametrize("d", [[5], [5, 4, 6], "x", {"5": 4}, [9, 4], [-1, 4], [True, 4],
                               [2 ** 63, 4]])
def test_a_malformed_delta_is_refused(monkeypatch: pytest.MonkeyPatch, d: Any) -> None:
    _refused_alike(monkeypatch, lambda c: c.send_raw({"d": d}), "delta")


@pytest.mark.parametrize("d", [[5, 4.0], [5, True], [5, None], [5, 2 ** 63], [7, -1],
                               [8, 1.5], [2, 3], [2, "x"]])
def test_a_delta_that_changes_what_the_lane_does_not_patch(monkeypatch: pytest.MonkeyPatch,
                                                           d: Any) -> None:
    """A constant of another type (an int made a float, a bool or None; a float made an int), a
    value past int64, a negative seed, or a constant the lane holds fixed (the dimension)."""
    _refused_alike(monkeypatch, lambda c: c.send_raw({"d": d}), "constant")


def test_an_oversized_delta_is_the_lanes_when_it_is_well_formed(monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """A delta naming positions many times is applied in order (the last value wins), as on the
    Python path; the lane's result is the last value's."""
    def bad(c: Client) -> dict:
        assert c.last is not None
        return c.send_raw({"d": [5, 2, 6, 3] * 2000 + [5, 4]})

    on, off = _worker(monkeypatch), _worker(monkeypatch, lanes=False)
    a, b = _steady(on), _steady(off)
    runs = on.lane_runs
    ra, rb = bad(a), bad(b)
    assert ra["t"] == rb["t"] == "ok" and on.lane_runs == runs + 1
    assert torch.equal(on.sess.store[a.next_id - 2], off.sess.store[b.next_id - 2])
    assert on.sess.store[a.next_id - 2].shape == (4,)


def test_a_failing_instruction_in_the_lane_replies_as_the_python_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An error the vet cannot see (here: a held input resized after its call was admitted is
    not possible from a client; a kernel's own error is): the lane's reply names the
    instruction as the Python path's does. Here a freed-and-replaced handle of the same layout
    whose values make no difference runs; the error case is the dtype test's. The lane keeps
    the session's accounting equal to the Python path's across many calls."""
    on, off = _worker(monkeypatch), _worker(monkeypatch, lanes=False)
    a, b = _steady(on), _steady(off)
    for step in range(12):
        for cl in (a, b):
            assert cl.last is not None
            consts, nar, _ = _call(cl, 12 + step, 3 + step, 2)
            reply = cl.run(consts, free=cl.last[:2])
            assert reply["t"] == "ok"
            assert torch.equal(cl.w.sess.store[cl.next_id - 2], nar)
        assert sorted(on.sess.store) == sorted(off.sess.store)
        assert on.sess.used() == off.sess.used()
    assert on.lane_runs >= 10, on.lane_passes


def _py_admit(cls: Any, ints: tuple[int, ...]) -> Any:
    return cls.admit(ints)


@pytest.mark.parametrize("guard,bound", [
    ("L['t1'] == 1 + L['t0'] and 2 <= L['t0']", "134861 + 4389*s0"),
    ("L['t0'] // 3 == L['t1'] % 5 or not L['t0'] < 7", "s0 * s1 - s0 ** 2"),
    ("(-L['t0']) // 4 <= L['t1'] and abs(L['t1'] - 20) < 10", "max(s0, s1, 3) + min(s0, -s1)"),
    ("L['t0'] < L['t1'] <= 2 * L['t0'] != 17", "(s0 if s0 > s1 else s1) * 1024 + (-s0) % 7"),
    ("torch.sym_max(L['t0'], L['t1']) >= 4 and bool(L['t1'] % 2)", "int(s0) * 9223372036854775"),
])
def test_a_class_admits_natively_as_in_python(guard: str, bound: str) -> None:
    """``_ShapeAdmit`` (the class's guard and bound evaluated natively) answers every call as
    ``ShapeClass.admit`` does, Python's floor division and modulo of negatives included; where
    int64 overflows it answers False (cannot tell), never a wrong bound."""
    spec = {"n": 4, "sym_idx": [0, 1, 3], "reps": [0, 1], "same_a": [3], "same_b": [0],
            "signs": [1, -1], "guard": guard, "names": ["s0", "s1"], "bound": bound}
    base = (10, -11, 5, 10)
    cls = shape_class.from_spec(spec, base)
    assert cls.native is not None
    rnd = random.Random(5)
    told = 0
    for _ in range(3000):
        s0 = rnd.choice([rnd.randint(-40, 40), rnd.randint(-(1 << 62), 1 << 62)])
        s1 = rnd.randint(-40, 40)
        ints = (s0, s1, rnd.choice([5, 5, 5, 6]), rnd.choice([s0, s0, s0 + 1]))
        want, got = _py_admit(cls, ints), cls.native.admit(list(ints))
        if got is False:
            continue
        told += 1
        assert got == want, (ints, got, want)
    assert told > 2000


def test_expressions_the_native_evaluator_does_not_take() -> None:
    for text in ("L['t0'] / 2 > 1", "math.floor(s0)", "s0 + 1.5", "L['t0'] ** L['t1']",
                 "IsNonOverlappingAndDenseIndicator(s0)", "min(s0)"):
        assert shape_class.native_expr(text, {"s0": 0}) is None, text
    assert shape_class.native_expr("s0 + 1", {"s0": 0}) == [(1, 0, [], []), (0, 1, [], []),
                                                            (2, 0, [0, 1], [])]
    with pytest.raises(ValueError):
        _C._ShapeAdmit(1, [], [], [], [], [0], [1], [(1, 5, [], [])], [(0, 1, [], [])])
    with pytest.raises(ValueError):
        _C._ShapeAdmit(1, [], [], [], [], [0], [1], [(2, 0, [0, 1], [])], [(0, 1, [], [])])


# view(x, [a, k]) -> 1; full([a, k], flag) -> 2 (``fill_value``: a value argument's bool);
# mul(1, 2) -> 3. Constants: 0 x, 1 a, 2 k, 3 a, 4 k, 5 flag.
_FULL_SK = protocol.pack([
    protocol.PROTOCOL_VERSION, ["aten::view.default", "aten::full.default", "aten::mul.Tensor"],
    [[1, [1, 0, [2, 0, 0]], [3, [], []]], [1, [1, [2, 0, 0], 0], [3, [], []]],
     [1, [1, 0, 0], [3, [], []]]],
    [[0, 0, [0, -1, -1], [1], [], False], [1, 1, [-1, -1, -1], [2], [], False],
     [2, 2, [1, 2], [3], [1, 2], False]],
    [0], [3], [3]])
_FULL_KEY = hashlib.blake2b(_FULL_SK, digest_size=16).digest()


def _fill_calls(w: Worker, calls: list[tuple[int, Any]], raw: dict[int, Any] | None = None
                ) -> list[dict[str, Any]]:
    """``x.view(2, k) * full((2, k), flag)`` per ``(k, flag)`` as Genie's client sends it (the
    constants, then deltas); ``raw[i]``: call ``i``'s flag sent as this value instead (an
    attacker's delta). Each reply checked against eager where it is ok."""
    last: list[Any] | None = None
    nid = 1000
    replies = []
    for i, (k, flag) in enumerate(calls):
        nid += 1
        x = torch.arange(1.0, 2.0 * k + 1)
        w.sess.put(nid, x)
        consts = [nid, 2, k, 2, k, raw[i] if raw and i in raw else flag]
        h: dict[str, Any] = {"t": "run", "k": _FULL_KEY, "id0": nid + 1}
        if last is None:
            h.update(sk=_FULL_SK, c=consts)
        else:
            h["d"] = [v for p, (a, b) in enumerate(zip(last, consts, strict=True))
                      if type(a) is not type(b) or a != b for v in (p, b)]
        reply = _send(w, h)
        replies.append(reply)
        last = consts if reply["t"] == "ok" else None
        nid += 1
        if reply["t"] == "ok":
            want = x.view(2, k) * torch.full((2, k), consts[5])
            assert torch.equal(w.sess.store[nid], want) and \
                w.sess.store[nid].dtype == want.dtype, (k, consts[5])
    return replies


def test_a_written_bool_that_flips_is_the_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's stopping criteria fill ``full((batch,), is_done)``: ``False`` at a generate's steps,
    ``True`` at its last. The class keys that bool by its type, and the program reads it per
    step, so the lane patches it (``kWrittenBool``): a flip is the lane's, not a pass to the Python
    path (two per generate before), with eager's values and the Python path's replies."""
    calls = [(3, False), (4, False), (5, False), (6, False), (7, True), (8, False), (8, True),
             (9, True), (10, False)]
    on, off = _worker(monkeypatch), _worker(monkeypatch, lanes=False)
    ra, rb = _fill_calls(on, calls), _fill_calls(off, calls)
    assert [r["t"] for r in ra] == ["ok"] * len(calls)
    assert [r.get("vt") for r in ra] == [r.get("vt") for r in rb]
    assert on.lane_runs == 6 and not on.lane_passes, on.lane_passes  # (from the 4th call)
    (c, _), = on.sess.skeletons.values()
    assert c.lane


@pytest.mark.parametrize("bad", [1, 0, 1.0, None, "x", [True]])
def test_a_written_bool_made_another_type_is_not_the_lanes(monkeypatch: pytest.MonkeyPatch,
                                                          bad: Any) -> None:
    """An attacker's delta gives the lane's bool another type (an int, a float, None, a string,
    a list): the lane passes it to the Python path, whose reply (a run keyed anew, or a
    refusal) is a worker's without lanes; the next calls are the lane's again."""
    calls = [(3, False), (4, False), (5, False), (6, True), (7, False), (8, False), (9, True),
             (10, False), (11, True)]
    on, off = _worker(monkeypatch), _worker(monkeypatch, lanes=False)
    ra, rb = _fill_calls(on, calls, {5: bad}), _fill_calls(off, calls, {5: bad})
    assert [(r["t"], r.get("kind"), r.get("msg")) for r in ra] == \
        [(r["t"], r.get("kind"), r.get("msg")) for r in rb], (ra[5], rb[5])
    assert on.lane_passes["constant"] == 1, on.lane_passes
    assert on.lane_runs >= 2 + (ra[5]["t"] != "ok"), on.lane_passes
    assert sorted(on.sess.store) == sorted(off.sess.store)


def test_a_lane_that_passed_many_requests_comes_back_with_its_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane that passed 8 requests in a row (calls its class does not admit: a generate's
    long warm-up prompts, vetted one by one once no wider class is built) is none while such
    calls come; once 8 calls in a row ran on the Python path admitted without a vet (short
    prompts again, within the class), the lane is built again and takes the next ones, with
    eager's values. A vet among them starts the count again."""
    w = _worker(monkeypatch)
    c = _steady(w)
    w.build_mode = "off"  # (no wider class arrives: the lane's only way back is its calls)

    (sk, _), = w.sess.skeletons.values()

    def bad() -> None:  # narrow past the end: passed by the lane (if any), vetted, refused
        assert c.last is not None
        consts = [*c.last[:5], 40, *c.last[6:]]
        assert c.run(consts)["t"] == "err"
        c.last = consts  # (the worker keeps a refused request's constants: deltas go on them)

    def good(n: int) -> None:
        consts, nar, rep = _call(c, n, n // 2, 2)
        reply = c.run(consts)
        assert reply["t"] == "ok" and reply["vt"] in ("class", "hit"), reply
        assert torch.equal(w.sess.store[c.next_id - 2], nar)
        assert torch.equal(w.sess.store[c.next_id - 1], rep)

    runs = w.lane_runs
    bad()
    for _ in range(7):  # each lane built (after a good call) passes its first request
        good(14)
        assert sk.lane
        bad()
    assert sk.lane is False and w.lane_runs == runs and w.lane_passes["shapes"] == 8
    for n in range(14, 28, 2):  # 7 admitted by the class on the Python path
        good(n)
    assert sk.lane is False and w.lane_runs == runs
    bad()  # a vet: the count starts again
    for n in range(14, 30, 2):  # 8 more: the 8th builds the lane
        good(n)
    assert sk.lane and w.lane_runs == runs
    for n in range(30, 36, 2):  # the lane's
        good(n)
    assert w.lane_runs == runs + 3, w.lane_passes


# --- a lane's steady request whole in one native call (_WorkerLane.serve, Worker._serve) -----

def _serving(monkeypatch: pytest.MonkeyPatch, on: bool, quota: int = 1 << 30) -> Worker:
    """A worker with lanes whose steady requests are served natively whole (``on``), or with
    the Python around the lane's step (``GENIE_SERVER_NATIVE_SERVE=0``, the reference)."""
    monkeypatch.setenv("GENIE_SERVER_NATIVE_SERVE", "1" if on else "0")
    w = _worker(monkeypatch, quota=quota)
    assert w.serve_native is on and w.lanes
    return w


def _same_session(on: Worker, py: Worker) -> None:
    """Two workers' sessions hold the same values under the same ids, with the same accounting,
    roles, last uses and decoding flag."""
    s, t = on.sess, py.sess
    assert sorted(s.store) == sorted(t.store)
    for hid in s.store:
        assert torch.equal(s.store[hid], t.store[hid]), hid
    assert s.used() == t.used() and s.residency() == t.residency() and s.nbytes == t.nbytes
    assert s.roles == t.roles
    assert s.used_at == t.used_at and s.tick == t.tick and s.decoding == t.decoding
    assert sorted(s.storages.values()) == sorted(t.storages.values())
    assert on.lane_runs == py.lane_runs and on.lane_passes == py.lane_passes


def test_a_steady_request_served_natively_is_the_python_paths(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """A lane's steady requests with frees, residency hints (on held, freed and new values) and
    a decode flag, served whole natively: the replies, eager's values, the accounting, the roles
    and last uses of the Python around the lane's step; the frees' values wait for the reply."""
    on, py = _serving(monkeypatch, True), _serving(monkeypatch, False)
    a, b = _steady(on), _steady(py)
    _same_session(on, py)
    served = on.served
    for n, k, r, s in ((14, 7, 2, 9), (9, 2, 4, 11), (30, 30, 2, 12), (14, 7, 2, 9)):
        replies = []
        for cl in (a, b):
            assert cl.last is not None
            old = cl.last[:2]
            consts, nar, rep = _call(cl, n, k, r, a=1.5, seed=s)
            nid = cl.next_id + 1
            h = {"d": [x for p, (u, v) in enumerate(zip(cl.last, consts, strict=True))
                       if type(u) is not type(v) or u != v for x in (p, v)],
                 "free": [*old, nid - 4, 1 << 40, "x"], "ph": 1, "rid": 5,
                 "ev": [consts[0], 3, nid, 1, nid + 2, 0, old[0], 2, consts[1], 4, consts[1], 1]}
            replies.append(_send(cl.w, {"t": "run", "k": _KEY, "id0": nid, **h}))
            cl.last = consts
            cl.next_id += 3
            assert torch.equal(cl.w.sess.store[nid], nar)
            assert torch.equal(cl.w.sess.store[nid + 1], rep)
        got, want = replies
        assert got == want and got["t"] == "ok", (got, want)
        _same_session(on, py)
        assert on.sess.roles[a.next_id - 2] == 1 and on.sess.roles[a.last[1]] == 1
    assert on.served == served + 4 and py.served == 0
    assert on.lane_runs == py.lane_runs and on.lane_passes == py.lane_passes


def test_a_steady_reply_written_natively_is_the_python_paths(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """Served natively with the front's channel (``reply_fd``): the status, header and frames
    serve_session's Python path writes for the same request, its ``st`` the seconds since the
    request's ``t0``."""
    on, py = _serving(monkeypatch, True), _serving(monkeypatch, False)
    a, b = _steady(on), _steady(py)
    front, _ = _front(py, 77, 0.5)  # (py's replies: written by _send_reply from Python)
    s0, s1 = socket.socketpair()
    on.reply_fd = s0.fileno()
    theirs = Channel(s1, 1 << 10, 1 << 30)
    for n, k, r, s in ((14, 7, 2, 9), (9, 2, 4, 11)):
        on.t0 = time.monotonic() - 0.25
        for cl in (a, b):
            consts, _, _ = _call(cl, n, k, r, a=1.5, seed=s)
            got = cl.send_raw({"d": [p for i, x in enumerate(consts) for p in (i, x)],
                               "rid": 77})
            assert got == {"t": "ok", "sent": 1}, got
        msgs = []
        for ch in (theirs, front):
            m: list[Any] = []
            while not m:
                m = ch.take()
            msgs.append(m[0])
        mine, ref = msgs
        assert read_status(mine[0]) == read_status(ref[0])
        head, want = protocol.unpack(mine[1]), protocol.unpack(ref[1])
        assert 0.25 <= head.pop("st") < 60 and want.pop("st") == 0.5
        assert head == want and head["rid"] == 77
        for x, y in zip(mine[2:], ref[2:], strict=True):
            assert bytes(x) == bytes(y)
        _same_session(on, py)
    assert on.native_replies == 2 and on.served >= 2
    s0.close()


def _bad_alike(monkeypatch: pytest.MonkeyPatch, h: Any, served: bool = False,
               quota: int = 1 << 30) -> None:
    """An attacker's steady request (a valid key and session, a field ``h`` malformed, of
    another type or naming what is not the session's) to a worker that serves lane requests
    natively and to one with the Python around the lane's step: the same reply (a refusal, a
    pass to the Python path, or a run), the same session after it, and good calls after."""
    on, py = _serving(monkeypatch, True, quota), _serving(monkeypatch, False, quota)
    a, b = _steady(on), _steady(py)
    count = on.served
    replies = []
    for cl in (a, b):
        assert cl.last is not None
        fields = h(cl) if callable(h) else h
        replies.append(cl.send_raw({"d": [], **fields}))
    ra, rb = replies
    assert ra == rb, (ra, rb)
    assert on.served == count + served, (on.served, ra)
    _same_session(on, py)
    for cl in (a, b):
        for n, k, r in ((16, 8, 2), (18, 9, 3)):
            consts, nar, _ = _call(cl, n, k, r)
            reply = cl.run(consts)
            assert reply["t"] == "ok", reply
            assert torch.equal(cl.w.sess.store[cl.next_id - 2], nar)
    _same_session(on, py)
    assert on.served > count + served  # (the lane serves the good calls again)


_MAX_HINTS = protocol.MAX_HINTS


class _TooManyHints:
    """One more hint than a request may carry, each on a value the session holds."""

    def __call__(self, c: Client) -> dict:
        assert c.last is not None
        return {"ev": [c.last[0], 0] * (_MAX_HINTS + 1)}

    def __repr__(self) -> str:
        return "too many hints"


@pytest.mark.parametrize("h", [
    {"id0": -1}, {"id0": True}, {"id0": 1.5}, {"id0": 2 ** 63 - 2}, {"id0": 2 ** 64 - 1},
    {"id0": None}, {"free": 5}, {"free": {"1": 2}}, {"free": "abc"}, {"ev": [1, 2, 3]},
    {"ev": "xy"}, {"ev": {"1": 2}}, {"ev": [0, 0] * (_MAX_HINTS + 1)}, {"ph": 2}, {"ph": -1},
    _TooManyHints(),
    {"ph": "1"}, {"ph": None}, {"ph": 1.0}, {"ph": True}, {"ph": 2 ** 64 - 1}, {"fc": [1]},
    {"fc": None}, {"c": None}, {"ids": [1, 2, 3]}, {"ids": 5}, {"sk": 5}, {"g": []},
    {"d": None}, {"d": "x"}, {"k": b"short"}, {"k": [1]},
], ids=repr)
def test_a_malformed_steady_field_is_the_python_paths(monkeypatch: pytest.MonkeyPatch,
                                                      h: Any) -> None:
    """Each field a steady request's native path reads, malformed or of another type: the
    Python path's reply (refused, or run there), the same session after it."""
    _bad_alike(monkeypatch, h)


@pytest.mark.parametrize("rid", ["x", 2 ** 63, None, 1.5], ids=repr)
def test_a_steady_request_with_an_odd_rid_is_served_with_the_python_reply(
        monkeypatch: pytest.MonkeyPatch, rid: Any) -> None:
    """A ``rid`` the native reply does not write: the request is the lane's, its reply
    Python's (as serve_session echoes it)."""
    _bad_alike(monkeypatch, {"rid": rid}, served=True)


@pytest.mark.parametrize("which", ["negative id", "bool id", "float code", "code past ROLES",
                                   "negative code", "bool code", "id past int64",
                                   "another session's", "never made", "past the new ids"])
def test_a_malformed_or_foreign_hint_is_refused_as_on_the_python_path(
        monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """A residency hint the Python path refuses (malformed, or naming a handle the session
    neither holds, frees nor makes in this request: another session's) is refused alike, and
    no hint of the request is applied."""
    def fields(c: Client) -> dict:
        assert c.last is not None
        held = c.last[0]
        ev = {"negative id": [-3, 0], "bool id": [True, 0], "float code": [held, 1.0],
              "code past ROLES": [held, 99], "negative code": [held, -1],
              "bool code": [held, True], "id past int64": [1 << 63, 0],
              "another session's": [1 << 40, 0], "never made": [99999, 1],
              "past the new ids": [c.next_id + 4, 0]}[which]
        return {"ev": [held, 0, *ev]}

    _bad_alike(monkeypatch, fields)


@pytest.mark.parametrize("free", [[True], [-1], [1 << 63], [None, "x", 1.5], [1 << 40],
                                  [99999, 99999]], ids=repr)
def test_frees_of_what_the_session_does_not_hold_drop_nothing(monkeypatch: pytest.MonkeyPatch,
                                                               free: list) -> None:
    """Frees naming another session's handles, ids never made or not ids at all drop nothing of
    the session's; the request is the lane's."""
    _bad_alike(monkeypatch, {"free": free}, served=True)


def test_a_hint_on_a_value_the_request_frees_is_the_lanes(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A hint racing its value's free (the Python path admits it) is served, the value freed."""
    def fields(c: Client) -> dict:
        assert c.last is not None
        x = c.hold(torch.ones(3))
        return {"free": [x], "ev": [x, 0]}

    _bad_alike(monkeypatch, fields, served=True)


def test_a_session_over_its_quota_is_refused_as_on_the_python_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A session over its quota before the program (the lane passes it: refused naming what
    to free), near it (a working set past what is left: passed), or whose kept values pass it
    after the program (nothing of them left put): each replies as the Python path does."""
    quota = 1 << 22
    after = 0
    for room in (-1, 0, 1 << 16, 8192, 6144, 4096, 3072, 2048, 1024, 512):
        def fields(c: Client, room: int = room) -> dict:
            left = quota - c.w.sess.used() - 1024 - room  # (a handle costs 1024 bytes)
            c.hold(torch.ones(left, dtype=torch.uint8))
            return {}

        on, py = _serving(monkeypatch, True, quota), _serving(monkeypatch, False, quota)
        a, b = _steady(on), _steady(py)
        runs = on.lane_runs
        ra, rb = (cl.send_raw({"d": [], **fields(cl)}) for cl in (a, b))
        assert ra == rb, (room, ra, rb)
        _same_session(on, py)
        if on.lane_runs > runs and ra["t"] == "err":
            assert ra["kind"] == "quota", ra
            after += 1
    assert after >= 1  # (some room let the program run and its puts pass the quota)


def test_a_put_past_the_handle_limit_is_refused_as_on_the_python_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept values past the session's handle limit: refused, nothing of them put."""
    from genie.remote import worker as W

    def fields(c: Client) -> dict:
        limit = len(c.w.sess.store) + 2  # (the request keeps 3 values)
        monkeypatch.setattr(W, "MAX_HANDLES", limit)
        monkeypatch.setattr(W, "_SERVE_LIMITS", [*W._SERVE_LIMITS[:2], limit,
                                                 *W._SERVE_LIMITS[3:]])
        return {}

    on, py = _serving(monkeypatch, True), _serving(monkeypatch, False)
    a, b = _steady(on), _steady(py)
    ra, rb = (cl.send_raw({"d": [], **fields(cl)}) for cl in (a, b))
    assert ra == rb and ra["t"] == "err" and ra["kind"] == "quota", (ra, rb)
    _same_session(on, py)
