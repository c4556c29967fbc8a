"""One sandboxed worker process per session (issue 27): what a misbehaving kernel costs.

The server runs with ``GENIE_SERVER_TEST_KERNELS=1``, which admits three test-only kernels
(:func:`genie.remote.worker.register_test_kernels`; never admitted otherwise): ``segfault(x)``
reads an unmapped address, ``overread(x, n)`` returns ``n`` bytes starting at ``x``'s data
whatever lies past its end, ``spin(x, seconds)`` keeps a core busy inside one kernel. Each test
holds a *victim* session with a value of a known byte pattern, lets an *attacker* session run the
bad kernel, and checks that only the attacker's session is affected: the server answers, the
victim's value is intact and was never read, other sessions run at their usual speed.
"""

from __future__ import annotations

import os
import re
import struct
import time

import pytest
import torch

zmq = pytest.importorskip("zmq")

from genie.remote import protocol  # noqa: E402
from genie.remote.protocol import tensor_frame  # noqa: E402
from test_remote import ServerProc  # noqa: E402
from test_security import A1, A2, A3, Session, err, host  # noqa: E402

#: the victim's bytes: a pattern no other value in these tests has
PATTERN = 0x5EC2E7A1
PATTERN_BYTES = struct.pack("<I", PATTERN) * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("genie-iso-keys")
    os.environ["GENIE_SERVER_TEST_KERNELS"] = "1"
    try:
        s = ServerProc(keys, "--quota", "64MiB", "--max-run-seconds", "1")
    finally:
        del os.environ["GENIE_SERVER_TEST_KERNELS"]
    yield s
    assert s.stop() == 0, "genie-server did not shut down cleanly on SIGTERM"


def _keep(sess: Session, x: torch.Tensor) -> int:
    """Upload ``x`` into ``sess`` (a clone kept on the server); its handle id."""
    hid = sess.hid
    r = sess.run(["aten::clone.default"], [[0, 0, [-1], [0], [], False]], [host(x, 0)],
                 (tensor_frame(x)[0],), outputs=(), keep=(0,), specs=[A1])
    assert r and r["t"] == "ok", r
    return hid


def _get(sess: Session, hid: int, like: torch.Tensor) -> torch.Tensor:
    r = sess.ask({"t": "get", "ids": [hid]})
    assert r and r["t"] == "ok", r
    [buf] = protocol.join_frames(sess.frames, r.get("fc"))
    return torch.frombuffer(bytearray(buf), dtype=like.dtype).view(like.shape)


@pytest.fixture
def victim(server: ServerProc):
    s = Session(server)
    x = torch.full((1 << 20,), PATTERN, dtype=torch.int64).view(torch.int32)  # 8 MiB
    hid = _keep(s, x)
    yield s, hid, x
    assert torch.equal(_get(s, hid, x), x), "the victim's value changed"
    s.close()


def _one_op(sess: Session) -> float:
    """Seconds a 1-op tape of ``sess`` takes (request to reply)."""
    x = torch.arange(4.0)
    t0 = time.monotonic()
    r = sess.run(["aten::mul.Scalar"], [[0, 0, [-1, -1], [0], [], False]], [host(x, 0), 3.0],
                 (tensor_frame(x)[0],), specs=[A2])
    assert r and r["t"] == "ok", r
    return time.monotonic() - t0


def test_the_test_kernels_are_refused_without_the_flag(tmp_path) -> None:
    s = ServerProc(tmp_path, "--quota", "64MiB")
    try:
        a = Session(s)
        x = torch.zeros(4)
        r = a.run(["genie_test::segfault.default"], [[0, 0, [-1], [0], [], False]],
                  [host(x, 0)], (tensor_frame(x)[0],), specs=[A1])
        err(r, "protocol", "genie_test::segfault")
        a.close()
    finally:
        assert s.stop() == 0


def test_a_segfaulting_kernel_costs_only_its_own_session(server: ServerProc, victim) -> None:
    v, hid, x = victim
    a = Session(server)
    y = torch.zeros(4)
    _keep(a, y)
    r = a.run(["genie_test::segfault.default"], [[0, 0, [-1], [0], [], False]], [host(y, 0)],
              (tensor_frame(y)[0],), specs=[A1])
    msg = err(r, "session", "SIGSEGV", "Other sessions are not affected")
    assert "1 resident tensors" in msg, msg
    # the attacker's session is gone; its token opens nothing
    err(a.ask({"t": "ping", "free": [1]}), "session", "does not exist")
    assert server.alive()
    assert torch.equal(_get(v, hid, x), x)
    v.alive()  # the victim's session and a fresh one still compute


@pytest.mark.parametrize("lie", [4, 5, 6, 7, 8, 9, 11])
def test_a_worker_that_lies_to_the_front_costs_only_its_session(server: ServerProc,
                                                                victim, lie: int) -> None:
    """A worker is no more trusted than a client: a reply the front cannot read ends that
    session with a clear error (by the lying kernel's input size: a transfer whose header does
    not decode, a status frame one byte short, a status that is no known message, a status
    with negative counts, a channel message of more parts than any message has, one that
    declares more bytes than any message has, the end of a run it never answered early:
    ``genie.remote.worker._lie_impl``)."""
    v, hid, x = victim
    a = Session(server)
    y = torch.zeros(lie)
    r = a.run(["genie_test::lie.default"], [[0, 0, [-1], [0], [], False]], [host(y, 0)],
              (tensor_frame(y)[0],), specs=[A1])
    err(r, "session", "malformed reply")
    assert server.alive()
    assert torch.equal(_get(v, hid, x), x)
    v.alive()


def test_a_worker_that_sends_part_of_a_message_is_stopped_at_the_deadline(server: ServerProc,
                                                                          victim) -> None:
    """A worker whose message head promises more bytes than it sends (the lying kernel with 10
    elements; its real reply is then read as the rest) never gets the front to block or to
    take garbage as a reply: the front waits for the rest without waiting on it, and the
    request's deadline stops the worker; other sessions go on meanwhile."""
    v, hid, x = victim
    a = Session(server)
    y = torch.zeros(10)
    t0 = time.monotonic()
    r = a.run(["genie_test::lie.default"], [[0, 0, [-1], [0], [], False]], [host(y, 0)],
              (tensor_frame(y)[0],), specs=[A1])
    err(r, "timeout", "past the server's limit of 1 s", "worker was stopped")
    assert time.monotonic() - t0 < 10
    assert server.alive()
    assert torch.equal(_get(v, hid, x), x)
    v.alive()


def test_a_reply_larger_than_the_quota_is_refused_not_sent(server: ServerProc, victim) -> None:
    """A ``get`` that names one 8 MiB value nine times asks for 72 MiB, more than the session's
    quota of 64 MiB (the bound of what a worker may send the front): the worker refuses it
    with the fix; the same value named once still comes back."""
    v, hid, x = victim
    msg = err(v.ask({"t": "get", "ids": [hid] * 9}), "quota", "more than the session's quota",
              "ask for fewer at once")
    assert "75497472 bytes" in msg, msg
    assert torch.equal(_get(v, hid, x), x)


def test_an_out_of_bounds_read_never_sees_another_session(server: ServerProc, victim) -> None:
    v, hid, x = victim
    a = Session(server)
    y = torch.zeros(16, dtype=torch.uint8)
    seen = 0
    for n in (1 << 16, 1 << 20, 1 << 24):  # past the buffer, past the heap: until it faults
        r = a.run(["genie_test::overread.default"], [[0, 0, [-1, -1], [0], [], False]],
                  [host(y, 0), n], (tensor_frame(y)[0],), specs=[A2])
        if r is not None and r["t"] == "err":
            err(r, "session", "SIGSEGV")  # read into unmapped memory: the attacker's worker died
            break
        assert r and r["t"] == "ok", r
        got = b"".join(bytes(f) for f in a.frames)  # a large reply comes in several frames
        assert len(got) == n
        seen += n
        assert PATTERN_BYTES not in got, "another session's bytes were read"
    assert seen, "the overread kernel never ran"
    assert torch.equal(_get(v, hid, x), x)
    v.alive()


def test_a_kernel_that_never_returns_is_stopped_and_others_run(server: ServerProc,
                                                                victim) -> None:
    """``--max-run-seconds 1``: a single kernel that runs on is stopped by killing its worker
    (~3 s), and meanwhile another session's 1-op tapes run at their usual speed, even with two
    such kernels keeping both of this machine's cores busy."""
    v, hid, x = victim
    alone = min(_one_op(v) for _ in range(3))
    spinners = [Session(server), Session(server)]
    y = torch.zeros(4)
    t0 = time.monotonic()
    for s in spinners:  # sent without waiting: both spin at once
        s.rid += 1
        sk = protocol.pack([protocol.PROTOCOL_VERSION, ["genie_test::spin.default"], [A2],
                            [[0, 0, [-1, -1], [0], [], False]], [], [0], []])
        import hashlib

        key = hashlib.blake2b(sk, digest_size=16).digest()
        s.sock.send_multipart([protocol.pack({"t": "run", "rid": s.rid, "s": s.tok, "k": key,
                                              "id0": 1, "sk": sk, "c": [host(y, 0), 30.0]}),
                               tensor_frame(y)[0]])
    time.sleep(0.5)
    during = max(_one_op(v) for _ in range(5))
    for s in spinners:
        r = None
        while s.sock.poll(20000):
            r = protocol.unpack(s.sock.recv_multipart()[0])
            if r.get("t") != "busy":
                break
        msg = err(r, "timeout", "past the server's limit of 1 s", "worker was stopped")
        assert "inside one kernel" in msg
        err(s.ask({"t": "ping", "free": [1]}), "session", "does not exist")
    took = time.monotonic() - t0
    assert took < 10, f"the spinning kernels were stopped after {took:.1f} s (limit 1 s)"
    assert during < max(1.0, 20 * alone), (during, alone)
    assert server.alive()
    v.alive()


def test_a_tape_past_the_deadline_between_kernels_keeps_its_session(server: ServerProc,
                                                                    victim) -> None:
    """Many short kernels past ``--max-run-seconds``: stopped between two of them by the worker
    itself (the session and its values survive)."""
    v, hid, x = victim
    y = torch.zeros(4)
    n = 8
    rows = [[0, 0, [-1 if i == 0 else i - 1, -1], [i], [], False] for i in range(n)]
    consts = [host(y, 0)] + [0.4] * n
    r = v.run(["genie_test::spin.default"], rows, consts, (tensor_frame(y)[0],),
              outputs=(n - 1,), specs=[A2])
    err(r, "timeout")
    assert torch.equal(_get(v, hid, x), x)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64, torch.float64,
                                   torch.int64, torch.float16])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_odd_sized_uploads_of_any_dtype(server: ServerProc, dtype: torch.dtype, n: int) -> None:
    """Frames arrive at any offset (8 mod 16 for ZeroMQ); a complex128 value of an odd element
    count used to crash the server on its copy."""
    a = Session(server)
    x = (torch.arange(n, dtype=torch.float64) + 0.5).to(dtype)
    if dtype.is_complex:
        x = x + 1j * x
    hid = _keep(a, x)
    assert torch.equal(_get(a, hid, x), x)
    r = a.run(["aten::sum.default"], [[0, 0, [-1], [0], [], False]], [host(x, 0)],
              (tensor_frame(x)[0],), specs=[A1])
    assert r and r["t"] == "ok", r
    got = torch.frombuffer(bytearray(a.frames[0]), dtype=x.dtype)
    assert torch.equal(got.view(()), x.sum())
    a.close()


@pytest.fixture
def remote(server: ServerProc):
    import genie

    genie.connect(server.address, key_file=str(server.key_file), timeout=30)
    yield
    genie.disconnect()


def test_a_factory_sized_by_a_float_is_vetted_by_its_value(remote) -> None:
    """Finding 4: the vet's effect cache keyed ``arange.out``'s float end by its type, so after
    ``arange(10.0)`` an ``arange(1.34e8)`` (512 MiB under a 64 MiB quota) ran unaccounted."""
    from genie.remote import QuotaExceededError

    D = "remote_accelerator:0"
    t = torch.empty(0, device=D)
    torch.arange(10.0, out=t)
    assert torch.equal(t.cpu(), torch.arange(10.0))
    with pytest.raises(QuotaExceededError, match="quota"):
        torch.arange(1.34e8, out=t)
        t.cpu()


def test_an_allocation_past_the_accounting_is_bounded_by_the_os(server: ServerProc,
                                                               victim) -> None:
    """Finding 4: a data-dependent op allocates before any accounting (``bincount`` with a huge
    ``minlength``: 2 GiB, +513 MiB RSS before); the worker's OS limit refuses it, the session,
    its values and the server go on."""
    v, hid, x = victim
    i = torch.tensor([1, 2, 2])
    r = v.run(["aten::bincount.default"], [[0, 0, [-1, -1, -1], [0], [], False]],
              [host(i, 0), None, 1 << 28], (tensor_frame(i)[0],), specs=[A3])
    assert r is not None and r["t"] == "err", r
    assert r["kind"] in ("exec", "quota"), r
    assert "memory" in r["msg"].lower() or "quota" in r["msg"].lower(), r
    assert server.alive()
    r = v.run(["aten::bincount.default"], [[0, 0, [-1, -1, -1], [0], [], False]],
              [host(i, 0), None, 0], (tensor_frame(i)[0],), specs=[A3])
    assert r and r["t"] == "ok", r
    assert torch.frombuffer(bytearray(v.frames[0]), dtype=torch.int64).tolist() == [0, 1, 2]


def test_a_stalled_log_sink_never_stops_the_front(tmp_path) -> None:
    """Found by the per-op fuzzer: the front wrote its log lines synchronously, so once nobody
    read its output (a pipe full at 64 KiB; a stalled journal or disk) the next line blocked its
    loop and every session hung (a tenant gets a line logged per refused request). Records now go
    through a bounded queue to a log thread, dropped when it is full, never waited for."""
    s = ServerProc(tmp_path, "--quota", "64MiB", drain=False, log_level="INFO")
    try:
        a = Session(s)
        for _ in range(1500):  # ~150 bytes of log each: several times what the pipe holds
            r = a.ask({"t": "ping", "s": b"\x00" * 16, "free": []}, timeout_ms=10000)
            assert r is not None, "the front stopped answering"
            assert r["t"] == "err"
        a.alive()  # the front answers, a fresh session computes
        a.close()
    finally:
        s.proc.kill()
        s.proc.wait()


def test_a_failure_after_an_early_reply_ends_only_its_session(server: ServerProc,
                                                              victim) -> None:
    """A replayed tape whose outputs are final before its end is answered early (worker.py,
    "early replies"); when the rest then fails (``fail_if``: a data-dependent error the meta vet
    cannot see), what it was to write is unknown: the session ends, and its client's next
    request says why. Other sessions are not touched."""
    v, hid, x = victim
    a = Session(server)
    zeros, ones = _keep(a, torch.zeros(4)), _keep(a, torch.ones(4))
    rows = [[0, 0, [0, -1], [1], [], False],  # y = x * 2: the output
            [1, 1, [0], [2], [], False]]      # fail_if(x): kept, after the output is final

    def call(h: int) -> dict | None:
        return a.run(["aten::mul.Scalar", "genie_test::fail_if.default"], rows, [h, 2.0],
                     inputs=(0,), outputs=(1,), keep=(2,), specs=[A2, A1])

    replies = [call(zeros) for _ in range(3)]  # guarded, then replayed (answered early)
    assert all(r and r["t"] == "ok" for r in replies), replies
    assert replies[0].get("er") is None and replies[2].get("er") == 1, replies
    r = call(ones)  # answered early with its values; then fail_if raises
    assert r and r["t"] == "ok" and r.get("er") == 1, r
    assert torch.equal(torch.frombuffer(bytearray(a.frames[0]), dtype=torch.float32),
                       torch.full((4,), 2.0))
    msg = err(a.ask({"t": "ping", "sync": 1}), "session", "after its reply failed",
              "fail_if")
    assert "Other sessions are not affected" in msg, msg
    assert server.alive()
    assert torch.equal(_get(v, hid, x), x)
    v.alive()


def test_a_sync_ping_waits_for_the_rest_of_an_early_answered_tape(server: ServerProc) -> None:
    """``torch.remote_accelerator.synchronize()`` sends ``ping`` with ``sync``: the front
    answers a plain ping itself, a sync ping goes through the session's worker, after the rest
    of the tape it answered early (here ``spin`` for 0.15 s after the output is final; a tape
    that runs longer than a quarter of ``--max-run-seconds`` stays interpreted)."""
    a = Session(server)
    x = _keep(a, torch.zeros(4))
    rows = [[0, 0, [0, -1], [1], [], False], [1, 0, [0, -1], [2], [], False]]

    def call() -> dict | None:
        return a.run(["aten::mul.Scalar", "genie_test::spin.default"], rows, [x, 2.0, 0.15],
                     inputs=(0,), outputs=(1,), keep=(2,), specs=[A2])

    for _ in range(3):
        r = call()
        assert r and r["t"] == "ok", r
    assert a.ask({"t": "ping", "sync": 1})["t"] == "ok"  # (the last call's spin is over)
    t0 = time.monotonic()
    r = call()
    answered = time.monotonic() - t0
    assert r and r.get("er") == 1, r
    assert answered < 0.1, answered  # before the spin
    t0 = time.monotonic()
    assert a.ask({"t": "ping"})["t"] == "ok"
    plain = time.monotonic() - t0
    assert a.ask({"t": "ping", "sync": 1})["t"] == "ok"
    waited = time.monotonic() - t0
    assert plain < 0.1 and waited > 0.1, (plain, waited)
    a.close()


def test_a_request_sent_while_the_rest_of_an_early_answered_tape_runs_waits_for_it(
        server: ServerProc, victim) -> None:
    """The front forwards a session's next request while the rest of a tape it answered early
    still runs (the worker reads it once that rest is done, and its reply says so; no word of
    the rest's end in between): a run sent at once is answered after the rest, with what the
    rest kept; when the rest then fails, the request that waits for it gets the session's end
    and why. Other sessions are not touched."""
    v, hid, x = victim
    a = Session(server)
    zeros, ones = _keep(a, torch.zeros(4)), _keep(a, torch.ones(4))
    rows = [[0, 0, [0, -1], [1], [], False],  # y = x * 2: the output
            [1, 0, [0, -1], [2], [], False],  # spin(x, seconds): after the output is final
            [2, 1, [2], [3], [], False]]      # fail_if(spin(x)): kept

    def call(h: int, seconds: float) -> dict | None:
        return a.run(["aten::mul.Scalar", "genie_test::spin.default",
                      "genie_test::fail_if.default"], rows, [h, 2.0, seconds], inputs=(0,),
                     outputs=(1,), keep=(3,), specs=[A2, A1])

    for _ in range(3):  # guarded, then replayed (answered early)
        r = call(zeros, 0.01)
        assert r and r["t"] == "ok", r
    assert r.get("er") == 1, r
    t0 = time.monotonic()
    r = call(zeros, 0.3)
    assert r and r.get("er") == 1 and time.monotonic() - t0 < 0.25, r
    first = a.hid - 100  # the kept value of that call (its handle id)
    r = call(zeros, 0.01)  # forwarded at once; read by the worker after the 0.3 s spin
    assert r and r["t"] == "ok" and time.monotonic() - t0 > 0.3, r
    assert torch.equal(_get(a, first, torch.zeros(4)), torch.zeros(4))  # what the rest kept
    assert a.ask({"t": "ping", "sync": 1})["t"] == "ok"
    r = call(ones, 0.3)  # answered early; the spin runs, then fail_if raises
    assert r and r["t"] == "ok" and r.get("er") == 1, r
    msg = err(call(zeros, 0.01), "session", "after its reply failed", "fail_if")
    assert "Other sessions are not affected" in msg, msg
    assert server.alive()
    assert torch.equal(_get(v, hid, x), x)
    v.alive()


def test_the_deadline_covers_the_rest_of_an_early_answered_tape(server: ServerProc,
                                                                victim) -> None:
    """The rest of a tape answered early still runs under ``--max-run-seconds``: a kernel in it
    that never returns is stopped by killing the worker, and the client's next request says so;
    other sessions are not touched."""
    v, hid, x = victim
    a = Session(server)
    y = _keep(a, torch.zeros(4))
    rows = [[0, 0, [0, -1], [1], [], False], [1, 0, [0, -1], [2], [], False]]

    def call(seconds: float) -> dict | None:
        return a.run(["aten::mul.Scalar", "genie_test::spin.default"], rows, [y, 2.0, seconds],
                     inputs=(0,), outputs=(1,), keep=(2,), specs=[A2])

    for _ in range(3):
        r = call(0.01)
        assert r and r["t"] == "ok", r
    t0 = time.monotonic()
    r = call(30.0)  # answered at once; the spin then runs past the limit
    assert r and r["t"] == "ok" and r.get("er") == 1, r
    assert time.monotonic() - t0 < 1.0
    msg = err(a.ask({"t": "ping", "sync": 1}, timeout_ms=30000), "timeout",
              "a run answered early and the ping request after it ran",
              "past the server's limit of 1 s", "worker was stopped")
    assert time.monotonic() - t0 < 10, msg
    assert server.alive()
    assert torch.equal(_get(v, hid, x), x)
    v.alive()


def test_a_server_logging_to_a_file_keeps_its_workers_log(tmp_path) -> None:
    """A worker cannot write a regular file (RLIMIT_FSIZE 0): with the server's output sent to
    one (``genie-server ... > server.log 2>&1``) every line a worker logged (a failed request's
    traceback) was lost without a word. The front now copies its workers' output into it."""
    log = tmp_path / "server.log"
    (tmp_path / "keys").mkdir(mode=0o700)
    s = ServerProc(tmp_path / "keys", "--quota", "64MiB", log_level="DEBUG", log=log)
    try:
        a = Session(s)  # its worker logs what its sandbox took, at DEBUG
        deadline = time.monotonic() + 20
        while "sandboxed" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        a.alive()
        a.close()
    finally:
        assert s.stop() == 0
    text = log.read_text()
    assert re.search(r"genie\.server\.worker: genie-server: worker \d+ sandboxed: .*'fsize': 0",
                     text), text[-2000:]


def test_a_tenant_cannot_flood_the_servers_log(tmp_path) -> None:
    """Each refused or failed request is a line in the server's log (a traceback, for an
    internal error): a key holder that sends bad requests in a loop filled the disk the log goes
    to. Now each session's worker, and each client key in the front, has a log budget
    (genie.remote.logbudget; 5 records at once, then one a second here): the flood is dropped
    and counted, another session's lines still reach the log."""
    log = tmp_path / "server.log"
    (tmp_path / "keys").mkdir(mode=0o700)
    os.environ["GENIE_SERVER_LOG_BUDGET"] = "5/1"
    try:
        s = ServerProc(tmp_path / "keys", "--quota", "64MiB", log_level="INFO", log=log)
    finally:
        del os.environ["GENIE_SERVER_LOG_BUDGET"]
    x = torch.zeros(4)

    def bad(sess: Session, name: str) -> None:
        r = sess.run([f"aten::{name}.default"], [[0, 0, [-1], [0], [], False]], [host(x, 0)],
                     (tensor_frame(x)[0],), specs=[A1])
        err(r, "protocol", name)

    try:
        a, v = Session(s), Session(s)
        t0 = time.monotonic()
        for _ in range(60):
            bad(a, "attacker_flood")  # refused in a's worker: a line in its log each
            err(a.ask({"t": "ping", "s": b"\0" * 16}), "session")  # refused by the front
        elapsed = time.monotonic() - t0
        bad(v, "victim_line")  # another session's worker: its own budget
        time.sleep(1.5)
        bad(a, "attacker_after")  # the budget refilled: it passes, saying what was dropped
        a.close()
        v.close()
    finally:
        assert s.stop() == 0
    text = log.read_text()
    allowed = 5 + int(elapsed) + 2
    flood = text.count("attacker_flood")
    assert 5 <= flood <= allowed, (flood, elapsed, text[-3000:])
    refusals = text.count("refused a request (session)")  # (the sessions' opening lines and
    assert 1 <= refusals <= allowed, (refusals, elapsed, text[-3000:])  # these share a budget)
    assert "earlier log record(s) of this client's dropped" in text, text[-3000:]
    assert "victim_line" in text, text[-3000:]
    line = next(ln for ln in text.splitlines() if "attacker_after" in ln)
    dropped = re.search(r"and (\d+) earlier log record\(s\) of this session's dropped", line)
    assert dropped and flood + int(dropped[1]) >= 60, line
