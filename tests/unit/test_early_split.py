"""Where a tape's outputs are final (``native_replay.early_split``), and the native run's early
callback: what a server's early reply (docs/deployment.md, "Early replies") rests on.

A worker answers a replayed tape once instruction ``early_split(tape) - 1`` has run, while the
rest runs. That is right only if nothing after that point writes a storage an output lives in:
each test builds a tape, runs it natively with the callback, and compares the values the callback
saw with the values at the end of the run and with eager on the CPU.
"""

from __future__ import annotations

import optree
import pytest
import torch

from genie.backends import native_replay
from genie.backends.native_replay import early_split
from genie.device import real_device
from genie.planner import Instr, Slot, Tape

from eager_oracle import AUTOGRAD, assert_equal_eager

aten = torch.ops.aten


def ins(op, args, outs, kwargs=None):
    leaves, spec = optree.tree_flatten((args, kwargs or {}), none_is_leaf=True)
    return Instr(op, leaves, spec, outs, None)


def run_early(tape: Tape) -> tuple[int, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """``(split, values the callback saw (cloned), values at the end)`` of a native run."""
    k = early_split(tape)
    seen: dict[int, torch.Tensor] = {}
    prog = native_replay.compile_tape(tape)
    with torch.no_grad():
        out = prog(tape, torch.device("cpu"), k,
                   lambda now: seen.update({s: now[s].clone() for s in tape.outputs}))
    return k, seen, out


def _step(w: torch.Tensor, x: torch.Tensor) -> Tape:
    """A training step's shape: ``loss = (x @ w).sum()``, then ``g = x.t() @ ones`` and
    ``w.sub_(g, alpha=0.1)`` (an update in place of an input); the loss is the output."""
    return Tape([ins(aten.mm.default, (Slot(0), Slot(1)), (2,)),
                 ins(aten.sum.default, (Slot(2),), (3,)),
                 ins(aten.t.default, (Slot(0),), (4,)),
                 ins(aten.ones_like.default, (Slot(2),), (5,)),
                 ins(aten.mm.default, (Slot(4), Slot(5)), (6,)),
                 ins(aten.sub_.Tensor, (Slot(1), Slot(6)), (7,), {"alpha": 0.1})],
                {0: x, 1: w}, [3], {3, 6}, [], {})


def test_a_loss_is_final_before_the_backward_and_update_run() -> None:
    w, x = torch.randn(4, 3), torch.randn(5, 4)
    w0 = w.clone()
    tape = _step(w, x)
    k, seen, out = run_early(tape)
    assert k == 2  # after the sum: the rest (gradient, update) writes nothing the loss holds
    assert torch.equal(seen[3], out[3])
    assert torch.equal(seen[3], (x @ w0).sum())  # eager's loss, before the update
    assert torch.equal(w, torch.sub(w0, x.t() @ torch.ones(5, 3), alpha=0.1))  # ran after


def test_an_output_that_views_an_input_waits_for_the_last_write_to_the_inputs() -> None:
    w, x = torch.randn(4, 3), torch.randn(5, 4)
    tape = _step(w, x)
    tape.instrs.append(ins(aten.select.int, (Slot(1), 0, 0), (8,)))  # w[0]: a view of w
    tape.outputs, tape.keep = [8], {8}
    k, seen, out = run_early(tape)
    assert k == len(tape.instrs)
    w2 = torch.randn(4, 3)
    tape2 = _step(w2, x)
    tape2.instrs.insert(2, ins(aten.select.int, (Slot(1), 0, 0), (8,)))  # viewed before the write
    tape2.outputs, tape2.keep = [8], {8}
    w2_0 = w2.clone()
    k2, seen2, out2 = run_early(tape2)
    assert k2 == len(tape2.instrs)  # the sub_ of w after it writes what the view shows
    assert torch.equal(seen2[8], out2[8])
    assert torch.equal(out2[8], torch.sub(w2_0, x.t() @ torch.ones(5, 3), alpha=0.1)[0])


def test_a_later_in_place_write_through_a_view_of_an_output_is_waited_for() -> None:
    x = torch.randn(6)
    tape = Tape([ins(aten.mul.Tensor, (Slot(0), Slot(0)), (1,)),       # a = x * x (output)
                 ins(aten.view.default, (Slot(1), [2, 3]), (2,)),     # v = a.view(2, 3)
                 ins(aten.exp.default, (Slot(0),), (3,)),
                 ins(aten.mul_.Scalar, (Slot(2), 2.0), (4,)),         # v.mul_(2): writes a
                 ins(aten.exp.default, (Slot(3),), (5,))],
                {0: x}, [1], {1, 5}, [], {})
    k, seen, out = run_early(tape)
    assert k == 4
    assert torch.equal(seen[1], out[1])
    assert torch.equal(out[1], x * x * 2)


def test_writes_through_a_list_argument_count() -> None:
    a, b = torch.randn(3), torch.randn(3)
    tape = Tape([ins(aten.add.Tensor, (Slot(0), Slot(1)), (2,)),       # s = a + b (output)
                 ins(aten.exp.default, (Slot(0),), (3,)),
                 ins(aten._foreach_add_.Scalar, ([Slot(2), Slot(3)], 1.0), ()),  # writes s
                 ins(aten.exp.default, (Slot(3),), (4,)),
                 ins(aten.exp.default, (Slot(4),), (5,))],
                {0: a, 1: b}, [2], {2, 5}, [], {})
    k, seen, out = run_early(tape)
    assert k == 3
    assert torch.equal(seen[2], out[2])
    assert torch.equal(out[2], a + b + 1)


def test_unsafe_view_counts_as_a_view() -> None:
    x = torch.randn(6)
    tape = Tape([ins(aten.mul.Scalar, (Slot(0), 3.0), (1,)),
                 ins(aten._unsafe_view.default, (Slot(1), [2, 3]), (2,)),  # output
                 ins(aten.add_.Scalar, (Slot(1), 1.0), (3,)),             # writes its base
                 ins(aten.exp.default, (Slot(0),), (4,))],
                {0: x}, [2], {2, 4}, [], {})
    k, seen, out = run_early(tape)
    assert k == 3
    assert torch.equal(seen[2], (x * 3 + 1).view(2, 3))


@pytest.mark.parametrize("op", ["upload", "python"])
def test_an_instruction_whose_effects_the_schema_does_not_say_means_no_early_point(op) -> None:
    x = torch.randn(3)
    other = native_replay.UPLOAD if op == "upload" else (lambda t: t)
    tape = Tape([ins(aten.exp.default, (Slot(0),), (1,)),
                 ins(other, (Slot(0),), (2,))],
                {0: x}, [1], {1, 2}, [], {})
    assert early_split(tape) == 2


def test_an_early_callback_that_raises_fails_the_run_at_its_instruction() -> None:
    w, x = torch.randn(4, 3), torch.randn(5, 4)
    tape = _step(w, x)
    prog = native_replay.compile_tape(tape)

    def boom(now):
        raise ValueError("the callback failed")

    with torch.no_grad(), pytest.raises(Exception) as e:
        prog(tape, torch.device("cpu"), 2, boom)
    assert "the callback failed" in str(e.value.__cause__ or e.value)


def test_each_element_of_a_list_of_views_is_a_view() -> None:
    x = torch.randn(6)
    tape = Tape([ins(aten.mul.Scalar, (Slot(0), 3.0), (1,)),
                 ins(aten.unbind.int, (Slot(1),), (2, 3, 4, 5, 6, 7)),  # views of x * 3
                 ins(aten.exp.default, (Slot(0),), (8,)),
                 ins(aten.add_.Scalar, (Slot(5), 1.0), (9,)),           # writes through one
                 ins(aten.exp.default, (Slot(8),), (10,))],
                {0: x}, [7], {7, 10}, [], {})
    k, seen, out = run_early(tape)
    assert k == 4  # the write to element 3 is a write to the base that element 5 views
    assert torch.equal(seen[7], out[7])
    assert torch.equal(out[7], (x * 3)[5])


def test_on_real_tapes_the_values_at_the_early_point_are_the_final_ones(monkeypatch) -> None:
    """Every tape the embedded executor replays natively in a training loop (AdamW's foreach
    updates, views of parameters read after the step) and a GPT-2 forward, run with the early
    callback at ``early_split``: what the callback saw is what the run ends with, and the loop
    is eager's."""
    transformers = pytest.importorskip("transformers")
    orig = native_replay.Program.__call__
    checked = []

    def call(self, tape, dev, split=-1, early=None):
        k = early_split(tape)
        seen = {}
        out = orig(self, tape, dev, k,
                   lambda now: seen.update({s: now[s].clone() for s in tape.outputs}))
        if 0 < k < len(tape.instrs):
            for s in tape.outputs:
                assert torch.equal(seen[s], out[s]), (s, k, len(tape.instrs))
            checked.append(k)
        return out

    monkeypatch.setattr(native_replay.Program, "__call__", call)

    def loop(dev):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 4)).to(dev)
        x, y = torch.randn(6, 8).to(dev), torch.randn(6, 4).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        row = model[0].weight[1]
        out = []
        for i in range(6):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            out.append(loss.item() if i % 2 else row.detach().cpu().clone())
        return out

    got, want = loop("remote_accelerator"), loop(AUTOGRAD)  # eager's kernels: bit-equal
    assert_equal_eager(got, want)
    assert checked, "no tape had an early point: the loop's losses should"
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 50, (1, 7))
    md = m.to("remote_accelerator")
    with torch.no_grad():
        for _ in range(3):
            logits = md(ids.to("remote_accelerator")).logits.cpu()
        m.to(real_device(0))  # eager on the real device's kernels: bit-equal
        assert torch.equal(logits, m(ids.to(real_device(0))).logits.cpu())
