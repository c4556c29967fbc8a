"""The server's narrow opset (issue 27): Core ATen plus a reviewed list; the client decomposes.

The list is data (:data:`genie.remote.allowlist.REVIEWED_GROUPS`, every name with its group's
reason); an op outside it is decomposed by the client (:mod:`genie.remote.decompose`) into ops
the server runs, or refused at the materialization naming the op. The decomposed tape is run here
by the eager backend and compared with eager on the same inputs; the same through a real server
is in ``tests/integration/test_opset_remote.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import genie  # noqa: F401
from genie.backends.eager import run_instrs
from genie.planner import Tape, build_tape
from genie.remote import allowlist
from genie.remote.decompose import NotServedError, for_server, served

D = "remote_accelerator"


def test_every_reviewed_name_is_an_op() -> None:
    """On the PyTorch the list was derived on (another release may lack a few: torch 2.11 has
    no ``_foreach_clone``; those are simply not served there)."""
    names = {o._schema.name.removeprefix("aten::") for o in allowlist.all_aten_overloads()}
    missing = [n for n in allowlist.REVIEWED if n not in names and n + "_" not in names]
    head = allowlist.LIST_FILE.read_text().splitlines()[0]
    if f"PyTorch {torch.__version__.split('+')[0]}" not in head and missing:
        pytest.skip(f"allowlist.txt was derived on another PyTorch ({head}); here {missing} "
                    "do not exist")
    assert not missing, f"REVIEWED names no op of this PyTorch (a typo?): {missing}"


def test_private_ops_are_admitted_only_when_reviewed() -> None:
    core = allowlist.core_bases()
    for n in allowlist.checked_in():
        base = n.removeprefix("aten::").partition(".")[0]
        if base.startswith("_") and not base.startswith("__"):
            fam = base.rstrip("_")
            assert base in core or fam in core or base in allowlist.REVIEWED or \
                fam in allowlist.REVIEWED, n


@pytest.mark.parametrize("name", [
    # finding 1: crashed the server through a missing or lax meta kernel
    "aten::_cummax_helper.default", "aten::_fused_sgd_.default", "aten::_fused_adagrad_.default",
    "aten::_fused_adam_.default", "aten::_segment_reduce_backward.default",
    # finding 3: read past their buffers
    "aten::_compute_linear_combination.default",
    "aten::adaptive_avg_pool3d_backward.grad_input",
    "aten::_transform_bias_rescale_qkv.default", "aten::_ctc_loss.default",
    # ops with a decomposition: the client sends that instead
    "aten::softshrink.default", "aten::celu.default", "aten::rot90.default",
])
def test_ops_outside_the_opset_are_refused(name: str) -> None:
    assert not allowlist.admitted(name)
    assert name not in allowlist.checked_in()


def test_the_opset_is_narrower_than_the_schema_rule() -> None:
    listed = allowlist.checked_in()
    schema_ok = [o for o in allowlist.all_aten_overloads()
                 if (r := allowlist.refusal(o)) is None or r.startswith("outside the server")]
    assert len(listed) < 0.7 * len(schema_ok), (len(listed), len(schema_ok))
    assert "outside the server's opset" in allowlist.why_refused("aten::softshrink.default")


def _expanded(values: list[torch.Tensor]) -> tuple[Tape, Tape]:
    tape = build_tape([(v._node, v._out) for v in values])
    instrs = for_server(tape)
    return tape, Tape(instrs, dict(tape.inputs), list(tape.outputs), set(tape.keep), tape.nodes,
                      tape.slots, tape.index)


CASES = {
    "softshrink": lambda x, y: F.softshrink(x, 0.3),
    "celu": lambda x, y: F.celu(x, 0.7),
    "pixel_shuffle": lambda x, y: F.pixel_shuffle(x.reshape(1, 4, 2, 4), 2),
    "rot90": lambda x, y: torch.rot90(x),
    "trace": lambda x, y: torch.trace(x[:4, :4]),
    "nansum": lambda x, y: torch.nansum(x),
    "aminmax": lambda x, y: torch.aminmax(x, dim=1).max,
    "hardshrink_inplace_chain": lambda x, y: (F.hardshrink(x, 0.5) * y).exp_().sum(1),
    "sinc_then_core": lambda x, y: torch.sinc(x).add_(y).relu(),
    "deg2rad": lambda x, y: torch.deg2rad(x),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_decomposed_tapes_give_eagers_values(name: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    want = CASES[name](x.clone(), y.clone())
    got = CASES[name](x.to(D), y.to(D))
    tape, exp = _expanded([got])
    assert any(not served(i.op) for i in tape.instrs), "the case must need a decomposition"
    assert all(served(i.op) for i in exp.instrs)
    out = run_instrs(exp, torch.device("cpu"))[exp.outputs[0]]
    assert out.shape == want.shape and out.dtype == want.dtype
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.cpu(), want) or torch.allclose(got.cpu(), want)  # embedded: whole op


def test_an_op_with_no_decomposition_is_refused_by_name() -> None:
    A = torch.randn(3, 3)
    LU, piv = torch.linalg.lu_factor(A)
    P, L, U = torch.lu_unpack(LU.to(D), piv.to(D))
    with pytest.raises(NotServedError, match=r"aten::lu_unpack.*does not run.*|lu_unpack") as ei:
        _expanded([L])
    assert "allowlist.py" in str(ei.value) and ".cpu()" in str(ei.value)
    assert isinstance(ei.value, NotImplementedError)


def test_nothing_changes_for_a_tape_of_served_ops() -> None:
    x = torch.randn(3, 3).to(D)
    v = (x @ x).relu().sum()
    tape = build_tape([(v._node, v._out)])
    assert for_server(tape) is tape.instrs  # no copy, no trace


GROUPED = {  # (mat_a, mat_b, offs): the layouts a mixture of experts and its backward use
    "2d_x_3d": (lambda: torch.randn(10, 8), lambda: torch.randn(3, 8, 12), [3, 7, 10]),
    "2d_x_3d_empty_group_and_end_past_rows": (lambda: torch.randn(10, 8),
                                              lambda: torch.randn(3, 8, 12), [3, 3, 20]),
    # mat_b column-major with 6 columns: the output's rows are padded to 16 bytes (stride 8)
    "2d_x_3d_padded_output": (lambda: torch.randn(10, 8),
                              lambda: torch.randn(3, 6, 8).transpose(1, 2), [4, 8, 10]),
    "3d_x_2d": (lambda: torch.randn(3, 6, 8), lambda: torch.randn(8, 12), [4, 4, 12]),
    "2d_x_2d": (lambda: torch.randn(8, 10).t().contiguous().t(), lambda: torch.randn(10, 12),
                [3, 7, 10]),
    "3d_x_3d": (lambda: torch.randn(3, 6, 8), lambda: torch.randn(3, 8, 12), None),
}


@pytest.mark.parametrize("name", sorted(GROUPED))
def test_grouped_mm_is_decomposed_with_eagers_values_and_layout(name: str) -> None:
    """``_grouped_mm`` (transformers' MoE layers on any non-CPU device) has no torch
    decomposition: Genie's own computes every group's product and selects, never reading the
    offsets on the host. Compared with the CPU kernel, values and strides."""
    torch.manual_seed(0)
    make_a, make_b, offs = GROUPED[name]
    a, b = make_a(), make_b()
    o = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    if name == "2d_x_3d":  # an inf in one expert never reaches the rows of another
        b[1, 0, 0] = float("inf")
    want = torch._grouped_mm(a, b, o)
    got = torch._grouped_mm(a.to(D), b.to(D), None if o is None else o.to(D))
    tape, exp = _expanded([got])
    assert any(not served(i.op) for i in tape.instrs)
    assert all(served(i.op) for i in exp.instrs)
    out = run_instrs(exp, torch.device("cpu"))[exp.outputs[0]]
    assert out.shape == want.shape and out.dtype == want.dtype and out.stride() == want.stride()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_grouped_mm_rows_past_the_last_offset_are_zero() -> None:
    """The kernels leave them unwritten (eager's values there are whatever memory held)."""
    a, b = torch.randn(10, 8), torch.randn(3, 8, 12)
    o = torch.tensor([3, 7, 9], dtype=torch.int32)
    got = torch._grouped_mm(a.to(D), b.to(D), o.to(D))
    _, exp = _expanded([got])
    out = run_instrs(exp, torch.device("cpu"))[exp.outputs[0]]
    torch.testing.assert_close(out[:9], torch._grouped_mm(a, b, o)[:9], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[9:], torch.zeros(1, 12))
