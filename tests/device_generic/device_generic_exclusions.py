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
#: An entry with this prefix fails on cpu as well (torch changed since the file's version): it is
#: skipped on cpu runs too, and not counted in the pass rates.
CPU_TOO = "fails on cpu too with torch 2.13 (the file is of 2023): "

EXCLUSIONS: dict[str, str] = {
    # test_view_ops.py
    "test_view_ops.py::TestOldViewOps::test_flatten":
        _F4 + "quantized tensors are refused at the call (genie.checks.Refused, as "
        "docs/semantics.md "
        "lists); the test quantizes a tensor on the device",
    "test_view_ops.py::TestOldViewOps::test_ravel":
        _F4 + "quantized tensors are refused at the call (genie.checks.Refused, as "
        "docs/semantics.md "
        "lists); the test quantizes a tensor on the device",
    "test_indexing.py::TestIndexing::test_advancedindex_float64":
        _F2 + "an index out of range is data-dependent: deferred by design (as on CUDA), so "
        "IndexError is not raised at the call",
    "test_indexing.py::NumpyTests::test_trivial_fancy_out_of_bounds":
        _F2 + "an index out of range is data-dependent: deferred by design (as on CUDA), so "
        "IndexError is not raised by __getitem__ itself",
    # test_tensor_creation_ops.py
    "test_tensor_creation_ops.py::TestAsArray::test_alias_from_dlpack_*":
        _NEW + "DLPack: torch.from_dlpack of a device tensor reaches aten::view/view_as_real "
        "with the backend key, which has no kernel (NotImplementedError)",
    "test_tensor_creation_ops.py::TestAsArray::test_copy_from_dlpack_*":
        _NEW + "DLPack: the tensor torch.from_dlpack makes of a device tensor is not a Genie "
        "tensor; copying it raises 'copy_ into remote_accelerator:0 from remote_accelerator:0 is "
        "not supported'",
    "test_tensor_creation_ops.py::TestRandomTensorCreation::test_normal_std_error":
        _F2 + "normal with a negative std raises only at materialization",
    "test_tensor_creation_ops.py::TestRandomTensorCreation::test_uniform_from_to_*":
        _F2 + "uniform_ range checks (from <= to, finite range) raise only at materialization",
    "test_tensor_creation_ops.py::TestRandomTensorCreation::test_rand_*":
        _NEW + "RNG: after the same manual_seed, torch.rand(..., out=t) gives other values than "
        "torch.rand(...) (eager and CUDA give the same)",
    "test_tensor_creation_ops.py::TestRandomTensorCreation::test_randperm":
        "upstream test limitation, not a Genie bug: fork_rng(devices=[device]) without "
        "device_type forks CUDA's generator only (pytorch#54282), so the device's generator "
        "moves on; fork_rng(devices=[D], device_type=D) restores it on remote_accelerator",
    "test_tensor_creation_ops.py::TestTensorCreation::test_random_from_to_*":
        _F2 + "random_(from, to) bounds checks and the float-precision UserWarning happen only "
        "at materialization (or not at all)",
    "test_tensor_creation_ops.py::TestTensorCreation::test_random_to_*":
        _F2 + "random_(to) bounds checks raise only at materialization",
    "test_tensor_creation_ops.py::TestTensorCreation::test_tensor_factories_empty":
        _F2 + "randint with a complex dtype raises only at materialization",
    "test_tensor_creation_ops.py::TestTensorCreation::test_torch_complex_same_dtype_error_*":
        _F2 + "torch.complex(out=) of another dtype raises only at materialization",
    "test_tensor_creation_ops.py::TestTensorCreation::test_cat_mem_overlap":
        _F2 + "cat(out=) into an expanded (internally overlapping) tensor raises only at "
        "materialization ('unsupported operation')",
    "test_tensor_creation_ops.py::TestTensorCreation::test_linlogspace_mem_overlap":
        _F2 + "linspace/logspace(out=) into an expanded tensor raise only at materialization",
    "test_tensor_creation_ops.py::TestTensorCreation::test_arange":
        _NEW + "silently wrong values: arange(out=) into a non-contiguous view "
        "(x.narrow(1, 1, 2)) writes the values as if the view were contiguous",
    "test_tensor_creation_ops.py::TestTensorCreation::test_linspace_bfloat16":
        _NEW + "silently wrong values: linspace(out=) into a non-contiguous view writes "
        "contiguously (as arange)",
    "test_tensor_creation_ops.py::TestTensorCreation::test_linspace_int*":
        _NEW + "silently wrong values: linspace(out=) into a non-contiguous view writes "
        "contiguously (as arange); int32/int64 also time out (see complex64)",
    "test_tensor_creation_ops.py::TestTensorCreation::test_linspace_uint8":
        _NEW + "silently wrong values: linspace(out=) into a non-contiguous view writes "
        "contiguously (as arange)",
    "test_tensor_creation_ops.py::TestTensorCreation::test_logspace_[biu]*":
        _NEW + "silently wrong values: logspace(out=) into a non-contiguous view writes "
        "contiguously (as arange); float32: the error text of an inferred complex dtype is "
        "meta's 'linspace(): ...', eager's says 'torch.logspace(): ...'",
    "test_tensor_creation_ops.py::TestTensorCreation::test_linspace_float32":
        _NEW + "error text: for an inferred complex dtype the meta kernel says 'linspace(): "
        "inferred dtype ...', eager 'torch.linspace(): inferred dtype ...'",
    "test_tensor_creation_ops.py::TestTensorCreation::test_linspace_float64":
        _NEW + "slow: all(cond) over a 1,000,000-element device tensor iterates it element by "
        "element, each a recorded select and a materialization (120 s timeout)",
    "test_tensor_creation_ops.py::TestTensorCreation::test_linspace_complex*":
        _NEW + "slow: all(cond) over a 1,000,000-element device tensor iterates it element by "
        "element, each a recorded select and a materialization (120 s timeout)",
    "test_tensor_creation_ops.py::TestTensorCreation::test_block_diag":
        _NEW + "error text: block_diag of a cpu and a device tensor raises with another message "
        "than eager's 'torch.block_diag: input tensors must all be on the same device'",
    "test_tensor_creation_ops.py::TestTensorCreation::test_cartesian_prod":
        _NEW + "aten::_local_scalar_dense (an .item()) reaches the backend key with no kernel "
        "(NotImplementedError) inside cartesian_prod",
    "test_tensor_creation_ops.py::TestTensorCreation::test_combinations":
        _NEW + "aten::_local_scalar_dense (an .item()) reaches the backend key with no kernel "
        "(NotImplementedError) inside combinations",
    # test_binary_ufuncs.py (from its fast subset: the patterns cover the dtype combinations)
    "test_binary_ufuncs.py::TestBinaryUfuncs::test_copysign_*":
        _NEW + "copysign of a device tensor and a 0-dim cpu tensor is refused ('Expected divisor "
        "(b) to be on the same device (cpu) as dividend (a)', the _refs decomposition's check); "
        "eager accepts a 0-dim cpu tensor as a scalar",
    "test_binary_ufuncs.py::TestBinaryUfuncs::test_type_promotion__refs_copysign":
        _NEW + "copysign of a device tensor and a 0-dim cpu tensor is refused (as test_copysign)",
    "test_binary_ufuncs.py::TestBinaryUfuncs::test_fmod_remainder_by_zero_integral_*":
        _F2 + "integer fmod/remainder by zero is data-dependent and deferred; it then surfaces "
        "as genie.errors.ExecutionError ('aten.fmod.Tensor failed on the device'), not eager's "
        "RuntimeError",
    "test_binary_ufuncs.py::TestBinaryUfuncs::test_reference_numerics__refs_floor_divide_[iu]*":
        _F2 + "integer floor_divide by zero is data-dependent and deferred: eager's "
        "RuntimeError('ZeroDivisionError') is not raised at the call",
    "test_binary_ufuncs.py::TestBinaryUfuncs::test_heaviside_*":
        _F2 + "heaviside of two different dtypes raises only at materialization (same-dtype "
        "combinations are covered by this pattern too)",
    "test_binary_ufuncs.py::TestBinaryUfuncs::test_maximum_minimum_complex_*":
        _F2 + "maximum/minimum of complex tensors raise only at materialization",
    # failing on cpu as well (not counted in the pass rates)
    "test_view_ops.py::TestOldViewOps::test_broadcast_shapes":
        CPU_TOO + "ValueError: Attempting to broadcast a dimension with negative length!",
    "test_reductions.py::TestReductions::test_dim_empty_keepdim_linalg_vector_norm":
        CPU_TOO + "dim=[] now reduces over every dimension (result shape differs)",
    "test_binary_ufuncs.py::TestBinaryUfuncs::test_reference_numerics_extremal_values_heaviside_"
    "float16":
        CPU_TOO + "heaviside of nan gives 0/1 where the NumPy reference gives nan",
    "test_binary_ufuncs.py::TestBinaryUfuncs::test_scalar_support__refs_sub_complex64":
        CPU_TOO + "the reference's dtype differs from the result's (exact_dtype assertion)",
    "test_tensor_creation_ops.py::TestTensorCreation::test_logspace_float*":
        _NEW + "silently wrong values: logspace(out=) into a non-contiguous view writes "
        "contiguously (as arange); float32: the error text of an inferred complex dtype is "
        "meta's 'linspace(): ...', eager's says 'torch.logspace(): ...'",
    "test_tensor_creation_ops.py::TestTensorCreation::test_tensor_ctor_device_inference":
        _F4 + "sparse tensors are refused at the call (genie.checks.Refused); the test builds a "
        "sparse COO tensor on the device",
    "test_tensor_creation_ops.py::TestAsArray::test_alias_from_tensor_[bcf]*[0-9]":
        CPU_TOO + "'Booleans mismatch: True is not False' (asarray's aliasing changed)",
    "test_tensor_creation_ops.py::TestAsArray::test_retain_autograd_history_*":
        CPU_TOO + "'Booleans mismatch: True is not False'",
}
