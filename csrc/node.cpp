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

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstring>
#include <vector>

#include "gccount.h"
#include "slots.h"

namespace genie {
namespace {

#define GENIE_NODE_FIELDS(X)                                                                    \
  X(op) X(spec) X(metas) X(out_spec) X(st) X(writes) X(out) X(values) X(executed)              \
  X(index) X(rng) X(graph) X(seq) X(where) X(n_consumers) X(tags) X(entry) X(ctx) X(wref)

int node_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* n = reinterpret_cast<NodeObject*>(self);
#define GENIE_VISIT(f) Py_VISIT(n->f);
  GENIE_NODE_FIELDS(GENIE_VISIT)
#undef GENIE_VISIT
  PyObject** leaf = node_leaf_array(self);
  for (int32_t p = 0; p < n->n_leaves; ++p) {
    Py_VISIT(leaf[p]);
  }
  return 0;
}

int node_clear(PyObject* self) {
  auto* n = reinterpret_cast<NodeObject*>(self);
  node_release_leaves(self);
#define GENIE_CLEAR(f) Py_CLEAR(n->f);
  GENIE_NODE_FIELDS(GENIE_CLEAR)
#undef GENIE_CLEAR
  return 0;
}

// Moves node `n`'s leaves (owned references) to the end of `to` and marks them released.
void take_leaves(PyObject* n, std::vector<PyObject*>& to) {
  auto* node = reinterpret_cast<NodeObject*>(n);
  PyObject** leaf = node_leaf_array(n);
  const int32_t k = node->n_leaves;
  node->n_leaves = node->n_leaves == kLeavesUnset ? kLeavesUnset : kLeavesReleased;
  for (int32_t p = 0; p < k; ++p) {
    if (leaf[p] != nullptr) {
      to.push_back(leaf[p]);
      leaf[p] = nullptr;
    }
  }
}

// A pending node's dealloc on this thread: the outermost one brackets the count; the argument
// leaves (producer nodes and constants) of the nodes freed inside it wait in `later` and are freed
// by the outermost in a loop, so a dropped chain is freed iteratively, within one bracket,
// whatever its length (nested, each level's node -> producer recursion would reach the
// interpreter's trashcan, which frees the deeper objects after the outermost deallocator
// returned: outside the bracket).
struct Dropping {
  int depth = 0;
  int credit = 0;  // liveness tokens of the nodes freed (see node_dealloc)
  std::vector<PyObject*> later;
};
thread_local Dropping dropping;

// The weak references in a node's `_out` (a capture graph's, one per output bound to a tensor;
// the default graph's outputs hold counts: node.h out_count_add, counted_outputs).
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
    gc_young_debit(counted_outputs(n->out));  // (the weak references its outputs once held)
    node_clear(self);
    Py_TYPE(self)->tp_free(self);
    return;
  }
  // A pending node freed: a graph dropped unread (or a run's, inside bind's own bracket). What
  // it holds was taken off the young count at allocation (the node, its lists, Refs, Storages,
  // weak references), so the frees below leave the count where it was; and each output's
  // liveness token (also off the count from its allocation) lowered it when its tensor died,
  // which is given back too (the default graph's outputs hold counts, whose last holder's release
  // lowers it as the token's free did: csrc/wrapper.cpp). Otherwise a program that only drops
  // pending graphs would never run a young collection (tests/unit/test_gc.py, docs/engine.md
  // "The garbage collector").
  Dropping& d = dropping;
  const bool outer = d.depth == 0;
  const int before = outer ? gc_young() : 0;
  ++d.depth;
  if (n->weaklist != nullptr) {
    PyObject_ClearWeakRefs(self);
  }
  d.credit += bound_outputs(n->out) + counted_outputs(n->out);
  take_leaves(self, d.later);  // (the references move to `later`)
  node_clear(self);
  Py_TYPE(self)->tp_free(self);
  if (outer) {
    while (!d.later.empty()) {  // the leaves of the nodes freed meanwhile (which may add more)
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
    GENIE_MEMBER("spec", spec, "The arguments' tree spec.")
    GENIE_MEMBER("metas", metas, "One TensorMeta per output (None for non-tensor outputs).")
    GENIE_MEMBER("out_spec", out_spec, "The tree spec that rebuilds the op's return value.")
    GENIE_MEMBER("_st", st, "A single output's Storage, or a list of one per output.")
    GENIE_MEMBER("writes", writes, "The storages this node mutates.")
    GENIE_MEMBER("_out", out, "A single output's liveness (a count of live holders; a capture graph's weak reference to its tensor), or a list.")
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

// genie.graph.Ref and its two fields' offsets, found at first use (genie.graph is imported by
// then: it defines the subclass every node is made of).
struct RefClass {
  PyTypeObject* type = nullptr;
  Py_ssize_t node = 0, out = 0;
};

const RefClass& ref_class() {
  static RefClass r = [] {
    RefClass c;
    PyObject* mod = PyImport_ImportModule("genie.graph");
    if (mod == nullptr) {
      throw pybind11::error_already_set();
    }
    PyObject* t = PyObject_GetAttrString(mod, "Ref");
    Py_DECREF(mod);
    if (t == nullptr) {
      throw pybind11::error_already_set();
    }
    c.type = reinterpret_cast<PyTypeObject*>(t);  // kept for the process
    c.node = slot_offset(c.type, "node");
    c.out = slot_offset(c.type, "out");
    return c;
  }();
  return r;
}

// A new Ref(node, out), made as object.__new__ and Ref.__init__ would make it.
PyObject* new_ref_object(PyObject* node, int32_t out) {
  const RefClass& r = ref_class();
  PyObject* o = r.type->tp_alloc(r.type, 0);
  if (o == nullptr) {
    return nullptr;
  }
  PyObject* k = PyLong_FromLong(out);
  if (k == nullptr) {
    Py_DECREF(o);
    return nullptr;
  }
  Py_INCREF(node);
  *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + r.node) = node;
  *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + r.out) = k;
  return o;
}

// Leaf `p` as Python sees it in `leaves` (a fresh Ref for a lazy input); a new reference.
PyObject* leaf_object(PyObject* n, Py_ssize_t p) {
  int32_t out = -1;
  PyObject* x = node_leaf(n, p, &out);
  if (out < 0) {
    return Py_NewRef(x);
  }
  return new_ref_object(x, out);
}

PyObject* leaves_get(PyObject* self, void*) {
  try {
    return node_leaves_list(self);
  } catch (pybind11::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// `n.leaves = v`: None releases them; a list or tuple (of Refs and constants) sets them, within
// the room the node was made with (genie.graph.Node's constructor makes it from its `leaves`).
int leaves_set(PyObject* self, PyObject* v, void*) {
  auto* n = reinterpret_cast<NodeObject*>(self);
  if (v == nullptr) {
    PyErr_SetString(PyExc_AttributeError, "a node's leaves cannot be deleted (assign None)");
    return -1;
  }
  if (v == Py_None) {
    node_release_leaves(self);
    return 0;
  }
  if (!PyList_Check(v) && !PyTuple_Check(v)) {
    PyErr_Format(PyExc_TypeError, "a node's leaves are a list or None, not %s",
                 Py_TYPE(v)->tp_name);
    return -1;
  }
  PyObject* seq = PySequence_Fast(v, "leaves");  // (a list or tuple: itself)
  if (seq == nullptr) {
    return -1;
  }
  const Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
  if (k > n->cap) {
    Py_DECREF(seq);
    PyErr_Format(PyExc_ValueError,
                 "this node was made with room for %d leaves, not %zd: a node's arguments are "
                 "fixed when it is made (genie.graph.Node(op, leaves, ...))",
                 static_cast<int>(n->cap), k);
    return -1;
  }
  const RefClass* rc = nullptr;
  try {
    rc = &ref_class();
  } catch (pybind11::error_already_set& e) {
    Py_DECREF(seq);
    e.restore();
    return -1;
  }
  std::vector<PyObject*> xs(static_cast<size_t>(k));
  std::vector<int32_t> outs(static_cast<size_t>(k), -1);
  for (Py_ssize_t p = 0; p < k; ++p) {
    PyObject* x = PySequence_Fast_GET_ITEM(seq, p);
    if (Py_TYPE(x) == rc->type) {
      PyObject* xn = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(x) + rc->node);
      PyObject* xo = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(x) + rc->out);
      const long o = xo != nullptr && PyLong_Check(xo) ? PyLong_AsLong(xo) : -1;
      if (PyErr_Occurred()) {
        PyErr_Clear();
      }
      if (xn == nullptr || !is_node_type(Py_TYPE(xn)) || o < 0 || o > INT32_MAX) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_TypeError,
                     "leaf %zd is a Ref whose node is not a genie.graph.Node or whose output "
                     "is not an int >= 0",
                     p);
        return -1;
      }
      x = xn;
      outs[static_cast<size_t>(p)] = static_cast<int32_t>(o);
    }
    xs[static_cast<size_t>(p)] = Py_NewRef(x);
  }
  Py_DECREF(seq);
  std::vector<PyObject*> old;
  take_leaves(self, old);
  for (Py_ssize_t p = 0; p < k; ++p) {
    node_init_leaf(self, p, xs[static_cast<size_t>(p)], outs[static_cast<size_t>(p)]);
  }
  n->n_leaves = static_cast<int32_t>(k);
  for (PyObject* o : old) {
    Py_DECREF(o);
  }
  return 0;
}

PyObject* n_leaves_get(PyObject* self, void*) {
  return PyLong_FromSsize_t(std::max<Py_ssize_t>(node_n_leaves(self), 0));
}

PyGetSetDef node_getset[] = {
    {"leaves", leaves_get, leaves_set,
     "The flattened arguments, a new list on each read (lazy inputs are fresh Refs); None once "
     "the node ran. Assign None to release them.",
     nullptr},
    {"n_leaves", n_leaves_get, nullptr, "How many leaves the node holds (0 once released).",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyObject* node_leaf_method(PyObject* self, PyObject* arg) {
  const Py_ssize_t p = PyLong_AsSsize_t(arg);
  if (p == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  if (p < 0 || p >= node_n_leaves(self)) {
    PyErr_Format(PyExc_IndexError, "leaf %zd of a node with %zd leaves%s", p,
                 std::max<Py_ssize_t>(node_n_leaves(self), 0),
                 node_n_leaves(self) < 0 ? " (released: it ran)" : "");
    return nullptr;
  }
  try {
    return leaf_object(self, p);
  } catch (pybind11::error_already_set& e) {
    e.restore();
    return nullptr;
  }
}

PyObject* node_refs_method(PyObject* self, PyObject*) {
  PyObject* r = PyList_New(0);
  if (r == nullptr) {
    return nullptr;
  }
  const Py_ssize_t k = node_n_leaves(self);
  for (Py_ssize_t p = 0; p < k; ++p) {
    int32_t out = -1;
    PyObject* x = node_leaf(self, p, &out);
    if (out < 0) {
      continue;
    }
    PyObject* t = Py_BuildValue("(Oi)", x, static_cast<int>(out));
    if (t == nullptr || PyList_Append(r, t) < 0) {
      Py_XDECREF(t);
      Py_DECREF(r);
      return nullptr;
    }
    Py_DECREF(t);
  }
  return r;
}

PyMethodDef node_methods[] = {
    {"leaf", node_leaf_method, METH_O,
     "leaf(p): leaves[p] without making the list (a fresh Ref for a lazy input)."},
    {"refs", node_refs_method, METH_NOARGS,
     "refs(): [(node, out)] of the lazy inputs, in argument order (no Ref made)."},
    {nullptr, nullptr, 0, nullptr},
};

// Node(op, leaves, ...) (genie.graph.Node's constructor) or Node.__new__(Node, op, leaves): made
// with room for `leaves` (a list or tuple), which __init__ then sets; otherwise with none.
PyObject* node_tp_new(PyTypeObject* t, PyObject* args, PyObject* kwds) {
  PyObject* leaves = nullptr;
  if (args != nullptr && PyTuple_Check(args) && PyTuple_GET_SIZE(args) >= 2) {
    leaves = PyTuple_GET_ITEM(args, 1);
  } else if (kwds != nullptr && PyDict_Check(kwds)) {
    leaves = PyDict_GetItemString(kwds, "leaves");
  }
  const Py_ssize_t k = leaves != nullptr && (PyList_Check(leaves) || PyTuple_Check(leaves))
                           ? Py_SIZE(leaves)
                           : 0;
  try {
    PyObject* n = node_new_sized(t, k, true);
    reinterpret_cast<NodeObject*>(n)->n_leaves = kLeavesUnset;
    return n;
  } catch (pybind11::error_already_set& e) {
    e.restore();
    return nullptr;
  }
}

}  // namespace

PyObject* node_new_sized(PyTypeObject* t, Py_ssize_t n, bool tracked) {
  if (n < 0 || n > INT32_MAX / 2) {
    PyErr_Format(PyExc_ValueError, "a node with %zd leaves", n);
    throw pybind11::error_already_set();
  }
  // the leaves, then their 32-bit output numbers, in pointer-sized items
  const Py_ssize_t items = n + (n + 1) / 2;
  PyObject* o;
  if (tracked) {
    o = t->tp_alloc(t, items);
    if (o == nullptr) {
      throw pybind11::error_already_set();
    }
  } else {
    const int before = gc_young();
    o = reinterpret_cast<PyObject*>(_PyObject_GC_NewVar(t, items));
    if (o == nullptr) {
      throw pybind11::error_already_set();
    }
    gc_untrack_new(o, before);  // counted by its allocation, never on the lists
    const size_t size = static_cast<size_t>(t->tp_basicsize + items * t->tp_itemsize);
    std::memset(reinterpret_cast<char*>(o) + sizeof(PyVarObject), 0, size - sizeof(PyVarObject));
  }
  auto* node = reinterpret_cast<NodeObject*>(o);
  node->cap = static_cast<int32_t>(n);
  node->n_leaves = static_cast<int32_t>(n);
  return o;
}

void node_release_leaves(PyObject* n) {
  auto* node = reinterpret_cast<NodeObject*>(n);
  const int32_t k = node->n_leaves;
  if (k <= 0) {
    node->n_leaves = k == kLeavesUnset ? kLeavesUnset : kLeavesReleased;
    return;
  }
  // Dropped after the node no longer names them (a free they trigger may read it): bind
  // releases every node of a run, so the common case takes no heap allocation.
  PyObject* small[16];
  std::vector<PyObject*> many;
  PyObject** old = small;
  if (k > 16) {
    many.resize(static_cast<size_t>(k));
    old = many.data();
  }
  PyObject** leaf = node_leaf_array(n);
  for (int32_t p = 0; p < k; ++p) {
    old[p] = leaf[p];
    leaf[p] = nullptr;
  }
  node->n_leaves = kLeavesReleased;
  for (int32_t p = 0; p < k; ++p) {
    Py_XDECREF(old[p]);
  }
}

PyObject* node_leaves_list(PyObject* n) {
  const int32_t k = reinterpret_cast<NodeObject*>(n)->n_leaves;
  if (k == kLeavesUnset) {
    PyErr_SetString(PyExc_AttributeError, "leaves");
    return nullptr;
  }
  if (k == kLeavesReleased) {
    return Py_NewRef(Py_None);
  }
  PyObject* r = PyList_New(k);
  if (r == nullptr) {
    return nullptr;
  }
  for (int32_t p = 0; p < k; ++p) {
    PyObject* x = leaf_object(n, p);
    if (x == nullptr) {
      Py_DECREF(r);
      return nullptr;
    }
    PyList_SET_ITEM(r, p, x);
  }
  return r;
}

PyTypeObject NodeType = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "genie._C.Node";
  t.tp_basicsize = sizeof(NodeObject);
  t.tp_itemsize = sizeof(PyObject*);  // the leaves and their output numbers (node_new_sized)
  t.tp_dealloc = node_dealloc;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  t.tp_doc = "A recorded op's fields (genie.graph.Node subclasses it).";
  t.tp_traverse = node_traverse;
  t.tp_clear = node_clear;
  t.tp_weaklistoffset = offsetof(NodeObject, weaklist);
  t.tp_members = node_members;
  t.tp_getset = node_getset;
  t.tp_methods = node_methods;
  t.tp_alloc = PyType_GenericAlloc;
  t.tp_new = node_tp_new;
  t.tp_free = PyObject_GC_Del;
  return t;
}();

Py_ssize_t out_count_add(PyObject* n, Py_ssize_t k, Py_ssize_t d) {
  static PyTypeObject* seen = nullptr;  // genie.graph.Node, once checked
  PyTypeObject* t = Py_TYPE(n);
  if (t != seen) {
    if (!is_node_type(t)) {
      return -1;
    }
    seen = t;
  }
  PyObject* o = reinterpret_cast<NodeObject*>(n)->out;
  PyObject** at = nullptr;
  if (o != nullptr && PyList_CheckExact(o)) {
    if (k < 0 || k >= PyList_GET_SIZE(o)) {
      return -1;
    }
    at = &reinterpret_cast<PyListObject*>(o)->ob_item[k];
  } else if (k == 0) {
    at = &reinterpret_cast<NodeObject*>(n)->out;
  } else {
    return -1;
  }
  PyObject* old = *at;
  Py_ssize_t c = 0;
  if (old != nullptr && old != Py_None) {
    if (!PyLong_CheckExact(old)) {
      return -1;  // a capture graph's weak reference
    }
    c = PyLong_AsSsize_t(old);
  }
  c = c + d < 0 ? 0 : c + d;
  PyObject* v = PyLong_FromSsize_t(c);  // (small ints: CPython's singletons)
  if (v == nullptr) {
    PyErr_Clear();
    return -1;
  }
  *at = v;
  Py_XDECREF(old);
  return c;
}

int counted_outputs(PyObject* out) {
  if (out == nullptr) {
    return 0;
  }
  if (PyList_CheckExact(out)) {
    int k = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(out); ++i) {
      k += PyLong_CheckExact(PyList_GET_ITEM(out, i)) ? 1 : 0;
    }
    return k;
  }
  return PyLong_CheckExact(out) ? 1 : 0;
}

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
