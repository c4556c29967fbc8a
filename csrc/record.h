// The native recording fast path (LazyTensor.__torch_dispatch__); see record.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

// Adds _record_dispatch, _record_init, _record_clear, _record_stats and _record_reset_stats
// to the genie._C module.
void add_record_functions(pybind11::module_& m);

// What LazyTensor.__torch_dispatch__ (_record_dispatch) does for func(*args, **kwargs): the
// native record, or lazy_tensor._dispatch. A new reference, or nullptr with a Python error set.
// Needs the GIL and the record path initialized (_record_init).
PyObject* record_call(PyObject* func, PyObject* args, PyObject* kwargs);

// What a PrivateUse1 factory kernel does for func(*args, **kwargs) (_record_factory): the native
// record, or lazy_tensor.record_factory. A new reference, or nullptr with a Python error set.
PyObject* record_factory_call(PyObject* func, PyObject* args, PyObject* kwargs);

// genie.lazy_tensor.LazyTensor once _record_init has run, else nullptr.
PyTypeObject* lazy_type();

// A read starts (executor.run_targets): what is sent ahead counts from here (_record_ahead_reset).
void record_ahead_restart();

// aten.detach.default (borrowed) once _record_init has run, else nullptr.
PyObject* detach_op();

// Whether a torch dispatch rule may be registered for (func, LazyTensor), `qualname` being
// func.__qualname__ (its key in torch's registry): 1 (or when Genie's native rule lookup is not
// installed), 0 when none is, -1 with a Python error set.
int dispatch_rule_may_apply(PyObject* func, PyObject* qualname);

// Adds _python_key_install, _python_key_enable and _python_key_stats (csrc/python_key.cpp).
void add_python_key_functions(pybind11::module_& m);

} // namespace genie
