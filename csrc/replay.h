// Native replay of a repeated plan's tape (replay.cpp; genie/backends/native_replay.py).
#pragma once

#include <cstdint>

#include <pybind11/pybind11.h>

namespace genie {

// Adds the _ReplayProgram class to the genie._C module.
void add_replay_functions(pybind11::module_& m);
// genie._C._hit_run with the program as a Python object (genie._C._ReplayProgram): csrc/read.cpp
pybind11::object hit_run_object(const pybind11::handle& program, const pybind11::dict& inputs,
                                const pybind11::object& consts, const pybind11::list& tmpl,
                                const pybind11::object& at, const pybind11::list& found,
                                const pybind11::list& stale, const pybind11::list& devices,
                                const pybind11::list& outs, int64_t prune_at, bool untrack,
                                int64_t hold, const pybind11::list& want);

// A _ReplayProgram's run (csrc/replay.cpp: Program::run without an index check), for a caller in
// C++ (csrc/worker_replay.cpp): {slot: value} of the kept slots, or (instruction, exception, live
// values) when one failed. TypeError (pybind11) when `program` is not a _ReplayProgram.
pybind11::object run_program(pybind11::handle program, const pybind11::dict& inputs,
                             const pybind11::list& instrs, const pybind11::list& devices,
                             int64_t split, const pybind11::object& early);

} // namespace genie
