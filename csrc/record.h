// The native recording fast path (LazyTensor.__torch_dispatch__); see record.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

// Adds _record_dispatch, _record_init, _record_clear, _record_stats and _record_reset_stats
// to the genie._C module.
void add_record_functions(pybind11::module_& m);

} // namespace genie
