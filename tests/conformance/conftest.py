"""Pass-rate report of the OpInfo conformance run (printed at the end of every pytest run).

An op is *tried* in a group when at least one of its tests in that group ran (not skipped), and
*passes* when every tried test of the group passed; an expected failure (xfail) counts as a
failure. Groups: out-of-place + in-place (variants ``out`` and ``inplace``), and gradients
(``grad``). ``GENIE_OPINFO_REPORT=path.json`` also writes every outcome with its message.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_outcomes: dict[tuple[str, str], tuple[str, str]] = {}
_meta_strides: dict[tuple[str, str], list[str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    props = dict(report.user_properties)
    key = props.get("opinfo")
    if key is None or report.when != "call":
        return
    if report.passed:
        outcome = "passed"
    elif report.skipped and hasattr(report, "wasxfail"):
        outcome = "xfailed"
    elif report.skipped:
        outcome = "skipped"
    else:
        outcome = "failed"
    msg = "" if report.passed else report.longreprtext[-3000:]
    _outcomes[tuple(key)] = (outcome, msg)
    if props.get("meta_strides"):
        _meta_strides[tuple(key)] = list(props["meta_strides"])


def pass_rates(outcomes: dict[tuple[str, str], tuple[str, str]]) -> dict[str, Any]:
    """``{"forward": (passed, tried, failing ops), "grad": (...)}`` from per-test outcomes."""
    groups = {"forward": ("out", "inplace"), "grad": ("grad",)}
    result = {}
    for group, variants in groups.items():
        per_op: dict[str, bool] = {}
        for (name, variant), (outcome, _) in outcomes.items():
            if variant not in variants or outcome == "skipped":
                continue
            per_op[name] = per_op.get(name, True) and outcome == "passed"
        failing = sorted(n for n, ok in per_op.items() if not ok)
        result[group] = (len(per_op) - len(failing), len(per_op), failing)
    return result


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _outcomes:
        return
    rates = pass_rates(_outcomes)
    tr = terminalreporter
    tr.section("OpInfo conformance pass rate (float32)")
    for group, label in (("forward", "out-of-place + in-place"), ("grad", "gradient checks")):
        ok, tried, failing = rates[group]
        pct = 100.0 * ok / tried if tried else 100.0
        tr.write_line(f"{label}: {ok}/{tried} ops pass all tried samples ({pct:.1f}%)")
        if failing:
            tr.write_line(f"  not passing: {', '.join(failing)}")
    if _meta_strides:
        noted = ", ".join(f"{n}-{v}" for n, v in sorted(_meta_strides))
        tr.write_line("strides as PyTorch's meta kernels give them, not as its CPU kernels "
                      f"(noted, not failed): {noted}")
    path = os.environ.get("GENIE_OPINFO_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"rates": {g: r[:2] for g, r in rates.items()},
                       "outcomes": {f"{n}|{v}": list(o) for (n, v), o in
                                    sorted(_outcomes.items())},
                       "meta_strides": {f"{n}|{v}": d for (n, v), d in
                                        sorted(_meta_strides.items())}}, f, indent=1)
        tr.write_line(f"outcomes written to {path}")
