// genie._C._lazy_walk: the lazy tensors in a module call's arguments; see walk.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

// Adds _lazy_walk to the genie._C module.
void add_walk_functions(pybind11::module_& m);

}  // namespace genie
