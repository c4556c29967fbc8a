"""PyTorch's device-generic test files on ``remote_accelerator`` (see device_generic_harness.py).

pytest imports this folder's modules with the folder on ``sys.path`` (rootdir-relative
"prepend" import mode), so the wrappers import the harness by its unique name. Every test here
runs with process-wide settings restored afterwards, so nothing an upstream test sets (default
dtype, deterministic algorithms, grad mode, ...) leaks into the project's other tests.
"""

import pytest
from device_generic_harness import global_state, restore_global_state

# The upstream files are loaded by the wrappers (test_upstream_*.py), never collected themselves.
collect_ignore_glob = ["upstream/*"]


@pytest.fixture(autouse=True)
def _no_global_state_leak():
    saved = global_state()
    yield
    restore_global_state(saved)
