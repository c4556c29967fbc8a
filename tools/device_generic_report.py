"""Runs PyTorch's device-generic test files on cpu and on remote_accelerator and compares them.

For each file: the tests that pass on cpu, the share of those that pass on the device (the
conformance figure of issue 29), and every test that passes on cpu but fails on the device with
the first line of its error. The device run ignores the exclusion table (it measures), then the
report says which excluded tests pass now (their entry can go) and which failures the table lacks.

    python tools/device_generic_report.py                     # the five files, every test
    python tools/device_generic_report.py --fast view_ops     # the CI subset of one file
    python tools/device_generic_report.py --json out.json     # also every outcome, as JSON

Each (file, device) is one pytest process (``GENIE_DEVICE_GENERIC_DEVICE``); results come from
its junit XML. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "tests" / "device_generic"
sys.path.insert(0, str(HERE))

DEFAULT = ["view_ops", "indexing", "binary_ufuncs", "reductions", "tensor_creation_ops"]


def run(file: str, device: str, fast: bool, workdir: Path) -> tuple[dict, float]:
    from device_generic_harness import generic_name

    xml = workdir / f"{file}-{device}.xml"
    env = dict(os.environ, GENIE_DEVICE_GENERIC_DEVICE=device,
               GENIE_DEVICE_GENERIC_NO_EXCLUSIONS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("GENIE_FULL_TESTS", None)
    env["GENIE_DEVICE_GENERIC_ALL"] = "0" if fast else "1"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", f"tests/device_generic/test_upstream_{file}.py",
                    "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                    "-o", "junit_logging=no"], cwd=ROOT, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    outcomes: dict[str, tuple[str, str]] = {}
    if not xml.exists():
        return outcomes, seconds
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        key = generic_name(f"test_{file}.py", cls, case.get("name", ""))
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "failed", "skipped": "skipped"}[tag]
                text = (el.get("message") or el.text or "").strip()
                message = text.splitlines()[0][:200] if text else ""
                break
        outcomes[key] = (outcome, message)
    return outcomes, seconds


# A device run's skip from the upstream file's own device restrictions (onlyCPU,
# onlyNativeDeviceTypes, skipPRIVATEUSE1...): the test is not for this device, not counted.
NOT_FOR_DEVICE = re.compile(r"Only runs on|doesn't run on|onlyNativeDeviceTypes|onlyCPU|"
                            r"PRIVATEUSE1|privateuse1|not supported on remote_accelerator|"
                            r"Skip as torch has no module")


def not_for_device(outcome: tuple[str, str]) -> bool:
    """Skipped by the file's own device restrictions, or never instantiated for the device (a
    class the file instantiates for cpu only)."""
    return outcome[0] == "missing" or (outcome[0] == "skipped"
                                       and bool(NOT_FOR_DEVICE.search(outcome[1])))


def report(file: str, cpu: dict, dev: dict, t_cpu: float, t_dev: float) -> tuple[int, int]:
    from device_generic_harness import exclusion_reason

    passed_cpu = [k for k, (o, _) in cpu.items() if o == "passed"]
    other_device = [k for k in passed_cpu if not_for_device(dev.get(k, ("missing", "")))]
    counted = [k for k in passed_cpu if k not in set(other_device)]
    both = [k for k in counted if dev.get(k, ("missing", ""))[0] == "passed"]
    lost = [k for k in counted if dev.get(k, ("missing", ""))[0] != "passed"]
    rate = 100.0 * len(both) / max(1, len(counted))
    print(flush=True)
    print(f"== {file}: {len(both)}/{len(counted)} of the tests that pass on cpu pass on the "
          f"device ({rate:.1f}%); cpu run {t_cpu:.0f} s, device run {t_dev:.0f} s; "
          f"{len(other_device)} more are for cpu only (the file's own device restrictions); "
          f"{sum(o == 'failed' for o, _ in cpu.values())} fail on cpu (torch has changed since "
          "the file's version)")
    for k in lost:
        outcome, message = dev.get(k, ("missing", ""))
        mark = "  [excluded]" if exclusion_reason(k) else "  [NOT IN TABLE]"
        print(f"  {outcome:7} {k}{mark}\n          {message}")
    for k in both:
        if exclusion_reason(k):
            print(f"  passes now, its exclusion can go: {k}")
    return len(both), len(counted)


def main() -> int:
    from device_generic_exclusions import EXCLUSIONS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", default=DEFAULT,
                    help="short names (view_ops, indexing, ..., unary_ufuncs)")
    ap.add_argument("--fast", action="store_true", help="the CI subset, not every test")
    ap.add_argument("--json", help="write every outcome to this file")
    ap.add_argument("--from-json", nargs="+", help="report from files that --json wrote")
    ap.add_argument("--cpu-from", nargs="+", default=[],
                    help="take the cpu outcomes from files that --json wrote (cpu results do "
                    "not depend on Genie): only the device runs")
    args = ap.parse_args()

    if args.from_json:
        total_both = total_cpu = 0
        for path in args.from_json:
            for file, v in json.loads(Path(path).read_text()).items():
                cpu = {k: tuple(o) for k, o in v["cpu"].items()}
                dev = {k: tuple(o) for k, o in v["device"].items()}
                b, c = report(f"test_{file}.py", cpu, dev, v["cpu_s"], v["device_s"])
                total_both += b
                total_cpu += c
        print(f"\nall files: {total_both}/{total_cpu} "
              f"({100.0 * total_both / max(1, total_cpu):.2f}%)")
        return 0

    cpu_before: dict = {}
    for path in args.cpu_from:
        for file, v in json.loads(Path(path).read_text()).items():
            cpu_before[file] = ({k: tuple(o) for k, o in v["cpu"].items()}, v["cpu_s"])
    everything: dict = {}
    total_cpu = total_both = 0
    with tempfile.TemporaryDirectory() as tmp:
        for file in args.files:
            if file in cpu_before:
                cpu, t_cpu = cpu_before[file]
            else:
                cpu, t_cpu = run(file, "cpu", args.fast, Path(tmp))
            dev, t_dev = run(file, "privateuse1", args.fast, Path(tmp))
            b, c = report(f"test_{file}.py", cpu, dev, t_cpu, t_dev)
            total_both += b
            total_cpu += c
            everything[file] = {"cpu": cpu, "device": dev, "cpu_s": t_cpu, "device_s": t_dev}
            if args.json:  # after each file, so a stopped run keeps what it measured
                Path(args.json).write_text(json.dumps(everything, indent=1))
            sys.stdout.flush()
    # an exact entry that names no test of a file that ran in full: its test was renamed
    stale = [] if args.fast else [
        k for k in EXCLUSIONS if "*" not in k and k.split("::")[0][len("test_"):-3] in everything
        and k not in everything[k.split("::")[0][len("test_"):-3]]["cpu"]]
    for k in stale:
        print(f"  exclusion names no test that ran on cpu: {k}")
    print(f"\nall files: {total_both}/{total_cpu} "
          f"({100.0 * total_both / max(1, total_cpu):.2f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
