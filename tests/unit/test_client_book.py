"""A steady run booked natively (``genie._C._client_book``, csrc/client_run.cpp: ``Client._book``
of a plan's tape) against the Python path (``Client._kept`` then ``Residency.ran``,
``GENIE_CLIENT_NATIVE=0``), the reference.

Each case books one run on a fresh client both ways, from the same rows (a plan's
``_kept_rows``), nodes, inputs and residency state: plain ones, which must be taken natively
(else the native path would pass by never running), and malformed or unusual ones, which the
native call must decline having changed nothing (the Python path then books them, or raises).
The outcomes must be the same: the same error (type and message), or the same kept handles (slot
order, id, client, metadata object, ``host``, every ``Resident`` slot) and the same residency
state (``live`` in order, ``pending`` in order: handle, node, output; the ``sized`` cache).
"""

from __future__ import annotations

import types

import pytest
import torch

client = pytest.importorskip("genie.remote.client")
pytest.importorskip("zmq")

from genie import _C  # noqa: E402
from genie.config import config  # noqa: E402
from genie.graph import TensorMeta  # noqa: E402
from genie.remote.handle import Handle  # noqa: E402
from genie.remote import residency  # noqa: E402
from genie.remote.residency import Resident  # noqa: E402
from genie.stats import stats as genie_stats  # noqa: E402

RES_SLOTS = ("role", "nbytes", "storage", "epoch", "source", "recipe", "slot", "evicted", "pins")


class _Node:
    """A node as booking reads it: its outputs' metadata; weakly referenced."""

    def __init__(self, metas) -> None:
        self.metas = metas


def _m(shape, stride=None, dtype=torch.float32, offset=0) -> TensorMeta:
    t = torch.empty(shape, dtype=dtype) if stride is None else \
        torch.empty_strided(shape, stride, dtype=dtype)
    return TensorMeta(tuple(t.shape), tuple(t.stride()), offset, dtype, 0)


def _res(r) -> tuple | None:
    if r is None:
        return None
    return tuple((k, getattr(r, k)) for k in RES_SLOTS)


def _outcome(native: bool, case: dict, monkeypatch) -> tuple:
    """Book ``case`` on a fresh client (native on or off): what it made or raised, the residency
    state after, and whether the native call took it."""
    c = client.Client("tcp://127.0.0.1:1", insecure=True, heartbeat=False)
    other = client.Client("tcp://127.0.0.1:2", insecure=True, heartbeat=False)
    env = {"c": c, "other": other}
    nodes, inputs, keep, rows = case["build"](env)
    metas = {id(m): j for j, m in enumerate(_metas(nodes) + [
        v.meta for v in inputs.values() if type(v) is Handle])}
    tape = types.SimpleNamespace(inputs=inputs, keep=keep, nodes=nodes)
    r = client._Run(tape)  # type: ignore[arg-type]
    r.enc = types.SimpleNamespace(order=[], key=b"k")
    r.id0 = case.get("id0", 1000)
    r.base = None
    res = c.res
    res.recording = case.get("recording", False)
    if "cache" in case:  # the cache as earlier steps left it
        case["cache"](res, nodes)
    res.pending.append((lambda: None, None, 0))  # a step's leftovers: cleared by booking
    monkeypatch.setattr(client, "_kept_rows", lambda tape, order: rows)
    saved = config.client_native
    config.client_native = native
    before = genie_stats().get("client_native_books", 0)
    try:
        kept = c._book(r)
        out: tuple = ("ok", [(s, h.id, h.client is c, h.client is other,
                              metas.get(id(h.meta), h.meta), h.host,
                              _res(h.res)) for s, h in kept.items()])
    except Exception as e:  # noqa: BLE001 - the error is the outcome
        out = ("raised", type(e), str(e))
    finally:
        config.client_native = saved
    took = genie_stats().get("client_native_books", 0) - before
    ids = {id(n): i for i, n in enumerate(nodes)}
    state = ([(i, w() is not None and w().id) for i, w in res.live.items()],
             [(w() is not None and w().id, None if wn is None else ids.get(id(wn())), k)
              for w, wn, k in res.pending],
             sorted(repr((metas.get(k, k < 0), metas.get(id(v[0]), v[0]), v[1], v[2]))
                    for k, v in res._sized.items()))
    return out, state, took


def _both(case: dict, monkeypatch) -> tuple[tuple, bool]:
    n = _outcome(True, case, monkeypatch)
    p = _outcome(False, case, monkeypatch)
    assert p[2] == 0
    assert n[0] == p[0]
    if n[0][0] == "ok":  # (an error: the Python path leaves a partial booking, the native none)
        assert n[1] == p[1]
    return n[0], n[2] == 1


def _plain(env):
    """Two nodes: a dense output, a transposed one (dense, hinted), an offset one (not dense),
    a non-tensor output; one metadata object kept twice; a kept input of this client's."""
    a, b = _m((2, 3)), _m((3, 2), (1, 3))
    n0 = _Node([a, None, _m((4,), offset=2)])
    n1 = _Node((b, a))
    h = Handle(7, env["c"], _m((5,)))
    return [n0, n1], {3: h, 9: torch.ones(1)}, {1, 2, 3, 4, 5, 6}, \
        [(1, 0, 0, 0), (2, 0, 1, 1), (3, -1, 0, 0), (4, 0, 2, 2), (5, 1, 0, 3), (6, 1, 1, 4)]


def _with(build_rows=None, **change):
    """The plain case with its rows (or inputs, nodes) changed."""
    def build(env):
        nodes, inputs, keep, rows = _plain(env)
        if build_rows is not None:
            nodes, inputs, keep, rows = build_rows(env, nodes, inputs, keep, rows)
        return nodes, inputs, keep, rows
    return {"build": build, **change}


def _metas(nodes):
    return [m for n in nodes if isinstance(n, _Node) for m in n.metas if m is not None]


def _warm(res, nodes):
    for m in _metas(nodes):
        res.size_of(m)


def _stale(res, nodes):
    """Entries under the metas' ids whose objects are others (a dead object's id come back)."""
    for m in _metas(nodes):
        res._sized[id(m)] = (_m((1,)), True, 4)


def _full(res, nodes):
    """A full cache: the next size clears it."""
    for k in range(4096):
        res._sized[-1 - k] = (None, False, 0)


PLAIN = {
    "plain": {"build": _plain},
    "no kept input": _with(lambda e, n, i, k, r: (n, {}, k - {3}, [x for x in r if x[1] >= 0])),
    "only a kept input": _with(lambda e, n, i, k, r: (n, i, {3}, [x for x in r if x[1] < 0])),
    "nothing kept": _with(lambda e, n, i, k, r: (n, i, set(), [])),
    "sizes cached": {"build": _plain, "cache": _warm},
    "sizes cached for other objects": {"build": _plain, "cache": _stale},
    "a full size cache": {"build": _plain, "cache": _full},
    "large ids": {"build": _plain, "id0": 2**62},
    "a bool output": _with(lambda e, n, i, k, r: (
        [_Node([_m((3,), dtype=torch.bool), None, _m((0,))]), n[1]], i, k, r)),
}


@pytest.mark.parametrize("case", list(PLAIN), ids=list(PLAIN))
def test_plain_runs_are_booked_natively_as_python_books_them(case, monkeypatch):
    _, native = _both(PLAIN[case], monkeypatch)
    assert native, "the native booking declined a plain run"


def _uploaded(env) -> torch.Tensor:
    """A host tensor the client uploaded earlier (its handle by the tensor's id)."""
    t = env["t"] = torch.ones(2)
    env["c"]._uploads[id(t)] = (t, Handle(8, env["c"], _m((2,))))
    return t


def _swap_row(k, row):
    return _with(lambda e, n, i, kp, r: (n, i, kp, [row if j == k else x for j, x in enumerate(r)]))


MALFORMED = {
    "a row as a list": _swap_row(0, [1, 0, 0, 0]),
    "a row of three": _with(lambda e, n, i, k, r: (n, i, k, [(1, 0, 0)] + r[1:])),
    "a bool in a row": _swap_row(0, (1, 0, False, 0)),
    "a float in a row": _swap_row(0, (1, 0, 0.0, 0)),
    "a huge int in a row": _swap_row(0, (1, 0, 0, 2**70)),
    "a negative place": _swap_row(0, (1, 0, 0, -1)),
    "a negative output": _swap_row(0, (1, 0, -1, 0)),
    "an output past the node's": _swap_row(0, (1, 0, 3, 0)),
    "a node index past the tape's": _swap_row(0, (1, 5, 0, 0)),
    "a released node": _with(lambda e, n, i, k, r: ([None, n[1]], i, k, r)),
    "a node without metas": _with(lambda e, n, i, k, r: ([object(), n[1]], i, k, r)),
    "metas of another type": _with(lambda e, n, i, k, r: ([types.SimpleNamespace(
        metas=iter(n[0].metas)), n[1]], i, k, r)),
    "a kept input of another client": _with(lambda e, n, i, k, r: (
        n, {**i, 3: Handle(8, e["other"], None)}, k, r)),
    "a kept input that is a tensor": _with(lambda e, n, i, k, r: (
        n, {**i, 3: _uploaded(e)}, k, r)),
    "a kept input missing": _with(lambda e, n, i, k, r: (n, {}, k, r)),
    "a kept input of a Handle subclass": _with(lambda e, n, i, k, r: (
        n, {**i, 3: type("H", (Handle,), {})(8, e["c"], None)}, k, r)),
    "an id past int64": {"build": _plain, "id0": 2**63 - 2},
    "an id that is not an int": {"build": _plain, "id0": 1000.0},
    "a meta whose size fails": _with(lambda e, n, i, k, r: (
        [_Node([_m((2,)), None, types.SimpleNamespace(offset=0, shape=(2,), stride=None)]),
         n[1]], i, k, r)),
    "a size error after an index error": _with(lambda e, n, i, k, r: (
        [_Node([types.SimpleNamespace(offset=0, shape=(2,), stride=None)]), n[1]], i, k, r)),
    "residency recording": {"build": _plain, "recording": True},
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_runs_end_as_on_the_python_path(case, monkeypatch):
    out, native = _both(MALFORMED[case], monkeypatch)
    assert not native, "declined by the native call, booked by the Python path"
    if case in ("a row of three", "a kept input of another client", "a kept input missing",
                "a released node", "a node without metas", "a node index past the tape's",
                "an output past the node's", "a meta whose size fails", "a float in a row",
                "metas of another type", "a size error after an index error"):
        assert out[0] == "raised", out


def _tm(shape, stride, offset=0, dtype=torch.float32, conj=False, neg=False) -> TensorMeta:
    return TensorMeta(tuple(shape), tuple(stride), offset, dtype, 0, conj, neg)


#: metadata natively sized (dense and bytes, residency.dense and _nbytes) or sized by Python
#: (True: must be booked natively)
LAYOUTS = {
    "contiguous": (_tm((2, 3, 4), (12, 4, 1)), True),
    "transposed": (_tm((3, 2), (1, 3)), True),
    "permuted 3-d": (_tm((2, 3, 4), (1, 8, 2)), True),
    "expanded": (_tm((4, 3), (0, 1)), True),
    "overlapping": (_tm((3, 3), (1, 1)), True),
    "gapped": (_tm((2, 3), (6, 2)), True),
    "size-1 dims, odd strides": (_tm((1, 5, 1), (99, 1, 7)), True),
    "empty": (_tm((0, 3), (3, 1)), True),
    "empty, odd strides": (_tm((3, 0), (5, 9)), True),
    "empty 1-d, odd stride": (_tm((0,), (5,)), True),
    "scalar": (_tm((), ()), True),
    "negative stride": (_tm((3,), (-1,)), True),
    "offset": (_tm((3,), (1,), offset=2), True),
    "conj": (_tm((3,), (1,), dtype=torch.complex64, conj=True), True),
    "neg": (_tm((3,), (1,), dtype=torch.complex64, neg=True), True),
    "more strides than dims": (_tm((3, 4), (9, 4, 1)), True),
    "fewer strides than dims": (_tm((3, 4, 2), (2, 1)), True),
    "bool": (_tm((5,), (1,), dtype=torch.bool), True),
    "float16": (_tm((2, 2), (2, 1), dtype=torch.float16), True),
    "int64": (_tm((2, 2), (1, 2), dtype=torch.int64), True),
    "complex128": (_tm((2,), (1,), dtype=torch.complex128), True),
    "a product past int64": (_tm((2**40, 2**40), (2**40, 1)), False),
    "a dim past int64": (_tm((2**70,), (1,)), False),
    "not a TensorMeta": (types.SimpleNamespace(shape=[2, 3], stride=[3, 1], offset=0,
                                               dtype=torch.float32), True),
    "a numpy-like int": (types.SimpleNamespace(shape=(True, 3), stride=(3, 1), offset=0,
                                               dtype=torch.float32), True),
}


@pytest.mark.parametrize("case", list(LAYOUTS), ids=list(LAYOUTS))
def test_each_layout_is_sized_as_python_sizes_it(case, monkeypatch):
    m, must = LAYOUTS[case]

    def build(env):
        return [_Node([m, m])], {}, {1, 2}, [(1, 0, 0, 0), (2, 0, 1, 1)]
    for cache in (None, _warm):  # sized here, or read from the cache
        c = {"build": build} if cache is None else {"build": build, "cache": cache}
        out, native = _both(c, monkeypatch)
        assert out[0] == "ok"
        assert native or not must


def test_a_declined_run_changes_nothing(monkeypatch):
    """Declined: the residency state and the sized cache as they were (the Python path clears
    `pending` first)."""
    c = client.Client("tcp://127.0.0.1:1", insecure=True, heartbeat=False)
    res = c.res
    nodes, inputs, keep, rows = _plain({"c": c})
    marker = (lambda: None, None, 0)
    res.pending.append(marker)
    rows = rows[:-1] + [(6, 1, 5, 4)]  # an output past the node's: declined at the last row
    got = _C._client_book(rows, nodes, inputs, 10, c, res._sized, res.live, res.pending,
                          res.size_of)
    assert got is None
    assert res.pending == [marker] and res.live == {}
    # a size that fails raises with nothing booked
    bad = _Node([types.SimpleNamespace(offset=0, shape=(2,), stride=None, dtype=None)])
    with pytest.raises(TypeError):
        _C._client_book([(1, 0, 0, 0)], [bad], {}, 10, c, res._sized, res.live, res.pending,
                        res.size_of)
    assert res.pending == [marker] and res.live == {}


def test_the_classes_are_checked_at_init():
    class H:
        __slots__ = ("id", "client", "meta", "host", "res", "extra", "__weakref__")

    with pytest.raises(TypeError, match="other slots"):
        _C._client_book_init(H, Resident, 4096)

    class R:
        __slots__ = RES_SLOTS

        def __new__(cls):
            return object.__new__(cls)

    with pytest.raises(TypeError, match="other slots or a __new__"):
        _C._client_book_init(Handle, R, 4096)
    with pytest.raises(TypeError, match="Handle and Resident classes"):
        _C._client_book_init(Handle(1, None, None), Resident, 4096)
    _C._client_book_init(Handle, Resident, residency.SIZED_MEMORY)  # (as the client set them)
