"""Materialization: triggers, exactly the dependency chain, once per node, identity kept."""

import io
import os

import pytest
import torch

import genie
from genie.device import real_device

D = "remote_accelerator"
# A tape that fails through a server (GENIE_SERVER: the remote backend) does not report how far it
# got, so the writes before the failure run again there (docs/semantics.md, "Errors").
in_process = pytest.mark.skipif(bool(os.environ.get("GENIE_SERVER")),
                                reason="a failing tape's progress is reported in process only")


def test_issue_example_runs_only_the_needed_chain():
    torch.manual_seed(0)
    x = torch.randn(64, 64, device=D)
    w = torch.nn.Linear(64, 32).to(D)
    y = torch.relu(w(x)) @ torch.ones(32, 8, device=D)
    z = (x - 1).sum()
    assert y.shape == (64, 8)
    genie.reset_stats()
    out = y.cpu()
    assert not z._node.executed  # the unused branch never ran
    assert x._node.executed
    xe = x.cpu()
    expected = torch.relu(xe @ w.weight.cpu().t() + w.bias.cpu()) @ torch.ones(32, 8)
    torch.testing.assert_close(out, expected)


def test_each_node_runs_at_most_once():
    x = torch.randn(16, device=D)
    y = x.exp()
    a = y + 1
    b = y * 2
    genie.reset_stats()
    a.cpu()
    n1 = genie.stats()["nodes_executed"]
    b.cpu()  # y and x are materialized: only the mul runs
    assert genie.stats()["nodes_executed"] - n1 == 1
    y.cpu()
    assert genie.stats()["nodes_executed"] - n1 == 1  # nothing new to run


def test_multi_output_materialize_one_execution():
    x = torch.randn(8, device=D)
    a, b = genie.materialize(x.sin(), x.cos())
    assert genie.stats()["materializations"] == 1
    xc = x.cpu()
    # materialize returns values on the real device (CUDA where present)
    torch.testing.assert_close(a.cpu(), xc.sin())
    torch.testing.assert_close(b.cpu(), xc.cos())


def test_triggers():
    x = torch.arange(6.0, device=D).reshape(2, 3)
    assert x.sum().item() == 15.0
    assert x.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert x.numpy().shape == (2, 3)
    assert bool(x.sum() > 1) and int(x[1, 1]) == 4 and float(x[0, 1]) == 1.0
    assert torch.equal(x, torch.arange(6.0).reshape(2, 3).to(D))
    assert x.to("cpu").device.type == "cpu"
    text = repr(x)
    assert "device='remote_accelerator:0'" in text and "5." in text
    buf = io.BytesIO()
    torch.save(x, buf)
    buf.seek(0)
    y = torch.load(buf)
    assert y.device.type == D
    torch.testing.assert_close(y.cpu(), x.cpu())
    s = genie.stats()
    for trig in ("item", "cpu", "repr"):
        assert s[f"materializations.{trig}"] >= 1


def test_item_of_math_bit_views_and_under_a_mode_equals_eager():
    """``.item()`` reads the real value directly unless it carries a math bit or a dispatch mode
    is active (lazy_tensor._run_now): every case gives eager's value."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.tensor([1.5, -2.0])
    z = torch.tensor([1.0 + 2.0j, 3.0 - 1.0j])
    cases = [lambda t: t[1], lambda t: torch._neg_view(t)[0], lambda t: torch._neg_view(t).sum()]
    for case in cases:
        assert case(x.to(D)).item() == case(x).item()
    assert z.to(D).conj()[0].item() == z.conj()[0].item()
    assert torch._neg_view(z.to(D).conj())[1].item() == torch._neg_view(z.conj())[1].item()
    lazy = (x.to(D) * 2).sum()
    with Seen() as mode:
        got = lazy.item()
    assert got == (x * 2).sum().item()
    assert "aten._local_scalar_dense.default" in mode.ops


def test_identity_is_kept_after_materialization():
    x = torch.ones(3, device=D)
    alias = x
    x.cpu()
    assert alias is x and isinstance(x, genie.LazyTensor)
    assert x._node.executed
    torch.testing.assert_close((alias + 1).cpu(), torch.full((3,), 2.0))


def test_unreferenced_intermediates_are_freed():
    from genie.backends.remote import clients

    if clients():
        pytest.skip("counts frees of the in-process executor; a Genie server frees on its side")
    x = torch.randn(32, 32, device=D)
    t = x
    for _ in range(10):
        t = t * 1.5 + 1
    t.cpu()
    # 20 intermediates nobody holds: their values are freed after their last use
    assert genie.stats()["values_freed"] >= 19
    assert t._node.values[0] is not None  # the held value stays on the device


def test_released_graph_after_materialization():
    x = torch.randn(4, device=D)
    y = (x + 1) * 2
    y.cpu()
    assert y._node.leaves is None  # executed nodes drop their inputs: the graph does not grow


@pytest.mark.parametrize("native_bind", [True, False])
def test_a_run_leaves_no_lists_on_what_it_ran(monkeypatch, native_bind: bool) -> None:
    """A node that ran keeps a list of values only if the run kept one of them: an intermediate
    gets a tuple of Nones, every node that ran no consumer to count, and a storage never
    written has no pending-write list (genie.graph: fewer objects per node to make and free)."""
    from genie.config import config

    monkeypatch.setattr(config, "native_bind", native_bind)
    x = torch.randn(4, device=D)
    for _ in range(3):  # the second time a plan-cache hit, bound by the plan's slots
        mid = x + 1
        z = (mid * 2).relu()  # mid * 2: an intermediate no tensor holds
        y = z._node.leaves[0].node
        genie.materialize(z, mid)
        assert y.executed and y.storages[0].pending_writes == ()
        assert y.values == (None,) and y.n_consumers == 0 and mid._node.n_consumers == 0
        assert type(z._node.values) is list and type(mid._node.values) is list
        torch.testing.assert_close(z.cpu(), ((x.cpu() + 1) * 2).relu())
    mid.add_(1)  # the first write gives the storage its list
    pw = mid._node.storages[0].pending_writes
    assert type(pw) is list and [n.op for n in pw] == [torch.ops.aten.add_.Tensor]
    torch.testing.assert_close(mid.cpu(), x.cpu() + 2)


@pytest.mark.parametrize("fuse", [False, True], ids=["general", "fused"])
@pytest.mark.parametrize("tracking", [False, True])
def test_a_run_frees_its_intermediates_while_binding(monkeypatch, tracking: bool,
                                                     fuse: bool) -> None:
    """The native bind takes the tape's references to its nodes as it binds them (last first),
    so an intermediate no tensor holds is freed before the executor drops the tape (on a long
    tape, freeing them afterwards cost a cache miss per object); the tape's node list is kept
    whole where it is read after the bind (a peak being measured on the general path), and
    released right after that read (tests/unit/test_gc.py: not left to the tape's drop); a fused
    hit knows its run's high-water mark before it runs, and releases them as it binds."""
    import weakref

    from genie import executor, memory
    from genie.config import config

    monkeypatch.setattr(config, "native_bind", True)
    # the Python path's calls of _bind_nodes and _hit_run are observed (csrc/read.cpp calls the
    # same functions natively: test_native_read's frees test)
    monkeypatch.setattr(config, "native_read", False)
    monkeypatch.setattr(memory, "_tracking", [tracking])
    server = bool(os.environ.get("GENIE_SERVER"))
    if fuse and (server or not executor._fuse[0]):
        pytest.skip("the fused hit path runs in process only (GENIE_SERVER is set)" if server
                    else "the settings turn the fused hit path off")
    monkeypatch.setattr(executor, "_fuse", [fuse])
    bound = []  # the node lists bound natively (a tape's, or a fused hit's found nodes)
    fused = []  # whether each was a fused hit's
    bind, hit = executor._bind_nodes, executor._hit_run
    monkeypatch.setattr(executor, "_bind_nodes", lambda nodes, *a: bound.append(nodes) or
                        fused.append(False) or bind(nodes, *a))
    monkeypatch.setattr(executor, "_hit_run", lambda *a: bound.append(a[5]) or
                        fused.append(True) or hit(*a))
    whole = []  # whether the peak pass found the tape's nodes all there
    high_water = memory.tape_high_water
    monkeypatch.setattr(memory, "tape_high_water", lambda tape: whole.append(
        all(n is not None for n in tape.nodes)) or high_water(tape))
    x = torch.randn(4, device=D)
    genie.materialize(x)
    natively = 0
    for _ in range(4):  # from the third time a column-match hit, bound by the plan's slots
        mid = (x + 1) * 2  # x + 1: an intermediate no tensor holds
        gone = weakref.ref(mid._node.leaves[0].node)
        z = mid.relu()
        was = len(bound)
        torch.testing.assert_close(z.cpu(), ((x.cpu() + 1) * 2).relu())
        if len(bound) == was:  # slots built: the Python loop binds
            continue
        natively += 1
        # the peak pass read them after the bind (on the CPU: CUDA's peaks are its allocator's)
        if tracking and not fused[-1] and not server and real_device(0).type == "cpu":
            assert whole and whole[-1]
            whole.clear()
        assert bound[-1] == [None] * len(bound[-1]) and gone() is None
    assert natively >= 2, "no run was bound natively: the test no longer covers it"
    assert any(fused) == fuse
    assert z._node.executed and z._node.values[0] is not None and mid._node.executed
    if tracking:
        assert memory.max_memory_allocated(D) > 0


def test_in_place_and_views_follow_eager():
    def prog(d):
        a = torch.arange(8.0, device=d)
        v = a[2:6]
        b = a * 2          # read before the write
        v.mul_(10)         # write through a view
        a[0] = -1          # write to the base
        c = v + 0          # read after
        return a, b, v, c

    e = prog("cpu")
    g = prog(D)
    for gi, ei in zip(g[::-1], e[::-1]):  # materialize in reverse order on purpose
        torch.testing.assert_close(gi.cpu(), ei)


def test_data_dependent_ops_run_now_and_are_counted():
    x = torch.tensor([0.0, 2.0, 0.0, 3.0], device=D)
    nz = torch.nonzero(x)
    assert nz.shape == (2, 1)
    torch.testing.assert_close(nz.cpu(), torch.tensor([[1], [3]]))
    assert x[x > 0].shape == (2,)
    assert genie.stats()["forced_materializations"] >= 2


def test_autograd_backward_equals_eager():
    w = torch.randn(5, 3, requires_grad=True)
    x = torch.randn(4, 5)
    ((x @ w).tanh().sum()).backward()
    wl = w.detach().to(D).requires_grad_()
    ((x.to(D) @ wl).tanh().sum()).backward()
    torch.testing.assert_close(wl.grad.cpu(), w.grad)


def test_model_forward_equals_eager():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.GELU(), torch.nn.LayerNorm(20),
                            torch.nn.Linear(20, 5), torch.nn.Softmax(-1))
    x = torch.randn(7, 10)
    expected = m(x)
    got = m.to(D)(x.to(D))
    torch.testing.assert_close(got.cpu(), expected)


def test_in_place_metadata_ops_follow_eager():
    def prog(d):
        a = torch.arange(6.0, device=d).reshape(2, 3)
        b = a.view(2, 3)
        a.t_()
        a.unsqueeze_(0)
        a.mul_(2)          # a write through the re-viewed tensor is seen by b
        return a, b, b + 1

    for g, e in zip(prog(D), prog("cpu")):
        assert (g.shape, g.stride()) == (e.shape, e.stride())
        torch.testing.assert_close(g.cpu(), e)
    x = torch.ones(2, device=D)
    x.resize_(4)  # supported since issue 12 (tests/unit/test_everyday.py): the storage grows
    assert x.shape == (4,) and x[:2].cpu().tolist() == [1.0, 1.0]
    y = torch.ones(3, device=D)
    x.set_(y)  # x becomes an alias of y, as eager's set_ (tests/unit/test_first_use.py)
    y.add_(1)
    assert x.shape == (3,) and x.cpu().tolist() == [2.0, 2.0, 2.0] and x.is_set_to(y)



@pytest.mark.kernel_error
@in_process
def test_an_in_place_write_before_a_failing_op_runs_once():
    want = torch.zeros(3)
    want.add_(1)
    with pytest.raises(IndexError):
        want[torch.tensor([5])]  # eager: add_ ran once, the index raises at its line
    a = torch.zeros(3).to("remote_accelerator")
    idx = torch.tensor([5]).to("remote_accelerator")
    genie.materialize(a, idx)  # idx's values are the device's now: its check is the kernel's
    a.add_(1)
    b = a[idx]
    with pytest.raises(Exception, match="out of bounds"):
        b.cpu()
    assert a.cpu().tolist() == want.tolist()


def _two_writes_then_a_failing_index(d: str, bad: int, dup: bool = False) -> list[list[float]]:
    """Two in-place writes and a value computed from them, then an index that may be out of
    range; returns what the program reads afterwards (eager raises at the index's line, Genie
    at the read of its result: both after the writes and the sum ran, once). ``dup``: the sum
    is spelled twice (a plan genie.passes' CSE optimizes)."""
    a = torch.zeros(3, device=d)
    b = torch.ones(3, device=d)
    idx = torch.tensor([bad]).to(d)
    if d == D:
        genie.materialize(a, b, idx)
    a.add_(1)
    b.mul_(3)
    c = a + b  # computed before the failing op, read after it
    if dup:
        c = c + (a + b)
    try:
        c[idx].cpu()
    except IndexError as e:
        assert bad >= 3 and (d == "cpu" or isinstance(e, genie.ExecutionError))
    else:
        assert bad < 3
    return [c.cpu().tolist(), a.cpu().tolist(), b.cpu().tolist()]


@pytest.mark.kernel_error
@in_process
@pytest.mark.parametrize("native,gen", [("1", "repeat"), ("always", "repeat"), ("0", "always"),
                                        ("0", "0")])
def test_writes_and_values_before_a_failing_op_are_bound_on_every_path(native, gen):
    """The nodes whose instructions ran before the failing one are bound (run once, their values
    kept), whichever way the tape ran: interpreted, generated code or native replay, on a plan's
    first use and on its repeats."""
    from genie import plan_cache
    from genie.backends import codegen
    from genie.config import config

    plan_cache.clear()  # the plans below start afresh (the counters check which path ran)
    saved = config.native_replay, codegen.mode()
    config.native_replay = native
    codegen.set_mode(gen)
    try:
        want = _two_writes_then_a_failing_index("cpu", 5)
        assert want == [[4.0] * 3, [1.0] * 3, [3.0] * 3]
        for _ in range(3):  # a plan's first use, then its repeats (replayed when the mode says)
            assert _two_writes_then_a_failing_index(D, 5) == want
        if native != "0":
            assert genie.stats().get("native_replay_plans", 0) >= 1
        elif gen != "0":
            assert genie.stats().get("codegen_plans", 0) >= 1
    finally:
        config.native_replay = saved[0]
        codegen.set_mode(saved[1])


@pytest.mark.kernel_error
@in_process
def test_a_failing_optimized_tape_binds_what_provably_ran():
    """A plan the passes optimized (once it ran well) that fails on a later step: the writes
    before the failure are not run again."""
    from genie import plan_cache

    plan_cache.clear()
    want = _two_writes_then_a_failing_index("cpu", 5, dup=True)
    for _ in range(8):  # valid steps: the passes verify, gate and settle
        assert _two_writes_then_a_failing_index(D, 1, dup=True) == \
            _two_writes_then_a_failing_index("cpu", 1, dup=True)
    assert _two_writes_then_a_failing_index(D, 5, dup=True) == want


@pytest.mark.kernel_error
def test_a_deferred_kernel_error_has_eagers_exception_type():
    """An error only the data reveals surfaces at materialization as an ExecutionError naming the
    op, and is also eager's exception class: ``except IndexError`` catches it as it catches
    eager's (the cause chained)."""
    from genie.errors import ExecutionError

    idx = torch.tensor([5])
    with pytest.raises(IndexError) as want:
        torch.zeros(3)[idx]
    a = torch.zeros(3).to(D)
    i = idx.to(D)
    genie.materialize(i)  # the device's values now (an index the host holds raises at once)
    b = a[i]
    with pytest.raises(IndexError) as got:
        b.cpu()
    assert isinstance(got.value, ExecutionError) and "aten.index.Tensor" in str(got.value)
    assert type(got.value.__cause__) is type(want.value)
    assert str(want.value) in str(got.value)
    # RuntimeError causes stay plain ExecutionErrors (already RuntimeErrors)
    from genie.errors import _with_cause_type
    assert _with_cause_type(RuntimeError("x")) is ExecutionError
    assert _with_cause_type(ValueError("x")) is _with_cause_type(ValueError("y"))
    # a server's reply names its cause's class: only the classes ATen raises are taken on
    assert _with_cause_type(StopIteration()) is ExecutionError
    assert _with_cause_type(KeyboardInterrupt()) is ExecutionError


def test_real_dispatch_reenables_the_math_bit_keys_and_restores_them() -> None:
    """Real ops run from inside ``__torch_dispatch__`` (where the math-bit keys are excluded)
    see those keys again; leaving restores the caller's state, also after an error."""
    from genie.executor import _MATH_BIT_KEYS, real_dispatch

    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Conjugate)):
        assert excluded(torch._C.DispatchKey.Conjugate)
        with real_dispatch():
            assert not any(excluded(k) for k in _MATH_BIT_KEYS)
        assert excluded(torch._C.DispatchKey.Conjugate)
        with pytest.raises(ValueError), real_dispatch():
            raise ValueError
        assert excluded(torch._C.DispatchKey.Conjugate)
    assert not excluded(torch._C.DispatchKey.Conjugate)
    # all three excluded (as inside __torch_dispatch__), and nested: each level restores its own
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Conjugate) | torch._C.DispatchKeySet(
        torch._C.DispatchKey.Negative) | torch._C.DispatchKeySet(torch._C.DispatchKey.ZeroTensor)
    with torch._C._ExcludeDispatchKeyGuard(keys):
        with real_dispatch():
            assert not any(excluded(k) for k in _MATH_BIT_KEYS)
            with torch._C._ExcludeDispatchKeyGuard(
                    torch._C.DispatchKeySet(torch._C.DispatchKey.Negative)):
                with real_dispatch():
                    assert not any(excluded(k) for k in _MATH_BIT_KEYS)
                assert excluded(torch._C.DispatchKey.Negative)
                assert not excluded(torch._C.DispatchKey.Conjugate)
            assert not any(excluded(k) for k in _MATH_BIT_KEYS)
        assert all(excluded(k) for k in _MATH_BIT_KEYS)
    assert not any(excluded(k) for k in _MATH_BIT_KEYS)


def test_disable_modes_pops_active_modes_and_is_free_without_them() -> None:
    """genie.meta.disable_modes: torch's _disable_current_modes where a TorchDispatchMode is
    active (the stack empty inside, restored after), a shared no-op context where none is."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from genie.meta import disable_modes

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            return func(*args, **(kwargs or {}))

    assert disable_modes() is disable_modes()  # nothing active: the shared no-op
    with Mode():
        assert torch._C._len_torch_dispatch_stack() == 1
        with disable_modes():
            assert torch._C._len_torch_dispatch_stack() == 0
        assert torch._C._len_torch_dispatch_stack() == 1
    assert torch._C._len_torch_dispatch_stack() == 0
    # a mode on torch's pre-dispatch stack (read through its slots: genie.modes._pre_slots)
    from torch._ops import (_len_torch_dispatch_stack_pre_dispatch, _pop_mode_from_pre_dispatch,
                            _set_mode_pre_dispatch)
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch._subclasses.schema_check_mode import SchemaCheckMode

    from genie import modes

    assert modes._pre_slots is not None  # this torch's slots are found (else the slow count)
    for mode in (SchemaCheckMode(), FunctionalTensorMode()):
        _set_mode_pre_dispatch(mode)
        try:
            assert _len_torch_dispatch_stack_pre_dispatch() == 1
            assert disable_modes() is not disable_modes()  # torch's: pops the stack
        finally:
            _pop_mode_from_pre_dispatch()
        assert _len_torch_dispatch_stack_pre_dispatch() == 0
        assert disable_modes() is disable_modes()
