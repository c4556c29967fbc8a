// Composite ops recorded whole when autograd does not need their decomposition; see whole.cpp.
#pragma once

#include <string>
#include <vector>

#include <pybind11/pybind11.h>

namespace genie {

// The operators (qualified names, default overloads) whole.cpp keeps whole.
const std::vector<std::string>& whole_ops();

// Adds _whole_ops and _whole_ops_enable to the genie._C module.
void add_whole_functions(pybind11::module_& m);

}  // namespace genie
