// genie._C: composite ops recorded whole on remote_accelerator when autograd does not need them
// decomposed.
//
// `matmul` and `linear` have only a CompositeImplicitAutograd kernel: on every device the
// autograd key runs their decomposition (matmul of two 4-d tensors: two expands, two reshapes,
// bmm, _unsafe_view; linear of a 3-d input: t, view, mm, _unsafe_view), so each of those ops
// reaches Genie one by one. Eager runs them as C++ calls of ~0.5 µs; Genie records, plans, binds
// and frees each as a node (~5 µs of host time): a GPT-2 decode step recorded 241 ops, 45 of
// them from its 8 matmuls and one linear.
//
// This file registers a kernel at AutogradPrivateUse1 (the key that takes precedence over the
// composite kernel for remote_accelerator tensors, as torch_xla keeps some composites whole at
// AutogradXLA). When autograd needs the decomposition - grad mode on and an input that requires
// grad, or an input with a forward-mode tangent - it runs the composite kernel itself
// (at::native::matmul / at::native::linear: exactly what the dispatcher would have called).
// Otherwise (no_grad, inference, inputs that need no grad) it redispatches below autograd, so
// the op reaches Genie's record as one node (genie.meta.policy: not `implicit`); the device runs
// the same composite when the node replays, with eager's values, shapes and strides. Errors are
// the meta kernel's (the same decomposition on meta tensors), raised at the user's line.
//
// GENIE_WHOLE_OPS=0 (config.whole_ops) makes the kernel run the composite always (the reference).
// Under torch.inference_mode() the autograd keys are skipped and the ops reach the record whole
// in every configuration. tests/unit/test_whole_ops.py.
//
// scaled_dot_product_attention is a composite of another kind: it asks the device's
// _fused_sdp_choice_stub which fused kernel to call, and a device without one (PrivateUse1 had
// none) gets the math path: a GPT-2 attention recorded as 6 nodes (two mul.Scalar, a transpose,
// two matmuls, _safe_softmax), eager CPU's one flash kernel's values only to ~1e-6, and a
// contiguous output where eager's follows the query's layout (HF's transposed heads: (B, L, H, D)
// strides). The stub registered here answers as the real device would: where the node replays
// on a CPU (genie.device.sdp_runs_on_cpu: the embedded CPU, no server), it asks the CPU's own
// choice (the same metadata checks, sdpa_kernel and enable_*_sdp flags, dropout, masks, dtypes)
// and the composite then records _scaled_dot_product_flash_attention_for_cpu, one node with its
// own derivative; elsewhere it says math, as before. tests/unit/test_whole_ops.py.
#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/linear_native.h>
#include <ATen/ops/matmul_native.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/_fused_sdp_choice_native.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "whole.h"

namespace py = pybind11;

namespace {

std::atomic<bool> enabled{true};

// Whether autograd has to see the op's decomposition: its backward formulas are the parts'.
bool differentiated(const at::Tensor& t) {
  if (!t.defined()) {
    return false;
  }
  if (at::GradMode::is_enabled() && t.requires_grad()) {
    return true;
  }
  return t._fw_grad(/*level=*/0).defined();  // forward-mode AD runs under no_grad too
}

at::Tensor matmul_kernel(c10::DispatchKeySet ks, const at::Tensor& self, const at::Tensor& other) {
  if (!enabled.load(std::memory_order_relaxed) || differentiated(self) || differentiated(other)) {
    return at::native::matmul(self, other);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return at::_ops::matmul::redispatch(ks & c10::after_ADInplaceOrView_keyset, self, other);
}

at::Tensor linear_kernel(c10::DispatchKeySet ks, const at::Tensor& input, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  if (!enabled.load(std::memory_order_relaxed) || differentiated(input) ||
      differentiated(weight) || (bias.has_value() && differentiated(*bias))) {
    return at::native::linear(input, weight, bias);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return at::_ops::linear::redispatch(ks & c10::after_ADInplaceOrView_keyset, input, weight,
                                      bias);
}

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("matmul", TORCH_FN(matmul_kernel));
  m.impl("linear", TORCH_FN(linear_kernel));
}

// genie.device.sdp_runs_on_cpu(index) -> bool, set at import; unset: the math path.
PyObject* sdp_runs_on_cpu = nullptr;

int64_t sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                   std::optional<double> scale, bool enable_gqa) {
  bool cpu = false;
  {
    py::gil_scoped_acquire gil;
    if (sdp_runs_on_cpu != nullptr) {
      py::object r = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(sdp_runs_on_cpu, "i", static_cast<int>(query.device().index())));
      if (!r) {
        throw py::error_already_set();
      }
      cpu = PyObject_IsTrue(r.ptr()) == 1;
    }
  }
  if (!cpu) {
    return static_cast<int64_t>(sdp::SDPBackend::math);
  }
  // the CPU's choice itself (the stub's CPU kernel; the stub's own call is not exported)
  return at::native::_fused_sdp_choice_cpp(query, key, value, attn_mask, dropout_p, is_causal,
                                           scale, enable_gqa);
}

}  // namespace

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &sdp_choice)
}  // namespace at::native

namespace genie {

const std::vector<std::string>& whole_ops() {
  static const std::vector<std::string> names{"aten::matmul", "aten::linear"};
  return names;
}

void add_whole_functions(py::module_& m) {
  m.def("_whole_ops", &whole_ops,
        "The composite aten operators (default overloads) recorded as one node when autograd "
        "does not need their decomposition (csrc/whole.cpp).");
  m.def("_whole_ops_enable", [](bool on) { enabled.store(on, std::memory_order_relaxed); },
        py::arg("on"),
        "Record the whole ops as one node (True) or always as their decomposition (False).");
  m.def("_set_sdp_runs_on_cpu", [](py::object fn) {
        Py_XDECREF(sdp_runs_on_cpu);
        sdp_runs_on_cpu = fn.is_none() ? nullptr : fn.release().ptr();
      }, py::arg("fn"),
        "fn(index) -> whether remote_accelerator:index's ops run on a CPU: "
        "scaled_dot_product_attention then takes the CPU's fused kernel choice (None: math).");
}

}  // namespace genie
