// Native replay of a repeated plan's tape (replay.cpp; genie/backends/native_replay.py).
#pragma once

#include <cstdint>

#include <pybind11/pybind11.h>

namespace genie {

// Adds the _ReplayProgram class to the genie._C module.
void add_replay_functions(pybind11::module_& m);

// A _ReplayProgram's run (csrc/replay.cpp: Program::run without an index check), for a caller in
// C++ (csrc/worker_replay.cpp): {slot: value} of the kept slots, or (instruction, exception, live
// values) when one failed. TypeError (pybind11) when `program` is not a _ReplayProgram.
pybind11::object run_program(pybind11::handle program, const pybind11::dict& inputs,
                             const pybind11::list& instrs, const pybind11::list& devices,
                             int64_t split, const pybind11::object& early);

} // namespace genie
