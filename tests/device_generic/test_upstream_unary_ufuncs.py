"""PyTorch's test/test_unary_ufuncs.py on remote_accelerator (device_generic_harness.py)."""

from device_generic_harness import load

globals().update(load("test_unary_ufuncs.py"))
