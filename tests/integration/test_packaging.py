"""Packaging: the wheel installs and works without the source tree; the torch.backends entry point
never breaks ``import torch``.

The wheel test builds ``genie-remote-accelerator`` with its native runtime (``pip wheel
--no-build-isolation``: compiled against the torch already installed), installs it into a fresh
venv that reuses this venv's packages for its dependencies (a ``.pth`` line, so torch is never
resolved or downloaded), and runs a smoke program from a directory outside the source tree.
"""

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("GENIE_")}
ENV.pop("PYTHONPATH", None)


def _run(args, cwd, timeout=300, env=None):
    r = subprocess.run(args, cwd=cwd, env=env or ENV, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, \
        f"{args} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.parametrize("init", ["raise ImportError('not Genie')\n", "VALUE = 1\n", None],
                         ids=["broken", "another-project", "namespace-folder"])
def test_import_torch_beside_a_foreign_genie_folder_warns_and_works(tmp_path, init):
    (tmp_path / "genie").mkdir()
    if init is not None:
        (tmp_path / "genie" / "__init__.py").write_text(init)
    r = _run([sys.executable, "-c", "import torch; print(torch.ones(2).sum().item(), "
              "hasattr(torch, 'remote_accelerator'))"], cwd=tmp_path)
    assert r.stdout.split() == ["2.0", "False"]
    assert "is not the package installed with this entry point" in r.stderr
    if init is not None:
        return
    # elsewhere, import torch alone registers the device through the entry point
    r = _run([sys.executable, "-c", "import torch; print(torch.remote_accelerator.device_count())"],
             cwd=tmp_path.parent)
    assert r.stdout.strip() == "1"


SMOKE = textwrap.dedent("""
    import torch, genie, pathlib
    assert "site-packages" in genie.__file__, genie.__file__
    import genie._C
    x = torch.randn(8, 8)
    d = x.to("remote_accelerator")
    torch.testing.assert_close((d @ d).relu().sum().cpu(), (x @ x).relu().sum())
    m = torch.nn.Linear(8, 2).to("remote_accelerator")
    m(d).sum().backward()
    assert m.weight.grad.shape == (2, 8)
    print("smoke ok", genie.__file__)
""")


@pytest.mark.skipif(os.environ.get("GENIE_SKIP_WHEEL") == "1", reason="GENIE_SKIP_WHEEL=1")
def test_wheel_installs_into_a_fresh_venv_and_runs_outside_the_source_tree(tmp_path):
    wheels = tmp_path / "wheels"
    env = {**ENV, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "MAX_JOBS": "2",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
          "-w", str(wheels), str(ROOT)], cwd=tmp_path, timeout=600, env=env)
    (whl,) = wheels.glob("genie_remote_accelerator-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).stdout.strip())
    # dependencies (torch, optree, numpy, pyzmq) from this venv, after the fresh venv's own
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
          "--no-index", str(whl)], cwd=tmp_path, env=env)
    work = tmp_path / "elsewhere"
    work.mkdir()
    r = _run([str(py), "-c", SMOKE], cwd=work)
    assert "smoke ok" in r.stdout and str(venv) in r.stdout
    # the console script is installed beside the interpreter
    assert (venv / "bin" / "genie-server").exists()
    r = _run([str(venv / "bin" / "genie-server"), "--help"], cwd=work)
    assert "--listen" in r.stdout


def test_install_hints_name_this_distribution():
    """``pip install genie[...]`` installs another project (the name is taken on the package
    index): no message or page may suggest it."""
    import re

    bad = re.compile(r"install\s+['\"]?genie\[")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in [*sorted((ROOT / "genie").rglob("*.py")),
                                                 *sorted((ROOT / "docs").glob("*.md")),
                                                 ROOT / "README.md", ROOT / "tools" / "setup.sh"]
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not hits, f"install hints naming the PyPI project 'genie': {hits}"


_LOADS = textwrap.dedent("""
    import json, sys
    import torch

    def f(t):
        return (t * 2 + 1).relu().sum()

    x = torch.randn(4, 4)
    want = torch.compile(f)(x)  # what torch itself loads to compile, on the CPU
    before = {m.partition(".")[0] for m in sys.modules}
    import genie
    got = torch.compile(f)(x.to("remote_accelerator")).cpu()
    assert torch.allclose(got, want), (got, want)
    print(json.dumps(sorted({m.partition(".")[0] for m in sys.modules} - before)))
""")


def _requirement_names(reqs):
    import re
    return {re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0].lower().replace("_", "-")
            for r in reqs or () if "extra ==" not in r}


def test_genie_loads_only_its_declared_dependencies():
    """``import torch`` loads Genie (the backend entry point), so a package Genie imports on that
    path or on a device's common paths (an op, a read, ``torch.compile``) that is not one of its
    declared dependencies breaks ``import torch`` for whoever installed it without the extras
    (the native replay importing the graph encoder imported msgpack, an extra then). Every
    package such a program loads beyond what torch loads itself must be the standard library's,
    torch's own dependencies' or in pyproject's ``dependencies``."""
    import importlib.metadata as md
    import tomllib

    core = _requirement_names(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                              ["dependencies"])
    allowed = core | _requirement_names(md.requires("torch")) | {"torch"}
    dists = md.packages_distributions()
    env = {**ENV, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONPATH": str(ROOT)}
    out = _run([sys.executable, "-c", _LOADS], cwd=ROOT, timeout=600, env=env).stdout
    loaded = json.loads(out.splitlines()[-1])
    undeclared = sorted(
        m for m in loaded
        if m not in sys.stdlib_module_names and m not in ("genie", "_genie_autoload")
        and not m.startswith("_")  # CPython's and extension modules' private parts
        and not {d.lower().replace("_", "-") for d in dists.get(m, [m])} & allowed)
    assert not undeclared, (
        f"a device program loads {undeclared}, which pyproject.toml does not declare as "
        "dependencies (only as extras, or not at all): import it where the optional feature "
        "needs it, or declare it")
