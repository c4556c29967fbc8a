// genie._C._read: the steady embedded read in one native call (csrc/read.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

void add_read_functions(pybind11::module_& m);

}  // namespace genie
