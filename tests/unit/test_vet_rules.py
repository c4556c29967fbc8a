"""The vet's effect rules against meta: a differential fuzzer (genie.remote.vet_rules).

For every op with a rule, random operands (every dtype; broadcast, empty, one-element,
transposed, sliced, expanded, channels-last layouts and size-1 dimensions with odd strides;
int/float/complex/bool scalars) go through the rule and through the vet's meta run of the same
instruction: the rule's effect must be meta's (shape, strides, offset, dtype, conj/neg bits,
the storage it shares or the bytes of a fresh one) or the rule must decline; where meta refuses,
the rule must have declined (the vet then raises meta's error). A rule made wrong on purpose is
caught. In-place and ``out=`` overloads have no rule and must decline.
"""

from __future__ import annotations

import os
import random
from typing import Any

import optree
import pytest
import torch

from genie.errors import ExecutionError
from genie.planner import Instr, Slot, Tape
from genie.remote import guard, vet_rules

aten = torch.ops.aten
META = torch.device("meta")
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128]
CASES = 250  # per op


def _layout(rng: random.Random, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of ``shape`` in a random layout over a storage at least as large."""
    kind = rng.choice(["contiguous", "contiguous", "permuted", "sliced", "expanded",
                       "channels_last", "odd_size1", "offset"])
    n = len(shape)
    if kind == "permuted" and n >= 2:
        perm = list(range(n))
        rng.shuffle(perm)
        base = torch.empty([shape[p] for p in perm], dtype=dtype, device=META)
        return base.permute([perm.index(i) for i in range(n)])
    if kind == "sliced" and n >= 1:
        d = rng.randrange(n)
        big = list(shape)
        big[d] = shape[d] * 2 + 1
        return torch.empty(big, dtype=dtype, device=META)[
            (slice(None),) * d + (slice(1, None, 2),)]
    if kind == "expanded" and n >= 1:
        small = [1 if rng.random() < 0.5 else s for s in shape]
        return torch.empty(small, dtype=dtype, device=META).expand(shape)
    if kind == "channels_last" and n == 4:
        return torch.empty(shape, dtype=dtype, device=META).to(memory_format=torch.channels_last)
    if kind == "odd_size1" and n >= 1:
        t = torch.empty(shape, dtype=dtype, device=META)
        stride = [rng.choice([st, 1, 7, 1000]) if s == 1 else st
                  for s, st in zip(shape, t.stride(), strict=True)]
        return torch.empty(4096, dtype=dtype, device=META).as_strided(shape, stride)
    if kind == "offset":
        t = torch.empty(shape, dtype=dtype, device=META)
        return torch.empty(t.numel() + 5, dtype=dtype, device=META).as_strided(
            shape, t.stride(), 3)
    return torch.empty(shape, dtype=dtype, device=META)


def _shape(rng: random.Random, ndim: int | None = None) -> list[int]:
    n = rng.randrange(0, 5) if ndim is None else ndim
    return [rng.choice([0, 1, 1, 2, 3, 5]) if rng.random() < 0.15 else rng.choice([1, 2, 3, 4])
            for _ in range(n)]


def _like(rng: random.Random, shape: list[int]) -> list[int]:
    """A shape that broadcasts with ``shape`` (sometimes one that does not)."""
    out = [1 if rng.random() < 0.3 else s for s in shape]
    out = out[rng.randrange(0, len(out) + 1):] if out and rng.random() < 0.3 else out
    if rng.random() < 0.1:
        out = [s + 1 for s in out]  # mismatched
    if rng.random() < 0.1:
        out = [rng.choice([1, 2])] + out  # more dims
    return out


def _dtype(rng: random.Random) -> torch.dtype:
    return rng.choice(DTYPES)


def _scalar(rng: random.Random) -> Any:
    return rng.choice([2, -3, 0, 87, 1 << 63, -(1 << 63), (1 << 63) - 1, 1 << 70, 0.5, -1.25,
                       float("inf"), float("nan"), True, False, 1 + 2j])


def _tensor(rng: random.Random, shape: list[int], dtype: torch.dtype | None = None
            ) -> torch.Tensor:
    return _layout(rng, shape, dtype or _dtype(rng))


def _binary_args(rng: random.Random) -> list[Any]:
    a = _tensor(rng, _shape(rng))
    if rng.random() < 0.25:
        return [a, _scalar(rng)] if rng.random() < 0.8 else [_scalar(rng), a]
    b = _tensor(rng, _like(rng, list(a.shape)), a.dtype if rng.random() < 0.5 else None)
    if rng.random() < 0.1:
        b = _tensor(rng, [], b.dtype)  # a 0-dim tensor operand
    return [a, b] if rng.random() < 0.7 else [b, a]


def _where_args(rng: random.Random) -> list[Any]:
    s = _shape(rng)
    pred = _tensor(rng, _like(rng, s), torch.bool if rng.random() < 0.85 else None)
    a = _tensor(rng, s)
    b = _tensor(rng, _like(rng, s), a.dtype if rng.random() < 0.5 else None)
    if rng.random() < 0.2:
        a = _tensor(rng, [], a.dtype)
    return [pred, a, b]


def _unsqueeze_args(rng: random.Random) -> list[Any]:
    a = _tensor(rng, _shape(rng))
    return [a, rng.randrange(-a.dim() - 2, a.dim() + 2)]


def _transpose_args(rng: random.Random) -> list[Any]:
    a = _tensor(rng, _shape(rng))
    n = max(a.dim(), 1)
    return [a, rng.randrange(-n - 1, n + 1), rng.randrange(-n - 1, n + 1)]


def _expand_args(rng: random.Random) -> list[Any]:
    a = _tensor(rng, _shape(rng))
    target = [rng.choice([s, s, -1, 3, 1]) if s == 1 else rng.choice([s, s, -1, s + 1])
              for s in a.shape]
    if rng.random() < 0.4:
        target = [rng.choice([1, 2, 3, -1])] + target
    if rng.random() < 0.1 and target:
        target = target[1:]
    return [a, target]


def _cat_args(rng: random.Random) -> list[Any]:
    s = _shape(rng, rng.randrange(1, 5))
    d = rng.randrange(len(s))
    ts = []
    for _ in range(rng.randrange(1, 4)):
        t = list(s)
        t[d] = rng.choice([0, 1, 2, 3])
        if rng.random() < 0.08:
            t = [0]  # the legacy empty 1-D operand
        if rng.random() < 0.05 and t:
            t[(d + 1) % len(t)] += 1  # mismatched
        ts.append(_tensor(rng, t, rng.choice([s_dtype for s_dtype in DTYPES[:3]]) if
                          rng.random() < 0.2 else torch.float32))
    return [ts, rng.choice([d, d - len(s), len(s) + 1])]


def _slice_args(rng: random.Random) -> list[Any]:
    a = _tensor(rng, _shape(rng))
    n = max(a.dim(), 1)
    size = a.shape[0] if a.dim() else 1
    pick = lambda: rng.choice([None, 0, 1, -1, 2, size, size + 3, -size - 2, 2 ** 62])  # noqa
    args = [a, rng.randrange(-n - 1, n + 1), pick(), pick(), rng.choice([1, 1, 2, 3, 0, -1])]
    return args[:rng.randrange(1, 6)]


def _softmax_args(rng: random.Random) -> list[Any]:
    a = _tensor(rng, _shape(rng), rng.choice(DTYPES[6:10]) if rng.random() < 0.8 else None)
    return [a, rng.randrange(-a.dim() - 1, a.dim() + 1), rng.random() < 0.3]


def _matmul_args(rng: random.Random) -> list[Any]:
    batch = _shape(rng, rng.randrange(1, 4))
    n, m, p = (rng.choice([0, 1, 2, 3, 5]) for _ in range(3))
    a = _tensor(rng, [*batch, n, m], rng.choice([torch.float32, torch.float32, _dtype(rng)]))
    b_batch = _like(rng, batch)
    b_shape = [*b_batch, m if rng.random() < 0.9 else m + 1, p]
    if rng.random() < 0.15:
        b_shape = b_shape[-rng.randrange(1, 3):]  # a matrix or a vector: another path
    return [a, _tensor(rng, b_shape, a.dtype if rng.random() < 0.8 else None)]


GEN = {
    **{op: _binary_args for op in (
        aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.eq.Tensor,
        aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor)},
    **{op: (lambda rng: [_tensor(rng, _shape(rng)), _scalar(rng)]) for op in (
        aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar,
        aten.ge.Scalar)},
    aten.where.self: _where_args,
    aten.unsqueeze.default: _unsqueeze_args,
    aten.transpose.int: _transpose_args,
    aten.expand.default: _expand_args,
    aten.cat.default: _cat_args,
    aten.slice.Tensor: _slice_args,
    aten._softmax.default: _softmax_args,
    aten.arange.default: None,  # a factory: test_arange below
    aten.matmul.default: _matmul_args,
}
#: overloads that write (in place, out=) with what they take: no rule, always meta
WRITERS = {
    aten.add_.Tensor: _binary_args, aten.mul_.Tensor: _binary_args,
    aten.le_.Tensor: _binary_args, aten.unsqueeze_.default: _unsqueeze_args,
    aten.transpose_.default: _transpose_args,
}


def _instr(op: Any, args: list[Any], kwargs: dict[str, Any] | None = None
           ) -> tuple[Instr, dict[int, Any], Any]:
    """The one-instruction tape of ``op(*args)`` and the vet's environment of its operands."""
    leaves, spec = optree.tree_flatten((tuple(args), kwargs or {}), none_is_leaf=True)
    ledger = guard._Ledger()
    env: dict[int, Any] = {}
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            env[i] = guard._tv_of(x, ledger, {})
            out.append(Slot(i))
        else:
            out.append(x)
    return Instr(op, out, spec, (100,), None), env, ledger


def _compare(op: Any, args: list[Any], kwargs: dict[str, Any] | None = None) -> str | None:
    """Why the rule disagrees with meta on ``op(*args)`` (None: it agrees or declines)."""
    ins, env, ledger = _instr(op, args, kwargs)
    try:
        vet_rules.effect(op, ins, env, ledger.st)
    except Exception as e:  # the vet would fall back to meta; still a wrong rule
        return f"the rule raised {e!r}"
    got = guard._ruled(op, ins, env, ledger.st)
    try:
        want = guard._infer(ins, env, ledger, 0)
    except ExecutionError as e:
        return None if got is None else f"meta refuses ({e.__cause__!r}), the rule gives {got}"
    if got is not None and got != want:
        return f"rule {got}\n  meta {want}"
    return None


def fuzz(op: Any, n: int = CASES, seed: int = 0) -> tuple[list[str], int]:
    """``n`` random cases of ``op``: the disagreements (with their operands) and how many the
    rule answered."""
    rng = random.Random(hash((str(op), seed)) & 0xFFFFFFFF)
    bad, answered = [], 0
    gen = GEN.get(op) or WRITERS[op]
    for _ in range(n):
        args = gen(rng)
        why = _compare(op, args)
        ins, env, ledger = _instr(op, args)
        answered += guard._ruled(op, ins, env, ledger.st) is not None
        if why is not None:
            desc = [(tuple(a.shape), a.stride(), a.storage_offset(), a.dtype)
                    if isinstance(a, torch.Tensor) else a for a in args]
            bad.append(f"{op}{desc}: {why}")
    return bad, answered


@pytest.fixture(autouse=True)
def _rules_on(monkeypatch):
    """The rules as the vet uses them on the torch they were reviewed for; on another torch
    they are off (the vet runs every op on meta) and the fuzzer says whether they would hold."""
    if not vet_rules.ACTIVE and not os.environ.get("GENIE_FUZZ_OTHER_TORCH"):
        pytest.skip(f"the vet's rules are off on torch {torch.__version__} (reviewed for "
                    f"{vet_rules.REVIEWED}x); GENIE_FUZZ_OTHER_TORCH=1 fuzzes them anyway")
    monkeypatch.setattr(vet_rules, "ACTIVE", True)


def test_every_rule_has_a_fuzzer():
    assert set(vet_rules.RULES) == set(GEN)


def _arange_case(rng: random.Random) -> tuple[list[Any], dict[str, Any]]:
    end = rng.choice([0, 1, 5, 88, -3, 2.5, True, 2 ** 40])
    kw: dict[str, Any] = {}
    for k, choices in (("dtype", [None, torch.int64, torch.float32, torch.int8]),
                       ("layout", [None, torch.strided]),
                       ("device", [torch.device("cpu"), None]),
                       ("pin_memory", [None, False, True])):
        if rng.random() < 0.5:
            kw[k] = rng.choice(choices)
    return [end], kw


def test_arange():
    rng = random.Random(5)
    answered = 0
    for _ in range(CASES):
        args, kw = _arange_case(rng)
        why = _compare(aten.arange.default, args, kw)
        assert why is None, f"arange{args, kw}: {why}"
        ins, env, ledger = _instr(aten.arange.default, args, kw)
        answered += guard._ruled(aten.arange.default, ins, env, ledger.st) is not None
    assert answered >= CASES // 5


@pytest.mark.parametrize("op", [op for op in GEN if GEN[op] is not None], ids=str)
def test_rule_equals_meta(op):
    bad, answered = fuzz(op)
    assert not bad, f"{len(bad)} of {CASES} cases differ from meta:\n" + "\n".join(bad[:5])
    # the fuzzer reaches the rule, not only its refusals
    assert answered >= CASES // 5, f"the rule answered only {answered} of {CASES} cases"


@pytest.mark.parametrize("op", list(WRITERS), ids=str)
def test_writers_have_no_rule(op):
    bad, answered = fuzz(op, 60)
    assert not bad and answered == 0


def test_alpha_and_host_tensors_decline():
    a = torch.empty(3, 4, device=META)
    ins, env, ledger = _instr(aten.add.Tensor, [a, a], {"alpha": 2})
    assert guard._ruled(aten.add.Tensor, ins, env, ledger.st) is None
    ins, env, ledger = _instr(aten.add.Tensor, [a, a])
    ins.leaves[1] = torch.ones(4)  # a host constant
    assert guard._ruled(aten.add.Tensor, ins, env, ledger.st) is None
    c = torch.empty(3, 4, dtype=torch.complex64, device=META)
    ins, env, ledger = _instr(aten.add.Tensor, [c.conj(), c])
    assert guard._ruled(aten.add.Tensor, ins, env, ledger.st) is None


@pytest.mark.parametrize("bug", ["perm", "wrap", "dtype", "expand"])
def test_fuzzer_catches_a_wrong_rule(monkeypatch, bug):
    """A rule made wrong on purpose fails the fuzzer (it can fail)."""
    if bug == "perm":  # outputs always contiguous, whatever the operands' layout
        monkeypatch.setattr(vet_rules, "_perm", lambda shape, strides: list(range(len(shape))))
        op = aten.add.Tensor
    elif bug == "wrap":  # a dimension one past the end admitted
        monkeypatch.setattr(vet_rules, "_wrap", lambda d, n: d + max(n, 1) if d < 0 else d)
        op = aten.unsqueeze.default
    elif bug == "dtype":  # the first operand's dtype, no promotion, no refusal
        monkeypatch.setattr(vet_rules, "_probe", lambda op, spec, vals: next(
            v.dtype for v in vals if type(v) is vet_rules._Op))
        op = aten.sub.Tensor
    else:  # a size-1 dimension expanded keeps its stride
        real = vet_rules._expand

        def wrong(shape, stride, target):
            e = real(shape, stride, target)
            return e and (e[0], [st if st else 1 for st in e[1]])
        monkeypatch.setattr(vet_rules, "_expand", wrong)
        op = aten.expand.default
    bad, _ = fuzz(op)
    assert bad, f"the fuzzer did not catch the {bug} bug"


def test_vet_with_rules_equals_vet_on_meta(monkeypatch):
    """A whole tape: the same peak and the same values' metadata with the rules as without."""
    x = torch.randn(2, 3, 8)
    k = torch.randn(2, 5, 8)
    leaves = [Slot(0), Slot(1), -1, -2]
    tr = Instr(aten.transpose.int, leaves[1:], optree.tree_structure(((0, 0, 0), {})), (2,),
               None)
    mm = Instr(aten.mul.Tensor, [Slot(0), 0.5], optree.tree_structure(((0, 0), {})), (3,),
               None)
    cat = Instr(aten.cat.default, [Slot(0), Slot(1), 1],
                optree.tree_structure((([0, 0], 0), {})), (4,), None)
    un = Instr(aten.unsqueeze.default, [Slot(4), 1], optree.tree_structure(((0, 0), {})),
               (6,), None)
    le = Instr(aten.le.Tensor, [Slot(6), Slot(4)], optree.tree_structure(((0, 0), {})), (5,),
               None)
    tape = Tape([tr, mm, cat, un, le], {0: x, 1: k}, [2, 3, 4, 5], set(), [], {})
    guard._effects.clear()
    with_rules = guard.vet_tape(tape, 1 << 30)
    effects = dict(guard._effects)
    guard._effects.clear()
    monkeypatch.setattr(vet_rules, "RULES", {})
    without = guard.vet_tape(tape, 1 << 30)
    assert with_rules == without and effects == guard._effects
    guard._effects.clear()


def test_off_on_another_torch(monkeypatch):
    """On a torch the rules were not reviewed for, every op goes to meta."""
    monkeypatch.setattr(vet_rules, "ACTIVE", False)
    a = torch.empty(3, 4, device=META)
    ins, env, ledger = _instr(aten.add.Tensor, [a, a])
    assert guard._ruled(aten.add.Tensor, ins, env, ledger.st) is None
    assert guard._infer(ins, env, ledger, 0).outs[0].meta[0] == (3, 4)
