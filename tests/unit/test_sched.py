"""The server's request queue (genie/remote/sched.py): sessions take turns, one request of a
session at a time and in order, a disconnected client's queued requests are dropped."""

import threading

from genie.remote.sched import FairQueue


def _drain(q: FairQueue) -> list:
    """Items in the order workers that finish at once would take them."""
    out = []
    while q.qsize():
        key, item = q.get()
        out.append(item)
        q.done(key)
    return out


def test_sessions_take_turns_and_keep_their_own_order():
    q = FairQueue()
    for i in range(4):
        q.put("long", f"L{i}")  # one client queued many requests first
    q.put("s1", "A0")
    q.put("s2", "B0")
    q.put("s1", "A1")
    assert _drain(q) == ["L0", "A0", "B0", "L1", "A1", "L2", "L3"]


def test_one_request_per_session_in_flight():
    q = FairQueue()
    q.put("a", "a0")
    q.put("a", "a1")
    q.put("b", "b0")
    assert q.get() == ("a", "a0")
    assert q.get() == ("b", "b0")  # a's next waits for a0, though it was queued first
    got: list = []
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    t.join(timeout=0.2)
    assert t.is_alive() and not got  # a worker is free, but a1 must wait for a0
    q.done("a")
    t.join(timeout=5)
    assert got == [("a", "a1")]


def test_drop_removes_a_clients_queued_requests_and_close_wakes_workers():
    q = FairQueue()
    for item in [("c1", 1), ("c2", 2), ("c1", 3)]:
        q.put(item[0], item)
    assert q.drop(lambda it: it[0] == "c1") == 2
    assert q.qsize() == 1
    assert _drain(q) == [("c2", 2)]
    got: list = []
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    q.close()
    t.join(timeout=5)
    assert got == [None]
