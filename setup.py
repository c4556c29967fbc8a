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


def static_cxx_runtime(path: str) -> bool:
    """Whether the shared object at ``path`` was linked without the shared C++ runtime: ELF
    (Linux), and ``libstdc++.so`` is not among its NEEDED libraries (``readelf -d``). False where
    that cannot be told (no ``readelf``, not ELF)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                return False
        out = subprocess.run(["readelf", "-d", path], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    return "libstdc++.so" not in out and "libc++.so" not in out


class Build(BuildExtension):
    """torch's ``BuildExtension``, and a check of what it linked: a compiler that links
    libstdc++ statically into genie._C (``/opt/gcc/bin/g++`` of an NVIDIA CUDA image did) gives it
    a C++ runtime of its own beside the shared one torch's libraries use, and any C++ exception
    it throws that torch catches (every error raised natively, such as
    ``torch.Generator(device="remote_accelerator:9")``) then ends the process with a segmentation
    fault. That is refused here, at the build, with what to do instead."""

    def build_extension(self, ext) -> None:
        super().build_extension(ext)
        path = self.get_ext_fullpath(ext.name)
        if static_cxx_runtime(path):
            how = f"the compiler {os.environ.get('CXX') or 'c++'!r}" + (
                f" with LDFLAGS {os.environ['LDFLAGS']!r}" if os.environ.get("LDFLAGS") else "")
            os.remove(path)
            raise RuntimeError(
                f"{ext.name} was linked with a static copy of the C++ runtime: {how} links "
                "libstdc++ statically (readelf -d shows no libstdc++.so among its NEEDED "
                "libraries). PyTorch's libraries use the shared libstdc++, and a C++ "
                f"exception thrown in {ext.name} and caught by torch would end the process with "
                "a segmentation fault. Build with a compiler that links it dynamically, e.g. "
                "`CXX=g++ pip install --no-build-isolation -e .` (or `CXX=g++ python setup.py "
                "build_ext --inplace`).")


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
    cmdclass={"build_ext": Build},
)
