// genie._C.Node: the recorded node's fields as a native struct (docs/node-layout.md, step 4).
// genie.graph.Node is a Python subclass of it with no fields of its own (its methods and
// properties); the natives read and write the object fields below through the member table's
// offsets (slots.h slot_offset), which are the struct's, and the arguments through the inline
// accessors here.
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>

#include <cstdint>

namespace genie {

// One recorded op. Every object field is a reference, NULL until set (reading an unset one from
// Python raises AttributeError, as an unset slot did); the names are genie.graph.Node's.
//
// The arguments (step 4b) are inline, after the struct: a var-sized object whose `cap` items
// are the leaves, followed by `cap` 32-bit output numbers. A lazy input is its producer node
// (a strong reference) with the output number it reads; any other leaf (a constant, a MetaArg,
// a host tensor) is the object with output number -1. There is no Ref and no argument list: the
// Python property `leaves` materializes a list of fresh Refs on each read.
struct NodeObject {
  PyObject_VAR_HEAD  // ob_size: the items allocated after the struct (leaves and output numbers)
  PyObject* op;
  PyObject* spec;
  PyObject* metas;
  PyObject* out_spec;
  PyObject* st;  // "_st": a single output's Storage, else a list (slots.h per_output)
  PyObject* writes;
  PyObject* out;  // "_out": a single output's liveness (out_count_add), else a list
  PyObject* values;
  PyObject* executed;
  PyObject* index;
  PyObject* rng;
  PyObject* graph;
  PyObject* seq;  // "_seq"
  PyObject* where;
  PyObject* n_consumers;
  PyObject* tags;
  PyObject* entry;
  PyObject* ctx;
  PyObject* wref;  // "_wref": the node's own weak reference (reader lists hold it)
  PyObject* weaklist;
  int32_t n_leaves;  // the arguments set; kLeavesReleased (leaves None), kLeavesUnset
  int32_t cap;       // room for this many leaves after the struct
};

constexpr int32_t kLeavesReleased = -1;  // `leaves` is None: the node ran (graph truncation)
constexpr int32_t kLeavesUnset = -2;     // never set (a node made by __new__ alone)

// The type genie._C.Node (a static type: its deallocator never changes).
extern PyTypeObject NodeType;

// Whether `t` is genie._C.Node or a subclass that adds no field (genie.graph.Node).
bool is_node_type(PyTypeObject* t);

// The leaf array of node `n` (its `cap` items), and the output number of each.
inline PyObject** node_leaf_array(PyObject* n) {
  return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(n) + sizeof(NodeObject));
}
inline int32_t* node_out_array(PyObject* n) {
  return reinterpret_cast<int32_t*>(node_leaf_array(n) +
                                    reinterpret_cast<NodeObject*>(n)->cap);
}

// How many leaves node `n` holds: -1 when released (or never set).
inline Py_ssize_t node_n_leaves(PyObject* n) {
  const int32_t k = reinterpret_cast<NodeObject*>(n)->n_leaves;
  return k >= 0 ? k : -1;
}

// Leaf `p` of node `n`, borrowed: the producer node of a lazy input (`*out` its output number),
// or the constant (`*out` -1). nullptr when `p` is out of range or the leaves were released.
inline PyObject* node_leaf(PyObject* n, Py_ssize_t p, int32_t* out) {
  if (p < 0 || p >= reinterpret_cast<NodeObject*>(n)->n_leaves) {
    return nullptr;
  }
  *out = node_out_array(n)[p];
  return node_leaf_array(n)[p];
}

// A new node of type `t` (genie._C.Node or genie.graph.Node) with room for `n` leaves, none set
// (n_leaves is `n`; the caller sets each with node_init_leaf). Every object field is NULL.
// `tracked` false: never put on the GC's lists, and off the young count (as record.cpp's
// new_object).
PyObject* node_new_sized(PyTypeObject* t, Py_ssize_t n, bool tracked);

// Sets leaf `p` (< n_leaves) of a node from node_new_sized: steals `x`; `out` -1 for a constant.
inline void node_init_leaf(PyObject* n, Py_ssize_t p, PyObject* x, int32_t out) {
  node_leaf_array(n)[p] = x;
  node_out_array(n)[p] = out;
}

// Drops node `n`'s leaves (`leaves = None`: graph truncation once it ran).
void node_release_leaves(PyObject* n);

// `n.leaves`: a new list (fresh Refs for the lazy inputs), None once released; nullptr with an
// AttributeError when never set.
PyObject* node_leaves_list(PyObject* n);

// An output's liveness, node `n`'s `_out` item for it (docs/node-layout.md section 7, step 2b).
// On the default graph, the count (a Python int; None until a tensor is bound) of what holds the
// output for a live tensor: each LazyImpl whose record is (n, k) (csrc/wrapper.cpp) and each
// liveness token genie._C.Alive(n, k) (the instance dict of a wrapper the Python path made). On a
// capture graph (keep_nodes), a weak reference to the tensor itself (genie.graph.track), which may
// since have been rebound to another node: readers check its `_node` (genie.planner.held_after).
//
// Adds `d` to output `k`'s count, with the GIL, and returns the new count; nothing (-1) where `n`
// is not a node, `k` is not one of its outputs or the item is not a count (a capture graph's weak
// reference): the same test on the way up and down, so a holder's +1 and -1 always pair. Raises
// nothing.
Py_ssize_t out_count_add(PyObject* n, Py_ssize_t k, Py_ssize_t d);

// How many of a node's `_out` items are counts (outputs of the default graph a tensor was bound
// to): each stands for the weak reference a bound output held before the counts, whose free
// lowered the collector's young count (csrc/node.cpp node_dealloc keeps that).
int counted_outputs(PyObject* out);

// Whether an output's `_out` item is a positive count (a live holder on the default graph).
inline bool out_counted(PyObject* r) {
  if (r == nullptr || !PyLong_CheckExact(r)) {
    return false;
  }
#if PY_VERSION_HEX >= 0x030C0000
  // 3.12 on: the sign is lv_tag's low bits (0 positive, 1 zero, 2 negative); Py_SIZE reads the
  // whole tag there, which is positive for 0 too (every output looked held: every plan missed)
  return (reinterpret_cast<PyLongObject*>(r)->long_value.lv_tag & 3) == 0;
#else
  return Py_SIZE(r) > 0;  // 3.11: the sign of ob_size
#endif
}

// Adds Node to the genie._C module.
void add_node_type(pybind11::module_& m);

}  // namespace genie
