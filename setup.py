"""Builds genie._C, the native remote_accelerator runtime (metadata lives in pyproject.toml).

Build against the installed torch, without build isolation:
    pip install --no-build-isolation -e .
    python setup.py build_ext --inplace
"""

import os
from glob import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

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
            extra_compile_args={"cxx": ["-O2"] + (
                ["-DGENIE_WRAP_VIA_PYTHON"] if os.environ.get("GENIE_WRAP_VIA_PYTHON") == "1"
                else [])},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
