"""Where a test's eager oracle runs a backward, and how close Genie's values must be to it.

Eager on the real device is the oracle (the same kernels: bit-equal values). A backward over
CUDA tensors cannot run in a process where the ``remote_accelerator`` device is registered
(torch then takes PrivateUse1 as its one accelerator and finds no CUDA stream for the
backward's nodes: pytorch/pytorch#161129, docs/semantics.md), so where the real device is CUDA
an oracle with a backward runs on the CPU, compared to float32's tolerance."""

import torch
from oracle import assert_close_to_eager

from genie.device import real_device

EXACT = real_device(0).type == "cpu"
AUTOGRAD = real_device(0) if EXACT else torch.device("cpu")  # the oracle's device
RTOL, ATOL = 1e-4, 1e-4  # CUDA's kernels against the CPU's, over a few training steps


def assert_equal_eager(got: list, want: list) -> None:
    """``got`` and ``want``: equal-length lists of floats or tensors (on the CPU)."""
    assert_close_to_eager(got, want, exact=EXACT, rtol=RTOL, atol=ATOL)
