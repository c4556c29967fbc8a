// genie._C._lazy_walk: the lazy tensors in an outermost module call's arguments, natively.
//
// genie.context._begin walks every outermost module call's arguments (args and kwargs) for
// tensors an earlier call of the same module recorded: a decode step's KV cache, which makes the
// call a decode and the tensors' role ``kv_cache``. transformers' generate calls the model once a
// token with keyword arguments and a cache object (DynamicCache: its layers' keys and values, ~25
// objects to visit), and the walk in Python cost ~13 µs of the ~45 µs a token spent entering and
// leaving that call (GPT-2 4x128 greedy generate, thread CPU, a loaded 2-core machine); here it
// is ~1 µs.
//
// The walk is genie.context._lazy_tensors' (its reference and documentation), step for step, in
// the same order: a stack of (object, depth); what to do with an object is looked up by its type
// in the same dict (``kinds``, filled by ``kind`` for a type not seen yet, bounded as there), and
// an object whose ``__class__`` is not its type is classified each time; lists and tuples (and
// their subclasses, iterated as Python iterates them), dicts (``values()``; exact dicts read
// directly), and the ``__dict__`` of other objects, to depth 6, each container once (by
// identity); values whose type is in ``atoms`` are not pushed. A tensor with a recorded node (its
// ``_node`` not None) is found. Every object visited is held until the walk ends (a property or
// ``values()`` may return fresh ones), so no identity is reused while it runs.
#include <unordered_set>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

#include "walk.h"

namespace py = pybind11;

namespace {

// genie.context's kinds (_TENSOR, _SKIP, _SEQ, _DICT, _OBJ)
enum Kind : long { kTensor = 0, kSkip = 1, kSeq = 2, kDict = 3, kObj = 4 };
constexpr int kMaxDepth = 6;
constexpr Py_ssize_t kMaxKinds = 4096;

PyObject* str_class = nullptr;
PyObject* str_node = nullptr;
PyObject* str_dict = nullptr;
PyObject* str_values = nullptr;

py::object steal(PyObject* o) {
  if (o == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(o);
}

long kind_of(PyObject* x, PyObject* kinds, PyObject* kind_fn) {
  PyObject* t = reinterpret_cast<PyObject*>(Py_TYPE(x));
  py::object cls = steal(PyObject_GetAttr(x, str_class));
  PyObject* k = PyDict_GetItemWithError(kinds, t);  // borrowed
  if (k == nullptr && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  py::object fresh;
  if (k == nullptr || cls.ptr() != t) {
    fresh = steal(PyObject_CallOneArg(kind_fn, x));
    if (cls.ptr() == t && PyDict_GET_SIZE(kinds) < kMaxKinds &&
        PyDict_SetItem(kinds, t, fresh.ptr()) < 0) {
      throw py::error_already_set();
    }
    k = fresh.ptr();
  }
  const long v = PyLong_AsLong(k);
  if (v == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return v;
}

PyObject* lazy_walk(PyObject* obj, PyObject* kinds, PyObject* kind_fn, PyObject* atoms) {
  if (!PyDict_CheckExact(kinds) || !PyAnySet_Check(atoms)) {
    PyErr_SetString(PyExc_TypeError, "_lazy_walk: kinds must be a dict and atoms a set");
    return nullptr;
  }
  try {
    py::list found;
    std::vector<py::object> held;  // every object visited, alive until the walk ends
    std::vector<std::pair<PyObject*, int>> todo{{obj, 0}};  // borrowed from `held` or `obj`
    std::unordered_set<PyObject*> seen;
    auto push = [&](PyObject* v, int depth) {
      const int atom = PySet_Contains(atoms, reinterpret_cast<PyObject*>(Py_TYPE(v)));
      if (atom < 0) {
        throw py::error_already_set();
      }
      if (!atom) {
        held.push_back(py::reinterpret_borrow<py::object>(v));
        todo.emplace_back(v, depth);
      }
    };
    auto push_iter = [&](PyObject* it_of, int depth) {
      py::object it = steal(PyObject_GetIter(it_of));
      while (PyObject* v = PyIter_Next(it.ptr())) {
        py::object hold = py::reinterpret_steal<py::object>(v);
        push(v, depth);
      }
      if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
    };
    while (!todo.empty()) {
      auto [x, depth] = todo.back();
      todo.pop_back();
      const long k = kind_of(x, kinds, kind_fn);
      if (k == kTensor) {
        PyObject* node = nullptr;
        if (_PyObject_LookupAttr(x, str_node, &node) < 0) {
          throw py::error_already_set();
        }
        if (node != nullptr) {
          const bool lazy = node != Py_None;
          Py_DECREF(node);
          if (lazy && PyList_Append(found.ptr(), x) < 0) {
            throw py::error_already_set();
          }
        }
        continue;
      }
      if (depth > kMaxDepth || k == kSkip || !seen.insert(x).second) {
        continue;
      }
      const int next = depth + 1;
      if (k == kSeq) {
        if (PyList_CheckExact(x)) {  // (push runs no Python code: the list stays as it is)
          for (Py_ssize_t i = 0; i < PyList_GET_SIZE(x); ++i) {
            push(PyList_GET_ITEM(x, i), next);
          }
        } else if (PyTuple_CheckExact(x)) {
          for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(x); ++i) {
            push(PyTuple_GET_ITEM(x, i), next);
          }
        } else {
          push_iter(x, next);
        }
      } else if (k == kDict) {
        if (PyDict_CheckExact(x)) {
          Py_ssize_t pos = 0;
          PyObject* key;
          PyObject* v;
          while (PyDict_Next(x, &pos, &key, &v)) {
            push(v, next);
          }
        } else {
          py::object vals = steal(PyObject_CallMethodNoArgs(x, str_values));
          push_iter(vals.ptr(), next);
        }
      } else {
        PyObject* d = nullptr;
        if (_PyObject_LookupAttr(x, str_dict, &d) < 0) {
          throw py::error_already_set();
        }
        if (d == nullptr) {
          continue;
        }
        py::object dict = py::reinterpret_steal<py::object>(d);
        if (PyDict_CheckExact(d)) {
          Py_ssize_t pos = 0;
          PyObject* key;
          PyObject* v;
          while (PyDict_Next(d, &pos, &key, &v)) {
            push(v, next);
          }
        } else if (PyDict_Check(d)) {
          py::object vals = steal(PyObject_CallMethodNoArgs(d, str_values));
          push_iter(vals.ptr(), next);
        }
      }
    }
    return found.release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  }
}

}  // namespace

namespace genie {

void add_walk_functions(py::module_& m) {
  str_class = PyUnicode_InternFromString("__class__");
  str_node = PyUnicode_InternFromString("_node");
  str_dict = PyUnicode_InternFromString("__dict__");
  str_values = PyUnicode_InternFromString("values");
  m.def(
      "_lazy_walk",
      [](py::handle obj, py::handle kinds, py::handle kind, py::handle atoms) {
        PyObject* r = lazy_walk(obj.ptr(), kinds.ptr(), kind.ptr(), atoms.ptr());
        if (r == nullptr) {
          throw py::error_already_set();
        }
        return py::reinterpret_steal<py::list>(r);
      },
      py::arg("obj"), py::arg("kinds"), py::arg("kind"), py::arg("atoms"),
      "genie.context._lazy_tensors, natively (csrc/walk.cpp): the tensors with a recorded node "
      "in obj's containers and objects, a few levels deep.");
}

}  // namespace genie
