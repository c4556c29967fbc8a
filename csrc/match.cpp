// The plan cache's column match (genie.plan_cache.match), its per-node part natively.
//
// A plan-cache hit is found from the requested values alone: the plan's in-plan argument
// references say, from the last instruction back, which node each instruction is (found through
// the argument references of the targets and of later nodes; an in-place update through the
// storages' pending writes at the plan's sites), and then every condition of a hit is checked
// over the found nodes (genie.plan_cache.match says them): the node's meta-cache entry is the
// plan's (identity), no node ran, every reference points where the plan's does, record order,
// source lines, the pending writes on the storages the slice reads (none before a read for a plan
// that does not write; exactly the plan's for one that does, with no pending reader before them
// outside the slice), which outputs are held by a live tensor or a pending consumer, float
// arguments that changed, and the input values bound to the plan's input slots. The Python
// version does this with ~15 `map` passes over columns (~2.4 µs per node on a GPT-2 decode
// step); here it is one pass over the instructions that checks each node while its memory is at
// hand, then one over the inputs. The cost is the nodes' memory: a slice that does not fit the
// caches (a 32-token generate's 6,480 nodes) paid a cache miss per condition per node with one
// pass per condition (0.75 µs per node; one pass: see bench/bench_models.py's lookup split).
//
// Contract: the same answer as the Python function (genie.plan_cache._match_core_py, kept as the
// reference; GENIE_NATIVE_MATCH=0 uses it): None (not this plan: the caller slices and
// instantiates) or (found nodes, shaped instructions, changed float columns, input slots as a
// flat [node, out, slot, ...] list, input values by slot). Constants and TensorMetas are compared by
// slice.cpp's native same_const / TensorMeta equality / same_kind / held_after (Python's for
// anything else); _entryless (nodes recorded without a meta-cache entry) is a Python callback.
// tests/unit/test_plan_cache.py compares the two on every outcome of its programs.
#include <Python.h>
#include <structmember.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

#include "match.h"
#include "slice.h"
#include "node.h"
#include "slots.h"

namespace py = pybind11;

namespace {

struct State {
  bool ready = false;
  PyTypeObject* node = nullptr;
  PyTypeObject* ref = nullptr;
  PyTypeObject* storage = nullptr;
  Py_ssize_t n_entry = 0, n_executed = 0, n_index = 0, n_where = 0,
             n_storages = 0, n_consumers = 0, n_outputs = 0, n_values = 0, n_metas = 0;
  Py_ssize_t r_node = 0, r_out = 0;
  Py_ssize_t st_pending = 0, st_readers = 0;
  PyObject* held_after = nullptr;
  PyObject* same_kind = nullptr;
  PyObject* klass = nullptr;  // interned "klass"
  PyTypeObject* klass_type = nullptr;  // the entry class whose "klass" slot is at klass_off
  Py_ssize_t klass_off = 0;
};

State S;

// A __slots__ member read by offset: borrowed, nullptr when unset.
inline PyObject* slot(PyObject* o, Py_ssize_t off) {
  return genie::slot_value(o, off);
}

inline bool is_node(PyObject* o) {
  return o != nullptr && Py_TYPE(o) == S.node;
}

// Index `i` of list `l` if it is a list long enough: borrowed, nullptr otherwise.
inline PyObject* item(PyObject* l, Py_ssize_t i) {
  if (l == nullptr || !PyList_CheckExact(l) || i < 0 || i >= PyList_GET_SIZE(l)) {
    return nullptr;
  }
  return PyList_GET_ITEM(l, i);
}

// Leaf `p` of node `n` (is_node): the producer node of a lazy input, `*out` its output number;
// nullptr for a constant, out of range, or released.
inline PyObject* input_at(PyObject* n, Py_ssize_t p, Py_ssize_t* out) {
  int32_t o = -1;
  PyObject* x = genie::node_leaf(n, p, &o);
  *out = o;
  return o >= 0 ? x : nullptr;
}

// Output `k`'s item of a node's `_st` or `_out` (slots.h per_output), or nullptr.
inline PyObject* out_item(PyObject* v, Py_ssize_t k) {
  return v == nullptr ? nullptr : genie::per_output(v, k);
}

Py_ssize_t as_index(PyObject* o) {
#if PY_VERSION_HEX < 0x030C0000
  // An exact int of at most one digit (node indices below 2**30, outputs, positions), read in
  // place: the conversion call per reference, node and reader was ~12% of a warm match of a
  // training step (AdamW's plan reads ~540 storage readers).
  if (PyLong_CheckExact(o)) {
    const Py_ssize_t size = Py_SIZE(o);
    const digit d = reinterpret_cast<PyLongObject*>(o)->ob_digit[0];
    if (size == 0) {
      return 0;
    }
    if (size == 1) {
      return static_cast<Py_ssize_t>(d);
    }
    if (size == -1) {
      return -static_cast<Py_ssize_t>(d);
    }
  }
#endif
  Py_ssize_t v = PyLong_AsSsize_t(o);
  if (v == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return v;
}

std::vector<Py_ssize_t> ints(PyObject* seq) {
  if (!PyList_CheckExact(seq)) {
    throw py::type_error("genie._C._match_core: plan columns must be lists");
  }
  std::vector<Py_ssize_t> out(PyList_GET_SIZE(seq));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = as_index(PyList_GET_ITEM(seq, i));
  }
  return out;
}

// The integer columns of a Plan.flat, converted once per plan: a 2,000-node plan has ~10 columns
// of ~2,000 ints, and converting them on every match cost ~0.4k instructions per node. Keyed by
// the tuple's identity, which the entry holds (so the address is not reused while it is a key);
// Plan.flat and its lists are never changed after genie.plan_cache._flatten builds them. A few
// plans (the ones a loop alternates between) are kept; the oldest goes first. Shared: a match
// holds its plan's columns while Python callbacks (which may match another plan) run.
struct Columns {
  PyObject* flat = nullptr;  // held
  std::vector<Py_ssize_t> ei, ep, ej, ek, fi, fp, hi, hk, hn, roots, oi, ok;
  // Plan.wsite (a plan that writes): sites (wi, wp), their expected writers wpos[wstart[k]:...],
  // and the requested values' (tw: tstart into tpos_w)
  bool writes = false;
  std::vector<Py_ssize_t> wi, wp, wstart, wpos, tstart, twpos;
  bool grouped = false;  // ei, fi, hi, oi and wi grouped by instruction, from the last one back
  Columns() = default;
  Columns(const Columns&) = delete;
  Columns& operator=(const Columns&) = delete;
  ~Columns() {
    Py_XDECREF(flat);
  }
};

constexpr size_t kRecentPlans = 8;
std::vector<std::shared_ptr<const Columns>>& recent_columns() {
  static auto* r = new std::vector<std::shared_ptr<const Columns>>();  // never destroyed: holds refs
  return *r;
}

std::shared_ptr<const Columns> columns_of(PyObject* flat) {
  auto& recent = recent_columns();
  for (const auto& c : recent) {
    if (c->flat == flat) {
      return c;
    }
  }
  PyObject* const* col = &PyTuple_GET_ITEM(flat, 0);
  auto c = std::make_shared<Columns>();
  c->ei = ints(col[0]);
  c->ep = ints(col[1]);
  c->ej = ints(col[2]);
  c->ek = ints(col[3]);
  c->fi = ints(col[5]);
  c->fp = ints(col[6]);
  c->hi = ints(col[9]);
  c->hk = ints(col[10]);
  c->hn = ints(col[11]);
  c->roots = ints(col[13]);
  PyObject* ws = col[16];
  if (ws != Py_None) {
    if (!PyTuple_Check(ws) || PyTuple_GET_SIZE(ws) != 5) {
      throw py::type_error("genie._C._match_core: Plan.wsite must be 5 columns");
    }
    c->writes = true;
    c->wi = ints(PyTuple_GET_ITEM(ws, 0));
    c->wp = ints(PyTuple_GET_ITEM(ws, 1));
    c->wstart = ints(PyTuple_GET_ITEM(ws, 2));
    c->wpos = ints(PyTuple_GET_ITEM(ws, 3));
    PyObject* tw = PyTuple_GET_ITEM(ws, 4);
    if (!PyList_CheckExact(tw) || c->wstart.size() != c->wi.size() + 1 ||
        c->wp.size() != c->wi.size()) {
      throw py::type_error("genie._C._match_core: Plan.wsite's columns do not agree");
    }
    c->tstart.push_back(0);
    for (Py_ssize_t t = 0; t < PyList_GET_SIZE(tw); ++t) {
      PyObject* e = PyList_GET_ITEM(tw, t);
      if (!PyTuple_Check(e)) {
        throw py::type_error("genie._C._match_core: Plan.wsite's targets must be tuples");
      }
      for (Py_ssize_t q = 0; q < PyTuple_GET_SIZE(e); ++q) {
        c->twpos.push_back(as_index(PyTuple_GET_ITEM(e, q)));
      }
      c->tstart.push_back(static_cast<Py_ssize_t>(c->twpos.size()));
    }
    for (size_t k = 0; k + 1 < c->wstart.size(); ++k) {
      if (c->wstart[k] > c->wstart[k + 1] ||
          c->wstart[k + 1] > static_cast<Py_ssize_t>(c->wpos.size())) {
        throw py::type_error("genie._C._match_core: Plan.wsite's columns do not agree");
      }
    }
  }
  PyObject* other = col[12];
  if (!PyList_CheckExact(other)) {
    throw py::type_error("genie._C._match_core: plan columns must be lists");
  }
  for (Py_ssize_t m = 0; m < PyList_GET_SIZE(other); ++m) {
    PyObject* ik = PyList_GET_ITEM(other, m);
    if (!PyTuple_Check(ik) || PyTuple_GET_SIZE(ik) != 2) {
      throw py::type_error("genie._C._match_core: Plan.flat's kept outputs must be (i, k) pairs");
    }
    c->oi.push_back(as_index(PyTuple_GET_ITEM(ik, 0)));
    c->ok.push_back(as_index(PyTuple_GET_ITEM(ik, 1)));
  }
  auto descending = [](const std::vector<Py_ssize_t>& v) {
    return std::is_sorted(v.rbegin(), v.rend());
  };
  c->grouped = descending(c->ei) && descending(c->fi) && descending(c->hi) &&
                descending(c->oi) && descending(c->wi);
  Py_INCREF(flat);
  c->flat = flat;
  std::shared_ptr<const Columns> old;  // released after the cache is consistent again
  if (recent.size() >= kRecentPlans) {
    old = std::move(recent.front());
    recent.erase(recent.begin());
  }
  recent.push_back(c);
  return c;
}

// What weak reference `r` refers to (Py_None once it died): borrowed; for anything but a plain
// weakref.ref, the result of calling it, held by `keep`.
PyObject* held_by(PyObject* r, py::object& keep) {
  if (PyWeakref_CheckRefExact(r)) {
    return PyWeakref_GET_OBJECT(r);
  }
  keep = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(r));
  if (!keep) {
    throw py::error_already_set();
  }
  return keep.ptr();
}

// Whether output item `r` (a node's `_out`, per output) may be held by a live tensor: a positive
// count (node.h out_counted), or a capture graph's weak reference whose tensor lives (it may since
// be another node's: held_after decides).
bool maybe_held(PyObject* r, py::object& keep) {
  if (genie::out_counted(r)) {
    return true;
  }
  return r != Py_None && !PyLong_CheckExact(r) && held_by(r, keep) != Py_None;
}

// A meta-cache entry's shape class (genie.meta.MetaEntry.klass): a new reference, nullptr when it
// has none. Read by offset from MetaEntry's slot (an attribute lookup walks the class's MRO).
PyObject* klass_of(PyObject* e) {
  PyTypeObject* t = Py_TYPE(e);
  if (S.klass_type == nullptr) {
    try {
      S.klass_off = genie::slot_offset(t, "klass");
      Py_INCREF(t);  // kept for the process
      S.klass_type = t;
    } catch (const std::runtime_error&) {  // a subclass (inherited slot): looked up below
    }
  }
  if (t == S.klass_type) {
    PyObject* k = slot(e, S.klass_off);
    Py_XINCREF(k);
    return k;
  }
  PyObject* k = PyObject_GetAttr(e, S.klass);
  if (k == nullptr) {
    PyErr_Clear();
  }
  return k;
}

// Ask for the first `lines` cache lines of `o` ahead of their use: the nodes of a slice and the
// values it reads are cold when a step is matched (recording and the previous replay ran since),
// and a load that waits for one stalls the pass, while prefetches of independent objects overlap.
inline void prefetch(const void* o, int lines = 1) {
  const char* p = static_cast<const char*>(o);
  for (int l = 0; l < lines; ++l) {
    __builtin_prefetch(p + 64 * l);
  }
}

// The items of list `l` from `k` on, when it is a list that long (a no-op otherwise).
inline void prefetch_item(PyObject* l, Py_ssize_t k) {
  if (l != nullptr && PyList_CheckExact(l) && k >= 0 && k < PyList_GET_SIZE(l)) {
    prefetch(&PyList_GET_ITEM(l, k));
  }
}

bool truthy(PyObject* o) {
  const int r = PyObject_IsTrue(o);
  if (r < 0) {
    throw py::error_already_set();
  }
  return r == 1;
}

// A storage of `n`'s output `k` with a pending write (a non-empty pending_writes list).
bool pending_on(PyObject* n, Py_ssize_t k, bool& ok) {
  PyObject* st = out_item(slot(n, S.n_storages), k);
  if (st == nullptr || Py_TYPE(st) != S.storage) {
    ok = false;
    return false;
  }
  PyObject* pw = slot(st, S.st_pending);
  if (pw == nullptr) {
    ok = false;
    return false;
  }
  return truthy(pw);
}

// The pending writes of Storage `st` (a list or the shared empty tuple): borrowed, nullptr when
// `st` is not a Storage or the slot holds anything else.
PyObject* pending_list(PyObject* st) {
  if (st == nullptr || Py_TYPE(st) != S.storage) {
    return nullptr;
  }
  PyObject* pw = slot(st, S.st_pending);
  if (pw == nullptr || !(PyList_CheckExact(pw) || PyTuple_CheckExact(pw))) {
    return nullptr;
  }
  return pw;
}

// Node.index of a node.
inline Py_ssize_t index_of(PyObject* n) {
  return as_index(slot(n, S.n_index));
}

// Whether a pending write on the storage of `xn`'s output `k` was recorded before node `reader`
// (ok = false when a slot holds what this does not read).
bool written_before(PyObject* xn, Py_ssize_t k, PyObject* reader, bool& ok) {
  PyObject* pw = pending_list(out_item(slot(xn, S.n_storages), k));
  if (pw == nullptr || !is_node(reader)) {
    ok = false;
    return false;
  }
  if (Py_SIZE(pw) == 0) {
    return false;
  }
  PyObject* w = PySequence_Fast_GET_ITEM(pw, 0);
  if (!is_node(w)) {
    ok = false;
    return false;
  }
  return index_of(w) < index_of(reader);
}

// Storage.prune_readers on the list `rs` in place: its plain weak references whose node died or
// ran are dropped, the others kept in order. A training step's plan reads each weight's, gradient's
// and optimizer state's reader list (~540 weak references over 60 storages for a 4-layer MLP's
// AdamW step), most of them readers of earlier steps that ran: dropped where the match reads them
// anyway, the next step's match reads only its own (binding prunes only lists of 16 or more).
void drop_gone_readers(PyObject* rs) {
  PyObject** items = reinterpret_cast<PyListObject*>(rs)->ob_item;
  const Py_ssize_t n = PyList_GET_SIZE(rs);
  std::vector<PyObject*> dropped;
  Py_ssize_t w = 0;
  for (Py_ssize_t q = 0; q < n; ++q) {
    PyObject* r = items[q];
    PyObject* rn = PyWeakref_CheckRefExact(r) ? PyWeakref_GET_OBJECT(r) : nullptr;
    if (rn != nullptr &&
        (rn == Py_None || (is_node(rn) && slot(rn, S.n_executed) == Py_True))) {
      dropped.push_back(r);
    } else {
      items[w++] = r;
    }
  }
  Py_SET_SIZE(rs, w);  // (a list may hold fewer items than it has room for)
  for (PyObject* r : dropped) {  // after the list is consistent: a weak reference's dealloc
    Py_DECREF(r);                // runs no Python code, but the list is whole first anyway
  }
}

struct PairHash {
  size_t operator()(const std::pair<PyObject*, Py_ssize_t>& k) const {
    return std::hash<void*>()(k.first) * 31 + static_cast<size_t>(k.second);
  }
};

}  // namespace

namespace genie {

void match_init(py::object node, py::object ref, py::object storage,
                py::object held_after, py::object same_kind) {
  auto type = [](py::object t) {
    if (!PyType_Check(t.ptr())) {
      throw py::type_error("genie._C._match_init: expected a class");
    }
    Py_INCREF(t.ptr());  // kept for the process
    return reinterpret_cast<PyTypeObject*>(t.ptr());
  };
  S.node = type(node);
  S.ref = type(ref);
  S.storage = type(storage);
  S.n_entry = genie::slot_offset(S.node, "entry");
  S.n_executed = genie::slot_offset(S.node, "executed");
  S.n_index = genie::slot_offset(S.node, "index");
  S.n_where = genie::slot_offset(S.node, "where");
  S.n_storages = genie::slot_offset(S.node, "_st");
  S.n_consumers = genie::slot_offset(S.node, "n_consumers");
  S.n_outputs = genie::slot_offset(S.node, "_out");
  S.n_values = genie::slot_offset(S.node, "values");
  S.n_metas = genie::slot_offset(S.node, "metas");
  S.r_node = genie::slot_offset(S.ref, "node");
  S.r_out = genie::slot_offset(S.ref, "out");
  S.st_pending = genie::slot_offset(S.storage, "pending_writes");
  S.st_readers = genie::slot_offset(S.storage, "readers");
  S.held_after = held_after.release().ptr();
  S.same_kind = same_kind.release().ptr();
  S.klass = PyUnicode_InternFromString("klass");
  S.ready = true;
}

py::object match_core(py::tuple flat, py::list entries, py::list klasses, py::object wheres,
                      py::dict produced, py::list want_out, py::list targets, bool generic,
                      bool pending, py::dict pin, py::object entryless) {
  // A plan that writes (Plan.wsite, flat's last column): its in-place updates are found from the
  // storages' pending writes at the sites the plan names (genie.plan_cache._write_sites; the
  // reference is _walk_writes and _writes_exact), and those lists are checked to be exactly the
  // plan's, so the nodes found are slice_nodes' slice; the "no pending write on a storage the
  // slice reads" rule of a plan that does not write is that check with no writes expected.
  if (!S.ready) {
    throw py::type_error("genie._C._match_core: call _match_init first");
  }
  const py::object miss = py::none();  // not this plan (the caller slices)
  if (PyTuple_GET_SIZE(flat.ptr()) != 17) {
    throw py::type_error("genie._C._match_core: flat must be Plan.flat (17 columns)");
  }
  PyObject* const* col = &PyTuple_GET_ITEM(flat.ptr(), 0);
  const std::shared_ptr<const Columns> cols_held = columns_of(flat.ptr());
  const Columns& cols = *cols_held;
  const std::vector<Py_ssize_t>&ei = cols.ei, &ep = cols.ep, &ej = cols.ej, &ek = cols.ek;
  PyObject* ingroups = col[4];
  const std::vector<Py_ssize_t>&fi = cols.fi, &fp = cols.fp;
  PyObject* fv = col[7];
  const std::vector<Py_ssize_t>&hi = cols.hi, &hk = cols.hk, &hn = cols.hn;
  const bool writes = cols.writes;
  if (writes && !pending) {
    return py::none();  // no write pending anywhere: not the slice of a plan that writes
  }
  const bool check_pending = pending && !writes;  // a plan that does not write: no write read

  const Py_ssize_t nn = PyList_GET_SIZE(entries.ptr());
  // Borrowed: every found node is reachable from the targets through argument references the
  // caller holds, and no callback below changes a node's leaves.
  std::vector<PyObject*> found(nn, nullptr);
  const Py_ssize_t nt = PyList_GET_SIZE(targets.ptr());
  if (nt != PyList_GET_SIZE(want_out.ptr())) {
    return py::none();
  }
  std::vector<std::pair<PyObject*, Py_ssize_t>> tg(nt);
  std::vector<Py_ssize_t> tpos(nt);
  for (Py_ssize_t t = 0; t < nt; ++t) {
    PyObject* pair = PyList_GET_ITEM(targets.ptr(), t);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
      return miss;
    }
    PyObject* node = PyTuple_GET_ITEM(pair, 0);
    const Py_ssize_t out = as_index(PyTuple_GET_ITEM(pair, 1));
    PyObject* p = PyDict_GetItemWithError(produced.ptr(), PyList_GET_ITEM(want_out.ptr(), t));
    if (p == nullptr) {
      if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
      if (!writes) {
        return miss;
      }
      tg[t] = {node, out};  // a value that ran, which the plan's writes update: an input
      tpos[t] = -1;
      continue;
    }
    const Py_ssize_t i = as_index(PyTuple_GET_ITEM(p, 0));
    if (out != as_index(PyTuple_GET_ITEM(p, 1)) || i < 0 || i >= nn ||
        (found[i] != nullptr && found[i] != node)) {
      return miss;
    }
    found[i] = node;
    tg[t] = {node, out};
    tpos[t] = i;
  }
  // One pass over the instructions from the last back, each node checked while its memory is
  // at hand (a generate's 6,480-node slice does not fit the caches: one pass per condition read
  // every node's lines again): the walk sets the node of each instruction's producers from its
  // argument references, so an instruction's node is known when the pass reaches it (plan order
  // is record order: producers come first). The outcome is the column passes': a walk that breaks
  // means not this plan at once; so does an instruction no reference reaches, and every other
  // failed condition, once the pass is over.
  if (!cols.grouped) {
    return miss;
  }
  const size_t ne = ei.size(), nf = fi.size(), nh = hi.size(), no = cols.oi.size();
  const std::vector<Py_ssize_t>&oi = cols.oi, &ok = cols.ok;
  bool none = false;    // an instruction no reference reaches
  bool later = false;   // a condition failed: not this plan
  // storages with a write of the slice that a read (or a requested value) waits for, and the
  // index of the last such write: their pending readers before it must be in the slice
  std::vector<std::pair<PyObject*, Py_ssize_t>> upto;
  auto waits = [&upto](PyObject* st, Py_ssize_t last) {
    for (auto& u : upto) {
      if (u.first == st) {
        u.second = std::max(u.second, last);
        return;
      }
    }
    upto.emplace_back(st, last);
  };
  // writes[q] of the pending-write list `pw` at plan positions want[0..len): true when taken
  auto take = [&found](PyObject* pw, const Py_ssize_t* want, Py_ssize_t len, Py_ssize_t below) {
    for (Py_ssize_t q = 0; q < len; ++q) {
      PyObject* w = PySequence_Fast_GET_ITEM(pw, q);
      const Py_ssize_t j = want[q];
      if (!is_node(w) || j < 0 || j >= below || (found[j] != nullptr && found[j] != w)) {
        return false;
      }
      found[j] = w;
    }
    return true;
  };
  const std::vector<Py_ssize_t>&wi = cols.wi, &wp = cols.wp, &wstart = cols.wstart,
                               &wpos = cols.wpos;
  if (writes) {  // a requested value's storage: every pending write is the plan's
    if (static_cast<Py_ssize_t>(cols.tstart.size()) != nt + 1) {
      return miss;
    }
    for (Py_ssize_t t = 0; t < nt; ++t) {
      PyObject* st = out_item(slot(tg[t].first, S.n_storages), tg[t].second);
      PyObject* pw = pending_list(st);
      const Py_ssize_t b = cols.tstart[t], len = cols.tstart[t + 1] - b;
      if (pw == nullptr || Py_SIZE(pw) != len ||
          !take(pw, cols.twpos.data() + b, len, nn)) {
        return miss;
      }
      if (len > 0) {
        waits(st, index_of(PySequence_Fast_GET_ITEM(pw, len - 1)));
      }
    }
  }
  std::vector<Py_ssize_t> shaped_at;  // from the last instruction back
  std::vector<Py_ssize_t> changed_at;
  // held_after decides: (node, output, the slice's references to the node; -1: not counted)
  std::vector<std::tuple<PyObject*, Py_ssize_t, Py_ssize_t>> must_free, must_keep;
  const bool no_where = wheres.is_none();
  if (!no_where && PyList_GET_SIZE(wheres.ptr()) != nn) {
    return miss;
  }
  size_t m = 0, f = 0, h = 0, o = 0, k = 0;
  const size_t nw = wi.size();
  Py_ssize_t next = PY_SSIZE_T_MAX;  // the index of the node after this one: record order
  for (Py_ssize_t i = nn - 1; i >= 0; --i) {
    PyObject* n = found[i];
    const bool consumer = m < ne && ei[m] == i;
    if (consumer && !is_node(n)) {
      return miss;
    }
    if (n == nullptr) {
      none = true;  // not a consumer: one of the plan's roots
    } else if (!is_node(n)) {
      later = true;
    }
    for (; m < ne && ei[m] == i; ++m) {  // the walk
      Py_ssize_t xo = -1;
      PyObject* xn = input_at(n, ep[m], &xo);
      if (xn == nullptr || ej[m] < 0 || ej[m] >= i) {
        return miss;
      }
      if (found[ej[m]] == nullptr) {
        prefetch(xn, 3);  // the pass reaches it soon: the producer comes before its consumer
      }
      PyObject*& at = found[ej[m]];
      if (at != nullptr && at != xn) {
        later = true;  // every reference (and a requested value) must name the same node
      }
      at = xn;
      if (!later) {
        bool fine = true;
        if (xo != ek[m] || (check_pending && (written_before(xn, xo, n, fine) || !fine))) {
          later = true;  // a write recorded before a read of the slice: the slice holds it
        }
      }
    }
    for (; k < nw && wi[k] == i; ++k) {  // a plan that writes: the pending writes each read sees
      if (later || !is_node(n)) {
        continue;
      }
      Py_ssize_t xo = -1;
      PyObject* xn = input_at(n, wp[k], &xo);
      if (!is_node(xn)) {
        later = true;
        continue;
      }
      PyObject* st = out_item(slot(xn, S.n_storages), xo);
      PyObject* pw = pending_list(st);
      const Py_ssize_t b = wstart[k], len = wstart[k + 1] - b;
      if (pw == nullptr || Py_SIZE(pw) < len || !take(pw, wpos.data() + b, len, i)) {
        later = true;
        continue;
      }
      if (Py_SIZE(pw) > len) {  // the next write must come after this read
        PyObject* w = PySequence_Fast_GET_ITEM(pw, len);
        if (!is_node(w) || index_of(w) < index_of(n)) {
          later = true;
          continue;
        }
      }
      if (len > 0) {
        waits(st, index_of(PySequence_Fast_GET_ITEM(pw, len - 1)));
      }
    }
    if (!later && n != nullptr) {
      // Meta-cache entries by identity (op, argument tree, input metadata, non-float constants).
      PyObject* e = slot(n, S.n_entry);
      if (e != PyList_GET_ITEM(entries.ptr(), i)) {
        PyObject* k = generic && e != nullptr && e != Py_None ? klass_of(e) : nullptr;
        if (k != nullptr && k == PyList_GET_ITEM(klasses.ptr(), i) && k != Py_None) {
          shaped_at.push_back(i);
        } else {
          py::object r = entryless(py::int_(i), py::handle(n));
          const Py_ssize_t v = as_index(r.ptr());
          if (v == 0) {
            later = true;
          } else if (v == 2) {
            shaped_at.push_back(i);
          }
        }
        Py_XDECREF(k);
      }
      if (slot(n, S.n_executed) != Py_False) {
        later = true;
      }
      const Py_ssize_t idx = as_index(slot(n, S.n_index));
      if (idx >= next) {
        later = true;
      }
      next = idx;
      PyObject* w = slot(n, S.n_where);
      if (no_where) {
        if (w != nullptr && truthy(w)) {
          later = true;
        }
      } else {
        PyObject* pw = PyList_GET_ITEM(wheres.ptr(), i);
        if (w != pw) {
          const int eq = PyObject_RichCompareBool(w, pw, Py_EQ);
          if (eq < 0) {
            throw py::error_already_set();
          }
          later = later || eq == 0;
        }
      }
    }
    for (; f < nf && fi[f] == i; ++f) {  // float arguments with another value: parameters
      if (later || n == nullptr) {
        continue;
      }
      int32_t xo = -1;
      PyObject* x = is_node(n) ? genie::node_leaf(n, fp[f], &xo) : nullptr;
      if (x == nullptr || xo >= 0) {
        later = true;
      } else if (!genie::constants_same(x, PyList_GET_ITEM(fv, f))) {
        changed_at.push_back(static_cast<Py_ssize_t>(f));
      }
    }
    // Outputs the plan frees: no live tensor, and consumers outside the slice must be dead.
    for (; h < nh && hi[h] == i; ++h) {
      if (later || n == nullptr) {
        continue;
      }
      PyObject* cons = slot(n, S.n_consumers);  // a count (genie.graph.Node.n_consumers)
      PyObject* r = out_item(slot(n, S.n_outputs), hk[h]);
      py::object keep;
      if (cons == nullptr || !PyLong_CheckExact(cons) || r == nullptr) {
        later = true;
      } else if (PyLong_AsSsize_t(cons) != hn[h] ||
                 maybe_held(r, keep)) {
        must_free.push_back({n, hk[h], hn[h]});  // (a capture graph's tensor: still this node's?)
      }
    }
    // Outputs the plan keeps: held by a live tensor, or read by a pending node outside the slice.
    for (; o < no && oi[o] == i; ++o) {
      if (later || n == nullptr) {
        continue;
      }
      PyObject* r = out_item(slot(n, S.n_outputs), ok[o]);
      py::object keep;
      if (r == nullptr) {
        later = true;
      } else if (!genie::out_counted(r)) {
        must_keep.emplace_back(n, ok[o], -1);
      }
    }
  }
  if (m != ne || f != nf || h != nh || o != no || k != nw) {
    return miss;  // columns out of order: not a Plan.flat
  }
  if (none) {
    return py::none();  // an instruction no reference reaches: not this plan's slice
  }
  for (Py_ssize_t t = 0; t < nt; ++t) {
    if (tpos[t] >= 0 && found[tpos[t]] != tg[t].first) {  // the walk rebinds: every reference
      return miss;                                          // must agree
    }
  }
  if (later) {
    return miss;
  }
  if (!upto.empty()) {  // pending readers before a write of the slice: in the slice
    std::vector<Py_ssize_t> at(nn);  // the found nodes' indices, increasing (checked above)
    for (Py_ssize_t i = 0; i < nn; ++i) {
      at[i] = index_of(found[i]);
    }
    for (const auto& [st, last] : upto) {
      PyObject* rs = st == nullptr ? nullptr : slot(st, S.st_readers);
      if (rs == nullptr || !(PyList_CheckExact(rs) || PyTuple_CheckExact(rs))) {
        return miss;
      }
      Py_ssize_t gone = 0;  // readers that died or ran (plain weak references)
      for (Py_ssize_t q = 0; q < Py_SIZE(rs); ++q) {
        py::object keep;
        PyObject* r = PySequence_Fast_GET_ITEM(rs, q);
        PyObject* rn = held_by(r, keep);
        if (!is_node(rn) || slot(rn, S.n_executed) != Py_False) {
          gone += PyWeakref_CheckRefExact(r) &&
                  (rn == Py_None || (is_node(rn) && slot(rn, S.n_executed) == Py_True));
          continue;  // died or ran
        }
        const Py_ssize_t idx = index_of(rn);
        if (idx >= last) {
          continue;
        }
        auto it = std::lower_bound(at.begin(), at.end(), idx);
        if (it == at.end() || *it != idx || found[it - at.begin()] != rn) {
          return miss;
        }
      }
      if (gone > 0 && PyList_CheckExact(rs)) {
        drop_gone_readers(rs);
      }
    }
  }
  if (check_pending) {  // a write waits on a requested value: the slice holds it
    bool fine = true;
    for (const auto& [node, out] : tg) {
      if (pending_on(node, out, fine) || !fine) {
        return miss;
      }
    }
  }
  // The slice's node indices, increasing (record order, checked above), made when a held check
  // needs them: held_after natively (slice.cpp) looks a reader up in them by bisection. The
  // Python set the callback takes is made only where the native one cannot answer (a type it
  // does not read); making it was ~17k PySet_Add per 96 generated tokens of GPT-2 4x128.
  std::vector<Py_ssize_t> run;
  py::object in_run;
  auto run_set = [&]() -> PyObject* {
    if (!in_run) {
      in_run = py::reinterpret_steal<py::object>(PySet_New(nullptr));
      for (PyObject* n : found) {
        if (PySet_Add(in_run.ptr(), slot(n, S.n_index)) < 0) {
          throw py::error_already_set();
        }
      }
    }
    return in_run.ptr();
  };
  auto held_after = [&](PyObject* n, Py_ssize_t k, Py_ssize_t inside) {
    if (run.empty()) {
      run.reserve(found.size());
      for (PyObject* f : found) {
        run.push_back(index_of(f));
      }
    }
    const int native = genie::held_after_sorted(n, k, run, inside);
    if (native >= 0) {
      return native == 1;
    }
    py::object kk = py::int_(k), ii = py::int_(inside);
    py::object r = py::reinterpret_steal<py::object>(PyObject_CallFunctionObjArgs(
        S.held_after, n, kk.ptr(), run_set(), ii.ptr(), nullptr));
    if (!r) {
      throw py::error_already_set();
    }
    return truthy(r.ptr());
  };
  for (const auto& [n, k, inside] : must_free) {
    if (held_after(n, k, inside)) {
      return miss;
    }
  }
  for (const auto& [n, k, inside] : must_keep) {
    if (!held_after(n, k, inside)) {
      return miss;
    }
  }
  py::list shaped;
  for (auto it = shaped_at.rbegin(); it != shaped_at.rend(); ++it) {
    shaped.append(py::int_(*it));
  }
  py::list changed;
  for (Py_ssize_t c : changed_at) {
    changed.append(py::int_(c));
  }
  // Input references, grouped by plan slot: one value each, bound as build_tape would.
  // Input slots by (node, output): a node is its index while it is alive (these are borrowed
  // from found nodes' Refs), so no (index, out) tuple is made and hashed per input here; the
  // tape's PendingSlots gets them as a flat [node, out, slot, ...] list and makes the
  // (node index, out) keys only if Tape.slots is read (a replay and a bind never read it).
  std::unordered_map<std::pair<PyObject*, Py_ssize_t>, PyObject*, PairHash> islots;
  std::vector<PyObject*> islot_list;  // borrowed: node, out, slot, ...
  py::dict inputs;
  const Py_ssize_t ng = PyList_GET_SIZE(ingroups);
  {  // the inputs' nodes (a weight's upload, the previous step's KV cache) are cold: ask for
     // them all, then their value and metadata lists, then the items, before the checks below
    std::vector<std::pair<PyObject*, Py_ssize_t>> at;
    at.reserve(ng);
    for (Py_ssize_t g = 0; g < ng; ++g) {
      PyObject* grp = PyList_GET_ITEM(ingroups, g);
      PyObject* gi = PyTuple_GET_ITEM(grp, 1);
      PyObject* gp = PyTuple_GET_ITEM(grp, 2);
      if (!PyList_CheckExact(gi) || !PyList_CheckExact(gp) || PyList_GET_SIZE(gi) == 0 ||
          PyList_GET_SIZE(gp) == 0) {
        continue;
      }
      const Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(gi, 0));
      const Py_ssize_t p = PyLong_AsSsize_t(PyList_GET_ITEM(gp, 0));
      if (PyErr_Occurred()) {
        PyErr_Clear();  // the loop below says so
        continue;
      }
      if (i < 0 || i >= nn) {
        continue;
      }
      Py_ssize_t xo = -1;
      PyObject* xn = is_node(found[i]) ? input_at(found[i], p, &xo) : nullptr;
      if (!is_node(xn)) {
        continue;
      }
      prefetch(xn, 3);
      at.emplace_back(xn, xo);
    }
    for (const auto& [xn, out] : at) {
      PyObject* values = slot(xn, S.n_values);
      PyObject* metas = slot(xn, S.n_metas);
      PyObject* index = slot(xn, S.n_index);
      for (PyObject* o : {values, metas, index}) {
        if (o != nullptr) {
          prefetch(o);
        }
      }
    }
    for (const auto& [xn, out] : at) {
      prefetch_item(slot(xn, S.n_values), out);
      prefetch_item(slot(xn, S.n_metas), out);
    }
    for (const auto& [xn, out] : at) {
      PyObject* v = item(slot(xn, S.n_values), out);
      if (v != nullptr) {
        prefetch(v);  // its reference count: the inputs dict holds it
      }
    }
  }
  // genie.plan_cache._bind_input(xn, out, y, pin, islots, inputs, generic): true when bound
  std::vector<py::object> outs_made;  // the ints of the inputs' output numbers, held
  auto bind = [&](PyObject* xn, Py_ssize_t out, PyObject* y) -> bool {
    const auto known = islots.find({xn, out});
    if (known != islots.end()) {
      return as_index(known->second) == as_index(y);
    }
    PyObject* want = PyDict_GetItemWithError(pin.ptr(), y);
    if (want == nullptr) {
      if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
      return false;
    }
    const int taken = PyDict_Contains(inputs.ptr(), y);
    if (taken < 0) {
      throw py::error_already_set();
    }
    PyObject* values = slot(xn, S.n_values);
    if (taken || slot(xn, S.n_executed) != Py_True || values == nullptr || values == Py_None) {
      return false;
    }
    PyObject* v = item(values, out);
    PyObject* meta = item(slot(xn, S.n_metas), out);
    if (v == nullptr || v == Py_None || meta == nullptr) {
      return false;
    }
    if (meta != want) {
      int eq = genie::tensor_meta_eq(meta, want);
      if (eq < 0) {
        eq = PyObject_RichCompareBool(meta, want, Py_EQ);
        if (eq < 0) {
          throw py::error_already_set();
        }
      }
      if (eq == 0 && generic && meta != Py_None && want != Py_None) {
        eq = genie::tensor_meta_same_kind(meta, want);
        if (eq < 0) {
          py::object r = py::reinterpret_steal<py::object>(
              PyObject_CallFunctionObjArgs(S.same_kind, meta, want, nullptr));
          if (!r) {
            throw py::error_already_set();
          }
          eq = truthy(r.ptr());
        }
      }
      if (eq == 0) {
        return false;
      }
    }
    if (PyDict_SetItem(inputs.ptr(), y, v) < 0) {
      throw py::error_already_set();
    }
    islots.emplace(std::make_pair(xn, out), y);
    outs_made.push_back(py::int_(out));  // (held until the result holds it)
    islot_list.insert(islot_list.end(), {xn, outs_made.back().ptr(), y});
    return true;
  };
  for (Py_ssize_t g = 0; g < ng; ++g) {
    PyObject* grp = PyList_GET_ITEM(ingroups, g);
    PyObject* y = PyTuple_GET_ITEM(grp, 0);
    PyObject* gi = PyTuple_GET_ITEM(grp, 1);
    PyObject* gp = PyTuple_GET_ITEM(grp, 2);
    const Py_ssize_t len = PyList_GET_SIZE(gi);
    PyObject* xn = nullptr;
    Py_ssize_t xo = -1;
    for (Py_ssize_t q = 0; q < len; ++q) {
      PyObject* n = found[as_index(PyList_GET_ITEM(gi, q))];
      Py_ssize_t o = -1;
      PyObject* x = is_node(n) ? input_at(n, as_index(PyList_GET_ITEM(gp, q)), &o) : nullptr;
      if (x == nullptr) {
        return miss;
      }
      if (q == 0) {
        xn = x;
        xo = o;
      } else if (x != xn || o != xo) {
        return miss;
      }
    }
    if (xn == nullptr || !is_node(xn)) {
      return miss;
    }
    const Py_ssize_t out = xo;
    if (check_pending) {  // a write recorded before one of the reads: the slice holds it
      bool ok = true;
      for (Py_ssize_t q = 0; q < len && ok; ++q) {
        if (written_before(xn, out, found[as_index(PyList_GET_ITEM(gi, q))], ok)) {
          return miss;
        }
      }
      if (!ok) {
        return miss;
      }
    }
    if (!bind(xn, out, y)) {
      return miss;
    }
  }
  for (Py_ssize_t t = 0; t < nt; ++t) {  // requested values that ran (a plan that writes)
    if (tpos[t] < 0) {
      if (!bind(tg[t].first, tg[t].second, PyList_GET_ITEM(want_out.ptr(), t))) {
        return miss;
      }
    }
  }
  if (PyDict_GET_SIZE(inputs.ptr()) != PyDict_GET_SIZE(pin.ptr())) {
    return py::none();
  }
  py::list islots_out(islot_list.size());
  for (size_t q = 0; q < islot_list.size(); ++q) {
    PyList_SET_ITEM(islots_out.ptr(), static_cast<Py_ssize_t>(q), Py_NewRef(islot_list[q]));
  }
  py::list nodes(nn);
  for (Py_ssize_t i = 0; i < nn; ++i) {
    Py_INCREF(found[i]);
    PyList_SET_ITEM(nodes.ptr(), i, found[i]);
  }
  return py::make_tuple(nodes, shaped, changed, islots_out, inputs);
}

}  // namespace genie
