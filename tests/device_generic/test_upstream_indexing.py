"""PyTorch's test/test_indexing.py on remote_accelerator (device_generic_harness.py)."""

from device_generic_harness import load

globals().update(load("test_indexing.py"))
