"""Shape classes (issue 27, vet once): a structure vetted once symbolically, then admitted by guards.

A worker vets a structure's calls on meta until two calls of it vet clean with moving integers;
then it vets the structure once with those integers as symbols (:mod:`genie.remote.shape_class`)
and admits later calls by the guards that run recorded. Each test compares with eager (the values
a call returns) and plays the attacker who knows a class exists: a call that the guards do not
admit must meet the concrete vet's refusal, never a kernel.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from genie.remote import protocol  # noqa: E402
from genie.remote.protocol import EXT_DTYPE  # noqa: E402
from test_remote import ServerProc  # noqa: E402
from test_security import A1, A2, Session, err, host, keys, server, sess  # noqa: E402,F401

DEV = "remote_accelerator:0"


@pytest.fixture(scope="module", autouse=True)
def _classes_at_once():
    """This module's server builds a class inline at a structure's second clean vet, so that
    each call's vetting is known (by default a forked child builds it while calls go on: see
    ``Worker._classify`` and the background tests at the end)."""
    os.environ["GENIE_SERVER_CLASS_BUILD_COST"] = "0"
    os.environ["GENIE_SERVER_CLASS_BUILD"] = "inline"
    yield
    os.environ.pop("GENIE_SERVER_CLASS_BUILD_COST", None)
    os.environ.pop("GENIE_SERVER_CLASS_BUILD", None)
#: view(x, [a, b]) then mul(_, 2.0): leaves x, a, b
VIEW = [1, [1, 0, [2, 0, 0]], [3, [], []]]
MUL = [1, [1, 0, 0], [3, [], []]]
#: as_strided(x, [n], [1]) then clone
STRIDED = [1, [1, 0, [2, 0], [2, 0]], [3, [], []]]


def _resident(s: Session, x: torch.Tensor) -> int:
    """Upload ``x`` as a resident value of the session: its handle id."""
    hid = s.hid
    r = s.run(["aten::clone.default"], [[0, 0, [-1], [0], [], False]], [host(x, 0)],
              [protocol.tensor_frame(x)[0]], outputs=(0,), keep=(0,), specs=[A1])
    assert r and r["t"] == "ok", r
    return hid


def _view_mul(s: Session, hid: int, a: int, b: int) -> dict | None:
    return s.run(["aten::view.default", "aten::mul.Scalar"],
                 [[0, 0, [0, -1, -1], [1], [], False], [1, 1, [1, -1], [2], [1], False]],
                 [hid, a, b, 2.0], inputs=(0,), outputs=(2,), specs=[VIEW, MUL])


def _calls(sess: Session, n: int) -> list[tuple[str, torch.Tensor]]:
    """view(x, [2, n]) * 2 of a resident arange(2n), for n = 3, 4, ...: the class is built at
    the third call (the first runs guarded, the second is vetted and moved)."""
    out = []
    for k in range(3, 3 + n):
        x = torch.arange(2.0 * k)
        r = _view_mul(sess, _resident(sess, x), 2, k)
        assert r and r["t"] == "ok", r
        out.append((r["vt"], _reply_tensor(sess, r)))
    return out


def test_moving_sizes_are_admitted_by_the_class_with_eagers_values(sess: Session) -> None:
    rs = _calls(sess, 5)
    assert [vt for vt, _ in rs] == ["guarded", "vetted", "class", "class", "class"], rs
    for k, (_, got) in zip(range(3, 8), rs):
        want = torch.arange(2.0 * k).view(2, k) * 2
        assert got.shape == want.shape and torch.equal(got, want)


def test_a_call_the_guards_do_not_admit_meets_the_concrete_vet(sess: Session) -> None:
    _calls(sess, 3)  # the class exists now
    hid = _resident(sess, torch.arange(12.0))
    # 2 x 7 = 14 elements of a 12-element value: the view's own check refuses it (on meta)
    r = _view_mul(sess, hid, 2, 7)
    assert r and r["t"] == "err" and r["kind"] == "exec", r
    assert "invalid for input of size 12" in r["msg"], r["msg"]
    # an honest call of the class after the refusal still runs, and is eager's
    r = _view_mul(sess, hid, 3, 4)
    assert r and r["t"] == "ok", r
    assert torch.equal(_reply_tensor(sess, r), torch.arange(12.0).view(3, 4) * 2)


def test_a_view_past_its_storage_is_refused_even_with_a_class(sess: Session) -> None:
    def strided(hid: int, n: int) -> dict | None:
        return sess.run(["aten::as_strided.default", "aten::clone.default"],
                        [[0, 0, [0, -1, -1], [1], [], False], [1, 1, [1], [2], [1], False]],
                        [hid, n, 1], inputs=(0,), outputs=(2,), specs=[STRIDED, A1])

    for n in (4, 5, 6, 7):
        r = strided(_resident(sess, torch.arange(float(n))), n)
        assert r and r["t"] == "ok", r
    assert r["vt"] == "class", r
    # the class's guard says n <= the storage's elements: 4096 of an 8-element value is not
    r = strided(_resident(sess, torch.arange(8.0)), 4096)
    assert r and r["t"] == "err" and r["kind"] == "exec", r
    assert "storage" in r["msg"] or "bounds" in r["msg"], r["msg"]



#: full([a, b], flag): leaves a, b, flag
FULL = [1, [1, [2, 0, 0], 0], [3, [], []]]


def test_a_call_that_differs_in_a_written_bool_is_of_the_class_with_its_own_values(
        sess: Session) -> None:
    """``x.view(2, k) * full((2, k), flag)``: a call whose ``flag`` differs (a generate's last
    step fills ``full((batch,), is_done)`` with ``True``) is admitted by the class its other
    calls made, and runs their program (which reads the value per step) with its own values;
    and a call of the class's key that its guards refuse meets the view's refusal, either
    flag."""
    def view_fill(hid: int, a: int, b: int, flag: bool) -> dict | None:
        return sess.run(["aten::view.default", "aten::full.default", "aten::mul.Tensor"],
                        [[0, 0, [0, -1, -1], [1], [], False], [1, 1, [-1, -1, -1], [2], [], False],
                         [2, 2, [1, 2], [3], [1, 2], False]],
                        [hid, a, b, a, b, flag], inputs=(0,), outputs=(3,), specs=[VIEW, FULL, A2])

    seen = []
    for k, flag in ((3, False), (4, False), (5, True), (6, True), (7, False), (8, True)):
        x = torch.arange(1.0, 2.0 * k + 1)
        r = view_fill(_resident(sess, x), 2, k, flag)
        assert r and r["t"] == "ok", r
        seen.append(r["vt"])
        assert torch.equal(_reply_tensor(sess, r), x.view(2, k) * flag), (k, flag)
    assert seen == ["guarded", "vetted", "class", "class", "class", "class"], seen
    for flag in (False, True):  # 2 x 7 = 14 elements of a 12-element value
        r = view_fill(_resident(sess, torch.arange(12.0)), 2, 7, flag)
        err(r, "exec", "invalid for input of size 12")


def _reply_tensor(sess: Session, r: dict) -> torch.Tensor:
    dtype, shape, stride = r["o"][0]
    ref = protocol.FrameRef(0, protocol.dtype_of(dtype), tuple(shape),
                            None if stride is None else tuple(stride))
    return protocol.frame_tensor(sess.frames[0], ref, copy=True)


def test_constants_sent_as_deltas_patch_the_last_tape(sess: Session) -> None:
    """Genie's client sends a known skeleton's changed constants only (``d``); the worker
    patches its last tape (``protocol.refill``) and its native program must read the patched
    numbers, not the ones it was compiled with: values against eager, every call."""
    import hashlib

    names = ["aten::view.default", "aten::mul.Scalar"]
    rows = [[0, 0, [0, -1, -1], [1], [], False], [1, 1, [1, -1], [2], [1], False]]
    sk = protocol.pack([protocol.PROTOCOL_VERSION, names, [VIEW, MUL], rows, [0], [2], []])
    key = hashlib.blake2b(sk, digest_size=16).digest()
    seen = []
    for k in range(3, 9):
        hid = _resident(sess, torch.arange(2.0 * k))
        scale = 1.0 + k
        head: dict = {"t": "run", "k": key, "id0": sess.hid}
        if k == 3:
            head.update(sk=sk, c=[hid, 2, k, scale])
        else:  # the input, the view's second size and the scale changed
            head.update(d=[0, hid, 2, k, 3, scale])
        r = sess.ask(head)
        sess.hid += 100
        assert r and r["t"] == "ok", r
        seen.append(r["vt"])
        want = torch.arange(2.0 * k).view(2, k) * scale
        got = _reply_tensor(sess, r)
        assert got.shape == want.shape and torch.equal(got, want), (k, got, want)
    assert seen[2:] == ["class"] * 4, seen


def test_hostile_deltas_get_the_full_fill_checks(sess: Session) -> None:
    """A delta that changes a constant's type (an int size into a string, a list, a float), or
    names a position past the constants, is not patched: it is filled and checked as a fresh
    call is, refused with a clear error, and the session goes on with eager's values."""
    import hashlib

    names = ["aten::view.default", "aten::mul.Scalar"]
    rows = [[0, 0, [0, -1, -1], [1], [], False], [1, 1, [1, -1], [2], [1], False]]
    sk = protocol.pack([protocol.PROTOCOL_VERSION, names, [VIEW, MUL], rows, [0], [2], []])
    key = hashlib.blake2b(sk, digest_size=16).digest()
    hid = _resident(sess, torch.arange(6.0))
    r = sess.ask({"t": "run", "k": key, "id0": sess.hid, "sk": sk, "c": [hid, 2, 3, 2.0]})
    assert r and r["t"] == "ok", r
    for d in ([2, "3"], [2, [3]], [2, 3.0], [9, 1], [-1, 1], [2, 1 << 63]):
        sess.hid += 100
        r = sess.ask({"t": "run", "k": key, "id0": sess.hid, "d": d})
        assert r is not None and r["t"] == "err", (d, r)
        assert r["kind"] in ("protocol", "exec"), (d, r)
    sess.hid += 100
    r = sess.ask({"t": "run", "k": key, "id0": sess.hid, "d": [1, 3, 2, 2]})  # honest again
    assert r and r["t"] == "ok", r
    assert torch.equal(_reply_tensor(sess, r), torch.arange(6.0).view(3, 2) * 2.0)


def test_a_delta_into_a_checked_argument_is_filled_and_checked(sess: Session) -> None:
    """A patched tape (``protocol.refill``) skips the schema's argument checks: a patch keeps
    each constant's type, and no plain number passes as a dtype, device, layout or string. An
    attacker's delta that puts an int (which the binding would turn into a quantized dtype) or
    None where the dtype was is a change of type: filled and checked as a fresh call is."""
    import hashlib

    spec = [1, [1, [2, 0]], [3, ["dtype"], [0]]]  # empty([n], dtype=...)
    sk = protocol.pack([protocol.PROTOCOL_VERSION, ["aten::empty.memory_format"], [spec],
                        [[0, 0, [-1, -1], [0], [], False]], [], [0], []])
    key = hashlib.blake2b(sk, digest_size=16).digest()
    f32 = msgpack.ExtType(EXT_DTYPE, b"float32")

    def run(head: dict) -> dict | None:
        sess.hid += 100
        return sess.ask({"t": "run", "k": key, "id0": sess.hid, **head})

    r = run({"sk": sk, "c": [4, f32]})
    assert r and r["t"] == "ok" and r["o"][0][:2] == ["float32", [4]], r
    for n in (5, 6):  # patched: the size only
        r = run({"d": [0, n]})
        assert r and r["t"] == "ok" and r["o"][0][:2] == ["float32", [n]], r
    for d in ([1, 13], [0, 7, 1, 13], [1, 1.5], [1, True]):
        err(run({"d": d}), "protocol", "dtype")
    r = run({"d": [0, 8, 1, None]})  # None is the default dtype: as eager
    assert r and r["t"] == "ok" and r["o"][0][:2] == ["float32", [8]], r
    r = run({"d": [0, 9, 1, f32]})
    assert r and r["t"] == "ok" and r["o"][0][:2] == ["float32", [9]], r


def test_a_delta_after_a_refused_one_applies_to_the_constants_sent(sess: Session) -> None:
    """A client's deltas are relative to the constants it sent last, refused or not: a request
    refused before its tape was patched (a handle not held) leaves the next delta's tape with
    every constant sent since, not the last run's (eager's values)."""
    import hashlib

    names = ["aten::view.default", "aten::mul.Scalar"]
    rows = [[0, 0, [0, -1, -1], [1], [], False], [1, 1, [1, -1], [2], [1], False]]
    sk = protocol.pack([protocol.PROTOCOL_VERSION, names, [VIEW, MUL], rows, [0], [2], []])
    key = hashlib.blake2b(sk, digest_size=16).digest()
    hid = _resident(sess, torch.arange(6.0))
    for head in ({"sk": sk, "c": [hid, 2, 3, 2.0]}, {"d": [3, 3.0]}):
        r = sess.ask({"t": "run", "k": key, "id0": sess.hid, **head})
        sess.hid += 100
        assert r and r["t"] == "ok", r
    r = sess.ask({"t": "run", "k": key, "id0": sess.hid, "d": [0, 10 ** 9, 3, 5.0]})
    sess.hid += 100
    err(r, "protocol", "no tensor with handle id")
    r = sess.ask({"t": "run", "k": key, "id0": sess.hid, "d": [0, hid]})
    sess.hid += 100
    assert r and r["t"] == "ok", r
    assert torch.equal(_reply_tensor(sess, r), torch.arange(6.0).view(2, 3) * 5.0)


def test_a_replayed_structures_inputs_are_each_checked(sess: Session) -> None:
    """An attacker with a valid key replays a structure the worker already vetted (it runs
    natively now, its inputs resolved in bulk: ``Worker._held_inputs``, keyed in one native pass:
    ``genie._C._input_key``) with mismatched inputs: handles freed, never made, of the wrong
    type; values of another shape, dtype or aliasing than the vetted calls'; too few or too many
    constants, as full constants and as deltas. Each is refused before a kernel runs, or vetted
    anew and answered as eager answers it; honest calls go on with eager's values."""
    import hashlib

    names = ["aten::add.Tensor"]
    rows = [[0, 0, [0, 1], [2], [], False]]
    sk = protocol.pack([protocol.PROTOCOL_VERSION, names, [A2], rows, [0, 1], [2], []])
    key = hashlib.blake2b(sk, digest_size=16).digest()
    x, y = torch.arange(4.0), torch.arange(4.0) * 10
    a, b = _resident(sess, x), _resident(sess, y)

    def add(head: dict) -> dict | None:
        sess.hid += 100
        return sess.ask({"t": "run", "k": key, "id0": sess.hid, **head})

    seen = []
    for _ in range(4):  # guarded, then replayed natively: vetted, then hits
        r = add({"sk": sk, "c": [a, b]})
        assert r and r["t"] == "ok", r
        assert torch.equal(_reply_tensor(sess, r), x + y)
        seen.append(r["vt"])
    assert seen[-1] == "hit", seen
    gone = _resident(sess, torch.ones(4))
    assert sess.ask({"t": "free", "ids": [gone]})["t"] == "ok"
    for bad in ([a, gone], [gone, b], [a, 10 ** 9], [a, -3], [a, (1 << 64) - 1]):
        err(add({"c": bad}), "protocol", "no tensor with handle id")
        err(add({"d": [0, bad[0], 1, bad[1]]}), "protocol", "no tensor with handle id")
    for bad in ([a, True], [a, 1.5], [a, None], [a, "b"], [a, [b]]):
        r = add({"c": bad})
        assert r and r["t"] == "err" and r["kind"] == "protocol", (bad, r)
        r = add({"d": [1, bad[1]]})
        assert r and r["t"] == "err" and r["kind"] == "protocol", (bad, r)
    err(add({"d": [2, b]}), "protocol", "constant position")
    for bad in ([a], [a, b, b], []):
        err(add({"c": bad}), "protocol", "constants")
        r = add({"d": [0, a]})  # the constants it kept are gone: a delta must come whole
        assert r and r["t"] == "miss", r
    # held values of another shape: vetted anew and refused as eager refuses them
    c = _resident(sess, torch.arange(5.0))
    r = add({"c": [a, c]})
    assert r and r["t"] == "err" and r["kind"] == "exec", r
    assert "broadcast" in r["msg"] or "must match the size" in r["msg"], r["msg"]
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.arange(4.0) + torch.arange(5.0)  # eager refuses it too
    # another dtype, a broadcast, the same value twice (aliasing): eager's answers
    i = _resident(sess, torch.arange(4))
    row = _resident(sess, torch.arange(8.0).view(2, 4))
    for ids, want in (([a, i], x + torch.arange(4)), ([a, a], x + x), ([row, a], torch.arange(
            8.0).view(2, 4) + x), ([i, i], torch.arange(4) * 2)):
        r = add({"c": ids})
        assert r and r["t"] == "ok", (ids, r)
        got = _reply_tensor(sess, r)
        assert got.dtype == want.dtype and torch.equal(got, want), (ids, got, want)
    r = add({"c": [a, b]})  # honest again: the vetted shapes, eager's values
    assert r and r["t"] == "ok" and r["vt"] == "hit", r
    assert torch.equal(_reply_tensor(sess, r), x + y)



def test_a_step_that_uploads_indexes_and_calls_new_ones_is_served_by_a_class(server) -> None:
    """What transformers < 5.24's decode step does (the GPU machine's 5.17, session 53): it
    uploads ``torch.tensor(0.0, device=...)`` each step, calls ``attention_mask.new_ones(...)``
    on a mask one longer each token and indexes with an integer tensor. Each of these once made
    every step's structure a new one or refused its class, so every step was vetted; now a class
    serves the steps after the first few, with eager's values."""
    import genie

    genie.connect(server.address, key_file=str(server.key_file), timeout=60)
    counters = ("server_vets", "server_shape_class_hits")
    try:
        h, want_h = torch.zeros(1, 2).to(DEV), torch.zeros(1, 2)
        seen = []
        for k in range(10):
            before = genie.stats()
            outs = []
            for hh, dev in ((h, DEV), (want_h, "cpu")):
                hh = torch.cat([hh, torch.ones(1, 1, device=dev) * float(k)], 1)
                m = hh.new_ones(1, hh.shape[1])  # a metadata-only argument that grows
                idx = torch.arange(hh.shape[1] - 1, -1, -1, device=dev)  # reversed: integers
                c = torch.tensor(0.0, device=dev)  # an upload, every step
                outs.append((hh, torch.where(hh[:, idx] > 2, c, hh * m * 0.5)))
            (h, got), (want_h, want) = outs
            assert torch.equal(got.cpu(), want), k
            after = genie.stats()
            seen.append(tuple(after.get(n, 0) - before.get(n, 0) for n in counters))
    finally:
        genie.disconnect()
    assert all(v == 0 for v, _ in seen[4:]), seen  # no concrete vet once the class exists
    assert sum(c for _, c in seen[4:]) >= 6, seen


def test_new_ones_of_a_huge_metadata_argument_costs_the_server_nothing(server) -> None:
    """An attacker's ``new_ones`` whose metadata-only argument claims 2**40 elements (a pending
    ``empty`` never sent: only its metadata travels) under a 64 MiB quota: the server takes it as
    a 0-dim value of its dtype (``protocol.fill``), makes no scratch tensor of that size, answers
    eager's value, and the session goes on."""
    import genie

    genie.connect(server.address, key_file=str(server.key_file), timeout=60)
    try:
        for dtype in (torch.float32, torch.int64):
            huge = torch.empty(1 << 40, dtype=dtype, device=DEV)  # recorded, never run
            got = huge.new_ones(3, 2).cpu()
            want = torch.empty(1, dtype=dtype).new_ones(3, 2)
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert torch.equal((torch.ones(4, device=DEV) * 3).cpu(), torch.full((4,), 3.0))
    finally:
        genie.disconnect()


def test_generate_with_a_new_prompt_length_each_call_is_vetted_in_its_first_calls_only(
        server) -> None:
    """GPT-2 greedy ``generate`` through the server, a prompt length never seen every call
    (the bench's row): the first call vets its structures (its prefill, its decode step, its
    last step), the second only its prefill (a new length: that structure's second clean vet,
    which builds its class); its decode steps at new KV lengths and its last step (HF's
    stopping criteria fill ``full((1,), True)`` there) are the decode step's class. From the
    third call on nothing is vetted concretely. Every call returns eager's tokens."""
    import copy

    import genie

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128,
                                  n_positions=128, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.generation_config.pad_token_id = 0
    genie.connect(server.address, key_file=str(server.key_file), timeout=60)
    counters = ("server_guarded_runs", "server_vets", "server_shape_class_hits",
                "server_vet_hits")
    try:
        remote = copy.deepcopy(model).to(DEV)
        calls = []
        for n in (5, 6, 7, 9, 12):
            ids = torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n))
            with torch.no_grad():
                want = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
                before = genie.stats()
                got = remote.generate(ids.to(DEV), max_new_tokens=8, min_new_tokens=8,
                                      do_sample=False).cpu()
            after = genie.stats()
            assert torch.equal(got, want), n
            calls.append({k.removeprefix("server_"): after.get(k, 0) - before.get(k, 0)
                          for k in counters})
    finally:
        genie.disconnect()
    assert calls[1]["guarded_runs"] == 0 and calls[1]["vets"] == 1, calls
    assert calls[1]["shape_class_hits"] >= 2, calls  # a new KV length, and the last step
    for c in calls[2:]:
        assert c["guarded_runs"] == 0 and c["vets"] == 0, calls


# --- background builds (the default) -------------------------------------------------------------

@pytest.fixture(scope="module")
def background(keys):
    """A server that builds classes as it does by default: in a forked child, while calls go
    on (``GENIE_SERVER_CLASS_BUILD=background``), two at a time as on a machine of 4 cores or
    more (``GENIE_SERVER_CLASS_BUILDS=2``)."""
    os.environ["GENIE_SERVER_CLASS_BUILD"] = "background"
    os.environ["GENIE_SERVER_CLASS_BUILDS"] = "2"
    try:
        s = ServerProc(keys, "--quota", "64MiB")
    finally:
        os.environ["GENIE_SERVER_CLASS_BUILD"] = "inline"
        os.environ.pop("GENIE_SERVER_CLASS_BUILDS", None)
    yield s
    assert s.stop() == 0


def test_a_class_built_in_the_background_serves_later_calls_with_eagers_values(background) -> None:
    s = Session(background)
    try:
        seen: list[str] = []
        deadline = time.monotonic() + 120
        k = 3
        while "class" not in seen:
            assert time.monotonic() < deadline, f"no class arrived: {seen}"
            x = torch.arange(2.0 * k)
            r = _view_mul(s, _resident(s, x), 2, k)
            assert r and r["t"] == "ok", r
            seen.append(r["vt"])
            got = _reply_tensor(s, r)
            assert got.shape == (2, k) and torch.equal(got, x.view(2, k) * 2), k
            k += 1
            time.sleep(0.05)
        # no call waited for the build: each one before the class was vetted concretely
        assert seen[0] == "guarded" and set(seen[1:-1]) <= {"vetted"}, seen
        # and the class refuses what the view's own check refuses
        r = _view_mul(s, _resident(s, torch.arange(12.0)), 2, 7)
        assert r and r["t"] == "err" and r["kind"] == "exec", r
    finally:
        s.alive()
        s.close()


def test_two_structures_that_move_together_each_get_their_class(background) -> None:
    """A generate call moves two structures at once (its prefill, a new prompt length each
    call, and its decode step): a build of one does not keep the other vetted concretely until
    it is done (a worker runs a build per structure side by side, ``BUILD_SLOTS``). Both are
    served by their classes, with eager's values."""
    s = Session(background)

    def strided(hid: int, n: int) -> dict | None:
        return s.run(["aten::as_strided.default", "aten::clone.default"],
                     [[0, 0, [0, -1, -1], [1], [], False], [1, 1, [1], [2], [1], False]],
                     [hid, n, 1], inputs=(0,), outputs=(2,), specs=[STRIDED, A1])

    try:
        seen: dict[str, list[str]] = {"view": [], "strided": []}
        deadline = time.monotonic() + 120
        k = 3
        while any("class" not in v for v in seen.values()):
            assert time.monotonic() < deadline, f"no classes for both: {seen}"
            x = torch.arange(2.0 * k)
            r = _view_mul(s, _resident(s, x), 2, k)
            assert r and r["t"] == "ok", r
            seen["view"].append(r["vt"])
            assert torch.equal(_reply_tensor(s, r), x.view(2, k) * 2), k
            y = torch.arange(float(k + 1))
            r = strided(_resident(s, y), k + 1)
            assert r and r["t"] == "ok", r
            seen["strided"].append(r["vt"])
            assert torch.equal(_reply_tensor(s, r), y), k
            k += 1
            time.sleep(0.05)
        for v in seen.values():  # no call waited for a build
            assert v[0] == "guarded" and set(v[1:v.index("class")]) <= {"vetted"}, seen
    finally:
        s.alive()
        s.close()


def test_a_prefills_upload_is_read_from_each_calls_own_frame(sess: Session) -> None:
    """A prefill uploads a prompt of a new length each call (an upload instruction, not a
    resident input): its calls are sent as deltas and patched from the last call's tape
    (``protocol.refill``), the upload read from the call's own frame, as a fill reads it. An
    attacker's delta whose upload claims more than its frame holds, names a frame not sent or
    is no frame is refused as a fill refuses it; one that makes the upload an odd count of
    complex128 (a frame ZeroMQ places at 8 mod 16) runs on an aligned copy; the session goes on
    with eager's values."""
    import hashlib

    names = ["genie.upload", "aten::view.default", "aten::mul.Scalar"]
    rows = [[0, -1, [-1], [0], [], False], [1, 0, [0, -1, -1], [1], [0], False],
            [2, 1, [1, -1], [2], [1], False]]
    sk = protocol.pack([protocol.PROTOCOL_VERSION, names, [VIEW, MUL], rows, [], [2], []])
    key = hashlib.blake2b(sk, digest_size=16).digest()

    def call(x: torch.Tensor, a: int, b: int, scale: float, first: bool = False,
             frames: tuple | None = None) -> dict | None:
        sess.hid += 100
        head: dict = {"t": "run", "k": key, "id0": sess.hid}
        consts = [host(x, 0), a, b, scale]
        if first:
            head.update(sk=sk, c=consts)
        else:
            head.update(d=[p for k, c in enumerate(consts) for p in (k, c)])
        return sess.ask(head, *(frames if frames is not None else
                                (protocol.tensor_frame(x)[0],)))

    seen = []
    for k in range(3, 9):
        x = torch.arange(2.0 * k) - 5
        r = call(x, 2, k, 1.0 + k, first=k == 3)
        assert r and r["t"] == "ok", (k, r)
        seen.append(r["vt"])
        want = x.view(2, k) * (1.0 + k)
        got = _reply_tensor(sess, r)
        assert got.shape == want.shape and torch.equal(got, want), (k, got, want)
    assert seen[2:] == ["class"] * 4, seen
    small = protocol.tensor_frame(torch.arange(4.0))[0]
    for x, frames, why in ((torch.arange(64.0), (small,), "frame"),
                           (torch.arange(4.0), (), "frame"),
                           (torch.arange(4.0), (small, small), None)):
        r = call(x, 2, x.numel() // 2, 2.0, frames=frames)
        if why is None:  # (an extra frame is not read)
            assert r and r["t"] == "ok", r
            continue
        err(r, "protocol", why)
    sess.hid += 100
    r = sess.ask({"t": "run", "k": key, "id0": sess.hid, "d": [0, 7]})  # no frame at all
    err(r, "protocol", "upload needs a tensor frame")
    z = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j], dtype=torch.complex128)
    r = call(z, 1, 3, 2.0)
    assert r and r["t"] == "ok", r
    assert torch.equal(_reply_tensor(sess, r), z.view(1, 3) * 2.0)
    x = torch.arange(10.0)
    r = call(x, 2, 5, 3.0)
    assert r and r["t"] == "ok", r
    assert torch.equal(_reply_tensor(sess, r), x.view(2, 5) * 3.0)
