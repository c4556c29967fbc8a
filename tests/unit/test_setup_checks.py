"""setup.py's check of what the build linked (``static_cxx_runtime``): a genie._C with a static
copy of libstdc++ ended the process with a segmentation fault at every C++ exception torch caught
from it (the H200 image's ``/opt/gcc/bin/g++``: the 7 ``test_native.py`` error tests; built with
that image's ``g++`` they passed). The build now refuses such a module; here the check itself,
on two small shared objects linked each way."""

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _check():
    """``static_cxx_runtime`` from setup.py, without running setup() (importing it would)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "static_cxx_runtime")
    ns = {"subprocess": subprocess, "os": os}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), ns)
    return ns["static_cxx_runtime"]


def _link(tmp_path: Path, name: str, *flags: str) -> Path:
    src = tmp_path / "throws.cpp"
    src.write_text('#include <stdexcept>\nextern "C" void f() { throw std::runtime_error("x"); }\n')
    out = tmp_path / name
    subprocess.run(["g++", "-shared", "-fPIC", *flags, str(src), "-o", str(out)], check=True,
                   capture_output=True)
    return out


@pytest.mark.skipif(not (shutil.which("g++") and shutil.which("readelf")),
                    reason="needs g++ and readelf (binutils)")
def test_a_static_cxx_runtime_is_found_and_a_shared_one_is_not(tmp_path):
    static = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True,
                            text=True).stdout.strip()
    if not os.path.isabs(static):
        pytest.skip("this g++ has no static libstdc++ to link")
    check = _check()
    assert not check(str(_link(tmp_path, "shared.so")))
    assert check(str(_link(tmp_path, "static.so", "-static-libstdc++")))
    # genie._C as this checkout built it (the suite runs against it), and a file that is not ELF
    import genie._C as native

    assert not check(native.__file__)
    (tmp_path / "x.so").write_bytes(b"not an ELF file")
    assert not check(str(tmp_path / "x.so"))
