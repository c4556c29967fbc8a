// The native recording fast path (LazyTensor.__torch_dispatch__); see record.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include <pybind11/pybind11.h>

namespace c10 {
struct IValue;
}

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

// How the Python-key kernel converts an argument (parseIValuesToPyArgsKwargs): by its schema
// type for the enums stored as ints, else by the value.
constexpr uint8_t kStackValue = 0, kStackDtype = 1, kStackLayout = 2, kStackMemoryFormat = 3;

// record_call(func, args, kwargs) for the args tuple and kwargs dict the Python-key kernel would
// make from `values` (its first `positional` IValues; the keyword-only ones at the schema
// positions `kw`, `n_kw` of them, in the order of their interned names `kw_names`, as flatten
// sorts a dict's keys; `kinds` by schema position), recorded from the IValues directly where
// that is the call of a learned entry (record.cpp's record_stack): a new reference, nullptr with
// a Python error set, or kStackDeclined where the caller must take record_call with the Python
// arguments (nothing done). `check_args`/`check_kwargs`: those Python arguments, to check the key
// and leaves against flatten()'s (stack_record_check), or nullptr. Needs the GIL.
extern PyObject* const kStackDeclined;
PyObject* record_stack(PyObject* func, const c10::IValue* values, size_t positional,
                       const size_t* kw, size_t n_kw, PyObject* const* kw_names,
                       const uint8_t* kinds, PyObject* check_args, PyObject* check_kwargs);
// Counts a call the kernel declined before record_stack (`why`: a keyword-only argument).
void stack_record_declined(PyObject* func, const char* why);
// Whether record_stack may take calls (config.stack_record, the record path initialized), and
// whether each is checked against flatten() (config.stack_record_check).
bool stack_record_on();
bool stack_record_check();

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
