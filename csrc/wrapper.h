// genie._C: a LazyTensor's record (its node and output number) held in its TensorImpl, not in its
// instance dict, and counted by its node's output (docs/node-layout.md section 7, steps 2a, 2b).
#pragma once

#include <Python.h>

#include <atomic>

#include <c10/core/TensorImpl.h>
#include <pybind11/pybind11.h>

namespace genie {

// The TensorImpl of a wrapper made by the native record path (csrc/record.cpp make_wrapper):
// a plain TensorImpl plus two strong references, set when the wrapper is bound to its node
// (bound_wrapper) and read by the `_node` and `_out` descriptors of LazyTensor. While both are
// set, the impl is one of the holders its node's output count counts (node.h out_count_add): no
// liveness token, no weak reference (docs/node-layout.md section 7, step 2b).
// torch.utils.swap_tensors swaps impls, so a parameter swapped by nn.Module.to() keeps its record
// (the reason the fields cannot be __slots__: swap_tensors refuses differing slots). Wrappers
// made elsewhere (the Python path's _make_wrapper_subclass, torch builds without the native
// wrapper) keep `_node` and `_out` in their instance dict, where the descriptors find them too,
// with a liveness token genie._C.Alive as `_alive` that holds their count.
struct LazyImpl final : c10::TensorImpl {
  using c10::TensorImpl::TensorImpl;
  ~LazyImpl() override;

  // A key-free LazyImpl (csrc/python_key.cpp, "PrivateUse1") detaches as torch's PyInterpreter
  // detaches one with the Python key: through genie's detach (lazy_detach_hook), not by copying
  // the impl (a plain TensorImpl would be a device tensor genie did not make)
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const override;
  template <typename V>
  c10::intrusive_ptr<c10::TensorImpl> detach_key_free(V&& version_counter,
                                                      bool allow_tensor_metadata_change) const;

  PyObject* node = nullptr;  // strong: the genie.graph.Node
  PyObject* out = nullptr;   // strong: the output number (an int)
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
extern c10::intrusive_ptr<c10::TensorImpl> (*lazy_detach_hook)(const c10::TensorImpl*);
// make_wrapper's wrappers carry no Python key (set once, by python_key.cpp's install_pu1)
extern bool wrappers_key_free;

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

// Binds a LazyImpl to output `out` of `node` (new references taken here): its count goes up by one,
// and the previous record's, if any, down.
void lazy_impl_bind(LazyImpl* impl, PyObject* node, PyObject* out);

// A wrapper's `_node` / `_out` (new reference) from its impl or its instance dict; nullptr
// without an error where it has none.
PyObject* wrapper_field(PyObject* t, int which);
enum WrapperField { kNodeField = 0, kOutField = 1 };

// A new liveness token genie._C.Alive for output `out` of `node` (the count goes up by one until
// it is freed), for a wrapper whose record is in its instance dict. `tracked` false: off the
// collector's lists and its young count (as record.cpp's new_object).
PyObject* new_alive(PyObject* node, PyObject* out, bool tracked);

// Whether the tensor `t` holds a count on output `out` of `node`: its impl's record is that
// output, or its instance dict's `_alive` is a token of that output.
bool wrapper_counts(PyObject* t, PyObject* node, Py_ssize_t out);

void add_wrapper_functions(pybind11::module_& m);

} // namespace genie
