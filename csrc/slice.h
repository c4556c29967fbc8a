// The plan cache's slow path natively: genie.planner.slice_nodes and genie.plan_cache.instantiate
// (slice.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

// Adds _slice_init, _slice_nodes and _instantiate to the genie._C module.
void add_slice_functions(pybind11::module_& m);

}  // namespace genie
