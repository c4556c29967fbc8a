"""The device-generic harness itself: runs with or without PyTorch's files in upstream/.

A small device-generic class goes through the same machinery as the upstream files
(``instantiate_device_type_tests`` with ``PrivateUse1TestBase``), so CI checks that PyTorch's
framework finds ``remote_accelerator`` and hands the tests its device string.
"""

import os
import subprocess
import sys

import pytest
import torch
from device_generic_exclusions import EXCLUSIONS
from device_generic_harness import (
    FAST_EVERY,
    FILES,
    UPSTREAM,
    generic_name,
    global_state,
    in_fast_subset,
    restore_global_state,
)
from torch.testing._internal.common_device_type import dtypes, instantiate_device_type_tests
from torch.testing._internal.common_utils import TestCase


class TestGenieDeviceGeneric(TestCase):
    def test_device_is_remote_accelerator(self, device):
        self.assertEqual(torch.device(device).type, "remote_accelerator")
        self.assertEqual(self.device_type, torch._C._get_privateuse1_backend_name())

    @dtypes(torch.float32, torch.int64)
    def test_matches_cpu(self, device, dtype):
        a = torch.arange(12, dtype=dtype).reshape(3, 4)
        d = a.to(device)
        self.assertEqual((d * 2 + d).sum(0).cpu(), (a * 2 + a).sum(0))
        self.assertEqual(d.t().stride(), a.t().stride())


instantiate_device_type_tests(TestGenieDeviceGeneric, globals(), only_for="privateuse1")


def test_instantiated_for_the_device_only():
    names = [n for n in globals() if n.startswith("TestGenieDeviceGeneric")]
    assert len(names) == 1 and names[0].endswith(("PRIVATEUSE1", "REMOTE_ACCELERATOR")), names
    cls = globals()[names[0]]
    tests = sorted(a for a in vars(cls) if a.startswith("test"))
    assert "test_matches_cpu_privateuse1_float32" in tests or \
        "test_matches_cpu_remote_accelerator_float32" in tests, tests


@pytest.mark.parametrize("cls,test", [
    ("TestViewOpsPRIVATEUSE1", "test_view_as_real_privateuse1_complex64"),
    ("TestOldViewOpsREMOTE_ACCELERATOR", "test_view_as_real_remote_accelerator_complex64"),
    ("TestViewOpsCPU", "test_view_as_real_cpu_complex64"),
])
def test_generic_name_is_the_same_on_cpu_and_device(cls, test):
    assert generic_name("test_view_ops.py", cls, test).split("::")[2] == \
        "test_view_as_real_complex64"
    name = generic_name("f.py", "TestXCPU", "test_cpu_stuff_cpu_float32")
    assert name == "f.py::TestX::test_cpu_stuff_float32"


def test_exclusion_table_is_well_formed():
    for key, reason in EXCLUSIONS.items():
        file, cls, test = key.split("::")
        assert file in FILES, key
        assert cls[:1].isupper() and test.startswith("test"), key
        assert "remote_accelerator" not in test and "privateuse1" not in test, key
        assert len(reason) > 20, f"{key}: a reason says what fails and why"


def test_fast_subset_is_deterministic_and_about_one_in_N():
    names = [f"test_x.py::TestX::test_{i}" for i in range(5000)]
    kept = [n for n in names if in_fast_subset(n)]
    assert kept == [n for n in names if in_fast_subset(n)]
    assert 0.5 < len(kept) * FAST_EVERY / len(names) < 1.5


def test_global_state_is_restored():
    saved = global_state()
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)
    torch.set_printoptions(precision=2)
    changed = restore_global_state(saved)
    assert set(changed) >= {"default_dtype", "deterministic", "grad_enabled", "printoptions"}
    assert global_state() == saved


@pytest.mark.skipif(not (UPSTREAM / "test_tensor_creation_ops.py").is_file(),
                    reason="PyTorch's test files are not in upstream/ (see its README.md)")
def test_upstream_tests_leave_no_global_state_behind():
    """test_tensor_creation_ops sets the default dtype in tests; a project test run after it
    in the same process sees torch's defaults (the conftest restores them)."""
    code = (
        "import sys, torch, pytest\n"
        "rc = pytest.main(['-q', '-p', 'no:cacheprovider', "
        "'tests/device_generic/test_upstream_tensor_creation_ops.py', "
        "'-k', 'default_dtype or set_default'])\n"
        "assert torch.get_default_dtype() == torch.float32, torch.get_default_dtype()\n"
        "assert torch.is_grad_enabled() and not torch.are_deterministic_algorithms_enabled()\n"
        "print('STATE-OK')\n")
    env = dict(os.environ, GENIE_DEVICE_GENERIC_ALL="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert "STATE-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
