// A server session's per-request work over its resident values, natively (session.cpp).
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

namespace genie {

// Adds _input_key and _storages_grown to the genie._C module (typed in genie/_C.pyi).
void add_session_functions(pybind11::module_& m);

// _input_key's pass (csrc/session.cpp) into `stat` and `ints` (both cleared first), for a
// caller in C++ (csrc/worker_replay.cpp); raises (pybind11) as _input_key does.
void input_key_into(PyObject* inputs, std::string& stat, std::vector<int64_t>& ints);

}  // namespace genie
