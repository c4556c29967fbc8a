"""The record from the IValue stack (``csrc/record.cpp``'s ``record_stack``) against the Python
arguments' path and eager.

With ``config.stack_record`` on, the Python-key kernel records a call of a learned meta-cache
entry from the dispatcher's IValues directly; off, it converts them into an args tuple and calls
``record_call`` (the reference). Every program here runs both ways in one process: the recorded
graphs must be equal field for field (``test_native_record.describe``) and the values, shapes,
strides, dtypes and errors those of eager. ``config.stack_record_check`` is on throughout, so each
call the stack path takes is also flattened from its Python arguments and must give the same key
words, leaves and aliased arguments. Calls the path must decline (strs, devices, optional-tensor
lists, writes, out=) are checked to reach the Python arguments' path.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_native_record import describe

import genie  # noqa: F401  (registers the device)
from genie import _C
from genie.config import config
from genie.graph import _record_counter

D = "remote_accelerator"

pytestmark = pytest.mark.skipif(
    not getattr(_C, "_python_key_kernel", False) or not _C._record_native
    or not hasattr(_C, "_stack_record_stats"),
    reason="genie._C built without the Python-key kernel (torch older than 2.11)")


@pytest.fixture(autouse=True)
def _stack_on() -> Iterator[None]:
    before = (config.python_key, config.stack_record, config.stack_record_check)
    config.python_key = True
    config.stack_record = True
    config.stack_record_check = True
    yield
    config.python_key, config.stack_record, config.stack_record_check = before


def _taken() -> tuple[int, int]:
    return tuple(_C._stack_record_stats())


def both(program: Callable[[], list[Any]]) -> tuple[int, int]:
    """Runs ``program`` twice to learn its entries, then with the stack path off and on; asserts
    the two recorded graphs are equal. Returns (calls taken, calls declined) of the "on" run."""
    program()
    program()
    out = {}
    counts = (0, 0)
    for on in (False, True):
        config.stack_record = on
        before = _taken()
        start = next(_record_counter)
        gc.collect()
        gc.disable()  # describe compares which objects are tracked (see test_python_key)
        try:
            results = program()
        finally:
            gc.enable()
        after = _taken()
        counts = (after[0] - before[0], after[1] - before[1])
        if not on:
            assert counts == (0, 0), counts
        out[on] = describe(results, start)
        del results
    config.stack_record = True
    assert len(out[False]) == len(out[True])
    for i, (a, b) in enumerate(zip(out[False], out[True])):
        assert a == b, f"item {i} differs:\n Python arguments {a}\n the stack        {b}"
    return counts


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(*shape)


def _like_eager(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride(), (g, w)
        assert g.storage_offset() == w.storage_offset()
        torch.testing.assert_close(g.cpu(), w)


def _hot(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
         idx: torch.Tensor, emb: torch.Tensor) -> list[Any]:
    """The common shapes of a GPT-2 step and an MLP: views, elementwise ops with tensors and
    Python numbers, matmuls, reductions, softmax, layer norm, embedding."""
    return [x.view(-1), x.view(2, 12), x.t(), x.transpose(0, 1), x.permute(1, 0),
            x.unsqueeze(0).expand(3, 4, 6), x[1], x[:, 1:], x.reshape(24), x.contiguous(),
            x + y, x * y, x - y, x / y, x + 2, x * 0.5, 0.5 * x, x - 1.5, x.pow(3.0), x > 0,
            torch.relu(x), torch.tanh(x), x.exp(), x.neg(), torch.where(x > 0, x, y),
            x @ w, F.linear(x, w.t(), b), torch.addmm(b, x, w), torch.mm(x, w), torch.bmm(
                x.unsqueeze(0), w.unsqueeze(0)),
            x.sum(1), x.sum(1, True), x.mean(-1, keepdim=True), x.amax(0), x.var(1),
            torch.softmax(x, -1), F.log_softmax(x, 1), F.layer_norm(x, (6,), b[:6], b[:6]),
            F.embedding(idx, emb), F.gelu(x), x.masked_fill(x > 0, -1.0), *x.split([1, 3]),
            *x.unbind(1), *torch.max(x, 1), *torch.native_layer_norm(x, (6,), None, None, 1e-5),
            torch.cat([x, y]), torch.cat([x, y, x], 1), torch.stack([x, y], 1),
            torch.add(x, y, alpha=2), x.sub(y, alpha=0.5), x.clone(memory_format=torch.
                                                                   contiguous_format),
            x.var(1, correction=0), torch.ones_like(x, dtype=torch.float64)]


def test_hot_ops_are_taken_and_match_the_python_arguments_and_eager() -> None:
    xc, yc, wc, bc = _x(4, 6), _x(4, 6, seed=1), _x(6, 8, seed=2), _x(8, seed=3)
    idxc, embc = torch.tensor([[0, 3, 2], [1, 1, 4]]), _x(5, 6, seed=4)
    lazy = [t.to(D) for t in (xc, yc, wc, bc, idxc, embc)]
    taken, declined = both(lambda: _hot(*lazy))
    # every call of the program: the masked_fill's float and the views included
    assert taken > 50 and declined == 0, (taken, declined, _C._stack_record_declines())
    _like_eager(_hot(*lazy), _hot(xc, yc, wc, bc, idxc, embc))


def test_floats_not_in_the_key_are_the_calls_own() -> None:
    """mul's float does not change its output's metadata: the key has no value for it, so calls
    with other numbers hit the same entry; each node keeps its own number."""
    xc = _x(3, 5)
    x = xc.to(D)
    for f in (0.5, 0.25, -3.0):  # learn the entry
        x * f
    before = _taken()
    got = [x * f for f in (0.5, 0.25, -3.0, 7.0)] + [x.add(f) for f in (1.5, 2.5)]
    got += [x.clamp(f, f + 1) for f in (-0.5, 0.5)] + [x.masked_fill(x > 0, f) for f in (2., 3.)]
    assert _taken()[0] - before[0] >= 6
    want = [xc * f for f in (0.5, 0.25, -3.0, 7.0)] + [xc.add(f) for f in (1.5, 2.5)]
    want += [xc.clamp(f, f + 1) for f in (-0.5, 0.5)]
    want += [xc.masked_fill(xc > 0, f) for f in (2., 3.)]
    _like_eager(got, want)
    # ints and bools as the wrapped numbers of Python scalars, and dtypes
    got = [x + 3, x * True, x.to(torch.float64), x.sum(1, dtype=torch.float64), x.half()]
    want = [xc + 3, xc * True, xc.to(torch.float64), xc.sum(1, dtype=torch.float64), xc.half()]
    _like_eager(got, want)
    _like_eager([x + 3, x * True, x.to(torch.float64)], want[:3])


def test_defaulted_trailing_arguments() -> None:
    xc = _x(4, 6)
    x = xc.to(D)

    def program() -> list[Any]:
        return [x.sum(1), x.sum(1, False), x.sum(1, True), x.cumsum(0), x.var(1, unbiased=True),
                x.var(1, unbiased=False), torch.softmax(x, 0), x.narrow(1, 0, 6), x[:, 0:6:1]]

    taken, declined = both(program)
    assert taken > 0 and declined == 0, (taken, declined, _C._stack_record_declines())
    want = [xc.sum(1), xc.sum(1, False), xc.sum(1, True), xc.cumsum(0), xc.var(1, unbiased=True),
            xc.var(1, unbiased=False), torch.softmax(xc, 0), xc.narrow(1, 0, 6), xc[:, 0:6:1]]
    _like_eager(program(), want)


@pytest.mark.parametrize("name,call", [
    ("keyword-only str", lambda x, y, z, i: torch.div(x, y, rounding_mode="floor")),
    ("keyword-only gelu", lambda x, y, z, i: F.gelu(x, approximate="tanh")),
    ("out=", lambda x, y, z, i: torch.mul(x, y, out=z)),
    ("in place", lambda x, y, z, i: z.add_(1.0)),
    ("in place tensor", lambda x, y, z, i: z.mul_(y)),
    ("optional tensor list", lambda x, y, z, i: x[i]),
    ("device", lambda x, y, z, i: x.new_zeros((2, 3), device=x.device)),
])
def test_declined_calls_take_the_python_arguments(name: str, call: Callable[..., Any]) -> None:
    xc, yc = _x(4, 6), _x(4, 6, seed=1)

    def inputs(dev: str) -> list[torch.Tensor]:
        return [xc.to(dev), yc.to(dev), torch.zeros(4, 6, device=dev),
                torch.tensor([0, 2]).to(dev)]

    def result(r: Any, z: torch.Tensor) -> list[Any]:
        return [*(r if isinstance(r, (tuple, list)) else [r]), z]

    args = inputs(D)
    call(*args)
    call(*args)
    before = _taken()
    got = result(call(*args), args[2])
    assert _taken()[0] == before[0], name  # the call itself is not taken
    eager = inputs("cpu")
    for _ in range(3):
        want = result(call(*eager), eager[2])
    _like_eager(got, want)

    def program() -> list[Any]:
        a = inputs(D)
        return result(call(*a), a[2])

    both(program)  # and with the stack path off the graphs are the same


def test_errors_are_eager_errors() -> None:
    xc = _x(4, 6)
    x = xc.to(D)
    x.view(-1)
    for bad in (lambda t: t.view(5, 7), lambda t: t.permute(0), lambda t: t @ t,
                lambda t: t.sum(3), lambda t: t.expand(3, 5, 6)):
        with pytest.raises(Exception) as eager:
            bad(xc)
        for on in (True, False):
            config.stack_record = on
            with pytest.raises(type(eager.value)) as got:
                bad(x)
            assert str(got.value) == str(eager.value)
    config.stack_record = True


def test_mlp_training_step() -> None:
    xc, yc = _x(8, 16), _x(8, 4, seed=1)

    def step(device: str) -> list[Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        x, y = xc.to(device), yc.to(device)
        for _ in range(3):
            loss = F.mse_loss(torch.softmax(model(x), -1), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return [loss.detach(), *(p.detach() for p in model.parameters())]

    taken, _ = both(lambda: step(D))
    assert taken > 0
    for g, w in zip(step(D), step("cpu")):
        torch.testing.assert_close(g.cpu(), w)


def test_switch_off_takes_nothing() -> None:
    x = _x(4, 6).to(D)
    x.view(-1)
    config.stack_record = False
    before = _taken()
    x.view(-1)
    x + x
    assert _taken() == before
