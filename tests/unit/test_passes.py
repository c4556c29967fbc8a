"""Passes: pure tape rewrites, each checked against the unoptimized tape on eager."""

import pytest
import torch

import genie
from genie.config import config
from genie.passes import optimize, verify
from genie.passes.cse import cse
from genie.passes.dce import dce
from genie.planner import Instr, Slot, Tape, build_tape, format_tape

D = "remote_accelerator"


def _tape(*ts):
    return build_tape([(t._node, t._out) for t in ts])


def test_cse_merges_repeated_pure_work_and_verifies():
    x = torch.randn(8, 8, device=D)
    genie.materialize(x)
    a = (x @ x).relu()
    b = (x @ x).relu()  # the same work again
    y = a.sum() + b.sum()
    del a, b
    tape = _tape(y)
    new, report = cse(tape)
    # matmul (recorded whole), relu and, once they are one, the two sums
    assert report.removed == 3 and len(new.instrs) == len(tape.instrs) - 3
    mm = "aten.matmul.default" if config.whole_ops else "aten.mm.default"  # csrc/whole.cpp
    assert format_tape(new).count(mm) == 1
    verify(tape, new)


def test_cse_does_not_merge_across_writes_or_random_ops():
    x = torch.zeros(4, device=D)
    genie.materialize(x)
    a = x * 2
    x.add_(1)  # the second x * 2 reads another value through the same slot
    b = x * 2
    r1 = torch.rand(4, device=D)
    r2 = torch.rand(4, device=D)
    y = a.sum() + b.sum() + (r1 - r2).abs().sum()
    del a, b, r1, r2
    tape = _tape(y, x)
    new, report = cse(tape)
    assert report.removed == 0
    verify(tape, new)


def test_cse_keeps_values_the_program_holds_distinct():
    x = torch.randn(4, device=D)
    genie.materialize(x)
    a, b = x.exp(), x.exp()  # two tensors the program may later change independently
    new, report = cse(_tape(a, b))
    assert report.removed == 0


def test_dce_drops_dead_instructions_but_keeps_effects():
    x = torch.randn(4, device=D)
    genie.materialize(x)
    y = x * 2
    tape = _tape(y)
    (xs,) = tape.inputs
    mul = tape.instrs[0]
    dead = Instr(mul.op, [Slot(xs), 3.0], mul.spec, (100,), None, (100,))
    tape = Tape([dead, *tape.instrs], tape.inputs, tape.outputs, tape.keep, tape.nodes,
                tape.slots, tape.index)
    new, report = dce(tape)
    assert report.removed == 1 and all(i.outs != (100,) for i in new.instrs)
    verify(tape, new)
    z = torch.zeros(3, device=D)
    genie.materialize(z)
    z.add_(1)  # an in-place update: its effect is the point, even if nobody reads its output
    new, report = dce(_tape(z))
    assert report.removed == 0


def test_optimize_on_a_training_step_preserves_every_value():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model.to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    genie.materialize(*model.parameters())
    for _ in range(2):
        opt.zero_grad()
        loss = model(torch.randn(4, 8).to(D)).square().mean()
        loss.backward()
        opt.step()
        tape = _tape(loss, *model.parameters())
        new, reports = optimize(tape)
        verify(tape, new)
        genie.materialize(loss, *model.parameters())
    assert all(r.removed >= 0 for r in reports)


def test_verify_catches_a_wrong_rewrite():
    x = torch.randn(4, device=D)
    genie.materialize(x)
    tape = _tape((x * 2).exp())
    bad_instrs = list(tape.instrs)
    bad_instrs[0] = Instr(bad_instrs[0].op, [bad_instrs[0].leaves[0], 3.0], bad_instrs[0].spec,
                          bad_instrs[0].outs, None, bad_instrs[0].free)
    bad = Tape(bad_instrs, tape.inputs, tape.outputs, tape.keep, tape.nodes, tape.slots)
    with pytest.raises(AssertionError, match="differs in kept value"):
        verify(tape, bad)
