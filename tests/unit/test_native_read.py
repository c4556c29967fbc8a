"""The steady read in one native call (genie._C._read, csrc/read.cpp; genie.executor._read_fast):
a read the fused path may take goes from its pending targets to its bound values without the
Python steps between them, and the Python path (GENIE_NATIVE_READ=0, config.native_read) stays
its reference: the same values, the same nodes bound, the same counters, the same errors."""

import threading
import traceback
import weakref

import pytest
import torch

import genie
from genie import executor, lazy_tensor, plan_cache
from genie.config import config
from genie.device import real_device

from test_fused_hit import _failing_reads, _growing, _peaks, _uploading, assert_same_peaks

D = "remote_accelerator"
_OFF = "the settings turn the fused path off (GENIE_NATIVE_BIND/REPLAY, index checks)"
_KEYS = ("plan_cache_hits", "plan_cache_generic_hits", "plan_cache_misses", "nodes_executed",
         "values_freed", "native_replays", "fused_hits", "passes_waiting", "uploads",
         "materializations", "step_tapes", "materializations.item", "forced_materializations",
         "materializations.cpu")


@pytest.fixture(autouse=True)
def _fused_only(monkeypatch):
    """Each test starts with no memory tracking (as test_fused_hit) and the fused path on."""
    from genie import memory

    if not executor._fuse[0]:
        pytest.skip(_OFF)
    monkeypatch.setattr(memory, "_tracking", [False])


class _PythonSteps:
    """Counts the Python steps a read takes between its lookup and its bind: the lookup
    (plan_cache.plan), the fused hit in Python (executor._run_hit) and a tape's run."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for mod, name in ((plan_cache, "plan"), (executor, "_run_hit"), (executor, "run_tape")):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, self._counted(real))

    def _counted(self, real):
        def f(*a, **k):
            self.calls += 1
            return real(*a, **k)
        return f


def _adamw(dev, steps=12, probe=None):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).to(dev)
    x, t = torch.randn(4, 8).to(dev), torch.randn(4, 8).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, calls = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(m(x), t)
        loss.backward()
        opt.step()
        before = probe.calls if probe is not None else 0
        losses.append(loss.item())
        calls.append((probe.calls if probe is not None else 0) - before)
    return losses, [p.detach().cpu() for p in m.parameters()], calls


def test_a_steady_training_step_is_one_native_call(monkeypatch):
    plan_cache.clear()
    probe = _PythonSteps(monkeypatch)
    before = genie.stats().get("fused_hits", 0)
    losses, params, calls = _adamw(D, steps=16, probe=probe)
    fused = genie.stats().get("fused_hits", 0) - before
    assert fused >= 4, calls
    # the steady steps' reads take no Python step (the first ones miss, verify or time passes)
    assert calls[-3:] == [0, 0, 0], calls
    want_losses, want_params, _ = _adamw("cpu", steps=16)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    for p, q in zip(params, want_params, strict=True):
        torch.testing.assert_close(p, q)


def _both(monkeypatch, run):
    """``run()`` with the native read and with the Python path: (what it returned, counters)."""
    seen = {}
    for on in (False, True):
        monkeypatch.setattr(config, "native_read", on)
        assert executor._read_native[0] is on
        plan_cache.clear()
        genie.reset_stats()
        got = run()
        s = genie.stats()
        seen[on] = (got, {k: s.get(k, 0) for k in _KEYS})
    return seen


def _timed_passes_aside(seen):
    """Leave out the counters a training step's first runs set by timing (the passes' gate
    times the optimized tape against the plain one: which one a step ran, and so how many nodes
    ran and values were freed, follows the machine's load on either path)."""
    for k in ("nodes_executed", "values_freed"):
        del seen[True][1][k], seen[False][1][k]


def test_the_native_read_binds_and_counts_as_the_python_path(monkeypatch):
    def run():
        torch.manual_seed(0)
        w = torch.randn(6, 6, device=D)
        genie.materialize(w)
        vals, states = [], []
        for step in range(8):
            lr = 0.5 / (step + 1)  # a float parameter that changes every step
            mid = (w * lr).exp()  # held: bound with its value
            y = (mid @ w + torch.rand(6, 6, device=D)).sum()  # rng: a new (seed, offset) a step
            vals.append(y.item())
            states.append((mid._node.executed, mid._node.values[0] is not None,
                           y._node.executed, len(mid._node.leaves or ())))
            w.add_(mid, alpha=-0.01)  # a pending write, run by the next read
        return vals, states, w.cpu()

    seen = _both(monkeypatch, run)
    assert seen[True][1]["fused_hits"] >= 4
    assert seen[True][0][0] == seen[False][0][0]  # bit-equal
    assert seen[True][0][1] == seen[False][0][1]
    assert torch.equal(seen[True][0][2], seen[False][0][2])
    assert seen[True][1] == seen[False][1]


def test_a_training_step_counts_as_the_python_path(monkeypatch):
    seen = _both(monkeypatch, lambda: _adamw(D, steps=16)[:2])
    assert seen[True][1]["step_tapes"] == 16 and seen[True][1]["fused_hits"] >= 4
    assert seen[True][0][0] == seen[False][0][0]
    for p, q in zip(seen[True][0][1], seen[False][0][1], strict=True):
        assert torch.equal(p, q)
    _timed_passes_aside(seen)
    assert seen[True][1] == seen[False][1]


@pytest.mark.parametrize("read", [_growing, _uploading], ids=["other-shapes", "host-tensor"])
def test_hits_of_other_shapes_and_host_tensors(monkeypatch, read):
    def run():
        w = torch.ones(4, device=D)
        genie.materialize(w)
        return [read(step, w).item() for step in range(8)]

    seen = _both(monkeypatch, run)
    assert seen[True][1]["fused_hits"] >= 4
    assert seen[True][0] == seen[False][0]
    assert seen[True][1] == seen[False][1]


@pytest.mark.kernel_error  # an out-of-range index only the data shows, on the device
def test_a_kernel_failing_in_a_native_read_raises_as_the_python_path(monkeypatch):
    """A kernel that fails during a read the native call runs: the same error, raised from
    genie's materialization (not from a backend), the op before it bound, the rest pending."""
    seen = {}
    for on in (False, True):
        monkeypatch.setattr(config, "native_read", on)
        plan_cache.clear()
        runs = []
        before = genie.stats().get("fused_hits", 0)
        e, a, y = _failing_reads(runs)
        fused = genie.stats().get("fused_hits", 0) - before
        frames = traceback.extract_tb(e.__traceback__)
        assert frames[-1].filename.endswith("executor.py")
        assert not any("/backends/" in f.filename for f in frames)
        assert a._node.executed and torch.equal(a._node.values[0], torch.arange(5.0) * 3)
        assert not y._node.executed and not y._node.leaves[0].node.executed
        torch.testing.assert_close(a.cpu(), torch.arange(5.0) * 3)
        with pytest.raises(IndexError):
            y.cpu()
        seen[on] = (type(e), str(e), e.op, e.index, type(e.__cause__), str(e.__cause__), fused)
    assert seen[True] == seen[False]
    assert seen[True][-1] >= 3  # the reads before the failing one ran fused


def test_memory_tracking_peaks_as_the_python_path(monkeypatch):
    from genie import memory

    monkeypatch.setattr(memory, "_tracking", [True])
    seen = _both(monkeypatch, _peaks)
    assert seen[True][1]["fused_hits"] >= 3
    assert_same_peaks(seen[True][0], seen[False][0])
    _timed_passes_aside(seen)
    assert seen[True][1] == seen[False][1]


@pytest.mark.parametrize("tracking", [False, True])
def test_a_native_read_frees_its_intermediates(monkeypatch, tracking):
    """As test_materialize's: an intermediate no tensor holds is freed by the read's bind, and
    the values are eager's, with memory tracking on or off."""
    from genie import memory

    monkeypatch.setattr(memory, "_tracking", [tracking])
    plan_cache.clear()
    probe = _PythonSteps(monkeypatch)
    x = torch.randn(4, device=D)
    genie.materialize(x)
    native = 0
    for _ in range(6):
        mid = (x + 1) * 2  # x + 1: an intermediate no tensor holds
        gone = weakref.ref(mid._node.leaves[0].node)
        z = mid.relu()
        before = probe.calls
        torch.testing.assert_close(z.cpu(), ((x.cpu() + 1) * 2).relu(), rtol=0, atol=0)
        native += probe.calls == before
        assert gone() is None and mid._node.executed and mid._node.values[0] is not None
    assert native >= 2


def test_the_profiler_takes_the_python_path(monkeypatch):
    plan_cache.clear()
    w = torch.ones(4, device=D)
    for step in range(6):
        (w * (step + 1.5)).sum().item()
    probe = _PythonSteps(monkeypatch)
    with torch.profiler.profile():
        got = (w * 7.5).sum().item()
    assert got == 30.0 and probe.calls >= 1


def test_reads_while_another_thread_records(monkeypatch):
    """Reads on the native path while another thread records and reads its own values: each
    thread's values are eager's (a step's pending effects are per thread)."""
    plan_cache.clear()
    stop = threading.Event()
    errors = []

    def other():
        try:
            v = torch.arange(16.0, device=D)
            k = 0
            while not stop.is_set():
                k += 1
                got = ((v + k) * 0.5).sum().item()
                if got != ((torch.arange(16.0) + k) * 0.5).sum().item():
                    errors.append((k, got))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    try:
        losses, params, _ = _adamw(D, steps=16)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    want_losses, want_params, _ = _adamw("cpu", steps=16)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    for p, q in zip(params, want_params, strict=True):
        torch.testing.assert_close(p, q)


# --- .item() on the steady path (csrc/read.cpp's item_steady) ----------------------------------

def _scalars(dev, dtype, probe=None, steps=8):
    """Steady ``.item()``, ``bool()``, ``int()`` and ``float()`` reads of ``dtype`` values on
    ``dev``: each number with its type. ``probe``: a dict whose ``"n"`` counts the Python
    path's reads; the number of them that each step's ``.item()`` and ``bool()`` (both of a
    pending value) took is appended to its ``"steps"``."""
    torch.manual_seed(0)
    w = (torch.rand(6) * 4).to(dtype).to(dev)
    if dev == D:
        genie.materialize(w)
    got = []
    for step in range(steps):
        s = (w * (step + 1)).sum() if dtype is not torch.bool else (w ^ (step % 2 == 0)).any()
        before = probe["n"] if probe else 0
        a, b = s.item(), bool(s.real != 3 if s.is_complex() else s != 3)
        if probe:
            probe["steps"].append(probe["n"] - before)
        for v in (a, b, int(s.real if s.is_complex() else s)):  # (int: of a value read above)
            got.append((type(v), v))
        if not s.is_complex():
            got.append((float, float(s)))
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64, torch.int32, torch.uint8, torch.bool,
                                   torch.complex64], ids=str)
def test_steady_item_reads_take_no_python_step_and_answer_as_eager(monkeypatch, dtype):
    """``.item()`` of a pending value: read natively from the record path once its plan is
    steady (no ``lazy_tensor._item_now``), the same numbers and types as eager and as the
    Python path (``GENIE_NATIVE_READ=0``), the same counters."""
    probes = {False: {"n": 0, "steps": []}, True: {"n": 0, "steps": []}}
    item_now = lazy_tensor._item_now

    def counted(x):
        probes[config.native_read]["n"] += 1
        return item_now(x)

    monkeypatch.setattr(lazy_tensor, "_item_now", counted)
    seen = _both(monkeypatch, lambda: _scalars(D, dtype, probes[config.native_read]))
    want = _scalars(str(real_device(0)), dtype)  # eager on the real device: the same kernels
    assert seen[True][0] == want and seen[False][0] == want
    assert seen[True][1] == seen[False][1]
    assert probes[False]["steps"] == [2] * 8  # the Python path: every read
    assert probes[False]["n"] == seen[False][1]["materializations.item"]
    # the first steps miss and build their plans (the Python path); the steady ones are native
    assert probes[True]["steps"][-3:] == [0, 0, 0], probes[True]


@pytest.mark.kernel_error  # an out-of-range index only the data shows, on the device
def test_a_failing_item_read_raises_as_the_python_path(monkeypatch):
    """A kernel that fails in a steady ``.item()`` read: the same error, raised from genie's
    materialization (executor.py), after the same reads."""
    seen = {}
    for on in (False, True):
        monkeypatch.setattr(config, "native_read", on)
        plan_cache.clear()
        genie.reset_stats()
        x = torch.arange(5.0, device=D)
        genie.materialize(x)
        got = []
        for k in range(8):
            i = torch.tensor([k], device=D)
            genie.materialize(i)
            try:
                got.append((x.index_select(0, i) * 2).sum().item())
            except Exception as e:  # noqa: BLE001 - compared between the paths below
                frames = traceback.extract_tb(e.__traceback__)
                assert frames[-1].filename.endswith("executor.py")
                seen[on] = (got, type(e), str(e), type(e.__cause__),
                            genie.stats().get("materializations.item"))
                break
    assert seen[True] == seen[False]
    assert seen[True][0] == [0.0, 2.0, 4.0, 6.0, 8.0] and seen[True][-1] == 6


def test_item_reads_under_the_profiler_or_the_python_record_path_take_the_python_path(
        monkeypatch):
    calls = []
    item_now = lazy_tensor._item_now
    monkeypatch.setattr(lazy_tensor, "_item_now", lambda x: calls.append(1) or item_now(x))
    plan_cache.clear()
    w = torch.ones(4, device=D)
    for step in range(6):
        (w * (step + 1.5)).sum().item()
    calls.clear()
    assert (w * 2.5).sum().item() == 10.0 and calls == []  # steady: native
    with torch.profiler.profile():
        assert (w * 3.5).sum().item() == 14.0
    assert len(calls) == 1
    monkeypatch.setattr(config, "native_record", False)  # GENIE_NATIVE_RECORD=0
    assert (w * 4.5).sum().item() == 18.0
    assert len(calls) == 2


def _downloads(dev, probe=None, steps=8):
    """Steady ``.cpu()``, ``.to("cpu", dtype)`` and ``.tolist()`` reads on ``dev``, a conjugate
    and a negative view's among them, each then written to (a download is the host's own
    copy): what they held. ``probe`` as :func:`_scalars`' (``lazy_tensor._transfer``'s
    calls, per step)."""
    torch.manual_seed(0)
    w = torch.randn(3, 4).to(dev)
    z = torch.randn(3, dtype=torch.complex64).to(dev)
    if dev == D:
        genie.materialize(w, z)
    got = []
    for step in range(steps):
        before = probe["n"] if probe else 0
        a = (w * (step + 1)).relu().cpu()
        b = (w + step).t().to("cpu", torch.float64)
        c = (z * (step + 1)).conj().cpu()
        d = (z + step).imag.neg().cpu()
        e = (w - step).sum(0).tolist()
        if probe:
            probe["steps"].append(probe["n"] - before)
        for t in (a, b, c, d):
            got.append((t.device.type, t.dtype, t.shape, t.stride(), t.is_conj(), t.clone()))
            t.zero_()  # the host's own copy: the device value keeps its own
        got.append(e)
    got.append(w.cpu())
    return got


def test_steady_downloads_take_no_python_step_and_answer_as_eager(monkeypatch):
    """``.cpu()`` of a pending value: read natively from the record path once its plan is
    steady (no ``lazy_tensor._transfer``), the same tensors as eager and as the Python path,
    the same counters."""
    probes = {False: {"n": 0, "steps": []}, True: {"n": 0, "steps": []}}
    transfer = lazy_tensor._transfer

    def counted(*a):
        probes[config.native_read]["n"] += 1
        return transfer(*a)

    monkeypatch.setattr(lazy_tensor, "_transfer", counted)
    seen = _both(monkeypatch, lambda: _downloads(D, probes[config.native_read]))
    want = _downloads("cpu")

    def same(a, b, bits=True):  # (eager's .cpu() of a CPU tensor is the tensor: its conj bit)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            if isinstance(x, tuple):
                assert x[:4] == y[:4] and torch.equal(x[5], y[5]), (x, y)
                assert x[4] == y[4] or not bits
            elif isinstance(x, torch.Tensor):
                assert torch.equal(x, y)
            else:
                assert x == y

    same(seen[True][0], want, bits=False)
    same(seen[False][0], want, bits=False)
    same(seen[True][0], seen[False][0])
    assert seen[True][1] == seen[False][1]
    assert seen[True][1]["materializations.cpu"] == 8 * 5 + 1
    assert probes[False]["steps"] == [5] * 8  # the Python path: every download
    # the first steps miss and build their plans (the Python path); the steady ones are native
    assert probes[True]["steps"][-3:] == [0, 0, 0], probes[True]
