"""Recording cost per op: genie (record only) against eager CPU and ``torch._lazy`` (TorchScript).

Two workloads, the same ATen ops in every variant:

* a chain of 2,000 elementwise ops on a 4x4 tensor (scalar mul, scalar add, relu, tensor sub),
  where eager's compute is negligible, so eager's time is PyTorch's dispatch floor;
* an MLP forward (4 x Linear(256, 256) + ReLU, batch 32) under ``torch.no_grad()``.

And genie alone on 1,000 ops each with a shape not seen before (``x[:, :n] + 1.0``,
``flat[:4 * n].view(n, 4)`` for new n: what a decode step's attention or a new prompt length
costs), recorded natively with the entry from Python (``genie``), through the whole Python path
(``genie (miss to Python)``, ``GENIE_NATIVE_RECORD_MISS=0``), and the same ops with shapes seen
before (``genie (hits)``).

"Record only" means the graph is built and then dropped, never run: for genie no
``materialize``, for ``torch._lazy`` no ``mark_step``. ``genie (no meta cache)`` turns
``genie.config.config.meta_cache`` off, so every op pays meta inference (the cache's effect);
``genie (no context)`` removes :mod:`genie.context`'s module hooks, so ``genie`` minus it is what
meaning on the default path (module path, region, phase per node) costs.
Inputs (and the MLP's parameters) are on each device, materialized, before timing. Per-op
figures divide by the number of ATen ops genie records for one call. The variants run
interleaved (see ``interleave`` in conftest.py), so the ratios are paired.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

import genie
from genie import context
from genie.config import config

SUITE = "bench_record: recording cost per op (record only, no materialization)"
N_CHAIN = 2000
NO_CACHE = "genie (no meta cache)"
NO_CONTEXT = "genie (no context)"
RATIOS = [("genie", "eager"), ("genie", "torch._lazy"), ("torch._lazy", "eager"),
          (NO_CACHE, "genie"), ("genie", NO_CONTEXT)]


def _without_meta_cache(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        saved = config.meta_cache
        config.meta_cache = False
        try:
            return fn()
        finally:
            config.meta_cache = saved

    return run


def _without_context(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with genie.context's module hooks removed (nodes get no module path or phase):
    what meaning on the default path costs is ``genie`` - this, per op."""
    def run() -> object:
        context.deactivate()
        try:
            return fn()
        finally:
            context.activate()

    return run


def _devices(workloads, row) -> dict[str, torch.device]:
    devs = {"eager": torch.device("cpu"), "genie": torch.device(workloads.dev)}
    lazy = workloads.lazy_device()
    if lazy is not None:
        devs["torch._lazy"] = lazy
    elif f"torch._lazy: {workloads.lazy_error()}" not in row.notes:
        row.notes.append(f"torch._lazy: {workloads.lazy_error()}")
    return devs


def test_record_chain(benchmark, ratios, workloads) -> None:
    benchmark.group = "record: 2,000-op elementwise chain, 4x4 (one round = every variant once)"
    row = ratios.row(SUITE, f"chain of {N_CHAIN:,} elementwise ops (4x4)", ratios=RATIOS)
    variants: dict[str, Callable[[], object]] = {}
    for name, dev in _devices(workloads, row).items():
        x = torch.randn(4, 4).to(dev)
        if name == "genie":
            genie.materialize(x)
            n = workloads.recorded_ops(lambda x=x: workloads.chain(x, N_CHAIN))
            assert n == N_CHAIN, f"expected {N_CHAIN} recorded ops, got {n}"
        variants[name] = lambda x=x: workloads.chain(x, N_CHAIN)
    variants[NO_CACHE] = _without_meta_cache(variants["genie"])
    variants[NO_CONTEXT] = _without_context(variants["genie"])
    workloads.interleave(benchmark, row, variants, rounds=9, per=N_CHAIN)


def test_record_mlp_forward(benchmark, ratios, workloads) -> None:
    benchmark.group = "record: MLP forward 4 x Linear(256) + ReLU, batch 32 (one round = all)"
    row = ratios.row(SUITE, "MLP forward (4 x Linear(256) + ReLU, batch 32, no_grad)",
                     ratios=RATIOS)
    variants: dict[str, Callable[[], object]] = {}
    ops = 0
    for name, dev in _devices(workloads, row).items():
        model = workloads.mlp().to(dev)
        x = torch.randn(32, 256).to(dev)

        def run(model: torch.nn.Module = model, x: torch.Tensor = x) -> torch.Tensor:
            with torch.no_grad():
                return model(x)

        if name == "genie":
            genie.materialize(x, *model.parameters())
            ops = workloads.recorded_ops(run)  # the same ops in every variant: one divisor for all
        variants[name] = run
    variants[NO_CACHE] = _without_meta_cache(variants["genie"])
    variants[NO_CONTEXT] = _without_context(variants["genie"])
    row.notes.append(f"{ops} ATen ops/forward")
    workloads.interleave(benchmark, row, variants, rounds=15, inner=20, per=ops)


NEW_SHAPES = 250  # steps of 4 ops
MISS_OFF = "genie (miss to Python)"
HITS = "genie (hits)"


def test_record_new_shapes(benchmark, ratios, workloads) -> None:
    benchmark.group = "record: 1,000 ops with new shapes (slice, add, view; one round = all)"
    row = ratios.row(SUITE, "1,000 ops, each with a shape not seen before (slice + add, slice + "
                     "view)", ratios=[(MISS_OFF, "genie"), ("genie", HITS)])
    rounds = 9
    top = (rounds + 2) * 2 * NEW_SHAPES + 1  # the new shapes below it, the repeated ones above
    x = torch.randn(2, top + NEW_SHAPES).to(workloads.dev)
    flat = torch.randn(4 * (top + NEW_SHAPES)).to(workloads.dev)
    genie.materialize(x, flat)
    new = itertools.count(1)  # one counter for both variants: neither sees the other's shapes

    def steps(ns: object) -> None:
        for n in ns:
            x[:, :n] + 1.0
            flat[: 4 * n].view(n, 4)

    def miss_off() -> None:
        saved = config.native_record_miss
        config.native_record_miss = False
        try:
            steps(itertools.islice(new, NEW_SHAPES))
        finally:
            config.native_record_miss = saved

    fixed = range(top, top + NEW_SHAPES)
    variants = {"genie": lambda: steps(itertools.islice(new, NEW_SHAPES)), MISS_OFF: miss_off,
                HITS: lambda: steps(fixed)}
    workloads.interleave(benchmark, row, variants, rounds=rounds, per=4 * NEW_SHAPES)
