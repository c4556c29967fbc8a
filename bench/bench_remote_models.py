"""Real models through a loopback ``genie-server`` (issue 27): what a user's step costs remotely.

The workloads of the host-cost issue, each interleaved with eager PyTorch in the same process
(``interleave``: per-round ratios, median), through one CURVE server on 127.0.0.1 (the default
security; client and server one intra-op thread each, ``GENIE_BENCH_THREADS``):

- GPT-2 12x768 (vocab 1000) decode step after a 64-token prompt, KV cache growing, logits
  materialized every step;
- the same decode step later in a long generation: through the server once its shape class
  (built in the background, see docs/deployment.md "Shape classes") serves the step; eager after
  as many steps;
- GPT-2 4x128 greedy ``generate`` of 32 tokens, a prompt length never seen before every call,
  called as most scripts call it (no ``attention_mask``): a fresh session's first calls (its
  vets and shape-class builds in them) and again after 3 warm-up calls at other lengths (its
  steady calls, as the embedded rows' come after a first call); the GPT-2 rows use transformers'
  ``eager`` attention (the host-cost issue's rows), and the generate row again with its default,
  ``sdpa`` (through a server the math path, as the client cannot know the server's kernels);
- MLP 4 x Linear(256) + ReLU, batch 32, MSE, AdamW, ``loss.item()`` every step; a call is
  four steps and then ``torch.remote_accelerator.synchronize()`` (timed): the server answers a
  step's loss before the step's backward and update have run (an early reply, see
  docs/deployment.md), so the last step's rest is waited for inside the timing; and again with
  32 steps a call, as a training loop runs them (its first steps fill the pipeline of early
  replies: a step's rest on the server beside the next step's record on the client);
- a 1-op tape's round trip (``(x + 1).cpu()`` of a resident 6-element value): the fixed cost of a
  request, isolation included (front, worker, and back);
- a 128 MiB upload (``t.to(dev)`` then ``.sum().item()``), MB/s.

Each row's note says how the timed runs were vetted by the server (``genie.stats()``'s
``server_*`` counters: concrete vets, shape-class hits, shapes vetted before), and where the
CPU went (Linux): per unit, the client's main thread (recording, planning, encoding; eager's
for the same unit beside it), the client's other threads (ZeroMQ's I/O: CURVE, the socket), the
front process and the session's worker (its kernels, its Python, its ZeroMQ thread) and the
worker's class builds (forked children). On a machine with cores to spare the client and the
worker overlap only where a reply comes early; on a loaded one a step costs about their sum.

Where the server runs (``GENIE_BENCH_PLACEMENT``): ``own-core`` (the default where the process
may use two or more CPUs) gives the server's processes every CPU but the first and keeps this
process (the client, and eager beside it) on the first, as a server on another host owns its
compute; ``shared`` leaves every process on every CPU (on a 2-CPU machine Linux's placement
then decides the MLP row: with the client and the session worker on one core its step costs
their sum, ~1.8 ms against ~1.2 ms on a core each, and the row flips between the two from one
run to the next; docs/benchmarks.md, session 58).

With ``GENIE_BENCH_BASE=PATH`` (a checkout of an earlier tree with its native module built, e.g.
a ``git worktree`` of the commit before the session-worker server), every row is measured again
against a server started from that tree, interleaved with eager in the same way, so the cost of
the redesign is read as the ratio of the two rows' ratios (each against eager in its own run).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import genie

zmq = pytest.importorskip("zmq")
transformers = pytest.importorskip("transformers")

SUITE = "bench_remote_models: real models through a loopback genie-server (CURVE)"
DEV = "remote_accelerator:0"
ROOT = Path(__file__).resolve().parents[1]
PROMPT = 64
DECODE_STEPS = 4
#: the long-generation decode row waits at most this long (seconds, and steps) for the class
CLASS_WAIT = 90.0
MAX_WARM_STEPS = 600
NEW_TOKENS = 32
MLP_STEPS = 4  # training steps per timed call (then a synchronize)
#: the same row's steps per call in a longer stretch of a training loop: a loop runs steps back to
#: back, so the server's pipeline (a step's rest beside the next step's record) is full after a
#: few steps, where a 4-step call spends most of its time filling it
MLP_LOOP_STEPS = 32
#: warm-up calls of the steady generate row: a session builds its decode step's shape class at
#: its first call and its prefill's at its third (docs/benchmarks.md, session 47)
GENERATE_WARM = 3
UPLOAD_ROUNDS = 7  # 128 MiB uploads per server (3 moved the server/base ratio 0.83-1.22x)
#: the server's device, and where eager runs beside it (``cuda`` on a GPU machine, see
#: tools/gpu_check.sh; the MLP row's eager backward cannot run on CUDA in a process with Genie)
REAL = os.environ.get("GENIE_BENCH_SERVER_DEVICE", "cpu")


def _placement() -> tuple[set[int], set[int]] | None:
    """(this process's CPUs, the server's CPUs) under ``own-core``; None under ``shared`` or
    where the process may use fewer than two CPUs (or the OS has no ``sched_setaffinity``)."""
    mode = os.environ.get("GENIE_BENCH_PLACEMENT", "own-core")
    if mode not in ("own-core", "shared"):
        raise ValueError(f"GENIE_BENCH_PLACEMENT={mode!r}: expected 'own-core' or 'shared'")
    if mode == "shared" or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return ({cpus[0]}, set(cpus[1:])) if len(cpus) >= 2 else None


PLACEMENT = _placement()
PLACEMENT_NOTE = ("placement shared (every process on every CPU)" if PLACEMENT is None else
                  f"placement own-core (client and eager on CPU {min(PLACEMENT[0])}, the server "
                  f"on CPU{'s' if len(PLACEMENT[1]) > 1 else ''} "
                  f"{','.join(map(str, sorted(PLACEMENT[1])))})")


def _trees() -> dict[str, Path]:
    trees = {"server": ROOT}
    base = os.environ.get("GENIE_BENCH_BASE")
    if base:
        trees["base server"] = Path(base).resolve()
    return trees


class _Server:
    def __init__(self, tree: Path, keys: Path) -> None:
        log = os.environ.get("GENIE_BENCH_SERVER_LOG")  # a file for the server's log (DEBUG)
        env = {**os.environ, "PYTHONPATH": str(tree),
               "GENIE_LOG_LEVEL": "DEBUG" if log else "WARNING"}
        env.pop("GENIE_SERVER", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "genie.remote.server", "--device", REAL, "--listen",
             "127.0.0.1:0", "--keys", str(keys), "--threads", str(torch.get_num_threads())],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tree,
            preexec_fn=None if PLACEMENT is None else
            (lambda cpus=PLACEMENT[1]: os.sched_setaffinity(0, cpus)))
        line = ""
        while not line.startswith("genie-server: serving"):
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"genie-server from {tree} did not start")
        self.address = re.search(r"tcp://[\d.]+:\d+", line).group(0)  # type: ignore[union-attr]
        if log:  # drained into the file (an unread pipe would block the server at 64 KiB)
            def drain(out=self.proc.stdout, path=f"{log}.{tree.name}") -> None:
                with open(path, "a") as f:
                    for text in out:
                        f.write(text)
            threading.Thread(target=drain, daemon=True).start()
        self.key_file = str(keys / "client.json")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def servers():
    mine = os.sched_getaffinity(0) if PLACEMENT is not None else None
    with tempfile.TemporaryDirectory() as d:
        out = {}
        for name, tree in _trees().items():
            keys = Path(d) / name.replace(" ", "-")
            out[name] = _Server(tree, keys)
        if PLACEMENT is not None:
            os.sched_setaffinity(0, PLACEMENT[0])
        try:
            yield out
        finally:
            if mine is not None:
                os.sched_setaffinity(0, mine)
            genie.disconnect()
            for s in out.values():
                s.stop()


def _task_ns(pid: int) -> int:
    """CPU nanoseconds of a live process's threads (``/proc/PID/task/*/schedstat``), 0 if gone."""
    total = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError), \
                    open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    return total


def _children_ns(pid: int) -> int:
    """CPU nanoseconds of a process's reaped children (``cutime + cstime``, clock ticks)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[13]) + int(fields[14])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return 0


def _descendants(pid: int) -> dict[int, int]:
    """Each live descendant of ``pid`` and its depth (1: a child)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{d}/stat") as f:
                parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
    depth = {pid: 0}
    changed = True
    while changed:
        changed = False
        for c, p in parent.items():
            if p in depth and c not in depth:
                depth[c] = depth[p] + 1
                changed = True
    del depth[pid]
    return depth


def _server_cpu(srv: _Server) -> dict[str, int] | None:
    """CPU nanoseconds so far of a server's front, its session workers (the zygote's children,
    ZeroMQ threads included) and their class builds (the workers' children, live or reaped);
    None where ``/proc`` does not tell."""
    if not os.path.exists(f"/proc/{srv.proc.pid}/task"):
        return None
    out = {"front": _task_ns(srv.proc.pid), "worker": 0, "builds": 0}
    for pid, depth in _descendants(srv.proc.pid).items():
        if depth == 2:  # front -> zygote -> worker
            out["worker"] += _task_ns(pid)
            out["builds"] += _children_ns(pid)
        elif depth > 2:
            out["builds"] += _task_ns(pid)
    return out


def _gpt2(layers: int, width: int, heads: int, attn: str = "eager"):
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=1000,
                                  n_positions=1024, bos_token_id=0, eos_token_id=0,
                                  attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.generation_config.pad_token_id = 0
    return model


def _decode(dev: str, warm: int | None = 0) -> Callable[[], object]:
    """``DECODE_STEPS`` decode steps per call after a ``PROMPT``-token prompt (and ``warm``
    steps more; None: as many as the server takes to serve a step by its shape class, see
    :func:`_decode_long`)."""
    from transformers import DynamicCache

    model = _gpt2(12, 768, 12).to(dev)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (1, PROMPT), generator=g).to(dev)
    tokens = [torch.randint(0, 1000, (1, 1), generator=g).to(dev) for _ in range(DECODE_STEPS)]
    with torch.no_grad():
        cache = DynamicCache()
        model(prompt, past_key_values=cache, use_cache=True).logits.cpu()

    def run() -> object:
        with torch.no_grad():
            for t in tokens:
                logits = model(t, past_key_values=cache, use_cache=True).logits
                logits.cpu()
        return None

    n = 0
    hits = lambda: genie.stats().get("server_shape_class_hits", 0)  # noqa: E731
    first = hits()
    deadline = time.monotonic() + CLASS_WAIT
    while (n < warm if warm is not None else
           hits() == first and time.monotonic() < deadline and n < MAX_WARM_STEPS):
        with torch.no_grad():
            model(tokens[0], past_key_values=cache, use_cache=True).logits.cpu()
        n += 1
    run.warm = n  # type: ignore[attr-defined]
    return run


def _decode_long(dev: str, warm: int | None = None) -> Callable[[], object]:
    """The decode row later in a long generation: through a server, once a step of the
    structure is served by its shape class (the worker builds it in the background while the
    first steps are vetted one by one; at most ``CLASS_WAIT`` seconds); eager after as many
    steps (the same KV length)."""
    return _decode(dev, warm)


_decode_long.remote_first = True  # type: ignore[attr-defined]


def _generate(dev: str, attn: str = "eager", warm: int = 0) -> Callable[[], object]:
    """Greedy generate of ``NEW_TOKENS`` tokens, a prompt length never seen every call (8, 9,
    ...), after ``warm`` calls at other prompt lengths (400, 401, ...): with ``warm`` the timed
    calls are a session's steady ones (its shape classes built, see docs/deployment.md), as the
    embedded rows' are after their op-counting call; without, a fresh session's first calls,
    its vets and class builds included."""
    model = _gpt2(4, 128, 4, attn).to(dev)

    def at(lengths: Iterator[int]) -> Callable[[], object]:
        def run() -> object:
            n = next(lengths)
            ids = torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n))
            with torch.no_grad():
                return model.generate(ids.to(dev), max_new_tokens=NEW_TOKENS,
                                      min_new_tokens=NEW_TOKENS, do_sample=False).cpu()
        return run

    warm_up = at(itertools.count(400))
    for _ in range(warm):
        warm_up()
    return at(itertools.count(8))


def _mlp(dev: str, steps_per_call: int = MLP_STEPS) -> Callable[[], object]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(dev)
    x, y = torch.randn(32, 256).to(dev), torch.randn(32, 256).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    def steps() -> list[float]:
        losses = [step() for _ in range(steps_per_call)]
        if dev == DEV:
            torch.remote_accelerator.synchronize()
        elif dev.startswith("cuda"):
            torch.cuda.synchronize()
        return losses

    for _ in range(3):
        step()
    return steps


def _one_op(dev: str) -> Callable[[], object]:
    x = torch.arange(6.0).to(dev)
    (x + 1).cpu()
    return lambda: (x + 1).cpu()


WORKLOADS: dict[str, tuple[Callable[[str], Callable[[], object]], float, str, int]] = {
    # name: (factory, per (units per call), unit, rounds)
    "GPT-2 12x768 decode step, KV cache growing": (_decode, DECODE_STEPS, "ms/step", 5),
    "GPT-2 12x768 decode step, later in a long generation (shape class built)":
        (_decode_long, DECODE_STEPS, "ms/step", 5),
    "GPT-2 4x128 generate 32 tokens, new prompt lengths, no attention_mask":
        (_generate, NEW_TOKENS, "ms/token", 5),
    "GPT-2 4x128 generate 32 tokens, new prompt lengths, no attention_mask, after "
    f"{GENERATE_WARM} warm-up calls": (lambda dev: _generate(dev, warm=GENERATE_WARM),
                                       NEW_TOKENS, "ms/token", 5),
    "GPT-2 4x128 generate 32 tokens, new prompt lengths, no attention_mask, sdpa":
        (lambda dev: _generate(dev, "sdpa"), NEW_TOKENS, "ms/token", 5),
    "MLP 4x256 AdamW step, loss.item()": (_mlp, MLP_STEPS, "ms/step", 15),
    f"MLP 4x256 AdamW step, loss.item(), {MLP_LOOP_STEPS} steps a call":
        (lambda dev: _mlp(dev, MLP_LOOP_STEPS), MLP_LOOP_STEPS, "ms/step", 9),
    "1-op tape round trip": (_one_op, 1, "ms/request", 30),
}


def _paired(variants: dict[str, Callable[[], object]], rounds: int, per: float,
            probe: Callable[[], dict[str, float]] | None = None
            ) -> tuple[dict[str, float], float, dict[str, float]]:
    """Each round times every variant once, back to back, in alternating order: per-variant
    median seconds per unit, the median of the per-round ratios (second / first), and with
    ``probe`` (CPU seconds so far, by part) the median per unit of each part's CPU over the
    second variant's calls (``main``: this thread's; ``eager``: this thread's over the first
    variant's calls)."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            before = probe() if probe is not None else None
            c0 = time.thread_time()
            t0 = time.perf_counter()
            variants[n]()
            times[n].append((time.perf_counter() - t0) / per)
            c1 = time.thread_time()
            if before is not None:
                after = probe()  # type: ignore[misc]
                got = {k: (after[k] - before[k]) / per for k in after}
                got["main"] = (c1 - c0) / per
                if n == names[0]:
                    got = {"eager": got["main"]}
                for k, v in got.items():
                    cpu.setdefault(k, []).append(v)
    ratio = statistics.median(b / a for a, b in zip(times[names[0]], times[names[1]]))
    return ({n: statistics.median(v) for n, v in times.items()}, ratio,
            {k: statistics.median(v) for k, v in cpu.items()})


def _cpu_probe(srv: _Server) -> Callable[[], dict[str, float]] | None:
    """CPU seconds so far of the client's threads other than this one (``io``: ZeroMQ's; eager
    uses none) and of the server's parts (:func:`_server_cpu`); None where ``/proc`` does not
    tell. (This thread's own CPU is read around each call by :func:`_paired`.)"""
    if _server_cpu(srv) is None:
        return None

    def probe() -> dict[str, float]:
        out = {"io": (_task_ns(os.getpid()) - time.thread_time_ns()) / 1e9}
        out.update({k: v / 1e9 for k, v in (_server_cpu(srv) or {}).items()})
        return out

    return probe


def _cpu_note(cpu: dict[str, float], unit: str) -> str:
    """Where a row's CPU went, in ms per ``unit`` (see the module's docstring)."""
    ms = lambda k: f"{cpu[k] * 1e3:.2f}"  # noqa: E731
    parts = [f"client {ms('main')} (eager {ms('eager')})", f"client I/O {ms('io')}"]
    # a server without session workers (a tree before them) runs every session in its process
    parts += [f"front {ms('front')}", f"worker {ms('worker')}"] if cpu.get("worker") else \
        [f"server {ms('front')}"]
    if cpu.get("builds"):
        parts.append(f"builds {ms('builds')}")
    return f"CPU ms {unit} (medians): " + ", ".join(parts)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_remote_model(benchmark, ratios, servers, name: str) -> None:
    make, per, unit, rounds = WORKLOADS[name]
    benchmark.group = f"remote: {name}"
    row = ratios.row(SUITE, name, unit=unit, scale=1e3)
    row.notes.append(PLACEMENT_NOTE)
    later = getattr(make, "remote_first", False)  # eager after as many warm-up steps
    eager = None if later else make(REAL)
    for sname, srv in servers.items():
        genie.connect(srv.address, key_file=srv.key_file, timeout=120)
        remote = make(DEV)
        if later:
            eager = make(REAL, remote.warm)
            row.notes.append(f"{sname}: after {remote.warm} steps")
        before = genie.stats()
        med, ratio, cpu = _paired({"eager": eager, sname: remote}, rounds, per, _cpu_probe(srv))
        row.values[sname] = med[sname]
        row.values.setdefault("eager", med["eager"])
        after = genie.stats()
        vetted = ", ".join(f"{k.removeprefix('server_')} {after[k] - before.get(k, 0)}"
                           for k in ("server_vets", "server_shape_class_hits", "server_vet_hits",
                                     "server_early_replies")
                           if after.get(k, 0) > before.get(k, 0))
        row.notes.append(f"{sname}: {ratio:.2f}x eager (median of per-round ratios, its own "
                         f"run){'; runs: ' + vetted if vetted else ''}")
        if cpu:
            row.notes.append(f"{sname}: " + _cpu_note(cpu, "per " + unit.split("/")[-1]))
        if sname == "server":
            benchmark.extra_info["ratio_vs_eager"] = ratio
            benchmark.pedantic(remote, rounds=1, iterations=1)
        genie.disconnect()


def test_upload_128mib(benchmark, ratios, servers) -> None:  # noqa: D103
    n = 128 << 20
    x = torch.randn(n // 4)
    ref = x.sum().item()
    row = ratios.row(SUITE, "upload 128 MiB (t.to(dev); .sum().item())", unit="MB/s", scale=1)
    row.notes.append(PLACEMENT_NOTE)
    got: dict[str, list[float]] = {s: [] for s in servers}
    names = list(servers)
    rounds = itertools.count()

    def once() -> None:  # the servers in turn first (the one after waits on the other's frees)
        r = next(rounds) % len(names)
        for sname in names[r:] + names[:r]:
            srv = servers[sname]
            genie.connect(srv.address, key_file=srv.key_file, timeout=120)
            warm = x.to(DEV)
            warm.sum().item()
            del warm
            t0 = time.perf_counter()
            v = x.to(DEV).sum().item()
            got[sname].append(time.perf_counter() - t0)
            assert abs(v - ref) <= 1e-3 * abs(ref) + 1e-2
            genie.disconnect()

    benchmark.pedantic(once, rounds=UPLOAD_ROUNDS, iterations=1)
    for k, v in got.items():
        row.values[k] = n / 1e6 / statistics.median(v)
    if "base server" in got:  # paired per round, as the other rows' ratios
        row.notes.append("server/base server throughput %.2fx (median of per-round ratios, "
                         "%d rounds)" % (statistics.median(
                             b / a for a, b in zip(got["server"], got["base server"])),
                          UPLOAD_ROUNDS))
