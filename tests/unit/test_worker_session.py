"""genie.remote.worker.Session's accounting in process: what a session holds and counts.

A run's kept values are put, and a request's frees dropped, in bulk (``put_many``,
``drop_many``: their storages counted in one native pass, ``genie._C._storages_held``); the
counts must be the ones :meth:`Session.put` and :meth:`Session.drop` reach one value at a time
(views of one storage counted once, a storage uncounted with its last value), and a bulk put
that :meth:`Session.put` would refuse puts nothing.
"""

from __future__ import annotations

import pytest
import torch

from genie.remote.worker import HANDLE_COST, Refused, Session


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
