// genie._C: a LazyTensor's record (its node, output number and liveness token) held in its
// TensorImpl, not in its instance dict (docs/node-layout.md section 7, step 2).
#pragma once

#include <Python.h>

#include <atomic>

#include <c10/core/TensorImpl.h>
#include <pybind11/pybind11.h>

namespace genie {

// The TensorImpl of a wrapper made by the native record path (csrc/record.cpp make_wrapper):
// a plain TensorImpl plus three strong references, set once when the wrapper is bound to its
// node (bound_wrapper) and read by the `_node`, `_out` and `_alive` descriptors of LazyTensor.
// torch.utils.swap_tensors swaps impls, so a parameter swapped by nn.Module.to() keeps its record
// (the reason the fields cannot be __slots__: swap_tensors refuses differing slots). Wrappers
// made elsewhere (the Python path's _make_wrapper_subclass, torch builds without the native
// wrapper) keep the fields in their instance dict, where the descriptors find them too.
struct LazyImpl final : c10::TensorImpl {
  using c10::TensorImpl::TensorImpl;
  ~LazyImpl() override;

  PyObject* node = nullptr;   // strong: the genie.graph.Node
  PyObject* out = nullptr;    // strong: the output number (an int)
  PyObject* alive = nullptr;  // strong: the liveness token the node's outputs refer to weakly
};

// The LazyImpl of a tensor object, or nullptr (another impl, or not a tensor). By its vtable
// pointer: `typeid(*impl) == typeid(LazyImpl)` compares the types' names with strcmp here (a
// type of a shared library with hidden symbols), ~20 instructions for every LazyTensor argument.
extern const void* lazy_impl_vtable;
inline LazyImpl* lazy_impl(c10::TensorImpl* impl) {
  return impl != nullptr && *reinterpret_cast<const void* const*>(impl) == lazy_impl_vtable
             ? static_cast<LazyImpl*>(impl)
             : nullptr;
}
LazyImpl* lazy_impl_of(PyObject* t);

// Releases the references of impls destroyed on a thread without the GIL (their destructor
// cannot touch Python objects); called with the GIL held before liveness is read and whenever a
// wrapper is bound. Cheap when there are none (one atomic load).
extern std::atomic<bool> pending_any;
void release_pending_slow();
inline void release_pending() {
  if (pending_any.load(std::memory_order_acquire)) {
    release_pending_slow();
  }
}

// Sets the three fields of a fresh LazyImpl (new references taken here).
void lazy_impl_bind(LazyImpl* impl, PyObject* node, PyObject* out, PyObject* alive);

// A wrapper's `_node` / `_out` / `_alive` (new reference) from its impl or its instance dict;
// nullptr without an error where it has none.
PyObject* wrapper_field(PyObject* t, int which);
enum WrapperField { kNodeField = 0, kOutField = 1, kAliveField = 2 };

void add_wrapper_functions(pybind11::module_& m);

} // namespace genie
