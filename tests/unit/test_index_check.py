"""Index arguments checked before indexing kernels (genie.index_check), on the real device.

Every op of the rule table has a case here: an in-range call passes the check and runs as eager,
an out-of-range one is refused with eager's exception type, and eager on the CPU refuses it too
(the oracle agrees that it is out of range). The table's completeness is checked against the
schemas of the server's allowlist; the batching (one sync for the indices a tape already has),
the mid-tape check and the invalidation by writes run through real tapes. The check raises before
the kernel, so these tests are safe on CUDA too (no ``kernel_error`` marker); an eager oracle
given an out-of-range index runs on the CPU (``_cpu``), never on the real device: on CUDA its
kernel's device-side assert would poison the process (every later test in the worker fails).
"""

from __future__ import annotations

import re
from pathlib import Path

import optree
import pytest
import torch

import genie
from genie import index_check
from genie.config import config
from genie.device import real_device
from genie.index_check import NOT_INDICES, RULES, UNCHECKED, VALUE_ASSERTS, Values, check_call
from genie.planner import Instr, Slot, Tape

aten = torch.ops.aten
L = torch.long
DEV = "remote_accelerator:0"


def _x() -> torch.Tensor:
    return torch.arange(12.0, device=real_device(0)).reshape(3, 4)


def _t(v, dtype=L) -> torch.Tensor:
    return torch.tensor(v, dtype=dtype, device=real_device(0))


def _f(*shape) -> torch.Tensor:
    return torch.rand(*shape, device=real_device(0))


def _logp() -> torch.Tensor:
    return torch.log_softmax(_x(), 1)


#: op base name -> (overload, arguments given the index tensor, good index, bad index, the
#: exception type the check raises (eager's on the CPU), whether eager's CPU kernel refuses the bad
#: index itself: False where it does not check (reads or writes out of bounds; the 3-D adaptive
#: pooling backward corrupts the heap), so the oracle is not run there)
CASES: dict[str, tuple] = {
    "gather": (aten.gather.default, lambda i: (_x(), 0, i), [[2, 0, 1, 0]], [[7, 0, 0, 0]],
               RuntimeError, True),
    "gather_backward": (aten.gather_backward.default, lambda i: (_f(1, 4), _x(), 0, i, False),
                        [[2, 0, 1, 0]], [[0, 3, 0, 0]], RuntimeError, True),
    "scatter": (aten.scatter.src, lambda i: (_x(), 0, i, _f(1, 4)), [[2, 0, 1, 0]],
                [[0, 0, -1, 0]], RuntimeError, True),
    "scatter_": (aten.scatter_.value, lambda i: (_x(), 1, i, 5.0), [[3], [0]], [[4], [0]],
                 RuntimeError, True),
    "scatter_add": (aten.scatter_add.default, lambda i: (_x(), 0, i, _f(1, 4)), [[2, 0, 1, 0]],
                    [[3, 0, 1, 0]], RuntimeError, True),
    "scatter_add_": (aten.scatter_add_.default, lambda i: (_x(), 0, i, _f(1, 4)), [[2, 0, 1, 0]],
                     [[3, 0, 1, 0]], RuntimeError, True),
    "scatter_reduce": (aten.scatter_reduce.two, lambda i: (_x(), 0, i, _f(1, 4), "sum"),
                       [[2, 0, 1, 0]], [[9, 0, 1, 0]], RuntimeError, True),
    "scatter_reduce_": (aten.scatter_reduce_.two, lambda i: (_x(), 0, i, _f(1, 4), "amax"),
                        [[2, 0, 1, 0]], [[9, 0, 1, 0]], RuntimeError, True),
    "index_add": (aten.index_add.default, lambda i: (_x(), 0, i, _f(1, 4)), [2], [3],
                  RuntimeError, True),
    "index_add_": (aten.index_add_.default, lambda i: (_x(), 0, i, _f(1, 4)), [2], [-1],
                   RuntimeError, True),
    "take_along_dim": (aten.take_along_dim.default, lambda i: (_x(), i, 0), [[2, 0, 1, 0]],
                       [[7, 0, 0, 0]], RuntimeError, False),  # eager's CPU kernel reads past
    "cummaxmin_backward": (aten.cummaxmin_backward.default,
                           lambda i: (_f(3, 4), _x(), i.expand(3, 4), 0), [[0, 1, 2, 0]],
                           [[0, 1, 2, 3]], RuntimeError, True),
    "value_selecting_reduction_backward": (
        aten.value_selecting_reduction_backward.default, lambda i: (_f(4), 0, i, [3, 4], False),
        [2, 0, 1, 0], [2, 0, 1, 3], RuntimeError, True),
    "index_select": (aten.index_select.default, lambda i: (_x(), 1, i), [3, 0], [4],
                     IndexError, True),
    "index_select_backward": (aten.index_select_backward.default,
                              lambda i: (_f(3, 1), [3, 4], 1, i), [3], [4], IndexError, True),
    "index_reduce": (aten.index_reduce.default, lambda i: (_x(), 0, i, _f(1, 4), "prod"), [2],
                     [3], IndexError, True),
    "index_reduce_": (aten.index_reduce_.default, lambda i: (_x(), 0, i, _f(1, 4), "mean"), [2],
                      [-3], IndexError, True),
    "index_copy": (aten.index_copy.default, lambda i: (_x(), 0, i, _f(1, 4)), [2], [3],
                   IndexError, True),
    "index_copy_": (aten.index_copy_.default, lambda i: (_x(), 0, i, _f(1, 4)), [2], [3],
                    IndexError, True),
    "index_fill": (aten.index_fill.int_Scalar, lambda i: (_x(), 0, i, 1.0), [-3, 2], [-4],
                   IndexError, True),
    "index_fill_": (aten.index_fill_.int_Scalar, lambda i: (_x(), 1, i, 1.0), [-1], [4],
                    IndexError, True),
    "index": (aten.index.Tensor, lambda i: (_x(), [None, i]), [-4, 3], [4], IndexError, True),
    "index_put": (aten.index_put.default, lambda i: (_x(), [i], _t(1.0, torch.float32)), [-3],
                  [3], IndexError, True),
    "index_put_": (aten.index_put_.default, lambda i: (_x(), [_t([0]), i], _t(1.0, torch.float32)),
                   [3], [-5], IndexError, True),
    "take": (aten.take.default, lambda i: (_x(), i), [-12, 11], [12], IndexError, True),
    "put": (aten.put.default, lambda i: (_x(), i, _f(1)), [11], [-13], IndexError, True),
    "put_": (aten.put_.default, lambda i: (_x(), i, _f(1)), [11], [12], IndexError, True),
    "embedding": (aten.embedding.default, lambda i: (_x(), i), [[0, 2]], [[0, 3]], IndexError,
                  True),
    "embedding_renorm": (aten.embedding_renorm.default, lambda i: (_x(), i, 1.0, 2.0), [2],
                         [3], IndexError, True),
    "embedding_renorm_": (aten.embedding_renorm_.default, lambda i: (_x(), i, 1.0, 2.0), [2],
                          [3], IndexError, True),
    "embedding_backward": (aten.embedding_backward.default,
                           lambda i: (_f(1, 4), i, 3, -1, False, False), [2], [3], IndexError,
                           False),
    "embedding_dense_backward": (aten.embedding_dense_backward.default,
                                 lambda i: (_f(1, 4), i, 3, -1, False), [2], [3], IndexError,
                                 False),
    "nll_loss": (aten.nll_loss.default, lambda i: (_logp(), i), [1, -100, 3], [1, 4, 0],
                 IndexError, True),
    "nll_loss_forward": (aten.nll_loss_forward.default, lambda i: (_logp(), i, None, 1, 2),
                         [2, 3, 0], [1, -1, 2], IndexError, True),
    "nll_loss_backward": (aten.nll_loss_backward.default,
                          lambda i: (_t(1.0, torch.float32), _logp(), i, None, 1, -100,
                                     _t(3.0, torch.float32)), [1, 2, 3], [1, 2, 4],
                          IndexError, True),
    "nll_loss2d": (aten.nll_loss2d.default,
                   lambda i: (torch.log_softmax(_f(1, 4, 1, 2), 1), i), [[[0, 3]]], [[[0, 4]]],
                   IndexError, True),
    "nll_loss2d_forward": (aten.nll_loss2d_forward.default,
                           lambda i: (torch.log_softmax(_f(1, 4, 1, 2), 1), i, None, 1, -100),
                           [[[0, -100]]], [[[-2, 1]]], IndexError, True),
    "nll_loss2d_backward": (aten.nll_loss2d_backward.default,
                            lambda i: (_t(1.0, torch.float32), torch.log_softmax(_f(1, 4, 1, 2),
                                       1), i, None, 1, -100, _t(2.0, torch.float32)),
                            [[[0, 3]]], [[[0, 4]]], IndexError, True),
    "nll_loss_nd": (aten.nll_loss_nd.default, lambda i: (_logp(), i), [0, 1, 2], [0, 1, 5],
                    IndexError, True),
    "cross_entropy_loss": (aten.cross_entropy_loss.default, lambda i: (_x(), i), [3, -100, 0],
                           [3, 4, 0], IndexError, True),
    "multi_margin_loss": (aten.multi_margin_loss.default, lambda i: (_x(), i), [3, 0, 1],
                          [3, 0, 4], RuntimeError, True),
    "multi_margin_loss_backward": (aten.multi_margin_loss_backward.default,
                                   lambda i: (_t(1.0, torch.float32), _x(), i, 1, 1.0),
                                   [3, 0, 1], [-1, 0, 1], RuntimeError, True),
    "max_pool2d_with_indices_backward": (
        aten.max_pool2d_with_indices_backward.default,
        lambda i: (_f(1, 1, 2, 2), _f(1, 1, 4, 4), [2, 2], [2, 2], [0, 0], [1, 1], False, i),
        [[[[0, 3], [9, 15]]]], [[[[0, 3], [9, 16]]]], RuntimeError, False),
    "max_pool3d_with_indices_backward": (
        aten.max_pool3d_with_indices_backward.default,
        lambda i: (_f(1, 1, 1, 1, 1), _f(1, 1, 2, 2, 2), [2, 2, 2], [2, 2, 2], [0, 0, 0],
                   [1, 1, 1], False, i), [[[[[7]]]]], [[[[[8]]]]], RuntimeError, False),
    "adaptive_max_pool2d_backward": (aten.adaptive_max_pool2d_backward.default,
                                     lambda i: (_f(1, 1, 1, 1), _f(1, 1, 2, 2), i),
                                     [[[[3]]]], [[[[4]]]], RuntimeError, False),
    "adaptive_max_pool3d_backward": (aten.adaptive_max_pool3d_backward.default,
                                     lambda i: (_f(1, 1, 1, 1, 1), _f(1, 1, 2, 2, 2), i),
                                     [[[[[7]]]]], [[[[[-1]]]]], RuntimeError, False),
    "fractional_max_pool2d_backward": (aten.fractional_max_pool2d_backward.default,
                                       lambda i: (_f(1, 1, 1, 1), _f(1, 1, 2, 2), [2, 2], [1, 1],
                                                  i), [[[[3]]]], [[[[4]]]], RuntimeError, True),
    "fractional_max_pool3d_backward": (aten.fractional_max_pool3d_backward.default,
                                       lambda i: (_f(1, 1, 1, 1, 1), _f(1, 1, 2, 2, 2),
                                                  [2, 2, 2], [1, 1, 1], i), [[[[[7]]]]],
                                       [[[[[8]]]]], RuntimeError, True),
    "one_hot": (aten.one_hot.default, lambda i: (i, 4), [3, 0], [4, 0], RuntimeError, True),
    "max_unpool2d": (aten.max_unpool2d.default, lambda i: (_f(1, 1, 1, 2), i, [2, 2]),
                     [[[[0, 3]]]], [[[[0, 4]]]], RuntimeError, True),
    "max_unpool3d": (aten.max_unpool3d.default,
                     lambda i: (_f(1, 1, 1, 1, 2), i, [1, 2, 2], [1, 1, 1], [0, 0, 0]),
                     [[[[[0, 3]]]]], [[[[[0, 4]]]]], RuntimeError, True),
}


NAN, INF = float("nan"), float("inf")
F32 = torch.float32


#: op base name -> (overload, arguments given the checked tensor, in-range values, a list of
#: out-of-range values (each fails in another way), the dtype of the values). Eager's CPU kernel
#: refuses each out-of-range case itself: the check must raise its exception type and text.
VALUE_CASES: dict[str, tuple] = {
    "bernoulli": (aten.bernoulli.default, lambda v: (v,), [0.0, 0.5, 1.0],
                  [[0.5, 1.5], [-0.1, 0.2], [NAN, 0.5]], F32),
    "bernoulli_": (aten.bernoulli_.Tensor, lambda v: (_f(3), v), [1.0, 0.0, 0.25],
                   [[1.0, 0.0, 2.0], [0.0, NAN, 0.0]], F32),
    "binary_cross_entropy": (aten.binary_cross_entropy.default,
                             lambda v: (v, _t([0.5, 1.0], F32)), [0.0, 1.0],
                             [[1.5, 0.5], [NAN, 0.5], [-INF, 0.5]], F32),
    "multinomial": (aten.multinomial.default, lambda v: (v, 3, True), [[0.2, 0.8], [1.0, 0.0]],
                    [[[0.2, -0.8], [1.0, 0.0]], [[0.2, NAN], [1.0, 0.0]],
                     [[0.2, INF], [1.0, 0.0]], [[0.0, 0.0], [1.0, 0.0]]], F32),
    "masked_scatter": (aten.masked_scatter.default, lambda m: (_x(), m, _f(6)),
                       [True, False, True, False], [[True, False, True, True]], torch.bool),
    "masked_scatter_": (aten.masked_scatter_.default, lambda m: (_x(), m, _f(4)),
                        [[False], [True], [False]], [[[True], [False], [True]]], torch.bool),
    "repeat_interleave": (aten.repeat_interleave.Tensor, lambda r: (r,), [1, 0, 2],
                          [[1, 1, 2], [3, -1, 1], [-1, 2, 2]], L),
}
# each case's output_size: the sum of its in-range repeats
VALUE_KWARGS = {"repeat_interleave": {"output_size": 3}}


def test_every_rule_has_a_case() -> None:
    cases = set(CASES) | set(VALUE_CASES)
    assert set(RULES) == cases, set(RULES) ^ cases


def _cpu(tree):
    return optree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, tree,
                           none_is_leaf=True)


_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.parametrize("name", sorted(VALUE_CASES))
def test_each_value_rule_refuses_what_eager_refuses(name: str) -> None:
    if name == "repeat_interleave" and _TORCH < (2, 13):
        # The oracle itself: on torch 2.11 (the GPU machine's), eager CPU repeat_interleave with
        # output_size and a negative repeat aborts the process instead of raising.
        pytest.skip("eager's repeat_interleave aborts on a negative repeat before torch 2.13")
    op, make, good, bads, dtype = VALUE_CASES[name]
    kw = VALUE_KWARGS.get(name, {})
    torch.manual_seed(0)
    want = op(*_cpu(make(_t(good, dtype))), **kw)
    torch.manual_seed(0)
    args = make(_t(good, dtype))
    check_call(op, args, kw)  # in range: passes, and draws no random numbers: eager's values
    assert torch.equal(op(*_cpu(args), **kw), want)
    for bad in bads:
        with pytest.raises(Exception) as eager:  # noqa: B017 (the oracle: whatever eager raises)
            op(*_cpu(make(_t(bad, dtype))), **kw)
        with pytest.raises(type(eager.value)) as ei:
            check_call(op, make(_t(bad, dtype)), kw)
        assert str(ei.value) == str(eager.value), (bad, ei.value, eager.value)


def test_value_rules_leave_what_eagers_host_code_checks() -> None:
    """A probability given as a number, ``repeat_interleave`` without ``output_size``: eager's
    host code checks these (it syncs anyway), so the check reduces nothing; bool probabilities
    and empty tensors hold nothing."""
    genie.reset_stats()
    x = _f(2, 3)
    check_call(aten.bernoulli.p, (x, 1.5), {})
    check_call(aten.bernoulli_.float, (x, 1.5), {})
    check_call(aten.repeat_interleave.Tensor, (_t([-1, 2]),), {})
    check_call(aten.bernoulli.Tensor, (x, _t([True, False], torch.bool)), {})
    check_call(aten.bernoulli.default, (_f(0),), {})
    check_call(aten.binary_cross_entropy.default, (_f(0), _f(0)), {})
    check_call(aten.masked_scatter.default, (_f(0, 3), _t([], torch.bool), _f(0)), {})
    assert "index_checks" not in genie.stats()


def test_value_rules_read_the_overload_they_check() -> None:
    x = _f(3)
    with pytest.raises(RuntimeError, match="p_in >= 0"):  # bernoulli(self, p): p, not self
        check_call(aten.bernoulli.Tensor, (x, _t([0.5, 2.0, 0.0], F32)), {})
    check_call(aten.bernoulli.Tensor, (x + 5, _t([0.5, 1.0, 0.0], F32)), {})
    # one repeat for every slice of dim (self_Tensor): 2 per row of 3 rows = 6
    check_call(aten.repeat_interleave.self_Tensor, (_x(), _t([2]), 0), {"output_size": 6})
    with pytest.raises(RuntimeError, match="allocated size does not match"):
        check_call(aten.repeat_interleave.self_Tensor, (_x(), _t([2]), 0), {"output_size": 5})
    check_call(aten.repeat_interleave.self_Tensor, (_x(), _t([1, 2, 0]), 0), {"output_size": 3})
    with pytest.raises(RuntimeError, match="Number of elements of source"):  # the broadcast mask
        check_call(aten.masked_scatter.default, (_x(), _t([[True], [False], [True]], torch.bool),
                                                 _f(7)), {})


def test_multinomials_fast_path_is_checked_too() -> None:
    """Drawing once, or without replacement, ``multinomial`` takes its fast path, whose checks
    are ``_assert_async`` in recent PyTorch: a device-side assert on CUDA. Eager's CPU texts."""
    for args in ((1, True), (2, False), (1, False)):
        check_call(aten.multinomial.default, (_t([[0.2, 0.8], [1.0, 0.0]], F32), *args), {})
        for bad in ([[0.2, -0.8], [1.0, 0.0]], [[0.2, NAN], [1.0, 0.0]],
                    [[INF, 0.8], [1.0, 0.0]], [[0.0, 0.0], [1.0, 0.0]]):
            with pytest.raises(RuntimeError) as eager:
                aten.multinomial.default(torch.tensor(bad), *args)
            with pytest.raises(RuntimeError) as ei:
                check_call(aten.multinomial.default, (_t(bad, F32), *args), {})
            assert str(ei.value) == str(eager.value), (args, bad, ei.value, eager.value)


def test_half_precision_values_and_row_sums_that_overflow_the_dtype() -> None:
    """Values are judged in float64 (bits carried exactly through the one int64 copy); a
    ``multinomial`` row whose sum overflows its dtype is refused: CUDA renormalizes in it."""
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        check_call(aten.bernoulli.default, (_t([0.0, 1.0], dt),), {})
        with pytest.raises(RuntimeError, match="p_in >= 0"):
            check_call(aten.bernoulli.default, (_t([0.0, 1.0 + 2 ** -7], dt),), {})
    big = _t([[60000.0, 60000.0]], torch.float16)
    with pytest.raises(RuntimeError, match="overflows torch.float16"):
        check_call(aten.multinomial.default, (big, 2, True), {})
    check_call(aten.multinomial.default, (big.float(), 2, True), {})


def test_the_audit_has_a_rule_or_a_refusal_for_every_served_op() -> None:
    """Every op of the allowlist whose CUDA kernel asserts on argument values (VALUE_ASSERTS,
    the audit) has a value rule or is refused where checks are on; every value rule is for an
    audited op; every audited op is served or refused for its missing rule."""
    path = Path(genie.__file__).parent / "remote" / "allowlist.txt"
    served = {ln.split("::")[1].partition(".")[0] for ln in path.read_text().splitlines()
              if ln.strip() and not ln.startswith("#")}
    missing = [n for n in VALUE_ASSERTS if n in served and n not in UNCHECKED and
               not any(type(r) is Values for r in RULES.get(n, ()))]
    assert not missing, (f"ops whose CUDA kernels assert on values and have neither a value "
                         f"rule nor a refusal: {missing}; add a Values rule or an UNCHECKED "
                         "reason")
    ruled = {n for n, rules in RULES.items() if any(type(r) is Values for r in rules)}
    assert ruled <= set(VALUE_ASSERTS), ruled - set(VALUE_ASSERTS)
    # an audited op the server does not run (outside its opset since rule version 2) must be
    # one the audit found unsafe without a rule: the narrower opset dropped it for that reason
    assert set(VALUE_ASSERTS) - served <= set(UNCHECKED), set(VALUE_ASSERTS) - served


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule_refuses_what_eager_refuses(name: str) -> None:
    op, make, good, bad, etype, eager_checks = CASES[name]
    check_call(op, make(_t(good)), {})
    op(*make(_t(good)))  # in range: eager runs it
    with pytest.raises(etype) as ei:
        check_call(op, make(_t(bad)), {})
    assert "out of" in str(ei.value) or "invalid" in str(ei.value), ei.value
    if eager_checks:  # the oracle: eager's CPU kernel refuses the same indices
        with pytest.raises((IndexError, RuntimeError)):
            op(*_cpu(make(_t(bad))))


def test_cpu_checks_says_what_eagers_cpu_kernels_do() -> None:
    """A rule is marked ``cpu_checks=False`` exactly where eager's CPU kernel let the case's
    out-of-range index through (a CPU server checks those by default)."""
    for name, case in CASES.items():
        assert case[5] == all(r.cpu_checks for r in RULES[name]), name


def test_messages_say_eagers_words() -> None:
    x = _x()
    with pytest.raises(RuntimeError,
                       match=r"^index 7 is out of bounds for dimension 0 with size 3$"):
        check_call(aten.gather.default, (x, 0, _t([[7]])), {})
    # advanced indexing: the "dimension" is the index tensor's position among the defined
    # ones, as eager's CPU kernel says it (x[:, i] names dimension 0); eager is asked here
    for indices in ([None, _t([-5])], [_t([0]), _t([9])], [_t([9]), None]):
        with pytest.raises(IndexError) as want:  # eager on the CPU (on CUDA: a device assert)
            aten.index.Tensor(*_cpu((x, indices)))
        with pytest.raises(IndexError, match=f"^{re.escape(str(want.value))}$"):
            check_call(aten.index.Tensor, (x, indices), {})
    with pytest.raises(IndexError, match=r"^Target 4 is out of bounds\.$"):
        check_call(aten.nll_loss.default, (x, _t([4, 0, 0])), {})


def test_masks_floats_and_empty_indices_are_not_indices() -> None:
    x = _x()
    check_call(aten.index.Tensor, (x, [_t([True, False, True], torch.bool)]), {})
    check_call(aten.index.Tensor, (x, [_t([1, 0, 1], torch.uint8), _t([3])]), {})
    mask = [_t([True, False, True], torch.bool), _t([4])]
    with pytest.raises(IndexError, match="dimension 1 with size 4"):  # after a 1-D mask
        aten.index.Tensor(*_cpu((x, mask)))  # (eager's words, on the CPU: CUDA's kernel asserts)
    with pytest.raises(IndexError, match="dimension 1 with size 4"):
        check_call(aten.index.Tensor, (x, mask), {})
    check_call(aten.cross_entropy_loss.default, (x, torch.softmax(_f(3, 4), 1)), {})
    check_call(aten.gather.default, (x, 0, _t([[]]).reshape(1, 0)), {})
    check_call(aten.embedding.default, (torch.zeros(0, 4), _t([]).reshape(0)), {})


def test_one_hot_without_num_classes_bounds_only_below() -> None:
    check_call(aten.one_hot.default, (_t([0, 9]), -1), {})
    with pytest.raises(RuntimeError, match="class value -1"):
        check_call(aten.one_hot.default, (_t([0, -1]), -1), {})


def _schema_index_args(op) -> list[str]:
    out = []
    for a in op._schema.arguments:
        ty = str(a.type)
        written = a.alias_info is not None and a.alias_info.is_write
        if "Tensor" in ty and a.name in index_check.INDEX_NAMES and not written:
            out.append(a.name)
    return out


def test_the_table_covers_every_allowlisted_op_with_index_arguments() -> None:
    """Derived from the schemas: every op of the server's allowlist that reads a tensor argument
    named like an index is checked (RULES), refused where checks are on (UNCHECKED) or has a
    reason it holds no device indices (NOT_INDICES)."""
    path = Path(genie.__file__).parent / "remote" / "allowlist.txt"
    missing = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        ns, rest = line.split("::")
        base, _, ov = rest.partition(".")
        packet = getattr(getattr(torch.ops, ns), base, None)
        if packet is None or not hasattr(packet, ov or "default"):
            continue  # the list is derived on one PyTorch release; this one lacks the op
        op = getattr(packet, ov or "default")
        if _schema_index_args(op) and base not in RULES and base not in UNCHECKED and \
                base not in NOT_INDICES:
            missing.append(line)
    assert not missing, (f"ops with index arguments and no entry in genie.index_check: "
                         f"{missing}; add a rule, or say why in UNCHECKED/NOT_INDICES")
    for name, rules in RULES.items():  # every rule names arguments its schemas have
        packet = getattr(aten, name)
        names = {a.name for ov in packet.overloads()
                 for a in getattr(packet, ov)._schema.arguments}
        for r in rules:
            if type(r) is Values:
                assert r.arg in names and r.ref in (None, *names), (name, r)
                continue
            assert r.index in names and r.ref in names, (name, r)
            assert r.kind != "dim" or r.dim in names, (name, r)
    for name in (*UNCHECKED, *NOT_INDICES):
        assert hasattr(aten, name), name


# --- tapes: batching, mid-tape indices, writes ---------------------------------------------------

@pytest.fixture
def checked(monkeypatch):
    monkeypatch.setattr(config, "index_check", "1")
    yield


def test_in_process_flag_off_by_default_and_on_with_genie_index_check(checked) -> None:
    x = torch.arange(12.0).reshape(3, 4)
    d = x.to(DEV)
    with pytest.raises(RuntimeError, match="index 7 is out of bounds") as ei:
        d.gather(0, torch.tensor([[7]]).to(DEV)).cpu()
    assert isinstance(ei.value, genie.ExecutionError) and "gather" in str(ei.value)
    assert genie.stats()["index_check_refusals"] == 1  # refused by the check, not the kernel
    idx = torch.tensor([[2, 0, 1, 0]])
    assert torch.equal(d.gather(0, idx.to(DEV)).cpu(), x.gather(0, idx))


def test_a_repeated_plan_is_checked_too(checked) -> None:
    """A plan's later uses would run as generated or native replays, which do not check: with
    the check on they run in the interpreter."""
    x = torch.arange(12.0).reshape(3, 4)
    d = x.to(DEV)
    for v in (0, 1, 2, 1):
        idx = torch.tensor([[v, 0, 0, 0]])
        assert torch.equal(d.gather(0, idx.to(DEV)).cpu(), x.gather(0, idx))
    with pytest.raises(RuntimeError, match="index 3 is out of bounds"):
        d.gather(0, torch.tensor([[3, 0, 0, 0]]).to(DEV)).cpu()
    s = genie.stats()
    assert s["index_check_refusals"] == 1 and s.get("plan_cache_hits", 0) >= 2, s


def test_indices_a_tape_holds_are_reduced_in_one_sync(checked) -> None:
    w = torch.randn(10, 4)
    p = torch.randn(6, 4)
    ids, pos = torch.tensor([[1, 9, 3]]), torch.tensor([[0, 1, 2]])
    wd, pd, idd, posd = (t.to(DEV) for t in (w, p, ids, pos))
    genie.materialize(wd, pd, idd, posd)
    genie.reset_stats()
    y = torch.nn.functional.embedding(idd, wd) + torch.nn.functional.embedding(posd, pd)
    assert torch.allclose(y.cpu(), w[ids] + p[pos])
    s = genie.stats()
    assert s["index_checks"] == 2 and s["index_check_syncs"] == 1, s


def test_an_index_computed_in_the_tape_is_checked_before_its_use(checked) -> None:
    x = torch.arange(12.0).reshape(3, 4)
    i = torch.tensor([1]).to(DEV)
    genie.materialize(i)
    genie.reset_stats()
    with pytest.raises(IndexError, match="index 6"):
        x.to(DEV).index_select(0, i + 5).cpu()
    j = i * 2
    assert torch.equal(x.to(DEV).index_select(0, j).cpu(), x[[2]])
    assert genie.stats()["index_check_syncs"] == 2


def test_values_are_checked_in_the_same_sync_as_indices(checked) -> None:
    """A tape with an index and a probability among its inputs: both reduced in one sync; an
    out-of-range probability is refused with eager's error, the session going on."""
    w, ids, p = torch.randn(10, 4), torch.tensor([[1, 9, 3]]), torch.tensor([[0.0, 1.0, 1.0]])
    wd, idd, pd = (t.to(DEV) for t in (w, ids, p))
    genie.materialize(wd, idd, pd)
    genie.reset_stats()
    y = torch.nn.functional.embedding(idd, wd) * torch.bernoulli(pd).unsqueeze(-1)
    assert torch.equal(y.cpu(), w[ids] * p.unsqueeze(-1))  # p in {0, 1}: eager's values
    s = genie.stats()
    assert s["index_checks"] == 2 and s["index_check_syncs"] == 1, s
    with pytest.raises(RuntimeError, match=r"Expected p_in >= 0 && p_in <= 1") as ei:
        torch.bernoulli(torch.tensor([0.5, 1.5]).to(DEV)).cpu()
    assert isinstance(ei.value, genie.ExecutionError) and "bernoulli" in str(ei.value)
    assert genie.stats()["index_check_refusals"] == 1
    with pytest.raises(RuntimeError, match="all elements of input should be between 0 and 1"):
        torch.nn.functional.binary_cross_entropy(pd * 2, pd).cpu()  # computed in the tape
    assert torch.equal(torch.bernoulli(pd * 1).cpu(), p)


def _tape(instrs, inputs, outputs):
    return Tape(instrs, inputs, list(outputs), set(outputs), [], {})  # no nodes: a raw tape


def _ins(op, args, outs, free=()):
    tree = (tuple(args), {})
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    return Instr(op, leaves, spec, tuple(outs), None, tuple(free))


def test_a_write_to_a_checked_index_invalidates_it() -> None:
    """A hand-made tape (what a hostile client can send): the index is reduced before the
    first gather, then written in place, then read by a second gather through the same slot."""
    from genie.remote.guard import run_guarded

    x, idx = _x(), _t([[1, 0, 2, 0]])
    tape = _tape([_ins(aten.gather.default, (Slot(0), 0, Slot(1)), (2,)),
                  _ins(aten.add_.Scalar, (Slot(1), 5), (3,)),
                  _ins(aten.gather.default, (Slot(0), 0, Slot(1)), (4,))],
                 {0: x, 1: idx.clone()}, (2, 4))
    ix = index_check.IndexCheck(tape)
    with pytest.raises(genie.ExecutionError, match="index 7 is out of bounds") as ei:
        run_guarded(tape, x.device, 1 << 20, index_check=ix)
    assert ei.value.index == 2 and ix.syncs == 2
    # a view of the index written through another slot: the same storage, also forgotten
    tape = _tape([_ins(aten.alias.default, (Slot(1),), (5,)),
                  _ins(aten.gather.default, (Slot(0), 0, Slot(1)), (2,)),
                  _ins(aten.mul_.Scalar, (Slot(5), 9), (3,)),
                  _ins(aten.gather.default, (Slot(0), 0, Slot(1)), (4,))],
                 {0: x, 1: idx.clone()}, (2, 4))
    ix = index_check.IndexCheck(tape)
    with pytest.raises(genie.ExecutionError, match="index 18 is out of bounds"):
        run_guarded(tape, x.device, 1 << 20, index_check=ix)
    assert ix.syncs == 2  # reduced again after the write (a stale (min, max) would pass it)


def test_a_write_to_checked_values_invalidates_them() -> None:
    """Probabilities reduced before a first bernoulli, then written in place (a hostile tape):
    reduced again before the second, which is refused."""
    from genie.remote.guard import run_guarded

    p = _t([0.0, 1.0], F32)
    tape = _tape([_ins(aten.bernoulli.default, (Slot(0),), (1,)),
                  _ins(aten.add_.Tensor, (Slot(0), Slot(0)), (2,)),
                  _ins(aten.bernoulli.default, (Slot(0),), (3,))], {0: p.clone()}, (1, 3))
    ix = index_check.IndexCheck(tape)
    with pytest.raises(genie.ExecutionError, match="p_in >= 0") as ei:
        run_guarded(tape, p.device, 1 << 20, index_check=ix)
    assert ei.value.index == 2 and ix.syncs == 2 and ix.refused == 1


def test_a_slot_written_again_is_reduced_again() -> None:
    """A freed slot named again by a later instruction holds a new value: reduced again (a
    second sync; a stale reduction would let the kernel see index 8)."""
    from genie.remote.guard import run_guarded

    x = _x()
    tape = _tape([_ins(aten.gather.default, (Slot(0), 0, Slot(1)), (2,), free=(1,)),
                  _ins(aten.full.default, ([1, 4], 8), (1,)),
                  _ins(aten.gather.default, (Slot(0), 0, Slot(1)), (4,))],
                 {0: x, 1: _t([[1, 0, 2, 0]])}, (2, 4))
    ix = index_check.IndexCheck(tape)
    with pytest.raises(genie.ExecutionError, match="index 8 is out of bounds") as ei:
        run_guarded(tape, x.device, 1 << 20, index_check=ix)
    assert ei.value.index == 2 and ix.syncs == 2


def test_unchecked_ops_are_refused_where_the_check_is_on(checked) -> None:
    w = torch.randn(5, 4)
    with pytest.raises(RuntimeError, match="not served where index arguments are checked"):
        torch.nn.functional.embedding_bag(torch.tensor([1, 2]).to(DEV), w.to(DEV),
                                          torch.tensor([0]).to(DEV)).cpu()


def test_a_cpu_server_checks_the_kernels_that_do_not_by_default() -> None:
    """``auto`` on a CPU server: only the rules whose CPU kernels do not bound their indices
    (refused before the kernel, so safe on any device), no refusal of unchecked ops."""
    from genie.remote.guard import run_guarded

    assert index_check.server_scope("auto", torch.device("cpu")) == "cpu"
    assert index_check.server_scope("auto", torch.device("cuda")) == "all"
    assert index_check.server_scope("1", torch.device("cpu")) == "all"
    assert index_check.server_scope("0", torch.device("cuda")) is None
    x, g = _x(), _f(1, 4)
    tape = _tape([_ins(aten.gather.default, (Slot(0), 0, Slot(1)), (2,)),
                  _ins(aten.embedding_bag.default, (Slot(0), Slot(1), Slot(4)), (5, 6, 7, 8)),
                  _ins(aten.embedding_dense_backward.default, (Slot(3), Slot(1), 3, -1, False),
                       (9,))],
                 {0: x, 1: _t([[1, 0, 2, 0]]), 3: g.expand(1, 4, 4), 4: _t([0])}, (2, 9))
    assert sorted(index_check.IndexCheck(tape, "cpu").plan) == [2]
    assert sorted(index_check.IndexCheck(tape).plan) == [0, 1, 2]
    tape = _tape([_ins(aten.embedding_dense_backward.default, (Slot(3), Slot(1), 3, -1, False),
                       (9,))], {1: _t([[1, 0, 3, 0]]), 3: g.expand(1, 4, 4)}, (9,))
    ix = index_check.IndexCheck(tape, "cpu")
    with pytest.raises(IndexError, match="index out of range in self") as ei:
        run_guarded(tape, x.device, 1 << 20, index_check=ix)
    assert ei.value.index == 0 and ix.refused == 1


def test_the_setting_says_what_it_takes() -> None:
    assert index_check.enabled("auto", torch.device("cuda")) is True
    assert index_check.enabled("auto", torch.device("cpu")) is False
    assert index_check.enabled("1", torch.device("cpu")) is True
    assert index_check.enabled("0", torch.device("cuda")) is False
    with pytest.raises(ValueError, match="expected auto, 1"):
        index_check.enabled("yes please", torch.device("cpu"))
