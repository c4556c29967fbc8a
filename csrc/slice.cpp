// The plan cache's slow path natively: genie.planner.slice_nodes and
// genie.plan_cache.instantiate.
//
// A slice the plan cache's column match cannot take (a node only a write reaches) slices the
// graph and matches the slice against a cached plan node by node; every miss (a new prompt
// length) slices too. In Python those two loops cost ~1.3 ms of a 4.4 ms MLP training step (~130
// nodes); here they cost a few µs per step.
//
// Semantics are those of the Python functions, kept as the reference (GENIE_NATIVE_SLICE=0, or
// genie.config.config.native_slice = False; tests/unit/test_native_slice.py compares the two):
// the same nodes in the same order, the same Tape or None, the same floats added to Plan.floats.
// The one difference is in form: the tape's slots come as a PendingSlots (built when read, equal
// to the dict the Python function builds), as the column match gives them, so binding the run's
// values takes the native loop of bind.cpp.
//
// Objects are read through their __slots__ (offsets from the member descriptors, found by name
// at _slice_init, as record.cpp does) after an exact type check. Anything this file does not
// expect (another type where a Node, Ref, Storage, Instr... should be, an unset slot, a list
// that is not a list) makes the call return NotImplemented, and the caller runs the Python
// function, which then gives its own answer or error.
#include <Python.h>
#include <structmember.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include "slice.h"
#include "seq.h"
#include "node.h"
#include "slots.h"

namespace py = pybind11;

namespace {

// Something the native path does not handle: the caller runs the Python reference.
struct Unsupported {};

// A Python error raised by code this file called (an __eq__, _HostMeta.matches): propagated.
[[noreturn]] void raise() {
  throw py::error_already_set();
}

using genie::slot_offset;

// A slot's value, borrowed; Unsupported when unset (the Python reference raises AttributeError).
inline PyObject* get(PyObject* o, Py_ssize_t off) {
  PyObject* v = genie::slot_value(o, off);
  if (v == nullptr) {
    throw Unsupported();
  }
  return v;
}

// An open-addressing hash map from int64 keys to small values: the walks below do a few lookups
// per node, and std::unordered_map's node allocations cost more than the rest of them.
template <class V>
class FlatMap {
 public:
  static constexpr int64_t kEmpty = INT64_MIN;

  explicit FlatMap(size_t expected) {
    size_t cap = 16;
    while (cap < expected * 2) {
      cap <<= 1;
    }
    keys_.assign(cap, kEmpty);
    vals_.resize(cap);
  }

  // The value of `key`, or nullptr.
  V* find(int64_t key) {
    for (size_t i = hash(key);; i = (i + 1) & (keys_.size() - 1)) {
      if (keys_[i] == key) {
        return &vals_[i];
      }
      if (keys_[i] == kEmpty) {
        return nullptr;
      }
    }
  }

  // Inserts `key` -> `value` if absent; returns the value slot and whether it was inserted.
  std::pair<V*, bool> insert(int64_t key, const V& value) {
    if ((size_ + 1) * 2 > keys_.size()) {
      grow();
    }
    for (size_t i = hash(key);; i = (i + 1) & (keys_.size() - 1)) {
      if (keys_[i] == key) {
        return {&vals_[i], false};
      }
      if (keys_[i] == kEmpty) {
        keys_[i] = key;
        vals_[i] = value;
        ++size_;
        return {&vals_[i], true};
      }
    }
  }

  template <class F>
  void for_each(F&& f) const {
    for (size_t i = 0; i < keys_.size(); ++i) {
      if (keys_[i] != kEmpty) {
        f(keys_[i], vals_[i]);
      }
    }
  }

  size_t size() const { return size_; }

 private:
  size_t hash(int64_t key) const {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> 7) &
           (keys_.size() - 1);
  }

  void grow() {
    std::vector<int64_t> keys(keys_.size() * 2, kEmpty);
    std::vector<V> vals(keys.size());
    keys.swap(keys_);
    vals.swap(vals_);
    size_ = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] != kEmpty) {
        insert(keys[i], vals[i]);
      }
    }
  }

  std::vector<int64_t> keys_;
  std::vector<V> vals_;
  size_t size_ = 0;
};

// (node index, output) as one key: indices count recorded ops (far below 2^50), and a node with
// 4096 outputs or more is left to the Python reference.
inline int64_t out_key(int64_t index, int64_t out) {
  if (out < 0 || out >= 4096 || index < 0 || index >= (int64_t{1} << 50)) {
    throw Unsupported();
  }
  return (index << 12) | out;
}

inline int64_t ptr_key(PyObject* o) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(o));
}

struct State {
  bool graph_ready = false;  // slice_nodes can run
  bool plan_ready = false;   // instantiate can run too
  PyTypeObject* node = nullptr;
  PyTypeObject* ref = nullptr;
  PyTypeObject* storage = nullptr;
  PyTypeObject* tensor_meta = nullptr;
  PyTypeObject* meta_arg = nullptr;
  PyTypeObject* slot = nullptr;
  PyTypeObject* instr = nullptr;
  PyTypeObject* host_meta = nullptr;
  PyObject* tape = nullptr;
  PyObject* pending_slots = nullptr;
  // Node
  Py_ssize_t n_op = 0, n_leaves = 0, n_spec = 0, n_metas = 0, n_storages = 0, n_writes = 0,
             n_outputs = 0, n_values = 0, n_executed = 0, n_index = 0, n_rng = 0, n_seq = 0,
             n_where = 0, n_consumers = 0;
  Py_ssize_t r_node = 0, r_out = 0;            // Ref
  Py_ssize_t st_pending = 0, st_readers = 0;   // Storage
  // TensorMeta, its fields in the order its dataclass __eq__ compares them
  Py_ssize_t tm_shape = 0, tm_stride = 0, tm_offset = 0, tm_dtype = 0, tm_index = 0, tm_conj = 0,
             tm_neg = 0;
  Py_ssize_t ma_meta = 0;                      // MetaArg
  Py_ssize_t sl_id = 0;                        // Slot
  // Instr
  Py_ssize_t i_op = 0, i_leaves = 0, i_spec = 0, i_outs = 0, i_rng = 0, i_free = 0, i_uid = 0,
             i_where = 0, i_device = 0;
};

State S;

PyTypeObject* type_of(const py::dict& objs, const char* name) {
  py::object o = objs[name];
  if (!PyType_Check(o.ptr())) {
    throw std::runtime_error(std::string(name) + " must be a class");
  }
  return reinterpret_cast<PyTypeObject*>(o.release().ptr());  // kept for the process
}

void slice_init(const py::dict& objs) {
  if (objs.contains("Node")) {
    S.node = type_of(objs, "Node");
    S.ref = type_of(objs, "Ref");
    S.storage = type_of(objs, "Storage");
    S.tensor_meta = type_of(objs, "TensorMeta");
    S.meta_arg = type_of(objs, "MetaArg");
    S.slot = type_of(objs, "Slot");
    S.instr = type_of(objs, "Instr");
    S.tape = objs["Tape"].cast<py::object>().release().ptr();
    S.pending_slots = objs["PendingSlots"].cast<py::object>().release().ptr();
    PyTypeObject* t = S.node;
    S.n_op = slot_offset(t, "op");
    S.n_spec = slot_offset(t, "spec");
    S.n_metas = slot_offset(t, "metas");
    S.n_storages = slot_offset(t, "_st");
    S.n_writes = slot_offset(t, "writes");
    S.n_outputs = slot_offset(t, "_out");
    S.n_values = slot_offset(t, "values");
    S.n_executed = slot_offset(t, "executed");
    S.n_index = slot_offset(t, "index");
    S.n_rng = slot_offset(t, "rng");
    S.n_seq = slot_offset(t, "_seq");
    S.n_where = slot_offset(t, "where");
    S.n_consumers = slot_offset(t, "n_consumers");
    S.r_node = slot_offset(S.ref, "node");
    S.r_out = slot_offset(S.ref, "out");
    S.st_pending = slot_offset(S.storage, "pending_writes");
    S.st_readers = slot_offset(S.storage, "readers");
    S.tm_shape = slot_offset(S.tensor_meta, "shape");
    S.tm_stride = slot_offset(S.tensor_meta, "stride");
    S.tm_offset = slot_offset(S.tensor_meta, "offset");
    S.tm_dtype = slot_offset(S.tensor_meta, "dtype");
    S.tm_index = slot_offset(S.tensor_meta, "index");
    S.tm_conj = slot_offset(S.tensor_meta, "conj");
    S.tm_neg = slot_offset(S.tensor_meta, "neg");
    S.ma_meta = slot_offset(S.meta_arg, "meta");
    S.sl_id = slot_offset(S.slot, "id");
    t = S.instr;
    // Instructions are made here as object.__new__ would, every slot written: the class must
    // have exactly these.
    py::tuple slots = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(t))
                          .attr("__slots__")
                          .cast<py::tuple>();
    std::vector<std::string> got;
    for (const auto& s : slots) {
      got.push_back(s.cast<std::string>());
    }
    if (got != std::vector<std::string>{"op", "leaves", "spec", "outs", "rng", "free", "uid",
                                        "where", "device"}) {
      throw std::runtime_error("genie.planner.Instr has other slots than slice.cpp writes");
    }
    S.i_op = slot_offset(t, "op");
    S.i_leaves = slot_offset(t, "leaves");
    S.i_spec = slot_offset(t, "spec");
    S.i_outs = slot_offset(t, "outs");
    S.i_rng = slot_offset(t, "rng");
    S.i_free = slot_offset(t, "free");
    S.i_uid = slot_offset(t, "uid");
    S.i_where = slot_offset(t, "where");
    S.i_device = slot_offset(t, "device");
    S.graph_ready = true;
  }
  if (objs.contains("HostMeta")) {
    S.host_meta = type_of(objs, "HostMeta");
  }
  S.plan_ready = S.graph_ready && S.host_meta != nullptr;
}

// --- small readers ------------------------------------------------------------------------------

inline bool truthy(PyObject* o) {
  if (o == Py_True) {
    return true;
  }
  if (o == Py_False || o == Py_None) {
    return false;
  }
  const int r = PyObject_IsTrue(o);
  if (r < 0) {
    raise();
  }
  return r != 0;
}

inline PyObject* as_node(PyObject* o) {
  if (Py_TYPE(o) != S.node) {
    throw Unsupported();
  }
  return o;
}

// How many leaves node `n` (as_node) holds, -1 once released (`leaves` None).
inline Py_ssize_t leaf_count(PyObject* n) {
  return genie::node_n_leaves(n);
}

// Leaf `p` of node `n` (as_node), borrowed: the producer node of a lazy input (`*out` its output
// number) or the constant (`*out` -1); Unsupported when out of range (Python raises IndexError).
inline PyObject* leaf_of(PyObject* n, Py_ssize_t p, int32_t* out) {
  PyObject* x = genie::node_leaf(n, p, out);
  if (x == nullptr) {
    throw Unsupported();
  }
  return x;
}

inline int64_t as_int(PyObject* o) {
  if (!PyLong_CheckExact(o)) {
    throw Unsupported();
  }
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw Unsupported();
  }
  return v;
}

inline int64_t index_of(PyObject* node) {
  return as_int(get(node, S.n_index));
}

inline bool executed(PyObject* node) {
  return truthy(get(node, S.n_executed));
}

inline PyObject* as_list(PyObject* o) {
  if (!PyList_CheckExact(o)) {
    throw Unsupported();
  }
  return o;
}

// The referent of a weak reference (borrowed; Py_None when dead).
inline PyObject* deref(PyObject* r) {
  if (!PyWeakref_CheckRef(r)) {
    throw Unsupported();
  }
  return PyWeakref_GET_OBJECT(r);
}

// seq[i] of a list or tuple, borrowed; Unsupported when out of range (Python raises IndexError).
inline PyObject* item(PyObject* seq, Py_ssize_t i) {
  if (PyList_CheckExact(seq)) {
    if (i < 0 || i >= PyList_GET_SIZE(seq)) {
      throw Unsupported();
    }
    return PyList_GET_ITEM(seq, i);
  }
  if (PyTuple_CheckExact(seq)) {
    if (i < 0 || i >= PyTuple_GET_SIZE(seq)) {
      throw Unsupported();
    }
    return PyTuple_GET_ITEM(seq, i);
  }
  throw Unsupported();
}

inline Py_ssize_t size_of(PyObject* seq) {
  if (PyList_CheckExact(seq)) {
    return PyList_GET_SIZE(seq);
  }
  if (PyTuple_CheckExact(seq)) {
    return PyTuple_GET_SIZE(seq);
  }
  throw Unsupported();
}

// Output `k`'s item of a node's `_st` or `_out` (slots.h per_output), borrowed; Unsupported when
// out of range.
inline PyObject* out_of(PyObject* v, Py_ssize_t k) {
  PyObject* r = genie::per_output(v, k);
  if (r == nullptr) {
    throw Unsupported();
  }
  return r;
}

// a == b as Python's bool(a == b) (propagating errors).
inline bool eq(PyObject* a, PyObject* b) {
  const int r = PyObject_RichCompareBool(a, b, Py_EQ);
  if (r < 0) {
    raise();
  }
  return r != 0;
}

// `a is b or a == b`, the form the Python code writes as `a is not b and a != b` negated.
inline bool same(PyObject* a, PyObject* b) {
  return a == b || eq(a, b);
}

// genie.graph.same_const.
bool same_const(PyObject* a, PyObject* b) {
  if (a == b) {
    return true;
  }
  if (Py_TYPE(a) != Py_TYPE(b)) {
    return false;
  }
  if (PyFloat_CheckExact(a)) {
    const double x = PyFloat_AS_DOUBLE(a);
    const double y = PyFloat_AS_DOUBLE(b);
    if (std::isnan(x)) {
      return std::isnan(y);
    }
    return x == y && std::signbit(x) == std::signbit(y);
  }
  PyObject* r = PyObject_RichCompare(a, b, Py_EQ);
  int t = -1;
  if (r != nullptr) {
    t = PyObject_IsTrue(r);
    Py_DECREF(r);
  }
  if (t < 0) {  // a failing == or a value that is not a truth value: different
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
      raise();
    }
    PyErr_Clear();
    return false;
  }
  return t != 0;
}

// a == b for two TensorMetas as their dataclass __eq__ (the tuples of their fields), without
// running it; anything else by Python's ==.
bool meta_eq(PyObject* a, PyObject* b) {
  if (a == b) {
    return true;
  }
  if (Py_TYPE(a) != S.tensor_meta || Py_TYPE(b) != S.tensor_meta) {
    return eq(a, b);
  }
  for (Py_ssize_t off : {S.tm_shape, S.tm_stride, S.tm_offset, S.tm_dtype, S.tm_index, S.tm_conj,
                         S.tm_neg}) {
    if (!same(get(a, off), get(b, off))) {
      return false;
    }
  }
  return true;
}

// a == b for two lists of output metadata (TensorMeta or None), as list ==.
bool metas_eq(PyObject* a, PyObject* b) {
  if (a == b) {
    return true;
  }
  if (!PyList_CheckExact(a) || !PyList_CheckExact(b)) {
    return eq(a, b);
  }
  const Py_ssize_t n = PyList_GET_SIZE(a);
  if (n != PyList_GET_SIZE(b)) {
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!meta_eq(PyList_GET_ITEM(a, i), PyList_GET_ITEM(b, i))) {
      return false;
    }
  }
  return true;
}

// genie.plan_cache.same_kind.
bool same_kind(PyObject* a, PyObject* b) {
  if (Py_TYPE(a) != S.tensor_meta || Py_TYPE(b) != S.tensor_meta) {
    throw Unsupported();
  }
  return get(a, S.tm_dtype) == get(b, S.tm_dtype) &&
         eq(get(a, S.tm_index), get(b, S.tm_index)) &&
         size_of(get(a, S.tm_shape)) == size_of(get(b, S.tm_shape)) &&
         get(a, S.tm_conj) == get(b, S.tm_conj) && get(a, S.tm_neg) == get(b, S.tm_neg);
}

// --- slice_nodes --------------------------------------------------------------------------------

// genie.planner.slice_nodes. No Python code runs during the walk (no object is created until
// the result list), so the borrowed nodes stay alive: the targets hold them, through their
// argument lists and the storages' pending writes.
py::object slice_nodes(const py::list& targets) {
  if (!S.graph_ready) {
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
  try {
    FlatMap<PyObject*> needed(256);
    // storage -> (the bound its writes were taken to, the bound its readers were taken to)
    FlatMap<std::pair<int64_t, int64_t>> bound(64);
    std::vector<PyObject*> stack;

    auto need = [&](PyObject* n) {
      as_node(n);
      if (!executed(n) && needed.insert(index_of(n), n).second) {
        stack.push_back(n);
      }
    };
    // The pending writes of `s` recorded before `upto`, and the live pending readers of `s`
    // recorded before one of those writes (before the latest: the union is the same; readers
    // below a bound already taken are needed already).
    auto need_storage = [&](PyObject* s, int64_t upto) {
      if (Py_TYPE(s) != S.storage) {
        throw Unsupported();
      }
      auto [b, fresh] = bound.insert(ptr_key(s), {upto, -1});
      if (!fresh) {
        if (b->first >= upto) {
          return;
        }
        b->first = upto;
      }
      PyObject* writes = get(s, S.st_pending);
      if (PyTuple_CheckExact(writes) && PyTuple_GET_SIZE(writes) == 0) {
        return;  // never written (genie.graph.Storage): no write to order, so no reader either
      }
      as_list(writes);
      int64_t last = -1;
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(writes); ++i) {
        PyObject* w = as_node(PyList_GET_ITEM(writes, i));
        const int64_t wi = index_of(w);
        if (wi >= upto) {
          break;
        }
        need(w);
        last = std::max(last, wi);
      }
      if (last <= b->second) {
        return;
      }
      b->second = last;
      PyObject* readers = get(s, S.st_readers);
      if (PyTuple_CheckExact(readers) && PyTuple_GET_SIZE(readers) == 0) {
        return;  // no reader yet (genie.graph.Storage: the shared empty tuple until the first)
      }
      as_list(readers);
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(readers); ++i) {
        PyObject* rn = deref(PyList_GET_ITEM(readers, i));
        if (rn != Py_None && !executed(as_node(rn)) && index_of(rn) < last) {
          need(rn);
        }
      }
    };

    const int64_t inf = int64_t{1} << 62;
    for (const auto& t : targets) {
      PyObject* tp = t.ptr();
      if (!PyTuple_CheckExact(tp) || PyTuple_GET_SIZE(tp) != 2) {
        throw Unsupported();
      }
      PyObject* node = as_node(PyTuple_GET_ITEM(tp, 0));
      need(node);
      need_storage(out_of(get(node, S.n_storages), as_int(PyTuple_GET_ITEM(tp, 1))), inf);
    }
    while (!stack.empty()) {
      PyObject* n = stack.back();
      stack.pop_back();
      const int64_t at = index_of(n);
      const Py_ssize_t nl = leaf_count(n);
      for (Py_ssize_t i = 0; i < nl; ++i) {
        int32_t xo = -1;
        PyObject* xn = leaf_of(n, i, &xo);
        if (xo < 0) {
          continue;
        }
        as_node(xn);
        need(xn);
        need_storage(out_of(get(xn, S.n_storages), xo), at);
      }
      PyObject* writes = get(n, S.n_writes);
      if (PyTuple_CheckExact(writes) || PyList_CheckExact(writes)) {
        const Py_ssize_t m = size_of(writes);
        for (Py_ssize_t i = 0; i < m; ++i) {
          need_storage(item(writes, i), at);
        }
      } else {
        throw Unsupported();
      }
    }
    std::vector<std::pair<int64_t, PyObject*>> order;
    order.reserve(needed.size());
    needed.for_each([&order](int64_t k, PyObject* n) { order.emplace_back(k, n); });
    std::sort(order.begin(), order.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(order.size()));
    if (out == nullptr) {
      raise();
    }
    for (size_t i = 0; i < order.size(); ++i) {
      Py_INCREF(order[i].second);
      PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), order[i].second);
    }
    return py::reinterpret_steal<py::object>(out);
  } catch (const Unsupported&) {
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
}

// --- instantiate --------------------------------------------------------------------------------

using SlotMap = FlatMap<int64_t>;  // out_key(node index, output) -> slot
using IndexSet = FlatMap<char>;    // node indices

// A run's node indices as the column match has them: increasing (genie::held_after_sorted).
struct SortedRun {
  const std::vector<Py_ssize_t>& at;
};

inline bool in(IndexSet& run, int64_t index) {
  return run.find(index) != nullptr;
}

inline bool in(const SortedRun& run, int64_t index) {
  return std::binary_search(run.at.begin(), run.at.end(), static_cast<Py_ssize_t>(index));
}

// Whether a pending node outside `in_run` reads an output of `n` (genie.planner.
// _has_pending_consumer): nodes keep only a count of their consumers, and every pending consumer
// is among the readers of the storage it reads, so the pending readers whose arguments name `n`
// are its pending consumers.
template <class Run>
bool has_pending_consumer(PyObject* n, Run& in_run) {
  PyObject* count = get(n, S.n_consumers);
  if (!PyLong_CheckExact(count)) {
    throw Unsupported();
  }
  if (PyLong_AsSsize_t(count) == 0) {
    return false;  // none was recorded, or n ran
  }
  py::object storages = py::reinterpret_borrow<py::object>(get(n, S.n_storages));
  const Py_ssize_t ns = genie::per_output_count(storages.ptr());
  for (Py_ssize_t j = 0; j < ns; ++j) {
    PyObject* st = out_of(storages.ptr(), j);
    if (st == Py_None) {
      continue;
    }
    bool again = false;  // (outputs may share a storage: views)
    for (Py_ssize_t q = 0; q < j && !again; ++q) {
      again = out_of(storages.ptr(), q) == st;
    }
    if (again) {
      continue;
    }
    if (Py_TYPE(st) != S.storage) {
      throw Unsupported();
    }
    py::object readers = py::reinterpret_borrow<py::object>(get(st, S.st_readers));
    const Py_ssize_t nr = size_of(readers.ptr());
    for (Py_ssize_t i = 0; i < nr; ++i) {
      PyObject* c = deref(item(readers.ptr(), i));
      if (c == Py_None || executed(as_node(c)) || in(in_run, index_of(c))) {
        continue;
      }
      const Py_ssize_t m = leaf_count(c);
      for (Py_ssize_t p = 0; p < m; ++p) {
        int32_t xo = -1;
        if (leaf_of(c, p, &xo) == n && xo >= 0) {
          return true;
        }
      }
    }
  }
  return false;
}

// genie.planner.held_after (in_run: the run's node indices; inside: the run's references to `n`,
// or -1 when not counted).
template <class Run>
bool held_after(PyObject* n, Py_ssize_t k, Run& in_run, Py_ssize_t inside) {
  static PyObject* const node_name = PyUnicode_InternFromString("_node");
  PyObject* r = out_of(get(n, S.n_outputs), k);
  if (genie::out_counted(r)) {
    return true;  // a live wrapper holds it (the default graph's count)
  }
  if (r != Py_None && !PyLong_CheckExact(r)) {  // a capture graph's weak reference to its tensor
    PyObject* t = deref(r);
    if (t != Py_None) {
      py::object keep = py::reinterpret_borrow<py::object>(t);
      PyObject* tn = PyObject_GetAttr(t, node_name);  // getattr(t, "_node", None)
      if (tn == nullptr) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
          raise();
        }
        PyErr_Clear();
      } else {
        const bool mine = tn == n;
        Py_DECREF(tn);
        if (mine) {
          return true;
        }
      }
    }
  }
  PyObject* count = get(n, S.n_consumers);
  if (PyLong_CheckExact(count) && PyLong_AsSsize_t(count) == inside) {
    return false;  // every consumer is in the run
  }
  return has_pending_consumer(n, in_run);
}

bool host_matches(PyObject* meta, PyObject* t, bool generic) {
  static PyObject* const matches_name = PyUnicode_InternFromString("matches");
  PyObject* r = PyObject_CallMethodObjArgs(meta, matches_name, t, generic ? Py_True : Py_False,
                                           nullptr);
  if (r == nullptr) {
    raise();
  }
  py::object keep = py::reinterpret_steal<py::object>(r);
  return truthy(r);
}

inline bool is_tensor(PyObject* x) {
  return THPVariable_Check(x);
}

// genie.plan_cache._same_node.
bool same_node(PyObject* n, PyObject* t, PyObject* meta, PyObject* spec, bool generic) {
  if (get(n, S.n_op) != get(t, S.i_op) ||
      (get(n, S.n_rng) == Py_None) != (get(t, S.i_rng) == Py_None)) {
    return false;
  }
  if (!same(get(n, S.n_spec), spec)) {
    return false;
  }
  PyObject* metas = get(n, S.n_metas);
  if (!metas_eq(metas, meta)) {
    if (!generic) {
      return false;
    }
    const Py_ssize_t m = size_of(metas);
    if (m != size_of(meta)) {
      return false;
    }
    for (Py_ssize_t i = 0; i < m; ++i) {
      PyObject* a = item(metas, i);
      PyObject* b = item(meta, i);
      if (!(a == b || (a != Py_None && b != Py_None && same_kind(a, b)))) {
        return false;
      }
    }
  }
  as_node(n);
  PyObject* tl = get(t, S.i_leaves);
  const Py_ssize_t m = leaf_count(n);
  if (m < 0) {
    return false;
  }
  if (m != size_of(tl)) {
    return false;
  }
  for (Py_ssize_t i = 0; i < m; ++i) {
    int32_t xo = -1;
    PyObject* x = leaf_of(n, i, &xo);
    PyObject* y = item(tl, i);
    PyTypeObject* tx = Py_TYPE(x);
    PyTypeObject* ty = Py_TYPE(y);
    if (xo >= 0) {
      if (ty != S.slot) {
        return false;
      }
    } else if (tx == &PyFloat_Type) {
      if (ty != &PyFloat_Type) {
        return false;
      }
    } else if (tx == S.meta_arg) {
      if (ty != S.meta_arg) {
        return false;
      }
      PyObject* xm = get(x, S.ma_meta);
      PyObject* ym = get(y, S.ma_meta);
      if (!meta_eq(xm, ym) && !(generic && same_kind(xm, ym))) {
        return false;
      }
    } else if (is_tensor(x)) {
      if (ty != S.host_meta) {
        return false;
      }
    } else if (generic && tx == &PyLong_Type) {
      if (ty != &PyLong_Type) {
        return false;
      }
    } else if (ty == S.slot || ty == S.host_meta || !same_const(x, y)) {
      return false;
    }
  }
  return true;
}

// genie.plan_cache._leaves_of, of node `n`'s leaves (as_node; as many as the template's `tl`).
PyObject* leaves_of(PyObject* n, PyObject* tl, bool shaped) {
  const Py_ssize_t m = leaf_count(n);
  if (m < 0 || m != size_of(tl)) {
    throw Unsupported();
  }
  PyObject* out = PyList_New(m);
  if (out == nullptr) {
    raise();
  }
  for (Py_ssize_t i = 0; i < m; ++i) {
    int32_t xo = -1;
    PyObject* x = genie::node_leaf(n, i, &xo);
    PyObject* y = item(tl, i);
    PyObject* v;
    if (x == nullptr) {
      Py_DECREF(out);
      throw Unsupported();
    }
    if (xo >= 0) {
      v = y;  // a lazy input: the template's Slot (a Ref is neither a tensor nor a float)
    } else if (shaped) {
      v = Py_TYPE(y) == S.slot ? y : x;
    } else {
      v = (is_tensor(x) || PyFloat_Check(x)) ? x : y;
    }
    Py_INCREF(v);
    PyList_SET_ITEM(out, i, v);
  }
  return out;
}

// genie.graph.Node.uid, "op*N", from the node's seq N: one string, no intermediate str(N).
PyObject* node_uid(PyObject* seq) {
  const long long v = PyLong_Check(seq) ? PyLong_AsLongLong(seq) : -1;
  if (v < 0) {
    PyErr_Clear();
    PyObject* uid = PyUnicode_FromFormat("op*%S", seq);  // not a count: as the property formats it
    if (uid == nullptr) {
      raise();
    }
    return uid;
  }
  char text[32];
  const int k = std::snprintf(text, sizeof text, "op*%lld", v);
  PyObject* uid = PyUnicode_FromStringAndSize(text, k);
  if (uid == nullptr) {
    raise();
  }
  return uid;
}

// Instr(op, leaves, spec, outs, rng, free, uid, where, device), made as object.__new__ would
// (every slot written; the dataclass __init__ only assigns them). Steals `leaves`.
PyObject* new_instr(PyObject* n, PyObject* t, PyObject* leaves) {
  py::object owned = py::reinterpret_steal<py::object>(leaves);
  PyObject* seq = get(n, S.n_seq);  // None: a default-graph node's, from its index (csrc/seq.cpp)
  py::object derived;
  if (seq == Py_None) {
    derived = py::reinterpret_steal<py::object>(
        PyLong_FromLongLong(genie::default_seq_of(index_of(n))));
    if (!derived) {
      raise();
    }
    seq = derived.ptr();
  }
  py::object uid = py::reinterpret_steal<py::object>(node_uid(seq));
  const std::pair<Py_ssize_t, PyObject*> fields[] = {
      {S.i_op, get(n, S.n_op)},     {S.i_leaves, leaves},         {S.i_spec, get(t, S.i_spec)},
      {S.i_outs, get(t, S.i_outs)}, {S.i_rng, get(n, S.n_rng)},   {S.i_free, get(t, S.i_free)},
      {S.i_uid, uid.ptr()},             {S.i_where, get(n, S.n_where)},
      {S.i_device, get(t, S.i_device)}};
  PyObject* ins = S.instr->tp_alloc(S.instr, 0);
  if (ins == nullptr) {
    raise();
  }
  for (const auto& [off, v] : fields) {
    Py_INCREF(v);
    *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(ins) + off) = v;
  }
  return ins;
}

// Whether value `v` differs from the plan's input metadata `m` in shape or strides.
bool differs_from(PyObject* v, PyObject* m) {
  static PyObject* const shape_name = PyUnicode_InternFromString("shape");
  static PyObject* const stride_name = PyUnicode_InternFromString("stride");
  if (Py_TYPE(m) != S.tensor_meta) {
    throw Unsupported();
  }
  PyObject* shape = get(m, S.tm_shape);
  py::object stride = py::reinterpret_borrow<py::object>(get(m, S.tm_stride));
  if (THPVariable_CheckExact(v) && PyTuple_CheckExact(shape) && PyTuple_CheckExact(stride.ptr())) {
    const at::Tensor& t = THPVariable_Unpack(v);
    auto same_ints = [](c10::IntArrayRef a, PyObject* tup) {
      if (static_cast<Py_ssize_t>(a.size()) != PyTuple_GET_SIZE(tup)) {
        return false;
      }
      for (size_t i = 0; i < a.size(); ++i) {
        PyObject* x = PyTuple_GET_ITEM(tup, static_cast<Py_ssize_t>(i));
        if (!PyLong_CheckExact(x)) {
          throw Unsupported();
        }
        if (PyLong_AsLongLong(x) != a[i]) {
          return false;
        }
      }
      return true;
    };
    if (t.is_sparse() || t.layout() != c10::kStrided) {
      throw Unsupported();
    }
    return !same_ints(t.sizes(), shape) || !same_ints(t.strides(), stride.ptr());
  }
  py::object vs = py::reinterpret_steal<py::object>(PyObject_GetAttr(v, shape_name));
  if (!vs) {
    raise();
  }
  if (!eq(vs.ptr(), shape)) {
    return true;
  }
  py::object vt = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(v, stride_name));
  if (!vt) {
    raise();
  }
  return !eq(vt.ptr(), stride.ptr());
}

// Input bindings: (node index, out) -> slot, for the tape's PendingSlots.
struct Inputs {
  py::dict values;  // slot -> value (Tape.inputs)
  py::dict slots;   // (node index, out) -> slot (PendingSlots.inputs)

  void bind(PyObject* index, PyObject* out, PyObject* slot, PyObject* value) {
    py::object key = py::reinterpret_steal<py::object>(PyTuple_Pack(2, index, out));
    if (!key) {
      raise();
    }
    if (PyDict_SetItem(slots.ptr(), key.ptr(), slot) < 0 ||
        PyDict_SetItem(values.ptr(), slot, value) < 0) {
      raise();
    }
  }

  bool has(PyObject* slot) const {
    const int r = PyDict_Contains(values.ptr(), slot);
    if (r < 0) {
      raise();
    }
    return r != 0;
  }
};

PyObject* dict_get(PyObject* d, PyObject* key) {
  if (!PyDict_CheckExact(d)) {
    throw Unsupported();
  }
  PyObject* v = PyDict_GetItemWithError(d, key);  // borrowed
  if (v == nullptr && PyErr_Occurred()) {
    raise();
  }
  return v;
}

// genie.plan_cache.instantiate.
py::object instantiate(const py::handle& plan, const py::list& targets, const py::list& nodes,
                       bool generic) {
  static PyObject* const n_instrs = PyUnicode_InternFromString("instrs");
  static PyObject* const n_metas = PyUnicode_InternFromString("metas");
  static PyObject* const n_specs = PyUnicode_InternFromString("specs");
  static PyObject* const n_wheres = PyUnicode_InternFromString("wheres");
  static PyObject* const n_inputs = PyUnicode_InternFromString("inputs");
  static PyObject* const n_keep = PyUnicode_InternFromString("keep");
  static PyObject* const n_outputs = PyUnicode_InternFromString("outputs");
  static PyObject* const n_floats = PyUnicode_InternFromString("floats");
  static PyObject* const n_index = PyUnicode_InternFromString("index");
  static PyObject* const n_guide = PyUnicode_InternFromString("guide");
  if (!S.plan_ready) {
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
  auto field = [&plan](PyObject* name) {
    PyObject* r = PyObject_GetAttr(plan.ptr(), name);
    if (r == nullptr) {
      raise();
    }
    return py::reinterpret_steal<py::object>(r);
  };
  try {
    py::object tmpl_o = field(n_instrs);
    PyObject* tmpl = as_list(tmpl_o.ptr());
    const Py_ssize_t nn = PyList_GET_SIZE(tmpl);
    PyObject* nodes_p = nodes.ptr();
    if (PyList_GET_SIZE(nodes_p) != nn) {
      return py::none();
    }
    py::object metas_o = field(n_metas), specs_o = field(n_specs), wheres_o = field(n_wheres);
    py::object pin_o = field(n_inputs), keep_o = field(n_keep), want_o = field(n_outputs);
    py::object guide_o = field(n_guide);
    PyObject* pguide = as_list(guide_o.ptr());
    PyObject* pmetas = as_list(metas_o.ptr());
    PyObject* pspecs = as_list(specs_o.ptr());
    PyObject* pwheres = as_list(wheres_o.ptr());
    PyObject* pin = pin_o.ptr();
    PyObject* keep = keep_o.ptr();
    PyObject* want_out = as_list(want_o.ptr());
    if (!PyDict_CheckExact(pin) || !PyAnySet_CheckExact(keep) || PyList_GET_SIZE(pmetas) != nn ||
        PyList_GET_SIZE(pspecs) != nn || PyList_GET_SIZE(pwheres) != nn ||
        PyList_GET_SIZE(pguide) != nn) {
      throw Unsupported();
    }
    IndexSet in_run(static_cast<size_t>(nn));
    for (Py_ssize_t i = 0; i < nn; ++i) {
      in_run.insert(index_of(as_node(PyList_GET_ITEM(nodes_p, i))), 1);
      if (Py_TYPE(PyList_GET_ITEM(tmpl, i)) != S.instr) {
        throw Unsupported();
      }
    }
    auto contains = [](PyObject* container, PyObject* x) {
      const int r = PySequence_Contains(container, x);
      if (r < 0) {
        raise();
      }
      return r != 0;
    };

    bool differs = false;
    SlotMap slots(static_cast<size_t>(nn) * 2);
    Inputs inputs;
    py::object instrs = py::reinterpret_steal<py::object>(PyList_GetSlice(tmpl, 0, nn));
    if (!instrs) {
      raise();
    }
    std::vector<Py_ssize_t> changed;  // instructions whose float arguments differ from the plan's
    for (Py_ssize_t i = 0; i < nn; ++i) {
      PyObject* n = PyList_GET_ITEM(nodes_p, i);
      PyObject* t = PyList_GET_ITEM(tmpl, i);
      PyObject* meta = PyList_GET_ITEM(pmetas, i);
      PyObject* spec = PyList_GET_ITEM(pspecs, i);
      PyObject* where = PyList_GET_ITEM(pwheres, i);
      PyObject* rng = get(n, S.n_rng);
      if (get(n, S.n_op) != get(t, S.i_op) || (rng == Py_None) != (get(t, S.i_rng) == Py_None)) {
        return py::none();
      }
      if (!same(get(n, S.n_spec), spec) || !same(get(n, S.n_where), where)) {
        return py::none();
      }
      bool shaped = false;
      if (!metas_eq(get(n, S.n_metas), meta)) {
        if (!generic || !same_node(n, t, meta, spec, true)) {
          return py::none();
        }
        shaped = differs = true;
      }
      // Hold the template's argument list and each leaf: the comparisons below may run Python
      // code.
      py::object tl_o = py::reinterpret_borrow<py::object>(get(t, S.i_leaves));
      PyObject* tl = tl_o.ptr();
      if (leaf_count(n) < 0 || leaf_count(n) != size_of(tl)) {
        return py::none();
      }
      bool params = false;
      const Py_ssize_t m = leaf_count(n);
      for (Py_ssize_t p = 0; p < m; ++p) {
        int32_t lo = -1;
        if (p >= leaf_count(n)) {  // (released by code the comparisons ran)
          return py::none();
        }
        py::object x_o = py::reinterpret_borrow<py::object>(leaf_of(n, p, &lo));
        PyObject* x = x_o.ptr();
        PyObject* y = item(tl, p);
        PyTypeObject* tx = Py_TYPE(x);
        PyTypeObject* ty = Py_TYPE(y);
        if (lo >= 0) {
          if (ty != S.slot) {
            return py::none();
          }
          PyObject* xn = as_node(x);
          py::object xo_o = py::reinterpret_steal<py::object>(PyLong_FromLong(lo));
          if (!xo_o) {
            raise();
          }
          PyObject* xo = xo_o.ptr();
          PyObject* yid = get(y, S.sl_id);
          const int64_t out = lo;
          const int64_t sid = as_int(yid);
          const int64_t key = out_key(index_of(xn), out);
          const int64_t* it = slots.find(key);
          if (it == nullptr) {  // not produced in this run: an input
            PyObject* pm = dict_get(pin, yid);
            if (pm == nullptr || inputs.has(yid) || !executed(xn)) {
              return py::none();
            }
            PyObject* values = get(xn, S.n_values);
            if (values == Py_None) {
              return py::none();
            }
            PyObject* v = item(values, out);
            PyObject* xm = item(get(xn, S.n_metas), out);
            if (v == Py_None || (!meta_eq(xm, pm) && !(generic && same_kind(xm, pm)))) {
              return py::none();
            }
            slots.insert(key, sid);
            inputs.bind(get(xn, S.n_index), xo, yid, v);
          } else if (*it != sid) {
            return py::none();
          }
        } else if (tx == &PyFloat_Type) {  // a parameter: only its type is structure
          if (ty != &PyFloat_Type) {
            return py::none();
          }
          if (!same_const(x, y)) {
            params = true;
            changed.push_back(i);
          }
        } else if (tx == S.meta_arg) {
          if (ty != S.meta_arg || !meta_eq(get(x, S.ma_meta), get(y, S.ma_meta))) {
            if (!generic || ty != S.meta_arg ||
                !same_kind(get(x, S.ma_meta), get(y, S.ma_meta))) {
              return py::none();
            }
            shaped = differs = true;
          }
        } else if (is_tensor(x)) {
          if (ty != S.host_meta || !host_matches(y, x, generic)) {
            return py::none();
          }
          if (generic && !differs && !host_matches(y, x, false)) {
            differs = true;
          }
          params = true;
        } else if (!same_const(x, y)) {
          if (!generic || tx != &PyLong_Type || ty != &PyLong_Type) {
            return py::none();
          }
          shaped = differs = true;
        }
      }
      PyObject* outs = get(t, S.i_outs);
      const int64_t idx = index_of(n);
      const Py_ssize_t no = size_of(outs);
      for (Py_ssize_t k = 0; k < no; ++k) {
        PyObject* s = item(outs, k);
        if (s == Py_None) {
          continue;
        }
        const int64_t sk = out_key(idx, k);
        const int64_t sv = as_int(s);
        *slots.insert(sk, sv).first = sv;
        // Which values the program still holds decides the frees: must be the plan's.
        PyObject* r = out_of(get(n, S.n_outputs), k);
        // (the plan's references to the node from inside the slice, which are this slice's
        // once it matches; if it does not, the tape is None anyway)
        const bool held = genie::out_counted(r) ||
                          held_after(n, k, in_run, as_int(item(item(pguide, i), 3)));
        if (held != contains(keep, s) && !contains(want_out, s)) {
          return py::none();
        }
      }
      if (params || shaped || rng != Py_None) {
        PyObject* ins = new_instr(n, t, leaves_of(n, tl, shaped));
        PyList_SetItem(instrs.ptr(), i, ins);  // steals ins, releases the template's reference
      }
    }
    // The requested values, in the plan's output slots.
    const Py_ssize_t nt = PyList_GET_SIZE(targets.ptr());
    const Py_ssize_t nw = PyList_GET_SIZE(want_out);
    const Py_ssize_t np = std::min(nt, nw);
    py::list outputs;
    for (Py_ssize_t q = 0; q < np; ++q) {
      PyObject* tp = PyList_GET_ITEM(targets.ptr(), q);
      PyObject* want = PyList_GET_ITEM(want_out, q);
      if (!PyTuple_CheckExact(tp) || PyTuple_GET_SIZE(tp) != 2) {
        throw Unsupported();
      }
      PyObject* node = as_node(PyTuple_GET_ITEM(tp, 0));
      PyObject* out_o = PyTuple_GET_ITEM(tp, 1);
      const int64_t out = as_int(out_o);
      const int64_t key = out_key(index_of(node), out);
      const int64_t* it = slots.find(key);
      int64_t s;
      if (it == nullptr) {  // a requested value that is already materialized: an input slot
        PyObject* pm = dict_get(pin, want);
        if (pm == nullptr || inputs.has(want) || !executed(node)) {
          return py::none();
        }
        PyObject* values = get(node, S.n_values);
        if (values == Py_None) {
          return py::none();
        }
        PyObject* v = item(values, out);
        if (v == Py_None) {
          return py::none();
        }
        PyObject* nm = item(get(node, S.n_metas), out);
        if (!meta_eq(nm, pm) && !(generic && same_kind(nm, pm))) {
          return py::none();
        }
        s = as_int(want);
        slots.insert(key, s);
        inputs.bind(get(node, S.n_index), out_o, want, v);
      } else {
        s = *it;
      }
      if (s != as_int(want)) {
        return py::none();
      }
      outputs.append(py::reinterpret_borrow<py::object>(want));
    }
    if (np != nw || PyDict_GET_SIZE(inputs.values.ptr()) != PyDict_GET_SIZE(pin)) {
      return py::none();
    }
    if (generic && !differs) {  // inputs of other shapes (all nodes alike) also make it generic
      PyObject *s, *v;
      Py_ssize_t pos = 0;
      while (PyDict_Next(inputs.values.ptr(), &pos, &s, &v)) {
        PyObject* pm = dict_get(pin, s);
        if (pm == nullptr) {
          throw Unsupported();
        }
        if (differs_from(v, pm)) {
          differs = true;
          break;
        }
      }
    }
    if (!changed.empty()) {  // as the Python function: backends that bake constants in
      py::object floats = field(n_floats);
      Py_ssize_t prev = -1;
      for (Py_ssize_t i : changed) {
        if (i == prev) {
          continue;
        }
        prev = i;
        PyObject* xl = get(PyList_GET_ITEM(instrs.ptr(), i), S.i_leaves);
        PyObject* yl = get(PyList_GET_ITEM(tmpl, i), S.i_leaves);
        const Py_ssize_t m = size_of(xl);
        for (Py_ssize_t j = 0; j < m; ++j) {
          PyObject* x = item(xl, j);
          if (PyFloat_CheckExact(x) && !same_const(x, item(yl, j))) {
            py::object key = py::make_tuple(i, j);
            if (PySet_Add(floats.ptr(), key.ptr()) < 0) {
              raise();
            }
          }
        }
      }
    }
    // The tape's slots: the plan's output slots per node, and the input bindings.
    py::list outs(nn);
    for (Py_ssize_t i = 0; i < nn; ++i) {
      outs[i] = py::reinterpret_borrow<py::object>(get(PyList_GET_ITEM(tmpl, i), S.i_outs));
    }
    py::object pending =
        py::reinterpret_borrow<py::object>(S.pending_slots)(outs, inputs.slots);
    py::object keep_set = py::reinterpret_steal<py::object>(PySet_New(keep));
    if (!keep_set) {
      raise();
    }
    return py::reinterpret_borrow<py::object>(S.tape)(
        instrs, inputs.values, outputs, keep_set, nodes, pending, field(n_index), plan,
        py::bool_(differs));
  } catch (const Unsupported&) {
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
}

}  // namespace

namespace genie {

// instrs[i] = Instr(n.op, _leaves_of(n.leaves, t.leaves, shaped), t.spec, ...) for each i of
// `indices`, n = found[i] and t = tmpl[i]: the instructions a plan-cache hit rebuilds from its
// nodes (shape-generic nodes take their ints and metadata arguments; the others this step's
// host tensors and floats). NotImplemented (nothing written) where a type is not the expected.
// Whether a value of `inputs` (slot -> value) differs in shape or strides from the plan's input
// metadata `pin[slot]`: genie.plan_cache.match's last check of a shape-generic hit whose nodes
// are all the plan's (in Python ~0.6 us per input: 37 for a compiled 6-layer MLP's graph call).
// NotImplemented where a value or a metadata is not one it reads (the caller checks in Python).
py::object inputs_differ(const py::dict& inputs, const py::dict& pin) {
  if (S.tensor_meta == nullptr) {
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
  PyObject *s, *v;
  Py_ssize_t pos = 0;
  try {
    while (PyDict_Next(inputs.ptr(), &pos, &s, &v)) {
      PyObject* m = dict_get(pin.ptr(), s);
      if (m == nullptr) {
        throw Unsupported();
      }
      if (differs_from(v, m)) {
        return py::bool_(true);
      }
    }
  } catch (const Unsupported&) {
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
  return py::bool_(false);
}

py::object rebuild_instrs(const py::list& instrs, const py::list& found, const py::list& tmpl,
                          const py::list& indices, bool shaped) {
  if (!S.graph_ready || S.instr == nullptr) {
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
  const Py_ssize_t k = PyList_GET_SIZE(indices.ptr());
  const Py_ssize_t nn = PyList_GET_SIZE(instrs.ptr());
  if (PyList_GET_SIZE(found.ptr()) != nn || PyList_GET_SIZE(tmpl.ptr()) != nn) {
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
  std::vector<std::pair<Py_ssize_t, PyObject*>> made;
  made.reserve(k);
  try {
    for (Py_ssize_t j = 0; j < k; ++j) {
      const Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(indices.ptr(), j));
      if (i < 0 || i >= nn) {
        PyErr_Clear();
        throw Unsupported();
      }
      PyObject* n = PyList_GET_ITEM(found.ptr(), i);
      PyObject* t = PyList_GET_ITEM(tmpl.ptr(), i);
      if (Py_TYPE(n) != S.node || Py_TYPE(t) != S.instr) {
        throw Unsupported();
      }
      PyObject* tl = get(t, S.i_leaves);
      if (tl == nullptr || !PyList_CheckExact(tl) || leaf_count(n) != PyList_GET_SIZE(tl)) {
        throw Unsupported();
      }
      made.emplace_back(i, new_instr(n, t, leaves_of(n, tl, shaped)));
    }
  } catch (const Unsupported&) {
    for (auto& [i, ins] : made) {
      Py_DECREF(ins);
    }
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  } catch (...) {
    for (auto& [i, ins] : made) {
      Py_DECREF(ins);
    }
    throw;
  }
  for (auto& [i, ins] : made) {
    if (PyList_SetItem(instrs.ptr(), i, ins) < 0) {  // steals ins
      throw py::error_already_set();
    }
  }
  return py::none();
}

bool constants_same(PyObject* a, PyObject* b) {
  return same_const(a, b);
}

int tensor_meta_eq(PyObject* a, PyObject* b) {
  if (a == b) {
    return 1;
  }
  if (S.tensor_meta == nullptr || Py_TYPE(a) != S.tensor_meta || Py_TYPE(b) != S.tensor_meta) {
    return -1;
  }
  try {
    return meta_eq(a, b) ? 1 : 0;
  } catch (const Unsupported&) {
    return -1;
  }
}

int held_after_sorted(PyObject* n, Py_ssize_t k, const std::vector<Py_ssize_t>& run,
                      Py_ssize_t inside) {
  if (!S.graph_ready || Py_TYPE(n) != S.node) {
    return -1;
  }
  const SortedRun r{run};
  try {
    return held_after(n, k, r, inside) ? 1 : 0;
  } catch (const Unsupported&) {
    return -1;
  }
}

int tensor_meta_same_kind(PyObject* a, PyObject* b) {
  if (S.tensor_meta == nullptr) {
    return -1;
  }
  try {
    return same_kind(a, b) ? 1 : 0;
  } catch (const Unsupported&) {
    return -1;
  }
}

void add_slice_functions(py::module_& m) {
  m.def("_slice_init", &slice_init, py::arg("objects"),
        "Give the native slice and instantiate the classes they read and make (genie.planner "
        "and genie.plan_cache call it at import).");
  m.def("_slice_nodes", &slice_nodes, py::arg("targets"),
        "genie.planner.slice_nodes natively; NotImplemented where it does not apply.");
  m.def("_instantiate", &instantiate, py::arg("plan"), py::arg("targets"), py::arg("nodes"),
        py::arg("generic"),
        "genie.plan_cache.instantiate natively; NotImplemented where it does not apply.");
  m.def("_inputs_differ", &inputs_differ, py::arg("inputs"), py::arg("pin"),
        "Whether a value of `inputs` (slot -> value) differs in shape or strides from `pin`'s "
        "metadata for its slot (genie.plan_cache.match); NotImplemented where it does not apply.");
  m.def("_rebuild_instrs", &rebuild_instrs, py::arg("instrs"), py::arg("found"), py::arg("tmpl"),
        py::arg("indices"), py::arg("shaped"),
        "The instructions a plan-cache hit rebuilds from its nodes, in place; NotImplemented "
        "where it does not apply (nothing written).");
}

}  // namespace genie
