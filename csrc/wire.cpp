// A remote client's encoding of a plan-cache hit (genie.remote.protocol.encode_tape, the plan's
// wire, `_PlanWire`): the entries of constants whose values are the last call's, natively.
//
// Per entry w of a plan's wire (an instruction index `at[w]` whose constants sit at some of its
// leaves), a steady step re-encodes only the entries whose source (`src[at[w]]`: the plan's
// instruction, or this step's node where it is not the plan's own, Plan.replay_source) is not the
// plan's own object (`own[w]`). Of those, most hold the values of the last call (a GPT-2 4x128
// token: ~33 of ~37, the nodes of a growing KV cache whose other constants stay): their
// constants are the last call's objects, placed into `part` as they are. That check, one Python
// iteration of ~2 µs each on the caches a client wakes to after its wait on the server, is this
// loop; what it cannot take (a first sight, constants that moved, floats compared as constants,
// an entry encoded every call) it hands back to the Python loop, which stays the reference
// (GENIE_NATIVE_WIRE=0 runs it for every entry; tests/unit/test_wire_encoding.py compares both).
//
// `seen[w]`: None (first sight), () (encoded every call) or (values at its leaves last call, their
// constants, float positions or None, changed before): an entry is taken here only when it is a
// 4-tuple whose float positions are None and whose values compare equal (Python's ==, no
// identity shortcut) to `gets[w](src[at[w]].leaves)`.
#include <Python.h>

#include <pybind11/pybind11.h>

#include "node.h"
#include "wire.h"

namespace py = pybind11;

namespace genie {
namespace {

// A recorded node's leaves for gets[w], which reads constant positions only: a list of its
// inline leaves with each lazy input's producer node in place of the Ref that `leaves` would make
// (csrc/node.h); nullptr with an error where the node ran (no leaves).
PyObject* constant_leaves(PyObject* n) {
  const Py_ssize_t k = node_n_leaves(n);
  if (k < 0) {
    PyErr_SetString(PyExc_ValueError, "genie._C._wire_same: a source node has run (no leaves)");
    return nullptr;
  }
  PyObject* r = PyList_New(k);
  if (r == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t p = 0; p < k; ++p) {
    int32_t out = -1;
    PyList_SET_ITEM(r, p, Py_NewRef(node_leaf(n, p, &out)));
  }
  return r;
}

PyObject* checked(PyObject* o) {
  if (o == nullptr) {
    throw py::error_already_set();
  }
  return o;
}

py::list wire_same(const py::list& src, const py::list& at, const py::list& own,
                   const py::list& gets, const py::list& seen, const py::list& starts,
                   const py::list& part) {
  static PyObject* const leaves_name = PyUnicode_InternFromString("leaves");
  const Py_ssize_t n = PyList_GET_SIZE(at.ptr());
  if (PyList_GET_SIZE(own.ptr()) != n || PyList_GET_SIZE(gets.ptr()) != n ||
      PyList_GET_SIZE(seen.ptr()) != n || PyList_GET_SIZE(starts.ptr()) != n) {
    throw py::value_error("genie._C._wire_same: the wire's columns differ in length");
  }
  const Py_ssize_t n_src = PyList_GET_SIZE(src.ptr());
  const Py_ssize_t n_part = PyList_GET_SIZE(part.ptr());
  py::list slow;
  for (Py_ssize_t w = 0; w < n; ++w) {
    const Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(at.ptr(), w));
    if (i == -1 && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    if (i < 0 || i >= n_src) {
      throw py::index_error("genie._C._wire_same: an entry's instruction is out of range");
    }
    PyObject* x = PyList_GET_ITEM(src.ptr(), i);
    if (x == PyList_GET_ITEM(own.ptr(), w)) {
      continue;  // the plan's own instruction: its constants are the plan's (already in part)
    }
    // (held: the calls below run Python code)
    const py::object x_ref = py::reinterpret_borrow<py::object>(x);
    const py::object last_ref = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(seen.ptr(), w));
    PyObject* last = last_ref.ptr();
    bool fast = PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == 4 &&
                PyTuple_GET_ITEM(last, 2) == Py_None &&
                PyList_CheckExact(PyTuple_GET_ITEM(last, 1));
    if (fast) {
      py::object leaves = py::reinterpret_steal<py::object>(
          is_node_type(Py_TYPE(x)) ? checked(constant_leaves(x))
                                   : checked(PyObject_GetAttr(x, leaves_name)));
      py::object now = py::reinterpret_steal<py::object>(
          checked(PyObject_CallOneArg(PyList_GET_ITEM(gets.ptr(), w), leaves.ptr())));
      py::object eq = py::reinterpret_steal<py::object>(
          checked(PyObject_RichCompare(PyTuple_GET_ITEM(last, 0), now.ptr(), Py_EQ)));
      const int same = PyObject_IsTrue(eq.ptr());
      if (same < 0) {
        throw py::error_already_set();
      }
      fast = same == 1;
    }
    if (!fast) {
      slow.append(py::int_(w));
      continue;
    }
    PyObject* vals = PyTuple_GET_ITEM(last, 1);  // this call's constants are the last call's
    const Py_ssize_t start = PyLong_AsSsize_t(PyList_GET_ITEM(starts.ptr(), w));
    if (start == -1 && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    const Py_ssize_t k = PyList_GET_SIZE(vals);
    if (start < 0 || start + k > n_part) {
      throw py::index_error("genie._C._wire_same: an entry's constants are out of range");
    }
    for (Py_ssize_t j = 0; j < k; ++j) {
      PyObject* v = PyList_GET_ITEM(vals, j);
      Py_INCREF(v);
      PyList_SetItem(part.ptr(), start + j, v);  // (steals v, drops the old item)
    }
  }
  return slow;
}

// genie.remote.protocol.const_delta: `[pos, value, ...]` for the positions where `cur` differs
// from `old` (the same object: the same; two ints: ==; else `same_const`), None when the lists
// differ in length or sending all is cheaper.
py::object const_delta(const py::list& old, const py::list& cur, const py::object& same_const) {
  const Py_ssize_t n = PyList_GET_SIZE(cur.ptr());
  if (PyList_GET_SIZE(old.ptr()) != n) {
    return py::none();
  }
  py::list d;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyList_GET_ITEM(old.ptr(), i);
    PyObject* b = PyList_GET_ITEM(cur.ptr(), i);
    if (a == b) {
      continue;
    }
    const py::object a_ref = py::reinterpret_borrow<py::object>(a);  // (same_const runs Python)
    const py::object b_ref = py::reinterpret_borrow<py::object>(b);
    int same;
    if (PyLong_CheckExact(a) && PyLong_CheckExact(b)) {
      same = PyObject_RichCompareBool(a, b, Py_EQ);
    } else {
      py::object r = py::reinterpret_steal<py::object>(
          checked(PyObject_CallFunctionObjArgs(same_const.ptr(), a, b, nullptr)));
      same = PyObject_IsTrue(r.ptr());
    }
    if (same < 0) {
      throw py::error_already_set();
    }
    if (!same) {
      d.append(py::int_(i));
      d.append(b_ref);
    }
  }
  if (PyList_GET_SIZE(d.ptr()) >= n) {
    return py::none();
  }
  return std::move(d);
}

}  // namespace

void add_wire_functions(py::module_& m) {
  m.def("_wire_same", &wire_same, py::arg("src"), py::arg("at"), py::arg("own"), py::arg("gets"),
        py::arg("seen"), py::arg("starts"), py::arg("part"),
        "genie.remote.protocol.encode_tape's loop over a plan's wire: place into `part` the "
        "constants of the entries whose values are the last call's; returns the other entries "
        "whose source is not the plan's own (for the Python loop), in order.");
  m.def("_const_delta", &const_delta, py::arg("old"), py::arg("new"), py::arg("same_const"),
        "genie.remote.protocol.const_delta: [pos, value, ...] where `new` differs from `old` "
        "(same object, ints by ==, else `same_const`), or None (lengths differ, or all is "
        "cheaper).");
}

}  // namespace genie
