// Binding a run's results back to its nodes (genie.executor._bind), natively; and the step's
// extra targets (genie.executor.with_step), at the end.
//
// After a tape runs, every node of its slice gets the values of its output slots that the run
// kept, is marked executed, and drops what only a pending node needs: its argument list (so the
// graph above it can be freed: memory stays flat in long loops), its consumer list and its
// entries in the pending writes of the storages it wrote. A decode step binds ~660 nodes, a
// 2,000-op chain 2,000: in Python that loop cost ~2 µs per node, here ~0.2.
//
// Semantics are those of the Python loop in genie/executor.py (kept as the reference, and used
// when a tape's slots are already built): node i takes `outs[i]`'s slots, in output order.
//
// `release`: the caller is done with the `nodes` list (genie.executor.run_tape drops the tape
// right after): the nodes are bound from the last to the first and each one's entry in the list
// becomes None once it is bound (see the end of the loop). The effects on each node are the same
// in either order (a node's own slots, its own entries in pending-write lists, its own output
// storages' reader lists).
#include <Python.h>

#include <algorithm>
#include <array>
#include <unordered_set>
#include <utility>

#include <c10/util/SmallVector.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include "bind.h"
#include "gccount.h"
#include "node.h"
#include "slots.h"

namespace py = pybind11;

namespace {

// genie.graph.Node's slots this loop writes, by offset (found once): a generic setattr per field
// cost more than the rest of binding a node.
struct NodeSlots {
  PyTypeObject* node = nullptr;
  PyTypeObject* storage = nullptr;
  PyTypeObject* meta = nullptr;  // genie.graph.TensorMeta
  Py_ssize_t values = 0, executed = 0, consumers = 0, writes = 0, storages = 0;
  Py_ssize_t readers = 0, pending = 0;
  Py_ssize_t outputs = 0, wref = 0, index = 0, metas = 0;
  Py_ssize_t meta_index = 0;
};

const NodeSlots& node_slots() {
  static const NodeSlots s = [] {
    py::module_ graph = py::module_::import("genie.graph");
    NodeSlots r;
    r.node = reinterpret_cast<PyTypeObject*>(py::object(graph.attr("Node")).release().ptr());  // kept
    r.storage = reinterpret_cast<PyTypeObject*>(py::object(graph.attr("Storage")).release().ptr());
    r.meta = reinterpret_cast<PyTypeObject*>(py::object(graph.attr("TensorMeta")).release().ptr());
    r.values = genie::slot_offset(r.node, "values");
    r.executed = genie::slot_offset(r.node, "executed");
    r.consumers = genie::slot_offset(r.node, "n_consumers");
    r.writes = genie::slot_offset(r.node, "writes");
    r.storages = genie::slot_offset(r.node, "_st");
    r.readers = genie::slot_offset(r.storage, "readers");
    r.pending = genie::slot_offset(r.storage, "pending_writes");
    r.metas = genie::slot_offset(r.node, "metas");
    r.meta_index = genie::slot_offset(r.meta, "index");
    r.outputs = genie::slot_offset(r.node, "_out");
    r.wref = genie::slot_offset(r.node, "_wref");
    r.index = genie::slot_offset(r.node, "index");
    return r;
  }();
  return s;
}

// Prefetching. Binding runs right after a replay, which streams a model's weights through the
// caches (340 MB for a GPT-2 12 x 768 decode step): every node, argument list, Ref and storage
// that the loop below and the nodes' teardown after it touch (recorded before the replay) is then
// a cache miss, one at a time (a decode step's 530 nodes: ~0.9 us each to bind, ~0.6 more to
// free). The loop asks for them a few nodes ahead, so the misses overlap: per decode step,
// binding 405-490 -> 380 us and the teardown when the tape is dropped 300-350 -> 250-270 (medians
// of 60 steps, three runs each, load ~3). A variant that prefetched only each object's first
// line, without reading its type, saved nothing; reading the type waited for the line, though
// (see prefetch_blind: the GC header and two lines, unread, one stage before anything reads them).
// CPython's GC header before a tracked object (two words; PyGC_Head is internal in 3.11).
constexpr size_t kGCHead = 2 * sizeof(void*);

inline void prefetch(const void* p) {
  __builtin_prefetch(p, 1, 3);
}

// A list's or tuple's item array (the items themselves: `items` true).
inline void prefetch_items(PyObject* seq, bool items) {
  if (seq == nullptr) {
    return;
  }
  PyObject** v = nullptr;
  Py_ssize_t n = 0;
  if (PyList_CheckExact(seq)) {
    v = reinterpret_cast<PyListObject*>(seq)->ob_item;
    n = PyList_GET_SIZE(seq);
  } else if (PyTuple_CheckExact(seq)) {
    v = &PyTuple_GET_ITEM(seq, 0);
    n = PyTuple_GET_SIZE(seq);
  }
  if (v == nullptr || n == 0) {
    return;
  }
  if (!items) {
    for (Py_ssize_t j = 0; j < n; j += 8) {
      prefetch(v + j);
    }
    return;
  }
  for (Py_ssize_t j = 0; j < n && j < 16; ++j) {
    prefetch(v[j]);
  }
}

// The object at `o` without reading it: its GC header (if it has one: the line before is
// fetched either way) and its first two lines. (Reading its type to size the fetch, as this did
// before, waits for the very line being fetched: perf put a third of binding's own time in a
// GPT-2 4 x 128 generate token on those reads.)
inline void prefetch_blind(PyObject* o) {
  if (o == nullptr) {
    return;
  }
  const char* b = reinterpret_cast<const char*>(o);
  prefetch(b - kGCHead);
  prefetch(b);
  prefetch(b + 64);
}

// Stage `stage` of prefetching node `node` (see bind_nodes): 0, the node; 1, the objects its
// slots hold that binding or freeing it touches; 2, the item arrays of its argument, storage and
// output lists; 3, their items (Refs, storages, weak references); 4, its storages' reader lists.
// Each stage reads only what an earlier one fetched.
void prefetch_node(PyObject* node, int stage, const NodeSlots& ns) {
  if (stage == 0) {  // (its type is not read: that would wait for the line)
    const char* b = reinterpret_cast<const char*>(node);
    prefetch(b - kGCHead);
    for (size_t at = 0; at < sizeof(genie::NodeObject) + 64; at += 64) {  // and its first leaves
      prefetch(b + at);
    }
    return;
  }
  if (Py_TYPE(node) != ns.node) {
    return;
  }
  static constexpr Py_ssize_t NodeSlots::*kLists[] = {&NodeSlots::storages, &NodeSlots::outputs};
  if (stage == 1) {
    // the leaves (producer nodes, constants): their reference counts drop when it is released
    const Py_ssize_t k = std::min<Py_ssize_t>(genie::node_n_leaves(node), 16);
    for (Py_ssize_t p = 0; p < k; ++p) {
      prefetch(genie::node_leaf_array(node)[p]);
    }
    static constexpr Py_ssize_t NodeSlots::*kHeld[] = {&NodeSlots::storages, &NodeSlots::outputs,
                                                       &NodeSlots::wref, &NodeSlots::index};
    for (Py_ssize_t NodeSlots::*f : kHeld) {
      prefetch_blind(genie::slot_value(node, ns.*f));
    }
    return;
  }
  if (stage == 2 || stage == 3) {
    for (Py_ssize_t NodeSlots::*f : kLists) {
      prefetch_items(genie::slot_value(node, ns.*f), stage == 3);
    }
    return;
  }
  PyObject* storages = genie::slot_value(node, ns.storages);
  if (storages == nullptr) {
    return;
  }
  for (Py_ssize_t j = 0; j < genie::per_output_count(storages) && j < 16; ++j) {
    PyObject* st = genie::per_output(storages, j);
    if (Py_TYPE(st) == ns.storage) {
      prefetch_blind(genie::slot_value(st, ns.readers));
    }
  }
}

// Set the slot at `off` of `o` to `v` (a new reference is taken); the old value is released
// last, as a setattr does.
inline void set_slot(PyObject* o, Py_ssize_t off, PyObject* v) {
  PyObject** p = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
  PyObject* old = *p;
  Py_INCREF(v);
  *p = v;
  Py_XDECREF(old);
}

// A new reference to the slot at `off` of `o`, or nullptr with AttributeError when unset.
inline PyObject* get_slot(PyObject* o, Py_ssize_t off, const char* name) {
  PyObject* v = genie::slot_value(o, off);
  if (v == nullptr) {
    PyErr_Format(PyExc_AttributeError, "'%s' object has no attribute '%s'", Py_TYPE(o)->tp_name,
                 name);
    return nullptr;
  }
  Py_INCREF(v);
  return v;
}

PyObject* attr(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_GetAttr(o, name);
  if (r == nullptr) {
    throw py::error_already_set();
  }
  return r;
}

PyObject* checked(PyObject* o) {
  if (o == nullptr) {
    throw py::error_already_set();
  }
  return o;
}

void set_attr(PyObject* o, PyObject* name, PyObject* value) {
  if (PyObject_SetAttr(o, name, value) < 0) {
    throw py::error_already_set();
  }
}

}  // namespace

namespace genie {

// Returns how many pending-write entries were removed (the caller lowers
// genie.graph.pending_total by it).
int64_t bind_nodes(const py::list& nodes, const py::list& outs, const py::dict& kept,
                   int64_t prune_at, bool untrack, bool release) {
  static PyObject* const values_name = PyUnicode_InternFromString("values");
  static PyObject* const executed_name = PyUnicode_InternFromString("executed");
  static PyObject* const leaves_name = PyUnicode_InternFromString("leaves");
  static PyObject* const consumers_name = PyUnicode_InternFromString("n_consumers");
  static PyObject* const writes_name = PyUnicode_InternFromString("writes");
  static PyObject* const storages_name = PyUnicode_InternFromString("storages");
  static PyObject* const pending_name = PyUnicode_InternFromString("pending_writes");
  static PyObject* const readers_name = PyUnicode_InternFromString("readers");
  static PyObject* const prune_name = PyUnicode_InternFromString("prune_readers");

  const Py_ssize_t n = PyList_GET_SIZE(nodes.ptr());
  if (PyList_GET_SIZE(outs.ptr()) != n) {
    throw py::value_error("genie._C._bind_nodes: nodes and outs differ in length");
  }
  const NodeSlots& ns = node_slots();
  const py::object no_consumers = py::reinterpret_steal<py::object>(checked(PyLong_FromLong(0)));
  std::array<py::object, 8> nones;  // (None,) * k, made once per call for each length k used
  int64_t removed = 0;
  // what the nodes freed here were taken off at allocation is not taken off the count again
  const int young = genie::gc_young();
  // Prefetch distances: node i + 20 is fetched, i + 16's containers, i + 12's item arrays,
  // i + 8's items, i + 4's storages' reader lists (each stage reads what one before fetched);
  // with `release`, the nodes are bound last first, so "ahead" is i - 20 and so on.
  constexpr Py_ssize_t kAhead[] = {20, 16, 12, 8, 4};
  constexpr int kStages = sizeof(kAhead) / sizeof(kAhead[0]);
  const Py_ssize_t step = release ? -1 : 1;
  const auto at = [&](Py_ssize_t q) { return release ? n - 1 - q : q; };  // q-th node bound
  for (Py_ssize_t q = 0; q < n && q < kAhead[0]; ++q) {
    prefetch_node(PyList_GET_ITEM(nodes.ptr(), at(q)), 0, ns);
  }
  for (Py_ssize_t q = 0; q < n; ++q) {
    const Py_ssize_t i = at(q);
    for (int stage = 0; stage < kStages; ++stage) {
      if (q + kAhead[stage] < n) {
        prefetch_node(PyList_GET_ITEM(nodes.ptr(), i + step * kAhead[stage]), stage, ns);
      }
    }
    PyObject* node = PyList_GET_ITEM(nodes.ptr(), i);
    PyObject* slots = PyList_GET_ITEM(outs.ptr(), i);
    if (!PyTuple_Check(slots)) {
      throw py::type_error("genie._C._bind_nodes: output slots must be tuples");
    }
    const Py_ssize_t k = PyTuple_GET_SIZE(slots);
    // The values the run kept for this node's outputs; a node none of whose values was kept
    // (most of a slice: intermediates) gets a tuple of Nones, shared for its length, instead of
    // a new list (nothing ever writes into one: genie.remote.placement replaces a kept value).
    c10::SmallVector<PyObject*, 4> got;  // borrowed from `kept`
    bool any = false;
    for (Py_ssize_t j = 0; j < k; ++j) {
      PyObject* s = PyTuple_GET_ITEM(slots, j);
      PyObject* v = Py_None;
      if (s != Py_None) {
        v = PyDict_GetItemWithError(kept.ptr(), s);  // borrowed
        if (v == nullptr) {
          if (PyErr_Occurred()) {
            throw py::error_already_set();
          }
          v = Py_None;
        }
      }
      any = any || v != Py_None;
      got.push_back(v);
    }
    py::object vals;
    if (!any && k < static_cast<Py_ssize_t>(nones.size())) {
      if (!nones[k]) {
        nones[k] = py::reinterpret_steal<py::object>(checked(PyTuple_New(k)));
        for (Py_ssize_t j = 0; j < k; ++j) {
          PyTuple_SET_ITEM(nones[k].ptr(), j, Py_NewRef(Py_None));
        }
      }
      vals = nones[k];
    } else {
      const int before = genie::gc_young();
      vals = py::reinterpret_steal<py::object>(checked(PyList_New(k)));
      for (Py_ssize_t j = 0; j < k; ++j) {
        PyList_SET_ITEM(vals.ptr(), j, Py_NewRef(got[j]));
      }
      if (untrack) {
        // Off the cyclic GC: a list of real tensors (or None) closes no cycle. Tracked, a step's
        // list per node survives the young collections its own allocation triggers and is
        // promoted, which makes the interpreter run full collections over the whole heap
        // (~100 ms with torch and a model loaded) every few steps. Off the young count too,
        // where its allocation counted (csrc/gccount.cpp).
        genie::gc_untrack_new(vals.ptr(), before);
      }
    }
    // A node that ran has no pending consumer to count (n_consumers: 0).
    const bool fast = Py_TYPE(node) == ns.node;
    if (fast) {
      set_slot(node, ns.values, vals.ptr());
      set_slot(node, ns.executed, Py_True);
      genie::node_release_leaves(node);  // graph truncation: what only this node held goes
      set_slot(node, ns.consumers, no_consumers.ptr());
    } else {
      set_attr(node, values_name, vals.ptr());
      set_attr(node, executed_name, Py_True);
      set_attr(node, leaves_name, Py_None);
      set_attr(node, consumers_name, no_consumers.ptr());
    }

    py::object writes = py::reinterpret_steal<py::object>(
        fast ? checked(get_slot(node, ns.writes, "writes")) : attr(node, writes_name));
    if (PyTuple_Check(writes.ptr()) && PyTuple_GET_SIZE(writes.ptr()) > 0) {
      const Py_ssize_t w = PyTuple_GET_SIZE(writes.ptr());
      for (Py_ssize_t j = 0; j < w; ++j) {
        PyObject* st = PyTuple_GET_ITEM(writes.ptr(), j);
        py::object pw = py::reinterpret_steal<py::object>(attr(st, pending_name));
        if (!PyList_Check(pw.ptr())) {
          continue;
        }
        const Py_ssize_t m = PyList_GET_SIZE(pw.ptr());
        for (Py_ssize_t q = 0; q < m; ++q) {
          if (PyList_GET_ITEM(pw.ptr(), q) == node) {  // list.remove: the first, by identity
            if (PySequence_DelItem(pw.ptr(), q) < 0) {
              throw py::error_already_set();
            }
            ++removed;
            break;
          }
        }
      }
    }
    // Readers that ran are dead weight; only long lists are pruned here (short ones are left to
    // Storage.add_reader's pruning at doubling, which bounds them).
    py::object storages = py::reinterpret_steal<py::object>(
        fast ? checked(get_slot(node, ns.storages, "storages")) : attr(node, storages_name));
    {  // (a single output's storage is held inline: slots.h per_output)
      const Py_ssize_t m = genie::per_output_count(storages.ptr());
      for (Py_ssize_t j = 0; j < m; ++j) {
        PyObject* st = genie::per_output(storages.ptr(), j);
        if (st == Py_None) {
          continue;
        }
        py::object readers = py::reinterpret_steal<py::object>(
            Py_TYPE(st) == ns.storage ? checked(get_slot(st, ns.readers, "readers"))
                                      : attr(st, readers_name));
        if (PyList_Check(readers.ptr()) && PyList_GET_SIZE(readers.ptr()) >= prune_at) {
          py::object r = py::reinterpret_steal<py::object>(
              PyObject_CallMethodNoArgs(st, prune_name));
          if (!r) {
            throw py::error_already_set();
          }
        }
      }
    }
    if (release) {
      // The list's reference goes now, while the node and what it holds are in the cache: the
      // consumers in the slice (bound before it, in reverse order) dropped their Refs to it, so
      // a node nothing else holds (an intermediate) is freed here rather than when the tape is
      // dropped, by then out of the cache on a long tape.
      storages = py::object();
      writes = py::object();
      PyList_SET_ITEM(nodes.ptr(), i, Py_NewRef(Py_None));
      Py_DECREF(node);
    }
  }
  genie::gc_young_at_least(young);
  return removed;
}

}  // namespace genie

namespace {

// A new reference to `o.name`, or nullptr (no error) when `o` has no such attribute: without
// making the AttributeError a plain getattr raises (and clears) for it, as getattr(o, name, None)
// does (an optimizer's CPU `step` tensors, one per parameter of an AdamW step, have no `_node`).
PyObject* attr_or_null(PyObject* o, PyObject* name) {
  PyObject* r = nullptr;
  if (_PyObject_LookupAttr(o, name, &r) < 0) {
    throw py::error_already_set();
  }
  return r;
}

// A new reference to the slot at `off` of `o` when `o` is of type `t`, else to `o.name`.
PyObject* field(PyObject* o, PyTypeObject* t, Py_ssize_t off, PyObject* name) {
  if (Py_TYPE(o) == t) {
    PyObject* v = genie::slot_value(o, off);
    if (v != nullptr) {
      return Py_NewRef(v);
    }
  }
  return attr(o, name);
}

// genie.executor.with_step's walk over one optimizer's tensors (genie.context.step_tensors):
// each parameter, its .grad and its state tensors, in the optimizer's order, given to `visit`.
template <typename Visit>
void step_tensors(PyObject* opt, Visit&& visit) {
  static PyObject* const state_name = PyUnicode_InternFromString("state");
  static PyObject* const groups_name = PyUnicode_InternFromString("param_groups");
  static PyObject* const params_name = PyUnicode_InternFromString("params");
  static PyObject* const grad_name = PyUnicode_InternFromString("grad");
  static PyObject* const get_name = PyUnicode_InternFromString("get");
  static PyObject* const values_name = PyUnicode_InternFromString("values");
  py::object state = py::reinterpret_steal<py::object>(attr(opt, state_name));
  py::object groups = py::reinterpret_steal<py::object>(attr(opt, groups_name));
  py::object git = py::reinterpret_steal<py::object>(checked(PyObject_GetIter(groups.ptr())));
  while (PyObject* g = PyIter_Next(git.ptr())) {
    py::object group = py::reinterpret_steal<py::object>(g);
    py::object params =
        py::reinterpret_steal<py::object>(checked(PyObject_GetItem(g, params_name)));
    py::object pit = py::reinterpret_steal<py::object>(checked(PyObject_GetIter(params.ptr())));
    while (PyObject* pp = PyIter_Next(pit.ptr())) {
      py::object p = py::reinterpret_steal<py::object>(pp);
      visit(pp);
      py::object grad = py::reinterpret_steal<py::object>(attr(pp, grad_name));
      if (grad.ptr() != Py_None) {
        visit(grad.ptr());
      }
      py::object st;
      if (PyDict_Check(state.ptr())) {  // dict.get: a defaultdict makes no entry
        PyObject* v = PyDict_GetItemWithError(state.ptr(), pp);
        if (v == nullptr && PyErr_Occurred()) {
          throw py::error_already_set();
        }
        st = py::reinterpret_borrow<py::object>(v != nullptr ? v : Py_None);
      } else {
        st = py::reinterpret_steal<py::object>(
            checked(PyObject_CallMethodOneArg(state.ptr(), get_name, pp)));
      }
      const int nonempty = PyObject_IsTrue(st.ptr());
      if (nonempty < 0) {
        throw py::error_already_set();
      }
      if (nonempty == 0) {
        continue;
      }
      if (PyDict_Check(st.ptr())) {
        Py_ssize_t pos = 0;
        PyObject* k = nullptr;
        PyObject* v = nullptr;
        // (the values are held by the dict, which `st` holds; visit() runs no Python code
        // that could change it but attribute reads of tensors)
        while (PyDict_Next(st.ptr(), &pos, &k, &v)) {
          if (THPVariable_Check(v)) {
            py::object keep = py::reinterpret_borrow<py::object>(v);
            visit(v);
          }
        }
        continue;
      }
      py::object vals =
          py::reinterpret_steal<py::object>(checked(PyObject_CallMethodNoArgs(st.ptr(), values_name)));
      py::object vit = py::reinterpret_steal<py::object>(checked(PyObject_GetIter(vals.ptr())));
      while (PyObject* v = PyIter_Next(vit.ptr())) {
        py::object keep = py::reinterpret_steal<py::object>(v);
        if (THPVariable_Check(v)) {
          visit(v);
        }
      }
    }
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
  }
  if (PyErr_Occurred()) {
    throw py::error_already_set();
  }
}

struct PairHash {
  size_t operator()(const std::pair<PyObject*, Py_ssize_t>& k) const {
    return std::hash<void*>()(k.first) * 31 + static_cast<size_t>(k.second);
  }
};

}  // namespace

namespace genie {

// genie.executor.with_step (the Python loop there is the reference): `targets` followed by
// (node, out) of each tensor the steps of `opts` write that lives on `index` and is pending
// (its node did not run, or a write to its storage did not), each once, in the optimizers'
// order. Per AdamW step of a 4-layer MLP (40 tensors): ~25 us in Python.
py::list step_targets(const py::list& targets, const py::list& opts, int64_t index) {
  static PyObject* const node_name = PyUnicode_InternFromString("_node");
  static PyObject* const out_name = PyUnicode_InternFromString("_out");
  static PyObject* const metas_name = PyUnicode_InternFromString("metas");
  static PyObject* const index_name = PyUnicode_InternFromString("index");
  static PyObject* const executed_name = PyUnicode_InternFromString("executed");
  static PyObject* const storages_name = PyUnicode_InternFromString("storages");
  static PyObject* const pending_name = PyUnicode_InternFromString("pending_writes");
  const NodeSlots& ns = node_slots();
  py::list out = py::reinterpret_steal<py::list>(
      checked(PyList_GetSlice(targets.ptr(), 0, PyList_GET_SIZE(targets.ptr()))));
  std::unordered_set<std::pair<PyObject*, Py_ssize_t>, PairHash> seen;
  const auto as_index = [](PyObject* o) {
    const Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return v;
  };
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(targets.ptr()); ++i) {
    PyObject* t = PyList_GET_ITEM(targets.ptr(), i);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
      throw py::type_error("genie._C._step_targets: targets must be (node, output) pairs");
    }
    seen.emplace(PyTuple_GET_ITEM(t, 0), as_index(PyTuple_GET_ITEM(t, 1)));
  }
  const auto visit = [&](PyObject* t) {
    py::object n = py::reinterpret_steal<py::object>(attr_or_null(t, node_name));
    if (!n || n.ptr() == Py_None) {
      return;
    }
    py::object o = py::reinterpret_steal<py::object>(attr(t, out_name));
    const Py_ssize_t k = as_index(o.ptr());
    py::object metas =
        py::reinterpret_steal<py::object>(field(n.ptr(), ns.node, ns.metas, metas_name));
    py::object meta = py::reinterpret_steal<py::object>(checked(PySequence_GetItem(metas.ptr(), k)));
    py::object idx =
        py::reinterpret_steal<py::object>(field(meta.ptr(), ns.meta, ns.meta_index, index_name));
    const int64_t on = PyLong_AsLongLong(idx.ptr());
    if (on == -1 && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    if (on != index) {
      return;
    }
    py::object ran =
        py::reinterpret_steal<py::object>(field(n.ptr(), ns.node, ns.executed, executed_name));
    const int executed = PyObject_IsTrue(ran.ptr());
    if (executed < 0) {
      throw py::error_already_set();
    }
    if (executed) {
      py::object sts =
          py::reinterpret_steal<py::object>(field(n.ptr(), ns.node, ns.storages, storages_name));
      PyObject* st_k = genie::per_output(sts.ptr(), k);
      if (st_k == nullptr) {
        throw py::index_error("genie._C._step_targets: an output its node does not have");
      }
      py::object st = py::reinterpret_borrow<py::object>(st_k);
      py::object pw =
          py::reinterpret_steal<py::object>(field(st.ptr(), ns.storage, ns.pending, pending_name));
      const int pending = PyObject_IsTrue(pw.ptr());
      if (pending < 0) {
        throw py::error_already_set();
      }
      if (!pending) {
        return;
      }
    }
    if (seen.emplace(n.ptr(), k).second) {
      py::object pair = py::reinterpret_steal<py::object>(checked(PyTuple_Pack(2, n.ptr(), o.ptr())));
      if (PyList_Append(out.ptr(), pair.ptr()) < 0) {
        throw py::error_already_set();
      }
    }
  };
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(opts.ptr()); ++i) {
    py::object opt = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(opts.ptr(), i));
    step_tensors(opt.ptr(), visit);
  }
  return out;
}

}  // namespace genie
