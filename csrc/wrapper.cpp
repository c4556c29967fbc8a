// genie._C: a LazyTensor's record in its TensorImpl (csrc/wrapper.h).
//
// Before, every recorded output's wrapper got an instance dict with three items (`_node`, `_out`,
// `_alive`): the dict and its keys object made, three inserts, and the same freed when the
// wrapper died, ~2k of the ~20k instructions an op costs Genie, plus a dict lookup per LazyTensor
// argument of every later op. The native record path now makes the wrapper's impl a LazyImpl and
// stores the three references there; `LazyTensor._node`, `._out` and `._alive` are data
// descriptors (installed on the class by `_install_wrapper_fields`) that read the impl, or the
// instance dict of a wrapper made by the Python path, so every reader (Python's attribute access,
// csrc's lazy_attr) sees one record whichever path made it.
//
// Lifetime: the fields are released when the wrapper's Python object goes (torch keeps a tensor
// subclass's Python object alive while C++ shares its impl), as the instance dict's items were:
// by LazyTensor's finalizer, with the GIL, just before torch drops the impl (lazy_finalize).
// Where the impl is destroyed some other way (still shared when its wrapper went), its
// destructor releases them, or, on a thread without the GIL, queues them for the next thread
// that holds it (release_pending: before every read and every wrapper bound); during interpreter
// finalization it leaves them (the process is ending).
#include "wrapper.h"

#include <atomic>
#include <mutex>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace genie {

// LazyImpl's vtable pointer, read by _install_wrapper_fields from one made for the purpose
// (lazy_impl; until then no impl is a LazyImpl, and none is made before: genie installs first).
const void* lazy_impl_vtable = nullptr;

namespace {

PyObject* field_names[3] = {nullptr, nullptr, nullptr};

PyObject*& field_ref(LazyImpl* impl, int which) {
  return which == kNodeField ? impl->node : which == kOutField ? impl->out : impl->alive;
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
    Py_XINCREF(value);
    Py_XSETREF(f, value);
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

PyGetSetDef field_defs[3] = {
    {"_node", get_field, set_field,
     "The genie.graph.Node whose output this tensor is (held by the tensor's impl).",
     reinterpret_cast<void*>(static_cast<intptr_t>(kNodeField))},
    {"_out", get_field, set_field, "Which output of `_node` this tensor is.",
     reinterpret_cast<void*>(static_cast<intptr_t>(kOutField))},
    {"_alive", get_field, set_field,
     "The liveness token the node's outputs refer to weakly (genie.graph.Alive).",
     reinterpret_cast<void*>(static_cast<intptr_t>(kAliveField))},
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
  PyObject* alive = impl->alive;
  impl->node = impl->out = impl->alive = nullptr;
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  const bool error = PyErr_Occurred() != nullptr;  // a finalizer keeps the error state as it was
  if (error) {
    PyErr_Fetch(&type, &value, &tb);
  }
  Py_XDECREF(node);
  Py_XDECREF(out);
  Py_XDECREF(alive);
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
  for (int i = 0; i < 3; ++i) {
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

// References whose impl was destroyed without the GIL, released by the next thread that holds it
// (release_pending). torch releases the GIL while a wrapper's dealloc drops its impl, so this is
// the common case: taking the GIL back there cost ~500 instructions an op (take_gil, its mutex
// and condition variable), more than the instance dict this file replaces.
std::mutex pending_mu;
std::vector<PyObject*>* pending = new std::vector<PyObject*>();  // never destroyed (exit order)
std::atomic<bool> pending_any{false};

LazyImpl::~LazyImpl() {
  if (node == nullptr && out == nullptr && alive == nullptr) {
    return;
  }
  if (!Py_IsInitialized() || _Py_IsFinalizing()) {
    return;  // the interpreter is going: its objects are freed with it
  }
  if (PyGILState_Check()) {
    Py_CLEAR(node);
    Py_CLEAR(out);
    Py_CLEAR(alive);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(pending_mu);
    for (PyObject* o : {node, out, alive}) {
      if (o != nullptr) {
        pending->push_back(o);
      }
    }
  }
  pending_any.store(true, std::memory_order_release);
}

void release_pending_slow() {
  std::vector<PyObject*> take;
  {
    std::lock_guard<std::mutex> lock(pending_mu);
    take.swap(*pending);
    pending_any.store(false, std::memory_order_relaxed);
  }
  for (PyObject* o : take) {
    Py_DECREF(o);  // (may free a node, whose release may add more: the next call takes them)
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

void lazy_impl_bind(LazyImpl* impl, PyObject* node, PyObject* out, PyObject* alive) {
  release_pending();
  Py_INCREF(node);
  Py_INCREF(out);
  Py_INCREF(alive);
  Py_XSETREF(impl->node, node);
  Py_XSETREF(impl->out, out);
  Py_XSETREF(impl->alive, alive);
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

void add_wrapper_functions(py::module_& m) {
  m.def("_install_wrapper_fields", &install, py::arg("cls"),
        "Give `cls` (genie.lazy_tensor.LazyTensor) the `_node`, `_out` and `_alive` descriptors "
        "that read a wrapper's record from its impl (csrc/wrapper.cpp) or its instance dict.");
  m.def("_wrapper_release", &release_pending,
        "Release the records of wrappers whose impl was destroyed without the GIL (the "
        "executor calls it before it reads which values are alive).");
  m.def(
      "_wrapper_drop_without_gil",
      [](py::handle t) {
        // Tests only: an impl holding `t`'s record destroyed with the GIL released, as an impl
        // whose wrapper went while it was shared would be; returns the references it queued.
        LazyImpl* src = lazy_impl_of(t.ptr());
        if (src == nullptr || src->node == nullptr) {
          throw py::type_error("_wrapper_drop_without_gil: a LazyTensor whose impl holds its record");
        }
        c10::intrusive_ptr<LazyImpl> impl = c10::make_intrusive<LazyImpl>(
            c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), caffe2::TypeMeta::Make<float>(),
            std::optional<c10::Device>(c10::Device(c10::DeviceType::PrivateUse1, 0)));
        Py_INCREF(src->node);
        Py_INCREF(src->out);
        Py_INCREF(src->alive);
        impl->node = src->node;
        impl->out = src->out;
        impl->alive = src->alive;
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
        "Whether the tensor's record (`_node`, `_out`, `_alive`) is held by its impl (a wrapper "
        "of the native record path) rather than its instance dict.");
}

} // namespace genie
