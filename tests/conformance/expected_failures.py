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

_SPARSE = ("Genie gap: sparse layouts. The sample's sparse CSR tensor cannot become a "
           "LazyTensor (a strided wrapper: 'Sparse CSR tensors do not have strides'); "
           "remote_accelerator tensors are strided only.")
_TENSOR_SPLIT = ("Not a Genie bug: with a tensor of split indices, tensor_split requires that "
                 "tensor on the CPU on every non-CPU device (eager CUDA raises the same "
                 "RuntimeError). The harness moves every sample tensor to the device, so the "
                 "device raises where eager CPU does not.")
_UNSAFE_VIEWS = ("Inherent (policy from schemas): the schema declares fresh outputs (no alias "
                 "annotation: that is the 'unsafe' part, autograd does not track them as views), "
                 "but eager's outputs are views sharing the input's storage. Genie follows the "
                 "schema, so a later write to the input is not seen through the outputs.")
_BN_EVAL = ("Inherent (meta kernel): with training=False the CPU kernel returns empty (0,) "
            "save_mean/save_invstd, the meta kernel (C,)-shaped ones; Genie reports the meta shape "
            "for outputs [1] and [2] (output [0] matches).")

EXPECTED_FAILURES: dict[tuple[str, str], str] = {
    ("addbmm", "inplace"): (
        "Inherent (meta kernel): eager CPU's addbmm_ silently resizes a broadcastable self "
        "([1] or [] -> [5, 10], the deprecated out-resize); the meta kernel raises 'output with "
        "shape [1] doesn't match the broadcast shape', so the device raises where eager does not."),
    ("native_batch_norm", "out"): _BN_EVAL,
    ("_native_batch_norm_legit", "out"): _BN_EVAL,
    ("sparse.mm.reduce", "out"): _SPARSE,
    ("sparse.mm.reduce", "grad"): _SPARSE,
    ("sparse.sampled_addmm", "out"): _SPARSE,
    ("sparse.sampled_addmm", "grad"): _SPARSE,
    ("to_sparse", "out"): (
        "Genie gap: sparse layouts. _to_sparse has no meta kernel, so it runs at once on the "
        "device, but its sparse COO result cannot be a LazyTensor (strided only): "
        "UnsupportedOpError."),
    ("to_sparse", "grad"): "Genie gap: sparse layouts; as ('to_sparse', 'out').",
    ("tensor_split", "out"): _TENSOR_SPLIT,
    ("tensor_split", "grad"): _TENSOR_SPLIT,
    ("unsafe_chunk", "out"): _UNSAFE_VIEWS,
    ("unsafe_split", "out"): _UNSAFE_VIEWS,
}
