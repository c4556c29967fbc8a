// The record positions of the default graph's nodes (genie.graph.Node.seq, N of a uid "op*N"),
// kept as runs of consecutive node indices instead of an int per node; see seq.cpp.
#pragma once

#include <cstdint>

#include <pybind11/pybind11.h>

namespace genie {

// Note a node recorded in the default graph with process-wide index `index`: -1 when its
// position follows from `index` (default_seq_of), else the position to store on the node (an
// index below one noted before: another thread's record came first).
int64_t default_seq_note(int64_t index);

// The position of the default-graph node with index `index` whose note returned -1.
int64_t default_seq_of(int64_t index);

// Adds _default_seq_note, _default_seq_of and _default_seq_len to the genie._C module.
void add_seq_functions(pybind11::module_& m);

}  // namespace genie
