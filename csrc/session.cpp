// genie._C: a server session's per-request work over its resident values (genie/remote/worker.py).
//
// Every request of a replayed structure keys its inputs for the shape class
// (genie.remote.shape_class.shape_params: what a vet of the structure depended on) and, after
// the run, recounts the storages a resize_ of a resident value may have grown (the quota's
// accounting, worker.Session.refresh). A GPT-2 12x768 decode step has 173 inputs: in Python each
// cost ~10 calls and a few dict operations (keying ~140 µs with hot caches, ~300 µs between a
// step's kernels); here it is one pass over the inputs.
//
// _input_key(inputs) -> (static, ints), for each input of the dict `inputs` (slot -> tensor, in
// the dict's order):
//   static: 5 int64 words in native byte order: slot, rank, scalar type, bits (1 conj, 2 neg,
//     4 dense) and its storage's index among the distinct storages met so far (aliasing). Fixed
//     width: two inputs' bytes are equal iff their fields are.
//   ints: its sizes; unless it is dense (its storage holds exactly its elements, from offset 0,
//     contiguous, and no earlier input has that storage: its layout follows from its sizes),
//     also its strides, storage offset and storage bytes.
// A value that is not a strided tensor with a storage is a TypeError (a session holds none).
//
// _storages_held(values, storages, sign) -> int | None: the session holds each tensor among
// `values` once more (sign 1: its storage's entry counts one more, a new entry [1, bytes] for a
// storage not counted yet) or once less (-1: one less, the entry dropped at 0); returns the
// change of the bytes counted. All or nothing: None, and nothing counted, when a value is not
// a tensor with a storage (the caller refuses it by name).
//
// _storages_grown(values, storages) -> int: for each tensor among `values` whose storage (keyed
// by its StorageImpl's address, which is torch's UntypedStorage._cdata) has an entry
// [count, bytes] in the dict `storages` and now holds other than `bytes`, the entry takes the
// bytes it holds; returns the sum of the changes.
//
// _frames_of(values, names) -> (metas, buffers) | None: a reply's tensors as wire frames
// (genie.remote.protocol.tensor_frame of each, in one pass: after a replay the reply runs with
// cold caches, and tensor_frame's ~8 tensor calls cost ~110 µs there for one GPT-2 logits
// tensor): per value [names[dtype], shape, None] and a read-only buffer of its elements
// (_TensorBytes, holding the tensor). None when a value is not a contiguous CPU tensor with
// elements and without conj/neg bits, or its dtype has no name in `names` (the caller frames
// each by tensor_frame).
#include "session.h"

#include <Python.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace genie {
namespace {

[[noreturn]] void raise() {
  throw py::error_already_set();
}

const at::Tensor& strided_tensor(PyObject* v, const char* what) {
  if (!THPVariable_Check(v)) {
    throw py::type_error(std::string(what) + ": a value is a " + Py_TYPE(v)->tp_name +
                         ", not a tensor");
  }
  const at::Tensor& t = THPVariable_Unpack(v);
  if (t.layout() != c10::kStrided || !t.has_storage()) {
    throw py::type_error(std::string(what) + ": a value is not a strided tensor with a storage");
  }
  return t;
}

void put_word(std::string& out, int64_t w) {
  char b[sizeof w];
  std::memcpy(b, &w, sizeof w);
  out.append(b, sizeof w);
}

py::tuple input_key(py::handle inputs) {
  PyObject* d = inputs.ptr();
  if (!PyDict_Check(d)) {
    throw py::type_error("_input_key(inputs) takes a dict of slot -> tensor");
  }
  std::string stat;
  stat.reserve(static_cast<size_t>(PyDict_GET_SIZE(d)) * 5 * sizeof(int64_t));
  std::vector<int64_t> ints;
  ints.reserve(static_cast<size_t>(PyDict_GET_SIZE(d)) * 4);
  std::unordered_map<const void*, int64_t> storages;
  Py_ssize_t pos = 0;
  PyObject* k = nullptr;
  PyObject* v = nullptr;
  while (PyDict_Next(d, &pos, &k, &v)) {
    if (!PyLong_CheckExact(k)) {
      throw py::type_error("_input_key: a slot is not an int");
    }
    const int64_t slot = PyLong_AsLongLong(k);
    if (slot == -1 && PyErr_Occurred()) {
      raise();
    }
    const at::Tensor& t = strided_tensor(v, "_input_key");
    const c10::Storage& st = t.storage();
    const int64_t nb = static_cast<int64_t>(st.nbytes());
    const auto [at, fresh] =
        storages.try_emplace(st.unsafeGetStorageImpl(), static_cast<int64_t>(storages.size()));
    const bool dense = fresh && nb == t.numel() * static_cast<int64_t>(t.element_size()) &&
                       t.storage_offset() == 0 && t.is_contiguous();
    const c10::IntArrayRef sizes = t.sizes();
    put_word(stat, slot);
    put_word(stat, static_cast<int64_t>(sizes.size()));
    put_word(stat, static_cast<int64_t>(t.scalar_type()));
    put_word(stat, (t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0) | (dense ? 4 : 0));
    put_word(stat, at->second);
    ints.insert(ints.end(), sizes.begin(), sizes.end());
    if (!dense) {
      const c10::IntArrayRef strides = t.strides();
      ints.insert(ints.end(), strides.begin(), strides.end());
      ints.push_back(t.storage_offset());
      ints.push_back(nb);
    }
  }
  py::tuple out(static_cast<Py_ssize_t>(ints.size()));
  for (size_t i = 0; i < ints.size(); ++i) {
    PyObject* x = PyLong_FromLongLong(ints[i]);
    if (x == nullptr) {
      raise();
    }
    PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), x);
  }
  return py::make_tuple(py::bytes(stat), out);
}

py::object storage_key(const c10::Storage& st) {
  py::object key =
      py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(st.unsafeGetStorageImpl()));
  if (!key) {
    raise();
  }
  return key;
}

// An entry of the storages dict: [count, bytes].
PyObject* entry_of(PyObject* d, PyObject* key) {
  PyObject* e = PyDict_GetItemWithError(d, key);  // borrowed
  if (e == nullptr && PyErr_Occurred()) {
    raise();
  }
  if (e != nullptr && (!PyList_CheckExact(e) || PyList_GET_SIZE(e) != 2)) {
    throw py::type_error("an entry of the session's storages is not a [count, bytes] list");
  }
  return e;
}

int64_t field(PyObject* e, Py_ssize_t i) {
  const int64_t x = PyLong_AsLongLong(PyList_GET_ITEM(e, i));
  if (x == -1 && PyErr_Occurred()) {
    raise();
  }
  return x;
}

void set_field(PyObject* e, Py_ssize_t i, int64_t x) {
  PyObject* o = PyLong_FromLongLong(x);
  if (o == nullptr) {
    raise();
  }
  PyList_SetItem(e, i, o);  // steals o
}

int64_t storages_grown(py::handle values, py::handle storages) {
  PyObject* d = storages.ptr();
  if (!PyDict_Check(d)) {
    throw py::type_error("_storages_grown(values, storages) takes a dict of storages");
  }
  py::object it = py::reinterpret_steal<py::object>(PyObject_GetIter(values.ptr()));
  if (!it) {
    raise();
  }
  int64_t delta = 0;
  while (true) {
    py::object v = py::reinterpret_steal<py::object>(PyIter_Next(it.ptr()));
    if (!v) {
      if (PyErr_Occurred()) {
        raise();
      }
      return delta;
    }
    if (!THPVariable_Check(v.ptr())) {
      continue;  // (as Session.refresh: only tensors have storages)
    }
    const at::Tensor& t = THPVariable_Unpack(v.ptr());
    if (!t.has_storage()) {
      continue;
    }
    const c10::Storage& st = t.storage();
    PyObject* e = entry_of(d, storage_key(st).ptr());
    if (e == nullptr) {
      continue;
    }
    const int64_t had = field(e, 1);
    const int64_t now = static_cast<int64_t>(st.nbytes());
    if (now != had) {
      set_field(e, 1, now);
      delta += now - had;
    }
  }
}

py::object storages_held(py::handle values, py::handle storages, int sign) {
  PyObject* d = storages.ptr();
  if (!PyDict_Check(d) || (sign != 1 && sign != -1)) {
    throw py::type_error("_storages_held(values, storages, sign): a dict of storages, sign +-1");
  }
  py::list vals = py::reinterpret_steal<py::list>(PySequence_List(values.ptr()));
  if (!vals) {
    raise();
  }
  const Py_ssize_t n = PyList_GET_SIZE(vals.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {  // all or nothing: the caller says what is not a tensor
    PyObject* v = PyList_GET_ITEM(vals.ptr(), i);
    if (!THPVariable_Check(v) || !THPVariable_Unpack(v).has_storage()) {
      return py::none();
    }
  }
  int64_t delta = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const c10::Storage& st = THPVariable_Unpack(PyList_GET_ITEM(vals.ptr(), i)).storage();
    py::object key = storage_key(st);
    PyObject* e = entry_of(d, key.ptr());
    if (sign > 0) {
      if (e == nullptr) {
        const int64_t nb = static_cast<int64_t>(st.nbytes());
        py::list entry(2);
        entry[0] = py::int_(1);
        entry[1] = py::int_(nb);
        if (PyDict_SetItem(d, key.ptr(), entry.ptr()) < 0) {
          raise();
        }
        delta += nb;
      } else {
        set_field(e, 0, field(e, 0) + 1);
      }
    } else if (e != nullptr) {
      const int64_t c = field(e, 0) - 1;
      if (c == 0) {
        const int64_t nb = field(e, 1);
        if (PyDict_DelItem(d, key.ptr()) < 0) {
          raise();
        }
        delta -= nb;
      } else {
        set_field(e, 0, c);
      }
    }
  }
  return py::int_(delta);
}

// A tensor's elements as a read-only byte buffer (Python's buffer protocol) that keeps it alive.
struct TensorBytes {
  at::Tensor t;
};

py::object frames_of(py::handle values, py::handle names) {
  PyObject* nd = names.ptr();
  if (!PyDict_Check(nd)) {
    throw py::type_error("_frames_of(values, names) takes a dict of dtype -> name");
  }
  py::list vals = py::reinterpret_steal<py::list>(PySequence_List(values.ptr()));
  if (!vals) {
    raise();
  }
  const Py_ssize_t n = PyList_GET_SIZE(vals.ptr());
  py::list metas(n);
  py::list bufs(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyList_GET_ITEM(vals.ptr(), i);
    if (!THPVariable_Check(v)) {
      return py::none();
    }
    const at::Tensor& t = THPVariable_Unpack(v);
    if (t.layout() != c10::kStrided || !t.has_storage() || !t.device().is_cpu() ||
        t.numel() == 0 || t.is_conj() || t.is_neg() || !t.is_contiguous()) {
      return py::none();
    }
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
    PyObject* name = PyDict_GetItemWithError(nd, dtype);  // borrowed
    if (name == nullptr) {
      if (PyErr_Occurred()) {
        raise();
      }
      return py::none();
    }
    const c10::IntArrayRef sizes = t.sizes();
    py::list shape(sizes.size());
    for (size_t d = 0; d < sizes.size(); ++d) {
      set_field(shape.ptr(), static_cast<Py_ssize_t>(d), sizes[d]);
    }
    py::list meta(3);
    meta[0] = py::reinterpret_borrow<py::object>(name);
    meta[1] = shape;
    meta[2] = py::none();
    metas[i] = meta;
    bufs[i] = py::cast(TensorBytes{t.detach()});
  }
  return py::make_tuple(metas, bufs);
}

}  // namespace

void add_session_functions(py::module_& m) {
  m.def("_input_key", &input_key, py::arg("inputs"),
        "A tape's inputs keyed for its shape class: (static bytes, ints) (csrc/session.cpp; "
        "genie.remote.shape_class.shape_params).");
  m.def("_storages_grown", &storages_grown, py::arg("values"), py::arg("storages"),
        "Recount the storages of `values` in `storages` ({StorageImpl address: [count, bytes]}) "
        "to the bytes they hold now; returns the change (csrc/session.cpp).");
  m.def("_storages_held", &storages_held, py::arg("values"), py::arg("storages"),
        py::arg("sign"),
        "Count the storages of the tensors `values` in `storages` once more (sign 1: new "
        "entries [1, bytes]) or once less (-1: entries dropped at 0); returns the change of the "
        "bytes counted, or None (nothing changed) when a value is not a tensor with a storage "
        "(csrc/session.cpp).");
  py::class_<TensorBytes>(m, "_TensorBytes", py::buffer_protocol())
      .def_buffer([](TensorBytes& b) -> py::buffer_info {
        return py::buffer_info(b.t.data_ptr(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.t.nbytes())}, {1}, true);
      })
      .def("__len__", [](const TensorBytes& b) { return b.t.nbytes(); });
  m.def("_frames_of", &frames_of, py::arg("values"), py::arg("names"),
        "A reply's tensors as wire frames: (metas [name, shape, None], read-only buffers), or "
        "None when one is not a contiguous CPU tensor with elements, without conj/neg bits, "
        "of a dtype in `names` (csrc/session.cpp).");
}

}  // namespace genie
