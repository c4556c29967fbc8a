"""``LazyTensor.backward`` runs the autograd engine on the calling thread
(``GENIE_CALLER_BACKWARD``, docs/engine.md): the same values, gradients and recording context as
on the engine's own device thread (the reference, ``config.caller_backward = False``)."""

import contextlib
import threading

import pytest
import torch

import genie
from genie.config import config
from genie.device import real_device

D = "remote_accelerator"


@pytest.fixture(params=[True, False], ids=["caller", "engine_thread"])
def caller(request):
    prev = config.caller_backward
    config.caller_backward = request.param
    yield request.param
    config.caller_backward = prev


def _step(dev: str, seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    m.to(dev)
    x = torch.randn(4, 6).to(dev)
    threads: list[bool] = []
    y = m(x)
    main = threading.main_thread().ident
    y.register_hook(lambda g: threads.append(threading.get_ident() == main))
    with genie.phase("train") if dev == D else contextlib.nullcontext():
        y.square().mean().backward()
    return m, threads


def test_gradients_equal_eager_and_hooks_run_where_the_setting_says(caller):
    exact = real_device(0).type == "cpu"
    ref, _ = _step("cpu")
    got, threads = _step(D)
    for p, q in zip(got.parameters(), ref.parameters(), strict=True):
        if exact:
            assert torch.equal(p.grad.cpu(), q.grad)
        else:  # CUDA kernels against eager's CPU ones (eager CUDA backward cannot run beside
            # genie in one process: pytorch#161129)
            torch.testing.assert_close(p.grad.cpu(), q.grad)
    assert threads == [caller]  # eager CPU runs hooks on the calling thread too


def test_backward_ops_are_labelled_as_on_the_engine_thread(caller):
    got, _ = _step(D)
    for p in got.parameters():
        ctx = p.grad._node.ctx
        assert ctx.region == "backward" and ctx.path is None


def test_under_a_dispatch_mode_the_engine_keeps_its_thread():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ident(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            return func(*args, **(kwargs or {}))

    w = torch.ones(3, device=D, requires_grad=True)
    y = (w * 2).sum()
    seen: list[bool] = []
    y.grad_fn.register_prehook(
        lambda g: seen.append(threading.get_ident() == threading.main_thread().ident))
    with Ident():
        y.backward()
    assert seen == [False] and w.grad.cpu().tolist() == [2.0, 2.0, 2.0]


@pytest.mark.skipif(real_device(0).type == "cuda" and torch.cuda.device_count() < 2,
                    reason="remote_accelerator:1 maps to cuda:1: needs two GPUs")
def test_the_current_device_is_the_one_the_engine_thread_would_set(caller):
    """On the calling thread too (the engine's stream guard per node sets the node's device)."""
    from genie import _C

    seen: list[int] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x * 2

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            seen.append(torch.remote_accelerator.current_device())
            return g * 2

    count, current = _C._device_count(), _C._current_device()
    if not caller:
        # The engine sizes its per-device threads at the process's first non-CPU backward, with
        # the device count of that moment (one, in this process): a fresh process with two
        # devices sizes them for both
        _engine_thread_device_probe()
        return
    _C._set_device_count(max(count, 2))
    try:
        x = torch.ones(3, device=f"{D}:1", requires_grad=True)
        Probe.apply(x).sum().backward()
        assert seen == [1] and x.grad.device == torch.device(D, 1)
        assert torch.remote_accelerator.current_device() == current
        assert x.grad.cpu().tolist() == [2.0, 2.0, 2.0]
    finally:
        _C._set_device_count(count)
        _C._set_device(current)


def _engine_thread_device_probe() -> None:
    """The engine-thread variant of the test above, in a fresh process with two devices."""
    import os
    import subprocess
    import sys

    code = """
import torch, genie
class Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2
    @staticmethod
    def backward(ctx, g):
        seen.append(torch.remote_accelerator.current_device())
        return g * 2
seen = []
x = torch.ones(3, device="remote_accelerator:1", requires_grad=True)
Probe.apply(x).sum().backward()
assert seen == [1] and x.grad.device == torch.device("remote_accelerator", 1), seen
assert torch.remote_accelerator.current_device() == 0
assert x.grad.cpu().tolist() == [2.0, 2.0, 2.0]
print("ok")
"""
    env = {**os.environ, "GENIE_DEVICE_COUNT": "2", "GENIE_CALLER_BACKWARD": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
