"""PyTorch's test/test_tensor_creation_ops.py on remote_accelerator (device_generic_harness.py)."""

from device_generic_harness import load

globals().update(load("test_tensor_creation_ops.py"))
