"""The one table of PyTorch device-generic tests excluded on ``remote_accelerator``, with reasons.

Keys are ``file::GenericClass::test_name`` with the device removed from the test's name (the same
name on cpu and on the device); a key with ``*`` is an fnmatch pattern. Every entry is a test
that passes on cpu and fails on the device (``tools/device_generic_report.py`` lists them, and
lists the entries that pass again so they can go); an excluded test is skipped on the device,
with its reason. "Family N" is the numbered family of issue 29 that the failure belongs to;
entries outside the five families say so ("not in families 1-5").
"""

_F1 = "family 1 (issue 29): the meta cache is keyed without the default dtype: "
_F2 = "family 2 (issue 29): a check eager makes at the call is deferred to materialization: "
_F3 = "family 3 (issue 29): storages and data pointers: "
_F4 = "family 4 (issue 29): missing op: "
_F5 = "family 5 (issue 29): "
_NEW = "not in families 1-5: "

EXCLUSIONS: dict[str, str] = {
    # test_view_ops.py
    "test_view_ops.py::TestOldViewOps::test_contiguous":
        _F4 + "set_ with a storage (UnsupportedOpError: aten.set_.source_Storage_storage_offset)",
    "test_view_ops.py::TestOldViewOps::test_flatten":
        _F4 + "quantized tensors (aten::_empty_affine_quantized has no Quantizedremote_accelerator "
        "kernel)",
    "test_view_ops.py::TestOldViewOps::test_ravel":
        _F4 + "quantized tensors (aten::_empty_affine_quantized has no Quantizedremote_accelerator "
        "kernel)",
    "test_view_ops.py::TestOldViewOps::test_reshape":
        _F3 + "data_ptr() is 0 for every tensor, so a reshape that copies compares equal",
    "test_view_ops.py::TestOldViewOps::test_reshape_view_semantics_*":
        _F3 + "untyped_storage().data_ptr() raises 'invalid python storage'",
    # test_indexing.py
    "test_indexing.py::TestIndexing::test_advancedindex_float64":
        _F4 + "set_ with a storage (UnsupportedOpError: aten.set_.source_Storage_storage_offset)",
    "test_indexing.py::TestIndexing::test_byte_tensor_assignment":
        _F2 + "the uint8-mask deprecation warning is not emitted",
    "test_indexing.py::TestIndexing::test_empty_ndim_index":
        _F2 + "an index into a dimension of size 0 (IndexError 'for dimension with size 0') is "
        "decidable from metadata but raised only at materialization",
    "test_indexing.py::TestIndexing::test_index_getitem_copy_bools_slices":
        _F3 + "data_ptr() is 0 for every tensor, so a[True].data_ptr() == a.data_ptr() for a copy",
    "test_indexing.py::TestIndexing::test_index_put_accumulate_empty":
        _F2 + "index_put_ with accumulate on empty inputs does not raise at the call",
    "test_indexing.py::TestIndexing::test_setitem_expansion_error":
        _F2 + "assigning a value that does not broadcast to the indexed shape raises only at "
        "materialization",
    "test_indexing.py::NumpyTests::test_boolean_assignment_value_mismatch":
        _F2 + "boolean-mask assignment of the wrong length raises only at materialization",
    "test_indexing.py::NumpyTests::test_broaderrors_indexing":
        _F2 + "index tensors of mismatched shapes in __setitem__ raise only at materialization",
    "test_indexing.py::NumpyTests::test_trivial_fancy_out_of_bounds":
        _F2 + "an index out of range is data-dependent: deferred by design (as on CUDA), so "
        "IndexError is not raised by __getitem__ itself",
}
