// genie._C._wire_same: a plan-cache hit's wire constants that are the last call's, found and
// placed natively (genie.remote.protocol.encode_tape); genie._C._const_delta: a request's
// constants against the ones its server holds (wire.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

void add_wire_functions(pybind11::module_& m);

}  // namespace genie
