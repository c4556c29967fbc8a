"""Per-model counters of the model tests, printed at the end of every run that has them.

A model test calls :func:`record_counts` with ``genie.stats()`` taken after its device-side run;
the terminal summary lists forced materializations and nodes executed per (model, phase).
``GENIE_MODELS_TABLE=path.md`` also writes the table as Markdown (docs/models.md quotes it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

_rows: dict[tuple[str, str], dict[str, int]] = {}

_HEADER = ("| model | phase | forced materializations | materializations | nodes executed |\n"
           "|---|---|---:|---:|---:|\n")


def record_counts(model: str, phase: str, stats: dict[str, int]) -> None:
    """Remember the counters of one (model, phase) run and print them (visible with ``-s``)."""
    row = {k: stats.get(k, 0) for k in
           ("forced_materializations", "materializations", "nodes_executed")}
    _rows[(model, phase)] = row
    print(f"\n[genie counts] {model} {phase}: " + ", ".join(f"{k}={v}" for k, v in row.items()))


@pytest.fixture
def counts() -> Callable[[str, str, dict[str, int]], None]:
    """The :func:`record_counts` function, for tests."""
    return record_counts


def markdown_table() -> str:
    lines = [_HEADER]
    for (model, phase), r in sorted(_rows.items()):
        lines.append(f"| {model} | {phase} | {r['forced_materializations']} | "
                     f"{r['materializations']} | {r['nodes_executed']} |\n")
    return "".join(lines)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _rows:
        return
    tr = terminalreporter
    tr.section("genie counters per model (forced materializations, nodes executed)")
    for line in markdown_table().splitlines():
        tr.write_line(line)
    path = os.environ.get("GENIE_MODELS_TABLE")
    if path:
        with open(path, "w") as f:
            f.write(markdown_table())
        tr.write_line(f"table written to {path}")
