"""Builds genie._C, the native remote_accelerator runtime (metadata lives in pyproject.toml).

Build against the installed torch, without build isolation:
    pip install --no-build-isolation -e .
    python setup.py build_ext --inplace
"""

import os
import shlex
import subprocess
import sysconfig
import tempfile
from glob import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension


def gc_offsets() -> list[str]:
    """``-D`` flags with where this CPython keeps the cyclic GC's young-generation threshold and
    count (csrc/gc_probe.c, compiled with the interpreter's C compiler and run); none where the
    probe does not build or run (another CPython, no C compiler): genie._C then leaves the count
    alone (csrc/gccount.cpp)."""
    compilers = [shlex.split(sysconfig.get_config_var("CC") or "cc"), ["cc"]]
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "gc_probe")
        for cc in compilers:  # (the interpreter's own compiler may not be on this machine)
            try:
                subprocess.run([*cc, "-I", sysconfig.get_paths()["include"], "csrc/gc_probe.c",
                                "-o", exe], check=True, capture_output=True)
                threshold, count = subprocess.run([exe], check=True, capture_output=True,
                                                  text=True).stdout.split()
                break
            except (OSError, subprocess.CalledProcessError, ValueError):
                continue
        else:
            return []
    return [f"-DGENIE_GC_THRESHOLD_OFFSET={int(threshold)}",
            f"-DGENIE_GC_COUNT_OFFSET={int(count)}"]


setup(
    ext_modules=[
        CppExtension(
            "genie._C",
            sources=sorted(glob("csrc/*.cpp")),
            # No -std flag: BuildExtension picks the standard the installed torch headers need
            # (C++20 for torch 2.13; its headers warn under -std=c++17).
            # GENIE_WRAP_VIA_PYTHON=1: the native record path makes its output wrappers through
            # torch.Tensor._make_wrapper_subclass, as it must on torch older than 2.13; set to
            # test that path where a newer torch is installed (csrc/record.cpp).
            extra_compile_args={"cxx": ["-O2"] + gc_offsets() + (
                ["-DGENIE_WRAP_VIA_PYTHON"] if os.environ.get("GENIE_WRAP_VIA_PYTHON") == "1"
                else [])},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
