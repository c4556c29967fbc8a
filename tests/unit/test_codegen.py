"""Replay as generated code (genie.backends.codegen) against eager and the interpreter.

The whole unit suite also passes with ``GENIE_CODEGEN=always`` (every tape generated, misses
included); these tests pin the cases where generated code could differ: per-step parameters
(floats that change, host uploads, random ops), multi-output ops, keyword arguments, in-place
views, frees, and errors naming the op.
"""

from __future__ import annotations

import pytest
import torch

import genie
from genie.backends import backend_order, codegen, set_backends
from genie.config import config
from genie.errors import ExecutionError

D = "remote_accelerator"


@pytest.fixture(autouse=True)
def _eager_backend():
    saved, mode, native = backend_order(), codegen.mode(), config.native_replay
    set_backends(["eager"])
    config.native_replay = "0"  # generated code is what these tests test (native runs first)
    yield
    set_backends(saved)
    codegen.set_mode(mode)
    config.native_replay = native


def _step(w: torch.Tensor, lr: float, host: torch.Tensor, dev: str) -> list[torch.Tensor]:
    """One program with every kind of per-step parameter and argument tree."""
    x = host.to(dev)  # a host upload: a parameter
    y = (w * lr + x).t_()  # a float that changes; an in-place view
    v, i = y.max(dim=0, keepdim=True)  # two outputs, keyword arguments
    z = torch.zeros_like(y) + torch.cat([v, v * 2], dim=0).sum(0)  # MetaArg; a list argument
    torch.manual_seed(7)
    r = torch.rand(3, 3, device=dev) * 0  # a random op (values zeroed: the seed scheme is genie's)
    return [z + r, i, torch.nn.functional.softmax(y, -1)]


@pytest.mark.parametrize("mode", ["repeat", "always"])
def test_generated_replay_equals_eager(mode):
    codegen.set_mode(mode)
    w_cpu = torch.randn(3, 3)
    w = w_cpu.to(D)
    genie.materialize(w)
    genie.plan_cache.clear()
    genie.reset_stats()
    for step in range(4):
        lr, host = 0.1 / (step + 1), torch.randn(3, 3)
        want = _step(w_cpu, lr, host, "cpu")
        got = [t.cpu() for t in genie.materialize(*_step(w, lr, host, D))]
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b)
    s = genie.stats()
    assert s["plan_cache_hits"] >= 3
    assert s.get("codegen_plans", 0) >= 1  # the repeated plan ran as generated code


def test_generated_function_is_flat_and_frees_as_the_interpreter():
    x = torch.randn(1000, device=D)
    genie.materialize(x)
    freed = {}
    for mode in ("0", "always"):
        codegen.set_mode(mode)
        genie.reset_stats()
        y = x
        for _ in range(30):
            y = (y * 1.01).cos()
        y.sum().item()
        freed[mode] = genie.stats()["values_freed"]
    assert freed["0"] == freed["always"] == 59
    tape = genie.plan_cache.plan([((x * 2).cos()._node, 0)])
    src = codegen.generate(tape).source
    assert src.startswith("def replay(inputs, I, dev):") and "del v" in src
    assert "for " not in src and "env" not in src  # locals, no loop over instructions


def test_random_op_replays_its_seed():
    torch.manual_seed(3)
    want = [(torch.rand(5, device=D) * 2).cpu() for _ in range(3)]
    codegen.set_mode("always")
    torch.manual_seed(3)
    got = [(torch.rand(5, device=D) * 2).cpu() for _ in range(3)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.kernel_error
def test_generated_error_names_the_op():
    codegen.set_mode("always")
    a = torch.randn(3, 3, device=D)
    idx = torch.tensor([0, 5], device=D)  # out of range: only the real kernel can tell
    with pytest.raises(ExecutionError, match="index_select.*failed on the device: IndexError") \
            as e:
        (a.index_select(0, idx) + 1).cpu()
    assert e.value.index is not None  # the failing instruction's position in its tape
    with pytest.raises(IndexError):  # eager raises the same kind of error
        torch.randn(3, 3).index_select(0, torch.tensor([0, 5]))
