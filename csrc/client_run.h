// genie._C._client_reply: a remote client's steady run reply read natively (client_run.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

void add_client_functions(pybind11::module_& m);

}  // namespace genie
