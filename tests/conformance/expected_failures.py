"""The one table of known OpInfo conformance failures on ``remote_accelerator``.

Key: ``(op name, variant)``; the op name is OpInfo's ``name`` with ``.variant_test_name`` appended
when it has one (``"div.trunc_rounding"``). Variants:

- ``"out"``: the out-of-place (function) variant: values, shapes, dtypes, strides, aliasing, errors;
- ``"inplace"``: ``op.inplace_variant`` (``torch.Tensor.add_``);
- ``"grad"``: the vector-Jacobian product of the function variant against eager's.

Value: why it fails: what breaks, and whether it is a Genie gap (to fix) or an inherent limit.
``tests/conformance/test_opinfo.py`` marks every entry ``xfail(strict=True)``: an entry whose test
passes fails the run, so fixed entries must be removed here and the table cannot rot.
"""

from __future__ import annotations

EXPECTED_FAILURES: dict[tuple[str, str], str] = {
}
