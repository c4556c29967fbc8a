// The plan cache's slow path natively: genie.planner.slice_nodes and genie.plan_cache.instantiate
// (slice.cpp).
#pragma once

#include <vector>

#include <pybind11/pybind11.h>

namespace genie {

// Adds _slice_init, _slice_nodes, _instantiate and _rebuild_instrs to the genie._C module.
void add_slice_functions(pybind11::module_& m);
// genie._C._inputs_differ (csrc/read.cpp calls it)
pybind11::object inputs_differ(const pybind11::dict& inputs, const pybind11::dict& pin);

// TensorMeta == TensorMeta (its dataclass __eq__) and genie.plan_cache.same_kind, natively, for
// the other native paths (match.cpp): 1 or 0; -1 when either is not exactly a TensorMeta or the
// classes are not known yet (the caller asks Python). A Python error propagates.
int tensor_meta_eq(PyObject* a, PyObject* b);
// genie.graph.same_const natively (floats by bits: -0.0 is not 0.0, NaN is NaN).
bool constants_same(PyObject* a, PyObject* b);
int tensor_meta_same_kind(PyObject* a, PyObject* b);
// genie.planner.held_after natively for the column match (match.cpp), the run given as its node
// indices in increasing order (the found nodes' record order): 1 or 0; -1 when an object is not
// of the type the native slice reads (the caller asks Python). A Python error propagates.
int held_after_sorted(PyObject* n, Py_ssize_t k, const std::vector<Py_ssize_t>& run,
                      Py_ssize_t inside);

}  // namespace genie
