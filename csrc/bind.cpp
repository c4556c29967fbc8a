// Binding a run's results back to its nodes (genie.executor._bind), natively.
//
// After a tape runs, every node of its slice gets the values of its output slots that the run
// kept, is marked executed, and drops what only a pending node needs: its argument list (so the
// graph above it can be freed: memory stays flat in long loops), its consumer list and its
// entries in the pending writes of the storages it wrote. A decode step binds ~660 nodes, a
// 2,000-op chain 2,000: in Python that loop cost ~2 µs per node, here ~0.2.
//
// Semantics are those of the Python loop in genie/executor.py (kept as the reference, and used
// when a tape's slots are already built): node i takes `outs[i]`'s slots, in output order.
#include <Python.h>

#include <pybind11/pybind11.h>

#include "bind.h"

namespace py = pybind11;

namespace {

PyObject* attr(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_GetAttr(o, name);
  if (r == nullptr) {
    throw py::error_already_set();
  }
  return r;
}

void set_attr(PyObject* o, PyObject* name, PyObject* value) {
  if (PyObject_SetAttr(o, name, value) < 0) {
    throw py::error_already_set();
  }
}

}  // namespace

namespace genie {

// Returns how many pending-write entries were removed (the caller lowers
// genie.graph.pending_total by it).
int64_t bind_nodes(const py::list& nodes, const py::list& outs, const py::dict& kept,
                   int64_t prune_at, bool untrack) {
  static PyObject* const values_name = PyUnicode_InternFromString("values");
  static PyObject* const executed_name = PyUnicode_InternFromString("executed");
  static PyObject* const leaves_name = PyUnicode_InternFromString("leaves");
  static PyObject* const consumers_name = PyUnicode_InternFromString("consumers");
  static PyObject* const writes_name = PyUnicode_InternFromString("writes");
  static PyObject* const storages_name = PyUnicode_InternFromString("storages");
  static PyObject* const pending_name = PyUnicode_InternFromString("pending_writes");
  static PyObject* const readers_name = PyUnicode_InternFromString("readers");
  static PyObject* const prune_name = PyUnicode_InternFromString("prune_readers");

  const Py_ssize_t n = PyList_GET_SIZE(nodes.ptr());
  if (PyList_GET_SIZE(outs.ptr()) != n) {
    throw py::value_error("genie._C._bind_nodes: nodes and outs differ in length");
  }
  int64_t removed = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* node = PyList_GET_ITEM(nodes.ptr(), i);
    PyObject* slots = PyList_GET_ITEM(outs.ptr(), i);
    if (!PyTuple_Check(slots)) {
      throw py::type_error("genie._C._bind_nodes: output slots must be tuples");
    }
    const Py_ssize_t k = PyTuple_GET_SIZE(slots);
    py::object vals = py::reinterpret_steal<py::object>(PyList_New(k));
    if (!vals) {
      throw py::error_already_set();
    }
    for (Py_ssize_t j = 0; j < k; ++j) {
      PyObject* s = PyTuple_GET_ITEM(slots, j);
      PyObject* v = Py_None;
      if (s != Py_None) {
        v = PyDict_GetItemWithError(kept.ptr(), s);  // borrowed
        if (v == nullptr) {
          if (PyErr_Occurred()) {
            throw py::error_already_set();
          }
          v = Py_None;
        }
      }
      Py_INCREF(v);
      PyList_SET_ITEM(vals.ptr(), j, v);
    }
    py::object empty = py::reinterpret_steal<py::object>(PyList_New(0));
    if (!empty) {
      throw py::error_already_set();
    }
    if (untrack) {
      // Off the cyclic GC: a list of real tensors (or None) and an empty list of weak references
      // close no cycle. Tracked, a step's ~2 lists per node survive the young collections their
      // own allocation triggers and are promoted, which makes the interpreter run full
      // collections over the whole heap (~100 ms with torch and a model loaded) every few steps.
      PyObject_GC_UnTrack(vals.ptr());
      PyObject_GC_UnTrack(empty.ptr());
    }
    set_attr(node, values_name, vals.ptr());
    set_attr(node, executed_name, Py_True);
    set_attr(node, leaves_name, Py_None);
    set_attr(node, consumers_name, empty.ptr());

    py::object writes = py::reinterpret_steal<py::object>(attr(node, writes_name));
    if (PyTuple_Check(writes.ptr()) && PyTuple_GET_SIZE(writes.ptr()) > 0) {
      const Py_ssize_t w = PyTuple_GET_SIZE(writes.ptr());
      for (Py_ssize_t j = 0; j < w; ++j) {
        PyObject* st = PyTuple_GET_ITEM(writes.ptr(), j);
        py::object pw = py::reinterpret_steal<py::object>(attr(st, pending_name));
        if (!PyList_Check(pw.ptr())) {
          continue;
        }
        const Py_ssize_t m = PyList_GET_SIZE(pw.ptr());
        for (Py_ssize_t q = 0; q < m; ++q) {
          if (PyList_GET_ITEM(pw.ptr(), q) == node) {  // list.remove: the first, by identity
            if (PySequence_DelItem(pw.ptr(), q) < 0) {
              throw py::error_already_set();
            }
            ++removed;
            break;
          }
        }
      }
    }
    // Readers that ran are dead weight; only long lists are pruned here (short ones are left to
    // Storage.add_reader's pruning at doubling, which bounds them).
    py::object storages = py::reinterpret_steal<py::object>(attr(node, storages_name));
    if (PyList_Check(storages.ptr())) {
      const Py_ssize_t m = PyList_GET_SIZE(storages.ptr());
      for (Py_ssize_t j = 0; j < m; ++j) {
        PyObject* st = PyList_GET_ITEM(storages.ptr(), j);
        if (st == Py_None) {
          continue;
        }
        py::object readers = py::reinterpret_steal<py::object>(attr(st, readers_name));
        if (PyList_Check(readers.ptr()) && PyList_GET_SIZE(readers.ptr()) >= prune_at) {
          py::object r = py::reinterpret_steal<py::object>(
              PyObject_CallMethodNoArgs(st, prune_name));
          if (!r) {
            throw py::error_already_set();
          }
        }
      }
    }
  }
  return removed;
}

}  // namespace genie
