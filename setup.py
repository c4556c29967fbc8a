"""Builds genie._C, the native remote_accelerator runtime (metadata lives in pyproject.toml).

Build against the installed torch, without build isolation:
    pip install --no-build-isolation -e .
    python setup.py build_ext --inplace
"""

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
            extra_compile_args={"cxx": ["-O2"]},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
