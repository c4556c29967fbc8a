"""Where an MLP training step's time goes, eager against genie: phases and the cyclic GC.

Usage: ``PYTHONPATH=. .venv/bin/python tools/mlp_step_phases.py [width] [batch] [steps]``
(defaults 256 32 300: the ``mlp256`` row of bench/bench_models.py). The eager and genie steps
alternate, so both see the same machine load; medians per phase:
``zero_grad``, forward, ``backward()``, ``opt.step()``, ``loss.item()`` (genie's one
materialization: the steady read's one native call, lookup, replay and bind, ``genie._C._read``;
or, where it hands the read back, the plan lookup and the fused hit's native call (replay and
bind) or the general path's replay and bind), and then the GC's collections per generation
with their time over as many genie steps (CPython's collection counts depend on allocations,
not on load: docs/benchmarks.md, issue 11).
"""
import gc
import statistics
import sys
import time

import torch

import genie
import genie.executor as ex
from genie import plan_cache
from genie.passes import pipeline

torch.set_num_threads(1)
_ARGS = sys.argv[1:] + ["256", "32", "300"][len(sys.argv) - 1:]
WIDTH, BATCH, STEPS = (int(a) for a in _ARGS[:3])
T: dict[str, list[float]] = {}


def add(k: str, v: float) -> None:
    T.setdefault(k, []).append(v)


def timed(label: str, fn):  # noqa: ANN001, ANN201
    def w(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            add(label, time.perf_counter() - t)
    return w


# the read's pieces, wrapped where the executor looks them up (module attributes): the steady
# read's one native call (csrc/read.cpp); the lookup, and then either the fused hit (one native
# call: replay and bind) or the general path's replay and bind; a piece the steps never reach
# prints no row
ex._read = timed("g.read", ex._read)
plan_cache.plan = timed("g.plan", plan_cache.plan)
ex._hit_run = timed("g.fused", ex._hit_run)
pipeline.run = timed("g.replay", pipeline.run)
ex._bind = timed("g.bind", ex._bind)


def make(dev: torch.device):  # noqa: ANN201
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(dev)
    torch.manual_seed(1)
    x, target = torch.randn(BATCH, WIDTH).to(dev), torch.randn(BATCH, WIDTH).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(name: str | None) -> None:
        t = [time.perf_counter()]
        opt.zero_grad(set_to_none=True)
        t.append(time.perf_counter())
        loss = torch.nn.functional.mse_loss(model(x), target)
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        loss.item()
        t.append(time.perf_counter())
        if name:
            for k, a, b in zip(("zero", "fwd", "bwd", "opt", "item"), t, t[1:]):
                add(f"{name}.{k}", b - a)
            add(f"{name}.total", t[-1] - t[0])
    return step


eager, lazy = make(torch.device("cpu")), make(torch.device("remote_accelerator:0"))
for i in range(STEPS + 10):
    eager("e" if i >= 10 else None)
    lazy("g" if i >= 10 else None)
    if i == 9:
        T.clear()
for k in sorted(T):
    print(f"{k:10s} {statistics.median(T[k]) * 1e6:8.1f} us")
ratios = [b / a for a, b in zip(T["e.total"], T["g.total"], strict=True)]
print(f"genie/eager {statistics.median(ratios):.3f} (median of paired steps)")

gcs = {"t": [0.0] * 3, "n": [0] * 3, "t0": 0.0}


def cb(phase: str, info: dict) -> None:
    if phase == "start":
        gcs["t0"] = time.perf_counter()
    else:
        g = info["generation"]
        gcs["t"][g] += time.perf_counter() - gcs["t0"]
        gcs["n"][g] += 1


gc.callbacks.append(cb)
for _ in range(1000):
    lazy(None)
gc.callbacks.remove(cb)
print("genie, 1000 steps: collections by generation", gcs["n"], "ms",
      [round(t * 1e3, 1) for t in gcs["t"]], f"= {sum(gcs['t']) * 1e3:.0f} us/step")
print({k: v for k, v in genie.stats().items() if k.startswith("plan_cache")})
