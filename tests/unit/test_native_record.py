"""The native record path (``csrc/record.cpp``) against the Python one it stands in for.

Each program runs three times in one process: once to warm the caches (the native path learns
a meta-cache entry from the Python path the first time it sees a call), then with
``config.native_record`` off and on. Each runs so again with the native path's entries
forgotten before its run (every call a native miss: the entry comes from Python's meta cache,
``lazy_tensor.entry_for``) and with both caches cleared before each run (every call a miss of
both: the entry is inferred). The two recorded graphs must be equal field for field:
every node's op, arguments, metadata, storages, liveness, consumers, counters, context, the
interned meta-cache entry (the same object), and which objects are off the cyclic GC; and every
output tensor's metadata, dispatch keys and attributes. ``GENIE_NATIVE_RECORD=0`` runs the whole
unit suite on the Python path.
"""

from __future__ import annotations

import gc
import math
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import genie
from genie import _C, plan_cache
from genie.config import config
from genie.device import real_device
from genie.graph import DEFAULT_GRAPH, MetaArg, Node, Ref, Storage, TensorMeta, _record_counter
from genie.lazy_tensor import _RECORD, LazyTensor
from genie.meta import meta_cache

D = "remote_accelerator"

pytestmark = pytest.mark.skipif(not _C._record_native, reason="genie._C built without the "
                                "native record path (torch older than 2.13)")


@pytest.fixture(autouse=True)
def _native_on() -> Iterator[None]:
    before = config.native_record, config.native_record_miss, config.generic_meta
    config.native_record = config.native_record_miss = config.generic_meta = True
    yield
    config.native_record, config.native_record_miss, config.generic_meta = before


# --- describing a recorded graph, independently of object identities --------------------------

def _nodes(results: list[Any]) -> list[Node]:
    """Every node the tensors in ``results`` reach (through inputs and pending writes), in
    record order."""
    seen: dict[int, Node] = {}
    stack = [t._node for t in results if isinstance(t, LazyTensor)]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen[id(n)] = n
        stack += [x.node for x in n.leaves or () if type(x) is Ref]
        for s in n.storages:
            if s is not None:
                stack += s.pending_writes
    return sorted(seen.values(), key=lambda n: n.index)


def _const(x: Any) -> Any:
    if type(x) is float and math.isnan(x):
        return (float, "nan")
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape), x.stride(), x.tolist())
    return (type(x), x)


def _uid(n: Node) -> int:
    return int(n.uid.split("*")[1])


def describe(results: list[Any], start: int) -> list[Any]:
    """Each node recorded since ``start`` (a Node.index) and each result tensor, as plain data.

    Objects recorded before ``start`` (the inputs) stand by identity, and of their storages only
    what the new nodes did to them shows (their other readers differ from run to run).
    """
    nodes = _nodes(results)
    new = [n for n in nodes if n.index >= start]
    pos = {id(n): i for i, n in enumerate(new)}
    old_storages = {id(s) for n in nodes if n.index < start for s in n.storages}
    storages: dict[int, int] = {}

    def node_id(n: Any) -> Any:
        return ("new", pos[id(n)]) if id(n) in pos else ("old", id(n))

    def new_readers(s: Storage) -> list[str]:
        return sorted(str(node_id(w())) for w in s.readers if id(w()) in pos)

    def storage_id(s: Any) -> Any:
        if s is None:
            return None
        if id(s) in old_storages:
            return ("old", id(s), [node_id(w) for w in s.pending_writes if id(w) in pos],
                    new_readers(s))
        if id(s) not in storages:
            storages[id(s)] = len(storages)
        return (storages[id(s)], [node_id(w) for w in s.pending_writes], new_readers(s),
                s._prune_at, getattr(s, "role", None), gc.is_tracked(s),
                gc.is_tracked(s.readers), gc.is_tracked(s.pending_writes))

    def leaf(x: Any) -> Any:
        if type(x) is Ref:
            return ("ref", node_id(x.node), x.out, gc.is_tracked(x))
        if type(x) is MetaArg:
            return ("meta", x.meta, gc.is_tracked(x))
        return _const(x)

    out: list[Any] = []
    if not new:
        return out
    base = new[0]
    for n in new:
        ctx = n.ctx
        out.append(dict(
            op=n.op, leaves=None if n.leaves is None else [leaf(x) for x in n.leaves],
            spec=n.spec, shared_spec=n.entry is not None and n.spec is n.entry.spec,
            metas=n.metas, shared_metas=n.entry is not None and n.metas is
            n.entry.metas, out_spec=n.out_spec, storages=[storage_id(s) for s in n.storages],
            writes=[storage_id(s) for s in n.writes],
            # counts (default graph) or weak references to the tensors (capture graphs)
            outputs=[o if o is None or type(o) is int else type(o).__name__ for o in n.outputs],
            outputs_tracked=[gc.is_tracked(o) for o in n.outputs],
            live=[n.live(k) for k in range(len(n.outputs))],
            values=None if n.values is None else [None if v is None else _const(v)
                                                  for v in n.values],
            executed=n.executed, index=n.index - base.index, rng=n.rng,
            graph=n.graph is DEFAULT_GRAPH or type(n.graph).__name__,
            uid=_uid(n) - _uid(base) if n.graph is DEFAULT_GRAPH else n.uid,
            seq=type(n.seq), where=n.where,
            n_consumers=n.n_consumers,
            consumers=sorted(str(node_id(w())) for w in n.consumers if w() is not None),
            tags=n.tags, entry=id(n.entry), ctx=None if ctx is None else repr(ctx),
            wref=n._wref() is n,
            shape_of_outputs=(type(n._st).__name__, type(n._out).__name__),
            tracked=[gc.is_tracked(o) for o in (n, n.leaves, n._st, n._out, n._wref)]))
    for t in results:
        if isinstance(t, LazyTensor):
            out.append(dict(
                type=type(t), node=node_id(t._node), out=t._out,
                # the record (`_node`, `_out`) is the impl's on the native path (csrc/wrapper.cpp),
                # the dict's on the Python one, with a liveness token: compared as attributes
                attrs=[k for k in vars(t) if k not in _RECORD],
                record=[hasattr(t, k) for k in ("_node", "_out")], counted=_C._wrapper_counts(t),
                shape=tuple(t.shape), stride=t.stride(), offset=t.storage_offset(),
                dtype=t.dtype, device=t.device, requires_grad=t.requires_grad,
                conj=t.is_conj(), neg=t.is_neg(), keys=str(torch._C._dispatch_keys(t)),
                nbytes=t.untyped_storage().nbytes(), dict_tracked=gc.is_tracked(vars(t)),
                alive_tracked=gc.is_tracked(vars(t)["_alive"]) if "_alive" in vars(t) else
                False))
        else:
            out.append(_const(t))
    return out


# The recording counters (the engine's, such as plan-cache hits, move as a plan repeats).
_RECORDING = ("ops_recorded", "factories_recorded", "uploads", "meta_cache_hits",
              "meta_cache_misses", "shape_rule_hits", "forced_materializations")


#: How warm the caches are when each of the two runs starts: "warm" (the native path has learned
#: every call of the program), "native_cold" (the native path's entries forgotten: each call a
#: native miss that Python's meta cache answers), "cold" (both caches cleared: each new call
#: inferred).
MODES = ("warm", "native_cold", "cold")


def _interned_entries(desc: list[Any]) -> list[Any]:
    """``desc`` with each node's entry numbered by first appearance (entries inferred anew in
    each run are other objects), after checking each is the one Python's meta cache holds."""
    held = {id(v) for v in meta_cache._d.values()} | {id(None)}  # uploads have no entry
    order: dict[int, int] = {}
    out = []
    for d in desc:
        if "entry" in d:
            assert d["entry"] in held, f"node entry not interned in the meta cache: {d}"
            d = {**d, "entry": order.setdefault(d["entry"], len(order))}
        out.append(d)
    return out


def both_ways(program: Callable[[], list[Any]], mode: str = "warm",
              ) -> tuple[list[Any], list[Any], dict[str, int]]:
    """``program`` recorded by the Python path and by the native path (after a warm-up run),
    caches as ``mode`` says (:data:`MODES`): both descriptions, and the native path's outcome
    counts of its run."""
    program()  # warm: meta cache, learned entries, op policies
    out = {}
    counts: dict[str, int] = {}
    for native in (False, True):
        config.native_record = native
        if mode == "cold":
            meta_cache.clear()  # the native path's entries too
        elif mode == "native_cold" and native:
            _C._record_clear()
        _C._record_reset_stats()
        genie.reset_stats()
        start = next(_record_counter)  # the next node's index (the gap is harmless)
        # No collection in a run: a full one re-tracks what pending writers reach
        # (graph.retrack_writers), in one run and not the other, as the file's earlier tests'
        # garbage happens to bring it.
        enabled = gc.isenabled()
        gc.disable()
        try:
            results = program()
            stats = genie.stats()
            desc = describe(results, start)
        finally:
            if enabled:
                gc.enable()
        if mode == "cold":
            desc = _interned_entries(desc)
        out[native] = (desc, {k: v for k, v in stats.items() if k in _RECORDING})
        if native:
            counts = _C._record_stats()
        del results
    assert out[False][1] == out[True][1], "genie.stats() differ"
    return out[False][0], out[True][0], counts


def assert_same(program: Callable[[], list[Any]], *, native_ops: bool = True) -> None:
    for mode in MODES:
        python, native, counts = both_ways(program, mode)
        assert len(python) == len(native)
        for i, (a, b) in enumerate(zip(python, native)):
            assert a == b, f"{mode}: item {i} differs:\n python {a}\n native {b}"
        if native_ops:
            done = counts["handled"] if mode == "warm" else counts["miss_native"]
            assert done > 0, (mode, counts)


# --- programs --------------------------------------------------------------------------------

def _x(*shape: int) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(*shape).to(D)
    genie.materialize(x)
    return x


X = None


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    global X
    if X is None:
        X = (_x(4, 6), _x(6))
    return X


def test_native_wrappers_are_key_free() -> None:
    """Where key-free wrappers are on (``GENIE_KEY_FREE``, default), a natively made LazyTensor
    carries no Python key, a view of it no autograd view function (``_base`` as eager's), and its
    ops still record; the Python path's wrappers are the same kind. Values and gradients against
    eager's, through a view written in place."""
    from genie.lazy_tensor import key_free_wanted

    if not key_free_wanted():
        pytest.skip("key-free wrappers are off (GENIE_KEY_FREE=0, or no native record path)")
    assert _C._pu1_stats()[0]
    python_key = torch._C.DispatchKey.Python
    x, _ = _inputs()
    config.native_record = True
    try:
        x * 2  # (the first call learns the native path's entry from the Python path)
        y = x * 2
        assert type(y) is LazyTensor and not torch._C._dispatch_keys(y).has(python_key)
        config.native_record = False
        z = x * 3  # the Python path's wrappers: the same kind
        assert type(z) is LazyTensor and not torch._C._dispatch_keys(z).has(python_key)
    finally:
        config.native_record = True

    def grads(dev: str) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        w = torch.randn(4, 6).to(dev).requires_grad_()
        h = w * 3
        v = h.view(24)[2:10]  # a view of a view, written in place: autograd replays it
        v.mul_(2)
        assert v._base is h
        (h.sin() * torch.arange(24.0).to(dev).view(4, 6)).sum().backward()
        return h.detach().cpu(), w.grad.cpu()

    want, got = grads("cpu"), grads(D)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_elementwise_scalars_and_tensors() -> None:
    x, b = _inputs()

    def program() -> list[Any]:
        y = x * 0.5
        z = y + 1
        w = torch.relu(z) - x
        v = w * True
        u = (v + b).sigmoid()
        return [y, z, w, v, u, u > 0.5, u.mul(u), torch.where(u > 0, u, x)]

    assert_same(program)


def test_a_chain_where_tensors_die() -> None:
    x, _ = _inputs()

    def program() -> list[Any]:
        y = x
        for i in range(64):
            y = y * 0.5 if i % 2 else y - x
        return [y]

    assert_same(program)


def test_views_share_storages() -> None:
    x, _ = _inputs()

    def program() -> list[Any]:
        y = x + 1
        parts = [y.view(6, 4), y.t(), y[1:, ::2], y.transpose(0, 1).contiguous(),
                 y.permute(1, 0), y.unsqueeze(0).expand(2, 4, 6), y.reshape(24), y[2],
                 y.narrow(1, 1, 3), y.select(1, 0)]
        return [y, *parts, *y.split(2), *y.unbind(0), *y.chunk(3, 1)]

    assert_same(program)


def test_in_place_ops_between_native_ones() -> None:
    x, _ = _inputs()

    def program() -> list[Any]:
        y = x * 2
        v = y.view(6, 4)
        r = v + 1  # a read of y's storage before the write
        y.add_(1)
        y.mul_(x)
        s = y.sum(1)
        v.zero_()
        return [y, v, r, s, y * 3]

    assert_same(program)


def test_keyword_arguments_writes_and_foreach() -> None:
    x, b = _inputs()

    def program() -> list[Any]:
        y = x * 2
        z = y.clone()
        z.add_(x, alpha=2)
        z.addcmul_(y, x, value=0.5)
        w = torch.empty(4, 6, device=D)
        torch.add(y, x, alpha=3, out=w)  # out= of the right size: written in place
        v = torch.empty(0, device=D)
        torch.mul(y, 2, out=v)  # out= of another size: resized first (the Python path)
        ts = [y + 0, z + 0]
        torch._foreach_mul_(ts, 0.5)
        torch._foreach_add_(ts, [x, x], alpha=2)
        return [y, z, w, v, *ts, torch.nn.functional.gelu(y, approximate="tanh"),
                torch.ones_like(y, memory_format=torch.preserve_format),
                torch.div(y, 3, rounding_mode="floor"), y.sum(1, keepdim=True)]

    assert_same(program)


def test_multi_output_values_are_eagers_containers() -> None:
    # A tuple or list of tensors an op returns is built natively (not by out_spec.unflatten):
    # the same container type and values as eager, for tuples (native_layer_norm, aminmax,
    # max.dim) and lists (split.Tensor, unbind, the _foreach ops), learned and then hit.
    def program(dev: str) -> list[Any]:
        torch.manual_seed(0)
        x = torch.randn(4, 6).to(dev)
        b = torch.randn(6).to(dev)
        aten = torch.ops.aten
        return [aten.native_layer_norm.default(x, [6], b, b, 1e-5), aten.aminmax.default(x),
                aten.split.Tensor(x, 2), aten.unbind.int(x), aten.max.dim(x, 1),
                torch._foreach_add([x, b], 1.5), torch._foreach_mul([x, x], [b, b])]

    want = program(real_device(0))  # eager on the real device's kernels: bit-equal
    for run in range(2):  # the first learns the calls' entries, the second hits them
        _C._record_reset_stats()
        got = program(D)
        if run == 1:
            assert _C._record_stats()["handled"] >= 7, _C._record_stats()
        for w, g in zip(want, got, strict=True):
            assert type(g) is type(w), (run, type(g), type(w))
            assert len(g) == len(w)
            for a, c in zip(w, g, strict=True):
                assert type(c) is LazyTensor
                torch.testing.assert_close(c.cpu(), a.cpu(), rtol=0, atol=0)


def test_writes_with_fresh_outputs_and_an_optimizer_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)).to(D)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, _ = _inputs()

    def program() -> list[Any]:
        opt.state.clear()  # the same step (and so the same constants) every run
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()  # batch norm writes its running stats in training
        loss.backward()
        opt.step()
        return [loss, *model.parameters(), *model.buffers()]

    assert_same(program)


def test_batch_norm_writes_its_statistics_only_in_training() -> None:
    """A write its schema does not mark (genie.meta.UNMARKED_WRITES), only where ``training``
    is True: eval calls (positional and keyword) read the statistics, as Python records them."""
    x, _ = _inputs()
    f = torch.nn.functional.batch_norm

    def program() -> list[Any]:
        rm, rv = torch.zeros(6, device=D), torch.ones(6, device=D)
        genie.materialize(rm, rv)
        a = f(x, rm, rv, training=False)
        b = f(x, rm, rv, training=True, momentum=0.5)
        c = torch.ops.aten.native_batch_norm(x, None, None, rm, rv, False, 0.1, 1e-5)[0]
        d = torch.ops.aten.native_batch_norm(x, None, None, rm, rv, training=True,
                                             momentum=0.1, eps=1e-5)[0]
        return [a, b, c, d, rm, rv]

    assert_same(program)


def test_multi_output_ops() -> None:
    x, b = _inputs()

    def program() -> list[Any]:
        y = x + 0
        var, mean = torch.var_mean(y, 1)
        values, indices = y.max(dim=1)
        ln = torch.nn.functional.layer_norm(y, (6,), b, b)
        s, i = y.sort(1)
        t, j = y.topk(2)
        return [var, mean, values, indices, ln, s, i, t, j]

    assert_same(program)


def test_tensor_lists_and_metadata_only_args() -> None:
    x, _ = _inputs()

    def program() -> list[Any]:
        y = x * 1.5
        return [torch.cat([x, y]), torch.stack([y, x], 1), torch.zeros_like(y),
                torch.ones_like(y, dtype=torch.float64), y.new_zeros(3), torch.empty_like(y)]

    assert_same(program)


def test_dtypes_kwargs_and_copies() -> None:
    x, _ = _inputs()

    def program() -> list[Any]:
        y = x * 3
        return [y.to(torch.float64), y.sum(1, dtype=torch.float64), y.int(),
                torch.nn.functional.gelu(y, approximate="tanh"), y.clone(), y.mean(1, True)]

    assert_same(program)


def test_nan_and_negative_zero_constants() -> None:
    x, _ = _inputs()

    def program() -> list[Any]:
        y = x * 2
        return [y + float("nan"), y * -0.0, y * 0.0, torch.full_like(y, float("nan")),
                y.clamp(-0.0, 1.0)]

    assert_same(program)


def test_inputs_recorded_or_executed() -> None:
    x, _ = _inputs()

    def program() -> list[Any]:
        y = x * 2
        z = y + 1
        genie.materialize(z)  # z's node runs: later readers are not its consumers
        return [y, z, z * 2, z - y, y * 4]

    assert_same(program)


def test_module_contexts_and_backward() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 2)).to(D)
    x, _ = _inputs()

    def program() -> list[Any]:
        model.zero_grad(set_to_none=True)
        out = model(x)
        loss = out.square().mean()
        loss.backward()
        return [out, loss, *(p.grad for p in model.parameters())]

    assert_same(program)
    with torch.no_grad():
        assert_same(lambda: [model(x), model[0](x)])


def test_capture_mode_records_the_same() -> None:
    x, _ = _inputs()

    def program() -> list[Any]:
        with genie.capture() as g:
            y = x * 2
            z = y.view(6, 4) + 1
        return [y, z, len(g.nodes)]

    assert_same(program, native_ops=False)


def test_errors_are_the_python_paths() -> None:
    x, _ = _inputs()
    for native in (False, True):
        config.native_record = native
        with pytest.raises(RuntimeError, match="size of tensor"):
            x + torch.ones(5, device=D)
        with pytest.raises(TypeError):
            torch.add(x, "nope")


# --- the switch, the cache and the counters ---------------------------------------------------

def test_common_ops_take_the_native_path_and_the_switch_turns_it_off() -> None:
    x, _ = _inputs()
    for _ in range(2):
        y = (x * 2 + 1).relu().view(24)
    _C._record_reset_stats()
    y = (x * 2 + 1).relu().view(24)
    assert _C._record_stats()["handled"] == 4
    config.native_record = False
    _C._record_reset_stats()
    y = (x * 2 + 1).relu().view(24)
    assert _C._record_stats()["handled"] == 0 and _C._record_stats()["off"] == 4
    assert y.shape == (24,)


def test_in_place_and_keyword_calls_take_the_native_path() -> None:
    x, _ = _inputs()
    y = x * 1
    for _ in range(2):
        y.add_(x, alpha=2)
        y.mul_(0.5)
    _C._record_reset_stats()
    y.add_(x, alpha=2)
    y.mul_(0.5)
    assert _C._record_stats()["handled"] == 2
    assert y._node.op is torch.ops.aten.mul.Tensor  # in place: the tensor keeps its producer


def test_environment_switch() -> None:
    code = ("import torch, genie; from genie import _C; from genie.config import config; "
            "x = torch.ones(3, device='remote_accelerator'); y = [x * 2 for _ in range(3)]; "
            "print(config.native_record, _C._record_stats()['handled'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "GENIE_NATIVE_RECORD": "0"},
                         check=True).stdout.split()
    assert out == ["False", "0"]


@pytest.mark.parametrize("env,expected", [("0", ["False", "0"]), ("1", ["True", "4"])])
def test_environment_switch_of_the_miss_path(env: str, expected: list[str]) -> None:
    code = ("import torch, genie; from genie import _C; from genie.config import config; "
            "x = torch.ones(8, device='remote_accelerator'); y = x[:1] + 1; "
            "_C._record_reset_stats(); y = [x[:n] + 1 for n in (2, 3)]; "
            "print(config.native_record_miss, _C._record_stats()['miss_native'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "GENIE_NATIVE_RECORD_MISS": env,
                              "GENIE_NATIVE_RECORD": "1"}, check=True).stdout.split()
    assert out == expected


def test_clearing_the_meta_cache_forgets_learned_entries() -> None:
    x, _ = _inputs()
    y = x * 7
    y = x * 7
    assert _C._record_stats()["entries"] > 0
    meta_cache.clear()
    assert _C._record_stats()["entries"] == 0
    genie.reset_stats()
    y = x * 7  # a miss again, counted as on the Python path
    y = x * 7
    s = genie.stats()
    assert s["meta_cache_misses"] == 1 and s["meta_cache_hits"] == 1 and s["ops_recorded"] == 2
    assert y.shape == x.shape


def test_profiler_ranges_come_from_the_python_path() -> None:
    x, _ = _inputs()
    y = x * 2
    y = x * 2
    with torch.profiler.profile() as prof:
        y = x * 2
    assert any(e.name == "genie.record" for e in prof.events())
    assert y.shape == x.shape


def test_init_refuses_classes_with_unknown_slots() -> None:
    with pytest.raises(TypeError, match="slots"):  # the arguments are inline (var-sized)
        class Slotted(Node):
            __slots__ = ("extra",)

    class Wider(Node):  # an instance dict: a field the native path does not write
        pass

    import genie.lazy_tensor as lt

    with pytest.raises(RuntimeError, match="other slots"):
        _C._record_init(dict(
            LazyTensor=LazyTensor, Node=Wider, Ref=Ref, Storage=Storage,
            MetaArg=MetaArg, TensorMeta=lt.TensorMeta, MetaEntry=lt.MetaEntry, Graph=lt.Graph,
            fallback=lt._dispatch, counts=lt._counts, profiler=vars(lt._profiler), tls=lt._tls,
            current=lt.graph_current, default_graph=DEFAULT_GRAPH, counter=lt._record_counter,
            leaf_spec=lt._LEAF_SPEC, copy_ops=(), pending_total=lt.pending_total,
            retrack_below=_C._gc_retrack_below, defer_writer=lt.defer_writer, limit=16))
    x, _ = _inputs()  # the path still works with the classes it was given
    y = x * 9
    _C._record_reset_stats()
    y = x * 9
    assert _C._record_stats()["handled"] == 1 and type(y._node) is Node


def test_values_equal_both_ways() -> None:
    x, b = _inputs()

    def run() -> list[float]:
        y = x
        for _ in range(10):
            y = torch.tanh(y * 0.9 + b) - x.sum(0)
        return y.cpu().flatten().tolist()

    config.native_record = False
    ref = run()
    config.native_record = True
    run()
    assert run() == ref
    assert re.fullmatch(r"op\*\d+", (x * 2)._node.uid)


# --- new shapes every step: the native miss path ----------------------------------------------

def _attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, new_k: torch.Tensor,
                    new_v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One decode step of a tiny attention with a growing KV cache: the cache's length, and so
    the shape of every op below, is new at each step (2 heads, head size 4)."""
    k = torch.cat([k, new_k], 1)
    v = torch.cat([v, new_v], 1)
    n = k.shape[1]
    scores = torch.bmm(q, k.transpose(1, 2)) / 2.0  # (2, 1, n)
    causal = mask[:1, :n].view(1, 1, n).expand(2, 1, n)
    scores = torch.where(causal, scores, torch.full_like(scores, -1e4))
    probs = torch.softmax(scores + 0.5, -1)
    out = torch.bmm(probs, v).view(1, 2, 4).transpose(0, 1).reshape(1, 8)
    return k, v, out


def _decode(dev: str | torch.device, steps: int = 6) -> list[Any]:
    torch.manual_seed(1)
    q, k0, v0, nk, nv = (torch.randn(*s) for s in
                         ((2, 1, 4), (2, 3, 4), (2, 3, 4), (2, steps, 4), (2, steps, 4)))
    mask = torch.ones(1, 32, dtype=torch.bool)
    mask[0, 5] = False  # a masked position, so `where` picks from both sides
    q, k, v, nk, nv, mask = (t.to(dev) for t in (q, k0, v0, nk, nv, mask))
    outs = []
    for i in range(steps):
        k, v, out = _attention_step(q, k, v, nk[:, i:i + 1], nv[:, i:i + 1], mask)
        outs.append(out)
    return [k, v, *outs, torch.cat(outs)]


def _prefill(dev: str | torch.device, length: int) -> list[Any]:
    """A prompt of a new length through a small MLP and a causal self-attention."""
    torch.manual_seed(2)
    x = torch.randn(length, 8)
    w1, w2 = torch.randn(8, 16), torch.randn(16, 8)
    x, w1, w2 = x.to(dev), w1.to(dev), w2.to(dev)
    h = torch.nn.functional.gelu(x @ w1) @ w2 + x
    scores = (h @ h.t()).masked_fill(
        torch.ones(length, length, dtype=torch.bool, device=dev).triu(1), float("-inf"))
    return [h, torch.softmax(scores, -1) @ h, h.mean(0), h.view(-1)[: length * 4].view(length, 4)]


def test_a_decode_loop_with_a_growing_cache() -> None:
    dev_inputs = _decode(D, 1)  # upload path and policies seen once
    del dev_inputs
    assert_same(lambda: _decode(D))


def test_a_prefill_at_a_new_length() -> None:
    lengths = iter(range(5, 400))
    assert_same(lambda: _prefill(D, 7))  # one length, every mode
    # each run a length never seen: every op with a new shape a miss of both caches
    for length in (next(lengths) for _ in range(3)):
        for native in (False, True):
            config.native_record = native
            _C._record_reset_stats()
            got = _prefill(D, length + 100 * native)
            want = _prefill("cpu", length + 100 * native)
            for g, w in zip(got, want):
                torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)
            if native:
                assert _C._record_stats()["miss_native"] > 0


def test_new_shapes_record_natively_with_eager_values() -> None:
    want = _decode("cpu")
    for native in (False, True):
        config.native_record = native
        meta_cache.clear()
        _C._record_reset_stats()
        got = _decode(D)
        counts = _C._record_stats()
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w)
        if native:
            # every op the native path takes, cache-cold, is a native miss, none a fallback
            assert counts["miss_native"] > 30 and counts["unseen"] == 0, counts
            assert counts["handled"] > 0  # the same shapes within one run: learned, hit


def test_the_switch_sends_misses_to_the_python_path() -> None:
    config.native_record_miss = False  # the fixture restores it
    meta_cache.clear()
    _C._record_reset_stats()
    _decode(D)
    counts = _C._record_stats()
    assert counts["miss_native"] == 0 and counts["learned"] > 30, counts


def test_a_plan_repeats_over_new_shapes_both_ways() -> None:
    """The plan cache compares nodes by entry and shape class: a native miss gives it the same
    entries as the Python path, so the steps of a decode hit the same plans."""
    def hits() -> dict[str, int]:
        meta_cache.clear()
        plan_cache.clear()
        _decode(D, 2)  # plans for the step's slice, first use
        genie.reset_stats()
        for out in _decode(D, 6)[2:]:
            genie.materialize(out)
        s = genie.stats()
        return {k: s.get(k, 0) for k in ("plan_cache_hits", "plan_cache_generic_hits",
                                          "plan_cache_misses")}

    config.native_record = False
    python = hits()
    config.native_record = True
    _C._record_reset_stats()
    native = hits()
    assert native == python and python["plan_cache_hits"] > 0, (python, native)
    assert _C._record_stats()["miss_native"] > 0


@pytest.mark.parametrize("bad", ["view", "matmul", "cat", "expand"])
def test_errors_on_a_miss_are_eagers(bad: str) -> None:
    """A call whose shapes are new and wrong raises what eager raises (the meta kernel's error,
    through the Python path) on both paths, with no node recorded and the same counts."""
    def call(dev: str, n: int) -> Any:
        torch.manual_seed(0)
        x = torch.randn(n, 3).to(dev)
        if bad == "view":
            return x.view(n + 1, 5)
        if bad == "matmul":
            return x @ torch.ones(n + 1, 2).to(dev)
        if bad == "cat":
            return torch.cat([x, torch.ones(2, n + 4).to(dev)])
        return x.expand(n + 1, 7)

    errors = {}
    for native in (None, False, True):
        config.native_record = bool(native)
        meta_cache.clear()  # every call a miss of both caches
        _C._record_reset_stats()
        genie.reset_stats()
        with pytest.raises(Exception) as info:
            call("cpu" if native is None else D, 13)
        errors[native] = (type(info.value), str(info.value),
                          {k: v for k, v in genie.stats().items() if k in _RECORDING})
    assert errors[False] == errors[True], errors
    assert errors[None][0] is errors[True][0], errors


def test_an_interrupt_during_a_miss_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only an inference that raises an Exception sends a miss to the Python path (which raises
    eager's error); a KeyboardInterrupt while inferring reaches the user on both paths."""
    from genie import shape_rules

    calls = []

    def interrupted_once(args: tuple, index: int) -> None:  # then declines: the meta kernel
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt

    x, _ = _inputs()
    monkeypatch.setitem(shape_rules.RULES, torch.ops.aten.view.default, interrupted_once)
    for native in (False, True):
        config.native_record = native
        meta_cache.clear()
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            x.view(3, 8)
        assert len(calls) == 1  # not inferred again by the Python path
    monkeypatch.undo()
    assert x.view(3, 8).shape == (3, 8)


# --- torch's per-op dispatch-rule lookup, natively (GENIE_NATIVE_DISPATCH_RULE) -----------------

def _torchs_find_rule(op, cls):
    """torch's own find_torch_dispatch_rule, spelled out (the reference the native one replaces)."""
    from torch._library import simple_registry
    return simple_registry.singleton.find(op.__qualname__).torch_dispatch_rules.find(cls)


class _RuleTensor(torch.Tensor):
    """A plain wrapper subclass for the rule tests: every op it sees it answers with a plain 0
    (so a registered rule, which answers 1, shows whether it was used)."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype,
                                                   device=elem.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return torch.zeros(())


def test_the_native_dispatch_rule_lookup_agrees_with_torchs_and_honours_registered_rules():
    from torch._library import simple_registry

    if not config.native_dispatch_rule:
        pytest.skip("GENIE_NATIVE_DISPATCH_RULE=0: torch's own lookup is in place")
    assert simple_registry.find_torch_dispatch_rule is _C._find_torch_dispatch_rule
    aten = torch.ops.aten
    ops = [aten.add.Tensor, aten.mul.Tensor, aten.sin.default, aten.cos.default]
    t = _RuleTensor(torch.randn(2))
    assert torch.sin(t).item() == 0 and torch.cos(t).item() == 0

    def rule(mode_or_cls, func, types, args, kwargs):  # noqa: ARG001
        return torch.ones(())

    with torch.library._scoped_library("aten", "FRAGMENT") as lib:
        torch.library.register_torch_dispatch("aten::sin", _RuleTensor, rule, lib=lib)
        for op in ops:
            for cls in (_RuleTensor, torch.Tensor, genie.LazyTensor):
                assert _C._find_torch_dispatch_rule(op, cls) is _torchs_find_rule(op, cls)
        assert _C._find_torch_dispatch_rule(aten.sin.default, _RuleTensor) is not None
        assert torch.sin(t).item() == 1  # torch's dispatch found the rule (native lookup)
        assert torch.cos(t).item() == 0
    assert _C._find_torch_dispatch_rule(aten.sin.default, _RuleTensor) is None  # deregistered
    assert torch.sin(t).item() == 0
    with pytest.raises(TypeError):
        _C._find_torch_dispatch_rule(aten.sin.default)


def _factories(n: int) -> list[Any]:
    d = torch.device(D, 0)
    return [torch.arange(n, device=d), torch.arange(1, n, 2, dtype=torch.float32, device=d),
            torch.full((2, n), 3, device=d), torch.full((1,), 0.5, device=d),
            torch.zeros(n, 2, device=d), torch.ones((), dtype=torch.int64, device=d),
            torch.scalar_tensor(-1.0, device=d), torch.empty_strided((2, n), (1, 2), device=d),
            torch.eye(3, device=d), torch.zeros(2, device=D)]  # the last one: no index


def test_factories_record_natively_as_record_factory_does() -> None:
    """The PrivateUse1 factory kernels (genie.factories) take the native path: the same nodes
    as lazy_tensor.record_factory (every mode), counted in factories_recorded, eager's values."""
    lengths = iter(range(3, 100))
    assert_same(lambda: _factories(4))
    config.native_record = True
    genie.reset_stats()
    _C._record_reset_stats()
    n = next(lengths)
    got = _factories(n)  # new shapes: native misses
    counts = _C._record_stats()
    assert counts["miss_native"] + counts["handled"] >= 8, counts
    assert genie.stats()["factories_recorded"] == len(got)
    for i, (g, w) in enumerate(zip(got, _factories_cpu(n), strict=True)):
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype), i
        if i != 7:  # empty_strided: no values to compare
            assert torch.equal(g.cpu(), w), i


def _factories_cpu(n: int) -> list[torch.Tensor]:
    return [torch.arange(n), torch.arange(1, n, 2, dtype=torch.float32), torch.full((2, n), 3),
            torch.full((1,), 0.5), torch.zeros(n, 2), torch.ones((), dtype=torch.int64),
            torch.scalar_tensor(-1.0), torch.empty_strided((2, n), (1, 2)), torch.eye(3),
            torch.zeros(2)]


def test_factory_errors_and_other_devices_take_record_factory() -> None:
    """A bad index raises eager's error through record_factory; a device without an index is
    recorded natively with the current device filled in, as record_factory fills it in."""
    from genie import device as gdev
    from genie.errors import DeviceError

    torch.zeros(2, device=D)  # the entry learned
    _C._record_reset_stats()
    with pytest.raises(DeviceError):
        torch.zeros(2, device=torch.device(D, 7))
    t = torch.zeros(2, device=D)
    counts = _C._record_stats()
    assert t.device == torch.device(D, 0) and counts["devices"] == 1 and counts["handled"] == 1
    assert torch.device(D, 0) in t._node.leaves
    if gdev.device_count() > 1:
        with gdev.device(1):
            u = torch.ones(3, device=D)
        assert u.device == torch.device(D, 1) and torch.device(D, 1) in u._node.leaves
        assert torch.equal(u.cpu(), torch.ones(3))


# --- shape-generic entries (csrc/record.cpp): a known class's misses take its rule natively -----

def test_new_shapes_of_a_known_class_make_the_entries_python_would() -> None:
    """A decode with cold caches: each step's calls are new shapes of the classes its first step
    met, so their entries are made natively from the class's shape rule. Each is interned in
    Python's meta cache under Python's key and equals what ``meta.infer`` gives for the call;
    the recorded graphs, counts and values equal the Python path's (``assert_same`` also runs
    this program cold)."""
    from genie.meta import infer, policy
    from genie.shape_rules import RULES

    meta_cache.clear()
    _C._record_reset_stats()
    before = _C._record_stats()["generic_made"]
    outs = _decode(D)
    assert _C._record_stats()["generic_made"] > before + 10
    checked = 0
    for key, entry in list(meta_cache._d.items()):
        op = next((o for o in RULES if policy(o).key == key[0]), None)
        if op is None or not all(type(m) is TensorMeta for m in entry.metas):
            continue
        leaves = []
        parts = list(key[2:])
        while parts:  # Python's key: a TensorMeta, or a type and (unless a float) its value
            x = parts.pop(0)
            if type(x) is TensorMeta:
                leaves.append(x)
            elif x is float and not (parts and type(parts[0]) is float):
                leaves.append(0.5)
            else:
                leaves.append(parts.pop(0))
        try:
            want = infer(op, policy(op), leaves, key[1], entry.metas[0].index)
        except Exception:  # noqa: BLE001 - a leaf this reconstruction cannot rebuild
            continue
        assert (want.metas, want.out_spec, want.consts, want.plan, want.spec) == \
            (entry.metas, entry.out_spec, entry.consts, entry.plan, entry.spec), key
        assert want.klass is entry.klass, key
        checked += 1
    assert checked > 10
    want = _decode("cpu")
    for g, w in zip(outs, want):
        torch.testing.assert_close(g.cpu(), w)


def _generic_both_ways(program: Callable[[], list[Any]]) -> list[list[Any]]:
    """``program`` recorded natively with cold caches, shape-generic entries off then on: the
    two descriptions (entries numbered) and stats must be equal."""
    program()
    out = []
    for generic in (False, True):
        config.generic_meta = generic
        meta_cache.clear()
        genie.reset_stats()
        start = next(_record_counter)
        results = program()
        stats = {k: v for k, v in genie.stats().items() if k in _RECORDING}
        out.append((_interned_entries(describe(results, start)), stats))
        del results
    config.generic_meta = True
    assert out[0][1] == out[1][1], out
    for i, (a, b) in enumerate(zip(out[0][0], out[1][0])):
        assert a == b, f"item {i} differs:\n off {a}\n on {b}"
    return [d for d, _ in out]


def test_generic_entries_record_the_same_graph_as_entry_for() -> None:
    _generic_both_ways(lambda: _decode(D))
    _generic_both_ways(lambda: _prefill(D, 9) + _prefill(D, 11) + _prefill(D, 12))


def test_a_class_first_found_by_value_makes_its_later_entries_natively() -> None:
    """An input that is a new TensorMeta object equal to a known one (generate's ``any(dim=-1)``
    of each token's fresh ``isin``): its entry is found in Python's meta cache by value, and the
    class's later new shapes are made natively from its rule, not through ``entry_for``
    (``unsqueeze`` here: any op with a shape rule)."""
    meta_cache.clear()
    x, y = torch.zeros(2, 5).to(D), torch.zeros(3, 7).to(D)
    config.generic_meta = False
    try:
        (x + 1).unsqueeze(1)  # Python's meta cache holds the entry; no class learned
    finally:
        config.generic_meta = True
    (x * 2).unsqueeze(1)  # an equal TensorMeta, another object: found by value
    z = y - 1
    before = _C._record_stats()["generic_made"]
    got = z.unsqueeze(1)  # a new shape of the class
    assert _C._record_stats()["generic_made"] == before + 1
    assert (got.shape, got.stride(), got.dtype) == ((3, 1, 7), (7, 7, 1), torch.float32)
    assert torch.equal(got.cpu(), torch.zeros(3, 1, 7) - 1)


def _keyword_rules(dev: str | torch.device) -> list[Any]:
    """Calls of ops whose shape rule takes keyword arguments (shape_rules.KW_RULES), at new
    constants or shapes each time: a decode step's position ids (arange from the KV length),
    ones/zeros of new sizes, clone and full_like of new shapes."""
    torch.manual_seed(4)
    out: list[Any] = []
    for n in (5, 6, 7, 9):
        out.append(torch.arange(n, n + 1, device=dev) + 1)
        out.append(torch.arange(n, device=dev, dtype=torch.int64) * 2)
        out.append(torch.ones(n, 2, device=dev) + 1)
        out.append(torch.zeros(2, n, device=dev) - 1)
        x = torch.randn(n, 3).to(dev)
        out.append(torch.full_like(x, 2.5) + x)
        out.append(x.clone() * 3)
    return out


def test_keyword_rule_classes_make_their_entries_natively() -> None:
    """A factory (or clone, *_like) call at a new constant or shape is a miss of its class: its
    entry comes from the class's keyword rule natively (no entry_for), the same graph, entries
    and counts as entry_for makes, eager's values."""
    _generic_both_ways(lambda: _keyword_rules(D))
    _keyword_rules(D)  # the classes learned
    before = _C._record_stats()["generic_made"]
    got = [torch.arange(n, n + 1, device=D) for n in (40, 41, 42)]
    assert _C._record_stats()["generic_made"] == before + 3
    assert [g.cpu().tolist() for g in got] == [[40], [41], [42]]
    want = _keyword_rules("cpu")
    got = _keyword_rules(D)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype)
        torch.testing.assert_close(g.cpu(), w)


def _squeeze_split(dev: str | torch.device) -> list[Any]:
    """Calls of one class whose outputs change class with the shapes: squeeze of a dim that is
    1 then 3 (rank 1 -> 2), split into 2 then 3 pieces, a cat whose sizes stop matching."""
    torch.manual_seed(3)
    out: list[Any] = []
    for n in (1, 3, 1):
        x = torch.randn(5, n).to(dev)
        out.append(x.squeeze(1) * 2)
    for n in (4, 6, 5):
        y = torch.randn(n, 2).to(dev)
        out.extend(p + 1 for p in y.split(2))
    return out


def test_a_rule_answer_of_another_class_takes_the_python_path() -> None:
    _generic_both_ways(lambda: _squeeze_split(D))
    want = _squeeze_split("cpu")
    got = _squeeze_split(D)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.shape, g.stride()) == (w.shape, w.stride())
        torch.testing.assert_close(g.cpu(), w)


@pytest.mark.parametrize("bad", ["view", "matmul", "cat"])
def test_errors_in_a_known_class_are_eagers(bad: str) -> None:
    """A class learned from a good call, then a call of it whose shapes are wrong: the rule
    declines, and the Python path raises eager's error at the call."""
    def call(dev: str, n: int, ok: bool) -> Any:
        torch.manual_seed(0)
        x = torch.randn(n, 3).to(dev)
        m = 0 if ok else 1
        if bad == "view":
            return x.view(3, n) if ok else x.view(n + 1, 5)
        if bad == "matmul":
            return x @ torch.ones(3 + m, 2).to(dev)
        return torch.cat([x, torch.ones(2, 3 + m).to(dev)])

    errors = {}
    for dev in ("cpu", D):
        meta_cache.clear()
        call(dev, 4, True)
        call(dev, 5, True)  # a known class now, on the device
        with pytest.raises(Exception) as info:
            call(dev, 6, False)
        errors[dev] = (type(info.value), str(info.value).replace(D + ":0", "cpu"))
    assert errors["cpu"] == errors[D], errors
