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

// _drop_handles, _put_handles, _storages_grown and _send_reply (csrc/session.cpp's head), for a
// caller in C++ (a lane's whole steady request, csrc/worker_replay.cpp's Lane::serve).
int64_t session_drop_handles(pybind11::handle store, pybind11::handle storages,
                             pybind11::handle roles, pybind11::handle used_at,
                             pybind11::handle ids);
pybind11::object session_put_handles(pybind11::handle store, pybind11::handle storages,
                                     pybind11::handle used_at, pybind11::handle ids,
                                     pybind11::handle values, pybind11::handle tick,
                                     int64_t max_handles);
int64_t session_storages_grown(pybind11::handle values, pybind11::handle storages);
pybind11::object session_send_reply(int fd, pybind11::handle used, pybind11::handle res,
                                    pybind11::handle pb, pybind11::handle rid,
                                    pybind11::handle st, pybind11::handle vt,
                                    pybind11::handle values, pybind11::handle names);

}  // namespace genie
