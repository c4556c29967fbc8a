"""The server's log budget per tenant (genie.remote.logbudget), with a clock the test moves."""

from __future__ import annotations

import logging

import pytest

from genie.remote import logbudget
from genie.remote.logbudget import LogBudget


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def rec(msg: str, *args: object, tenant: str | None = None) -> logging.LogRecord:
    r = logging.LogRecord("genie.server", logging.INFO, __file__, 1, msg, args, None)
    if tenant is not None:
        r.tenant = tenant
    return r


def test_a_session_logs_its_burst_then_one_per_period_and_says_what_it_dropped() -> None:
    clock = Clock()
    f = LogBudget(3, 2.0, keyed=False, clock=clock)
    assert [f.filter(rec("line %d", i)) for i in range(5)] == [True] * 3 + [False] * 2
    clock.t += 1.9
    assert not f.filter(rec("early"))
    clock.t += 0.1  # one record's worth refilled
    r = rec("late %s", "x")
    assert f.filter(r)
    assert r.getMessage().startswith("late x [and 3 earlier log record(s) of this session's "
                                     "dropped"), r.getMessage()
    assert not f.filter(rec("again"))
    clock.t += 1000  # refills up to the burst, not past it
    assert [f.filter(rec("x")) for _ in range(4)] == [True] * 3 + [False]


def test_the_front_keeps_one_budget_per_client_and_never_drops_the_servers_own_lines() -> None:
    clock = Clock()
    f = LogBudget(2, 10.0, keyed=True, clock=clock)
    assert [f.filter(rec("a", tenant="k1")) for _ in range(3)] == [True, True, False]
    assert f.filter(rec("b", tenant="k2"))  # another client's budget is its own
    assert all(f.filter(rec("server")) for _ in range(100))  # no tenant: never dropped
    clock.t += 10
    r = rec("c", tenant="k1")
    assert f.filter(r) and "1 earlier log record(s) of this client's dropped" in r.getMessage()


def test_the_front_forgets_the_least_recently_heard_client_first(monkeypatch) -> None:
    monkeypatch.setattr(logbudget, "MAX_TENANTS", 2)
    f = LogBudget(1, 10.0, keyed=True, clock=Clock())
    assert f.filter(rec("x", tenant="a")) and not f.filter(rec("x", tenant="a"))
    assert f.filter(rec("x", tenant="b")) and f.filter(rec("x", tenant="c"))
    assert len(f._buckets) == 2 and "a" not in f._buckets


@pytest.mark.parametrize("value, expected", [("", (50, 5.0)), ("20/0.5", (20, 0.5)),
                                             ("off", None), ("0", None)])
def test_the_budget_comes_from_the_environment(monkeypatch, value, expected) -> None:
    monkeypatch.setenv(logbudget.ENV, value)
    assert logbudget.budget_from_env() == expected


@pytest.mark.parametrize("value", ["fast", "10", "0/1", "5/0", "5/-1", "a/b"])
def test_a_bad_budget_stops_the_server_with_the_form_it_takes(monkeypatch, value) -> None:
    monkeypatch.setenv(logbudget.ENV, value)
    with pytest.raises(SystemExit, match="BURST/SECONDS"):
        logbudget.budget_from_env()
