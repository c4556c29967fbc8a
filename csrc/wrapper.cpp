// genie._C: a LazyTensor's record in its TensorImpl (csrc/wrapper.h).
//
// Before, every recorded output's wrapper got an instance dict with three items (`_node`, `_out`,
// `_alive`): the dict and its keys object made, three inserts, and the same freed when the
// wrapper died, ~2k of the ~20k instructions an op costs Genie, plus a dict lookup per LazyTensor
// argument of every later op. The native record path now makes the wrapper's impl a LazyImpl and
// stores the record there; `LazyTensor._node` and `._out` are data descriptors (installed on the
// class by `_install_wrapper_fields`) that read the impl, or the instance dict of a wrapper made
// by the Python path, so every reader (Python's attribute access, csrc's lazy_attr) sees one
// record whichever path made it (step 2a).
//
// Liveness (step 2b): a node's output holds a count of its live holders (node.h out_count_add),
// which the impl joins while its record is set; a wrapper whose record is in its instance dict
// holds a liveness token genie._C.Alive as `_alive`, which counts while it lives. Before, each
// output had a token object and a weak reference to it in the node, two objects made and freed
// per op. The token's free lowered the collector's young count, and so does the last holder's
// release here (gc_young_debit), so that the collector runs when it ran (docs/node-layout.md
// section 7).
//
// Lifetime: the record is released when the wrapper's Python object goes (torch keeps a tensor
// subclass's Python object alive while C++ shares its impl), as the instance dict's items were:
// by LazyTensor's finalizer, with the GIL, just before torch drops the impl (lazy_finalize).
// Where the impl is destroyed some other way (still shared when its wrapper went), its
// destructor releases it, or, on a thread without the GIL, queues it for the next thread that
// holds it (release_pending: before every read and every wrapper bound); during interpreter
// finalization it leaves it (the process is ending).
#include "wrapper.h"

#include <atomic>
#include <mutex>
#include <vector>

#include <structmember.h>
#include <torch/csrc/autograd/python_variable.h>

#include "gccount.h"
#include "node.h"

namespace py = pybind11;

namespace genie {

// LazyImpl's vtable pointer, read by _install_wrapper_fields from one made for the purpose
// (lazy_impl; until then no impl is a LazyImpl, and none is made before: genie installs first).
const void* lazy_impl_vtable = nullptr;
c10::intrusive_ptr<c10::TensorImpl> (*lazy_detach_hook)(const c10::TensorImpl*) = nullptr;
bool wrappers_key_free = false;

// (both overloads: the detached impl from lazy_detach_hook, given the caller's version counter and
// metadata rule, as TensorImpl's own gives them to its copy)
template <typename V>
c10::intrusive_ptr<c10::TensorImpl> LazyImpl::detach_key_free(V&& version_counter,
                                                              bool allow_tensor_metadata_change) const {
  if (key_set().has(c10::DispatchKey::Python) || lazy_detach_hook == nullptr) {
    return nullptr;
  }
  c10::intrusive_ptr<c10::TensorImpl> r = lazy_detach_hook(this);
  if (r) {
    r->set_version_counter(std::forward<V>(version_counter));
    r->set_allow_tensor_metadata_change(allow_tensor_metadata_change);
  }
  return r;
}

c10::intrusive_ptr<c10::TensorImpl> LazyImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  if (auto r = detach_key_free(version_counter, allow_tensor_metadata_change)) {
    return r;
  }
  return c10::TensorImpl::shallow_copy_and_detach(version_counter, allow_tensor_metadata_change);
}

c10::intrusive_ptr<c10::TensorImpl> LazyImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  if (auto r = detach_key_free(version_counter, allow_tensor_metadata_change)) {
    return r;
  }
  return c10::TensorImpl::shallow_copy_and_detach(std::move(version_counter),
                                                  allow_tensor_metadata_change);
}

namespace {

PyObject* field_names[2] = {nullptr, nullptr};

PyObject*& field_ref(LazyImpl* impl, int which) {
  return which == kNodeField ? impl->node : impl->out;
}

// Output `out`'s count of `node` moved by `d` for one holder; the last impl's release lowers the
// collector's young count as the token's free did (see the top of this file; a token's own free
// lowers it: `debit` false).
void count_holder(PyObject* node, PyObject* out, Py_ssize_t d, bool debit = true) {
  if (node == nullptr || out == nullptr || !PyLong_CheckExact(out)) {
    return;
  }
  const Py_ssize_t k = PyLong_AsSsize_t(out);
  if (k == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return;
  }
  if (out_count_add(node, k, d) == 0 && d < 0 && debit) {
    gc_young_debit(1);
  }
}

// A record's references released, with the GIL: its count down, then the references.
void release_record(PyObject* node, PyObject* out, bool debit = true) {
  count_holder(node, out, -1, debit);
  Py_XDECREF(out);
  Py_XDECREF(node);
}

// The instance dict of `t` (borrowed), or nullptr (none yet, or an object without one).
PyObject* dict_of(PyObject* t) {
  PyObject** dp = _PyObject_GetDictPtr(t);
  return dp != nullptr ? *dp : nullptr;
}

PyObject* get_field(PyObject* self, void* closure) {
  const int which = static_cast<int>(reinterpret_cast<intptr_t>(closure));
  PyObject* v = wrapper_field(self, which);
  if (v == nullptr && !PyErr_Occurred()) {
    PyErr_Format(PyExc_AttributeError, "'%.100s' object has no attribute '%U'",
                 Py_TYPE(self)->tp_name, field_names[which]);
  }
  return v;
}

int set_field(PyObject* self, PyObject* value, void* closure) {
  const int which = static_cast<int>(reinterpret_cast<intptr_t>(closure));
  if (LazyImpl* impl = lazy_impl_of(self)) {
    PyObject*& f = field_ref(impl, which);
    if (value == nullptr && f == nullptr) {
      PyErr_SetObject(PyExc_AttributeError, field_names[which]);
      return -1;
    }
    release_pending();
    count_holder(impl->node, impl->out, -1);  // the record the impl held, then the new one
    PyObject* old = f;
    Py_XINCREF(value);
    f = value;
    count_holder(impl->node, impl->out, 1);
    Py_XDECREF(old);
    return 0;
  }
  PyObject* d = PyObject_GenericGetDict(self, nullptr);  // made if the wrapper has none yet
  if (d == nullptr) {
    return -1;
  }
  const int r = value != nullptr ? PyDict_SetItem(d, field_names[which], value)
                                 : PyDict_DelItem(d, field_names[which]);
  Py_DECREF(d);
  if (r < 0 && value == nullptr && PyErr_ExceptionMatches(PyExc_KeyError)) {
    PyErr_Clear();
    PyErr_SetObject(PyExc_AttributeError, field_names[which]);
  }
  return r;
}

PyGetSetDef field_defs[2] = {
    {"_node", get_field, set_field,
     "The genie.graph.Node whose output this tensor is (held by the tensor's impl).",
     reinterpret_cast<void*>(static_cast<intptr_t>(kNodeField))},
    {"_out", get_field, set_field, "Which output of `_node` this tensor is.",
     reinterpret_cast<void*>(static_cast<intptr_t>(kOutField))},
};

// genie._C.Alive: the liveness token of a wrapper whose record is in its instance dict (the
// Python path's, or every wrapper where torch has no native wrapper): output `k` of `node` counts
// it while it lives. A collector type never on its lists (it holds only a node, which never holds
// a token back), so that its allocation and free move the young count as the Python class it
// replaces did.
struct AliveObject {
  PyObject_HEAD
  PyObject* node;
  PyObject* out;
};

PyTypeObject AliveType = {PyVarObject_HEAD_INIT(nullptr, 0)};

int alive_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<AliveObject*>(self)->node);
  return 0;
}

int alive_clear(PyObject* self) {
  auto* a = reinterpret_cast<AliveObject*>(self);
  PyObject* node = a->node;
  PyObject* out = a->out;
  a->node = a->out = nullptr;
  release_record(node, out, false);  // (the token's free lowers the young count)
  return 0;
}

void alive_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  alive_clear(self);
  Py_TYPE(self)->tp_free(self);
}

void alive_init(PyObject* a, PyObject* node, PyObject* out) {
  Py_INCREF(node);
  Py_INCREF(out);
  reinterpret_cast<AliveObject*>(a)->node = node;
  reinterpret_cast<AliveObject*>(a)->out = out;
  count_holder(node, out, 1);
}

PyObject* alive_tp_new(PyTypeObject* t, PyObject* args, PyObject* kwds) {
  static const char* kw[] = {"node", "out", nullptr};
  PyObject *node = nullptr, *out = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!:Alive", const_cast<char**>(kw), &node,
                                   &PyLong_Type, &out)) {
    return nullptr;
  }
  if (!is_node_type(Py_TYPE(node))) {
    PyErr_Format(PyExc_TypeError, "Alive(node, out): node must be a genie.graph.Node, not %.100s",
                 Py_TYPE(node)->tp_name);
    return nullptr;
  }
  PyObject* a = t->tp_alloc(t, 0);  // (tracked, counted: as the Python class's instance was)
  if (a != nullptr) {
    alive_init(a, node, out);
  }
  return a;
}

PyMemberDef alive_members[] = {
    {"node", T_OBJECT, offsetof(AliveObject, node), READONLY, "The node whose output it holds."},
    {"out", T_OBJECT, offsetof(AliveObject, out), READONLY, "Which output."},
    {nullptr, 0, 0, 0, nullptr},
};

// LazyTensor's tp_finalize. torch's THPVariable_subclass_dealloc calls it once it has decided that
// the wrapper goes (its impl is not shared: otherwise it keeps the Python object alive instead),
// with the GIL held; right after, it drops the impl with the GIL released. So the record is
// released here, at once and under the GIL, as the instance dict's items were; the impl's
// destructor then finds nothing to release. A wrapper whose impl is still shared keeps its
// record (the impl outlives it: its destructor, or release_pending, releases the record).
void lazy_finalize(PyObject* self) {
  const at::Tensor& t = THPVariable_Unpack(self);  // (the object owns it: torch >= 2.11)
  if (!t.defined() || t.use_count() != 1) {
    return;
  }
  LazyImpl* impl = lazy_impl(t.unsafeGetTensorImpl());
  if (impl == nullptr) {
    return;
  }
  PyObject* node = impl->node;
  PyObject* out = impl->out;
  impl->node = impl->out = nullptr;
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  const bool error = PyErr_Occurred() != nullptr;  // a finalizer keeps the error state as it was
  if (error) {
    PyErr_Fetch(&type, &value, &tb);
  }
  release_record(node, out);
  if (error) {
    PyErr_Restore(type, value, tb);
  }
}

bool install(py::object cls) {
  if (!PyType_Check(cls.ptr())) {
    throw py::type_error("genie._C._install_wrapper_fields: a class is needed");
  }
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  if (type->tp_finalize != nullptr && type->tp_finalize != lazy_finalize) {
    throw py::type_error("genie._C._install_wrapper_fields: the class has a finalizer already");
  }
  type->tp_finalize = lazy_finalize;  // (subclasses made later inherit it)
  if (lazy_impl_vtable == nullptr) {
    c10::intrusive_ptr<LazyImpl> probe = c10::make_intrusive<LazyImpl>(
        c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), caffe2::TypeMeta::Make<float>(),
        std::optional<c10::Device>(c10::Device(c10::DeviceType::PrivateUse1, 0)));
    lazy_impl_vtable = *reinterpret_cast<const void* const*>(probe.get());
  }
  for (int i = 0; i < 2; ++i) {
    if (field_names[i] == nullptr) {
      field_names[i] = PyUnicode_InternFromString(field_defs[i].name);
    }
    py::object d = py::reinterpret_steal<py::object>(PyDescr_NewGetSet(type, &field_defs[i]));
    if (!d || PyObject_SetAttr(cls.ptr(), field_names[i], d.ptr()) < 0) {
      throw py::error_already_set();
    }
  }
  return true;
}

} // namespace

// Records whose impl was destroyed without the GIL, released by the next thread that holds it
// (release_pending). torch releases the GIL while a wrapper's dealloc drops its impl, so this is
// the common case: taking the GIL back there cost ~500 instructions an op (take_gil, its mutex
// and condition variable), more than the instance dict this file replaces.
std::mutex pending_mu;
// (node, out) pairs; never destroyed (exit order)
std::vector<std::pair<PyObject*, PyObject*>>* pending =
    new std::vector<std::pair<PyObject*, PyObject*>>();
std::atomic<bool> pending_any{false};

LazyImpl::~LazyImpl() {
  if (node == nullptr && out == nullptr) {
    return;
  }
  if (!Py_IsInitialized() || _Py_IsFinalizing()) {
    return;  // the interpreter is going: its objects are freed with it
  }
  if (PyGILState_Check()) {
    PyObject* n = node;
    PyObject* o = out;
    node = out = nullptr;
    release_record(n, o);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(pending_mu);
    pending->emplace_back(node, out);
  }
  node = out = nullptr;
  pending_any.store(true, std::memory_order_release);
}

void release_pending_slow() {
  std::vector<std::pair<PyObject*, PyObject*>> take;
  {
    std::lock_guard<std::mutex> lock(pending_mu);
    take.swap(*pending);
    pending_any.store(false, std::memory_order_relaxed);
  }
  for (const auto& [node, out] : take) {
    release_record(node, out);  // (may free a node, whose release may add more: the next call)
  }
}

LazyImpl* lazy_impl_of(PyObject* t) {
  // by the type alone (THPVariable_Check's isinstance would ask the object for `__class__`)
  if (THPVariableClass == nullptr ||
      !PyType_IsSubtype(Py_TYPE(t), reinterpret_cast<PyTypeObject*>(THPVariableClass))) {
    return nullptr;
  }
  const at::Tensor& v = THPVariable_Unpack(t);
  return v.defined() ? lazy_impl(v.unsafeGetTensorImpl()) : nullptr;
}

void lazy_impl_bind(LazyImpl* impl, PyObject* node, PyObject* out) {
  release_pending();
  count_holder(impl->node, impl->out, -1);
  PyObject* old_node = impl->node;
  PyObject* old_out = impl->out;
  Py_INCREF(node);
  Py_INCREF(out);
  impl->node = node;
  impl->out = out;
  count_holder(node, out, 1);
  Py_XDECREF(old_out);
  Py_XDECREF(old_node);
}

PyObject* wrapper_field(PyObject* t, int which) {
  if (LazyImpl* impl = lazy_impl_of(t)) {
    if (PyObject* v = field_ref(impl, which)) {
      Py_INCREF(v);
      return v;
    }
  }
  PyObject* d = dict_of(t);
  PyObject* v = d != nullptr && field_names[which] != nullptr
                    ? PyDict_GetItemWithError(d, field_names[which])
                    : nullptr;
  Py_XINCREF(v);
  return v;
}

PyObject* new_alive(PyObject* node, PyObject* out, bool tracked) {
  PyObject* a = nullptr;
  if (tracked) {
    a = AliveType.tp_alloc(&AliveType, 0);
  } else {
    const int before = gc_young();
    a = reinterpret_cast<PyObject*>(_PyObject_GC_New(&AliveType));
    if (a != nullptr) {
      gc_untrack_new(a, before);  // counted by its allocation, never on the lists
    }
  }
  if (a != nullptr) {
    alive_init(a, node, out);
  }
  return a;
}

bool wrapper_counts(PyObject* t, PyObject* node, Py_ssize_t out) {
  static PyObject* const alive_name = PyUnicode_InternFromString("_alive");
  const auto is_out = [out](PyObject* o) {
    return o != nullptr && PyLong_CheckExact(o) && PyLong_AsSsize_t(o) == out;
  };
  if (LazyImpl* impl = lazy_impl_of(t)) {
    if (impl->node != nullptr) {
      return impl->node == node && is_out(impl->out);
    }
  }
  PyObject* d = dict_of(t);
  PyObject* a = d != nullptr ? PyDict_GetItemWithError(d, alive_name) : nullptr;
  if (a == nullptr) {
    PyErr_Clear();
    return false;
  }
  return Py_TYPE(a) == &AliveType && reinterpret_cast<AliveObject*>(a)->node == node &&
         is_out(reinterpret_cast<AliveObject*>(a)->out);
}

void add_wrapper_functions(py::module_& m) {
  AliveType.tp_name = "genie._C.Alive";
  AliveType.tp_basicsize = sizeof(AliveObject);
  AliveType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  AliveType.tp_doc =
      "Alive(node, out): the liveness token of a LazyTensor whose record is in its instance dict "
      "(`_alive`): output `out` of `node` counts it among its live holders while it lives "
      "(csrc/wrapper.cpp).";
  AliveType.tp_dealloc = alive_dealloc;
  AliveType.tp_traverse = alive_traverse;
  AliveType.tp_clear = alive_clear;
  AliveType.tp_members = alive_members;
  AliveType.tp_alloc = PyType_GenericAlloc;
  AliveType.tp_new = alive_tp_new;
  AliveType.tp_free = PyObject_GC_Del;
  if (PyType_Ready(&AliveType) < 0) {
    throw py::error_already_set();
  }
  Py_INCREF(&AliveType);
  if (PyModule_AddObject(m.ptr(), "Alive", reinterpret_cast<PyObject*>(&AliveType)) < 0) {
    Py_DECREF(&AliveType);
    throw py::error_already_set();
  }
  m.def("_install_wrapper_fields", &install, py::arg("cls"),
        "Give `cls` (genie.lazy_tensor.LazyTensor) the `_node` and `_out` descriptors that read "
        "a wrapper's record from its impl (csrc/wrapper.cpp) or its instance dict, and the "
        "finalizer that releases an impl's record.");
  m.def("_wrapper_release", &release_pending,
        "Release the records of wrappers whose impl was destroyed without the GIL (the "
        "executor calls it before it reads which values are alive).");
  m.def(
      "_wrapper_counts",
      [](py::handle t) {
        py::object node = py::reinterpret_steal<py::object>(wrapper_field(t.ptr(), kNodeField));
        py::object out = py::reinterpret_steal<py::object>(wrapper_field(t.ptr(), kOutField));
        if (PyErr_Occurred()) {
          throw py::error_already_set();
        }
        return node && out && PyLong_CheckExact(out.ptr()) &&
               wrapper_counts(t.ptr(), node.ptr(), PyLong_AsSsize_t(out.ptr()));
      },
      py::arg("tensor"),
      "Whether the tensor is one of the live holders its node's output counts (its impl's "
      "record, or a liveness token of its record's output in its instance dict).");
  m.def(
      "_wrapper_drop_without_gil",
      [](py::handle t) {
        // Tests only: an impl holding `t`'s record destroyed with the GIL released, as an impl
        // whose wrapper went while it was shared would be; returns the records it queued.
        LazyImpl* src = lazy_impl_of(t.ptr());
        if (src == nullptr || src->node == nullptr) {
          throw py::type_error("_wrapper_drop_without_gil: a LazyTensor whose impl holds its record");
        }
        c10::intrusive_ptr<LazyImpl> impl = c10::make_intrusive<LazyImpl>(
            c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), caffe2::TypeMeta::Make<float>(),
            std::optional<c10::Device>(c10::Device(c10::DeviceType::PrivateUse1, 0)));
        lazy_impl_bind(impl.get(), src->node, src->out);  // (one more holder of the output)
        size_t before = 0;
        {
          std::lock_guard<std::mutex> lock(pending_mu);
          before = pending->size();
        }
        {
          py::gil_scoped_release no_gil;
          impl.reset();
        }
        std::lock_guard<std::mutex> lock(pending_mu);
        return pending->size() - before;
      },
      py::arg("tensor"), "Tests only: see csrc/wrapper.cpp.");
  m.def("_wrapper_in_impl", [](py::handle t) { return lazy_impl_of(t.ptr()) != nullptr; },
        py::arg("tensor"),
        "Whether the tensor's record (`_node`, `_out`) is held by its impl (a wrapper of the "
        "native record path) rather than its instance dict.");
}

} // namespace genie
