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

}  // namespace

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
}

}  // namespace genie
