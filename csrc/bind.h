// genie._C._bind_nodes: a run's results bound back to its nodes (bind.cpp).
#pragma once

#include <cstdint>

#include <pybind11/pybind11.h>

namespace genie {

int64_t bind_nodes(const pybind11::list& nodes, const pybind11::list& outs,
                   const pybind11::dict& kept, int64_t prune_at, bool untrack, bool release = false);

}  // namespace genie
