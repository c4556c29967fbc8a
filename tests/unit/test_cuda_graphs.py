"""Steady plans replayed as CUDA graphs (genie.backends.cuda_graphs) against eager.

On a CUDA device the window is really captured and replayed; elsewhere the same bookkeeping
runs with ``GENIE_CUDA_GRAPHS=emulate``: the window runs again from the captured step's
parameters into the captured outputs' memory, so each hazard a graph has shows here too: a
parameter that changed after the capture (a miss must run the step plainly), an output a node
still holds (the next replay must not overwrite it), outputs that alias each other, in-place
inputs (weights, a static KV cache, optimizer state), inputs written through a buffer (copied
back), random ops and host syncs (kept out of the window). Every test compares each step's values
with eager's and checks from the counters that graphs really replayed.
"""

from __future__ import annotations

import pytest
import torch

import eager_oracle

import genie
from genie import plan_cache
from genie.backends import backend_order, cuda_graphs, set_backends
from genie.config import config
from genie.device import real_device

D = "remote_accelerator"
EAGER = str(real_device(0))
ON_CUDA = real_device(0).type == "cuda"


@pytest.fixture(autouse=True)
def _graphs():
    saved, mode, replay = backend_order(), config.cuda_graphs, config.native_replay
    set_backends(["eager"])
    config.native_replay = "1"
    config.cuda_graphs = "1" if ON_CUDA else "emulate"
    plan_cache.clear()
    genie.reset_stats()
    yield
    set_backends(saved)
    config.cuda_graphs, config.native_replay = mode, replay
    plan_cache.clear()


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
        # the same kernels, launched from a graph: equal to eager's on the same device
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _mlp(dev: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 16, generator=g).to(dev) for _ in range(3)]


def _forward(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for w in ws:
        x = torch.nn.functional.gelu(x @ w) * 0.5 + 0.1
    return x


def test_an_inference_loop_replays_a_graph_and_equals_eager():
    xs = [torch.randn(4, 16) for _ in range(10)]
    want = [_forward(_mlp(EAGER), x.to(EAGER)).cpu() for x in xs]
    ws = _mlp(D)
    got = [_forward(ws, x.to(D)).cpu() for x in xs]
    _close(got, want)
    s = genie.stats()
    assert s["cuda_graph_captures"] == 1
    assert s["cuda_graph_replays"] >= 4


def test_values_a_node_holds_are_not_overwritten_by_later_replays():
    xs = [torch.randn(4, 16) for _ in range(9)]
    ws_e, ws = _mlp(EAGER), _mlp(D)
    want = [_forward(ws_e, x.to(EAGER)) for x in xs]
    held = []
    for x in xs:
        y = _forward(ws, x.to(D))
        y.sum().item()  # materialized each step; y itself is read again at the end
        held.append(y)
    _close([y.cpu() for y in held], [w.cpu() for w in want])
    assert genie.stats()["cuda_graph_replays"] >= 3


def test_outputs_that_alias_each_other_stay_views_of_one_another():
    ws_e, ws = _mlp(EAGER), _mlp(D)
    got, want = [], []
    for k in range(8):
        x = torch.full((4, 16), 0.01 * k)
        for dev, w, out in ((D, ws, got), (EAGER, ws_e, want)):
            h = _forward(w, x.to(dev))
            row = h[1]  # a view of another output of the same step
            h.sum().item()
            h.add_(1.0)  # written after the run: the view sees it, as in eager
            out.append(row.cpu())
    _close(got, want)
    assert genie.stats()["cuda_graph_replays"] >= 2


def test_in_place_inputs_are_written_where_they_live():
    acc_e = torch.zeros(4, 16, device=EAGER)
    acc = torch.zeros(4, 16, device=D)
    ws_e, ws = _mlp(EAGER), _mlp(D)
    got, want = [], []
    for k in range(8):
        x = torch.randn(4, 16)
        for a, w, dev, out in ((acc, ws, D, got), (acc_e, ws_e, EAGER, want)):
            a.add_(_forward(w, x.to(dev)))
            out.append(a.sum(0).cpu())
    _close(got, want)
    _close([acc.cpu()], [acc_e.cpu()])
    assert genie.stats()["cuda_graph_replays"] >= 2


def test_a_parameter_that_changes_after_the_capture_runs_the_step_plainly():
    ws_e, ws = _mlp(EAGER), _mlp(D)
    scales = [0.5] * 6 + [0.25] + [0.5] * 5  # the window's float changes once
    got, want = [], []
    x = torch.randn(4, 16)
    for c in scales:
        for w, dev, out in ((ws, D, got), (ws_e, EAGER, want)):
            out.append((_forward(w, x.to(dev)) * c).cpu())
    _close(got, want)
    s = genie.stats()
    assert s["cuda_graph_misses"] >= 1 and s["cuda_graph_replays"] >= 3


def test_parameters_at_the_head_of_a_step_run_before_the_window():
    ws_e, ws = _mlp(EAGER), _mlp(D)
    pos_e = torch.zeros(4, 16, device=EAGER)
    pos = torch.zeros(4, 16, device=D)
    got, want = [], []
    for k in range(11):
        for p, w, dev, out in ((pos, ws, D, got), (pos_e, ws_e, EAGER, want)):
            p.fill_(k * 0.1)  # a per-step float, then a view at a per-step index written
            p[:, k] = 1.0
            out.append(_forward(w, p).cpu())
    _close(got, want)
    assert genie.stats()["cuda_graph_replays"] >= 2


def test_a_moving_input_the_window_writes_is_copied_back():
    ws_e, ws = _mlp(EAGER), _mlp(D)
    got, want = [], []
    for k in range(14):
        for w, dev, out in ((ws, D, got), (ws_e, EAGER, want)):
            z = torch.ones(4, 16, device=dev) * (k + 1.0)  # made by the step's head
            z.mul_(2.0)  # written in the window
            y = _forward(w, z)
            out += [y.cpu(), z.cpu()]
    _close(got, want)
    assert genie.stats()["cuda_graph_replays"] >= 2


def test_a_random_op_stays_out_of_the_window_and_keeps_its_values():
    ws = _mlp(D)
    x = torch.randn(4, 16).to(D)
    runs = {}
    for mode in ("0", config.cuda_graphs):
        config.cuda_graphs = mode
        plan_cache.clear()
        torch.manual_seed(5)
        runs[mode] = [torch.nn.functional.dropout(_forward(ws, x), 0.5).cpu() for _ in range(8)]
    _close(runs[config.cuda_graphs], runs["0"])
    assert genie.stats()["cuda_graph_replays"] >= 2


def test_a_host_sync_in_the_window_is_refused_and_runs_plainly():
    ws_e, ws = _mlp(EAGER), _mlp(D)
    got, want = [], []
    for k in range(7):
        x = torch.randn(4, 16)
        for w, dev, out in ((ws, D, got), (ws_e, EAGER, want)):
            y = _forward(w, x.to(dev))
            out.append(y[y > 0].sum().cpu())  # a data-dependent shape (nonzero) mid-step
    _close(got, want)
    # the boolean index splits the step: a window on either side of it, or none
    assert genie.stats().get("cuda_graph_replays", 0) + \
        genie.stats().get("cuda_graph_refused", 0) >= 1


def test_a_replaced_weight_drops_the_graph_and_a_new_one_is_captured():
    ws_e, ws = _mlp(EAGER), _mlp(D)
    got, want = [], []
    for k in range(16):
        if k == 7:  # new tensors: the captured addresses no longer hold the weights
            ws_e, ws = _mlp(EAGER, seed=1), _mlp(D, seed=1)
        x = torch.randn(4, 16)
        for w, dev, out in ((ws, D, got), (ws_e, EAGER, want)):
            out.append(_forward(w, x.to(dev)).cpu())
    _close(got, want)
    s = genie.stats()
    assert s["cuda_graph_captures"] == 2 and s["cuda_graph_misses"] >= cuda_graphs.MAX_MISSES


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_training_steps_equal_eager(opt):
    """Forward and backward in the window, the update too where its floats do not change (SGD);
    AdamW's step-dependent bias corrections run after it. Equal to the same steps without graphs
    bit for bit, and to eager (on the CPU where the real device is CUDA: pytorch#161129)."""

    def run(dev: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 4)).to(dev)
        o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt == "sgd" else \
            torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(14):
            x, y = torch.randn(8, 16, generator=g).to(dev), torch.randn(8, 4, generator=g).to(dev)
            loss = torch.nn.functional.mse_loss(model(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
            losses.append(loss.detach().cpu())
        return [*losses, *(p.detach().cpu() for p in model.parameters())]

    want = run(str(eager_oracle.AUTOGRAD))
    got = run(D)
    assert genie.stats()["cuda_graph_replays"] >= 2
    mode = config.cuda_graphs
    config.cuda_graphs = "0"
    plan_cache.clear()
    plain = run(D)
    config.cuda_graphs = mode
    for a, b in zip(got, plain, strict=True):
        assert torch.equal(a, b)  # the same kernels, launched from a graph
    eager_oracle.assert_equal_eager(got, want)


def test_a_static_cache_decode_step_equals_eager():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, StaticCache

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128)

    def run(dev: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg).eval().to(dev)
        L, P = 64, 8
        cache = StaticCache(config=model.config, max_cache_len=L)
        tok = torch.zeros((1, 1), dtype=torch.long, device=dev)
        pos = torch.zeros((1, 1), dtype=torch.long, device=dev)
        mask = torch.full((1, 1, 1, L), torch.finfo(torch.float32).min, device=dev)
        prompt = torch.arange(P)[None].to(dev)
        out = []
        with torch.no_grad():
            mask[..., :P] = 0.0
            logits = model(prompt, past_key_values=cache, use_cache=True,
                           position_ids=torch.arange(P, device=dev)[None]).logits
            nxt = logits[:, -1:].argmax(-1)
            for p in range(P, P + 14):
                tok.copy_(nxt)
                pos.fill_(p)
                mask[..., p] = 0.0
                logits = model(tok, past_key_values=cache, position_ids=pos,
                               attention_mask=mask, use_cache=True).logits
                nxt = logits[:, -1:].argmax(-1)
                out.append(logits.cpu())
        return out

    want = run(EAGER)
    got = run(D)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    s = genie.stats()
    assert s["cuda_graph_captures"] == 1 and s["cuda_graph_replays"] >= 7


def test_off_and_on_a_cpu_device_nothing_is_hooked(monkeypatch):
    config.cuda_graphs = "0"
    xs = [torch.randn(4, 16) for _ in range(6)]
    ws = _mlp(D)
    for x in xs:
        _forward(ws, x.to(D)).cpu()
    if not ON_CUDA:
        config.cuda_graphs = "1"  # the default: CPU programs get no hook
        plan_cache.clear()
        for x in xs:
            _forward(ws, x.to(D)).cpu()
    s = genie.stats()
    assert s.get("cuda_graph_captures", 0) == 0 and s.get("cuda_graph_refused", 0) == 0


def test_a_mode_that_is_not_one_raises_a_clear_error():
    config.cuda_graphs = "yes"
    with pytest.raises(ValueError, match="GENIE_CUDA_GRAPHS='yes'"):
        cuda_graphs.mode()


def test_a_memory_budget_keeps_programs_plain():
    """A graph holds its window's memory for good: where the program asked the recompute pass
    to keep its peak under a budget, nothing is captured."""
    from genie.passes import pipeline

    pipeline.set_memory_budget("1GiB")
    try:
        ws = _mlp(D)
        for _ in range(8):
            _forward(ws, torch.randn(4, 16).to(D)).cpu()
    finally:
        pipeline.set_memory_budget(None)
    s = genie.stats()
    assert s.get("cuda_graph_captures", 0) == 0 and s["cuda_graph_refused"] >= 1


def test_a_dropped_plan_lets_its_graph_go():
    """A graph (and its memory pool) lives as long as its plan's program: clearing the plan
    cache frees it (nothing else holds it)."""
    import gc
    import weakref

    ws = _mlp(D)
    for _ in range(8):
        _forward(ws, torch.randn(4, 16).to(D)).cpu()
    held = [r() for r in cuda_graphs._held if r() is not None]
    assert held and all(h.graph is not None for h in held)
    gone = [weakref.ref(h) for h in held]
    del held
    plan_cache.clear()
    gc.collect()
    assert all(r() is None for r in gone)
