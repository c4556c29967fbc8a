// genie._C._bind_nodes: a run's results bound back to its nodes; genie._C._step_targets: a
// training step's extra targets (bind.cpp).
#pragma once

#include <cstdint>

#include <pybind11/pybind11.h>

namespace genie {

int64_t bind_nodes(const pybind11::list& nodes, const pybind11::list& outs,
                   const pybind11::dict& kept, int64_t prune_at, bool untrack, bool release = false);

pybind11::list step_targets(const pybind11::list& targets, const pybind11::list& opts,
                            int64_t index);

}  // namespace genie
