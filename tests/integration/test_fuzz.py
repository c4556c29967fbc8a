"""A structure-aware fuzzer against a real ``genie-server`` (issue 10).

The corpus is valid ``run`` requests of real Genie programs (elementwise chains, matmuls, views,
factories, reductions, indexing, random ops, in-place updates, uploads). Each fuzzed message is
one of them mutated field by field - header fields, op names (any aten overload, admitted or
not), argument trees, leaves, slots, frees, outputs, constants (numbers, shapes, strides,
dtypes, devices, extension values, nesting), frame references and the frames themselves - or
random bytes, or a bit-flipped valid message. Skeleton keys are recomputed (most of the time)
so that mutations reach the compiler, the vet and the ops, not only the hash check.

Checked: zero crashes (the process is alive after every message), every decodable request is
answered, the server answers a ping after every batch, and its RSS stays within
``baseline + quota + RSS_SLACK`` (the documented constant). A few thousand messages run by default
(< ~60 s here); ``GENIE_FULL_TESTS=1`` runs >= 100,000 (``GENIE_FUZZ_MESSAGES`` overrides).
The figures print at the end (``-s``).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import genie
from genie.planner import build_tape

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from genie.remote import allowlist, protocol  # noqa: E402
from genie.remote.protocol import (  # noqa: E402
    EXT_COMPLEX, EXT_DEVICE, EXT_DTYPE, EXT_HOST, EXT_INPUT, EXT_LAYOUT, EXT_MEMFMT, EXT_META,
    EXT_SIZE)
from test_remote import ServerProc, _raw  # noqa: E402
from test_security import RSS_SLACK, rss  # noqa: E402

DEV = "remote_accelerator:0"
FULL = os.environ.get("GENIE_FULL_TESTS", "0") == "1"
MESSAGES = int(os.environ.get("GENIE_FUZZ_MESSAGES", 100_000 if FULL else 4000))
BATCH = 250
QUOTA = 64 << 20


def _programs() -> list[list[torch.Tensor]]:
    """Lazy values of small Genie programs (recorded in process, never run here)."""
    torch.manual_seed(0)
    a = torch.randn(4, 6).to(DEV)
    b = torch.randn(6, 3).to(DEV)
    i = torch.tensor([0, 2, 1]).to(DEV)
    progs = [
        [(a * 3 + 1).relu().sum()],
        [a @ b, (a @ b).t().contiguous()],
        [a.view(2, 12)[:, 3:7].transpose(0, 1).clone()],
        [torch.zeros(5, 5, device=DEV) + torch.arange(5.0, device=DEV)],
        [a.index_select(1, i), a.gather(1, i.expand(4, 3))],
        [torch.randn(3, 3, device=DEV), torch.rand(2, device=DEV) * a.mean()],
        [torch.nn.functional.gelu(a, approximate="tanh").softmax(-1)],
        [a.new_zeros(3, 3).fill_(2.0), torch.empty(2, 2, device=DEV).zero_()],
        [a.cumsum(0).max(dim=1).values, a.sort(dim=1).indices],
        [torch.where(a > 0, a, b.t().sum() * 0), a.to(torch.float16).float()],
    ]
    c = torch.ones(3, 3).to(DEV)
    c.add_(1).mul_(a[:3, :3])
    progs.append([c])
    return progs


def _corpus() -> list[tuple[dict, list[Any]]]:
    """Valid run requests (header without session, rid and id0; frames)."""
    out = []
    for values in _programs():
        tape = build_tape([(v._node, v._out) for v in values])
        hids = iter(range(10 ** 6, 2 * 10 ** 6))

        def const(_s: int, v: Any, frames: list[Any]) -> Any:
            return msgpack.ExtType(EXT_INPUT, protocol.pack([protocol.host_ref(v, frames),
                                                            next(hids)]))

        enc = protocol.encode_tape(tape, const)
        out.append(({"t": "run", "k": enc.key, "sk": enc.skeleton, "c": enc.consts},
                    [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f
                     for f in enc.frames]))
    return out


_OPS = [allowlist.op_name(op) for op in allowlist.all_aten_overloads()]
_DTYPES = ["float32", "int64", "bool", "float16", "complex64", "quint8", "qint32", "bits8",
           "uint3", "nope", "float8_e4m3fn", "bfloat16", "uint64"]


class Mutator:
    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def scalar(self) -> Any:
        r = self.r
        return r.choice([
            0, 1, -1, 2, 3, 7, 64, 1 << 16, 1 << 31, (1 << 63) - 1, -(1 << 63), 1 << 40, 10 ** 9,
            0.5, -0.0, float("nan"), float("inf"), 1e300, True, False, None, "", "sum", "tanh",
            "meta", "cpu", "cuda:0", "/etc/passwd", b"\x00" * 8, [], [1, 2], [[1], [2]],
            {"a": 1}, [1 << 40, 1 << 40], [-1], [0, 0, 0],
            msgpack.ExtType(EXT_DTYPE, r.choice(_DTYPES).encode()),
            msgpack.ExtType(EXT_DEVICE, r.choice([b"cpu", b"remote_accelerator:0", b"meta",
                                                  b"cuda", b"remote_accelerator:99999"])),
            msgpack.ExtType(EXT_LAYOUT, r.choice([b"strided", b"sparse_coo", b"x"])),
            msgpack.ExtType(EXT_MEMFMT, r.choice([b"contiguous_format", b"channels_last"])),
            msgpack.ExtType(EXT_SIZE, protocol.pack([r.randrange(1 << 20), r.randrange(9)])),
            msgpack.ExtType(EXT_COMPLEX, protocol.pack([1.0, -2.0])),
            msgpack.ExtType(EXT_META, protocol.pack(self.meta())),
            msgpack.ExtType(EXT_HOST, protocol.pack(self.ref())),
            msgpack.ExtType(EXT_INPUT, protocol.pack([self.ref(), r.randrange(1 << 20)])),
            msgpack.ExtType(r.randrange(128), bytes(r.randrange(256) for _ in range(8))),
            msgpack.ExtType(EXT_HOST, protocol.pack(msgpack.ExtType(EXT_HOST, b"\xc0"))),
        ])

    def shape(self) -> list[int]:
        r = self.r
        return r.choice([[], [0], [4], [2, 3], [1 << 20], [1 << 28], [-1], [3] * 70,
                         [r.randrange(64) for _ in range(r.randrange(5))]])

    def meta(self) -> list[Any]:
        s = self.shape()
        st = self.r.choice([[1] * len(s), [0] * len(s), [1 << 30] * len(s), [-1] * len(s), [1]])
        return [s, st, self.r.choice([0, 5, -1, 1 << 40]), self.r.choice(_DTYPES)]

    def ref(self) -> list[Any]:
        s = self.shape()
        return [self.r.randrange(4), self.r.choice(_DTYPES), s,
                self.r.choice([None, [1] * len(s), [2] * len(s), [0] * len(s)])]

    def tweak(self, x: Any, depth: int = 0) -> Any:
        """x with one random change somewhere inside."""
        r = self.r
        if isinstance(x, list) and x and depth < 6 and r.random() < 0.7:
            x = list(x)
            i = r.randrange(len(x))
            op = r.random()
            if op < 0.6:
                x[i] = self.tweak(x[i], depth + 1)
            elif op < 0.7:
                del x[i]
            elif op < 0.8:
                x.insert(i, self.scalar())
            elif op < 0.9:
                x[i] = [x[i]]  # nesting
            else:
                x = x + x
            return x
        if isinstance(x, msgpack.ExtType) and r.random() < 0.5:
            try:
                inner = msgpack.unpackb(x.data, raw=False)
                return msgpack.ExtType(x.code, protocol.pack(self.tweak(inner, depth + 1)))
            except Exception:
                return self.scalar()
        if type(x) is int and r.random() < 0.5:
            v = r.choice([x + 1, x - 1, -x, x * 1000, x << 20, 0])
            return v if -(1 << 63) <= v < (1 << 64) else (1 << 63) - 1
        return self.scalar()

    def skeleton(self, sk: bytes) -> bytes:
        r = self.r
        s = msgpack.unpackb(sk, raw=False)
        field = r.randrange(8)
        if field == 1 and r.random() < 0.6:  # an op name: any aten overload, or garbage
            names = list(s[1])
            if names:
                names[r.randrange(len(names))] = r.choice(
                    [r.choice(_OPS), r.choice(_OPS), "genie.upload", "aten::x.y", "os::system",
                     "aten::" + "a" * 300, 42])
            s[1] = names
        elif field == 3 and s[3] and r.random() < 0.8:  # one instruction, one of its fields
            rows = list(s[3])
            j = r.randrange(len(rows))
            row = list(rows[j])
            k = r.randrange(6)
            row[k] = self.tweak(row[k]) if r.random() < 0.8 else self.scalar()
            rows[j] = row
            s[3] = rows
        else:
            s = self.tweak(s)
        return protocol.pack(s)

    def request(self, seed: tuple[dict, list[Any]], tok: bytes, rid: int
                ) -> list[bytes]:
        self.lossy = False  # True: the rid may be destroyed, an answer may not name it
        r = self.r
        h, frames = dict(seed[0]), list(seed[1])
        h.update(s=tok, rid=rid, id0=r.choice([1, rid * 1000, 0]))
        kind = r.random()
        if kind < 0.1:
            self.lossy = True
        if kind < 0.05:  # random bytes
            return [bytes(r.randrange(256) for _ in range(r.randrange(1, 200)))]
        if kind < 0.1:  # a valid message with flipped bytes
            b = bytearray(protocol.pack(h))
            for _ in range(r.randrange(1, 8)):
                b[r.randrange(len(b))] = r.randrange(256)
            return [bytes(b), *frames]
        what = r.random()
        if what < 0.45:
            h["sk"] = self.skeleton(h["sk"])
        elif what < 0.75:
            c = list(h["c"])
            for _ in range(r.randrange(1, 3)):
                if c:
                    i = r.randrange(len(c))
                    c[i] = self.tweak(c[i])
            h["c"] = c
        elif what < 0.85:  # frames: dropped, truncated, grown, extra
            if frames and r.random() < 0.5:
                i = r.randrange(len(frames))
                f = frames[i]
                frames[i] = r.choice([f[: len(f) // 2], f + f, b"", f[:-1]])
            elif frames and r.random() < 0.5:
                frames.pop()
            else:
                frames.append(b"\x00" * r.choice([0, 3, 64]))
        else:  # header fields
            key = r.choice(["t", "k", "id0", "s", "c", "d", "sk", "free", "ids"])
            h[key] = self.tweak(h.get(key, 0)) if r.random() < 0.5 else self.scalar()
            if key == "d":
                h.pop("c", None)
        if isinstance(h.get("sk"), bytes) and r.random() < 0.9:
            h["k"] = hashlib.blake2b(h["sk"], digest_size=16).digest()
        return [protocol.pack(h), *frames]


def _hello(sock: zmq.Socket, rid: int) -> bytes:
    sock.send_multipart([protocol.pack({"t": "hello", "v": protocol.PROTOCOL_VERSION,
                                        "rid": rid})])
    while sock.poll(30000):
        h = protocol.unpack(sock.recv_multipart()[0])
        if h.get("rid") == rid and h["t"] == "ok":
            return h["session"]
    raise AssertionError("no session")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("genie-fuzz-keys")
    s = ServerProc(keys, "--quota", "64MiB", "--max-message", "16MiB", "--max-run-seconds", "5",
                   "--workers", "2", "--peers", str(keys / "peers.json"))
    # its own pool: the sends of the peer fuzzer go to this very server
    (keys / "peers.json").write_text(json.dumps({"peers": [
        {"address": s.address, "server_public_key": s.keys["server_public_key"]}]}))
    s.keys_dir = keys
    yield s
    assert s.stop() == 0


def test_fuzz_structure_aware(server: ServerProc) -> None:
    corpus = _corpus()
    genie.disconnect()
    sock = _raw(server)
    rid = 1
    tok = _hello(sock, rid)
    # the corpus itself runs
    for h, frames in corpus:
        rid += 1
        sock.send_multipart([protocol.pack({**h, "s": tok, "rid": rid, "id0": rid * 1000}),
                             *frames])
        while sock.poll(30000):
            r = protocol.unpack(sock.recv_multipart()[0])
            if r.get("rid") == rid and r["t"] != "busy":
                break
        assert r["t"] == "ok", r
    pid = server.proc.pid
    baseline = rss(pid)
    m = Mutator(0)
    sent = answered = 0
    kinds: collections.Counter[str] = collections.Counter()
    t0 = time.monotonic()
    peak = baseline
    dbg_hwm = rss(pid, "VmHWM")
    while sent < MESSAGES:
        for _ in range(BATCH):
            rid += 1
            parts = m.request(m.r.choice(corpus), tok, rid)
            sock.send_multipart(parts)
            sent += 1
            got = None
            while sock.poll(1000 if m.lossy else 15000):
                r = protocol.unpack(sock.recv_multipart()[0])
                if r.get("t") != "busy" and r.get("rid") in (rid, -1):
                    got = r
                    break
            assert server.alive(), f"genie-server died on message {sent}: {parts[0][:300]!r}"
            answered += got is not None or m.lossy
            if os.environ.get("GENIE_FUZZ_DEBUG"):
                hwm = rss(pid, "VmHWM")
                if hwm > dbg_hwm + (24 << 20):
                    print("HWM", hwm >> 20, got and got.get("t"), got and got.get("kind"),
                          str(got and got.get("msg"))[:200], protocol.msgpack.unpackb(
                              parts[0], raw=False, strict_map_key=False) if len(parts[0]) < 3000
                          else len(parts[0]))
                dbg_hwm = max(dbg_hwm, hwm)
            if got is not None and got.get("kind") == "internal" and \
                    os.environ.get("GENIE_FUZZ_DEBUG"):
                print("INTERNAL", got.get("msg", "")[:300])
            if got is None and not m.lossy and os.environ.get("GENIE_FUZZ_DEBUG"):
                print("NOANSWER", protocol.msgpack.unpackb(parts[0], raw=False,
                      strict_map_key=False), [len(p) for p in parts[1:]])
            kinds[f"{got['t']}:{got.get('kind', '')}" if got else "none"] += 1
        # after every batch: the server answers a ping, and a new session (no quota carried)
        rid += 1
        sock.send_multipart([protocol.pack({"t": "ping", "rid": rid, "s": tok, "free": [0]})])
        while True:
            assert sock.poll(30000), "no answer to a ping after a batch"
            r = protocol.unpack(sock.recv_multipart()[0])
            if r.get("rid") == rid and r["t"] != "busy":  # a busy note: keep waiting
                break
        assert r["t"] in ("ok", "err"), r
        sock.send_multipart([protocol.pack({"t": "bye", "rid": rid + 1, "s": tok})])
        rid += 2
        tok = _hello(sock, rid)
        now = rss(pid)
        peak = max(peak, now)
        assert now <= baseline + QUOTA + RSS_SLACK, (now, baseline)
    sock.close()
    peak = max(peak, rss(pid, "VmHWM"))
    took = time.monotonic() - t0
    print(f"\n[genie fuzz] {sent} messages in {took:.0f} s, {answered} answered, 0 crashes; "
          f"server RSS baseline {baseline >> 20} MiB, peak {peak >> 20} MiB "
          f"(bound {(baseline + QUOTA + RSS_SLACK) >> 20} MiB); answers {dict(kinds)}")
    assert answered >= sent * 0.95
    assert peak <= baseline + QUOTA + RSS_SLACK


def test_fuzz_report_path(tmp_path: Path) -> None:
    """The fuzzer's corpus is made of admitted ops only (else mutations would test less)."""
    for h, _ in _corpus():
        names = msgpack.unpackb(h["sk"], raw=False)[1]
        assert all(n == protocol.UPLOAD or allowlist.admitted(n) for n in names), names


# --- server-to-server messages (issue 15) ------------------------------------------------------

PEER_MESSAGES = int(os.environ.get("GENIE_FUZZ_PEER_MESSAGES", 20_000 if FULL else 1500))


def _peer_seeds(address: str, tok: bytes, nonce: int, k: int, sk: str | None = None
                ) -> list[tuple[dict, list[bytes]]]:
    """Valid put and send messages for the session ``tok`` (a send to this very server, of
    the values stored under ids 1 to 4), writing fresh ids from ``k`` on."""
    from genie.remote import peer

    base = torch.arange(24.0).reshape(4, 6)
    geo, frames, _ = peer.pack_values([base, base.t(), base[1:3, 2:5], torch.arange(5)])
    put = {"t": "put", "sid": peer.session_id(tok), "n": nonce, "ids": [k, k + 1, k + 2, k + 3],
           "v": [g.signed() for g in geo], "g": [g.group for g in geo]}
    send = {"t": "send", "s": tok, "ids": [1, 2], "to": address, "dids": [k, k + 1],
            "o": [g.signed() for g in geo[:2]], "sid": peer.session_id(tok), "n": nonce,
            "to_s": 2.0, "sk": sk}
    return [(put, [bytes(memoryview(f).cast("B")) for f in frames]), (send, [])]


def _peer_sock(server: ServerProc):
    """A raw socket authenticated with the server's peer key pair (puts come only from one)."""
    import zmq
    from zmq.auth import load_certificate

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.curve_serverkey = server.keys["server_public_key"].encode()
    s.curve_publickey, s.curve_secretkey = load_certificate(
        str(server.keys_dir / "peer.key_secret"))
    s.connect(server.address)
    return s


def test_fuzz_peer_messages(server: ServerProc) -> None:
    """put and send, mutated field by field (geometry, ids, nonces, tickets, destinations,
    frames): no crash, every message answered, nothing past the quota; tickets are recomputed
    for 90% of the mutated messages so that the mutations reach the checks behind them."""
    from genie.remote import peer

    genie.disconnect()
    sock = _raw(server)
    psock = _peer_sock(server)
    rid = 1
    nonce = 1

    def session(rid: int) -> bytes:
        """A fresh session holding values under ids 1 to 4 (what the sends read)."""
        tok = _hello(sock, rid)
        h, frames = _peer_seeds(server.address, tok, 1, 1)[0]
        h = {**h, "rid": rid, "tk": peer.ticket(tok, 1, h["ids"], h["v"])}
        psock.send_multipart([protocol.pack(h), *frames])
        while True:
            assert psock.poll(15000)
            a = protocol.unpack(psock.recv_multipart()[0])
            if a.get("rid") == rid and a["t"] != "busy":
                assert a["t"] == "ok", a
                return tok

    tok = session(rid)
    nonce = 2
    pid = server.proc.pid
    baseline = rss(pid)
    m = Mutator(1)
    r = m.r
    kinds: collections.Counter[str] = collections.Counter()
    sent = answered = 0
    while sent < PEER_MESSAGES:
        for _ in range(BATCH):
            rid += 1
            nonce += 1
            h, frames = r.choice(_peer_seeds(server.address, tok, nonce, 10 * rid,
                                             server.keys["server_public_key"]))
            h, frames = dict(h), list(frames)
            what = r.random()
            if what < 0.5:
                key = r.choice(list(h))
                if key != "t":
                    h[key] = m.tweak(h[key]) if r.random() < 0.7 else m.scalar()
            elif what < 0.7 and frames:
                i = r.randrange(len(frames))
                frames[i] = r.choice([frames[i][:-1], frames[i] * 2, b""])
            elif what < 0.8:
                frames.append(b"\x00" * r.choice([0, 4, 64]))
            ids = h.get("ids") if h["t"] == "put" else h.get("dids")
            if r.random() < 0.9:
                try:
                    h["tk"] = peer.ticket(tok, h.get("n"), ids,
                                          h.get("v") if h["t"] == "put" else h.get("o"))
                except Exception:
                    h["tk"] = b"\0" * 16
            else:
                h["tk"] = m.tweak(b"\0" * 16)
            h["rid"] = rid
            to = psock if h["t"] == "put" else sock
            to.send_multipart([protocol.pack(h), *frames])
            sent += 1
            got = None
            deadline = time.monotonic() + 15  # "busy" notes of an unanswered send never end it
            while time.monotonic() < deadline and to.poll(1000):
                a = protocol.unpack(to.recv_multipart()[0])
                if a.get("t") != "busy" and a.get("rid") in (rid, -1):
                    got = a
                    break
            assert server.alive(), f"genie-server died on peer message {sent}: {h!r:.300}"
            assert got is not None, f"peer message {sent} got no answer: {h!r:.300}"
            answered += got is not None
            kinds[f"{h['t']}/{got['t']}:{got.get('kind', '')}" if got else "none"] += 1
        rid += 1
        sock.send_multipart([protocol.pack({"t": "bye", "rid": rid, "s": tok})])
        rid += 1
        tok = session(rid)
        nonce = 2
        assert rss(pid) <= baseline + QUOTA + RSS_SLACK
    sock.close()
    psock.close()
    print(f"\n[genie fuzz] {sent} peer messages, {answered} answered; answers {dict(kinds)}")
    assert answered == sent
    assert kinds.get("put/err:internal", 0) == 0 and kinds.get("send/err:internal", 0) == 0
