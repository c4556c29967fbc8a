// The __slots__ fields of Genie's Python classes (Node, Ref, Storage, TensorMeta, Instr, ...),
// read and written from C++ by offset: record.cpp, slice.cpp and match.cpp find each offset once,
// from the class's member descriptor, and check the field is an object slot.
#pragma once

#include <Python.h>
#include <structmember.h>

#include <stdexcept>
#include <string>

namespace genie {

// The offset of slot `name` of the slotted class `t` (or of a member of a native base, as
// genie._C.Node's fields are genie.graph.Node's: found along the MRO); std::runtime_error if it is
// not one.
inline Py_ssize_t slot_offset(PyTypeObject* t, const char* name) {
  PyObject* d = nullptr;  // borrowed
  PyObject* mro = t->tp_mro;
  const Py_ssize_t n = mro != nullptr && PyTuple_Check(mro) ? PyTuple_GET_SIZE(mro) : 0;
  for (Py_ssize_t i = 0; i < n && d == nullptr; ++i) {
    d = PyDict_GetItemString(reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(mro, i))->tp_dict,
                             name);
  }
  if (n == 0) {
    d = PyDict_GetItemString(t->tp_dict, name);
  }
  if (d == nullptr || Py_TYPE(d) != &PyMemberDescr_Type) {
    throw std::runtime_error(std::string(t->tp_name) + "." + name + " is not a slot");
  }
  PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
  if (m->type != T_OBJECT_EX) {
    throw std::runtime_error(std::string(t->tp_name) + "." + name + " is not an object slot");
  }
  return m->offset;
}

// The value of the slot at `off` of `o`: borrowed, nullptr when unset.
inline PyObject* slot_value(PyObject* o, Py_ssize_t off) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
}

// Output `k`'s item of genie.graph.Node's per-output fields `_st` (storages) and `_out`
// (liveness): a single-output node holds the item itself, never a list; a node with another
// number of outputs a list. Borrowed; nullptr when `k` is out of range.
inline PyObject* per_output(PyObject* v, Py_ssize_t k) {
  if (PyList_CheckExact(v)) {
    return k >= 0 && k < PyList_GET_SIZE(v) ? PyList_GET_ITEM(v, k) : nullptr;
  }
  return k == 0 ? v : nullptr;
}

// How many items `v` (a per-output field, as above) holds.
inline Py_ssize_t per_output_count(PyObject* v) {
  return PyList_CheckExact(v) ? PyList_GET_SIZE(v) : 1;
}

}  // namespace genie
