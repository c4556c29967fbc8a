"""Shape rules (genie.shape_rules) against PyTorch's meta kernels, the oracle they replace.

OpInfo samples of the ops whose ATen calls the rules cover (directly, or through their
decompositions: ``reshape`` -> ``view``, ``matmul`` -> ``bmm``/``expand``, ``stack`` -> ``cat``)
run on meta tensors under a dispatch mode. At every ATen call with a rule, the rule's answer
must equal the meta kernel's output metadata (shape, stride, storage offset, dtype), and where the
meta kernel raises, the rule must have declined (None), so errors stay the kernels'.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from genie.graph import TensorMeta
from genie.shape_rules import KW_RULES, RULES

aten = torch.ops.aten
OPINFOS = ["add", "sub", "mul", "eq", "ne", "le", "lt", "ge", "gt", "view", "reshape", "expand",
           "unsqueeze", "transpose", "cat", "stack", "bmm", "matmul", "flatten", "broadcast_to",
           "div.no_rounding_mode", "where", "tanh", "exp", "neg", "sqrt", "rsqrt", "sigmoid",
           "nn.functional.relu", "pow", "softmax", "log_softmax", "mm", "addmm", "narrow",
           "split", "chunk", "__getitem__", "tensor_split", "slice", "cumsum",
           "nn.functional.layer_norm", "masked_fill", "all", "any", "nn.functional.embedding",
           "clone", "contiguous", "isin", "nn.functional.linear", "tril", "triu", "long",
           "float", "bool", "nn.functional.scaled_dot_product_attention"]
# Composites recorded whole (csrc/whole.cpp): their samples run a second time under
# inference_mode, where the autograd keys that decompose them are skipped and the dispatch mode
# sees the whole op, as genie's record does.
WHOLE_OPINFOS = {"matmul", "nn.functional.linear"}
DTYPES = [torch.float32, torch.int64, torch.float64]


class _Check(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.checked: Counter[str] = Counter()
        self.declined: Counter[str] = Counter()
        self.failures: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        rule, kw_rule = RULES.get(func), KW_RULES.get(func)
        pred = None
        if (rule is not None and not kwargs) or kw_rule is not None:
            margs = tree_map(lambda t: TensorMeta.of(t, 0) if isinstance(t, torch.Tensor) else t,
                             args)
            pred = rule(tuple(margs), 0) if rule is not None else kw_rule(tuple(margs), kwargs, 0)
            if pred is None:
                self.declined[str(func)] += 1
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if pred is not None:
                self.failures.append(f"{func}: meta kernel raised {type(e).__name__} but the "
                                     f"rule answered {pred}")
            raise
        if pred is not None:
            # several outputs: the rule returns them as the op does (a tuple or a list)
            got = TensorMeta.of(out, 0) if isinstance(out, torch.Tensor) else \
                type(out)(TensorMeta.of(t, 0) for t in out)
            if got != pred:
                self.failures.append(f"{func}{_describe(args)}: rule {pred} != meta {got}")
            self.checked[str(func)] += 1
        return out


def _describe(args: tuple) -> str:
    return str(tree_map(lambda t: (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
                        if isinstance(t, torch.Tensor) else t, args))


def _to_meta(x):  # noqa: ANN001, ANN202
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def test_rules_equal_meta_kernels_over_opinfo() -> None:
    check = _Check()
    def name(op):  # noqa: ANN001, ANN202
        return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name

    ops = [op for op in op_db if name(op) in OPINFOS]
    assert {name(op) for op in ops} == set(OPINFOS)
    for op in ops:
        for dtype in DTYPES:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            for s in op.sample_inputs("cpu", dtype):
                inp, args, kwargs = tree_map(_to_meta, (s.input, s.args, s.kwargs))
                for whole in (False, True) if name(op) in WHOLE_OPINFOS else (False,):
                    with check, torch.inference_mode(whole):
                        try:
                            op.op(inp, *args, **kwargs)
                        except Exception:  # noqa: BLE001 - an error sample: the rule declined or fails above
                            pass
            for e in op.error_inputs("cpu") if op.error_inputs_func else ():
                s = e.sample_input
                inp, args, kwargs = tree_map(_to_meta, (s.input, s.args, s.kwargs))
                with check:
                    try:
                        op.op(inp, *args, **kwargs)
                    except Exception:  # noqa: BLE001
                        pass
    assert not check.failures, "\n".join(check.failures[:20])
    # every rule was exercised where it answers (not only declined): the comparison ran
    for op in (aten.view.default, aten.expand.default, aten.unsqueeze.default,
               aten.transpose.int, aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor,
               aten.cat.default, aten.bmm.default, aten.eq.Tensor, aten.le.Tensor,
               aten.div.Tensor, aten.where.self, aten.tanh.default, aten.exp.default,
               aten.neg.default, aten.sqrt.default, aten.rsqrt.default, aten.sigmoid.default,
               aten.relu.default, aten._softmax.default,
               aten._log_softmax.default, aten.mm.default, aten.slice.Tensor,
               aten.cumsum.default, aten.native_layer_norm.default, aten.masked_fill.Scalar,
               aten.all.default, aten.any.default, aten.any.dim, aten.all.dim,
               aten.embedding.default, aten.split.Tensor,
               aten.clone.default, aten.isin.Tensor_Tensor, aten.matmul.default,
               aten.linear.default, aten.tril.default, aten.triu.default,
               aten._to_copy.default, aten.mul.Scalar, aten._safe_softmax.default):
        assert check.checked[str(op)] >= 2, f"{op}: rule answered only {check.checked[str(op)]}x"


@pytest.mark.parametrize("shape,size", [((2, 3, 4), (6, 4)), ((2, 3, 4), (-1,)),
                                        ((1, 4), (4, 1, 1)), ((5,), (5, 1)), ((2, 3), (3, 3)),
                                        ((2, 3), (-1, -1)), ((6,), (0, -1))])
def test_view_rule_matches_or_declines(shape, size) -> None:  # noqa: ANN001
    check = _Check()
    x = torch.empty(shape, device="meta")
    with check:
        try:
            x.view(size)
        except RuntimeError:
            pass
    assert not check.failures, check.failures


# Views of strided inputs (transposes, slices, expands, offsets): q/k/v split out of one
# projection and transposed, as attention does, view as ATen's computeStride says or raise.
_STRIDED = [
    (lambda t: t.transpose(0, 1), (8, 3, 4)), (lambda t: t[:, 1:3], (4, 8)),
    (lambda t: t[1:, :, ::2], (5, 4, 6)), (lambda t: t.unsqueeze(1).expand(4, 3, 6), (4, 6)),
    (lambda t: t.view(2, 4, 3, 2).transpose(1, 2), (8, 6)),
    (lambda t: t[:, :6].view(4, 2, 3), (4, 12)), (lambda t: t.permute(2, 0, 1), (3, 4, 5)),
]


@pytest.mark.parametrize("make,shape", _STRIDED)
@pytest.mark.parametrize("size", [(-1,), (2, -1), (-1, 2), (1, -1, 1), (3, -1), (4, -1)])
def test_view_rule_on_strided_inputs(make, shape, size) -> None:  # noqa: ANN001
    check = _Check()
    x = make(torch.empty(shape, device="meta"))
    answered = []
    with check:
        try:
            x.view(size)
            answered.append(True)
        except RuntimeError:
            pass
    assert not check.failures, check.failures


def test_view_rule_answers_attention_shapes() -> None:
    """The attention pattern whose views the rule used to leave to the meta kernel: heads split
    out of a fused q/k/v projection (a non-contiguous slice), transposed, merged back."""
    from genie.graph import TensorMeta

    view = RULES[aten.view.default]
    qkv = torch.empty(1, 11, 3 * 128, device="meta")
    q = qkv[..., :128]
    heads = q.view(1, 11, 4, 32)
    for x, size in ((q, (1, 11, 4, 32)), (heads.transpose(1, 2).transpose(1, 2), (1, 11, 128))):
        got = view((TensorMeta.of(x, 0), list(size)), 0)
        want = TensorMeta.of(x.view(size), 0)
        assert got == want
    # a 0-dim tensor viewed as one element: the dense rule answers it too
    s = torch.empty((), device="meta")
    for size in ((1,), (1, 1), (-1,)):
        assert view((TensorMeta.of(s, 0), list(size)), 0) == \
            TensorMeta.of(s.view(size), 0)


def test_rules_decide_recording_metadata() -> None:
    """Through genie: with rules on, metadata of recorded ops equals eager's on the CPU."""
    import genie  # noqa: F401
    from genie.config import config

    a, b = torch.randn(2, 3, 4), torch.randn(1, 3, 4)
    for flag in (True, False):
        config.shape_rules = flag
        try:
            la, lb = a.to("remote_accelerator"), b.to("remote_accelerator")
            for f in (lambda p, q: p + q, lambda p, q: (p * q).view(6, 4),
                      lambda p, q: torch.cat([p, q.expand(2, 3, 4)], 1).transpose(0, 2),
                      lambda p, q: torch.bmm(p, q.expand(2, 3, 4).transpose(1, 2)),
                      lambda p, q: p.unsqueeze(1) <= q):
                got, want = f(la, lb), f(a, b)
                assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(),
                                                                want.dtype)
                torch.testing.assert_close(got.cpu(), want)
        finally:
            config.shape_rules = True


def test_scalar_operands_match_or_decline() -> None:
    check = _Check()
    f = torch.empty(2, 3, device="meta")
    i = torch.empty(2, 3, dtype=torch.int64, device="meta")
    h = torch.empty(2, 3, dtype=torch.float16, device="meta")
    with check:
        for x in (f, i, h):
            for s in (2, 0.5, True):
                for fn in (torch.add, torch.sub, torch.mul, torch.eq, torch.ne, torch.le,
                           torch.lt):
                    try:
                        fn(x, s)
                    except RuntimeError:
                        pass
    assert not check.failures, check.failures
    assert sum(check.checked.values()) >= 20, check.checked


def _layouts(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A meta tensor of ``shape`` in a random layout: contiguous, permuted, sliced (gaps),
    expanded from size 1, or channels-last."""
    k = int(torch.randint(0, 5, (1,), generator=gen))
    n = len(shape)
    if k == 1 and n >= 2:  # permuted storage
        perm = torch.randperm(n, generator=gen).tolist()
        base = torch.empty([shape[p] for p in perm], device="meta")
        return base.permute([perm.index(i) for i in range(n)])
    if k == 2 and n >= 1:  # a slice with a gap in the last dimension
        return torch.empty(*shape[:-1], shape[-1] * 2, device="meta")[..., ::2]
    if k == 3 and n >= 1:  # expanded from a size-1 dimension
        d = int(torch.randint(0, n, (1,), generator=gen))
        return torch.empty(*shape[:d], 1, *shape[d + 1:], device="meta").expand(shape)
    if k == 4 and n == 4:
        return torch.empty(shape, device="meta").contiguous(memory_format=torch.channels_last)
    return torch.empty(shape, device="meta")


def test_pointwise_layouts_equal_meta_kernels() -> None:
    """TensorIterator's output layout (csrc/shape_rules.cpp's ``elementwise_strides``) against
    the meta kernels over random operand layouts and broadcasting, for the pointwise rules."""
    gen = torch.Generator().manual_seed(0)
    check = _Check()
    shapes = [(3,), (2, 3), (1, 3), (2, 1, 4), (2, 3, 4), (1, 3, 1, 5), (2, 3, 4, 5), (4, 1, 1, 1)]
    with check:
        for _ in range(400):
            a = shapes[int(torch.randint(0, len(shapes), (1,), generator=gen))]
            b = a[int(torch.randint(0, len(a), (1,), generator=gen)):]  # a suffix: broadcasts
            if torch.rand(1, generator=gen) < 0.5:
                a, b = b, a
            x, y = _layouts(a, gen), _layouts(b, gen)
            c = _layouts(b, gen).to(torch.bool)
            torch.add(x, y)
            torch.mul(y, x)
            torch.div(x, y)
            torch.where(c, x, y)
            torch.tanh(x)
            torch.pow(x, 2)
            torch.add(x, 1.5)
            torch.le(x, y)
            torch.eq(y, 2.0)
            m1, m2 = _layouts((a[-1], 3), gen), _layouts((3, 5), gen)
            torch.addmm(_layouts((5,), gen), m1, m2)
            torch.addmm(_layouts((a[-1], 5), gen), m1, m2)
            torch.mm(m1, m2)
            torch.cat([x, _layouts(a, gen)], -1)
            kv = torch.empty(1, 2, 5, 4, device="meta")
            new = torch.empty(1, 1, 2, 4, device="meta").transpose(1, 2)  # a new token's key
            torch.cat([kv, new], -2)
            torch.cat([_layouts((1, 2, 1, 4), gen), _layouts((1, 2, 1, 4), gen)], 2)
            # a KV cache's first step: a 1-d empty tensor and a transposed key
            torch.cat([torch.empty(0, device="meta"), x], -1)
            torch.cat([torch.empty(0, device="meta"), _layouts((1, 2, 3, 4), gen)], -2)
            torch.cat([_layouts((2, 3, 4, 5), gen), _layouts((2, 3, 4, 5), gen)], 1)
            torch.cumsum(x, -1)
            torch.cumsum(c, 0)
            x.masked_fill(c, 0.5)
            torch.nn.functional.layer_norm(x, x.shape[-1:], _layouts(x.shape[-1:], gen),
                                           _layouts(x.shape[-1:], gen))
            x.clone()
            x.contiguous()
            x.split(2, -1)
            torch.all(c), torch.any(x)
            aten.mul.Scalar(x, 0.5)  # SDPA's math path: q, k scaled; its causal mask, softmax
            aten._safe_softmax(x, -1)
            if len(a) >= 2:
                torch.tril(x), torch.triu(x.bool(), 1)
            x.long(), c.float()
            for z in (torch.empty((), dtype=dt, device="meta") for dt in (
                    torch.bool, torch.int32, torch.int64, torch.float64, torch.float32)):
                torch.mul(x, z), torch.add(x.long(), z), torch.le(z, x)  # a 0-dim operand
    assert not check.failures, "\n".join(check.failures[:20])
    for op in (aten.add.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.where.self,
               aten.tanh.default, aten.pow.Tensor_Scalar, aten.addmm.default, aten.mm.default,
               aten.le.Tensor, aten.eq.Scalar, aten.cat.default, aten.clone.default, aten.split.Tensor,
               aten.all.default, aten.any.default, aten.mul.Scalar, aten._to_copy.default,
               aten._safe_softmax.default):
        assert check.checked[str(op)] >= 200, (op, check.checked[str(op)])
    for op in (aten.masked_fill.Scalar, aten.native_layer_norm.default, aten.tril.default,
               aten.triu.default):  # (some: dense inputs only)
        assert check.checked[str(op)] >= 50, (op, check.checked[str(op)])


@pytest.mark.parametrize("dtype", [None, torch.int64, torch.int32, torch.float32, torch.float64,
                                   torch.float16])
def test_arange_rule_equals_meta_kernel_or_declines(dtype) -> None:  # noqa: ANN001
    """Factory rules read keyword arguments: ``arange`` over every bound/step combination in a
    small range, against the meta kernel (shape, stride, offset, dtype; raises -> declined)."""
    from genie.shape_rules import KW_RULES

    checked = declined = 0
    cases = [(e,) for e in range(-2, 6)] + [(s, e) for s in range(-3, 4) for e in range(-3, 4)]
    cases += [(s, e, st) for s in range(-3, 4) for e in range(-3, 4) for st in (-3, -1, 0, 2, 5)]
    cases += [(0.5, 3), (1, 2.5), (True, 3), (64, 65)]
    ops = {1: aten.arange.default, 2: aten.arange.start, 3: aten.arange.start_step}
    for args in cases:
        op = ops[len(args)]
        kw = {"dtype": dtype, "device": torch.device("remote_accelerator", 0)}
        pred = KW_RULES[op](args, kw, 0)
        try:
            out = op(*args, dtype=dtype, device="meta")
        except RuntimeError:
            assert pred is None, (args, pred)
            continue
        if pred is None:
            declined += 1
            continue
        assert pred == TensorMeta.of(out, 0), (args, dtype, pred, TensorMeta.of(out, 0))
        checked += 1
    if dtype is torch.float16:
        assert checked == 0  # not a dtype the rule takes
    else:
        assert checked >= 100 and declined <= 10, (checked, declined)


def test_arange_rule_through_genie_equals_eager() -> None:
    """Position ids of a decode step: a new ``start`` every step takes the rule, not the meta
    kernel; values, shape, stride and dtype equal eager's."""
    import genie

    before = genie.stats().get("shape_rule_hits", 0)
    for past in range(3, 9):
        got = torch.arange(past, past + 1, device="remote_accelerator")
        want = torch.arange(past, past + 1)
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        assert torch.equal(got.cpu(), want)
        got = torch.arange(0, past, 2, dtype=torch.float32, device="remote_accelerator:0")
        torch.testing.assert_close(got.cpu(), torch.arange(0, past, 2, dtype=torch.float32))
    assert genie.stats().get("shape_rule_hits", 0) - before >= 6


@pytest.mark.parametrize("dtype", [None, torch.int64, torch.float32, torch.bool])
def test_like_and_empty_strided_rules_equal_meta_kernels(dtype) -> None:  # noqa: ANN001
    """``*_like`` and ``empty_strided`` read keyword arguments (device, dtype, memory format):
    against the meta kernel over layouts, or declined."""
    from genie.shape_rules import KW_RULES

    gen = torch.Generator().manual_seed(1)
    dev = torch.device("remote_accelerator", 0)
    checked = 0
    for shape in [(3,), (2, 3), (1, 14), (2, 1, 4), (2, 3, 4, 5), (0, 3)]:
        for _ in range(4):
            x = _layouts(shape, gen)
            for fmt in (None, torch.preserve_format, torch.contiguous_format,
                        torch.channels_last):
                kw = {"dtype": dtype, "device": dev, "pin_memory": False}
                if fmt is not None:
                    kw["memory_format"] = fmt
                for op, extra in ((aten.ones_like.default, ()), (aten.zeros_like.default, ()),
                                  (aten.empty_like.default, ()), (aten.full_like.default, (2,))):
                    pred = KW_RULES[op]((TensorMeta.of(x, 0), *extra), kw, 0)
                    try:
                        out = op(x, *extra, **{**kw, "device": "meta"})
                    except RuntimeError:
                        assert pred is None, (op, shape, fmt, pred)
                        continue
                    if pred is not None:
                        want = TensorMeta.of(out, 0)
                        assert pred == want, (op, shape, x.stride(), fmt, pred, want)
                        checked += 1
        size = list(shape)
        for stride in ([1] * len(shape), list(torch.empty(shape).stride()), [0] * len(shape)):
            kw = {"dtype": dtype, "device": dev}
            pred = KW_RULES[aten.empty_strided.default]((size, stride), kw, 0)
            out = torch.empty_strided(size, stride, dtype=dtype, device="meta")
            assert pred == TensorMeta.of(out, 0), (size, stride, pred)
            checked += 1
    assert checked >= 60, checked


def test_isin_rule_equals_meta_kernel_or_declines() -> None:
    """``isin``: the rule answers contiguous inputs (size-1 dimensions with any stride, as
    ``input_ids[:, -1:]``) as the meta kernel does, and declines the rest; over random layouts."""
    gen = torch.Generator().manual_seed(2)
    rule = KW_RULES[aten.isin.Tensor_Tensor]
    answered = 0
    for shape in [(3,), (2, 3), (1, 14), (2, 1, 4), (2, 3, 4, 5), (0, 3)]:
        for _ in range(6):
            x = _layouts(shape, gen).to(torch.int64)
            for test in (torch.empty(3, dtype=torch.int64, device="meta"),
                         torch.empty(2, 2, dtype=torch.int64, device="meta")):
                for kw in ({}, {"invert": True}, {"assume_unique": True}):
                    pred = rule((TensorMeta.of(x, 0), TensorMeta.of(test, 0)), kw, 0)
                    if pred is not None:
                        assert pred == TensorMeta.of(aten.isin.Tensor_Tensor(x, test, **kw), 0)
                        answered += 1
    x = torch.empty(1, 75, dtype=torch.int64, device="meta")[:, -1:]  # generate's last token
    pred = rule((TensorMeta.of(x, 0), TensorMeta.of(test, 0)), {}, 0)
    assert pred == TensorMeta.of(torch.isin(x, test), 0)
    assert rule((TensorMeta.of(x.float(), 0), TensorMeta.of(test, 0)), {"bad": 1}, 0) is None
    assert answered >= 20, answered


@pytest.mark.parametrize("op", [aten.ones.default, aten.zeros.default])
def test_filled_factory_rules_equal_meta_kernels_or_decline(op) -> None:  # noqa: ANN001
    """``ones(size)``, ``zeros(size)`` (SDPA's causal mask for each new prompt length): over
    sizes and dtypes against the meta kernel, or declined (a negative size: eager's error)."""
    dev = torch.device("remote_accelerator", 0)
    checked = 0
    for size in ([], [3], [11, 11], [2, 0, 4], [1, 3, 1], [-1, 2]):
        for dtype in (None, torch.bool, torch.int64, torch.float64):
            kw = {"dtype": dtype, "device": dev, "pin_memory": False}
            pred = KW_RULES[op]((size,), kw, 0)
            try:
                out = op(size, dtype=dtype, device="meta")
            except RuntimeError:
                assert pred is None, (size, pred)
                continue
            assert pred == TensorMeta.of(out, 0), (size, dtype, pred)
            checked += 1
    assert checked == 20, checked
    assert KW_RULES[op](([2],), {"device": torch.device("cpu")}, 0) is None
    assert KW_RULES[op](([2],), {"layout": torch.sparse_coo}, 0) is None


def test_flash_attention_for_cpu_rule_equals_meta_kernel() -> None:
    """``_scaled_dot_product_flash_attention_for_cpu`` (SDPA on the CPU): output and logsumexp
    as its meta kernel gives them, over query layouts (HF's transposed heads, a q of a fused qkv
    projection's split, decode's one-token query, random layouts) and key lengths; a query with
    a storage offset or of another rank is declined."""
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    rule = KW_RULES[op]
    gen = torch.Generator().manual_seed(3)
    qkv = torch.empty(2, 5, 3 * 4 * 8, device="meta")
    queries = [torch.empty(2, 4, 5, 8, device="meta"),
               torch.empty(2, 5, 4, 8, device="meta").transpose(1, 2),
               qkv[..., :32].view(2, 5, 4, 8).transpose(1, 2),
               torch.empty(1, 1, 4, 8, device="meta").transpose(1, 2),
               torch.empty(1, 4, 1, 8, device="meta")]
    queries += [_layouts(s, gen) for s in [(2, 4, 5, 8), (1, 4, 1, 8), (3, 1, 6, 8)] * 4]
    for q in queries:
        for lk in (1, 5, 9):
            k = torch.empty(q.shape[0], q.shape[1], lk, 8, device="meta")
            for kw in ({}, {"scale": 0.5}, {"attn_mask": torch.empty(q.shape[2], lk,
                                                                       device="meta")}):
                want = op(q, k, k, 0.0, True, **kw)
                got = rule((TensorMeta.of(q, 0), TensorMeta.of(k, 0), TensorMeta.of(k, 0), 0.0,
                            True), {n: TensorMeta.of(v, 0) if isinstance(v, torch.Tensor) else v
                                    for n, v in kw.items()}, 0)
                assert got == tuple(TensorMeta.of(w, 0) for w in want), (q.shape, q.stride())
    sliced = torch.empty(2, 4, 6, 8, device="meta")[:, :, 1:]
    assert rule((TensorMeta.of(sliced, 0),) * 3, {}, 0) is None
    assert rule((TensorMeta.of(torch.empty(4, 5, 8, device="meta"), 0),) * 3, {}, 0) is None


def _offset_layouts(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """``_layouts``' tensor, half of the time placed at a random storage offset of a larger
    storage (a view into a KV cache or a fused projection)."""
    t = _layouts(shape, gen)
    if torch.rand(1, generator=gen) < 0.5:
        return t
    off = int(torch.randint(1, 50, (1,), generator=gen))
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    base = torch.empty(off + extent, device="meta")
    return base.as_strided(t.shape, t.stride(), off)


def test_native_rules_over_random_layouts_and_offsets() -> None:
    """The native rules (csrc/shape_rules.cpp) against the meta kernels over random values of
    shape, stride, storage offset and dtype: the views and slices a decode step takes of its KV
    cache, its matmuls, cat, where, compares and softmax."""
    gen = torch.Generator().manual_seed(4)
    check = _Check()
    shapes = [(3,), (2, 3), (1, 3), (2, 1, 4), (2, 3, 4), (1, 3, 1, 5), (2, 3, 4, 5)]
    dtypes = [torch.float32, torch.float64, torch.int64, torch.float16]

    def pick(seq):  # noqa: ANN001, ANN202
        return seq[int(torch.randint(0, len(seq), (1,), generator=gen))]

    with check:
        for _ in range(300):
            shape = pick(shapes)
            dt = pick(dtypes)
            x = _offset_layouts(shape, gen).to(dt)
            y = _offset_layouts(shape[int(torch.randint(0, len(shape), (1,), generator=gen)):],
                                gen).to(pick(dtypes))
            n = len(shape)
            d = int(torch.randint(-n, n, (1,), generator=gen))
            for f in (lambda: x.view(-1), lambda: x.view(*shape[:-1], 1, shape[-1]),
                      lambda: x.unsqueeze(d), lambda: x.unsqueeze(-1).expand(*shape, 3),
                      lambda: x.transpose(0, d), lambda: x[..., 1:], lambda: x[..., ::2],
                      lambda: x.narrow(d, 0, 1), lambda: x + y, lambda: x * 2, lambda: x - y,
                      lambda: x / y, lambda: x <= y, lambda: x == 1,
                      lambda: torch.where(y > 0, x, x), lambda: torch.cat([x, x], d),
                      lambda: torch.softmax(x, d), lambda: torch.exp(x),
                      lambda: torch.any(x, d), lambda: torch.all(x > 0, d, keepdim=True),
                      lambda: torch.matmul(x, x.transpose(-1, -2)),
                      lambda: torch.matmul(x, _offset_layouts(shape[-1:], gen).to(dt))):
                try:
                    f()
                except (RuntimeError, IndexError):
                    pass
            if dt.is_floating_point:
                a = _offset_layouts((shape[0], 4), gen).to(dt)
                b = _offset_layouts((4, 3), gen).to(dt)
                for f in (lambda: torch.mm(a, b), lambda: torch.addmm(
                        _offset_layouts((3,), gen).to(dt), a, b),
                        lambda: torch.bmm(a.unsqueeze(0), b.unsqueeze(0)),
                        lambda: torch.nn.functional.linear(a, b.t(), None)):
                    try:
                        f()
                    except RuntimeError:
                        pass
    assert not check.failures, "\n".join(check.failures[:20])
    for op in (aten.view.default, aten.expand.default, aten.unsqueeze.default,
               aten.transpose.int, aten.slice.Tensor, aten.add.Tensor, aten.sub.Tensor,
               aten.mul.Tensor, aten.div.Tensor, aten.le.Tensor, aten.eq.Scalar,
               aten.where.self, aten.cat.default,
               aten._softmax.default, aten.exp.default, aten.mm.default, aten.addmm.default,
               aten.bmm.default, aten.any.dim, aten.all.dim):
        assert check.checked[str(op)] >= 20, (op, check.checked[str(op)])


def test_native_rules_decline_what_they_do_not_take() -> None:
    """A native rule answers None (the meta kernel decides) for arguments outside its plain
    cases, never raises for them: bools where ints go, ints past 64 bits, math bits, other
    types, wrong argument counts; a call of the rule itself with a wrong signature is a
    TypeError."""
    x = TensorMeta((2, 3), (3, 1), 0, torch.float32, 0)
    conj = TensorMeta((2, 3), (3, 1), 0, torch.float32, 0, conj=True)
    big = 1 << 70
    junk = [None, True, big, -big, 1.5, "a", [2, 3], (x,), conj, object()]
    for op, rule in [*RULES.items(), *KW_RULES.items()]:
        if not type(rule).__name__ == "builtin_function_or_method":
            continue
        kw = op in KW_RULES
        call = (lambda a: rule(a, {}, 0)) if kw else (lambda a: rule(a, 0))
        for n in range(5):
            for j in junk:
                for args in ((j,) * n, (x, *(j,) * (n - 1)) if n else (),
                             (x, x, *(j,) * max(n - 2, 0))):
                    call(tuple(args))  # None or an answer: never an error
        with pytest.raises(TypeError):
            rule((x,)) if not kw else rule((x,), 0)
    view, arange = RULES[aten.view.default], KW_RULES[aten.arange.default]
    assert view((x, [True, 6]), 0) is None and view((x, [big, 6]), 0) is None
    assert view((conj, [6]), 0) is None and view((x, [6]), 0) == TensorMeta(
        (6,), (1,), 0, torch.float32, 0)
    assert arange((big,), {}, 0) is None and arange((True,), {}, 0) is None
    assert arange((3,), {"bad": 1}, 0) is None and arange((-(1 << 63), 0, -1), {}, 0) is None
