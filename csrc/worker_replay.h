// A session worker's steady request in one native call (worker_replay.cpp;
// genie/remote/worker.py).
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

// Adds _WorkerLane and _ShapeAdmit to the genie._C module (typed in genie/_C.pyi).
void add_worker_replay_functions(pybind11::module_& m);

}  // namespace genie
