"""Native replay (genie.backends.native_replay, csrc/replay.cpp) against eager and the interpreter.

The whole unit suite also passes with ``GENIE_NATIVE_REPLAY=always`` (every tape compiled and run
natively, misses included) and with ``GENIE_NATIVE_REPLAY=0``; these tests pin the cases where a
native program could differ: per-step parameters (floats that change, host uploads, random ops,
shapes of a shape-generic plan), multi-output ops, keyword arguments, in-place views and writes,
MetaArg factories, tensor lists (``cat``, ``index``), frees, and errors naming the op with the
exception eager raises. Each test checks that native replay really ran (``native_replays``).
"""

from __future__ import annotations

import pytest
import torch

import genie
from genie import plan_cache
from genie.backends import backend_order, native_replay, set_backends
from genie.config import config
from genie.device import real_device
from genie.errors import ExecutionError

D = "remote_accelerator"
# Eager, the oracle, runs on the real device genie runs on (CUDA where present): the same kernels,
# so bit-equal values are expected there too.
EAGER = str(real_device(0))


@pytest.fixture(autouse=True)
def _eager_backend():
    saved, mode = backend_order(), config.native_replay
    set_backends(["eager"])
    yield
    set_backends(saved)
    config.native_replay = mode


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _step_matches_eager(w: torch.Tensor, w_cpu: torch.Tensor, step: int) -> None:
    """One ``_step`` on the device (this step's float and host tensor) equals eager's."""
    lr, host = 0.1 / (step + 1), torch.randn(3, 3)
    want = [t.cpu() for t in _step(w_cpu.to(EAGER), lr, host, EAGER)]
    got = [t.cpu() for t in genie.materialize(*_step(w, lr, host, D))]
    for a, b in zip(got, want, strict=True):
        _same(a, b)


def _step(w: torch.Tensor, lr: float, host: torch.Tensor, dev: str) -> list[torch.Tensor]:
    """One program with every kind of per-step parameter and argument tree."""
    x = host.to(dev)  # a host upload: a parameter
    y = (w * lr + x).t_()  # a float that changes; an in-place view
    v, i = y.max(dim=0, keepdim=True)  # two outputs, keyword arguments
    z = torch.zeros_like(y) + torch.cat([v, v * 2], dim=0).sum(0)  # MetaArg; a list argument
    u = y.clone()
    u.add_(1.5).mul_(x)  # in-place writes
    o = torch.empty(3, 3, device=dev)
    torch.mul(u, 2, out=o)  # an out= keyword
    g = y[torch.tensor([2, 0], device=dev)] + y[:, torch.tensor([1, 1], device=dev)].t()
    torch.manual_seed(7)
    r = torch.rand(3, 3, device=dev) * 0  # a random op (values zeroed: the seed scheme is genie's)
    return [z + r, i, torch.nn.functional.softmax(y, -1), o, g, y.contiguous().T]


@pytest.mark.parametrize("mode", ["1", "always"])
def test_native_replay_equals_eager(mode):
    config.native_replay = mode
    w_cpu = torch.randn(3, 3)
    w = w_cpu.to(D)
    genie.materialize(w)
    plan_cache.clear()
    genie.reset_stats()
    for step in range(4):
        _step_matches_eager(w, w_cpu, step)
    s = genie.stats()
    assert s["plan_cache_hits"] >= 3
    assert s["native_replays"] >= (4 if mode == "always" else 3)  # really replayed natively
    assert s["native_replay_plans"] >= 1
    if mode == "always":  # native first: no tape left for generated code
        assert s.get("codegen_plans", 0) == 0


def test_native_program_is_memoized_on_the_plan():
    config.native_replay = "1"
    x = torch.randn(5, device=D)
    genie.materialize(x)
    plan_cache.clear()
    genie.reset_stats()
    for k in range(5):
        (x * (k + 0.5)).exp().sum().item()
    s = genie.stats()
    assert (s["native_replay_plans"], s["native_replays"]) == (1, 4)  # from the second use
    plan = plan_cache.cache().plans()[-1]
    assert isinstance(plan.artifacts["native"], native_replay.Program)


def test_frees_as_the_interpreter():
    x = torch.randn(1000, device=D)
    genie.materialize(x)
    freed = {}
    for mode in ("0", "always"):
        config.native_replay = mode
        genie.reset_stats()
        y = x
        for _ in range(30):
            y = (y * 1.01).cos()
        y.sum().item()
        freed[mode] = genie.stats()["values_freed"]
    assert freed["0"] == freed["always"] == 59
    assert genie.stats()["native_replays"] == 1


def test_random_op_replays_its_seed():
    config.native_replay = "0"
    torch.manual_seed(3)
    want = [(torch.rand(5, device=D) * 2 + torch.randn(5, device=D)).cpu() for _ in range(3)]
    config.native_replay = "always"
    genie.reset_stats()
    torch.manual_seed(3)
    got = [(torch.rand(5, device=D) * 2 + torch.randn(5, device=D)).cpu() for _ in range(3)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert genie.stats()["native_replays"] == 3
    # the generator's own state is untouched by a replayed random op, as in the interpreter
    torch.manual_seed(5)
    before = torch.get_rng_state()
    (torch.rand(2, device=D) + 1).cpu()
    assert torch.equal(torch.get_rng_state(), before)


def test_shape_generic_decode_loop_with_growing_length():
    """A decode-like loop: the KV cache grows by one row per step, so every step after the
    first two is a shape-generic hit (ints and MetaArgs read from the step's own tape)."""
    config.native_replay = "1"
    torch.manual_seed(0)
    wq, wk = torch.randn(8, 8), torch.randn(8, 8)
    k_cpu = torch.randn(4, 8)
    dq, dk, kd = wq.to(D), wk.to(D), k_cpu.to(D)
    wq, wk, k_cpu = wq.to(EAGER), wk.to(EAGER), k_cpu.to(EAGER)  # eager on the real device
    genie.materialize(dq, dk, kd)
    plan_cache.clear()
    genie.reset_stats()

    def step(k, wq, wk, x, dev):
        k = torch.cat([k, x @ wk], dim=0)
        att = torch.softmax((x @ wq) @ k.T * 0.125, dim=-1)
        n = k.shape[0]
        pos = torch.arange(n, device=dev, dtype=torch.float32).view(1, n)
        return k, (att @ k) + (att * pos).sum(-1, keepdim=True) + torch.ones_like(att).sum()

    for t in range(6):
        x = torch.randn(1, 8)
        k_cpu, want = step(k_cpu, wq, wk, x.to(EAGER), EAGER)
        kd, got = step(kd, dq, dk, x.to(D), D)
        got_k, got_o = genie.materialize(kd, got)
        _same(got_k.cpu(), k_cpu.cpu())
        torch.testing.assert_close(got_o.cpu(), want.cpu())
    s = genie.stats()
    assert s.get("plan_cache_generic_hits", 0) >= 3
    assert s["native_replays"] >= 3
    assert any("native_generic" in p.artifacts for p in plan_cache.cache().plans())


def test_a_hit_replays_from_its_nodes_without_building_its_instructions(monkeypatch):
    """A plan-cache hit's instructions are built only when read (``Tape.instrs``): a native
    replay reads the step's floats, host tensors, shapes and ``(seed, offset)`` from its nodes
    (``Plan.replay_source``). Values as eager's (random ones as the interpreter's), with the
    instructions built once per plan (its program compiled from them), then never (without
    passes: an optimized plan's script reads the step's instructions)."""
    from genie import memory, passes

    monkeypatch.setattr(passes.pipeline, "_config", {**passes.pipeline._config, "names": ()})
    monkeypatch.setattr(memory, "_tracking", [False])  # (peaks read the built instructions)
    built = []
    step_instrs = plan_cache.Plan.step_instrs

    def counted(plan, *a):
        built.append(plan)
        return step_instrs(plan, *a)

    monkeypatch.setattr(plan_cache.Plan, "step_instrs", counted)
    w_cpu = torch.randn(3, 3)
    w = w_cpu.to(D)
    genie.materialize(w)

    def rand(step: int, dev: str) -> torch.Tensor:
        torch.manual_seed(step)  # a new (seed, offset) every step
        return torch.rand(3, 3, device=dev) + torch.randn(3, 3, device=dev)

    def grow(n: int, dev: str) -> torch.Tensor:  # new shapes every step: a generic hit
        x = torch.arange(n * 3, device=dev, dtype=torch.float32).view(n, 3)
        return torch.cat([x, x * 0.5], 0).sum(0) + torch.zeros(n, 1, device=dev).sum()

    config.native_replay = "0"
    randoms = [rand(step, D).cpu() for step in range(5)]  # (generated code reads instructions)
    config.native_replay = "1"
    built.clear()
    plan_cache.clear()
    genie.reset_stats()
    for step in range(5):
        _step_matches_eager(w, w_cpu, step)
        _same(rand(step, D).cpu(), randoms[step])
        _same(grow(step + 2, D).cpu(), grow(step + 2, EAGER).cpu())
    s = genie.stats()
    assert s["plan_cache_hits"] >= 12 and s["plan_cache_generic_hits"] >= 3
    assert s["native_replays"] >= 12
    assert len(built) == len(set(map(id, built))) == 3  # once per plan: its program's compile


def test_a_hits_instructions_read_after_its_run_raise_saying_when_to_read_them(monkeypatch):
    """A hit's instructions are built from its nodes, which its run releases: a wrapper of
    ``pipeline.run`` that reads them after the run got ``'NoneType' object has no attribute
    'op'``; now a clear error, and reading them before the run ends gives eager's program."""
    from genie import executor, memory, passes
    from genie.planner import Tape

    monkeypatch.setattr(passes.pipeline, "_config", {**passes.pipeline._config, "names": ()})
    monkeypatch.setattr(memory, "_tracking", [False])
    monkeypatch.setattr(executor, "_fuse", [False])  # the general path (a fused hit: no tape)
    tapes: list[Tape] = []
    run = passes.pipeline.run

    def grab(tape, device):
        tapes.append(tape)
        return run(tape, device)

    monkeypatch.setattr(passes.pipeline, "run", grab)
    plan_cache.clear()
    for n in range(2, 6):  # new shapes every step: generic hits rebuild their instructions
        x = torch.arange(n * 3, device=D, dtype=torch.float32).view(n, 3)
        (x * 0.5).sum(0).cpu()
    late = [t for t in tapes if t._stale is not None]
    assert late, "no hit left its instructions unbuilt"
    with pytest.raises(RuntimeError, match="read Tape.instrs before the run ends"):
        _ = late[-1].instrs


@pytest.mark.kernel_error
@pytest.mark.parametrize("mode", ["1", "always"])
def test_error_names_the_op_with_eagers_exception(mode):
    config.native_replay = mode
    a = torch.randn(3, 3, device=D)
    genie.materialize(a)
    for bad in (False, False, True):  # the bad step is a native replay in both modes
        idx = torch.tensor([0, 5 if bad else 1])
        if not bad:
            (a.index_select(0, idx.to(D)) + 1).cpu()
            continue
        with pytest.raises(ExecutionError,
                           match="index_select.*failed on the device: IndexError") as e:
            (a.index_select(0, idx.to(D)) + 1).cpu()
        assert e.value.index is not None  # the failing instruction's position in its tape
        assert type(e.value.__cause__) is IndexError
    assert genie.stats()["native_replays"] >= 1
    with pytest.raises(IndexError):  # eager raises the same kind of error
        torch.randn(3, 3).index_select(0, torch.tensor([0, 5]))


def _failing_gather_after_a_write() -> list[float]:
    a = torch.zeros(3, device=D)
    idx = torch.tensor([7]).to(D)
    genie.materialize(a, idx)
    genie.reset_stats()
    a.add_(1)  # an in-place write before the failing op, in the same tape
    with pytest.raises(ExecutionError, match="gather.*RuntimeError") as e:
        a.gather(0, idx).cpu()
    assert type(e.value.__cause__) is RuntimeError
    return a.cpu().tolist()


@pytest.mark.kernel_error
def test_runtime_error_keeps_its_type_and_state_after_it_is_the_interpreters():
    with pytest.raises(RuntimeError):  # what eager raises
        torch.zeros(3).gather(0, torch.tensor([7]))
    config.native_replay = "0"
    want = _failing_gather_after_a_write()
    config.native_replay = "always"
    got = _failing_gather_after_a_write()
    s = genie.stats()
    assert s["native_replay_plans"] >= 1  # the failing tape was compiled and run natively
    assert got == want


def test_ops_that_cannot_compile_fall_back_per_plan(monkeypatch):
    config.native_replay = "1"

    def refuse(tape, generic=False):
        raise TypeError("not here")

    monkeypatch.setattr(native_replay, "compile_tape", refuse)
    x = torch.randn(4, device=D)
    genie.materialize(x)
    plan_cache.clear()
    genie.reset_stats()
    for _ in range(3):
        torch.testing.assert_close((x * 2).cpu(), x.cpu() * 2)
    assert genie.stats().get("native_replays", 0) == 0
    assert plan_cache.cache().plans()[-1].artifacts["native"] is False  # decided once


def test_parameters_come_back_to_the_plans_values():
    """A program skips the patches of floats and ints its template holds when a step runs the
    very instruction it was compiled from: steps whose floats and shapes go back and forth
    between the plan's and others' (the program compiled from either) give eager's values."""
    config.native_replay = "1"
    torch.manual_seed(0)
    w_cpu = torch.randn(8, 8)
    w = w_cpu.to(D)
    genie.materialize(w)
    plan_cache.clear()
    genie.reset_stats()

    def step(w, n, lr, dev):
        x = torch.arange(n * 8, device=dev, dtype=torch.float32).view(n, 8)
        return ((x @ w) * lr).softmax(-1)[: n - 1].sum(0) + lr

    for n, lr in [(4, 0.5), (4, 0.25), (4, 0.5), (5, 0.5), (4, 0.25), (6, 0.5), (5, 0.25),
                  (4, 0.5), (6, 0.125)]:
        torch.testing.assert_close(step(w, n, lr, D).cpu(),
                                   step(w_cpu.to(EAGER), n, lr, EAGER).cpu(), rtol=0, atol=0)
    s = genie.stats()
    assert s["native_replays"] >= 6 and s.get("plan_cache_generic_hits", 0) >= 3


@pytest.mark.parametrize("mode", ["1", "always"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_float_constants_of_binary_ops_replay_as_eager(mode, dtype):
    """``x * 0.1`` and friends: the native program casts a float32 operand's wrapped-number
    scalar once (csrc/replay.cpp, cast_scalar) instead of TensorIterator casting it per call;
    the values, dtypes and out-of-range constants (inf, as the cast gives) are eager's."""
    config.native_replay = mode

    def f(x: torch.Tensor, c: float) -> list[torch.Tensor]:
        return [x * c, x + c, x - c, x / c, torch.add(x, c, alpha=3), 2.5 * x, x * 1e300,
                x + float("nan"), (x * c) * c]

    host = (torch.randn(5) * 10).to(dtype)
    x = host.to(D)
    genie.materialize(x)
    plan_cache.clear()
    genie.reset_stats()
    for step in range(4):
        c = 0.1 / (step + 1) if step < 3 else 1 / 3
        want = [t.cpu() for t in f(host.to(EAGER), c)]
        got = [t.cpu() for t in genie.materialize(*f(x, c))]
        for a, b in zip(got, want, strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape)
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert genie.stats()["native_replays"] >= 3
