"""The per-op adversarial fuzzer (issue 27): every op a server admits, called as an attacker would.

For each admitted overload (``genie/remote/allowlist.txt``), calls are generated from its schema
with hostile arguments: tensors of every dtype and of mismatched, empty, one-element and broadcast
shapes (values including huge, negative and NaN ones, so index and count arguments point
anywhere), huge and negative ints and sizes, NaN/inf floats, every dtype, the admitted string
values. Each call is a one-instruction tape sent as a raw ``run`` request (the client's checks
are not in the way). A *bystander* session holds a value of known bytes all along.

Checked after every op: the front process is alive and answers a ping, the bystander's value is
intact, and a fresh session computes. A call may be refused (``err``), run, or kill its own
session's worker (a kernel that crashes: the zygote reaps it; that session only): all three are
answers. The ops whose kernels killed their worker are printed (``-s``): each is a kernel without
a check it needs, to harden or to drop from the opset.

CI runs a deterministic sample (``GENIE_OPSET_FUZZ_OPS``, default 160 ops x 3 calls);
``GENIE_FULL_TESTS=1`` runs every admitted op x 6 calls.
"""

from __future__ import annotations

import collections
import os
import random
import time
from typing import Any

import optree
import pytest
import torch

zmq = pytest.importorskip("zmq")

from genie.planner import Instr, Tape  # noqa: E402
from genie.remote import allowlist, protocol  # noqa: E402
from test_isolation import _get, _keep  # noqa: E402
from test_remote import ServerProc  # noqa: E402
from test_security import RSS_SLACK, Session, err, rss  # noqa: E402

FULL = os.environ.get("GENIE_FULL_TESTS", "0") == "1"
N_OPS = int(os.environ.get("GENIE_OPSET_FUZZ_OPS", 0 if FULL else 160))  # 0: all
CALLS = 6 if FULL else 3
QUOTA = 64 << 20
#: GENIE_OPSET_FUZZ_TRACE=path: each call is written there before it is sent
TRACE = open(os.environ["GENIE_OPSET_FUZZ_TRACE"], "w") if os.environ.get(  # noqa: SIM115
    "GENIE_OPSET_FUZZ_TRACE") else None

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
SHAPES = [(), (0,), (1,), (3,), (2, 3), (3, 2), (4, 1, 3), (1, 1, 1, 1), (2, 0, 3), (5, 4, 3, 2)]
INTS = [-(1 << 40), -7, -1, 0, 1, 2, 3, 5, 64, 1 << 31, 1 << 62]
FLOATS = [0.0, -0.0, 0.5, -1.0, 1e30, -1e300, float("nan"), float("inf"), float("-inf")]


class Gen:
    """Hostile arguments for one schema."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.like: tuple[tuple[int, ...], torch.dtype] | None = None

    def int(self) -> int:
        if self.like is not None and self.r.random() < 0.7:  # plausible dims and sizes
            return self.r.choice([-1, 0, 1, 1, 2, 3])
        return self.r.choice(INTS + [0, 1, 1, 2])

    def tensor(self) -> torch.Tensor:
        r = self.r
        shape, dt = self.like if self.like is not None and r.random() < 0.85 else \
            (r.choice(SHAPES), r.choice(DTYPES))
        n = 1
        for s in shape:
            n *= s
        if dt.is_floating_point or dt.is_complex:
            vals = [r.choice([r.uniform(-3, 3), *FLOATS]) for _ in range(n)]
            t = torch.tensor(vals, dtype=torch.float64).to(dt) if dt.is_floating_point else \
                torch.complex(torch.tensor(vals), torch.tensor(vals[::-1])).to(dt)
        elif dt == torch.bool:
            t = torch.tensor([r.random() < 0.5 for _ in range(n)], dtype=torch.bool)
        else:
            info = torch.iinfo(dt)
            vals = [r.choice([0, 1, 2, -1, 7, 1 << 20, info.max, info.min, r.randrange(-9, 9)])
                    for _ in range(n)]
            t = torch.tensor([max(info.min, min(info.max, v)) for v in vals], dtype=dt)
        t = t.reshape(shape)
        if r.random() < 0.15 and t.dim() >= 1 and t.numel() > 0:
            t = t.expand(*([3] + list(t.shape[1:])) if t.shape[0] == 1 else t.shape)
        return t

    def value(self, a: Any) -> Any:
        r = self.r
        t = str(a.real_type)
        opt = t.startswith("Optional[")
        if opt and r.random() < 0.3:
            return None
        t = t.removeprefix("Optional[").removesuffix("]") if opt else t
        if t == "Tensor":
            return self.tensor()
        if t in ("List[Tensor]", "List[Optional[Tensor]]"):
            return [self.tensor() for _ in range(r.choice([0, 1, 2, 3]))]
        if t in ("int", "SymInt"):
            return self.int()
        if t in ("List[int]", "List[SymInt]"):
            return [self.int() for _ in range(r.choice([0, 1, 2, 3, 4]))]
        if t == "float":
            return r.choice(FLOATS + [1.0, 2.0])
        if t == "List[float]":
            return [r.choice(FLOATS) for _ in range(r.choice([0, 1, 2]))]
        if t == "bool":
            return r.random() < 0.5
        if t == "List[bool]":
            return [r.random() < 0.5 for _ in range(r.choice([1, 2, 3]))]
        if t in ("number", "complex"):
            return r.choice([*INTS[:4], *FLOATS, True, 1 + 2j])
        if t == "List[number]":
            return [r.choice([1, 2.5, -1]) for _ in range(r.choice([1, 2]))]
        if t == "ScalarType":
            return r.choice(DTYPES)
        if t == "Layout":
            return torch.strided
        if t == "MemoryFormat":
            return r.choice([torch.contiguous_format, torch.channels_last,
                             torch.preserve_format])
        if t == "Device":
            return torch.device("remote_accelerator", 0)
        if t == "Generator":
            return None
        if t == "str":
            vals = allowlist.STR_ENUMS.get(a.name)
            return r.choice(sorted(vals)) if vals else None
        return None

    def call(self, op: torch._ops.OpOverload) -> tuple[tuple, dict]:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        # half the calls are consistent (one shape and dtype for most tensors, plausible ints):
        # they pass the meta checks and reach the kernel with hostile values; half are not
        self.like = (self.r.choice(SHAPES[2:8]), self.r.choice(DTYPES[:2] + DTYPES[4:5])) \
            if self.r.random() < 0.5 else None
        for a in op._schema.arguments:
            if a.kwarg_only:
                if a.has_default_value() and self.r.random() < 0.5:
                    continue
                kwargs[a.name] = self.value(a)
            else:
                args.append(self.value(a))
        return tuple(args), kwargs


def _request(op: torch._ops.OpOverload, args: tuple, kwargs: dict, hid: int
             ) -> tuple[dict, list[Any]]:
    """A one-instruction ``run`` request calling ``op(*args, **kwargs)`` on host constants."""
    leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
    n_out = sum(2 if str(r.real_type) == "List[Tensor]" else 1 for r in op._schema.returns)
    outs = tuple(range(n_out))
    tape = Tape([Instr(op, leaves, spec, outs, None)], {}, [], set(), [], {})
    enc = protocol.encode_tape(tape, lambda *_: None)
    h = {"t": "run", "k": enc.key, "id0": hid, "sk": enc.skeleton, "c": enc.consts}
    frames = [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f
              for f in enc.frames]
    return h, frames


def _ops() -> list[torch._ops.OpOverload]:
    names = sorted(allowlist.checked_in())
    by_name = {allowlist.op_name(o): o for o in allowlist.all_aten_overloads()}
    ops = [by_name[n] for n in names if n in by_name and allowlist.admitted(n)]
    if N_OPS and N_OPS < len(ops):
        ops = random.Random(27).sample(ops, N_OPS)
    return ops


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("genie-opfuzz-keys")
    s = ServerProc(keys, "--quota", "64MiB", "--max-message", "16MiB",
                   "--max-run-seconds", "10")
    yield s
    assert s.stop() == 0


def test_every_admitted_op_against_a_server(server: ServerProc) -> None:
    ops = _ops()
    assert ops, "no admitted ops"
    pid = server.proc.pid
    bystander = Session(server)
    held = torch.arange(1 << 16, dtype=torch.int64) * 7919
    held_id = _keep(bystander, held)
    baseline = rss(pid)
    s = Session(server)
    outcomes: collections.Counter[str] = collections.Counter()
    killers: dict[str, str] = {}
    unanswered: list[str] = []
    t0 = time.monotonic()
    calls = 0
    start = int(os.environ.get("GENIE_OPSET_FUZZ_FROM", "0"))  # to replay a stretch
    for k, op in enumerate(ops):
        if k < start:
            continue
        gen = Gen(k)
        name = allowlist.op_name(op)
        for _ in range(CALLS):
            args, kwargs = gen.call(op)
            try:
                h, frames = _request(op, args, kwargs, s.hid)
            except (protocol.Unsendable, TypeError, ValueError, OverflowError):
                outcomes["unsendable"] += 1  # the wire format cannot carry these arguments
                continue
            s.hid += 100
            calls += 1
            if TRACE:
                print(f"{k} {name} {args!r:.200} {kwargs!r:.100}", file=TRACE, flush=True)
            r = s.ask(h, *frames, timeout_ms=30000)
            assert server.alive(), f"the front died on {name}{args!r:.300}"
            if r is None:
                unanswered.append(name)
                outcomes["none"] += 1
                s = Session(server)
                continue
            kind = f"{r['t']}:{r.get('kind', '')}"
            outcomes[kind] += 1
            if r.get("kind") == "session":  # the worker died: only this session
                killers[name] = r.get("msg", "")[:160]
                s = Session(server)
        if k % 20 == 19 or k == len(ops) - 1:
            bystander.alive()  # the front answers, a fresh session computes
            assert torch.equal(_get(bystander, held_id, held), held), \
                f"the bystander's value changed (after {name})"
            assert rss(pid) <= baseline + QUOTA + RSS_SLACK, "the front's memory grew"
    took = time.monotonic() - t0
    bystander.close()
    print(f"\n[genie opset fuzz] {len(ops)} ops, {calls} calls in {took:.0f} s: "
          f"{dict(outcomes)}; 0 crashes of the front; {len(killers)} ops killed their own "
          f"session's worker: {sorted(killers)}")
    for n, m in sorted(killers.items()):
        print(f"  {n}: {m}")
    assert not unanswered, f"requests with no answer: {unanswered[:10]}"


def test_the_fuzzer_covers_the_opset() -> None:
    """Every admitted op has a generator for each of its argument types (no silent skip)."""
    gen = Gen(0)
    for n in sorted(allowlist.checked_in()):
        if not allowlist.admitted(n):
            continue
        base, _, ov = n.removeprefix("aten::").partition(".")
        op = getattr(getattr(torch.ops.aten, base), ov)
        for a in op._schema.arguments:
            t = str(a.real_type)
            if t.startswith("Optional[") or t in ("Generator",):
                continue
            if t == "str" and not allowlist.STR_ENUMS.get(a.name):
                continue
            assert gen.value(a) is not None, (n, a.name, t)


def test_foreach_lists_of_different_lengths_are_refused(server: ServerProc) -> None:
    """Found by this fuzzer: ``_foreach_copy([t], [a, b, c])`` read past the shorter list in
    its kernel (the worker died of SIGSEGV). The lists of a ``_foreach_`` op must have one
    length: refused before anything runs, the session goes on."""
    s = Session(server)
    one = torch.ones(1)
    for op, args in ((torch.ops.aten._foreach_copy.default, ([one], [one, one, one], True)),
                     (torch.ops.aten._foreach_add.List, ([one, one], [one])),
                     (torch.ops.aten._foreach_mul.ScalarList, ([one], [2.0, 3.0]))):
        h, frames = _request(op, args, {}, s.hid)
        s.hid += 100
        err(s.ask(h, *frames), "protocol", "one length")
    h, frames = _request(torch.ops.aten._foreach_add.List, ([one, one], [one, one]),
                         {"alpha": 2.0}, s.hid)
    s.hid += 100
    r = s.ask(h, *frames)
    assert r and r["t"] == "ok", r
    s.alive()
    s.close()
