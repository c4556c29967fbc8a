"""How a test compares Genie's values with eager's: the one rule every eager oracle uses.

Eager on the same device as Genie's kernels is bit-equal (``exact``); where the oracle must run
elsewhere (a backward over CUDA tensors cannot run in a process where ``remote_accelerator`` is
registered: pytorch/pytorch#161129, docs/semantics.md; a server's CUDA against the test's CPU),
the values are compared to float32's tolerance over a few training steps. Importable from every
test directory (pytest puts ``tests/``, the directory of the top conftest, on ``sys.path``)."""

import pytest
import torch


def assert_close_to_eager(got: list, want: list, *, exact: bool, rtol: float = 1e-4,
                          atol: float = 1e-4) -> None:
    """``got`` and ``want``: equal-length lists of Python numbers or tensors (on the CPU); equal
    where ``exact`` (dtype, shape and every bit of the value), else within ``rtol``/``atol``."""
    assert len(got) == len(want), f"{len(got)} values against eager's {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, **({"rtol": 0, "atol": 0} if exact else
                                                {"rtol": rtol, "atol": atol}),
                                       msg=lambda m, i=i: f"value {i} against eager's: {m}")
        else:
            assert a == b if exact else a == pytest.approx(b, rel=rtol, abs=atol), \
                f"value {i}: {a!r} against eager's {b!r}"
