// The record positions of the default graph's nodes (genie.graph.Node.seq: N of the node's uid
// "op*N", its position among the nodes recorded in its graph).
//
// Every node takes the next process-wide index (genie.graph._record_counter) when it is made, so
// within a run of consecutive indices recorded in the default graph, a node's position is its
// index minus the run's base. The runs start only where another graph (genie.capture) recorded in
// between, or an index was taken without a node: the default graph keeps one (first index,
// position) pair per run instead of an int per node (a pymalloc block each: indices and
// positions pass the small-int cache after 256 nodes). A note whose index is below the end of
// the last run (two threads recording at once, the later index noted first) gets its position as
// a number to store on the node (genie.graph.Node._seq), so the runs stay ascending.
#include "seq.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace genie {
namespace {

struct DefaultSeq {
  int64_t total = 0;  // nodes noted (len(DEFAULT_GRAPH))
  int64_t next = -1;  // the index that continues the last run
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first index, its position), ascending
};

DefaultSeq seq;

}  // namespace

int64_t default_seq_note(int64_t index) {
  const int64_t at = seq.total++;
  if (index == seq.next) {
    ++seq.next;
    return -1;
  }
  if (index < seq.next) {
    return at;  // out of order: stored on the node
  }
  seq.runs.emplace_back(index, at);
  seq.next = index + 1;
  return -1;
}

int64_t default_seq_of(int64_t index) {
  auto it = std::upper_bound(seq.runs.begin(), seq.runs.end(), index,
                             [](int64_t i, const std::pair<int64_t, int64_t>& r) {
                               return i < r.first;
                             });
  if (it == seq.runs.begin() || index >= seq.next) {
    return -1;  // not an index a note derived
  }
  --it;
  return it->second + (index - it->first);
}

void add_seq_functions(pybind11::module_& m) {
  m.def("_default_seq_note",
        [](int64_t index) -> pybind11::object {
          const int64_t at = default_seq_note(index);
          if (at < 0) {
            return pybind11::none();
          }
          return pybind11::int_(at);
        },
        pybind11::arg("index"),
        "Note a node recorded in the default graph with this index: None where its position "
        "follows from the index (_default_seq_of), else the position to store on the node.");
  m.def("_default_seq_of", &default_seq_of, pybind11::arg("index"),
        "The position in the default graph of the node with this index (noted, None returned).");
  m.def("_default_seq_len", [] { return seq.total; },
        "How many nodes were recorded in the default graph (len(genie.graph.DEFAULT_GRAPH)).");
}

}  // namespace genie
