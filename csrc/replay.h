// Native replay of a repeated plan's tape (replay.cpp; genie/backends/native_replay.py).
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

// Adds the _ReplayProgram class to the genie._C module.
void add_replay_functions(pybind11::module_& m);

} // namespace genie
