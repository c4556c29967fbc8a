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
  value (``.cpu()``).

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
    def __init__(self, keys: Path, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GENIE_LOG_LEVEL": "WARNING"}
        env.pop("GENIE_SERVER", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "genie.remote.server", "--device", "cpu", "--listen",
             "127.0.0.1:0", "--keys", str(keys), "--threads", str(torch.get_num_threads()),
             *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
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
    d["total s"] = total
    d["first bytes_sent"] = per.marks[1][1].get("bytes_sent", 0)
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


def test_upload_throughput(benchmark, ratios, servers) -> None:
    benchmark.group = f"upload of {UPLOAD_MIB} MiB"
    n = UPLOAD_MIB << 20
    x = torch.randn(n // 4)
    ref = x.sum().item()
    up: dict[str, list[float]] = {"raw socket": [], "genie insecure": [], "genie CURVE": []}
    down: dict[str, list[float]] = {"genie insecure": [], "genie CURVE": []}

    def once() -> None:
        up["raw socket"].append(_raw_socket_seconds(n))
        for name, key in (("genie insecure", "insecure"), ("genie CURVE", "curve")):
            servers[key].connect(insecure=key == "insecure")
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
                     ratios=[("genie insecure", "raw socket"), ("genie CURVE", "raw socket")])
    for k, v in up.items():
        row.values[k] = n / 1e6 / statistics.median(v)
    row = ratios.row(SUITE, f"download {UPLOAD_MIB} MiB (.cpu() of a resident value)",
                     unit="MB/s", scale=1)
    for k, v in down.items():
        row.values[k] = n / 1e6 / statistics.median(v)
