"""Planner: the tape holds exactly the needed slice, frees at last use, prints, is plain data."""

import weakref

import pytest
import torch

import genie
from genie.backends import backend_order, codegen, eager, set_backends
from genie.config import config
from genie.planner import Slot, build_tape, format_tape
from genie.tape_io import TapeDataError, allow_only, op_from_name, op_to_name

D = "remote_accelerator"


def _tape(*ts):
    return build_tape([(t._node, t._out) for t in ts])


def test_unused_branch_is_not_in_the_tape():
    x = torch.randn(8, 8, device=D)
    genie.materialize(x)
    used = (x @ x).relu()
    unused = [x - 1, (x * 3).exp(), (x - 1).sum()]  # a pending branch nobody asks for
    tape = _tape(used.sum())
    in_tape = {id(n) for n in tape.nodes}
    assert all(id(t._node) not in in_tape for t in unused)
    mm = "aten.matmul.default" if config.whole_ops else "aten.mm.default"  # csrc/whole.cpp
    assert [str(i.op) for i in tape.instrs] == [mm, "aten.relu.default", "aten.sum.default"]
    assert list(tape.inputs) == [0]  # x: already on the device, an input, not recomputed
    genie.materialize(used)
    assert not any(t._node.executed for t in unused)


def test_frees_at_last_use_structurally():
    x = torch.randn(16, device=D)
    y = x
    for _ in range(20):
        y = (y * 2).sin()
    tape = _tape(y)
    last: dict[int, int] = {}
    for i, ins in enumerate(tape.instrs):
        for leaf in ins.leaves:
            if isinstance(leaf, Slot):
                last[leaf.id] = i
    freed = {s: i for i, ins in enumerate(tape.instrs) for s in ins.free}
    for s, i in last.items():
        if s in tape.keep or s in tape.inputs:
            assert s not in freed
        else:
            assert freed[s] == i, f"%{s} last used by instr {i}, freed at {freed.get(s)}"


def test_live_values_stay_bounded_during_execution(monkeypatch):
    """Count the executor's live values with weak references: a 60-op chain keeps at most a few."""
    produced: list[weakref.ref] = []
    live_counts: list[int] = []
    real = eager.run_instr

    def spy(ins, env, dev):
        live_counts.append(sum(r() is not None for r in produced))
        outs = real(ins, env, dev)
        produced.extend(weakref.ref(o) for o in outs if isinstance(o, torch.Tensor))
        return outs

    monkeypatch.setattr(eager, "run_instr", spy)
    monkeypatch.setattr(codegen, "_mode", "0")  # the interpreter (test_codegen: generated code)
    monkeypatch.setattr(config, "native_replay", "0")  # (test_native_replay: native programs)
    saved = backend_order()
    set_backends(["eager"])
    x = torch.randn(1000, device=D)
    genie.materialize(x)
    produced.clear()
    live_counts.clear()
    y = x
    for _ in range(30):
        y = (y * 1.01).cos()
    try:
        y.sum().item()
    finally:
        set_backends(saved)
    assert len(live_counts) == 61
    assert max(live_counts) <= 2, live_counts  # one operand, plus the op being produced
    # every intermediate is freed right after its last use, except y, which the program holds
    assert genie.stats()["values_freed"] == 59


def test_kept_values_survive_and_are_not_recomputed():
    x = torch.randn(4, device=D)
    a = x.exp()  # held by the program: kept
    b = a * 2
    tape = _tape(b)
    slot_a = tape.slots[(a._node.index, 0)]
    assert slot_a in tape.keep
    genie.materialize(b)
    n = genie.stats()["nodes_executed"]
    torch.testing.assert_close(a.cpu(), x.cpu().exp())
    assert genie.stats()["nodes_executed"] == n


def test_format_tape_lists_ops_and_frees():
    x = torch.randn(3, 3, device=D)
    genie.materialize(x)
    y = ((x + 1) * 2).sum()
    text = format_tape(_tape(y))
    assert text.splitlines()[0].startswith("tape: 3 instrs")
    assert "aten.add.Tensor(%0, 1)" in text
    assert "# free %1" in text  # x + 1 dies at the mul


# --- tapes as data -----------------------------------------------------------------------------

def _program():
    torch.manual_seed(0)
    w = torch.randn(5, 3).to(D)
    x = torch.arange(15.0).reshape(3, 5).to(D)
    h = torch.nn.functional.gelu(x @ w, approximate="tanh")
    z = torch.zeros_like(h) + h.softmax(-1)
    parts = torch.split(z, [1, 2], dim=0)
    return parts[1].to(torch.float64).sum(dim=(0, 1), keepdim=True)


def _wire(tape):
    """``tape`` through the one codec (genie.remote.protocol), as a server receives it: the
    skeleton and the constants as msgpack bytes, the tensor frames as bytes."""
    protocol = pytest.importorskip("genie.remote.protocol")
    enc = protocol.encode_tape(tape, lambda slot, _v, _frames: slot)  # inputs: by slot
    return enc, protocol.pack(enc.consts), [bytes(memoryview(f)) for f in enc.frames]


def test_tape_round_trips_through_plain_data():
    y = _program()
    tape = _tape(y)
    enc, consts, frames = _wire(tape)
    from genie.remote import protocol

    compiled = protocol.compile_skeleton(enc.skeleton)  # plain data: msgpack, no pickle
    back = protocol.fill(compiled, protocol.unpack(consts), frames, dict(tape.inputs))
    assert [i.op for i in back.instrs] == [i.op for i in tape.instrs]
    assert [i.free for i in back.instrs] == [i.free for i in tape.instrs]
    assert back.outputs == tape.outputs and back.keep == tape.keep
    got = eager.run_instrs(back, torch.device("cpu"))[back.outputs[0]]
    torch.testing.assert_close(got, y.cpu())


def test_tape_data_is_deterministic():
    def encoded():
        enc, consts, frames = _wire(_tape(_program()))  # node ids are not part of it
        return enc.key, enc.skeleton, consts, frames

    assert encoded() == encoded()


def test_tape_data_names_inputs_by_constant():
    x = torch.randn(4, device=D)
    genie.materialize(x)
    enc, consts, frames = _wire(_tape(x * 2))
    from genie.remote import protocol

    assert frames == [] and protocol.unpack(consts)[0] == 0  # the input is named, not sent
    back = protocol.fill(protocol.compile_skeleton(enc.skeleton), protocol.unpack(consts),
                         frames, {0: torch.ones(4)})
    out = eager.run_instrs(back, torch.device("cpu"))[back.outputs[0]]
    torch.testing.assert_close(out, torch.full((4,), 2.0))


@pytest.mark.parametrize("edit, match", [
    (lambda sk: sk[1].__setitem__(0, "aten::from_file.default"), "does not run on a Genie"),
    (lambda sk: sk[1].__setitem__(0, "os::system"), "does not run on a Genie"),
    (lambda sk: sk[1].__setitem__(0, "aten::no_such_op.default"), "does not run on a Genie"),
    (lambda sk: sk[1].__setitem__(0, "aten::mul.Tensor; import os"), "does not run on a Genie"),
    (lambda sk: sk[3][-1][2].__setitem__(0, 99), "not live"),
    (lambda sk: sk[3][0].__setitem__(0, 7), "bad instruction"),
    (lambda sk: sk[3][-1][2].__setitem__(0, "pickle"), "bad leaf"),
    (lambda sk: sk.__setitem__(0, 0), "protocol version"),
])
def test_compile_skeleton_rejects_bad_skeletons(edit, match):
    x = torch.randn(4, device=D)
    genie.materialize(x)
    enc, _, _ = _wire(_tape((x * 2).relu()))
    from genie.remote import ProtocolError, protocol

    sk = protocol.unpack(enc.skeleton)
    edit(sk)
    with pytest.raises(ProtocolError, match=match):
        protocol.compile_skeleton(protocol.pack(sk))


@pytest.mark.parametrize("name, match", [
    ("aten::from_file.default", "allowlist"),
    ("os::system", "allowlist"),
    ("aten::mul.Tensor; import os", "bad op name"),
    ("mul", "bad op name"),
])
def test_op_names_resolve_checked(name, match):
    with pytest.raises(TapeDataError, match=match):
        op_from_name(name)


def test_an_op_that_does_not_exist_is_refused_even_when_allowed():
    with pytest.raises(TapeDataError, match="does not exist"):
        op_from_name("aten::no_such_op.default", lambda ns, op: True)


def test_allowlist_can_be_narrowed():
    mul, relu = op_from_name("aten::mul.Tensor"), op_from_name("aten::relu")
    assert (op_to_name(mul), op_to_name(relu)) == ("aten::mul.Tensor", "aten::relu.default")
    assert op_from_name("aten::mul.Tensor", allow_only({"aten::mul", "aten::relu"})) is mul
    with pytest.raises(TapeDataError, match="allowlist"):
        op_from_name("aten::relu.default", allow_only({"aten::mul"}))


def test_a_structure_encoded_before_gives_the_skeleton_and_constants_a_fresh_encoding_does():
    """encode_tape memoizes skeletons by tape structure: a second tape of that structure with
    other constants (sizes, scalars, a host tensor, a seed) encodes to exactly what an encoding
    without the memo gives."""
    from genie.remote import protocol

    def program(n: int, scale: float):
        torch.manual_seed(n)
        x = torch.arange(float(2 * n)).to(D)
        noise = torch.rand(2, n, device=D)  # a seed and offset per call
        host = torch.full((2, 1), scale)  # a host tensor constant
        return ((x.view(2, n) * scale + noise) * host.to(D)).sum(1)

    tapes = [_tape(program(n, 1.5 + n)) for n in (3, 4, 5, 5)]
    first = protocol.encode_tape(tapes[0], lambda slot, _v, _f: slot)
    for t in tapes[1:]:
        memo = protocol.encode_tape(t, lambda slot, _v, _f: slot)
        protocol._encoded.clear()
        fresh = protocol.encode_tape(t, lambda slot, _v, _f: slot)
        assert memo.key == fresh.key == first.key and memo.skeleton == fresh.skeleton
        assert protocol.pack(memo.consts) == protocol.pack(fresh.consts)
        assert [bytes(memoryview(f)) for f in memo.frames] == \
            [bytes(memoryview(f)) for f in fresh.frames]
    assert protocol.pack(first.consts) != protocol.pack(memo.consts)  # the constants moved


def test_a_plan_cache_hit_encodes_to_what_a_fresh_encoding_gives(monkeypatch):
    """A tape instantiated from a plan takes the plan's encoding (no structure key) and the
    constants of the plan's own instructions from the last call: each call's skeleton,
    constants and frames are still exactly what an encoding without any memo gives, as sizes,
    scalars, a host tensor and seeds move. Each tape is encoded where the remote backend encodes
    it, before its run (a hit whose instructions are never built releases the nodes they would
    be built from when the run binds: on torch 2.11's wrapper path, the H200's, they were not
    built by the run, and encoding after it failed)."""
    from genie import executor
    from genie.passes import pipeline
    from genie.remote import protocol

    monkeypatch.setattr(executor, "_fuse", [False])  # every hit a tape (a fused one makes none)
    tapes = []
    run = pipeline.run

    def check(t) -> None:
        # a structure's first encoding is kept by structure, the next one pins it on the plan
        protocol.encode_tape(t, lambda slot, _v, _f: slot)
        memo = protocol.encode_tape(t, lambda slot, _v, _f: slot)
        if t.plan is not None:
            assert protocol._WIRE in t.plan.artifacts  # the plan keeps its encoding
        protocol._encoded.clear()
        saved = dict(t.plan.artifacts) if t.plan is not None else {}
        if t.plan is not None:
            t.plan.artifacts.pop(protocol._WIRE, None)
        fresh = protocol.encode_tape(t, lambda slot, _v, _f: slot)
        if t.plan is not None:
            t.plan.artifacts.update(saved)  # the memo (and its shared constants) goes on
        assert memo.key == fresh.key and memo.skeleton == fresh.skeleton
        assert protocol.pack(memo.consts) == protocol.pack(fresh.consts)
        assert [bytes(memoryview(f)) for f in memo.frames] == \
            [bytes(memoryview(f)) for f in fresh.frames]

    def grab(tape, device):
        tapes.append(tape)
        check(tape)
        return run(tape, device)

    monkeypatch.setattr(pipeline, "run", grab)

    def program(n: int, scale: float, k: int):
        x = torch.arange(float(2 * n)).to(D)
        noise = torch.rand(2, n, device=D)  # a seed and offset per call
        host = torch.full((2, 1), float(k))  # a host tensor constant
        return ((x.view(2, n) * scale + noise) * host.to(D) + 1.0).sum(1).cpu()

    calls = [(3, 2.0, 1), (3, 2.0, 1), (3, 2.5, 1), (4, 2.5, 2), (4, 2.5, 2), (3, 2.0, 1)]
    for n, scale, k in calls:
        program(n, scale, k)
    assert len(tapes) == len(calls) and sum(t.plan is not None for t in tapes) >= 4


def test_a_constant_delta_names_exactly_the_positions_that_differ():
    from genie.remote.protocol import const_delta

    shared = [1.5, 2]
    assert const_delta([1, 2.0, "a", shared], [1, 2.0, "a", shared]) == []
    same = list(range(10))
    assert const_delta([1, 2.0, 0.0, True, *same], [1, 2.5, -0.0, 1, *same]) == \
        [1, 2.5, 2, -0.0, 3, 1]
    assert const_delta([float("nan")] * 3, [float("nan")] * 3) == []  # a NaN repeats
    assert const_delta([1, 2], [1, 2, 3]) is None  # another length: all of them
    assert const_delta([1, 2], [3, 4]) is None  # all changed: no cheaper than all
