"""Loads PyTorch's own device-generic test files and instantiates them for ``remote_accelerator``.

This is how PyTorch's reference out-of-tree backend (torch_openreg) runs them: the upstream file
calls ``instantiate_device_type_tests``, which makes one class per device-type test base that
``PYTORCH_TESTING_DEVICE_ONLY_FOR`` lets through; ``PrivateUse1TestBase`` is the base for the
PrivateUse1 backend (its ``device_type`` "privateuse1" resolves to
``torch._C._get_privateuse1_backend_name()``, "remote_accelerator", in ``setUpClass``). Genie is
imported first, so the backend is registered when ``common_device_type`` builds its list of bases.

The upstream files are not part of this repository (see ``upstream/README.md``): each wrapper module
(``test_upstream_*.py``) calls :func:`load`, which imports the file under a unique module name,
undoes the module-level changes to global state its import made, applies the one exclusion table
(``device_generic_exclusions.py``) and, unless ``GENIE_FULL_TESTS=1``, keeps the fast subset.

Environment:
    GENIE_DEVICE_GENERIC_DEVICE   ``privateuse1`` (default) or ``cpu``: the device-type test base
                                  to instantiate (the comparison runner runs both).
    GENIE_DEVICE_GENERIC_NO_EXCLUSIONS=1   run the excluded tests too (to measure raw pass rates).
    GENIE_DEVICE_GENERIC_ALL=1    every test, not the fast subset (implied by GENIE_FULL_TESTS=1).
    GENIE_PYTORCH_TEST_DIR        a folder with the upstream files (default: ``upstream/``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import hashlib
import importlib.util
import os
import re
import signal
import sys
import unittest
from pathlib import Path
from typing import Any

import torch

import genie  # noqa: F401  (registers remote_accelerator before common_device_type is imported)

HERE = Path(__file__).resolve().parent
UPSTREAM = Path(os.environ.get("GENIE_PYTORCH_TEST_DIR") or HERE / "upstream")

#: The upstream files run here, with the sha256 of the recorded version (upstream/README.md).
FILES: dict[str, str] = {
    "test_view_ops.py": "f15dd296505aff884cdd2689d1ec658029536912e140a9857a6a8fb1a0f5828b",
    "test_indexing.py": "353386a7aa59d490f4f59cdbb20732da43b3fd0b78330e898b4c2f70f384f2da",
    "test_binary_ufuncs.py": "696a39fea7947cf183b56b7b7a9df91447c95b9a1e27c4c965f08211f152425e",
    "test_reductions.py": "cb66e13cf2c3cb23aa85a3b7dab02c799b87e1d4693a3158674333463861b790",
    "test_tensor_creation_ops.py":
        "ed18017924d939e2c83cf666f031e69e07430244794e300e79ff9ef12836a966",
    "test_unary_ufuncs.py": "2ab12e2632c8da04394f6b9ac3f106a8a71d37e4c24cd08cc3246202dfa2cfa6",
}

#: The fast subset keeps one test in FAST_EVERY (by a stable hash of its device-free name),
#: more of the small files, fewer of the big ones (test_unary_ufuncs.py: 23,506 tests, 99.9%
#: passing in issue 29; test_binary_ufuncs.py 13,271, test_reductions.py 4,520): about 600
#: tests, so that the whole folder stays within about a minute of CPU time.
FAST_EVERY = 25
FAST_EVERY_FILE = {"test_view_ops.py": 5, "test_indexing.py": 3,
                   "test_tensor_creation_ops.py": 10, "test_unary_ufuncs.py": 400,
                   "test_binary_ufuncs.py": 100, "test_reductions.py": 50}
#: A test that runs longer than this is stopped with a TimeoutError (a hang must not stall CI).
TEST_TIMEOUT_S = 120

# instantiate_test names a test f"{name}{param_suffix}_{device}{dtype_suffix}": the device is
# the last of these tokens (dtype names never contain one).
_DEVICE_TOKEN = re.compile(r"^(.*)_(remote_accelerator|privateuse1|cpu)(?=_|$)")
_CLASS_SUFFIX = re.compile(r"(REMOTE_ACCELERATOR|PRIVATEUSE1|CPU)$")


def device() -> str:
    return os.environ.get("GENIE_DEVICE_GENERIC_DEVICE", "privateuse1")


def full_run() -> bool:
    return (os.environ.get("GENIE_FULL_TESTS") == "1"
            or os.environ.get("GENIE_DEVICE_GENERIC_ALL") == "1")


def generic_name(file: str, cls_name: str, test_name: str) -> str:
    """``file::GenericClass::test_name`` with the device removed: the same for cpu and device."""
    m = _DEVICE_TOKEN.match(test_name)  # greedy: the last device token
    test = m.group(1) + test_name[m.end():] if m else test_name
    return f"{file}::{_CLASS_SUFFIX.sub('', cls_name)}::{test}"


def in_fast_subset(name: str) -> bool:
    every = FAST_EVERY_FILE.get(name.split("::")[0], FAST_EVERY)
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % every == 0


CPU_TOO = "fails on cpu too"


def exclusion_reason(name: str) -> str | None:
    from device_generic_exclusions import EXCLUSIONS

    reason = EXCLUSIONS.get(name)
    if reason is not None:
        return reason
    for pattern, why in EXCLUSIONS.items():
        if "*" in pattern and fnmatch.fnmatchcase(name, pattern):
            return why
    return None


def global_state() -> dict[str, Any]:
    """Process-wide settings that decide an op's result: none may leak out of these tests."""
    return {
        "default_dtype": torch.get_default_dtype(),
        "default_device": torch.get_default_device(),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "deterministic_fill": torch.utils.deterministic.fill_uninitialized_memory,
        "anomaly": torch.is_anomaly_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "num_threads": torch.get_num_threads(),
        "printoptions": dict(vars(torch._tensor_str.PRINT_OPTS)),
        "warn_always": torch.is_warn_always_enabled(),
    }


def restore_global_state(saved: dict[str, Any]) -> list[str]:
    """Puts back what :func:`global_state` recorded; returns the names that had changed."""
    changed = [k for k, v in global_state().items() if v != saved[k]]
    torch.set_default_dtype(saved["default_dtype"])
    torch.set_default_device(None if saved["default_device"].type == "cpu"
                             else saved["default_device"])
    torch.set_grad_enabled(saved["grad_enabled"])
    torch.use_deterministic_algorithms(saved["deterministic"],
                                       warn_only=saved["deterministic_warn_only"])
    torch.utils.deterministic.fill_uninitialized_memory = saved["deterministic_fill"]
    torch.set_anomaly_enabled(saved["anomaly"])
    torch.set_float32_matmul_precision(saved["matmul_precision"])
    torch.set_num_threads(saved["num_threads"])
    vars(torch._tensor_str.PRINT_OPTS).update(saved["printoptions"])
    torch.set_warn_always(saved["warn_always"])
    return changed


def _with_timeout(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        def expired(signum, frame):
            raise TimeoutError(f"the test ran longer than {TEST_TIMEOUT_S} s (a hang?)")

        if threading_main():
            old = signal.signal(signal.SIGALRM, expired)
            signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT_S)
        try:
            return fn(*args, **kwargs)
        finally:
            if threading_main():
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)

    return run


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")


def _skip(reason: str):
    def skipped(self, *args, **kwargs):
        raise unittest.SkipTest(reason)

    return skipped


@contextlib.contextmanager
def _device_env():
    """``PYTORCH_TESTING_DEVICE_ONLY_FOR`` is read by ``instantiate_device_type_tests`` at the
    upstream module's import: set for that import only, so no other test file sees it."""
    keys = ("PYTORCH_TESTING_DEVICE_ONLY_FOR", "PYTORCH_TESTING_DEVICE_EXCEPT_FOR")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = device()
    os.environ.pop("PYTORCH_TESTING_DEVICE_EXCEPT_FOR", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _compat() -> None:
    """Names these upstream files import that torch's test helpers renamed since (see
    upstream/README.md): the old name is bound to the new object, the file stays verbatim."""
    from torch.testing._internal import common_methods_invocations as cmi

    if not hasattr(cmi, "binary_ufuncs_and_refs"):  # renamed: binary_ufuncs has the refs now
        cmi.binary_ufuncs_and_refs = cmi.binary_ufuncs


def load(file: str) -> dict[str, type]:
    """The device test classes of one upstream file, exclusions and subset applied."""
    path = UPSTREAM / file
    if not path.is_file():
        import pytest

        pytest.skip(f"PyTorch's {file} is not in {UPSTREAM}: see tests/device_generic/upstream/"
                    "README.md for how to put it there (PyTorch's test files are not part of "
                    "this repository)", allow_module_level=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != FILES[file]:
        print(f"device_generic: {path} is not the recorded version (sha256 {digest[:12]}); "
              "the exclusion table was made for the version in upstream/README.md",
              file=sys.stderr)

    saved = global_state()
    argv = sys.argv
    sys.argv = [argv[0]]  # common_utils parses sys.argv when it is first imported
    try:
        with _device_env():
            _compat()
            spec = importlib.util.spec_from_file_location(
                "genie_upstream_" + path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
    finally:
        sys.argv = argv
        restore_global_state(saved)

    from torch.testing._internal.common_device_type import DeviceTypeTestBase

    raw = os.environ.get("GENIE_DEVICE_GENERIC_NO_EXCLUSIONS") == "1"
    subset = not full_run()
    classes: dict[str, type] = {}
    for name, obj in vars(module).items():
        if not (isinstance(obj, type) and issubclass(obj, DeviceTypeTestBase)
                and obj.__name__ == name and _CLASS_SUFFIX.search(name)):
            continue
        for attr in [a for a in vars(obj) if a.startswith("test")]:
            key = generic_name(file, name, attr)
            reason = None if raw else exclusion_reason(key)
            if reason is not None and device() == "cpu" and not reason.startswith(CPU_TOO):
                reason = None
            if subset and not in_fast_subset(key):
                delattr(obj, attr)
            elif reason is not None:
                setattr(obj, attr, _skip(f"excluded on remote_accelerator: {reason}"))
            else:
                setattr(obj, attr, _with_timeout(getattr(obj, attr)))
        classes[name] = obj
    return classes
