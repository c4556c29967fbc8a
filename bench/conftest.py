"""Genie's benchmark suites (pytest-benchmark): collection, shared settings and the ratio tables.

Run ``pytest bench/ --benchmark-only`` (or one file: ``pytest bench/bench_record.py
--benchmark-only``). Files are named ``bench_*.py``; the hook below collects them, so no pytest
option is needed. Every suite reports, at the end of the run, a table of *ratios* measured in that
same run (genie against eager PyTorch and ``torch._lazy``): absolute times move with the machine,
ratios much less. Nothing is asserted: these are reports, not tests.

Settings (environment variables):

| variable | meaning | default |
|---|---|---|
| ``GENIE_BENCH_THREADS`` | intra-op threads for every variant (``0``: torch's default) | ``1`` |
| ``GENIE_BENCH_LARGE`` | ``1`` adds the 100k-node planning case (about 30 s more) | ``0`` |
| ``GENIE_BENCH_STEPS`` | training steps of each memory-loop subprocess | ``200`` |

One intra-op thread by default: on a small shared machine, OpenMP threads that spin-wait on busy
cores turn a 1 ms step into a 100 ms one at random, which buries every ratio in noise. All
variants run under the same setting, so the ratios stay like for like.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Collect ``bench_*.py`` (pytest's default pattern, ``test_*.py``, would skip them).

    Files named on the command line are collected by pytest itself; not twice.
    """
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


_load_at_start: tuple[float, float, float] | None = None


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def pytest_configure(config: pytest.Config) -> None:
    global _load_at_start
    _load_at_start = _loadavg()
    threads = int(os.environ.get("GENIE_BENCH_THREADS", "1") or 0)
    if threads > 0:
        torch.set_num_threads(threads)


@dataclass
class Row:
    """One line of a ratio table: a figure per variant in one unit, and ratios between variants.

    ``values`` are seconds (or already in ``unit`` with ``scale`` 1); ``samples`` are the
    per-round seconds of an interleaved comparison, which make each ratio the median of the
    per-round ratios (paired: both variants ran back to back, under the same machine load).
    """

    title: str
    unit: str
    scale: float
    ratios: list[tuple[str, str]]
    values: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def ratio(self, a: str, b: str) -> float | None:
        sa, sb = self.samples.get(a), self.samples.get(b)
        if sa and sb and len(sa) == len(sb):
            return statistics.median(x / y for x, y in zip(sa, sb, strict=True) if y > 0)
        if a in self.values and b in self.values and self.values[b] > 0:
            return self.values[a] / self.values[b]
        return None

    def format(self) -> str:
        parts = [f"{k} {_fmt(v * self.scale)} {self.unit}" for k, v in self.values.items()]
        for a, b in self.ratios:
            r = self.ratio(a, b)
            if r is not None:
                parts.append(f"{a}/{b} {r:.2f}x")
        parts += self.notes
        return f"{self.title}: " + " | ".join(parts)


def _fmt(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


class Ratios:
    """Registry of the rows each suite fills; printed by :func:`pytest_terminal_summary`."""

    def __init__(self) -> None:
        self.suites: dict[str, dict[str, Row]] = {}

    def row(self, suite: str, title: str, unit: str = "µs/op", scale: float = 1e6,
            ratios: Iterable[tuple[str, str]] = ()) -> Row:
        rows = self.suites.setdefault(suite, {})
        r = rows.get(title)
        if r is None:
            r = rows[title] = Row(title, unit, scale, list(ratios))
        return r

    def add(self, row: Row, variant: str, benchmark: Any, per: float = 1.0) -> None:
        """Store ``benchmark``'s median divided by ``per`` (e.g. nodes per call) as ``variant``."""
        stats = getattr(getattr(benchmark, "stats", None), "stats", None)
        if stats is not None and getattr(stats, "data", None):  # None under --benchmark-disable
            row.values[variant] = float(stats.median) / per


RATIOS = Ratios()


@pytest.fixture(scope="session")
def ratios() -> Ratios:
    return RATIOS


def interleave(benchmark: Any, row: Row, variants: dict[str, Callable[[], object]], rounds: int,
               inner: int = 1, per: float | dict[str, float] = 1.0,
               before: dict[str, Callable[[], object]] | None = None, warm: int = 1) -> None:
    """Time every variant once per round, back to back in an order drawn for each round (seeded:
    every run draws the same orders), and fill ``row``.

    On a shared machine the load drifts over seconds: timing the variants in separate tests lets
    the drift into every ratio. Here each round runs all of them under the same load, and a ratio
    is the median over rounds of the per-round ratios. pytest-benchmark times whole rounds (its
    table shows the sum of the variants); the per-variant medians go to ``extra_info`` (and the
    JSON of ``--benchmark-json``). ``inner`` calls make one sample; ``per`` divides it (ops per
    call; one number, or one per variant). ``before[name]``, where given, runs before each of
    that variant's samples, outside the timing (process state a variant needs, such as genie's
    module wrapper removed for eager: bench_models.py). ``warm`` untimed calls of each variant
    come first (caches, compilation; more where a workload's first calls differ from its steady
    ones, such as a training loop's first pass over its batches).
    """
    names = list(variants)
    divisor = per if isinstance(per, dict) else dict.fromkeys(names, per)
    setups = before or {}
    for k, fn in variants.items():  # warm: caches, allocator, torch._lazy's compiled graph
        if k in setups:
            setups[k]()
        for _ in range(warm):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in names}
    # Not a rotation: with one, each variant ran after the same other one in most rounds, and
    # what a variant leaves in the caches moved its successor's time (bench_models' MLP 4x256
    # row: its eager ran after torch._lazy's 12 ms step and read 1.08-1.12x of "eager, no
    # genie", which ran after eager; 1.01x with the orders drawn, same run otherwise)
    draw = random.Random(len(names))

    def one_round() -> None:
        for k in draw.sample(names, len(names)):
            fn = variants[k]
            if k in setups:
                setups[k]()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[k].append((time.perf_counter() - t0) / inner / divisor[k])

    benchmark.pedantic(one_round, rounds=rounds, iterations=1)
    if getattr(benchmark, "disabled", False):  # --benchmark-disable: a smoke run, no figures
        return
    for k in names:
        row.values[k] = statistics.median(samples[k])
        row.samples[k] = samples[k]
        benchmark.extra_info[f"{k} median s"] = row.values[k]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    filled = {suite: [r for r in rows.values() if r.values]
              for suite, rows in RATIOS.suites.items()}
    if not any(filled.values()):  # e.g. --benchmark-disable: nothing was timed
        return
    tr = terminalreporter
    threads = torch.get_num_threads()
    tr.write_sep("=", f"genie ratios (this run; medians; {threads} intra-op "
                 f"thread{'s' if threads > 1 else ''}, {os.cpu_count()} CPUs)")
    start, end = _load_at_start, _loadavg()
    if start and end:
        # Other processes on the machine move absolute times; the load says how busy it was.
        tr.write_line(f"load average (1 min) at start {start[0]:.1f}, at end {end[0]:.1f}")
    for suite, rows in filled.items():
        if not rows:
            continue
        tr.write_line(f"[{suite}]")
        for r in rows:
            tr.write_line("  " + r.format())


# --- workloads shared by the suites -------------------------------------------------------------

DEV = "remote_accelerator:0"


def elementwise_chain(x: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` elementwise ops on ``x``, cycling scalar mul, scalar add, relu and tensor sub."""
    y = x
    for i in range(n):
        k = i & 3
        if k == 0:
            y = y * 0.5
        elif k == 1:
            y = y + 1.0
        elif k == 2:
            y = torch.relu(y)
        else:
            y = y - x
    return y


def make_mlp(width: int = 256, depth: int = 4, seed: int = 0) -> torch.nn.Sequential:
    """``depth`` x (Linear(width, width) + ReLU), on the CPU, with seeded weights."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


_lazy_state: dict[str, Any] = {}


def lazy_device() -> torch.device | None:
    """``torch._lazy``'s device on the TorchScript backend, or None (``lazy_error()`` says why)."""
    if "device" not in _lazy_state and "error" not in _lazy_state:
        try:
            import torch._lazy
            import torch._lazy.ts_backend

            torch._lazy.ts_backend.init()
            torch.ones(1, device="lazy").cpu()  # fails here if the backend cannot run
            _lazy_state["device"] = torch.device("lazy")
        except Exception as e:  # report it in the table, never fail the suite
            _lazy_state["error"] = f"{type(e).__name__}: {e}"
    return _lazy_state.get("device")


def lazy_error() -> str | None:
    return _lazy_state.get("error")


def lazy_sync() -> None:
    """Run ``torch._lazy``'s pending graph and wait for it (its materialization)."""
    import torch._lazy

    torch._lazy.mark_step()
    torch._lazy.wait_device_ops()


def recorded_ops(fn: Callable[[], object]) -> int:
    """Ops (ATen ops and factory calls) Genie records for one call of ``fn``, checking that the
    record-only workload ran nothing."""
    import genie

    before = genie.stats()
    out = fn()
    after = genie.stats()
    del out
    ran = after.get("materializations", 0) - before.get("materializations", 0)
    assert ran == 0, f"the record-only workload materialized {ran} time(s): wrong measurement"
    return sum(after.get(k, 0) - before.get(k, 0) for k in ("ops_recorded", "factories_recorded"))


def extra_backends() -> list[str]:
    """Genie backends besides ``eager`` that are registered and available here."""
    try:
        from genie.backends import get_backend, registered_backends
    except Exception:  # no registry yet, or another API: only the default path
        return []
    out = []
    for name in registered_backends():
        try:
            if name == "eager" or not get_backend(name).is_available():
                continue
        except Exception:
            continue
        out.append(name)
    return out


def with_backend(name: str | None, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with Genie's backend order set to ``[name, "eager"]`` (None: as configured)."""
    if name is None:
        return fn
    from genie.backends import backend_order, set_backends

    def run() -> object:
        saved = backend_order()
        set_backends([name, "eager"])
        try:
            return fn()
        finally:
            set_backends(saved)

    return run


@pytest.fixture(scope="session")
def workloads() -> SimpleNamespace:
    """Shared workloads and ``torch._lazy`` helpers (pytest advises against importing conftest)."""
    return SimpleNamespace(dev=DEV, chain=elementwise_chain, mlp=make_mlp, interleave=interleave,
                           lazy_device=lazy_device, lazy_error=lazy_error,
                           lazy_sync=lazy_sync, extra_backends=extra_backends,
                           recorded_ops=recorded_ops,
                           with_backend=with_backend)
