"""The server's op allowlist is a list (issue 10, findings 3, 4, 8): data, derived by one rule.

``genie/remote/allowlist.txt`` is checked in and reviewed; these tests recompute it from the rule
in :mod:`genie.remote.allowlist` and fail when the installed PyTorch would widen it (a new op, or
a schema change that the rule admits), so that a PyTorch upgrade never silently admits an op.
They also pin the refusals the attack review needed and the ops Genie's own client sends.
"""

from __future__ import annotations

import re

import pytest
import torch

from genie.remote import allowlist
from genie.tape_io import TapeDataError, op_from_name

#: every op Genie's client sent to a server while the model suite, the semantics unit tests and
#: the fast OpInfo conformance ran through one (GENIE_SERVER set): they must keep running
CLIENT_OPS = """
    aten::_adaptive_avg_pool2d.default aten::_adaptive_avg_pool2d_backward.default 
    aten::_log_softmax.default aten::_log_softmax_backward_data.default 
    aten::_safe_softmax.default aten::_softmax.default aten::_softmax_backward_data.default 
    aten::_to_copy.default aten::_transformer_encoder_layer_fwd.default aten::_unsafe_view.default 
    aten::abs.default aten::abs_.default aten::adaptive_max_pool2d.default 
    aten::adaptive_max_pool2d_backward.default aten::add.Scalar aten::add.Tensor aten::add.out 
    aten::add_.Scalar aten::add_.Tensor aten::addcdiv_.default aten::addcmul.default 
    aten::addcmul_.default aten::addmm.default aten::addmm_.default aten::alias.default 
    aten::all.default aten::all.dim aten::all.dims aten::amax.default aten::any.default 
    aten::any.dim aten::arange.default aten::arange.start aten::arange.start_step 
    aten::argmax.default aten::as_strided.default aten::as_strided_.default 
    aten::avg_pool2d.default aten::avg_pool2d_backward.default aten::baddbmm.default 
    aten::baddbmm_.default aten::bernoulli_.float aten::bitwise_and.Tensor 
    aten::bitwise_not.default aten::bitwise_or.Tensor aten::bmm.default aten::cat.default 
    aten::cat.out aten::clamp.Tensor aten::clamp_.Tensor aten::clone.default 
    aten::constant_pad_nd.default aten::convolution.default aten::convolution_backward.default 
    aten::copy_.default aten::cos.default aten::cumprod.default aten::cumsum.default 
    aten::cumsum_.default aten::detach.default aten::diagonal.default 
    aten::diagonal_backward.default aten::div.Scalar aten::div.Tensor aten::div.Tensor_mode 
    aten::div_.Scalar aten::div_.Tensor aten::div_.Tensor_mode aten::dot.default 
    aten::embedding.default aten::embedding_dense_backward.default aten::embedding_renorm_.default 
    aten::empty.memory_format aten::empty_like.default aten::eq.Scalar aten::eq.Tensor 
    aten::eq_.Tensor aten::erf.default aten::erf_.default aten::exp.default aten::exp_.default 
    aten::expand.default aten::eye.m aten::fill.Scalar aten::fill_.Scalar aten::flip.default 
    aten::fmod.Tensor aten::fmod_.Tensor aten::full.default aten::full_like.default 
    aten::gather.default aten::gather.out aten::ge.Scalar aten::ge.Tensor aten::gelu.default 
    aten::gelu_backward.default aten::gt.Scalar aten::gt.Tensor aten::hardtanh.default 
    aten::hardtanh_backward.default aten::index.Tensor aten::index_add.default 
    aten::index_add_.default aten::index_copy.default aten::index_copy_.default 
    aten::index_fill.int_Scalar aten::index_put.default aten::index_put_.default 
    aten::index_select.default aten::isin.Tensor_Tensor aten::isnan.default aten::le.Tensor 
    aten::leaky_relu.default aten::leaky_relu_.default aten::leaky_relu_backward.default 
    aten::lerp.Scalar aten::lerp.Tensor aten::lerp_.Scalar aten::lerp_.Tensor 
    aten::lift_fresh.default aten::linalg_vector_norm.default aten::linspace.default 
    aten::log.default aten::log_.default aten::logical_and.default aten::logical_and_.default 
    aten::logical_not.default aten::logical_or.default aten::logspace.default 
    aten::logsumexp.default aten::lt.Scalar aten::lt.Tensor aten::lt_.Tensor 
    aten::masked_fill.Scalar aten::masked_fill.Tensor aten::masked_fill_.Scalar 
    aten::masked_fill_.Tensor aten::masked_scatter.default aten::max.default aten::max.dim 
    aten::max_pool2d_with_indices.default aten::max_pool2d_with_indices_backward.default 
    aten::maximum.default aten::mean.default aten::mean.dim aten::mm.default 
    aten::mse_loss.default aten::mse_loss_backward.default aten::mul.Scalar aten::mul.Tensor 
    aten::mul.out aten::mul_.Tensor aten::mv.default aten::nan_to_num.default 
    aten::nan_to_num_.default aten::native_batch_norm.default 
    aten::native_batch_norm_backward.default aten::native_dropout.default 
    aten::native_dropout_backward.default aten::native_group_norm.default 
    aten::native_group_norm_backward.default aten::native_layer_norm.default 
    aten::native_layer_norm_backward.default aten::ne.Scalar aten::neg.default aten::neg_.default 
    aten::new_ones.default aten::new_zeros.default aten::nll_loss2d_backward.default 
    aten::nll_loss2d_forward.default aten::nll_loss_backward.default 
    aten::nll_loss_forward.default aten::normal.float_float aten::ones.default 
    aten::ones_like.default aten::permute.default aten::pow.Tensor_Scalar aten::pow.Tensor_Tensor 
    aten::pow_.Scalar aten::pow_.Tensor aten::prod.default aten::prod.dim_int aten::rand.default 
    aten::randint.low aten::randn.default aten::randn.generator aten::randperm.default 
    aten::relu.default aten::remainder.Scalar aten::repeat.default aten::resize_.default 
    aten::resize_as_.default aten::roll.default aten::round.default aten::round_.default 
    aten::rsqrt.default aten::rsqrt_.default aten::rsub.Scalar aten::scalar_tensor.default 
    aten::scatter.reduce aten::scatter.src aten::scatter.value aten::scatter.value_reduce 
    aten::scatter_.reduce aten::scatter_.src aten::scatter_.value aten::scatter_.value_reduce 
    aten::scatter_add.default aten::scatter_add_.default aten::scatter_reduce.two 
    aten::scatter_reduce_.two aten::select.int aten::select_backward.default aten::sgn.default 
    aten::sigmoid.default aten::sigmoid_.default aten::sigmoid_backward.default aten::silu.default 
    aten::silu_.default aten::sin.default aten::sin_.default aten::slice.Tensor 
    aten::slice_backward.default aten::softplus.default aten::softplus_backward.default 
    aten::sort.default aten::sort.stable aten::split.Tensor aten::sqrt.default aten::sqrt_.default 
    aten::squeeze.default aten::squeeze.dim aten::squeeze_.default aten::squeeze_.dim 
    aten::stack.default aten::std.correction aten::sub.Scalar aten::sub.Tensor aten::sub_.Tensor 
    aten::sum.default aten::sum.dim_IntList aten::t.default aten::t_.default aten::tanh.default 
    aten::tanh_.default aten::tanh_backward.default aten::threshold_backward.default 
    aten::topk.default aten::transpose.int aten::transpose_.default aten::tril.default 
    aten::tril_.default aten::tril_indices.default aten::unbind.int aten::unsqueeze.default 
    aten::unsqueeze_.default aten::var_mean.correction aten::view.default aten::where.self 
    aten::zero_.default aten::zeros.default aten::zeros_like.default """.split()


def _list_torch() -> str:
    """The PyTorch version the checked-in list was derived with (its first line says)."""
    head = allowlist.LIST_FILE.read_text().splitlines()[0]
    return head.split("PyTorch ", 1)[1].split(",", 1)[0]


# The checked-in list is derived on one PyTorch release; another release's schemas and tags
# (torch 2.11 on the GPU machines) can differ in a few overloads either way. There the server
# still re-applies the rule at run time (admitted()); the set comparisons hold per release.
same_torch = pytest.mark.skipif(
    _list_torch().split(".")[:2] != torch.__version__.split(".")[:2],
    reason=f"allowlist.txt was derived on PyTorch {_list_torch()}, this is {torch.__version__}")


@same_torch
def test_the_rule_does_not_widen_the_checked_in_list() -> None:
    derived = set(allowlist.derive())
    listed = allowlist.checked_in()
    new = sorted(derived - listed)
    assert not new, (
        f"PyTorch {torch.__version__} would admit {len(new)} overloads that genie/remote/"
        f"allowlist.txt does not list (e.g. {new[:8]}); review them, then regenerate the file: "
        "python -m genie.remote.allowlist > genie/remote/allowlist.txt")


@same_torch
def test_the_checked_in_list_is_what_the_rule_derives() -> None:
    head = allowlist.LIST_FILE.read_text().splitlines()[0]
    assert f"rule version {allowlist.RULE_VERSION}," in head, head
    gone = sorted(allowlist.checked_in() - set(allowlist.derive()))
    # names the installed PyTorch no longer has (or the rule now refuses) are refused at run
    # time anyway (admitted() re-applies the rule); a regenerated list drops them
    for name in gone:
        assert not allowlist.admitted(name)


def test_the_ops_genies_client_sends_are_admitted() -> None:
    refused = {n: allowlist.why_refused(n) for n in CLIENT_OPS if not allowlist.admitted(n)}
    assert not refused, refused


@pytest.mark.parametrize("name, why", [
    ("aten::_reshape_alias.default", "bounds"),  # finding 3
    ("aten::_reshape_alias_copy.default", "bounds"),
    ("aten::_sparse_coo_tensor_with_dims_and_tensors.default", "sparse"),  # finding 4
    ("aten::_to_dense.default", "sparse"),
    ("aten::save.default", "file"),  # finding 8
    ("aten::manual_seed.default", "random state"),
    ("aten::seed.default", "random state"),
    ("aten::Generator.default", "Generator"),
    ("aten::from_file.default", "file"),
    ("aten::set_.source_Tensor", "storage"),
    ("aten::set_.source_Storage", "storage"),
    ("aten::_unsafe_index.Tensor", "unchecked"),
    ("aten::_index_put_impl_.default", "unsafe"),
    ("aten::quantize_per_tensor.default", "quantized"),
    ("aten::_nested_tensor_from_mask.default", "nested"),
    ("aten::to_mkldnn.default", "backend"),
    ("aten::pin_memory.default", "host memory"),
    ("aten::_efficientzerotensor.default", "storage"),
    ("aten::record_stream.default", "stream"),
    ("aten::einsum.default", "string"),
])
def test_refused_ops_say_why(name: str, why: str) -> None:
    assert not allowlist.admitted(name)
    assert why.lower() in allowlist.why_refused(name).lower(), allowlist.why_refused(name)
    with pytest.raises(TapeDataError, match="not on the allowlist"):
        op_from_name(name)


def test_what_the_rule_admits_takes_only_checked_argument_types() -> None:
    for op in allowlist.all_aten_overloads():
        if allowlist.refusal(op) is not None:
            continue
        for a in op._schema.arguments:
            t = str(a.real_type)
            assert t in allowlist.ARG_TYPES or a.name in allowlist.STR_ENUMS, (op, a.name, t)
            assert "Storage" not in t and "Stream" not in t and t != "Generator"
        assert not re.search(r"sparse|quantiz|nested|mkldnn", op._schema.name)


def test_admitted_ops_resolve() -> None:
    assert op_from_name("aten::add.Tensor") is torch.ops.aten.add.Tensor
    assert op_from_name("aten::_unsafe_view.default") is torch.ops.aten._unsafe_view.default
