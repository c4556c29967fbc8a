"""split_foreach (issue 31): an optimizer's ``_foreach_*`` chain run one group of parameters at a
time under a memory budget. Eager on the real device is the oracle for losses and parameters (the
same kernels: bit-equal); the device's ``max_memory_allocated`` shows the foreach temporaries gone
from the peak. A budget is the device's (absolute): what it holds before a loop (on CUDA,
cuBLAS's workspace too) plus a share of the loop's peak above that."""

import gc

import pytest
import torch

import genie
from genie import passes, plan_cache
from genie.passes import pipeline, verify
from genie.passes.split_foreach import split_foreach
from genie.planner import build_tape, format_tape

from eager_oracle import AUTOGRAD, assert_equal_eager

D = "remote_accelerator"
WHOLE = [n for n in pipeline.DEFAULT if n != "split_foreach"]


pytestmark = pytest.mark.usefixtures("fresh_passes")


class _Conv1D(torch.nn.Module):
    """GPT-2's linear layer (``x @ W + b``): its weight's gradient is a fresh matrix product."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out) * 0.05)
        self.bias = torch.nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(4) for m in (_Conv1D(128, 128),
                                                                 torch.nn.GELU())],
                               torch.nn.LayerNorm(128))


def _adamw_loop(device, steps=5):
    """Wide layers, a batch of 2: AdamW's update (its ``_foreach_sqrt`` of every parameter's
    size) sets the step's peak, not the activations."""
    gc.collect()
    on = device == D
    base = torch.remote_accelerator.memory_allocated() if on else 0
    model = _model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 128, generator=g).to(device)
    y = torch.randn(2, 128, generator=g).to(device)
    losses, peaks = [], []
    for _ in range(steps):
        if on:
            torch.remote_accelerator.reset_peak_memory_stats()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on:
            peaks.append(torch.remote_accelerator.max_memory_allocated() - base)
    states = [opt.state[p][k].cpu() for p in model.parameters() for k in ("exp_avg",
                                                                           "exp_avg_sq")]
    return losses, [p.detach().cpu() for p in model.parameters()], states, peaks


def _sizes():
    """Bytes of ``_foreach_sqrt``'s temporaries: all of them, and the largest one."""
    sizes = [p.numel() * 4 for p in _model().parameters()]
    return sum(sizes), max(sizes)


def _states():
    return [s.state for p in plan_cache.cache().plans()
            if isinstance(s := p.artifacts.get("passes"), pipeline.Script)
            and "split_foreach" in s.changed_by]


def test_adamw_steps_equal_eager_and_the_update_no_longer_sets_the_peak():
    want = _adamw_loop(AUTOGRAD)
    passes.set_passes([])
    got0 = _adamw_loop(D)
    gc.collect()  # passed by the whole update's temporaries:
    budget = torch.remote_accelerator.memory_allocated() + max(got0[3][1:]) * 3 // 4
    runs = {}
    for name, names in (("whole", WHOLE), ("split", None)):
        plan_cache.clear()
        passes.set_passes(names)
        passes.set_memory_budget(budget)
        runs[name] = _adamw_loop(D)
    for got in (got0, *runs.values()):  # losses, parameters and both moments
        assert_equal_eager(got[0] + got[1] + got[2], want[0] + want[1] + want[2])
    assert "on" in _states()  # verified against eager, then kept
    # steps 1-2: the plan's miss and its verification (the unoptimized tape runs for real);
    # from step 3 the split plan, whose constants (bias corrections) change every step: the
    # peak loses every temporary but the largest group's (one weight's)
    split, whole = max(runs["split"][3][2:]), max(runs["whole"][3][2:])
    total, largest = _sizes()
    assert whole - split >= 0.95 * (total - largest), (runs["whole"][3], runs["split"][3])


def test_no_budget_or_a_fitting_one_changes_nothing():
    a, b = torch.randn(64, device=D), torch.randn(32, device=D)
    genie.materialize(a, b)
    ts = torch._foreach_sqrt([a, b])
    torch._foreach_add_(ts, 1.0)
    tape = build_tape([(t._node, t._out) for t in ts])
    assert split_foreach(tape)[0] is tape
    passes.set_memory_budget(1 << 30)
    assert split_foreach(tape)[0] is tape


def test_a_chain_is_split_per_group_and_verifies():
    xs = [torch.randn(n, device=D) for n in (256, 8, 8, 256)]
    ms = [torch.randn_like(x) for x in xs]
    genie.materialize(*xs, *ms)
    ts = torch._foreach_sqrt([m.abs() for m in ms])
    torch._foreach_div_(ts, [2.0, 3.0, 4.0, 5.0])
    torch._foreach_add_(ts, 1e-8)
    torch._foreach_addcdiv_(xs, ms, ts, [-0.1, -0.2, -0.3, -0.4])
    del ts
    tape = build_tape([(x._node, x._out) for x in xs])
    passes.set_memory_budget(1)
    new, rep = split_foreach(tape)
    text = format_tape(new)
    # groups: [256], [8, 8], [256]: three of each of the four ops
    assert text.count("_foreach_sqrt") == 3 and text.count("_foreach_addcdiv_") == 3
    assert len(rep.placeholders) == 1 and rep.removed == -8
    verify(tape, new)
    from genie import memory
    assert memory.tape_high_water(new) < memory.tape_high_water(tape)


def test_a_storage_at_two_positions_is_not_split():
    """A group must not read what another group writes: ``[a, a]`` (or views of one storage)
    stays one instruction."""
    a = torch.randn(256, device=D)
    genie.materialize(a)
    for lst in ([a, a], [a[:128], a[128:]]):
        ts = torch._foreach_sqrt([t.abs() for t in lst])
        torch._foreach_add_(lst, ts)
        tape = build_tape([(a._node, a._out)])
        passes.set_memory_budget(1)
        new, _ = split_foreach(tape)
        assert format_tape(new).count("_foreach_sqrt") == 1
        genie.materialize(a)


def test_scalar_temporaries_are_not_worth_a_split():
    """``clip_grad_norm_``'s ``_foreach_norm`` makes one scalar per gradient: splitting it would
    add instructions to save a few bytes of a tape whose values are kilobytes."""
    gs = [torch.randn(256, device=D) for _ in range(4)]
    genie.materialize(*gs)
    hs = [g * 2 for g in gs]
    total = torch.stack(torch._foreach_norm(hs)).sum()
    tape = build_tape([(t._node, t._out) for t in (total, *hs)])
    passes.set_memory_budget(1)
    assert split_foreach(tape)[0] is tape
    torch._foreach_add_(hs, torch._foreach_sqrt(hs))  # kilobytes of temporaries: split
    tape = build_tape([(t._node, t._out) for t in hs])
    assert format_tape(split_foreach(tape)[0]).count("_foreach_sqrt") == 4
