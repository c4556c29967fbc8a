"""The execution engine: planning cost against graph size, training-step time, memory over a loop.

* Planning: ``genie.planner.build_tape`` on a pending elementwise chain of 1k and 10k nodes (100k
  with ``GENIE_BENCH_LARGE=1``), timed alone (each chain is recorded once, outside the timing;
  planning does not change the graph). Reported per node; a flat per-node cost means planning is
  linear in the slice. With ``genie.plan_cache`` (when present): the 10k chain planned without
  the cache, on a miss (cache cleared) and on a hit (the same structure again; a loop's next step
  records new nodes of the same structure, which costs the same comparison pass).
* Training step, steady state: an MLP (4 x Linear(256) + ReLU, batch 32, MSE loss; and 4 x
  Linear(2048), batch 64, where execution rather than per-op overhead decides) doing
  ``zero_grad``, forward, ``backward``, ``optimizer.step()`` and ``loss.item()`` (the one
  materialization per step), with SGD (momentum 0.9) and AdamW, against eager PyTorch on the CPU.
  Optimizers use their default implementation on each device (what a user would get; here the
  single-tensor loop on both). Every Genie backend registered
  besides ``eager`` that is available (``genie[name]``: that backend first, then eager); plain
  ``genie`` uses the configured order (``GENIE_BACKENDS``, default eager).
* Memory over a loop: each variant runs ``GENIE_BENCH_STEPS`` AdamW steps in a fresh subprocess,
  which reports its resident set size (``VmRSS``/``VmHWM`` from ``/proc/self/status``: all memory,
  torch's tensor buffers included; not tracemalloc, which sees only Python's heap) and, for genie,
  the number of live graph nodes and of gc-tracked Python objects. Flat = RSS, live nodes and
  tracked objects stop growing after warm-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import genie
from genie.planner import build_tape

SUITE = "bench_engine: planning, training step, memory"
LARGE = os.environ.get("GENIE_BENCH_LARGE", "0") == "1"
STEPS = int(os.environ.get("GENIE_BENCH_STEPS", "200"))
SIZES = [1_000, 10_000] + ([100_000] if LARGE else [])


# --- planning -----------------------------------------------------------------------------------

def test_plan(benchmark, ratios, workloads) -> None:
    benchmark.group = "planning: build_tape on pending elementwise chains (one round = all sizes)"
    row = ratios.row(SUITE, "planning (build_tape), per node", unit="µs/node",
                     ratios=[("10k", "1k"), ("100k", "1k")])
    x = torch.randn(4, 4, device=workloads.dev)
    genie.materialize(x)
    chains = {f"{n // 1000}k": workloads.chain(x, n) for n in SIZES}  # recorded once, kept pending
    variants = {}
    for label, y in chains.items():
        targets = [(y._node, y._out)]
        n = len(build_tape(targets).instrs)
        assert n == int(label[:-1]) * 1000, f"the {label} tape has {n} instructions"
        variants[label] = lambda targets=targets: build_tape(targets)
    per = {label: int(label[:-1]) * 1000 for label in chains}
    workloads.interleave(benchmark, row, variants, rounds=3 if LARGE else 9, per=per)


def test_plan_cache(benchmark, ratios, workloads) -> None:
    """Planning a 10k-node chain: no cache (``build_tape``), a plan-cache miss, a hit."""
    pc = pytest.importorskip("genie.plan_cache")
    if not all(hasattr(pc, f) for f in ("plan", "clear", "enable", "enabled")):
        pytest.skip("genie.plan_cache has another API than plan/clear/enable/enabled")
    benchmark.group = "planning: plan cache, 10k-node chain (one round = every variant)"
    n = 10_000
    row = ratios.row(SUITE, f"plan cache, {n // 1000}k-node chain, per node", unit="µs/node",
                     ratios=[("miss", "hit"), ("build_tape", "hit")])
    x = torch.randn(4, 4, device=workloads.dev)
    genie.materialize(x)
    y = workloads.chain(x, n)
    targets = [(y._node, y._out)]

    def miss() -> object:
        pc.clear()
        return pc.plan(targets)

    was = pc.enabled()
    pc.enable(True)
    try:
        variants = {"build_tape": lambda: build_tape(targets), "miss": miss,
                    "hit": lambda: pc.plan(targets)}  # hit: the plan of the last miss or the warm-up
        before = genie.stats().get("plan_cache_hits", 0)
        pc.plan(targets)
        pc.plan(targets)
        assert genie.stats().get("plan_cache_hits", 0) > before, "the same structure missed"
        workloads.interleave(benchmark, row, variants, rounds=9, per=n)
    finally:
        pc.enable(was)
        pc.clear()


# --- steady-state training step -----------------------------------------------------------------

def _make_step(variant: str, opt_name: str, workloads, width: int = 256, batch: int = 32):
    dev = torch.device("cpu") if variant == "eager" else torch.device(workloads.dev)
    model = workloads.mlp(width).to(dev)
    torch.manual_seed(1)
    x = torch.randn(batch, width).to(dev)
    target = torch.randn(batch, width).to(dev)
    if opt_name == "SGD":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.functional.mse_loss

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), target)
        loss.backward()
        opt.step()
        return loss.item()

    return step


# (width, batch): overhead-bound (per-op costs decide) and execution-bound (kernels and memory
# traffic decide: eager's single-tensor AdamW runs 8 ops per parameter, ~20 parameter-sized
# reads and writes; compiled, one fused kernel per parameter reads 4 and writes 3).
SIZES_STEP = [(256, 32), (2048, 64)]


@pytest.mark.parametrize("width,batch", SIZES_STEP, ids=[f"{w}x{b}" for w, b in SIZES_STEP])
@pytest.mark.parametrize("opt_name", ["SGD", "AdamW"])
def test_train_step(benchmark, ratios, workloads, opt_name: str, width: int, batch: int) -> None:
    benchmark.group = (f"train step: MLP 4 x Linear({width}) + ReLU, batch {batch}, {opt_name} "
                       "(round = all)")
    extra = workloads.extra_backends()
    names = ["eager", "genie"] + [f"genie[{b}]" for b in extra]
    row = ratios.row(SUITE, f"train step ({opt_name}, MLP 4 x {width}, batch {batch})",
                     unit="ms/step", scale=1e3,
                     ratios=[(v, "eager") for v in names if v != "eager"])
    variants = {}
    for v in names:
        backend = v[len("genie["):-1] if v.startswith("genie[") else None
        step = _make_step(v, opt_name, workloads, width, batch)
        variants[v] = workloads.with_backend(backend, step)
    for name in list(variants):  # warm: optimizer state, caches, compiled plans
        try:
            for _ in range(3):
                variants[name]()
        except Exception as e:
            if name in ("eager", "genie"):
                raise
            # An optional backend that fails is reported in the table, not fatal to the suite.
            del variants[name]
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            row.notes.append(f"{name} failed: {msg[:160]}")
    before = genie.stats()
    variants["genie"]()
    after = genie.stats()
    ops = after.get("ops_recorded", 0) - before.get("ops_recorded", 0)
    runs = after.get("materializations", 0) - before.get("materializations", 0)
    row.notes.append(f"genie: {ops} ops, {runs} materialization(s)/step")
    big = width * width * batch > 2 ** 24
    workloads.interleave(benchmark, row, variants, rounds=9 if big else 15, inner=1 if big else 5)


# --- memory over a loop of steps (one fresh process per variant) ---------------------------------

_CHILD = r"""
import gc, json, os, sys
import torch
threads = int(os.environ.get("GENIE_BENCH_THREADS", "1") or 0)
if threads > 0:
    torch.set_num_threads(threads)
variant, steps = sys.argv[1], int(sys.argv[2])
if variant == "genie":
    import genie
    from genie.graph import live_nodes as count_nodes
    dev = torch.device("remote_accelerator:0")
else:
    dev = torch.device("cpu")

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0  # kB -> MiB
    return float("nan")

def live_nodes():
    if variant != "genie":
        return 0
    gc.collect()
    return count_nodes()  # untracked nodes are not in gc.get_objects()

torch.manual_seed(0)
layers = []
for _ in range(4):
    layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers).to(dev)
x = torch.randn(32, 256).to(dev)
target = torch.randn(32, 256).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
warm = max(10, steps // 10)
marks = sorted({warm, steps // 2, steps})
points = []
for i in range(1, steps + 1):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), target)
    loss.backward()
    opt.step()
    loss.item()
    if i in marks:
        gc.collect()
        points.append({"step": i, "rss_mib": status("VmRSS"), "nodes": live_nodes(),
                       "objects": len(gc.get_objects())})
print(json.dumps({"points": points, "peak_rss_mib": status("VmHWM")}))
"""


def _run_child(variant: str, steps: int) -> dict:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run([sys.executable, "-c", _CHILD, variant, str(steps)], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory loop ({variant}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_memory_loop(benchmark, ratios) -> None:
    # --benchmark-disable (a smoke run): a short loop that only checks the children work.
    steps = 20 if getattr(benchmark, "disabled", False) else STEPS
    benchmark.group = f"memory: {steps} AdamW steps in a subprocess (wall time includes startup)"
    results: dict[str, dict] = {}

    def run() -> None:
        for variant in ("eager", "genie"):
            results[variant] = _run_child(variant, steps)

    benchmark.pedantic(run, rounds=1, iterations=1)
    if getattr(benchmark, "disabled", False):
        return
    row = ratios.row(SUITE, f"memory over {steps} AdamW steps (RSS, fresh process each)",
                     unit="MiB peak RSS", scale=1.0, ratios=[("genie", "eager")])
    for variant, r in results.items():
        row.values[variant] = r["peak_rss_mib"]
        first, last = r["points"][0], r["points"][-1]
        growth = last["rss_mib"] - first["rss_mib"]
        note = (f"{variant} RSS step {first['step']}->{last['step']}: "
                f"{first['rss_mib']:.0f}->{last['rss_mib']:.0f} MiB ({growth:+.1f})")
        if variant == "genie":
            note += ", live nodes " + "->".join(str(p["nodes"]) for p in r["points"])
        # Python objects the collector tracks: a leak of small objects shows here first.
        per_step = (last["objects"] - first["objects"]) / max(1, last["step"] - first["step"])
        note += f", gc-tracked objects {per_step:+.0f}/step"
        row.notes.append(note)
    benchmark.extra_info.update(results)
