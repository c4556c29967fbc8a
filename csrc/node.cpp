// genie._C.Node: a recorded node's fields as a native struct (docs/node-layout.md, step 4a).
//
// genie.graph.Node subclasses it, adding methods and properties only (no field of its own: the
// native record path checks that, record.cpp). The type exists for its deallocator, which a
// slotted Python class cannot have: CPython lowers the cyclic collector's young count at every
// free of a collector-allocated object, and genie._C takes the node and most of what it holds
// (its lists, Refs, Storages, weak references) off that count at allocation (csrc/gccount.h).
// Nodes freed in bulk by Genie's own code put the count back (bind.cpp, _release_nodes); a node
// freed anywhere else, as a pending graph a program drops unread, now does it itself: the
// count after its free is what it was before, except for the real tensors of its `values`,
// which are freed after the count is put back, as eager frees its tensors (counted at
// allocation, lowered at free). A static type: session 49 swapped the Python class's tp_dealloc
// while it ran, which CPython's subtype_dealloc does not allow between threads.
//
// The cyclic collector: tp_traverse visits every field and tp_clear clears them, as a slotted
// class's would; which nodes are tracked at all is genie.graph's ("the cyclic garbage
// collector": only a node that can close a cycle through a pending write).
#include "node.h"

#include <structmember.h>

#include <cstddef>
#include <vector>

#include "gccount.h"

namespace genie {
namespace {

#define GENIE_NODE_FIELDS(X)                                                                    \
  X(op) X(leaves) X(spec) X(metas) X(out_spec) X(st) X(writes) X(out) X(values) X(executed)    \
  X(index) X(rng) X(graph) X(seq) X(where) X(n_consumers) X(tags) X(entry) X(ctx) X(wref)

int node_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* n = reinterpret_cast<NodeObject*>(self);
#define GENIE_VISIT(f) Py_VISIT(n->f);
  GENIE_NODE_FIELDS(GENIE_VISIT)
#undef GENIE_VISIT
  return 0;
}

int node_clear(PyObject* self) {
  auto* n = reinterpret_cast<NodeObject*>(self);
#define GENIE_CLEAR(f) Py_CLEAR(n->f);
  GENIE_NODE_FIELDS(GENIE_CLEAR)
#undef GENIE_CLEAR
  return 0;
}

// A pending node's dealloc on this thread: the outermost one brackets the count; the argument
// lists of the nodes freed inside it wait in `later` and are freed by the outermost in a loop,
// so a dropped chain is freed iteratively, within one bracket, whatever its length (nested, each
// level's list -> Ref -> node recursion would reach the interpreter's trashcan, which frees the
// deeper objects after the outermost deallocator returned: outside the bracket).
struct Dropping {
  int depth = 0;
  int credit = 0;  // liveness tokens of the nodes freed (see node_dealloc)
  std::vector<PyObject*> later;
};
thread_local Dropping dropping;

// The weak references in a node's `_out` (one per output bound to a tensor).
int bound_outputs(PyObject* out) {
  if (out == nullptr) {
    return 0;
  }
  if (PyList_CheckExact(out)) {
    int k = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(out); ++i) {
      k += PyWeakref_CheckRefExact(PyList_GET_ITEM(out, i)) ? 1 : 0;
    }
    return k;
  }
  return PyWeakref_CheckRefExact(out) ? 1 : 0;
}

void node_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  auto* n = reinterpret_cast<NodeObject*>(self);
  // weak references first: their callbacks (executor._host_values is a WeakKeyDictionary) see
  // the node's fields still set, as with a slotted class
  if (n->executed == Py_True || n->executed == nullptr) {
    // A node that ran is freed as a slotted object was: its tensors die with the program's
    // references (eager frees its own tensors the same way), and Genie's bulk frees of a run's
    // nodes bracket the count themselves (bind.cpp, _release_nodes).
    if (n->weaklist != nullptr) {
      PyObject_ClearWeakRefs(self);
    }
    node_clear(self);
    Py_TYPE(self)->tp_free(self);
    return;
  }
  // A pending node freed: a graph dropped unread (or a run's, inside bind's own bracket). What
  // it holds was taken off the young count at allocation (the node, its lists, Refs, Storages,
  // weak references), so the frees below leave the count where it was; and each output's
  // liveness token (also off the count from its allocation) lowered it when its tensor died,
  // which is given back too. Otherwise a program that only drops pending graphs would never run
  // a young collection (tests/unit/test_gc.py, docs/engine.md "The garbage collector").
  Dropping& d = dropping;
  const bool outer = d.depth == 0;
  const int before = outer ? gc_young() : 0;
  ++d.depth;
  if (n->weaklist != nullptr) {
    PyObject_ClearWeakRefs(self);
  }
  d.credit += bound_outputs(n->out);
  if (n->leaves != nullptr) {
    d.later.push_back(n->leaves);  // (the reference moves to `later`)
    n->leaves = nullptr;
  }
  node_clear(self);
  Py_TYPE(self)->tp_free(self);
  if (outer) {
    while (!d.later.empty()) {  // the lists of the nodes freed meanwhile (which may add more)
      PyObject* o = d.later.back();
      d.later.pop_back();
      Py_DECREF(o);
    }
  }
  --d.depth;
  if (outer) {
    const int credit = d.credit;
    d.credit = 0;
    gc_young_at_least(before);
    gc_young_credit(credit);
  }
}

#define GENIE_MEMBER(name, field, doc) \
  {name, T_OBJECT_EX, offsetof(NodeObject, field), 0, doc},

PyMemberDef node_members[] = {
    GENIE_MEMBER("op", op, "The torch OpOverload, or a Genie pseudo-op (genie.upload).")
    GENIE_MEMBER("leaves", leaves, "The flattened arguments (lazy inputs are Refs); None once run.")
    GENIE_MEMBER("spec", spec, "The arguments' tree spec.")
    GENIE_MEMBER("metas", metas, "One TensorMeta per output (None for non-tensor outputs).")
    GENIE_MEMBER("out_spec", out_spec, "The tree spec that rebuilds the op's return value.")
    GENIE_MEMBER("_st", st, "A single output's Storage, or a list of one per output.")
    GENIE_MEMBER("writes", writes, "The storages this node mutates.")
    GENIE_MEMBER("_out", out, "A single output's liveness weak reference, or a list.")
    GENIE_MEMBER("values", values, "The real values after execution (None before).")
    GENIE_MEMBER("executed", executed, "Whether the node ran.")
    GENIE_MEMBER("index", index, "Process-wide record order.")
    GENIE_MEMBER("rng", rng, "(seed, offset) of a random op, else None.")
    GENIE_MEMBER("graph", graph, "The owning genie.graph.Graph.")
    GENIE_MEMBER("_seq", seq, "Record position in its graph; None on the default graph.")
    GENIE_MEMBER("where", where, "The user's source line, or None.")
    GENIE_MEMBER("n_consumers", n_consumers, "Argument references made while pending.")
    GENIE_MEMBER("tags", tags, "A dict of roles (KV cache), or None.")
    GENIE_MEMBER("entry", entry, "The meta-cache entry the op was recorded with, or None.")
    GENIE_MEMBER("ctx", ctx, "The genie.context.Context it was recorded in.")
    GENIE_MEMBER("_wref", wref, "The node's own weak reference.")
    {nullptr, 0, 0, 0, nullptr},
};

#undef GENIE_MEMBER

}  // namespace

PyTypeObject NodeType = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "genie._C.Node";
  t.tp_basicsize = sizeof(NodeObject);
  t.tp_itemsize = 0;
  t.tp_dealloc = node_dealloc;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  t.tp_doc = "A recorded op's fields (genie.graph.Node subclasses it).";
  t.tp_traverse = node_traverse;
  t.tp_clear = node_clear;
  t.tp_weaklistoffset = offsetof(NodeObject, weaklist);
  t.tp_members = node_members;
  t.tp_alloc = PyType_GenericAlloc;
  t.tp_new = PyType_GenericNew;
  t.tp_free = PyObject_GC_Del;
  return t;
}();

bool is_node_type(PyTypeObject* t) {
  return PyType_IsSubtype(t, &NodeType) && t->tp_basicsize == NodeType.tp_basicsize &&
         t->tp_weaklistoffset == NodeType.tp_weaklistoffset && t->tp_dictoffset == 0;
}

void add_node_type(pybind11::module_& m) {
  if (PyType_Ready(&NodeType) < 0) {
    throw pybind11::error_already_set();
  }
  Py_INCREF(&NodeType);
  if (PyModule_AddObject(m.ptr(), "Node", reinterpret_cast<PyObject*>(&NodeType)) < 0) {
    Py_DECREF(&NodeType);
    throw pybind11::error_already_set();
  }
}

}  // namespace genie
