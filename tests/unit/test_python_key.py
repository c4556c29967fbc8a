"""Genie's kernel on the Python dispatch key (``csrc/python_key.cpp``) against PyTorch's path.

With ``config.python_key`` on, a LazyTensor call reaches the record from a C++ kernel that
converts the dispatcher's stack itself; off, PyTorch's Python fallback calls
``LazyTensor.__torch_dispatch__``. Every program here runs both ways in one process and the two
recorded graphs must be equal field for field (``test_native_record.describe``), values equal
to eager; calls the kernel must not take (other subclasses, modes, registered dispatch rules, a
replaced ``__torch_dispatch__``) must reach PyTorch's path and behave as without the kernel.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_native_record import _RuleTensor as _Zeros  # another subclass: answers every op with 0
from test_native_record import describe
from torch.utils._python_dispatch import TorchDispatchMode

import genie
from genie import _C
from genie.config import config
from genie.graph import _record_counter
from genie.lazy_tensor import LazyTensor

D = "remote_accelerator"
aten = torch.ops.aten

pytestmark = pytest.mark.skipif(
    not getattr(_C, "_python_key_kernel", False) or not _C._record_native,
    reason="genie._C built without the Python-key kernel (torch older than 2.13)")


@pytest.fixture(autouse=True)
def _key_on() -> Iterator[None]:
    before = config.python_key
    config.python_key = True
    yield
    config.python_key = before


def _stats() -> tuple[int, int]:
    return tuple(_C._python_key_stats())[:2]


def both_keys(program: Callable[[], list[Any]]) -> tuple[list[Any], list[Any]]:
    """``program``'s recorded graph with the kernel off and on (after a warm-up run); asserts
    the kernel recorded the calls of the "on" run and none of the "off" run."""
    program()
    out = {}
    for on in (False, True):
        config.python_key = on
        before = _stats()
        start = next(_record_counter)
        # Earlier runs' dropped writes freed first, and no collection inside the run: a full one,
        # or 4,096 writes pending, re-tracks pending writers (graph.defer_writer), and the
        # descriptions compare which objects are tracked.
        gc.collect()
        gc.disable()
        try:
            results = program()
        finally:
            gc.enable()
        recorded = _stats()[0] - before[0]
        assert (recorded > 0) == on, (on, recorded)
        out[on] = describe(results, start)
        del results
    return out[False], out[True]


def assert_same(program: Callable[[], list[Any]]) -> None:
    off, on = both_keys(program)
    assert len(off) == len(on)
    for i, (a, b) in enumerate(zip(off, on)):
        assert a == b, f"item {i} differs:\n torch's path {a}\n the kernel  {b}"


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(*shape)


# --- the graphs: every kind of argument and return the kernel converts -------------------------

def test_scalars_defaults_and_keyword_only_arguments() -> None:
    xc, bc = _x(4, 6), _x(6, seed=1)
    x, b = xc.to(D), bc.to(D)

    def program() -> list[Any]:
        return [x * 0.5, x + 1, torch.add(x, b, alpha=2), x.sub(b, alpha=0.5), torch.relu(x),
                x.clamp(min=-0.1), x.clamp(-0.2, 0.3), x.sum(1, keepdim=True),
                x.sum(dtype=torch.float64), x.to(torch.float16), torch.zeros_like(x),
                torch.ones_like(x, dtype=torch.int32), x.mean((0, 1)), x > 0, x * True,
                torch.where(x > 0, x, b), x.new_full((2, 3), 7.0), x.std(1, correction=0)]

    assert_same(program)
    got = program()
    want = [xc * 0.5, xc + 1, torch.add(xc, bc, alpha=2), xc.sub(bc, alpha=0.5), torch.relu(xc),
            xc.clamp(min=-0.1), xc.clamp(-0.2, 0.3), xc.sum(1, keepdim=True),
            xc.sum(dtype=torch.float64), xc.to(torch.float16), torch.zeros_like(xc),
            torch.ones_like(xc, dtype=torch.int32), xc.mean((0, 1)), xc > 0, xc * True,
            torch.where(xc > 0, xc, bc), xc.new_full((2, 3), 7.0), xc.std(1, correction=0)]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        torch.testing.assert_close(g.cpu(), w)


def test_lists_views_multiple_outputs_and_memory_formats() -> None:
    xc = _x(2, 3, 4, 5)
    x = xc.to(D)

    def program() -> list[Any]:
        a, b = x.split([1, 1])
        m = torch.max(x, dim=1)
        return [torch.cat([a, b, x]), torch.stack([x, x], 1), *x.unbind(0), m.values, m.indices,
                x.contiguous(memory_format=torch.channels_last), x.transpose(1, 2), x[:, 1:],
                x.view(2, -1), x.permute(3, 2, 1, 0).reshape(-1), x.expand(3, 2, 3, 4, 5)]

    assert_same(program)
    got = program()
    a, b = xc.split([1, 1])
    m = torch.max(xc, dim=1)
    want = [torch.cat([a, b, xc]), torch.stack([xc, xc], 1), *xc.unbind(0), m.values, m.indices,
            xc.contiguous(memory_format=torch.channels_last), xc.transpose(1, 2), xc[:, 1:],
            xc.view(2, -1), xc.permute(3, 2, 1, 0).reshape(-1), xc.expand(3, 2, 3, 4, 5)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride()
        torch.testing.assert_close(g.cpu(), w)


def test_writes_indexing_and_optional_tensor_lists() -> None:
    def program() -> list[Any]:
        y = _x(5, 4).to(D)
        idx = torch.tensor([0, 3]).to(D)
        y.add_(1.0)
        y[idx] = torch.zeros(2, 4, device=D)
        y.index_put_((idx,), torch.ones(4, device=D), accumulate=True)
        z = torch.empty(5, 4, device=D)
        torch.mul(y, 2, out=z)
        return [y, z, y[idx], y.gather(1, torch.zeros(5, 1, dtype=torch.long, device=D))]

    assert_same(program)
    y = _x(5, 4)
    idx = torch.tensor([0, 3])
    y.add_(1.0)
    y[idx] = torch.zeros(2, 4)
    y.index_put_((idx,), torch.ones(4), accumulate=True)
    got = program()
    for g, w in zip(got, [y, y * 2, y[idx], y.gather(1, torch.zeros(5, 1, dtype=torch.long))]):
        torch.testing.assert_close(g.cpu(), w)


def test_a_training_step_with_foreach_lists() -> None:
    xc, yc = _x(4, 6), _x(4, 1, seed=1)
    x, y = xc.to(D), yc.to(D)

    def step(device: str) -> list[Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 1)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        inp, target = (x, y) if device == D else (xc, yc)
        for _ in range(2):
            loss = torch.nn.functional.mse_loss(model(inp), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return [loss.detach(), *(p.detach() for p in model.parameters())]

    assert_same(lambda: step(D))
    for g, w in zip(step(D), step("cpu")):
        torch.testing.assert_close(g.cpu(), w)


def _detached() -> int:
    return tuple(_C._python_key_stats())[3]


def _saved_output_step(device: str, x: torch.Tensor) -> list[Any]:
    """relu saves its output: autograd detaches it in C++ (TensorImpl::shallow_copy_and_detach,
    through torch's interpreter) when it saves it and again when backward unpacks it."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 3).to(device)
    lin(x.to(device)).relu().sum().backward()
    return [lin.weight.grad, lin.bias.grad]


@pytest.mark.skipif(not getattr(_C, "_native_detach", False),
                    reason="genie._C built without the native detach (torch other than 2.13)")
def test_detaches_from_cpp_are_recorded_natively() -> None:
    x = _x(4, 6)
    assert_same(lambda: _saved_output_step(D, x))
    for on in (False, True):
        config.python_key = on
        before = _detached()
        got = _saved_output_step(D, x)
        assert _detached() - before == (2 if on else 0)  # relu's output saved and unpacked
        for g, w in zip(got, _saved_output_step("cpu", x)):
            torch.testing.assert_close(g.cpu(), w)
            assert type(g) is LazyTensor and g.grad_fn is None and not g.requires_grad


def _spy_on_torch_dispatch(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace ``LazyTensor.__torch_dispatch__`` by one that notes each op and calls Genie's;
    the list it notes them in."""
    seen: list = []
    native = LazyTensor.__dict__["__torch_dispatch__"]

    def spy(func, types, args=(), kwargs=None):
        seen.append(func)
        return native.__func__(func, types, args, kwargs)

    monkeypatch.setattr(LazyTensor, "__torch_dispatch__", staticmethod(spy))
    return seen


def test_detaches_from_cpp_reach_modes_and_a_replaced_torch_dispatch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = _x(4, 6)
    before = _detached()
    with _Log() as log:
        _saved_output_step(D, x)
    assert log.ops.count(aten.detach.default) >= 2
    seen = _spy_on_torch_dispatch(monkeypatch)
    got = _saved_output_step(D, x)
    assert seen.count(aten.detach.default) >= 2
    assert _detached() == before
    for g, w in zip(got, _saved_output_step("cpu", x)):
        torch.testing.assert_close(g.cpu(), w)


# --- calls the kernel hands to PyTorch's path ----------------------------------------------------

class _Log(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_other_subclasses_and_mixed_calls_take_torchs_path() -> None:
    z = _Zeros(torch.randn(3))
    x = torch.randn(3).to(D)
    for on in (False, True):
        config.python_key = on
        recorded, delegated = _stats()
        assert torch.sin(z).item() == 0
        assert _stats()[0] == recorded
        if on:
            assert _stats()[1] > delegated
        # A LazyTensor beside another subclass: torch's ordering of the overloaded arguments
        # decides, exactly as without the kernel.
        results = []
        for call in (lambda: z + x, lambda: x + z):
            try:
                results.append(("value", float(call())))
            except Exception as e:  # noqa: BLE001 - compared across both paths below
                results.append((type(e), str(e)))
        if on:
            assert results == off_results
        else:
            off_results = results


def test_modes_see_every_op() -> None:
    x = torch.randn(3).to(D)
    for on in (False, True):
        config.python_key = on
        with _Log() as log:  # the mode first; its own calls (mode off) reach LazyTensor's path
            y = (x * 2).sin()
        assert [str(f) for f in log.ops] == ["aten.mul.Tensor", "aten.sin.default"]
        torch.testing.assert_close(y.cpu(), (x.cpu() * 2).sin())
        with genie.capture() as g:
            w = x.cos() + 1
        assert [str(n.op) for n in g.nodes][-2:] == ["aten.cos.default", "aten.add.Tensor"]
        torch.testing.assert_close(w.cpu(), x.cpu().cos() + 1)


def test_a_dispatch_rule_registered_for_lazy_tensor_is_used() -> None:
    if not config.native_dispatch_rule:
        pytest.skip("GENIE_NATIVE_DISPATCH_RULE=0: the kernel hands every call to torch's path")
    x = torch.randn(3).to(D)

    def rule(cls, func, types, args, kwargs):  # noqa: ARG001
        return torch.ones(3).to(D)

    with torch.library._scoped_library("aten", "FRAGMENT") as lib:
        torch.library.register_torch_dispatch("aten::sin", LazyTensor, rule, lib=lib)
        assert torch.sin(x).cpu().tolist() == [1.0, 1.0, 1.0]
        torch.testing.assert_close(torch.cos(x).cpu(), x.cpu().cos())
    torch.testing.assert_close(torch.sin(x).cpu(), x.cpu().sin())


def test_a_replaced_torch_dispatch_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy_on_torch_dispatch(monkeypatch)
    x = torch.randn(3).to(D)
    y = x.exp()
    assert aten.exp.default in seen
    torch.testing.assert_close(y.cpu(), x.cpu().exp())


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    lambda t: t + torch.ones(5, device=t.device),
    lambda t: t.view(7),
    lambda t: torch.cat([t, t.unsqueeze(0)]),
    lambda t: t.sum(dim=5),
    lambda t: torch.mm(t, t),
])
def test_errors_are_eagers(bad: Callable[[torch.Tensor], Any]) -> None:
    xc = torch.randn(4, 6)
    with pytest.raises(Exception) as eager:
        bad(xc)
    x = xc.to(D)
    for on in (False, True):
        config.python_key = on
        with pytest.raises(type(eager.value)) as got:
            bad(x)
        assert str(eager.value).splitlines()[0] in str(got.value)


def test_environment_switch() -> None:
    code = ("import torch, genie; from genie import _C; x = torch.ones(2).to('remote_accelerator');"
            "(x + 1).cpu(); print(_C._python_key_stats()[0] > 0)")
    for env, want in (("0", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**__import__("os").environ, "GENIE_PYTHON_KEY": env},
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want


# --- LazyTensor's tp_getattr: torch's per-call __torch_function__ lookup ------------------------

def test_torch_function_lookups_answer_as_getattr(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's bindings ask each subclass argument for ``__torch_function__`` through the type's
    char* getattr slot, which LazyTensor fills with getattr()'s own answer: the disabled
    implementation by default, a user's override when one is set."""
    x = torch.randn(3).to(D)
    for on in (False, True):
        config.python_key = on
        assert not torch.overrides.has_torch_function((x,))
        assert getattr(x, "__torch_function__") is torch._C._disabled_torch_function_impl
    config.python_key = True
    seen = []

    @classmethod
    def spy(cls, func, types, args=(), kwargs=None):
        seen.append(func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(LazyTensor, "__torch_function__", spy)
    assert torch.overrides.has_torch_function((x,))
    y = torch.sin(x) + 1
    assert torch.sin in seen
    torch.testing.assert_close(y.cpu(), x.cpu().sin() + 1)


def test_an_instance_torch_function_comes_before_the_class_one() -> None:
    """LazyTensor's tp_getattr reads the class's plain ``__torch_function__`` without the generic
    lookup; an instance's own attribute of that name still comes first, as getattr() answers,
    whether the wrapper's record is in its impl (no instance dict) or its instance dict."""
    config.python_key = True
    x = torch.randn(3).to(D)
    ys = [x * 2 for _ in range(3)]  # natively recorded after the first
    saved = config.native_record
    config.native_record = False
    try:
        ys.append(x * 2)  # the Python path's wrapper: its record in its instance dict
    finally:
        config.native_record = saved

    def own(func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
        return NotImplemented

    for y in ys:
        assert not torch.overrides.has_torch_function((y,))
        y.__torch_function__ = own
        assert getattr(y, "__torch_function__") is own
        assert torch.overrides.has_torch_function((y,))
        del y.__torch_function__
        assert not torch.overrides.has_torch_function((y,))
        torch.testing.assert_close(y.cpu(), x.cpu() * 2)


# --- factories: the native PrivateUse1 kernel against torch.library's Python kernel -------------

_FACTORIES = r"""
import torch, genie
from genie import _C
from genie.graph import _record_counter
from test_native_record import describe
D = torch.device("remote_accelerator", 0)
g = torch.Generator().manual_seed(3)
start = next(_record_counter)
res = [torch.zeros(3, dtype=torch.int64, device=D), torch.ones(2, 3, device=D),
       torch.full((2, 2), 1.5, device=D), torch.full((2,), 7, device=D),
       torch.arange(5, device=D), torch.arange(1, 9, 2, dtype=torch.float32, device=D),
       torch.arange(0.0, 1.0, 0.25, device=D), torch.empty_strided((2, 3), (1, 2), device=D),
       torch.scalar_tensor(2.5, device=D), torch.eye(3, 2, device=D),
       torch.linspace(0, 1, 5, device=D), torch.randn(4, device=D),
       torch.rand(2, 2, dtype=torch.float64, device=D), torch.randint(0, 9, (5,), device=D),
       torch.tril_indices(3, 3, device=D), torch.zeros(2, device=D, requires_grad=True)]
import re
print(re.sub(r"\d{9,}", "<id>", repr(describe(res, start))))
print([r.cpu().tolist() if not r.is_floating_point() or r.numel() == 0 else
       [round(v, 6) for v in r.detach().cpu().flatten().tolist()] for r in res[:7] + res[8:11]])  # not empty_strided's
print([tuple(r.shape) for r in res], _C._python_key_stats()[2] > 0)
try:
    torch.ones(-1, device=D)
except Exception as e:
    print(type(e).__name__, str(e).splitlines()[0])
"""


def test_factory_kernel_records_as_the_python_kernel() -> None:
    """Factories (``torch.zeros(..., device=...)`` and friends) reach a C++ PrivateUse1 kernel
    with the kernel on (``GENIE_PYTHON_KEY=1`` at import) and torch.library's Python kernel off:
    the recorded graphs are equal field for field, values and errors too."""
    import os
    out = {}
    for env in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", _FACTORIES], capture_output=True, text=True,
                           env={**os.environ, "GENIE_PYTHON_KEY": env,
                                "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                                              os.environ.get("PYTHONPATH", "")])},
                           timeout=180)
        assert r.returncode == 0, r.stderr
        out[env] = r.stdout.strip().splitlines()
    assert out["0"][-2].endswith("False") and out["1"][-2].endswith("True")
    assert out["0"][:-2] == out["1"][:-2]
    assert out["0"][-2].rsplit(" ", 1)[0] == out["1"][-2].rsplit(" ", 1)[0]
    assert out["0"][-1] == out["1"][-1] == \
        "RuntimeError Trying to create tensor with negative dimension -1: [-1]"
    eager = [torch.zeros(3, dtype=torch.int64).tolist(), torch.ones(2, 3).flatten().tolist(),
             torch.full((2, 2), 1.5).flatten().tolist(), torch.full((2,), 7).tolist(),
             torch.arange(5).tolist(), torch.arange(1, 9, 2, dtype=torch.float32).tolist()]
    assert out["1"][1].startswith(repr(eager)[:-1])
