// genie._C._read: the steady embedded read in one native call (csrc/read.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

void add_read_functions(pybind11::module_& m);

// .item() or .cpu() of a pending LazyTensor on the steady embedded path (read.cpp's
// read_op_steady), for the record path (record.cpp's try_record): the Python number or the host
// tensor (a new reference), or nullptr without
// an error where it does not apply (nothing done: the record path goes on); raises
// (py::error_already_set) as the read would.
PyObject* read_op_steady(PyObject* func, PyObject* args, PyObject* kwargs);

// Whether `func` is one of read_op_steady's ops (.item()'s, .cpu()'s _to_copy): the record path
// from the IValue stack (record.cpp's record_stack) leaves those to try_record.
bool read_op_is(PyObject* func);

}  // namespace genie
