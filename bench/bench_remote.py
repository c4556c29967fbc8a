"""Remote execution through a loopback ``genie-server``: round trips, bytes, time, throughput.

* GPT-2 greedy generation (``transformers``; random weights, 4 layers, 4 heads, width 128, vocab
  1000), 32 new tokens from an 8-token prompt, ``model.generate(do_sample=False)`` unchanged:

  - ``eager``: plain PyTorch on the CPU;
  - ``in-process``: Genie's embedded executor (``remote_accelerator`` = this process's CPU);
  - ``remote``: Genie through a server process on loopback (CURVE on, the default);
  - ``naive``: the same server, but every recorded op is sent as its own request the moment it
    is recorded (what an op-by-op remoting such as torch RPC pays; only requested values come
    back, resident values stay on the server, so this baseline is already generous).

  Per generated token after the first (prompt and weights excluded): round trips, bytes sent
  and received (``genie.stats()``), wall time. Target: 1 round trip and under 2 KB sent per token.
* Upload throughput of one 128 MiB float32 tensor (``t.to(dev)`` then ``.sum().item()``, so the
  reply is a scalar) through an ``--insecure`` server and a CURVE server, against a raw loopback
  TCP socket moving the same bytes between two threads; and the download of a resident 128 MiB
  value (``.cpu()``). Each connection first moves one untimed 128 MiB upload (first-use costs:
  allocator, page faults, skeleton), so the rows are the steady state a training loop sees. The
  same bytes between two plain ZeroMQ sockets, with and without CURVE (one frame; and 4 MiB
  frames, whose encryption and decryption overlap), give the transport's and the cipher's own
  ceilings in the same run.
* Serving (issue 14): a short request's latency (warm ``.item()`` of a 6-element tape) while
  another client process runs a chain of 1024x1024 matmuls, on a server with ``--workers 1``
  against ``--workers 4``, and with no other client; recovery of a 20-step AdamW loop after
  ``kill -9`` of its server at step 10 (the replay, ``genie.stats()["last_recovery_ms"]``)
  against re-running the lost steps from scratch on a fresh session; ``genie-pool`` start-up for
  2 CPU servers (Ray actors when Ray is installed, local processes always).
* Placement over a pool of two CURVE servers (issue 15), the same GPT-2 generate under each
  policy (``fixed``, ``phase-split``, ``semantic``): tokens equal eager's; per decode token of the
  second request (weights and skeletons already in place), bytes through the client, round trips
  and time; ``peer_bytes`` per request against the prompt's KV cache size. Then two clients at
  once: another process runs prefills of a 1000-token prompt back to back while this one generates;
  the generating client's time per token alone, with both clients on one server (``fixed``), and
  with both on the pool under ``semantic`` (target: within 1.2x of alone).

Servers run on the same machine as the client, with as many intra-op threads as the client
(``GENIE_BENCH_THREADS``, default 1): on a small shared machine both compete for the same cores,
so times are an upper bound; round trips and bytes do not depend on the machine.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import genie

zmq = pytest.importorskip("zmq")
transformers = pytest.importorskip("transformers")

SUITE = "bench_remote: loopback genie-server"
DEV = "remote_accelerator:0"
TOKENS = 32
UPLOAD_MIB = 128
ROOT = Path(__file__).resolve().parents[1]


class _Server:
    def __init__(self, keys: Path, *args: str, cpu: int | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GENIE_LOG_LEVEL": "WARNING"}
        env.pop("GENIE_SERVER", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "genie.remote.server", "--device", "cpu", "--listen",
             "127.0.0.1:0", "--keys", str(keys), "--threads", str(torch.get_num_threads()),
             *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            preexec_fn=None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu})))
        line = "-"
        while line and not line.startswith("genie-server: serving"):
            line = self.proc.stdout.readline()
        m = re.search(r"tcp://[\d.]+:\d+", line)
        if m is None:
            self.proc.kill()
            raise RuntimeError(f"genie-server did not start: {line!r}")
        self.address = m.group(0)
        self.key_file = str(keys / "client.json")

    def connect(self, insecure: bool = False) -> None:
        genie.connect(self.address, key_file=None if insecure else self.key_file,
                      insecure=insecure, timeout=60)

    @staticmethod
    def pool(keys: Path, *servers: _Server) -> list[_Server]:
        """Register ``servers`` (started with ``--peers KEYS/peers.json``) as each other's peers,
        as genie-pool does: a server sends values only to its pool's members."""
        import json

        k = json.loads((keys / "client.json").read_text())["server_public_key"]
        (keys / "peers.json").write_text(json.dumps({"peers": [
            {"address": s.address, "server_public_key": k} for s in servers]}))
        return list(servers)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def servers():
    with tempfile.TemporaryDirectory() as d:
        curve = _Server(Path(d))
        plain = _Server(Path(d), "--insecure")
        yield {"curve": curve, "insecure": plain}
        genie.disconnect()
        curve.stop()
        plain.stop()


# --- GPT-2 generation -----------------------------------------------------------------------------

def _gpt2() -> tuple[torch.nn.Module, torch.Tensor]:
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=1000,
                                  n_positions=128, bos_token_id=0, eos_token_id=999)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(1, 999, (1, 8), generator=torch.Generator().manual_seed(1))
    return model, ids


class _PerStep(transformers.LogitsProcessor):
    """Snapshots counters and the clock once per generation step."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, dict[str, int]]] = []

    def __call__(self, input_ids, scores):  # noqa: ANN001, ANN204
        self.marks.append((time.perf_counter(), genie.stats()))
        return scores


def _generate(model: torch.nn.Module, ids: torch.Tensor, dev: str) -> tuple[torch.Tensor, dict]:
    per = _PerStep()
    genie.reset_stats()
    t0 = time.perf_counter()
    out = model.generate(ids.to(dev), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0,
                         logits_processor=transformers.LogitsProcessorList([per]))
    out = out.cpu()
    total = time.perf_counter() - t0
    per.marks.append((time.perf_counter(), genie.stats()))
    steps = per.marks[1:]  # token 2 onwards: the prompt and the weights are behind us
    pairs = list(zip(steps, steps[1:], strict=False))
    d = {k: statistics.median(b[1].get(k, 0) - a[1].get(k, 0) for a, b in pairs)
         for k in ("round_trips", "bytes_sent", "bytes_received", "materializations")}
    d["s/token"] = statistics.median(b[0] - a[0] for a, b in pairs)
    through = [b[1].get("bytes_sent", 0) + b[1].get("bytes_received", 0)
               - a[1].get("bytes_sent", 0) - a[1].get("bytes_received", 0) for a, b in pairs]
    d["client B/token"] = statistics.median(through)
    d["client B/token max"] = max(through)
    d["total s"] = total
    d["first bytes_sent"] = per.marks[1][1].get("bytes_sent", 0)
    last = per.marks[-1][1]
    d["peer_bytes"] = last.get("peer_bytes", 0)
    d["placement.moved"] = last.get("placement.moved", 0)
    return out, d


class _OpPerRequest:
    """Run every recorded op at once, as its own request (outputs stay on the server)."""

    def __enter__(self) -> None:
        from genie import executor, lazy_tensor, planner

        self._orig = orig = lazy_tensor._record

        def record(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = orig(*args, **kwargs)
            import optree

            targets = []
            for t in optree.tree_leaves(out, none_is_leaf=True):
                if isinstance(t, lazy_tensor.LazyTensor) and not t._node.executed:
                    if all(n is not t._node for n, _ in targets):
                        targets.append((t._node, t._out))
            if targets:
                tape = planner.build_tape(targets)
                tape.outputs = []
                executor.run_tape(tape, tape.index)
            return out

        lazy_tensor._record = record

    def __exit__(self, *exc: object) -> None:
        from genie import lazy_tensor

        lazy_tensor._record = self._orig


def test_gpt2_generate(benchmark, ratios, servers) -> None:
    benchmark.group = f"GPT-2 greedy generation, {TOKENS} tokens"
    model, ids = _gpt2()
    ref = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    results: dict[str, dict] = {}

    def eager() -> None:
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
        results["eager"] = {"s/token": (time.perf_counter() - t0) / TOKENS}

    def run(name: str) -> None:
        m = model.to(DEV)
        if name == "naive":
            with _OpPerRequest():
                out, d = _generate(m, ids, DEV)
        else:
            out, d = _generate(m, ids, DEV)
        model.to("cpu")
        assert torch.equal(out, ref), f"{name}: tokens differ from eager"
        results[name] = d

    def all_variants() -> None:
        eager()
        genie.disconnect()
        run("in-process")
        servers["curve"].connect()
        run("remote")
        run("naive")
        genie.disconnect()

    benchmark.pedantic(all_variants, rounds=1, iterations=1)
    t = ratios.row(SUITE, f"GPT-2 greedy, {TOKENS} tokens: time per token", unit="ms/token",
                   scale=1e3, ratios=[("remote", "in-process"), ("naive", "remote"),
                                      ("in-process", "eager")])
    for k, d in results.items():
        t.values[k] = d["s/token"]
    for key, unit in [("round_trips", "round trips/token"), ("bytes_sent", "B sent/token"),
                      ("bytes_received", "B received/token")]:
        r = ratios.row(SUITE, f"GPT-2 greedy, per token after the first: {key}", unit=unit,
                       scale=1, ratios=[("naive", "remote")])
        for k in ("remote", "naive"):
            r.values[k] = results[k][key]
    first = ratios.row(SUITE, "GPT-2 greedy: bytes sent up to the first token (weights + prompt)",
                       unit="B", scale=1)
    first.values["remote"] = results["remote"]["first bytes_sent"]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    first.notes.append(f"weights {weights:,} B")
    for k, d in results.items():
        benchmark.extra_info[k] = d


# --- throughput -----------------------------------------------------------------------------------

def _raw_socket_seconds(nbytes: int) -> float:
    """Seconds to move ``nbytes`` over a loopback TCP socket (sender and receiver threads)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    buf = bytearray(nbytes)
    done = threading.Event()

    def receive() -> None:
        conn, _ = srv.accept()
        view = memoryview(bytearray(nbytes))
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:], min(1 << 22, nbytes - got))
        conn.sendall(b"k")
        conn.close()
        done.set()

    th = threading.Thread(target=receive)
    th.start()
    c = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    c.sendall(buf)
    c.recv(1)
    dt = time.perf_counter() - t0
    c.close()
    th.join()
    srv.close()
    return dt


def _zmq_seconds(nbytes: int, curve: bool, frame: int | None = None) -> float:
    """Seconds to move ``nbytes`` between two ZeroMQ sockets over loopback TCP (PUSH -> PULL, as
    one frame or as frames of ``frame`` bytes), with CURVE or without: the transport's own speed,
    the ceiling for Genie's transfers on the same wire."""
    ctx = zmq.Context()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        if curve:
            spub, ssec = zmq.curve_keypair()
            cpub, csec = zmq.curve_keypair()
            rx.curve_server, rx.curve_secretkey, rx.curve_publickey = True, ssec, spub
            tx.curve_serverkey, tx.curve_publickey, tx.curve_secretkey = spub, cpub, csec
        port = rx.bind_to_random_port("tcp://127.0.0.1")
        tx.connect(f"tcp://127.0.0.1:{port}")
        tx.send(b"x")  # connection and handshake, untimed
        rx.recv()
        buf = memoryview(bytearray(nbytes))
        parts = [buf] if frame is None else [buf[i:i + frame] for i in range(0, nbytes, frame)]
        t0 = time.perf_counter()
        tx.send_multipart(parts, copy=False)
        got = rx.recv_multipart(copy=False)
        dt = time.perf_counter() - t0
        assert sum(len(f.buffer) for f in got) == nbytes
        return dt
    finally:
        tx.close(linger=0)
        rx.close(linger=0)
        ctx.term()


def _cipher_mb_s(nbytes: int = 4 << 20) -> float | None:
    """MB/s of CURVE's cipher itself (XSalsa20-Poly1305, ``crypto_box_easy_afternm``) on one core,
    through the libsodium that pyzmq bundles (None where it cannot be found)."""
    import ctypes
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(zmq.__file__), "..", "pyzmq.libs",
                                  "libsodium*.so*"))
    if not libs:
        return None
    lib = ctypes.CDLL(libs[0])
    if lib.sodium_init() < 0:
        return None
    pk, sk, k = (ctypes.create_string_buffer(32) for _ in range(3))
    lib.crypto_box_keypair(pk, sk)
    lib.crypto_box_beforenm(k, pk, sk)
    nonce = ctypes.create_string_buffer(24)
    m, c = ctypes.create_string_buffer(nbytes), ctypes.create_string_buffer(nbytes + 16)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        lib.crypto_box_easy_afternm(c, m, ctypes.c_ulonglong(nbytes), nonce, k)
        times.append(time.perf_counter() - t0)
    return nbytes / 1e6 / statistics.median(times)


def test_upload_throughput(benchmark, ratios, servers) -> None:
    benchmark.group = f"upload of {UPLOAD_MIB} MiB"
    n = UPLOAD_MIB << 20
    x = torch.randn(n // 4)
    ref = x.sum().item()
    up: dict[str, list[float]] = {"raw socket": [], "zmq plain": [], "zmq CURVE": [],
                                  "zmq CURVE 4 MiB frames": [], "genie insecure": [],
                                  "genie CURVE": []}
    down: dict[str, list[float]] = {"genie insecure": [], "genie CURVE": []}

    def once() -> None:
        up["raw socket"].append(_raw_socket_seconds(n))
        up["zmq plain"].append(_zmq_seconds(n, curve=False))
        up["zmq CURVE"].append(_zmq_seconds(n, curve=True))
        up["zmq CURVE 4 MiB frames"].append(_zmq_seconds(n, curve=True, frame=4 << 20))
        for name, key in (("genie insecure", "insecure"), ("genie CURVE", "curve")):
            servers[key].connect(insecure=key == "insecure")
            warm = x.to(DEV)
            warm.sum().item()
            del warm
            t0 = time.perf_counter()
            xd = x.to(DEV)
            v = xd.sum().item()
            up[name].append(time.perf_counter() - t0)
            assert abs(v - ref) <= 1e-3 * abs(ref) + 1e-2
            t0 = time.perf_counter()
            back = xd.cpu()
            down[name].append(time.perf_counter() - t0)
            assert torch.equal(back, x)
            del xd, back
            genie.disconnect()

    benchmark.pedantic(once, rounds=3, iterations=1)
    row = ratios.row(SUITE, f"upload {UPLOAD_MIB} MiB", unit="MB/s", scale=1,
                     ratios=[("genie insecure", "raw socket"), ("genie CURVE", "raw socket"),
                             ("genie insecure", "zmq plain"), ("zmq CURVE", "raw socket"),
                             ("genie CURVE", "zmq CURVE")])
    for k, v in up.items():
        row.values[k] = n / 1e6 / statistics.median(v)
    cipher = _cipher_mb_s()
    if cipher is not None:  # the cipher is not what bounds CURVE: ZeroMQ's per-message work is
        row.values["CURVE cipher alone (1 core, encrypt)"] = cipher
    row = ratios.row(SUITE, f"download {UPLOAD_MIB} MiB (.cpu() of a resident value)",
                     unit="MB/s", scale=1)
    for k, v in down.items():
        row.values[k] = n / 1e6 / statistics.median(v)


# --- serving: concurrency, recovery, pool start-up (issue 14) -------------------------------------

_LONG = """
import sys, time, torch, genie
genie.connect(sys.argv[1], insecure=True, timeout=120)
z = torch.randn(1024, 1024, device="remote_accelerator") / 32
for _ in range(int(sys.argv[2])):
    z = torch.tanh(z @ z)
print("start", flush=True)
z.sum().item()
print("done", flush=True)
"""


def _insecure_server(*args: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GENIE_LOG_LEVEL": "WARNING"}
    env.pop("GENIE_SERVER", None)
    p = subprocess.Popen([sys.executable, "-m", "genie.remote.server", "--device", "cpu",
                          "--listen", "127.0.0.1:0", "--insecure", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    m = re.search(r"tcp://[\d.]+:\d+", p.stdout.readline())
    if m is None:
        p.kill()
        raise RuntimeError("genie-server did not start")
    return p, m.group(0)


def _kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def test_short_request_latency_during_a_long_tape(benchmark, ratios) -> None:
    """Latency of a short request sent 1 s after another client's long tape (idle: median of
    10)."""
    lat: dict[str, float] = {}

    def short_latencies(n: int = 10) -> list[float]:
        x = torch.arange(6.0)
        out: list[float] = []
        for k in range(1, n + 1):
            t0 = time.perf_counter()
            assert (x.to(DEV) * k).sum().item() == 15.0 * k
            out.append(time.perf_counter() - t0)
            time.sleep(0.05)
        return out

    def once() -> None:
        for workers in (1, 4):
            srv, addr = _insecure_server("--workers", str(workers))
            long = None
            try:
                genie.connect(addr, insecure=True, timeout=120)
                short_latencies(3)  # warm
                lat[f"idle, {workers} worker(s)"] = statistics.median(short_latencies())
                long = subprocess.Popen([sys.executable, "-c", _LONG, addr, "300"],
                                        stdout=subprocess.PIPE, text=True, cwd=ROOT)
                assert long.stdout.readline().startswith("start")
                time.sleep(1.0)  # the tape is on the server and runs
                assert long.poll() is None, "the long tape was too short"
                first = short_latencies(1)[0]
                assert long.poll() is None or workers == 1, "the long tape was too short"
                lat[f"during a long tape, {workers} worker(s)"] = first
                long.communicate(timeout=300)
            finally:
                genie.disconnect()
                _kill(*(p for p in (long, srv) if p is not None))

    benchmark.pedantic(once, rounds=1, iterations=1)
    row = ratios.row(SUITE, "short request (.item() of a 6-element tape) latency", unit="ms",
                     scale=1e3, ratios=[("during a long tape, 1 worker(s)",
                                         "during a long tape, 4 worker(s)"),
                                        ("during a long tape, 4 worker(s)", "idle, 4 worker(s)")])
    row.values.update(lat)
    row.notes.append("the long tape: another client process, 300 chained 1024x1024 matmuls")


def _adamw_loop(dev: str, data: list, stop_at: int | None = None, on_step=None) -> list[float]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 10)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i, (x, y) in enumerate(data[:stop_at]):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(i)
    return losses


def test_recovery_after_kill_9(benchmark, ratios) -> None:
    """20-step AdamW loop, its server killed after step 10: the replay's time against re-running
    the 10 lost steps on a fresh session (what a restart without lineage costs in device work;
    a restart also pays the program's own start-up, not counted here)."""
    torch.manual_seed(0)
    data = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(20)]
    ref = _adamw_loop("cpu", data)
    res: dict[str, float] = {}

    def once() -> None:
        (pa, a), (pb, b) = _insecure_server(), _insecure_server()
        try:
            genie.connect(b, insecure=True, timeout=30)
            _adamw_loop(DEV, data, stop_at=2)  # b warm, as a pool member serving others is
            genie.disconnect()
            genie.connect([a, b], insecure=True, timeout=30)
            genie.reset_stats()

            def kill(i: int) -> None:
                if i == 9:
                    pa.kill()
                    pa.wait(timeout=30)
            t0 = time.perf_counter()
            got = _adamw_loop(DEV, data, on_step=kill)
            res["20 steps with a kill -9 and a replay"] = time.perf_counter() - t0
            assert got == pytest.approx(ref, rel=1e-4)
            st = genie.stats()
            assert st["replays"] == 1
            res["replay (recovery)"] = st["last_recovery_ms"] / 1e3
            genie.disconnect()
            genie.connect(b, insecure=True, timeout=30)
            t0 = time.perf_counter()
            _adamw_loop(DEV, data, stop_at=10)
            res["rerun of the 10 lost steps from scratch"] = time.perf_counter() - t0
        finally:
            genie.disconnect()
            _kill(pa, pb)

    benchmark.pedantic(once, rounds=1, iterations=1)
    row = ratios.row(SUITE, "recovery of a 20-step AdamW loop (MLP 64-256-10) after kill -9",
                     unit="ms", scale=1e3,
                     ratios=[("rerun of the 10 lost steps from scratch", "replay (recovery)")])
    row.values.update(res)


def test_genie_pool_startup(benchmark, ratios) -> None:
    """Seconds from starting genie-pool to its GENIE_* lines, for 2 CPU servers."""
    res: dict[str, float] = {}
    launchers = ["process"]
    try:
        import ray  # noqa: F401

        launchers.append("ray")
    except ImportError:
        pass

    def once() -> None:
        for launcher in launchers:
            env = {**os.environ, "PYTHONPATH": str(ROOT), "GENIE_LOG_LEVEL": "WARNING",
                   "RAY_USAGE_STATS_ENABLED": "0"}
            env.pop("GENIE_POOL", None)
            t0 = time.perf_counter()
            p = subprocess.Popen([sys.executable, "-m", "genie.remote.pool", "--servers", "2",
                                  "--device", "cpu", "--insecure", "--launcher", launcher],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 env=env)
            try:
                for line in p.stdout:
                    if line.startswith("GENIE_INSECURE"):
                        break
                res[f"genie-pool --launcher {launcher}"] = time.perf_counter() - t0
            finally:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)

    benchmark.pedantic(once, rounds=1, iterations=1)
    row = ratios.row(SUITE, "genie-pool start-up, 2 CPU servers (until the GENIE_* lines)",
                     unit="s", scale=1)
    row.values.update(res)
    if "ray" not in launchers:
        row.notes.append("Ray not installed: the ray launcher was not measured")


# --- placement over a pool of two servers (issue 15) --------------------------------------------

PROMPT_LONG = 1000
#: interleaved rounds of the two-client scenarios (ratios: medians of per-round ratios)
ROUNDS_2CLIENTS = 5

_PREFILLS = """
import sys, time, torch, genie, transformers
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
genie.connect(sys.argv[1].split(","), key_file=sys.argv[2], placement=sys.argv[3], timeout=120)
cfg = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=1000, n_positions=1024,
                              bos_token_id=0, eos_token_id=999)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(cfg).eval().to("remote_accelerator")
ids = torch.randint(1, 999, (1, int(sys.argv[4])), generator=torch.Generator().manual_seed(2))
with torch.no_grad():
    model(ids.to("remote_accelerator")).logits[:, -1].argmax(-1).item()   # weights, skeleton
    print("start", flush=True)
    while True:
        t0 = time.perf_counter()
        model(ids.to("remote_accelerator")).logits[:, -1].argmax(-1).item()
        print("prefill", time.perf_counter() - t0, flush=True)
"""


def _kv_bytes(model: torch.nn.Module, prompt: int) -> int:
    c = model.config
    return c.n_layer * 2 * prompt * c.n_embd * 4  # keys and values, float32, batch 1


def _pool_generate(model: torch.nn.Module, ids: torch.Tensor, ref: torch.Tensor) -> dict:
    """Two requests on the connected pool; the figures of the second (steady state)."""
    m = model.to(DEV)
    try:
        for _ in range(2):
            out, d = _generate(m, ids, DEV)
            assert torch.equal(out, ref), f"{genie.backends.remote.placement()}: tokens differ"
    finally:
        model.to("cpu")
    return d


def test_placement_policies(benchmark, ratios) -> None:
    """GPT-2 4 x 128, 32 greedy tokens on a pool of two CURVE servers, under each policy."""
    benchmark.group = "placement over a pool of two servers"
    model, ids = _gpt2()
    ref = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        peers = ("--peers", str(Path(d) / "peers.json"))
        pool = _Server.pool(Path(d), _Server(Path(d), *peers), _Server(Path(d), *peers))
        try:
            def once() -> None:
                for policy in ("fixed", "phase-split", "semantic"):
                    genie.connect([p.address for p in pool], key_file=pool[0].key_file,
                                  placement=policy, timeout=60)
                    try:
                        res[policy] = _pool_generate(model, ids, ref)
                    finally:
                        genie.disconnect()

            benchmark.pedantic(once, rounds=1, iterations=1)
        finally:
            for p in pool:
                p.stop()
    kv = _kv_bytes(model, ids.shape[1])
    for key, unit in [("client B/token", "B/token"), ("client B/token max", "B/token"),
                      ("round_trips", "round trips/token"), ("s/token", "ms/token")]:
        row = ratios.row(SUITE, f"pool of 2, GPT-2 greedy {TOKENS} tokens, per decode token of "
                         f"request 2: {key}", unit=unit, scale=1e3 if key == "s/token" else 1)
        for k, v in res.items():
            row.values[k] = v[key]
    row = ratios.row(SUITE, "pool of 2: peer_bytes per request (request 2)", unit="B", scale=1)
    for k, v in res.items():
        row.values[k] = v["peer_bytes"]
    row.notes.append(f"prompt KV cache {kv:,} B ({ids.shape[1]} tokens); tokens equal eager's "
                     "under every policy")
    row = ratios.row(SUITE, "pool of 2: tapes run off their device's server (request 2)",
                     unit="tapes", scale=1)
    for k, v in res.items():
        row.values[k] = v["placement.moved"]
    for k, v in res.items():
        benchmark.extra_info[k] = v


def _prefill_client(addresses: list[str], key_file: str, policy: str, cpu: int | None
                    ) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GENIE_SERVER", None)
    p = subprocess.Popen([sys.executable, "-c", _PREFILLS, ",".join(addresses), key_file, policy,
                          str(PROMPT_LONG)], stdout=subprocess.PIPE, text=True, env=env,
                         cwd=ROOT, preexec_fn=None if cpu is None else
                         (lambda: os.sched_setaffinity(0, {cpu})))
    line = p.stdout.readline()
    if not line.startswith("start"):
        p.kill()
        raise RuntimeError(f"the prefill client did not start: {line!r}")
    return p


def _stop_prefills(p: subprocess.Popen) -> list[float]:
    p.kill()
    out, _ = p.communicate(timeout=30)
    return [float(x.split()[1]) for x in out.splitlines() if x.startswith("prefill ")]


@pytest.mark.parametrize("pinned", [False, True], ids=["shared-cores", "a-core-per-server"])
def test_placement_decode_beside_a_long_prefill(benchmark, ratios, pinned) -> None:
    """The decode stream's time per token: alone; with another client's prefills on the same
    server (fixed, one server); with both clients on the pool under semantic.

    ``shared-cores``: every process on every core (this machine as it is: the two servers
    compete for the same cores). ``a-core-per-server``: server 0 and the prefill client on core
    0, server 1 and this (decode) client on core 1: each server owns its compute, as each owns a
    device in a real pool."""
    if pinned and (not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2):
        pytest.skip("needs two cores and sched_setaffinity")
    benchmark.group = f"decode stream beside a long prefill ({'pinned' if pinned else 'shared'})"
    model, ids = _gpt2()
    ref = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    samples: dict[str, list[float]] = {"alone": [], "fixed, one server, with prefills": [],
                                       "semantic, pool of 2, with prefills": []}
    if pinned:  # where semantic puts it beside the prefills: its server shares its core
        samples["alone, on server 1"] = []
    prefill_s: dict[str, list[float]] = {k: [] for k in samples}
    moved: list[int] = []
    mine = os.sched_getaffinity(0) if pinned else None
    with tempfile.TemporaryDirectory() as d:
        peers = ("--peers", str(Path(d) / "peers.json"))
        pool = _Server.pool(Path(d), _Server(Path(d), *peers, cpu=0 if pinned else None),
                            _Server(Path(d), *peers, cpu=1 if pinned else None))
        addrs = [p.address for p in pool]
        key_file = pool[0].key_file
        cpu0 = 0 if pinned else None

        def scenario(name: str) -> None:
            other = None
            if name.startswith("fixed"):
                other = _prefill_client(addrs[:1], key_file, "fixed", cpu0)
                genie.connect(addrs[:1], key_file=key_file, timeout=60)
            elif name.startswith("semantic"):
                other = _prefill_client(addrs, key_file, "semantic", cpu0)
                genie.connect(addrs, key_file=key_file, placement="semantic", timeout=60)
            elif name == "alone, on server 1":
                genie.connect(addrs[::-1], key_file=key_file, placement="semantic", timeout=60)
            else:
                genie.connect(addrs, key_file=key_file, placement="semantic", timeout=60)
            try:
                time.sleep(1.0)  # the heartbeat has read the servers' load
                r = _pool_generate(model, ids, ref)
                samples[name].append(r["s/token"])
                if name.startswith("semantic"):
                    moved.append(r["placement.moved"])
            finally:
                genie.disconnect()
                if other is not None:
                    prefill_s[name] += _stop_prefills(other)

        def once() -> None:
            names = list(samples)
            k = len(samples["alone"]) % len(names)
            for name in names[k:] + names[:k]:
                scenario(name)

        try:
            if pinned:
                os.sched_setaffinity(0, {1})
            benchmark.pedantic(once, rounds=ROUNDS_2CLIENTS, iterations=1)
        finally:
            if mine is not None:
                os.sched_setaffinity(0, mine)
            for p in pool:
                p.stop()
    how = "a core per server" if pinned else "servers sharing the cores"
    row = ratios.row(SUITE, f"decode stream (GPT-2 4 x 128, {TOKENS} tokens) beside another "
                     f"client's {PROMPT_LONG}-token prefills, {how}: time per token",
                     unit="ms/token",
                     scale=1e3, ratios=[("semantic, pool of 2, with prefills", "alone"),
                                        ("fixed, one server, with prefills", "alone"),
                                        ("semantic, pool of 2, with prefills",
                                         "alone, on server 1")])
    for k, v in samples.items():
        row.values[k] = statistics.median(v)
        row.samples[k] = v
    pf = [x for v in prefill_s.values() for x in v]
    if pf:
        row.notes.append(f"one prefill {statistics.median(pf) * 1e3:.0f} ms (median of {len(pf)})")
    row.notes.append(f"semantic: {moved} of the decode client's tapes ran on server 1 "
                     "(request 2 of each round)")
    row.notes.append("per round (ms/token): " + "; ".join(
        f"{k} {', '.join(f'{x * 1e3:.0f}' for x in v)}" for k, v in samples.items()))


# --- residency under memory pressure (issue 15) ------------------------------------------------

class _Decoder(torch.nn.Module):
    """One attention layer with a KV cache (``torch.cat``), vocabulary 2048, width 32."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(2048, 32)
        self.q, self.k, self.v = (torch.nn.Linear(32, 32) for _ in range(3))
        self.out = torch.nn.Linear(32, 2048)

    def forward(self, ids: torch.Tensor, cache: tuple | None = None) -> tuple:
        x = self.emb(ids)
        q, k, v = self.q(x), self.k(x), self.v(x)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
        return self.out(x + torch.softmax(q @ k.transpose(1, 2) / 8.0, -1) @ v), (k, v)


def _decode_keeping_scores(m: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple:
    """Greedy decode that keeps every step's log-probabilities (as ``output_scores=True``)
    and checks for an end of sequence each step (one materialization per token)."""
    with torch.no_grad():
        logits, cache = m(ids)
        scores = [torch.log_softmax(logits[:, -1], -1)]
        tok = logits[:, -1].argmax(-1, keepdim=True)
        toks = [tok]
        for _ in range(steps):
            logits, cache = m(tok, cache)
            scores.append(torch.log_softmax(logits[:, -1], -1))
            tok = logits[:, -1].argmax(-1, keepdim=True)
            toks.append(tok)
            if bool((tok < 0).all()):
                break
        return torch.cat(toks, 1).cpu(), [s.cpu() for s in scores]


def test_decode_under_memory_pressure(benchmark, ratios) -> None:
    """A decode loop (batch 64, 48 tokens, every step's scores kept: ~25 MiB held) on a server
    whose quota is 60% of its working set, against the same loop with room to spare."""
    steps = 48
    torch.manual_seed(0)
    model = _Decoder().eval()
    ids = torch.randint(0, 2048, (64, 4))
    ref_toks, ref_scores = _decode_keeping_scores(model, ids, steps)
    res: dict[str, dict] = {}

    def run(name: str, quota: str, rounds: int = 3) -> int:
        srv, addr = _insecure_server("--quota", quota, "--threads",
                                     str(torch.get_num_threads()))
        try:
            genie.connect(addr, insecure=True, timeout=120)
            ra = torch.remote_accelerator
            times = []
            for _ in range(rounds):
                genie.reset_stats()
                ra.reset_peak_memory_stats()
                m = _Decoder()
                m.load_state_dict(model.state_dict())
                m = m.eval().to(DEV)
                t0 = time.perf_counter()
                toks, scores = _decode_keeping_scores(m, ids.to(DEV), steps)
                times.append(time.perf_counter() - t0)
                assert torch.equal(toks, ref_toks), f"{name}: tokens differ from eager"
                for a, b in zip(scores, ref_scores, strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
                del m
            s = genie.stats()
            res[name] = {"s/token": statistics.median(times) / steps,
                         "peak": ra.max_memory_allocated(), "stats": s}
            return ra.max_memory_allocated()
        finally:
            genie.disconnect()
            _kill(srv)

    def once() -> None:
        peak = run("no pressure", "1GiB")
        run("quota 60%", str(int(peak * 0.6)))

    benchmark.pedantic(once, rounds=1, iterations=1)
    row = ratios.row(SUITE, f"decode loop, {steps} tokens, scores kept, quota 60% of its "
                     "working set: time per token", unit="ms/token", scale=1e3,
                     ratios=[("quota 60%", "no pressure")])
    for k, d in res.items():
        row.values[k] = d["s/token"]
        benchmark.extra_info[k] = {**d, "stats": dict(d["stats"])}
    s = res["quota 60%"]["stats"]
    roles = {k.split(".", 1)[1]: v for k, v in s.items() if k.startswith("evictions.") and
             k.split(".", 1)[1] not in ("spilled", "dropped")}
    row.notes.append(
        f"tokens equal eager; working set {res['no pressure']['peak']:,} B, peak under the quota "
        f"{res['quota 60%']['peak']:,} B; evictions by role (last round) {roles}, "
        f"{s.get('evict_bytes', 0):,} B evicted ({s.get('evictions.spilled', 0)} spilled, "
        f"{s.get('evictions.dropped', 0)} dropped), restores by re-upload "
        f"{s.get('restores.upload', 0)}, by recompute {s.get('restores.recompute', 0)}, "
        f"{s.get('pressure_events', 0)} pressure rounds, round trips {s.get('round_trips', 0)} "
        f"(no pressure: {res['no pressure']['stats'].get('round_trips', 0)})")
