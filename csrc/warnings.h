// Running a Python callable with some of PyTorch's C++ warnings dropped; see warnings.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

// Adds _without_warning to the genie._C module.
void add_warning_functions(pybind11::module_& m);

}  // namespace genie
