// Micro-prototype (issue 28 design study, helper "nodes"): today's per-node object graph
// (Node + argument list + Refs + output list + weakref + storage list + consumer list + seq/index
// ints + 0.43 Storage with reader lists + the node's own weakref) against one compact native node.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

static PyTypeObject *TNode, *TRef, *TStorage, *TAlive;
static Py_ssize_t n_op, n_leaves, n_spec, n_metas, n_out_spec, n_storages, n_writes, n_outputs,
    n_values, n_executed, n_index, n_rng, n_graph, n_seq, n_where, n_consumers, n_tags, n_entry,
    n_ctx, n_wref, r_node, r_out, s_pw, s_readers, s_prune, s_role;

static Py_ssize_t off(PyTypeObject* t, const char* name) {
  PyObject* d = PyDict_GetItemString(t->tp_dict, name);
  PyMemberDef* m = ((PyMemberDescrObject*)d)->d_member;
  return m->offset;
}
#define SLOT(o, off) (*(PyObject**)((char*)(o) + (off)))
static PyObject* newobj(PyTypeObject* t) {
  PyObject* o = t->tp_alloc(t, 0);
  if (PyObject_IS_GC(o)) PyObject_GC_UnTrack(o);  // recorded untracked (gc_untrack)
  return o;
}
static PyObject* untr(PyObject* o) { if (PyObject_IS_GC(o) && PyObject_GC_IsTracked(o)) PyObject_GC_UnTrack(o); return o; }

static PyObject* setup(PyObject* self, PyObject* args) {
  PyObject *a, *b, *c, *d;
  if (!PyArg_ParseTuple(args, "OOOO", &a, &b, &c, &d)) return NULL;
  TNode = (PyTypeObject*)a; TRef = (PyTypeObject*)b; TStorage = (PyTypeObject*)c; TAlive = (PyTypeObject*)d;
  Py_INCREF(a); Py_INCREF(b); Py_INCREF(c); Py_INCREF(d);
#define O(v, t, s) v = off(t, s)
  O(n_op, TNode, "op"); O(n_leaves, TNode, "leaves"); O(n_spec, TNode, "spec"); O(n_metas, TNode, "metas");
  O(n_out_spec, TNode, "out_spec"); O(n_storages, TNode, "storages"); O(n_writes, TNode, "writes");
  O(n_outputs, TNode, "outputs"); O(n_values, TNode, "values"); O(n_executed, TNode, "executed");
  O(n_index, TNode, "index"); O(n_rng, TNode, "rng"); O(n_graph, TNode, "graph"); O(n_seq, TNode, "seq");
  O(n_where, TNode, "where"); O(n_consumers, TNode, "consumers"); O(n_tags, TNode, "tags");
  O(n_entry, TNode, "entry"); O(n_ctx, TNode, "ctx"); O(n_wref, TNode, "_wref");
  O(r_node, TRef, "node"); O(r_out, TRef, "out");
  O(s_pw, TStorage, "pending_writes"); O(s_readers, TStorage, "readers"); O(s_prune, TStorage, "prune_at");
  O(s_role, TStorage, "role");
  Py_RETURN_NONE;
}

// ---- today's shape -------------------------------------------------------------------------
// node i reads node i-1 (and node i-2 on odd i: 1.5 Refs), plus one constant; one output;
// a fresh Storage on every other node (0.5), a view's (the input's) otherwise; outputs[0] a
// weak reference to a liveness token that died (an intermediate); consumers: a list with the
// consumer's _wref; the fresh storage's readers: a list with the consumer's _wref.
static long long counter = 1000000;
// Interleaved allocations (a wrapper tensor's dict, a tuple, a list per op: what a recorded op
// makes besides its node), appended to `noise` when set and freed by the driver after the build.
static PyObject* noise = NULL;
static void add_noise(void) {
  if (noise == NULL) return;
  PyObject* d = PyDict_New();
  PyDict_SetItemString(d, "_node", Py_None); PyDict_SetItemString(d, "_out", Py_None);
  PyObject* t = PyTuple_Pack(3, Py_None, Py_None, Py_None);
  PyObject* l = PyList_New(0); PyList_Append(l, t);
  PyList_Append(noise, d); PyList_Append(noise, l);
  Py_DECREF(d); Py_DECREF(t); Py_DECREF(l);
}
static PyObject* set_noise(PyObject* self, PyObject* o) {
  Py_XDECREF(noise); noise = o == Py_None ? NULL : Py_NewRef(o); Py_RETURN_NONE;
}
static PyObject* build_old(PyObject* self, PyObject* args) {
  Py_ssize_t n; PyObject *op, *entry, *spec, *metas, *graph, *cst;
  if (!PyArg_ParseTuple(args, "nOOOOOO", &n, &op, &entry, &spec, &metas, &graph, &cst)) return NULL;
  PyObject* nodes = PyList_New(n);
  PyObject* empty = PyTuple_New(0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    add_noise();
    PyObject* prev = i ? PyList_GET_ITEM(nodes, i - 1) : NULL;
    PyObject* prev2 = i > 1 ? PyList_GET_ITEM(nodes, i - 2) : NULL;
    int nref = (prev ? 1 : 0) + ((i & 1) && prev2 ? 1 : 0);
    PyObject* leaves = untr(PyList_New(nref + 1));
    Py_ssize_t li = 0;
    PyObject* srcs[2] = {prev, (i & 1) ? prev2 : NULL};
    for (int r = 0; r < 2; ++r) {
      if (!srcs[r]) continue;
      PyObject* ref = newobj(TRef);
      SLOT(ref, r_node) = Py_NewRef(srcs[r]);
      SLOT(ref, r_out) = PyLong_FromLong(0);
      PyList_SET_ITEM(leaves, li++, ref);
    }
    PyList_SET_ITEM(leaves, li, Py_NewRef(cst));
    PyObject* storages = untr(PyList_New(1));
    PyObject* st;
    if ((i & 1) == 0 || !prev) {
      st = newobj(TStorage);
      SLOT(st, s_pw) = Py_NewRef(empty); SLOT(st, s_readers) = Py_NewRef(empty);
      SLOT(st, s_prune) = PyLong_FromLong(64); SLOT(st, s_role) = Py_NewRef(Py_None);
    } else {
      st = Py_NewRef(PyList_GET_ITEM(SLOT(prev, n_storages), 0));
    }
    PyList_SET_ITEM(storages, 0, st);
    PyObject* node = newobj(TNode);
    PyObject* outputs = untr(PyList_New(1));
    PyObject* tok = PyObject_CallNoArgs((PyObject*)TAlive);
    PyList_SET_ITEM(outputs, 0, untr(PyWeakref_NewRef(tok, NULL)));
    Py_DECREF(tok);  // the tensor died: an intermediate
    SLOT(node, n_outputs) = outputs;
    SLOT(node, n_op) = Py_NewRef(op); SLOT(node, n_leaves) = leaves; SLOT(node, n_spec) = Py_NewRef(spec);
    SLOT(node, n_metas) = Py_NewRef(metas); SLOT(node, n_out_spec) = Py_NewRef(Py_None);
    SLOT(node, n_storages) = storages; SLOT(node, n_writes) = Py_NewRef(empty);
    SLOT(node, n_values) = Py_NewRef(Py_None); SLOT(node, n_executed) = Py_NewRef(Py_False);
    SLOT(node, n_index) = PyLong_FromLongLong(counter++); SLOT(node, n_rng) = Py_NewRef(Py_None);
    SLOT(node, n_graph) = Py_NewRef(graph); SLOT(node, n_seq) = PyLong_FromLongLong(counter + 7);
    SLOT(node, n_where) = Py_NewRef(Py_None); SLOT(node, n_consumers) = Py_NewRef(empty);
    SLOT(node, n_tags) = Py_NewRef(Py_None); SLOT(node, n_entry) = Py_NewRef(entry);
    SLOT(node, n_ctx) = Py_NewRef(Py_None);
    PyObject* w = untr(PyWeakref_NewRef(node, NULL));
    SLOT(node, n_wref) = w;
    // consumers and readers of the inputs
    for (int r = 0; r < 2; ++r) {
      PyObject* x = srcs[r];
      if (!x) continue;
      PyObject* cons = SLOT(x, n_consumers);
      if (!PyList_CheckExact(cons)) { SLOT(x, n_consumers) = untr(PyList_New(0)); Py_DECREF(cons); cons = SLOT(x, n_consumers); }
      PyList_Append(cons, w);
      PyObject* xs = PyList_GET_ITEM(SLOT(x, n_storages), 0);
      PyObject* rd = SLOT(xs, s_readers);
      if (!PyList_CheckExact(rd)) { SLOT(xs, s_readers) = untr(PyList_New(0)); Py_DECREF(rd); rd = SLOT(xs, s_readers); }
      PyList_Append(rd, w);
    }
    PyList_SET_ITEM(nodes, i, node);
  }
  Py_DECREF(empty);
  return nodes;
}

// A match-like read of every node: entry, executed, index, each Ref's node and out, the
// consumer count, the output's liveness.
static PyObject* walk_old(PyObject* self, PyObject* nodes) {
  Py_ssize_t n = PyList_GET_SIZE(nodes); long long acc = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* node = PyList_GET_ITEM(nodes, i);
    acc += SLOT(node, n_entry) == Py_None;
    acc += SLOT(node, n_executed) == Py_True;
    acc += PyLong_AsLongLong(SLOT(node, n_index)) & 1;
    PyObject* leaves = SLOT(node, n_leaves);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(leaves); ++j) {
      PyObject* x = PyList_GET_ITEM(leaves, j);
      if (Py_TYPE(x) == TRef) { acc += (intptr_t)SLOT(x, r_node) & 0xff; acc += PyLong_AsLong(SLOT(x, r_out)); }
    }
    acc += Py_SIZE(SLOT(node, n_consumers));
    acc += PyWeakref_GET_OBJECT(PyList_GET_ITEM(SLOT(node, n_outputs), 0)) == Py_None;
    acc += Py_SIZE(SLOT(PyList_GET_ITEM(SLOT(node, n_storages), 0), s_readers));
  }
  return PyLong_FromLongLong(acc);
}


// ---- stage 1: today's Python Node, without the per-node lists and ints --------------------
// storages / outputs slots hold the one Storage / weak reference itself (single output), the
// consumer list is a count (a small int: cached), seq is not stored (derived from index).
static PyObject* build_mid(PyObject* self, PyObject* args) {
  Py_ssize_t n; PyObject *op, *entry, *spec, *metas, *graph, *cst;
  if (!PyArg_ParseTuple(args, "nOOOOOO", &n, &op, &entry, &spec, &metas, &graph, &cst)) return NULL;
  PyObject* nodes = PyList_New(n);
  PyObject* empty = PyTuple_New(0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    add_noise();
    PyObject* prev = i ? PyList_GET_ITEM(nodes, i - 1) : NULL;
    PyObject* prev2 = i > 1 ? PyList_GET_ITEM(nodes, i - 2) : NULL;
    int nref = (prev ? 1 : 0) + ((i & 1) && prev2 ? 1 : 0);
    PyObject* leaves = untr(PyList_New(nref + 1));
    Py_ssize_t li = 0;
    PyObject* srcs[2] = {prev, (i & 1) ? prev2 : NULL};
    for (int r = 0; r < 2; ++r) {
      if (!srcs[r]) continue;
      PyObject* ref = newobj(TRef);
      SLOT(ref, r_node) = Py_NewRef(srcs[r]);
      SLOT(ref, r_out) = PyLong_FromLong(0);
      PyList_SET_ITEM(leaves, li++, ref);
    }
    PyList_SET_ITEM(leaves, li, Py_NewRef(cst));
    PyObject* st;
    if ((i & 1) == 0 || !prev) {
      st = newobj(TStorage);
      SLOT(st, s_pw) = Py_NewRef(empty); SLOT(st, s_readers) = Py_NewRef(empty);
      SLOT(st, s_prune) = PyLong_FromLong(64); SLOT(st, s_role) = Py_NewRef(Py_None);
    } else {
      st = Py_NewRef(SLOT(prev, n_storages));
    }
    PyObject* node = newobj(TNode);
    PyObject* tok = PyObject_CallNoArgs((PyObject*)TAlive);
    SLOT(node, n_outputs) = untr(PyWeakref_NewRef(tok, NULL));
    Py_DECREF(tok);
    SLOT(node, n_op) = Py_NewRef(op); SLOT(node, n_leaves) = leaves; SLOT(node, n_spec) = Py_NewRef(spec);
    SLOT(node, n_metas) = Py_NewRef(metas); SLOT(node, n_out_spec) = Py_NewRef(Py_None);
    SLOT(node, n_storages) = st; SLOT(node, n_writes) = Py_NewRef(empty);
    SLOT(node, n_values) = Py_NewRef(Py_None); SLOT(node, n_executed) = Py_NewRef(Py_False);
    SLOT(node, n_index) = PyLong_FromLongLong(counter++); SLOT(node, n_rng) = Py_NewRef(Py_None);
    SLOT(node, n_graph) = Py_NewRef(graph); SLOT(node, n_seq) = Py_NewRef(Py_None);
    SLOT(node, n_where) = Py_NewRef(Py_None); SLOT(node, n_consumers) = PyLong_FromLong(0);
    SLOT(node, n_tags) = Py_NewRef(Py_None); SLOT(node, n_entry) = Py_NewRef(entry);
    SLOT(node, n_ctx) = Py_NewRef(Py_None);
    PyObject* w = untr(PyWeakref_NewRef(node, NULL));
    SLOT(node, n_wref) = w;
    for (int r = 0; r < 2; ++r) {
      PyObject* x = srcs[r];
      if (!x) continue;
      PyObject* c = SLOT(x, n_consumers);
      SLOT(x, n_consumers) = PyLong_FromLong(PyLong_AsLong(c) + 1);
      Py_DECREF(c);
      PyObject* xs = SLOT(x, n_storages);
      PyObject* rd = SLOT(xs, s_readers);
      if (!PyList_CheckExact(rd)) { SLOT(xs, s_readers) = untr(PyList_New(0)); Py_DECREF(rd); rd = SLOT(xs, s_readers); }
      PyList_Append(rd, w);
    }
    PyList_SET_ITEM(nodes, i, node);
  }
  Py_DECREF(empty);
  return nodes;
}
static PyObject* walk_mid(PyObject* self, PyObject* nodes) {
  Py_ssize_t n = PyList_GET_SIZE(nodes); long long acc = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* node = PyList_GET_ITEM(nodes, i);
    acc += SLOT(node, n_entry) == Py_None;
    acc += SLOT(node, n_executed) == Py_True;
    acc += PyLong_AsLongLong(SLOT(node, n_index)) & 1;
    PyObject* leaves = SLOT(node, n_leaves);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(leaves); ++j) {
      PyObject* x = PyList_GET_ITEM(leaves, j);
      if (Py_TYPE(x) == TRef) { acc += (intptr_t)SLOT(x, r_node) & 0xff; acc += PyLong_AsLong(SLOT(x, r_out)); }
    }
    acc += PyLong_AsLong(SLOT(node, n_consumers));
    acc += PyWeakref_GET_OBJECT(SLOT(node, n_outputs)) == Py_None;
    acc += Py_SIZE(SLOT(SLOT(node, n_storages), s_readers));
  }
  return PyLong_FromLongLong(acc);
}

// ---- the compact node ----------------------------------------------------------------------
// One object: fixed fields inline, the argument array inline (a lazy input is its producer,
// held strongly, with its output number in `outs`; a constant is the object), the one output's
// storage and liveness inline, counts as C integers. Storages and reader lists as today, the
// node's own weak reference as today (the readers lists hold it).
typedef struct CNode {
  PyObject_VAR_HEAD
  PyObject *op, *entry, *ctx, *values, *storage0, *wref, *extra;  // extra: rare fields (tags, where, rng, multi-output lists)
  int64_t index, seq;
  int32_t n_consumers;
  uint8_t executed, live, n_args, ref_mask;  // ref_mask: which args are lazy inputs
  uint8_t outs[8];
  PyObject* weaklist;
  PyObject* args[1];
} CNode;

static int cnode_traverse(CNode* self, visitproc visit, void* arg) {
  Py_VISIT(self->op); Py_VISIT(self->entry); Py_VISIT(self->ctx); Py_VISIT(self->values);
  Py_VISIT(self->storage0); Py_VISIT(self->extra);
  for (int i = 0; i < self->n_args; ++i) Py_VISIT(self->args[i]);
  return 0;
}
static int cnode_clear(CNode* self) {
  Py_CLEAR(self->op); Py_CLEAR(self->entry); Py_CLEAR(self->ctx); Py_CLEAR(self->values);
  Py_CLEAR(self->storage0); Py_CLEAR(self->wref); Py_CLEAR(self->extra);
  for (int i = 0; i < self->n_args; ++i) Py_CLEAR(self->args[i]);
  self->n_args = 0;
  return 0;
}
static PyObject* cnode_weakreflist_dummy;
typedef struct { CNode base; } unused_t;
static void cnode_dealloc(CNode* self);
static PyTypeObject CNodeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proto.CNode",
    .tp_itemsize = sizeof(PyObject*),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)cnode_traverse,
    .tp_clear = (inquiry)cnode_clear,
    .tp_dealloc = (destructor)cnode_dealloc,
};
#define WEAKLIST(o) (((CNode*)(o))->weaklist)
static void cnode_dealloc(CNode* self) {
  PyObject_GC_UnTrack(self);
  if (WEAKLIST(self) != NULL) PyObject_ClearWeakRefs((PyObject*)self);
  Py_TRASHCAN_BEGIN(self, cnode_dealloc)
  cnode_clear(self);
  Py_TYPE(self)->tp_free((PyObject*)self);
  Py_TRASHCAN_END
}

static PyObject* build_new(PyObject* self, PyObject* args) {
  Py_ssize_t n; PyObject *op, *entry, *spec, *metas, *graph, *cst; int with_wref;
  if (!PyArg_ParseTuple(args, "nOOOOOOp", &n, &op, &entry, &spec, &metas, &graph, &cst, &with_wref)) return NULL;
  PyObject* nodes = PyList_New(n);
  PyObject* empty = PyTuple_New(0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    add_noise();
    CNode* prev = i ? (CNode*)PyList_GET_ITEM(nodes, i - 1) : NULL;
    CNode* prev2 = i > 1 ? (CNode*)PyList_GET_ITEM(nodes, i - 2) : NULL;
    CNode* srcs[2] = {prev, (i & 1) ? prev2 : NULL};
    int nargs = (srcs[0] != NULL) + (srcs[1] != NULL) + 1;
    CNode* node = PyObject_GC_NewVar(CNode, &CNodeType, nargs);  // untracked until GC_Track
    memset(&node->op, 0, offsetof(CNode, args) - offsetof(CNode, op) + nargs * sizeof(PyObject*));
    node->n_args = 0; node->ref_mask = 0;
    for (int r = 0; r < 2; ++r) {
      if (!srcs[r]) continue;
      node->ref_mask |= 1 << node->n_args; node->outs[node->n_args] = 0;
      node->args[node->n_args++] = Py_NewRef(srcs[r]);
      srcs[r]->n_consumers++;
    }
    node->args[node->n_args++] = Py_NewRef(cst);
    WEAKLIST(node) = NULL;
    node->op = Py_NewRef(op); node->entry = Py_NewRef(entry); node->ctx = Py_NewRef(Py_None);
    node->values = Py_NewRef(Py_None);
    if ((i & 1) == 0 || !prev) {
      PyObject* st = newobj(TStorage);
      SLOT(st, s_pw) = Py_NewRef(empty); SLOT(st, s_readers) = Py_NewRef(empty);
      SLOT(st, s_prune) = PyLong_FromLong(64); SLOT(st, s_role) = Py_NewRef(Py_None);
      node->storage0 = st;
    } else {
      node->storage0 = Py_NewRef(prev->storage0);
    }
    node->index = counter++; node->seq = counter + 7; node->live = 0;
    node->wref = with_wref ? untr(PyWeakref_NewRef((PyObject*)node, NULL)) : NULL;
    if (with_wref) {
      for (int r = 0; r < 2; ++r) {
        CNode* x = srcs[r];
        if (!x) continue;
        PyObject* xs = x->storage0;
        PyObject* rd = SLOT(xs, s_readers);
        if (!PyList_CheckExact(rd)) { SLOT(xs, s_readers) = untr(PyList_New(0)); Py_DECREF(rd); rd = SLOT(xs, s_readers); }
        PyList_Append(rd, node->wref);
      }
    }
    PyList_SET_ITEM(nodes, i, (PyObject*)node);
  }
  Py_DECREF(empty);
  return nodes;
}

static PyObject* walk_new(PyObject* self, PyObject* nodes) {
  Py_ssize_t n = PyList_GET_SIZE(nodes); long long acc = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    CNode* node = (CNode*)PyList_GET_ITEM(nodes, i);
    acc += node->entry == Py_None;
    acc += node->executed;
    acc += node->index & 1;
    for (int j = 0; j < node->n_args; ++j)
      if (node->ref_mask >> j & 1) { acc += (intptr_t)node->args[j] & 0xff; acc += node->outs[j]; }
    acc += node->n_consumers;
    acc += node->live;
    acc += Py_SIZE(SLOT(node->storage0, s_readers));
  }
  return PyLong_FromLongLong(acc);
}

// bind + release as bind.cpp does: last to first, each node's entry dropped (freed if nothing
// else holds it). `old`: today's slots written as bind writes them.
static PyObject* release(PyObject* self, PyObject* args) {
  PyObject* nodes; int old;
  if (!PyArg_ParseTuple(args, "Oi", &nodes, &old)) return NULL;
  Py_ssize_t n = PyList_GET_SIZE(nodes);
  PyObject* empty = PyTuple_New(0);
  for (Py_ssize_t i = n - 1; i >= 0; --i) {
    PyObject* node = PyList_GET_ITEM(nodes, i);
    if (old) {
      PyObject* t;
      t = SLOT(node, n_executed); SLOT(node, n_executed) = Py_NewRef(Py_True); Py_DECREF(t);
      t = SLOT(node, n_leaves); SLOT(node, n_leaves) = Py_NewRef(Py_None); Py_DECREF(t);
      t = SLOT(node, n_consumers); SLOT(node, n_consumers) = old == 2 ? PyLong_FromLong(0) : Py_NewRef(empty); Py_DECREF(t);
    } else {
      CNode* c = (CNode*)node;
      c->executed = 1;
      for (int j = 0; j < c->n_args; ++j) Py_CLEAR(c->args[j]);
      c->n_args = 0; c->n_consumers = 0;
    }
    PyList_SET_ITEM(nodes, i, Py_NewRef(Py_None));
    Py_DECREF(node);
  }
  Py_DECREF(empty);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS, ""}, {"set_noise", set_noise, METH_O, ""}, {"build_old", build_old, METH_VARARGS, ""},
    {"build_new", build_new, METH_VARARGS, ""}, {"walk_old", walk_old, METH_O, ""},
    {"walk_new", walk_new, METH_O, ""}, {"build_mid", build_mid, METH_VARARGS, ""}, {"walk_mid", walk_mid, METH_O, ""}, {"release", release, METH_VARARGS, ""}, {NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "proto", NULL, -1, methods};
PyMODINIT_FUNC PyInit_proto(void) {
  CNodeType.tp_basicsize = offsetof(CNode, args);
  CNodeType.tp_weaklistoffset = offsetof(CNode, weaklist);
  if (PyType_Ready(&CNodeType) < 0) return NULL;
  return PyModule_Create(&mod);
}
