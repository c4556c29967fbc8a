// A server session's per-request work over its resident values, natively (session.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

// Adds _input_key and _storages_grown to the genie._C module (typed in genie/_C.pyi).
void add_session_functions(pybind11::module_& m);

}  // namespace genie
