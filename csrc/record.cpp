// genie._C recording fast path: LazyTensor.__torch_dispatch__ in C++ for the common case.
//
// genie.lazy_tensor.record (Python) is the reference: every call this file does not handle goes
// to it (the "fallback", lazy_tensor._dispatch), and what this file does for the calls it handles
// is what record does for them, field for field (tests/unit/test_native_record.py compares the
// two; GENIE_NATIVE_RECORD=0 turns this path off).
//
// Handled: an op whose policy has no randomness, no data dependence, no inplace-view, no portable
// decomposition and no implicit (CompositeImplicitAutograd) kernel (in-place and out= writes
// are handled); every argument and keyword argument a LazyTensor, int, float, bool, None, str,
// dtype, layout, memory format or device, or one level of list/tuple of those; all LazyTensors
// on one device index; the default graph (no genie.capture block), meta cache on, no source
// recording, no profiler; and a meta-cache entry for exactly these arguments (its outputs fresh,
// views or the written arguments, none with conj/neg bits, no out= argument to resize).
// Factory calls (the PrivateUse1 kernels of genie.factories call _record_factory) are handled
// under the same conditions, with no LazyTensor argument and a remote_accelerator device= with
// its index; their reference is genie.lazy_tensor.record_factory.
//
// The cache. Python's meta-cache key is (op, argument tree, TensorMeta of each input by value,
// constants); hashing a TensorMeta by value is Python code. This path keys on the same things
// but takes each input's TensorMeta by identity (a TensorMeta is immutable, and the key holds a
// reference, so its address is never reused while the key lives). A key this path has not seen
// (a "miss": new shapes, every decode step and prompt length) asks genie.lazy_tensor.entry_for
// for the entry Python's meta cache holds for the equal value key (inferring it on a miss there,
// as _record would), checks that entry_for flattened the call into the very leaves this path
// did, remembers key -> entry and records the node here. Where entry_for declines (its
// inference raised: the fallback raises eager's error; config.native_record_miss off), the
// call goes to the fallback, and this path learns key -> entry from the node it records
// (Node.entry). Identity keys are finer than value keys, so an entry remembered is always the
// one Python would use; both caches are cleared together (genie.meta.MetaCache calls
// _record_clear).
//
// Objects: the Node, Refs, Storages, MetaArgs and liveness tokens are allocated as
// object.__new__ does and their __slots__ written directly (offsets from the member descriptors,
// found by name at init), so no Python __init__ runs; _record_init refuses classes whose slots
// differ from the ones written here. What genie.graph.untrack_node and graph.track would take
// off the cyclic GC at the end is made untracked from the start. The output tensor is made as
// torch's _make_wrapper_subclass makes it and wrapped with THPVariable_Wrap(tensor, LazyTensor)
// (torch >= 2.13; older torch builds this file without the fast path: every op takes Python's).
//
// Per op, no dict update and no thread-local lookup: ops_recorded/meta_cache_hits are counted
// here and added to genie.stats when read (stats.sync); the config flags are mirrored on change
// (config.on_change); the per-thread objects are cached by thread state (this_thread).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <pybind11/pybind11.h>
#include <structmember.h>

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Allocator.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#elif __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

#include "device.h"
#include "gccount.h"
#include "node.h"
#include "read.h"
#include "record.h"
#include "wrapper.h"
#include "seq.h"
#include "slots.h"
#include "state.h"
#include "storage.h"

// The output wrapper: THPVariable_Wrap(tensor, type) is exported from torch 2.13 on, so there
// the wrapper is made here as _make_wrapper_subclass makes it. Older torch (2.11 on the GPU
// machines) calls torch.Tensor._make_wrapper_subclass itself (a few µs more per output); the rest
// of the native path is the same. Building with GENIE_WRAP_VIA_PYTHON=1 (setup.py) takes the
// older path on any torch, so it is tested where only a newer torch is installed.
#if !defined(GENIE_WRAP_VIA_PYTHON) && defined(TORCH_VERSION_MAJOR) && \
    defined(TORCH_VERSION_MINOR) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13))
#define GENIE_WRAP_NATIVE 1
#else
#define GENIE_WRAP_NATIVE 0
#endif

namespace py = pybind11;

namespace {

// --- Python objects this path reads or writes, set once by _record_init ----------------------

PyObject* intern(const char* s) {
  return PyUnicode_InternFromString(s);
}

struct Names {
  PyObject* profiler_enabled = intern("_is_profiler_enabled");
  PyObject* graphs = intern("graphs");
  PyObject* ctx = intern("ctx");
  PyObject* backward = intern("backward");
  PyObject* node = intern("_node");
  PyObject* out = intern("_out");
  PyObject* alive = intern("_alive");
  PyObject* policy = intern("_genie_policy");
  PyObject* ops_recorded = intern("ops_recorded");
  PyObject* meta_cache_hits = intern("meta_cache_hits");
  PyObject* unflatten = intern("unflatten");
  PyObject* dict = intern("__dict__");
  PyObject* thread_key = intern("genie.record.thread");
  PyObject* factories_recorded = intern("factories_recorded");
  PyObject* active = intern("_active");
  PyObject* context_on = intern("_on");
  PyObject* device = intern("device");
  PyObject* meta_cache_misses = intern("meta_cache_misses");
  PyObject* shape_rule_hits = intern("shape_rule_hits");
  PyObject* type = intern("type");
};

Names* names = nullptr;

// Offsets of a slotted class's fields: slots.h.
using genie::slot_offset;

// The class must have exactly these slots (besides __weakref__): a field this file does not
// know of would be left unset, so such a class turns the fast path off instead.
void check_slots(PyTypeObject* t, const std::vector<std::string>& expected) {
  py::tuple slots = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(t))
                        .attr("__slots__")
                        .cast<py::tuple>();
  std::vector<std::string> got;
  for (const auto& s : slots) {
    auto name = s.cast<std::string>();
    if (name != "__weakref__") {
      got.push_back(name);
    }
  }
  if (got != expected) {
    throw std::runtime_error(std::string(t->tp_name) +
                             " has other slots than the native record path writes");
  }
}

inline PyObject*& slot(PyObject* o, Py_ssize_t off) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
}

// Write a slot of a fresh object (empty until now); steals `v`.
inline void init_slot(PyObject* o, Py_ssize_t off, PyObject* v) {
  slot(o, off) = v;
}

// A borrowed item of a dict (str keys), or nullptr; a lookup error propagates.
inline PyObject* dict_get(PyObject* d, PyObject* key) {
  PyObject* v = PyDict_GetItemWithError(d, key);
  if (v == nullptr && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return v;
}

inline PyObject* new_ref(PyObject* o) {
  Py_INCREF(o);
  return o;
}

struct NodeSlots {
  Py_ssize_t op, spec, metas, out_spec, storages, writes, outputs, values, executed, index,
      rng, graph, seq, where, consumers, tags, entry, ctx, wref;
};

struct State {
  PyTypeObject* lazy = nullptr;
  PyTypeObject* node = nullptr;
  PyTypeObject* ref = nullptr;
  PyTypeObject* storage = nullptr;
  PyTypeObject* meta_arg = nullptr;
  PyTypeObject* tensor_meta = nullptr;
  PyTypeObject* meta_entry = nullptr;
  PyTypeObject* graph_type = nullptr;
  PyObject* fallback = nullptr;       // lazy_tensor._dispatch(func, args, kwargs)
  PyObject* entry_for = nullptr;      // lazy_tensor.entry_for(func, args, kwargs), or nullptr
  PyObject* counts = nullptr;         // genie.stats._counts
  PyObject* profiler = nullptr;       // torch.autograd.profiler.__dict__
  PyObject* tls = nullptr;            // lazy_tensor._tls (graphs: the capture stack)
  PyObject* current = nullptr;        // graph.current (ctx, backward)
  PyObject* default_graph = nullptr;
  PyObject* graph_dict = nullptr;  // default_graph.__dict__ (keep_nodes)
  PyObject* counter = nullptr;  // graph._record_counter
  PyObject* leaf_spec = nullptr;
  PyObject* copy_ops = nullptr;  // a tuple of ops that always take the fallback
  PyObject* detach = nullptr;    // aten.detach.default (lazy_tensor._detach_alias), or nullptr
  PyObject* device_ops = nullptr;  // ops taken only when every device argument is this backend's
  PyObject* pending_total = nullptr;  // graph.pending_total (a one-item list)
  PyObject* retrack_below = nullptr;  // _C._gc_retrack_below(leaves, Ref)
  PyObject* defer_writer = nullptr;   // graph.defer_writer(wref)
  PyObject* factory_fallback = nullptr;  // lazy_tensor.record_factory(func, args, kwargs)
  PyObject* context_dict = nullptr;      // genie.context.__dict__ (_active)
  PyObject* rules = nullptr;             // genie.shape_rules.RULES, or nullptr
  PyObject* kw_rules = nullptr;          // genie.shape_rules.KW_RULES, or nullptr
  PyObject* meta_cache_dict = nullptr;   // genie.meta.meta_cache._d, or nullptr
  size_t limit = 1 << 16;       // entries, as genie.meta.MetaCache.limit
  NodeSlots n{};
  Py_ssize_t ref_node = 0, ref_out = 0;
  Py_ssize_t st_pending = 0, st_readers = 0, st_prune = 0, st_role = 0;
  Py_ssize_t tm_shape = 0, tm_stride = 0, tm_offset = 0, tm_dtype = 0, tm_index = 0,
             tm_conj = 0, tm_neg = 0;
  Py_ssize_t me_metas = 0, me_out_spec = 0, me_consts = 0, me_plan = 0, me_spec = 0, me_klass = 0,
             me_state = 0;
  Py_ssize_t ma_meta = 0;
  bool ready = false;
};

// genie.config.config's flags this path reads, mirrored by _record_config on every change.
struct Flags {
  bool native_record = false;
  bool meta_cache = false;
  bool record_source = true;
  bool gc_untrack = true;
  bool gc_defer_writes = true;
  bool native_record_miss = true;
  bool stack_record = true;         // config.stack_record: record_stack takes what it can
  bool stack_record_check = false;  // config.stack_record_check: each such call checked
  bool generic_meta = true;  // config.generic_meta and config.shape_rules
};

Flags flags;

State S;

// Why calls took the fallback: read by tests and benchmarks through _record_stats().
enum Reason {
  kHandled,
  kLearned,
  kOff,
  kProfiler,
  kKwargs,
  kOpPolicy,
  kArgs,
  kDevices,
  kCapture,
  kUnseen,
  kEntry,
  kMissNative,
  kReasons
};
const char* const kReasonNames[kReasons] = {
    "handled", "learned", "off", "profiler", "kwargs", "op_policy", "arguments",
    "devices", "capture", "unseen", "entry", "miss_native"};
std::array<uint64_t, kReasons> reasons{};

PyObject* checked(PyObject* o);

// --- per-thread objects ----------------------------------------------------------------------
//
// The capture stack (lazy_tensor._tls.graphs) and genie.graph.current's dict are per thread
// (threading.local); looking them up costs more than the rest of a node's fields. They are
// cached per OS thread, keyed by the Python thread state's unique id, and kept alive in that
// thread state's dict, which Python clears when the thread state goes: a cached pointer is used
// only while the thread state that owns it lives. Neither object is replaced while its thread
// lives (capture pushes onto the one list; a threading.local keeps one dict per thread).

struct ThreadObjects {
  uint64_t id = UINT64_MAX;
  PyObject* graphs = nullptr;   // borrowed (held by the thread state's dict)
  PyObject* current = nullptr;  // borrowed (held by the thread state's dict)
  // genie.context._tls.modules and .phases (borrowed, held by the thread state's dict), read by
  // ctx_push / ctx_pop; nullptr until first needed on this thread
  PyObject* ctx_modules = nullptr;
  PyObject* ctx_phases = nullptr;
};

thread_local ThreadObjects thread_objects;

const ThreadObjects& this_thread() {
  PyThreadState* ts = PyThreadState_Get();
  const uint64_t id = PyThreadState_GetID(ts);
  ThreadObjects& t = thread_objects;
  if (t.id == id) {
    return t;
  }
  py::object graphs = py::reinterpret_steal<py::object>(checked(PyObject_GetAttr(S.tls, names->graphs)));
  py::object current =
      py::reinterpret_steal<py::object>(checked(PyObject_GetAttr(S.current, names->dict)));
  if (!PyList_Check(graphs.ptr()) || !PyDict_Check(current.ptr())) {
    throw std::logic_error("lazy_tensor._tls.graphs is not a list or graph.current has no dict");
  }
  PyObject* tdict = PyThreadState_GetDict();  // borrowed
  if (tdict == nullptr) {
    throw std::logic_error("no thread state dict");
  }
  py::object pair = py::reinterpret_steal<py::object>(
      checked(PyTuple_Pack(2, graphs.ptr(), current.ptr())));
  if (PyDict_SetItem(tdict, names->thread_key, pair.ptr()) < 0) {
    throw py::error_already_set();
  }
  t.id = id;
  t.graphs = graphs.ptr();
  t.current = current.ptr();
  t.ctx_modules = t.ctx_phases = nullptr;
  return t;
}

// --- per-op facts from genie.meta.OpPolicy, cached by op object -----------------------------

struct OpInfo {
  bool ok = false;  // the policy allows this path at all
  bool float_values_matter = true;
  bool metadata_only = false;
  bool same_device = false;  // a device argument off this backend is a transfer: the fallback's
  std::vector<Py_ssize_t> writes;  // schema positions of the arguments it mutates
  std::vector<Py_ssize_t> unmarked;  // those its schema does not mark (OpPolicy.unmarked)
  Py_ssize_t write_flag = -1;  // the bool without which it writes none of them (OpPolicy.write_flag)
  PyObject* names = nullptr;       // argument names by schema position (a tuple, held)
  PyObject* pol_key = nullptr;     // OpPolicy.key (held): the op in Python's meta-cache keys
  PyObject* rule = nullptr;        // its positional shape rule (genie.shape_rules.RULES), held
  PyObject* kw_rule = nullptr;     // else its keyword rule (shape_rules.KW_RULES: factories), held
};

std::unordered_map<PyObject*, OpInfo> ops;  // keys hold a reference to the op

// In front of `ops`, direct-mapped by the op's address: one read for the op of a recorded call.
// Never cleared: `ops` keeps its elements in place and forever (and the ops alive).
struct OpSlot {
  PyObject* op = nullptr;
  const OpInfo* info = nullptr;
};
std::array<OpSlot, 256> op_slots;

bool truthy_attr(PyObject* o, const char* name) {
  PyObject* v = PyObject_GetAttrString(o, name);
  if (v == nullptr) {
    throw py::error_already_set();
  }
  int r = PyObject_IsTrue(v);
  Py_DECREF(v);
  if (r < 0) {
    throw py::error_already_set();
  }
  return r != 0;
}

// The op's facts, or nullptr while its policy is not cached yet (genie.meta.policy stores it on
// the op as _genie_policy the first time the fallback records it).
const OpInfo* op_info(PyObject* func) {
  OpSlot& c = op_slots[(reinterpret_cast<uintptr_t>(func) >> 4) & (op_slots.size() - 1)];
  if (c.op == func) {
    return c.info;
  }
  auto it = ops.find(func);
  if (it != ops.end()) {
    c = {func, &it->second};
    return &it->second;
  }
  // The generic lookup: an OpOverload's own __getattr__ (Python) must not run here.
  PyObject* pol = PyObject_GenericGetAttr(func, names->policy);
  if (pol == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  OpInfo info;
  try {
    int copy = PySequence_Contains(S.copy_ops, func);
    if (copy < 0) {
      throw py::error_already_set();
    }
    PyObject* portable = PyObject_GetAttrString(pol, "portable");
    if (portable == nullptr) {
      throw py::error_already_set();
    }
    const bool has_portable = portable != Py_None;
    Py_DECREF(portable);
    if (S.device_ops != nullptr) {
      const int same = PySequence_Contains(S.device_ops, func);
      if (same < 0) {
        throw py::error_already_set();
      }
      info.same_device = same != 0;
    }
    info.ok = !copy && !has_portable && !truthy_attr(pol, "random") &&
        !truthy_attr(pol, "dynamic") && !truthy_attr(pol, "inplace_view") &&
        !truthy_attr(pol, "implicit");
    info.float_values_matter = truthy_attr(pol, "float_values_matter");
    info.metadata_only = truthy_attr(pol, "metadata_only");
    py::object writes = py::reinterpret_steal<py::object>(checked(PyObject_GetAttrString(pol, "writes")));
    for (const auto& w : writes) {
      info.writes.push_back(w.cast<Py_ssize_t>());
    }
    py::object unmarked = py::reinterpret_steal<py::object>(
        checked(PyObject_GetAttrString(pol, "unmarked")));
    for (const auto& w : unmarked) {
      info.unmarked.push_back(w.cast<Py_ssize_t>());
    }
    info.write_flag = py::reinterpret_steal<py::object>(
        checked(PyObject_GetAttrString(pol, "write_flag"))).cast<Py_ssize_t>();
    info.pol_key = checked(PyObject_GetAttrString(pol, "key"));
    if (S.rules != nullptr) {
      PyObject* rule = PyDict_GetItemWithError(S.rules, func);  // borrowed
      if (rule == nullptr && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      info.rule = rule != nullptr ? new_ref(rule) : nullptr;
    }
    if (S.kw_rules != nullptr && info.rule == nullptr) {  // as meta._infer: a rule comes first
      PyObject* rule = PyDict_GetItemWithError(S.kw_rules, func);  // borrowed
      if (rule == nullptr && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      info.kw_rule = rule != nullptr ? new_ref(rule) : nullptr;
    }
    info.names = checked(PyObject_GetAttrString(pol, "names"));
    if (!PyTuple_CheckExact(info.names)) {
      Py_DECREF(info.names);
      throw std::logic_error("OpPolicy.names is not a tuple");
    }
  } catch (...) {
    Py_DECREF(pol);
    throw;
  }
  Py_DECREF(pol);
  Py_INCREF(func);
  const OpInfo* r = &ops.emplace(func, info).first->second;
  c = {func, r};
  return r;
}

// --- the identity key ------------------------------------------------------------------------
//
// One word per tag and one per payload: a LazyTensor's TensorMeta address, an int's or bool's
// value, a float's bits (or nothing when float values cannot change the output metadata), a
// dtype's, layout's or memory format's address (torch's singletons), a device's type and index,
// a str's interned copy; a list/tuple header with its length; the keyword arguments after the
// positional ones, each its (interned) name then its value, in name order (as optree flattens
// a dict). The op's address comes first, then (kState, the global state word: csrc/state.cpp),
// which Python's key holds third (after the op and the argument tree).

enum Tag : uint64_t {
  kLazy = 1, kInt, kBool, kFloat, kNone, kDtype, kStr, kSingleton, kDevice, kList, kTuple, kDict,
  kKey, kState
};

using Words = c10::SmallVector<uint64_t, 32>;
// A learned key's words: inline for up to 16 (a call of up to six leaves), read by a lookup
// right after the table's slot.
using KeyWords = c10::SmallVector<uint64_t, 16>;

template <class W>
uint64_t hash_words(const W& w) {
  uint64_t h = 0x9E3779B97F4A7C15ull;
  for (uint64_t x : w) {
    h ^= x + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  }
  h ^= h >> 33;  // a finalizer (MurmurHash3's): WordTable's slot is the hash's low bits
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  return h;
}

// One output tensor of a learned entry, decoded once from its TensorMeta.
enum class Kind { kFresh, kView, kWrite };

struct Out {
  Py_ssize_t k = 0;      // flat output position
  Kind kind = Kind::kFresh;
  Py_ssize_t pos = -1;   // view, write: schema position of the aliased or written argument
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
  c10::DeviceIndex index = 0;
  size_t nbytes = 0;
};

struct Entry {
  KeyWords words;
  std::vector<PyObject*> held;  // the TensorMetas and dtypes whose addresses are in `words`
  PyObject* entry = nullptr;    // the genie.meta.MetaEntry
  PyObject* metas = nullptr;
  PyObject* out_spec = nullptr;
  PyObject* consts = nullptr;
  PyObject* spec = nullptr;
  bool single = false;       // out_spec is a leaf: return the tensor itself
  // out_spec a tuple or a list of leaves (native_layer_norm, split, the _foreach ops): the
  // value is the flat outputs as that type, made here instead of by out_spec.unflatten
  PyTypeObject* flat_kind = nullptr;
  bool python_only = false;  // a plan this path does not make (conj/neg outputs, out= resizes)
  std::vector<Out> outs;
  std::shared_ptr<Entry> next;  // same hash

  ~Entry() {
    for (PyObject* o : held) {
      Py_DECREF(o);
    }
    Py_XDECREF(entry);
    Py_XDECREF(metas);
    Py_XDECREF(out_spec);
    Py_XDECREF(consts);
    Py_XDECREF(spec);
  }
};

// Objects keyed by a call's words (Entry, Generic), bounded like genie.meta.MetaCache (cleared
// when full). Open addressing (linear probing, at most half full, a power of two of slots): a
// lookup reads one slot, then the object's words (inline in it for most calls). A recorded
// op pays one lookup; in a decode step, where the objects are out of cache (the step's kernels
// ran in between), the chained std::unordered_map it replaces cost two more dependent reads
// (bucket, node) and a division per lookup.
template <class T>
struct WordTable {
  struct Slot {
    uint64_t h = 0;
    std::shared_ptr<T> e;  // empty: a free slot
  };
  std::vector<Slot> slots;
  size_t n = 0;

  template <class W>
  static bool same(const T& x, const W& w) {
    return x.words.size() == w.size() &&
        std::memcmp(x.words.data(), w.data(), w.size() * sizeof(uint64_t)) == 0;
  }

  // The slot of `w` (hash `h`), or the free slot where it would go. Needs a slot free.
  template <class W>
  size_t probe(uint64_t h, const W& w) const {
    const size_t mask = slots.size() - 1;
    size_t i = static_cast<size_t>(h) & mask;
    while (slots[i].e && !(slots[i].h == h && same(*slots[i].e, w))) {
      i = (i + 1) & mask;
    }
    return i;
  }

  // A copy of the shared_ptr (two atomic operations) only for the one returned.
  std::shared_ptr<T> find(uint64_t h, const Words& w) const {
    if (n == 0) {
      return nullptr;
    }
    return slots[probe(h, w)].e;
  }

  // Remember `e` (its words `e->words`, hash `h`): in place of an object with equal words, as
  // the newest of a chain was found first before.
  void store(uint64_t h, std::shared_ptr<T> e, size_t limit) {
    if (n >= limit) {
      clear();
    }
    if ((n + 1) * 2 > slots.size()) {
      grow();
    }
    Slot& s = slots[probe(h, e->words)];
    if (!s.e) {
      n++;
    }
    std::shared_ptr<T> old = std::move(s.e);  // released last: its destructor may run Python
    s.h = h;
    s.e = std::move(e);
  }

  void grow() {
    std::vector<Slot> old(std::max<size_t>(64, slots.size() * 2));
    old.swap(slots);
    const size_t mask = slots.size() - 1;
    for (Slot& s : old) {
      if (s.e) {
        size_t i = static_cast<size_t>(s.h) & mask;
        while (slots[i].e) {
          i = (i + 1) & mask;
        }
        slots[i] = std::move(s);
      }
    }
  }

  void clear() {
    // Move out first: destructors release Python objects, which may run code that reaches here.
    std::vector<Slot> old;
    old.swap(slots);
    n = 0;
    old.clear();
  }
};

// Never destroyed: its entries hold Python references, and C++ static destructors run after
// the interpreter is gone.
WordTable<Entry>& entries = *new WordTable<Entry>();

// --- shape-generic entries ---------------------------------------------------------------
//
// A call whose exact key was never seen (a new sequence length, batch size, KV-cache length) is
// a meta-cache miss. Where Python answered the first miss of its *shape class* (op, argument
// tree, each tensor's dtype, rank, device and math bits, numbers by type, other constants by
// value) with a shape rule (genie.shape_rules.RULES, KW_RULES), or found its entry by value (a
// hit of Python's meta cache for inputs that are new TensorMeta objects), every later miss of
// that class calls the rule here, with the call's TensorMetas in place of its LazyTensors, and
// makes the MetaEntry itself from what the class shares (argument tree spec, output spec and
// plan, the interned shape class): what lazy_tensor.entry_for -> meta.infer would make, without
// Python's flattening, key hashing, dataclass construction and shape-class interning (~20 of a
// miss's ~25-35 µs). The entry goes into Python's meta cache under the key Python builds (a key
// already there is a hit, as in entry_for), counted as entry_for counts. A rule that declines,
// raises, or answers with outputs of another count, dtype, rank or device than the class's
// takes entry_for's path. GENIE_GENERIC_META=0 (config.generic_meta) turns this off.

struct OutKind {
  PyObject* dtype;  // torch.dtype singleton
  Py_ssize_t rank;
  int64_t index;
};

struct Generic {
  KeyWords words;  // the class words (flatten's words, payloads by class)
  std::vector<py::object> held;  // interned strs whose addresses are in `words`
  py::object rule, spec, out_spec, plan, klass;
  bool kw = false;  // rule(args, kwargs, index) (a keyword rule), not rule(args, index)
  PyTypeObject* seq = nullptr;  // tuple or list for several outputs; nullptr for one tensor
  std::vector<OutKind> outs;
  std::shared_ptr<Generic> next;  // same hash
};

WordTable<Generic>& generics = *new WordTable<Generic>();
uint64_t n_generic_made = 0;  // entries made from a shape class's rule (_record_stats)

void clear_entries() {
  entries.clear();
  generics.clear();
}

// --- one call's arguments ----------------------------------------------------------------

// A LazyTensor's attribute (its _node, _out), new reference or nullptr: read from its instance
// dict (materialized by graph.track), as generic attribute lookup finds it there.
PyObject* lazy_attr(PyObject* t, PyObject* name) {
  if (genie::LazyImpl* impl = genie::lazy_impl_of(t)) {  // the native path's wrappers
    PyObject* v = name == names->node ? impl->node : name == names->out ? impl->out : nullptr;
    if (v != nullptr) {
      return new_ref(v);
    }
  }
#if PY_VERSION_HEX < 0x030D0000
  PyObject** dp = _PyObject_GetDictPtr(t);
  PyObject* v = dp != nullptr && *dp != nullptr ? PyDict_GetItemWithError(*dp, name) : nullptr;
#else
  PyObject* d = PyObject_GenericGetDict(t, nullptr);
  PyObject* v = d != nullptr ? PyDict_GetItemWithError(d, name) : nullptr;
  Py_XDECREF(d);  // the tensor holds its dict
#endif
  if (v == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  return new_ref(v);
}

// lazy_attr(t, "_node") and lazy_attr(t, "_out") from one look at the dict (new references);
// false, with neither set, where either is missing.
bool lazy_attrs(PyObject* t, PyObject** node, PyObject** out) {
  if (genie::LazyImpl* impl = genie::lazy_impl_of(t)) {  // the native path's wrappers
    if (impl->node != nullptr && impl->out != nullptr) {
      *node = new_ref(impl->node);
      *out = new_ref(impl->out);
      return true;
    }
  }
#if PY_VERSION_HEX < 0x030D0000
  PyObject** dp = _PyObject_GetDictPtr(t);
  PyObject* d = dp != nullptr ? *dp : nullptr;
  PyObject* n = d != nullptr ? PyDict_GetItemWithError(d, names->node) : nullptr;
  PyObject* o = n != nullptr ? PyDict_GetItemWithError(d, names->out) : nullptr;
  if (o == nullptr) {
    PyErr_Clear();
    return false;
  }
  *node = new_ref(n);
  *out = new_ref(o);
  return true;
#else
  *node = lazy_attr(t, names->node);
  if (*node == nullptr) {
    return false;
  }
  *out = lazy_attr(t, names->out);
  if (*out == nullptr) {
    Py_CLEAR(*node);
    return false;
  }
  return true;
#endif
}

struct Lazy {
  PyObject* tensor;     // borrowed (the call's args hold it)
  PyObject* node;       // owned
  PyObject* out;        // owned
  Py_ssize_t out_i;
  PyObject* meta;       // borrowed from node.metas
  Py_ssize_t leaf;      // position among the leaves
};

struct Call {
  c10::SmallVector<PyObject*, 16> leaves;  // borrowed
  c10::SmallVector<Lazy, 8> lazies;
  c10::SmallVector<PyObject*, 4> interned;  // owned: interned strs whose addresses are in words
  c10::SmallVector<PyObject*, 8> owned;  // the leaves record_stack made from IValues
  Words words;
  bool nan = false;  // a NaN float key: never learned (Python keys compare NaNs by identity)
  Reason reason = kArgs;  // why flatten refused the call

  ~Call() {
    for (auto& l : lazies) {
      Py_XDECREF(l.node);
      Py_XDECREF(l.out);
    }
    for (PyObject* s : interned) {
      Py_DECREF(s);
    }
    for (PyObject* o : owned) {
      Py_DECREF(o);
    }
  }
};

// The interned str equal to `s` (a new reference, kept by the call).
PyObject* interned(Call& call, PyObject* s) {
  Py_INCREF(s);
  PyUnicode_InternInPlace(&s);
  call.interned.push_back(s);
  return s;
}

// A LazyTensor leaf `x` of a call, its node and output number read (new references, which the
// Lazy record takes): the record, at the next leaf's position, with its output's metadata, and
// its device index checked against the call's (`index`, -1 before the first). kNo: not a call
// these paths take (an error PyLong_AsSsize_t set for an output number past Py_ssize_t stays
// set: flatten's caller reports it); kDevices: LazyTensors on several devices. flatten and
// record_stack both read their LazyTensors with it.
enum class LeafRead { kOk, kNo, kDevices };
LeafRead read_lazy_leaf(PyObject* x, PyObject* node, PyObject* out, Call& call, int64_t& index) {
  call.lazies.push_back(Lazy{x, node, out, 0, nullptr,
                             static_cast<Py_ssize_t>(call.leaves.size())});
  if (Py_TYPE(node) != S.node || !PyLong_CheckExact(out)) {
    return LeafRead::kNo;
  }
  Lazy& l = call.lazies.back();
  l.out_i = PyLong_AsSsize_t(out);
  PyObject* metas = slot(node, S.n.metas);
  if (metas == nullptr || !PyList_CheckExact(metas) || l.out_i < 0 ||
      l.out_i >= PyList_GET_SIZE(metas)) {
    return LeafRead::kNo;
  }
  l.meta = PyList_GET_ITEM(metas, l.out_i);
  if (Py_TYPE(l.meta) != S.tensor_meta) {
    return LeafRead::kNo;
  }
  PyObject* idx = slot(l.meta, S.tm_index);
  const int64_t i = idx != nullptr ? PyLong_AsLongLong(idx) : -2;
  if (i < 0) {
    PyErr_Clear();
    return LeafRead::kNo;
  }
  if (index < 0) {
    index = i;
  } else if (i != index) {
    return LeafRead::kDevices;
  }
  return LeafRead::kOk;
}

// Fills call.leaves/words/lazies from the positional args; false: not a call this path takes
// (`factory`: a call with no LazyTensor argument at all, the others at least one).
// May leave a Python error set (then returns false and the caller reports it).
bool flatten(PyObject* args, PyObject* kwargs, const OpInfo& info, PyObject* func, Call& call,
             bool factory = false) {
  call.words.push_back(reinterpret_cast<uint64_t>(func));
  call.words.push_back(kState);
  call.words.push_back(genie::state_word());
  int64_t index = -1;
  auto leaf = [&](PyObject* x) -> bool {
    PyTypeObject* t = Py_TYPE(x);
    if (t == S.lazy) {
      PyObject* node;
      PyObject* out;
      if (!lazy_attrs(x, &node, &out)) {
        return false;
      }
      const LeafRead r = read_lazy_leaf(x, node, out, call, index);
      if (r != LeafRead::kOk) {
        if (r == LeafRead::kDevices) {
          call.reason = kDevices;
        }
        return false;
      }
      const Lazy& l = call.lazies.back();
      call.words.push_back(kLazy);
      call.words.push_back(reinterpret_cast<uint64_t>(l.meta));
    } else if (t == &PyLong_Type) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
      if (overflow != 0) {
        return false;
      }
      call.words.push_back(kInt);
      call.words.push_back(static_cast<uint64_t>(v));
    } else if (t == &PyBool_Type) {
      call.words.push_back(kBool);
      call.words.push_back(x == Py_True ? 1 : 0);
    } else if (t == &PyFloat_Type) {
      call.words.push_back(kFloat);
      if (info.float_values_matter) {
        const double v = PyFloat_AS_DOUBLE(x);
        uint64_t bits;
        std::memcpy(&bits, &v, sizeof bits);
        call.words.push_back(bits);
        call.nan = call.nan || std::isnan(v);
      } else {
        call.words.push_back(0);
      }
    } else if (x == Py_None) {
      call.words.push_back(kNone);
      call.words.push_back(0);
    } else if (THPDtype_Check(x)) {
      call.words.push_back(kDtype);
      call.words.push_back(reinterpret_cast<uint64_t>(x));
    } else if (t == &PyUnicode_Type) {
      call.words.push_back(kStr);
      call.words.push_back(reinterpret_cast<uint64_t>(interned(call, x)));
    } else if (THPLayout_Check(x) || THPMemoryFormat_Check(x)) {
      call.words.push_back(kSingleton);
      call.words.push_back(reinterpret_cast<uint64_t>(x));
    } else if (THPDevice_Check(x)) {
      const c10::Device d = reinterpret_cast<THPDevice*>(x)->device;
      if (info.same_device && d.type() != c10::DeviceType::PrivateUse1) {
        return false;  // x.to("cpu"): a download, materialized by the fallback
      }
      call.words.push_back(kDevice);
      call.words.push_back((static_cast<uint64_t>(d.type()) << 16) |
                           static_cast<uint16_t>(d.index()));
    } else {
      return false;
    }
    call.leaves.push_back(x);
    return true;
  };
  auto arg = [&](PyObject* a) -> bool {
    const bool is_list = PyList_CheckExact(a);
    if (is_list || PyTuple_CheckExact(a)) {
      const Py_ssize_t k = is_list ? PyList_GET_SIZE(a) : PyTuple_GET_SIZE(a);
      call.words.push_back(is_list ? kList : kTuple);
      call.words.push_back(static_cast<uint64_t>(k));
      for (Py_ssize_t j = 0; j < k; ++j) {
        if (!leaf(is_list ? PyList_GET_ITEM(a, j) : PyTuple_GET_ITEM(a, j))) {
          return false;
        }
      }
      return true;
    }
    return leaf(a);
  };
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!arg(PyTuple_GET_ITEM(args, i))) {
      return false;
    }
  }
  const Py_ssize_t nk = kwargs != nullptr ? PyDict_GET_SIZE(kwargs) : 0;
  if (nk > 0) {
    c10::SmallVector<std::pair<PyObject*, PyObject*>, 4> items;
    Py_ssize_t it = 0;
    PyObject* key;
    PyObject* value;
    while (PyDict_Next(kwargs, &it, &key, &value)) {
      if (!PyUnicode_CheckExact(key)) {
        return false;
      }
      items.emplace_back(key, value);
    }
    std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
      return PyUnicode_Compare(a.first, b.first) < 0;
    });
    call.words.push_back(kDict);
    call.words.push_back(static_cast<uint64_t>(nk));
    for (const auto& [k, v] : items) {
      call.words.push_back(kKey);
      call.words.push_back(reinterpret_cast<uint64_t>(interned(call, k)));
      if (!arg(v)) {
        return false;
      }
    }
  }
  return factory ? call.lazies.empty() : !call.lazies.empty();
}

// OpPolicy.arg: the argument at schema position `pos` (borrowed; nullptr when absent).
PyObject* arg_at(const OpInfo& info, PyObject* args, PyObject* kwargs, Py_ssize_t pos) {
  if (pos < PyTuple_GET_SIZE(args)) {
    return PyTuple_GET_ITEM(args, pos);
  }
  if (kwargs == nullptr || pos >= PyTuple_GET_SIZE(info.names)) {
    return nullptr;
  }
  PyObject* v = PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(info.names, pos));
  if (v == nullptr) {
    PyErr_Clear();
  }
  return v;
}

// The LazyTensor an output aliases: the argument at `o.pos`, or of a list there the k-th
// (written) or first (viewed) element; nullptr when it is no LazyTensor.
PyObject* alias_source(const OpInfo& info, PyObject* args, PyObject* kwargs, const Out& o) {
  PyObject* src = arg_at(info, args, kwargs, o.pos);
  if (src != nullptr && (PyList_CheckExact(src) || PyTuple_CheckExact(src))) {
    const Py_ssize_t i = o.kind == Kind::kWrite ? o.k : 0;
    src = i < PySequence_Fast_GET_SIZE(src) ? PySequence_Fast_ITEMS(src)[i] : nullptr;
  }
  return src != nullptr && Py_TYPE(src) == S.lazy ? src : nullptr;
}

// A LazyTensor's Storage (t._node.storage(t._out)), new reference, or nullptr.
PyObject* storage_of(PyObject* t) {
  py::object node = py::reinterpret_steal<py::object>(lazy_attr(t, names->node));
  py::object out = py::reinterpret_steal<py::object>(lazy_attr(t, names->out));
  if (!node || !out || Py_TYPE(node.ptr()) != S.node || !PyLong_CheckExact(out.ptr())) {
    return nullptr;
  }
  PyObject* sts = slot(node.ptr(), S.n.storages);
  const Py_ssize_t i = PyLong_AsSsize_t(out.ptr());
  PyObject* st = sts == nullptr ? nullptr : genie::per_output(sts, i);
  if (st == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  return Py_TYPE(st) == S.storage ? new_ref(st) : nullptr;
}

// storage_of(t) for a LazyTensor among the call's arguments: from the node and output flatten
// read for it (no second look into its dict); storage_of where it is not among them.
PyObject* storage_in(const Call& call, PyObject* t) {
  for (const Lazy& l : call.lazies) {
    if (l.tensor != t) {
      continue;
    }
    PyObject* sts = slot(l.node, S.n.storages);
    PyObject* st = sts == nullptr ? nullptr : genie::per_output(sts, l.out_i);
    return st != nullptr && Py_TYPE(st) == S.storage ? new_ref(st) : nullptr;
  }
  return storage_of(t);
}

// The storages the op writes, as lazy_tensor._record collects them (LazyTensor arguments at the
// positions OpPolicy.call_writes gives, and the LazyTensors in lists there), new references;
// false when one has no storage.
bool write_storages(const OpInfo& info, PyObject* args, PyObject* kwargs, const Call* call,
                    c10::SmallVector<py::object, 4>& out) {
  const bool flag_off =
      info.write_flag >= 0 && arg_at(info, args, kwargs, info.write_flag) == Py_False;
  for (Py_ssize_t pos : info.writes) {
    if (flag_off &&
        std::find(info.unmarked.begin(), info.unmarked.end(), pos) != info.unmarked.end()) {
      continue;  // an eval-mode batch norm reads its running statistics
    }
    PyObject* a = arg_at(info, args, kwargs, pos);
    if (a == nullptr) {
      continue;
    }
    const bool seq = PyList_CheckExact(a) || PyTuple_CheckExact(a);
    const Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(a) : 1;
    PyObject** items = seq ? PySequence_Fast_ITEMS(a) : &a;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (Py_TYPE(items[i]) != S.lazy) {
        continue;
      }
      PyObject* st = call != nullptr ? storage_in(*call, items[i]) : storage_of(items[i]);
      if (st == nullptr) {
        return false;
      }
      out.push_back(py::reinterpret_steal<py::object>(st));
    }
  }
  return true;
}

// --- learning an entry from what the fallback recorded ----------------------------------------

PyObject* first_lazy(PyObject* result) {
  if (Py_TYPE(result) == S.lazy) {
    return result;
  }
  if (PyTuple_CheckExact(result) || PyList_CheckExact(result)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(result);
    PyObject** items = PySequence_Fast_ITEMS(result);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (Py_TYPE(items[i]) == S.lazy) {
        return items[i];
      }
    }
  }
  return nullptr;
}

bool decode_meta(PyObject* m, Out& o) {
  if (Py_TYPE(m) != S.tensor_meta) {
    return false;
  }
  if (slot(m, S.tm_conj) != Py_False || slot(m, S.tm_neg) != Py_False) {
    return false;  // the wrapper would need its math bits set: left to Python
  }
  PyObject* shape = slot(m, S.tm_shape);
  PyObject* stride = slot(m, S.tm_stride);
  PyObject* dtype = slot(m, S.tm_dtype);
  if (!PyTuple_CheckExact(shape) || !PyTuple_CheckExact(stride) ||
      PyTuple_GET_SIZE(shape) != PyTuple_GET_SIZE(stride) || !THPDtype_Check(dtype)) {
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); ++i) {
    o.sizes.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)));
    o.strides.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(stride, i)));
  }
  o.offset = PyLong_AsLongLong(slot(m, S.tm_offset));
  const long long index = PyLong_AsLongLong(slot(m, S.tm_index));
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (index < 0 || index > 127) {
    return false;
  }
  o.index = static_cast<c10::DeviceIndex>(index);
  o.dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  o.nbytes = at::detail::computeStorageNbytes(o.sizes, o.strides, c10::elementSize(o.dtype),
                                              static_cast<size_t>(o.offset));
  return true;
}

// Reads the entry's plan: per tensor output (k, None | "view" | "write", position).
bool read_plan(Entry& e, PyObject* plan) {
  if (!PyTuple_CheckExact(plan)) {
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(plan); ++i) {
    PyObject* p = PyTuple_GET_ITEM(plan, i);
    if (!PyTuple_CheckExact(p) || PyTuple_GET_SIZE(p) != 3) {
      return false;
    }
    Out o;
    o.k = PyLong_AsSsize_t(PyTuple_GET_ITEM(p, 0));
    PyObject* kind = PyTuple_GET_ITEM(p, 1);
    if (kind == Py_None) {
      o.kind = Kind::kFresh;
    } else if (PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, "view") == 0) {
      o.kind = Kind::kView;
    } else if (PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, "write") == 0) {
      o.kind = Kind::kWrite;  // the op returns its mutated argument itself
    } else {
      return false;
    }
    if (o.kind != Kind::kFresh) {
      o.pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(p, 2));
      if (o.pos < 0) {
        PyErr_Clear();
        return false;
      }
    }
    if (PyErr_Occurred() || o.k < 0 || o.k >= PyList_GET_SIZE(e.metas)) {
      PyErr_Clear();
      return false;
    }
    if (o.kind != Kind::kWrite && !decode_meta(PyList_GET_ITEM(e.metas, o.k), o)) {
      return false;
    }
    e.outs.push_back(std::move(o));
  }
  return true;
}

// The node the fallback recorded for `func`: the producer of its first fresh output, or the
// last pending write of the first storage it writes; nullptr when neither is one.
py::object recorded_node(PyObject* func, const OpInfo& info, PyObject* args, PyObject* kwargs,
                         PyObject* result) {
  PyObject* t = first_lazy(result);
  if (t != nullptr) {
    py::object n = py::reinterpret_steal<py::object>(lazy_attr(t, names->node));
    if (n && Py_TYPE(n.ptr()) == S.node && slot(n.ptr(), S.n.op) == func) {
      return n;
    }
  }
  c10::SmallVector<py::object, 4> writes;
  if (!info.writes.empty() && write_storages(info, args, kwargs, nullptr, writes) && !writes.empty()) {
    PyObject* pw = slot(writes[0].ptr(), S.st_pending);
    if (PyList_CheckExact(pw) && PyList_GET_SIZE(pw) > 0) {
      PyObject* n = PyList_GET_ITEM(pw, PyList_GET_SIZE(pw) - 1);
      if (Py_TYPE(n) == S.node && slot(n, S.n.op) == func) {
        return py::reinterpret_borrow<py::object>(n);
      }
    }
  }
  return py::object();
}

// The native Entry for `call` from genie.meta.MetaEntry `entry` (the one Python's meta cache holds
// for the call's value key): its outputs decoded, or python_only where this path does not make
// them (conj/neg outputs, an out= argument to resize).
// tuple or list where `spec` is the tree spec of a tuple or a list of `n` leaves, as optree
// makes it (genie.meta: none_is_leaf): compared with the spec of such a value; else nullptr.
PyTypeObject* flat_kind_of(PyObject* spec, Py_ssize_t n) {
  PyObject* t = PyObject_GetAttr(spec, names->type);  // optree and torch specs: the node's type
  if (t == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  Py_DECREF(t);  // tuple and list live forever
  if (t != reinterpret_cast<PyObject*>(&PyTuple_Type) &&
      t != reinterpret_cast<PyObject*>(&PyList_Type)) {
    return nullptr;
  }
  static PyObject* structure = nullptr;  // optree.tree_structure (never released)
  if (structure == nullptr) {
    py::object optree = py::reinterpret_steal<py::object>(PyImport_ImportModule("optree"));
    structure = optree ? PyObject_GetAttrString(optree.ptr(), "tree_structure") : nullptr;
    if (structure == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
  }
  py::object zeros = py::reinterpret_steal<py::object>(PyList_New(n));
  if (!zeros) {
    PyErr_Clear();
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyList_SET_ITEM(zeros.ptr(), i, PyLong_FromLong(0));  // cached: cannot fail
  }
  py::object value = t == reinterpret_cast<PyObject*>(&PyList_Type)
                         ? zeros
                         : py::reinterpret_steal<py::object>(PyList_AsTuple(zeros.ptr()));
  py::object kw = py::reinterpret_steal<py::object>(Py_BuildValue("{s:O}", "none_is_leaf", Py_True));
  if (!value || !kw) {
    PyErr_Clear();
    return nullptr;
  }
  py::object call_args = py::reinterpret_steal<py::object>(PyTuple_Pack(1, value.ptr()));
  py::object canon = py::reinterpret_steal<py::object>(
      call_args ? PyObject_Call(structure, call_args.ptr(), kw.ptr()) : nullptr);
  const int same = canon ? PyObject_RichCompareBool(spec, canon.ptr(), Py_EQ) : -1;
  if (same < 0) {
    PyErr_Clear();
  }
  return same == 1 ? reinterpret_cast<PyTypeObject*>(t) : nullptr;
}

std::shared_ptr<Entry> make_entry(const OpInfo& info, PyObject* args, PyObject* kwargs,
                                  const Call& call, PyObject* entry) {
  auto e = std::make_shared<Entry>();
  e->words.assign(call.words.begin(), call.words.end());
  for (const auto& l : call.lazies) {
    e->held.push_back(new_ref(l.meta));
  }
  for (PyObject* x : call.leaves) {
    if (THPDtype_Check(x) || THPLayout_Check(x) || THPMemoryFormat_Check(x)) {
      e->held.push_back(new_ref(x));
    }
  }
  for (PyObject* x : call.interned) {
    e->held.push_back(new_ref(x));
  }
  e->entry = new_ref(entry);
  e->metas = new_ref(slot(entry, S.me_metas));
  e->out_spec = new_ref(slot(entry, S.me_out_spec));
  e->consts = new_ref(slot(entry, S.me_consts));
  e->spec = new_ref(slot(entry, S.me_spec));
  if (!PyList_CheckExact(e->metas) || !PyList_CheckExact(e->consts) ||
      PyList_GET_SIZE(e->metas) != PyList_GET_SIZE(e->consts)) {
    e->python_only = true;
    return e;
  }
  const int single = PyObject_RichCompareBool(e->out_spec, S.leaf_spec, Py_EQ);
  if (single < 0) {
    PyErr_Clear();
    e->python_only = true;
  }
  e->single = single == 1;
  if (!e->python_only && !read_plan(*e, slot(entry, S.me_plan))) {
    e->python_only = true;
  }
  if (!e->python_only && !e->single) {
    e->flat_kind = flat_kind_of(e->out_spec, PyList_GET_SIZE(e->metas));
  }
  // An out= argument of another size is resized first (lazy_tensor._record): left to Python.
  // Its TensorMeta is in the key, so the sizes compare the same on every call with it.
  for (const Out& o : e->outs) {
    if (e->python_only || o.kind != Kind::kWrite) {
      continue;
    }
    PyObject* src = alias_source(info, args, kwargs, o);
    py::object sn = py::reinterpret_steal<py::object>(src ? lazy_attr(src, names->node) : nullptr);
    py::object so = py::reinterpret_steal<py::object>(src ? lazy_attr(src, names->out) : nullptr);
    if (!sn || !so || Py_TYPE(sn.ptr()) != S.node) {
      e->python_only = true;
      continue;
    }
    PyObject* src_meta = PySequence_GetItem(slot(sn.ptr(), S.n.metas), PyLong_AsSsize_t(so.ptr()));
    PyObject* out_meta = PyList_GET_ITEM(e->metas, o.k);
    if (src_meta == nullptr || Py_TYPE(src_meta) != S.tensor_meta ||
        Py_TYPE(out_meta) != S.tensor_meta) {
      PyErr_Clear();
      e->python_only = true;
    } else {
      const int same = PyObject_RichCompareBool(slot(src_meta, S.tm_shape),
                                                slot(out_meta, S.tm_shape), Py_EQ);
      if (same != 1) {
        PyErr_Clear();
        e->python_only = true;
      }
    }
    Py_XDECREF(src_meta);
  }
  return e;
}

// Remember `e` under its words (a full table is cleared first, as genie.meta.MetaCache.put).
void store_entry(std::shared_ptr<Entry> e) {
  const uint64_t h = hash_words(e->words);
  entries.store(h, std::move(e), S.limit);
}

// After the fallback recorded `call` and returned `result`: remember its entry under the key.
void learn(PyObject* func, const OpInfo& info, PyObject* args, PyObject* kwargs, Call& call,
           PyObject* result) {
  if (call.nan) {
    return;
  }
  py::object node = recorded_node(func, info, args, kwargs, result);
  if (!node) {
    return;
  }
  PyObject* n = node.ptr();
  PyObject* entry = slot(n, S.n.entry);
  if (entry == nullptr || Py_TYPE(entry) != S.meta_entry ||
      genie::node_n_leaves(n) != static_cast<Py_ssize_t>(call.leaves.size())) {
    return;
  }
  // The node must be the one recorded from exactly these arguments.
  size_t li = 0;
  for (Py_ssize_t i = 0; i < genie::node_n_leaves(n); ++i) {
    int32_t out = -1;
    PyObject* r = genie::node_leaf(n, i, &out);
    if (li < call.lazies.size() && call.lazies[li].leaf == i) {
      const Lazy& l = call.lazies[li++];
      if (out >= 0) {
        if (r != l.node || out != l.out_i) {
          return;
        }
      } else if (!(i == 0 && info.metadata_only && Py_TYPE(r) == S.meta_arg &&
                   slot(r, S.ma_meta) == l.meta)) {
        return;
      }
    } else if (out >= 0 || r != call.leaves[i]) {
      return;
    }
  }
  store_entry(make_entry(info, args, kwargs, call, entry));
  reasons[kLearned]++;
}

// A call with no learned entry: its entry from genie.lazy_tensor.entry_for (Python's meta cache,
// or inference, counted there as a hit or a miss), remembered as `learn` would remember it from
// the node the fallback records. nullptr (no error) where entry_for declines or raises, or
// found its entry for another flattening of the call than `call`'s: the fallback takes it.
std::shared_ptr<Entry> entry_from_python(PyObject* func, const OpInfo& info, PyObject* args,
                                         PyObject* kwargs, const Call& call) {
  if (call.nan || S.entry_for == nullptr) {
    return nullptr;
  }
  py::object r = py::reinterpret_steal<py::object>(PyObject_CallFunctionObjArgs(
      S.entry_for, func, args, kwargs != nullptr ? kwargs : Py_None, nullptr));
  if (!r) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
      throw py::error_already_set();  // KeyboardInterrupt, SystemExit: not the call's error
    }
    PyErr_Clear();  // record() raises it again, from the user's call
    return nullptr;
  }
  if (!PyTuple_CheckExact(r.ptr()) || PyTuple_GET_SIZE(r.ptr()) != 2) {
    return nullptr;
  }
  PyObject* entry = PyTuple_GET_ITEM(r.ptr(), 0);
  PyObject* leaves = PyTuple_GET_ITEM(r.ptr(), 1);
  const Py_ssize_t n = static_cast<Py_ssize_t>(call.leaves.size());
  if (Py_TYPE(entry) != S.meta_entry || !PyList_CheckExact(leaves) ||
      PyList_GET_SIZE(leaves) != n) {
    return nullptr;
  }
  // Python's leaves are this call's, object for object: the entry is the one for its key.
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyList_GET_ITEM(leaves, i) != call.leaves[i]) {
      return nullptr;
    }
  }
  std::shared_ptr<Entry> e = make_entry(info, args, kwargs, call, entry);
  store_entry(e);
  return e;
}

PyObject* new_object(PyTypeObject* t, bool tracked);

// The class words of a flattened call (see "shape-generic entries"): a LazyTensor's TensorMeta
// address becomes its dtype and (rank, device index, conj, neg); an int's value and a float's
// bits become 0. false: a TensorMeta field is not what the class needs.
bool class_words(const Call& call, Words& cw) {
  cw.push_back(call.words[0]);  // the op
  size_t li = 0;
  for (size_t i = 1; i + 1 < call.words.size(); i += 2) {
    const uint64_t tag = call.words[i];
    uint64_t payload = call.words[i + 1];
    if (tag == kLazy) {
      if (li >= call.lazies.size()) {
        return false;
      }
      PyObject* m = call.lazies[li++].meta;
      PyObject* shape = slot(m, S.tm_shape);
      PyObject* index = slot(m, S.tm_index);
      if (shape == nullptr || !PyTuple_CheckExact(shape) || index == nullptr ||
          !PyLong_CheckExact(index)) {
        return false;
      }
      const long idx = PyLong_AsLong(index);
      cw.push_back(kLazy);
      cw.push_back(reinterpret_cast<uint64_t>(slot(m, S.tm_dtype)));
      payload = (static_cast<uint64_t>(PyTuple_GET_SIZE(shape)) << 16) |
                (static_cast<uint64_t>(idx & 0xff) << 2) |
                (slot(m, S.tm_conj) == Py_True ? 2u : 0u) |
                (slot(m, S.tm_neg) == Py_True ? 1u : 0u);
    } else if (tag == kInt || tag == kFloat) {
      payload = 0;
    }
    cw.push_back(tag);
    cw.push_back(payload);
  }
  return li == call.lazies.size();
}


int64_t count_of(PyObject* name) {
  PyObject* v = PyDict_GetItemWithError(S.counts, name);
  return v != nullptr ? PyLong_AsLongLong(v) : 0;
}

void bump(PyObject* name) {
  py::object v =
      py::reinterpret_steal<py::object>(checked(PyLong_FromLongLong(count_of(name) + 1)));
  if (PyDict_SetItem(S.counts, name, v.ptr()) < 0) {
    throw py::error_already_set();
  }
}

// After entry_from_python answered the first miss of a class with a shape rule, or found its
// entry by value: remember what the class's later misses share.
void learn_generic(const OpInfo& info, const Call& call, Words&& cw, uint64_t ch, const Entry& e) {
  PyObject* entry = e.entry;
  PyObject* metas = slot(entry, S.me_metas);
  PyObject* klass = slot(entry, S.me_klass);
  if (!PyList_CheckExact(metas) || klass == nullptr || PyList_GET_SIZE(metas) == 0) {
    return;
  }
  auto g = std::make_shared<Generic>();
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(metas); ++k) {
    PyObject* m = PyList_GET_ITEM(metas, k);
    if (Py_TYPE(m) != S.tensor_meta || slot(m, S.tm_conj) != Py_False ||
        slot(m, S.tm_neg) != Py_False || !PyTuple_CheckExact(slot(m, S.tm_shape))) {
      return;
    }
    g->outs.push_back(OutKind{slot(m, S.tm_dtype), PyTuple_GET_SIZE(slot(m, S.tm_shape)),
                              PyLong_AsLongLong(slot(m, S.tm_index))});
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return;
  }
  if (!e.single) {
    PyObject* t = PyObject_GetAttr(e.out_spec, names->type);  // optree: the node's type
    if (t == nullptr) {
      PyErr_Clear();
      return;
    }
    Py_DECREF(t);  // tuple and list live forever
    if (t != reinterpret_cast<PyObject*>(&PyTuple_Type) &&
        t != reinterpret_cast<PyObject*>(&PyList_Type)) {
      return;
    }
    g->seq = reinterpret_cast<PyTypeObject*>(t);
  } else if (g->outs.size() != 1) {
    return;
  }
  g->words.assign(cw.begin(), cw.end());
  for (PyObject* x : call.interned) {
    g->held.push_back(py::reinterpret_borrow<py::object>(x));
  }
  g->kw = info.rule == nullptr;
  g->rule = py::reinterpret_borrow<py::object>(g->kw ? info.kw_rule : info.rule);
  g->spec = py::reinterpret_borrow<py::object>(e.spec);
  g->out_spec = py::reinterpret_borrow<py::object>(e.out_spec);
  g->plan = py::reinterpret_borrow<py::object>(slot(entry, S.me_plan));
  g->klass = py::reinterpret_borrow<py::object>(klass);
  generics.store(ch, std::move(g), S.limit);
}

// The argument the rule takes for `x`, a positional argument of the call (a new reference):
// LazyTensors as their TensorMetas, in the order flatten met them (also inside lists).
PyObject* rule_arg(PyObject* x, const Call& call, size_t& li) {
  if (Py_TYPE(x) == S.lazy) {
    return new_ref(call.lazies[li++].meta);
  }
  const bool is_list = PyList_CheckExact(x);
  if (is_list || PyTuple_CheckExact(x)) {
    const Py_ssize_t k = is_list ? PyList_GET_SIZE(x) : PyTuple_GET_SIZE(x);
    PyObject* out = checked(is_list ? PyList_New(k) : PyTuple_New(k));
    for (Py_ssize_t j = 0; j < k; ++j) {
      PyObject* y = is_list ? PyList_GET_ITEM(x, j) : PyTuple_GET_ITEM(x, j);
      PyObject* v = Py_TYPE(y) == S.lazy ? new_ref(call.lazies[li++].meta) : new_ref(y);
      if (is_list) {
        PyList_SET_ITEM(out, j, v);
      } else {
        PyTuple_SET_ITEM(out, j, v);
      }
    }
    return out;
  }
  return new_ref(x);
}

// A dict's item (borrowed; nullptr, with or without an error) and its store, for a key whose
// hash is known (CPython's private calls up to 3.12; hashed again from 3.13 on).
inline PyObject* dict_get_known(PyObject* d, PyObject* key, Py_hash_t h) {
#if PY_VERSION_HEX < 0x030D0000
  return _PyDict_GetItem_KnownHash(d, key, h);
#else
  (void)h;
  return PyDict_GetItemWithError(d, key);
#endif
}

inline int dict_set_known(PyObject* d, PyObject* key, PyObject* v, Py_hash_t h) {
#if PY_VERSION_HEX < 0x030D0000
  return _PyDict_SetItem_KnownHash(d, key, v, h);
#else
  (void)h;
  return PyDict_SetItem(d, key, v);
#endif
}

// Python's meta-cache key of the call, as lazy_tensor.entry_for builds it (a new tuple).
PyObject* python_key(const OpInfo& info, const Call& call, PyObject* spec) {
  py::list parts;
  parts.append(py::handle(info.pol_key));
  parts.append(py::handle(spec));
  parts.append(py::int_(call.words[2]));  // the state word (flatten)
  size_t li = 0;
  for (size_t i = 0; i < call.leaves.size(); ++i) {
    PyObject* x = call.leaves[i];
    if (li < call.lazies.size() && call.lazies[li].leaf == static_cast<Py_ssize_t>(i)) {
      parts.append(py::handle(call.lazies[li++].meta));
    } else if (PyFloat_CheckExact(x)) {
      parts.append(py::handle(reinterpret_cast<PyObject*>(&PyFloat_Type)));
      if (info.float_values_matter) {
        parts.append(py::handle(x));
      }
    } else {
      parts.append(py::handle(reinterpret_cast<PyObject*>(Py_TYPE(x))));
      parts.append(py::handle(x));
    }
  }
  return checked(PyList_AsTuple(parts.ptr()));
}

// Whether every LazyTensor of the call is among its positional arguments (flatten takes them
// first, then the keyword arguments): the LazyTensors rule_arg counts there are all of them.
bool positional_lazies(const Call& call, PyObject* args) {
  size_t n = 0;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
    PyObject* x = PyTuple_GET_ITEM(args, i);
    if (Py_TYPE(x) == S.lazy) {
      n++;
    } else if (PyList_CheckExact(x) || PyTuple_CheckExact(x)) {
      PyObject* fast = x;  // a list or tuple: PySequence_Fast_* read both
      for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(fast); ++j) {
        n += Py_TYPE(PySequence_Fast_GET_ITEM(fast, j)) == S.lazy ? 1 : 0;
      }
    }
  }
  return n == call.lazies.size();
}

// A miss of a known class: its entry made here (see "shape-generic entries"), or nullptr (no
// error) for entry_for's path.
std::shared_ptr<Entry> generic_entry(const OpInfo& info, PyObject* args, PyObject* kwargs,
                                     const Call& call, const Generic& g) {
  py::object key = py::reinterpret_steal<py::object>(python_key(info, call, g.spec.ptr()));
  PyObject* d = S.meta_cache_dict;
  // The key is hashed once for the lookup and the store (a tuple does not keep its hash, and
  // hashing its TensorMetas and tree spec is most of a dict operation on it).
  const Py_hash_t kh = PyObject_Hash(key.ptr());
  PyObject* found = kh == -1 ? nullptr : dict_get_known(d, key.ptr(), kh);  // borrowed
  if (found == nullptr && PyErr_Occurred()) {
    PyErr_Clear();  // an unhashable constant: entry_for's path (no caching)
    return nullptr;
  }
  if (found != nullptr) {  // the key's entry (equal TensorMetas at other addresses): a hit
    if (Py_TYPE(found) != S.meta_entry) {
      return nullptr;
    }
    bump(names->meta_cache_hits);
    std::shared_ptr<Entry> e = make_entry(info, args, kwargs, call, found);
    store_entry(e);
    return e;
  }
  if (static_cast<size_t>(PyDict_GET_SIZE(d)) >= S.limit) {
    return nullptr;  // MetaCache.put clears it first: entry_for's path does that
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  py::object margs = py::reinterpret_steal<py::object>(checked(PyTuple_New(n)));
  size_t li = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyTuple_SET_ITEM(margs.ptr(), i, rule_arg(PyTuple_GET_ITEM(args, i), call, li));
  }
  // the output's device index as entry_for passes it: the first LazyTensor's, else (a factory)
  // that of its device= (always given with its index here: try_record_factory)
  py::object index;
  if (!call.lazies.empty()) {
    index = py::reinterpret_borrow<py::object>(slot(call.lazies[0].meta, S.tm_index));
  } else {
    PyObject* dev = kwargs != nullptr ? dict_get(kwargs, names->device) : nullptr;
    if (dev == nullptr || !THPDevice_Check(dev) ||
        reinterpret_cast<THPDevice*>(dev)->device.index() < 0) {
      return nullptr;
    }
    index = py::int_(reinterpret_cast<THPDevice*>(dev)->device.index());
  }
  py::object r;
  if (g.kw) {  // its own dict, as meta._infer gives it one (unflattened)
    py::object kw = py::reinterpret_steal<py::object>(
        checked(kwargs != nullptr ? PyDict_Copy(kwargs) : PyDict_New()));
    r = py::reinterpret_steal<py::object>(PyObject_CallFunctionObjArgs(
        g.rule.ptr(), margs.ptr(), kw.ptr(), index.ptr(), nullptr));
  } else {
    r = py::reinterpret_steal<py::object>(
        PyObject_CallFunctionObjArgs(g.rule.ptr(), margs.ptr(), index.ptr(), nullptr));
  }
  if (!r) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
      throw py::error_already_set();
    }
    PyErr_Clear();  // entry_for runs the rule again and decides
    return nullptr;
  }
  PyObject* res = r.ptr();
  const size_t n_out = g.outs.size();
  const auto n_flat = static_cast<Py_ssize_t>(n_out);
  py::object metas = py::reinterpret_steal<py::object>(checked(PyList_New(n_flat)));
  if (g.seq == nullptr) {
    if (Py_TYPE(res) != S.tensor_meta) {
      return nullptr;  // declined (None), or another kind of answer
    }
    PyList_SET_ITEM(metas.ptr(), 0, new_ref(res));
  } else {
    if (Py_TYPE(res) != g.seq || PySequence_Fast_GET_SIZE(res) != static_cast<Py_ssize_t>(n_out)) {
      return nullptr;
    }
    for (size_t k = 0; k < n_out; ++k) {
      PyObject* m = PySequence_Fast_GET_ITEM(res, static_cast<Py_ssize_t>(k));
      if (Py_TYPE(m) != S.tensor_meta) {
        return nullptr;
      }
      PyList_SET_ITEM(metas.ptr(), static_cast<Py_ssize_t>(k), new_ref(m));
    }
  }
  for (size_t k = 0; k < n_out; ++k) {
    PyObject* m = PyList_GET_ITEM(metas.ptr(), static_cast<Py_ssize_t>(k));
    PyObject* shape = slot(m, S.tm_shape);
    PyObject* idx = slot(m, S.tm_index);
    if (slot(m, S.tm_dtype) != g.outs[k].dtype || shape == nullptr || !PyTuple_CheckExact(shape) ||
        PyTuple_GET_SIZE(shape) != g.outs[k].rank || idx == nullptr || !PyLong_CheckExact(idx) ||
        PyLong_AsLongLong(idx) != g.outs[k].index || slot(m, S.tm_conj) != Py_False ||
        slot(m, S.tm_neg) != Py_False) {
      PyErr_Clear();
      return nullptr;  // another class of output (squeeze of a dim that became 1): Python decides
    }
  }
  py::object consts = py::reinterpret_steal<py::object>(checked(PyList_New(n_flat)));
  for (size_t k = 0; k < n_out; ++k) {
    PyList_SET_ITEM(consts.ptr(), static_cast<Py_ssize_t>(k), new_ref(Py_None));
  }
  py::object entry = py::reinterpret_steal<py::object>(new_object(S.meta_entry, !flags.gc_untrack));
  PyObject* en = entry.ptr();
  init_slot(en, S.me_metas, new_ref(metas.ptr()));
  init_slot(en, S.me_out_spec, new_ref(g.out_spec.ptr()));
  init_slot(en, S.me_consts, new_ref(consts.ptr()));
  init_slot(en, S.me_plan, new_ref(g.plan.ptr()));
  init_slot(en, S.me_spec, new_ref(g.spec.ptr()));
  init_slot(en, S.me_klass, new_ref(g.klass.ptr()));
  init_slot(en, S.me_state, checked(PyLong_FromUnsignedLongLong(call.words[2])));
  if (dict_set_known(d, key.ptr(), en, kh) < 0) {
    throw py::error_already_set();
  }
  if (flags.gc_untrack) {  // as genie.meta._untrack_entry
    for (PyObject* o : {key.ptr(), metas.ptr(), consts.ptr()}) {
      PyObject_GC_UnTrack(o);
    }
    for (size_t k = 0; k < n_out; ++k) {
      PyObject* m = PyList_GET_ITEM(metas.ptr(), static_cast<Py_ssize_t>(k));
      if (PyObject_IS_GC(m) && PyObject_GC_IsTracked(m)) {
        PyObject_GC_UnTrack(m);
      }
    }
  }
  bump(names->meta_cache_misses);
  bump(names->shape_rule_hits);
  n_generic_made++;
  std::shared_ptr<Entry> e = make_entry(info, args, kwargs, call, en);
  store_entry(e);
  return e;
}

// The entry of a flattened call: the learned one (`hit`), else, with the native miss path on,
// one made from its shape class's rule, else the one Python's entry_for gives; nullptr where
// none has one.
std::shared_ptr<Entry> entry_of(PyObject* func, const OpInfo& info, PyObject* args,
                                PyObject* kwargs, const Call& call, bool& hit) {
  std::shared_ptr<Entry> e = entries.find(hash_words(call.words), call.words);
  hit = e != nullptr;
  if (hit || !flags.native_record_miss) {
    return e;
  }
  // A positional rule takes calls without keyword arguments (meta._infer's condition) and with
  // a LazyTensor (a TensorMeta for the rule); a keyword rule (factories, clone, *_like) calls
  // whose LazyTensors are all positional (rule_arg replaces those).
  const bool no_kwargs = kwargs == nullptr || PyDict_GET_SIZE(kwargs) == 0;
  const bool generic = flags.generic_meta && flags.meta_cache && S.meta_cache_dict != nullptr &&
                       !info.metadata_only && !call.nan &&
                       (info.rule != nullptr ? no_kwargs && !call.lazies.empty()
                                             : info.kw_rule != nullptr && positional_lazies(call, args));
  Words cw;
  uint64_t ch = 0;
  if (generic && class_words(call, cw)) {
    ch = hash_words(cw);
    std::shared_ptr<Generic> g = generics.find(ch, cw);
    if (g) {
      e = generic_entry(info, args, kwargs, call, *g);
      if (e) {
        return e;
      }
      cw.clear();  // known class, declined here: entry_for decides, nothing to learn
    }
  } else {
    cw.clear();
  }
  const int64_t misses = cw.empty() ? 0 : count_of(names->meta_cache_misses);
  const int64_t rules = cw.empty() ? 0 : count_of(names->shape_rule_hits);
  e = entry_from_python(func, info, args, kwargs, call);
  const int64_t missed = cw.empty() ? 0 : count_of(names->meta_cache_misses) - misses;
  const int64_t ruled = cw.empty() ? 0 : count_of(names->shape_rule_hits) - rules;
  // a miss a shape rule answered, or a hit by value (an input's TensorMeta a new object equal to
  // a known one: generate's any.dim of each token's fresh isin): the class's later calls here
  if (e && !cw.empty() && !e->python_only && missed == ruled && missed <= 1) {
    learn_generic(info, call, std::move(cw), ch, *e);
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
  }
  return e;
}

// --- making the node and its outputs -----------------------------------------------------

// For objects of GC types only (PyObject_GC_UnTrack is a no-op on an untracked one).
inline void untrack(PyObject* o) {
  PyObject_GC_UnTrack(o);
}

// As genie.graph.untrack_node does for a Storage with no pending write: it and its lists.
void untrack_storage(PyObject* s) {
  if (!PyObject_GC_IsTracked(s)) {
    return;
  }
  PyObject* pw = slot(s, S.st_pending);
  const bool no_write = pw != nullptr && (PyTuple_CheckExact(pw) ? PyTuple_GET_SIZE(pw) == 0
                                          : PyList_CheckExact(pw) && PyList_GET_SIZE(pw) == 0);
  if (no_write) {
    PyObject* readers = slot(s, S.st_readers);
    if (readers != nullptr && PyList_CheckExact(readers)) {
      untrack(readers);
    }
    if (PyList_CheckExact(pw)) {
      untrack(pw);
    }
    untrack(s);
  }
}

PyObject* checked(PyObject* o) {
  if (o == nullptr) {
    throw py::error_already_set();
  }
  return o;
}

// An instance of a slotted genie class, all slots empty, as object.__new__ makes it. `tracked`
// false: never put on the GC's lists (what record would untrack at the end, made untracked at
// once, which saves linking and unlinking it).
PyObject* new_object(PyTypeObject* t, bool tracked) {
  if (tracked) {
    return checked(t->tp_alloc(t, 0));
  }
  const int before = genie::gc_young();
  PyObject* o = checked(_PyObject_GC_New(t));
  genie::gc_untrack_new(o, before);  // counted by its allocation, never on the lists
  std::memset(reinterpret_cast<char*>(o) + sizeof(PyObject), 0,
              static_cast<size_t>(t->tp_basicsize) - sizeof(PyObject));
  return o;
}

// A GC container (list, weak reference) that `make` makes, as CPython makes it tracked:
// untracked right away, while its neighbours on the GC list are still in cache, and off the
// young count if its allocation counted (csrc/gccount.cpp; a list from the free list did not).
template <class Make>
inline PyObject* fresh(Make make, bool tracked) {
  const int before = genie::gc_young();
  PyObject* o = checked(make());
  if (!tracked) {
    genie::gc_untrack_new(o, before);
  }
  return o;
}

PyObject* new_storage(bool tracked) {
  PyObject* s = new_object(S.storage, tracked);
  init_slot(s, S.st_pending, checked(PyTuple_New(0)));  // the empty tuple until a first write
  init_slot(s, S.st_readers, checked(PyTuple_New(0)));  // and until a first reader
  init_slot(s, S.st_prune, checked(PyLong_FromLong(64)));
  Py_INCREF(Py_None);
  init_slot(s, S.st_role, Py_None);  // a role known for the storage's life (uploads only)
  return s;
}

// The list in `owner`'s slot at `off`, made from the shared empty tuple a Storage's readers
// start as (most lists are never made: genie.graph.Storage), under the collector as its owner is
// (it holds weak references only).
PyObject* list_slot(PyObject* owner, Py_ssize_t off) {
  PyObject* v = slot(owner, off);
  if (PyList_CheckExact(v)) {
    return v;
  }
  // the shared empty tuple (the common case): an empty list, without PySequence_List's copy
  PyObject* list = checked(PyTuple_CheckExact(v) && PyTuple_GET_SIZE(v) == 0 ? PyList_New(0)
                                                                              : PySequence_List(v));
  if (!PyObject_GC_IsTracked(owner)) {
    untrack(list);
  }
  slot(owner, off) = list;
  Py_DECREF(v);
  return list;
}

// One more consumer of the pending node `n` (genie.graph.Node.n_consumers: a count, a cached
// small int below 257; the consumers themselves are found through the storages' readers).
void count_consumer(PyObject* n) {
  PyObject*& c = slot(n, S.n.consumers);
  const Py_ssize_t v = PyLong_AsSsize_t(c);
  if (v == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  PyObject* next = checked(PyLong_FromSsize_t(v + 1));
  Py_SETREF(c, next);
}

// genie.graph.Storage.add_reader.
void add_reader(PyObject* storage, PyObject* wref) {
  PyObject* readers = list_slot(storage, S.st_readers);
  if (PyList_Append(readers, wref) < 0) {
    throw py::error_already_set();
  }
  const Py_ssize_t prune_at = PyLong_AsSsize_t(slot(storage, S.st_prune));
  if (PyList_GET_SIZE(readers) < prune_at) {
    return;
  }
  PyObject* kept = checked(PyList_New(0));
  if (!PyObject_GC_IsTracked(storage)) {
    untrack(kept);
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(readers); ++i) {
    PyObject* w = PyList_GET_ITEM(readers, i);
    PyObject* n = PyWeakref_GetObject(w);  // borrowed
    if (n == nullptr) {
      Py_DECREF(kept);
      throw py::error_already_set();
    }
    if (n == Py_None) {
      continue;
    }
    PyObject* executed = Py_TYPE(n) == S.node ? slot(n, S.n.executed) : nullptr;
    int done = executed != nullptr ? PyObject_IsTrue(executed) : 0;
    if (done < 0) {
      Py_DECREF(kept);
      throw py::error_already_set();
    }
    if (!done && PyList_Append(kept, w) < 0) {
      Py_DECREF(kept);
      throw py::error_already_set();
    }
  }
  const Py_ssize_t n = PyList_GET_SIZE(kept);
  PyObject* old = slot(storage, S.st_readers);
  slot(storage, S.st_readers) = kept;
  Py_DECREF(old);
  PyObject* old_prune = slot(storage, S.st_prune);
  slot(storage, S.st_prune) = checked(PyLong_FromSsize_t(n * 2 > 64 ? n * 2 : 64));
  Py_DECREF(old_prune);
}

// torch's _make_wrapper_subclass for one output: a data-less tensor on remote_accelerator whose
// every op reaches LazyTensor.__torch_dispatch__. Its storage (storage.cpp) is `base`'s (a
// LazyTensor whose value the output aliases: a view, a detach) or a fresh fake one.
PyObject* make_wrapper(const Out& o, PyObject* base) {
#if GENIE_WRAP_NATIVE
  const c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  const caffe2::TypeMeta dtype = c10::scalarTypeToTypeMeta(o.dtype);
  at::Tensor t;
  if (base == nullptr) {
    t = at::detail::make_tensor<genie::LazyImpl>(genie::fake_storage(o.nbytes, o.index), keys,
                                                 dtype);
  } else if (c10::InferenceMode::is_enabled() && !THPVariable_Unpack(base).is_inference()) {
    // An alias of a normal tensor taken in inference mode is a normal tensor, as eager's views
    // (which take their base's keys): autograd's view tracking gives it the base's version
    // counter, which an inference tensor cannot take.
    t = at::detail::make_tensor<genie::LazyImpl>(
        c10::TensorImpl::VIEW, c10::Storage(THPVariable_Unpack(base).storage()),
        keys | c10::getAutocastRelatedKeySetFromBackend(c10::BackendComponent::PrivateUse1Bit) |
            c10::getAutogradRelatedKeySetFromBackend(c10::BackendComponent::PrivateUse1Bit),
        dtype);
  } else {
    t = at::detail::make_tensor<genie::LazyImpl>(c10::Storage(THPVariable_Unpack(base).storage()),
                                                 keys, dtype);
  }
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(o.sizes, o.strides, o.offset);
  // Key-free (csrc/python_key.cpp, "PrivateUse1") but under a TorchDispatchMode: a mode that
  // returns NotImplemented for a LazyTensor (FakeTensorMode for any tensor subclass, as for the
  // lift of torch.tensor(v, device=...) while inductor traces) leaves the call to the tensors'
  // own __torch_dispatch__, which torch asks only of tensors with the Python key.
  if (!genie::wrappers_key_free || c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    impl->set_python_dispatch(true);
  }
  return checked(THPVariable_Wrap(t, S.lazy));
#else
  // torch.Tensor._make_wrapper_subclass(LazyTensor, sizes, strides=, storage_offset=, dtype=,
  // device=, requires_grad=False), as LazyTensor.__new__ calls it
  static PyObject* make = checked(PyObject_GetAttrString(THPVariableClass, "_make_wrapper_subclass"));
  static PyObject* kw_names = checked(Py_BuildValue("(sssss)", "strides", "storage_offset", "dtype",
                                                    "device", "requires_grad"));
  auto ints = [](const std::vector<int64_t>& v) {
    py::tuple t(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      t[i] = py::int_(v[i]);
    }
    return t;
  };
  py::tuple sizes = ints(o.sizes), strides = ints(o.strides);
  py::object offset = py::int_(o.offset);
  py::object device = py::reinterpret_steal<py::object>(
      checked(THPDevice_New(c10::Device(c10::DeviceType::PrivateUse1, o.index))));
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(o.dtype));  // borrowed
  PyObject* args[] = {reinterpret_cast<PyObject*>(S.lazy), sizes.ptr(), strides.ptr(), offset.ptr(),
                      dtype, device.ptr(), Py_False};
  std::optional<c10::InferenceMode> normal;  // an alias of a normal tensor is one (see above)
  if (base != nullptr && c10::InferenceMode::is_enabled() &&
      !THPVariable_Unpack(base).is_inference()) {
    normal.emplace(false);
  }
  PyObject* r = checked(PyObject_Vectorcall(make, args, 2, kw_names));
  normal.reset();
  if (base != nullptr) {
    const at::Tensor b = THPVariable_Unpack(base);
    genie::set_storage(THPVariable_Unpack(r), &b);
  } else {
    genie::set_storage(THPVariable_Unpack(r), nullptr);
  }
  return r;
#endif
}

// The wrapper of `o` bound to output `out` of `node`, one more holder of its count (node.h
// out_count_add): the record in its impl (csrc/wrapper.cpp), or, where torch made no LazyImpl,
// t._node, t._out and a liveness token t._alive in its instance dict, as `setattr` fills it, in
// that order. `gc_untrack`: the dict and the token go off the GC (the dict holds the node and
// the token, which never hold the tensor).
py::object bound_wrapper(const Out& o, PyObject* node, PyObject* out, bool gc_untrack,
                         PyObject* base) {
  py::object t = py::reinterpret_steal<py::object>(make_wrapper(o, base));
  if (genie::LazyImpl* impl = genie::lazy_impl(THPVariable_Unpack(t.ptr()).unsafeGetTensorImpl())) {
    genie::lazy_impl_bind(impl, node, out);  // no instance dict, no token (csrc/wrapper.cpp)
    return t;
  }
  py::object a = py::reinterpret_steal<py::object>(checked(genie::new_alive(node, out, !gc_untrack)));
  py::object d = py::reinterpret_steal<py::object>(checked(PyObject_GenericGetDict(t.ptr(), nullptr)));
  if (PyDict_SetItem(d.ptr(), names->node, node) < 0 ||
      PyDict_SetItem(d.ptr(), names->out, out) < 0 ||
      PyDict_SetItem(d.ptr(), names->alive, a.ptr()) < 0) {
    throw py::error_already_set();
  }
  if (gc_untrack) {
    untrack(d.ptr());  // after its items: storing a GC object tracks a dict again
  }
  return t;
}

// LazyTensor(node, k, meta) and graph.track(t, node, k), for the default graph. `gc_untrack`:
// track() takes the tensor's dict (and token) off the GC.
PyObject* new_lazy(PyObject* node, const Out& o, bool gc_untrack, PyObject* base) {
  py::object k = py::reinterpret_steal<py::object>(checked(PyLong_FromSsize_t(o.k)));
  return bound_wrapper(o, node, k.ptr(), gc_untrack, base).release().ptr();
}

// The ctx a Node takes at creation (genie.graph.Node.__init__).
// `current` is a threading.local: its per-thread dict holds what this thread set, its class
// the defaults (genie.context sets `type(current).backward`).
PyObject* current_attr(PyObject* local_dict, PyObject* name) {
  PyObject* v = dict_get(local_dict, name);
  if (v == nullptr) {
    v = _PyType_Lookup(Py_TYPE(S.current), name);  // borrowed
    if (v == nullptr || Py_TYPE(v)->tp_descr_get != nullptr) {
      return checked(PyObject_GetAttr(S.current, name));  // not a plain class default
    }
  }
  return new_ref(v);
}

PyObject* current_ctx(PyObject* d) {
  PyObject* ctx = current_attr(d, names->ctx);
  // Node.__init__ reads current.backward before the graph task id; both are plain reads, and
  // the task id (a C++ thread-local) is the cheaper one to look at first
  if (ctx != Py_None || torch::autograd::get_current_graph_task_id() == -1) {
    return ctx;
  }
  PyObject* bw = current_attr(d, names->backward);
  if (bw != Py_None) {
    Py_DECREF(ctx);
    return bw;
  }
  Py_DECREF(bw);
  return ctx;
}

// Counts since the last _record_sync_counts, added to genie.stats' ops_recorded and
// meta_cache_hits (a dict update per op would cost more than the rest of it). A hit is a learned
// entry used; a miss recorded here was counted by entry_for; after a miss the fallback records,
// entry_for's lookup is one too many and its hit is taken back (counted_hits may go below 0).
uint64_t counted_ops = 0;
int64_t counted_hits = 0;
uint64_t counted_factories = 0;  // genie.stats' factories_recorded

void add_count(PyObject* name, int64_t n) {
  PyObject* v = dict_get(S.counts, name);  // borrowed
  py::object add = py::reinterpret_steal<py::object>(checked(PyLong_FromLongLong(n)));
  py::object nv = py::reinterpret_steal<py::object>(
      v == nullptr ? new_ref(add.ptr()) : checked(PyNumber_Add(v, add.ptr())));
  if (PyDict_SetItem(S.counts, name, nv.ptr()) < 0) {
    throw py::error_already_set();
  }
}

void record_sync_counts() {
  if ((counted_ops == 0 && counted_hits == 0 && counted_factories == 0) || !S.ready) {
    return;
  }
  const int64_t ops = static_cast<int64_t>(counted_ops);
  const int64_t hits = counted_hits;
  const int64_t factories = static_cast<int64_t>(counted_factories);
  counted_ops = 0;
  counted_hits = 0;
  counted_factories = 0;
  if (factories != 0) {
    add_count(names->factories_recorded, factories);
  }
  if (ops != 0) {
    add_count(names->ops_recorded, ops);
  }
  if (hits != 0) {
    add_count(names->meta_cache_hits, hits);
  }
}

// Graph.next_seq of the default graph for the node with index `index` (a new reference):
// None, its position (N of its uid "op*N") following from the index (csrc/seq.cpp), so a node
// costs no int and no string here (Node.seq and Node.uid make them when asked).
PyObject* next_seq(PyObject* index) {
  const long long i = PyLong_AsLongLong(index);
  if (i == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  const int64_t at = genie::default_seq_note(i);
  return at < 0 ? new_ref(Py_None) : checked(PyLong_FromLongLong(at));
}

// lazy_tensor._record for a learned entry: one Node, its Refs and outputs; nullptr without an
// error for a call whose aliased arguments are not what the entry needs (the fallback takes it).
// `hit`: the entry was found here, a meta-cache hit (a miss was counted by entry_for).
PyObject* record_made(PyObject* func, const OpInfo& info, Call& call, const Entry& e,
                      PyObject* graph, bool gc_untrack, bool hit,
                      const c10::SmallVector<PyObject*, 4>& sources,
                      const c10::SmallVector<py::object, 4>& writes);

PyObject* record_hit(PyObject* func, const OpInfo& info, PyObject* args, PyObject* kwargs,
                     Call& call, const Entry& e, PyObject* graph, bool gc_untrack, bool hit) {
  // Everything that can send the call to the fallback comes before the first side effect.
  c10::SmallVector<PyObject*, 4> sources;  // borrowed: the aliased argument of each output
  for (const Out& o : e.outs) {
    PyObject* src = nullptr;
    if (o.kind != Kind::kFresh && (src = alias_source(info, args, kwargs, o)) == nullptr) {
      return nullptr;
    }
    sources.push_back(src);
  }
  c10::SmallVector<py::object, 4> writes;
  if (!info.writes.empty() && !write_storages(info, args, kwargs, &call, writes)) {
    return nullptr;
  }
  return record_made(func, info, call, e, graph, gc_untrack, hit, sources, writes);
}

// record_hit once the aliased argument of each output (`sources`, borrowed) and the storages
// written are known: nullptr without an error where an aliased argument has no storage (nothing
// done yet), else the outputs.
PyObject* record_made(PyObject* func, const OpInfo& info, Call& call, const Entry& e,
                      PyObject* graph, bool gc_untrack, bool hit,
                      const c10::SmallVector<PyObject*, 4>& sources,
                      const c10::SmallVector<py::object, 4>& writes) {
  c10::SmallVector<py::object, 4> aliased;  // the storage of each aliased output
  for (size_t j = 0; j < e.outs.size(); ++j) {
    if (sources[j] != nullptr) {
      PyObject* st = storage_in(call, sources[j]);
      if (st == nullptr) {
        return nullptr;
      }
      aliased.push_back(py::reinterpret_steal<py::object>(st));
    } else {
      aliased.emplace_back();
    }
  }
  counted_ops++;  // added to genie.stats by _record_sync_counts
  counted_hits += hit ? 1 : 0;

  // A node that writes stays on the GC's lists, with what it reaches, unless writers are
  // deferred (graph.py, "the cyclic garbage collector"); any other is made as untrack_node
  // leaves it.
  const bool deferred = gc_untrack && flags.gc_defer_writes && !writes.empty();
  const bool untracked = gc_untrack && (writes.empty() || deferred);
  const bool tracked = !untracked;
  // The node, with its arguments inline (csrc/node.h: a lazy input is its producer node and
  // output number; no Ref, no argument list).
  const Py_ssize_t n_leaves = static_cast<Py_ssize_t>(call.leaves.size());
  py::object node = py::reinterpret_steal<py::object>(genie::node_new_sized(S.node, n_leaves, tracked));
  PyObject* n = node.ptr();
  {
    size_t li = 0;
    for (Py_ssize_t i = 0; i < n_leaves; ++i) {
      PyObject* x;
      int32_t out = -1;
      if (li < call.lazies.size() && call.lazies[li].leaf == i) {
        const Lazy& l = call.lazies[li++];
        if (i == 0 && info.metadata_only) {
          x = new_object(S.meta_arg, true);  // untrack_node leaves a MetaArg tracked
          init_slot(x, S.ma_meta, new_ref(l.meta));
        } else {
          x = new_ref(l.node);
          out = static_cast<int32_t>(l.out_i);
        }
      } else {
        x = new_ref(call.leaves[i]);
      }
      genie::node_init_leaf(n, i, x, out);
    }
  }
  if (!untracked && gc_untrack) {
    // graph.retrack_below: a writer may close a cycle, so what it reaches goes back on the lists
    py::object r = py::reinterpret_steal<py::object>(
        checked(PyObject_CallFunctionObjArgs(S.retrack_below, n, S.ref, nullptr)));
  }
  const Py_ssize_t n_out = PyList_GET_SIZE(e.metas);
  // each output's storage: a single output's inline (genie.graph.Node._st), else a list
  const bool one = n_out == 1;
  py::object storages = py::reinterpret_steal<py::object>(
      one ? new_ref(Py_None) : fresh([&] { return PyList_New(n_out); }, tracked));
  for (Py_ssize_t k = 0; k < n_out && !one; ++k) {
    PyList_SET_ITEM(storages.ptr(), k, new_ref(Py_None));
  }
  for (size_t j = 0; j < e.outs.size(); ++j) {
    const Out& o = e.outs[j];
    PyObject* st = o.kind == Kind::kFresh ? new_storage(tracked) : new_ref(aliased[j].ptr());
    if (one) {
      storages = py::reinterpret_steal<py::object>(st);
      continue;
    }
    PyObject* old = PyList_GET_ITEM(storages.ptr(), o.k);
    PyList_SET_ITEM(storages.ptr(), o.k, st);
    Py_DECREF(old);
  }
  py::object write_tuple =
      py::reinterpret_steal<py::object>(checked(PyTuple_New(static_cast<Py_ssize_t>(writes.size()))));
  for (size_t i = 0; i < writes.size(); ++i) {
    PyTuple_SET_ITEM(write_tuple.ptr(), static_cast<Py_ssize_t>(i), new_ref(writes[i].ptr()));
  }

  // Node.__init__
  PyObject* outputs = one ? new_ref(Py_None) : fresh([&] { return PyList_New(n_out); }, tracked);
  for (Py_ssize_t k = 0; k < n_out && !one; ++k) {
    PyList_SET_ITEM(outputs, k, new_ref(Py_None));
  }
  init_slot(n, S.n.outputs, outputs);
  init_slot(n, S.n.op, new_ref(func));
  init_slot(n, S.n.spec, new_ref(e.spec));
  init_slot(n, S.n.metas, new_ref(e.metas));
  init_slot(n, S.n.out_spec, new_ref(e.out_spec));
  init_slot(n, S.n.storages, new_ref(storages.ptr()));
  init_slot(n, S.n.writes, new_ref(write_tuple.ptr()));
  init_slot(n, S.n.values, new_ref(Py_None));
  init_slot(n, S.n.executed, new_ref(Py_False));
  init_slot(n, S.n.index, checked(PyIter_Next(S.counter)));
  init_slot(n, S.n.rng, new_ref(Py_None));
  init_slot(n, S.n.graph, new_ref(graph));
  init_slot(n, S.n.seq, next_seq(slot(n, S.n.index)));
  init_slot(n, S.n.where, new_ref(Py_None));
  init_slot(n, S.n.consumers, checked(PyLong_FromLong(0)));  // a count (no list per node)
  init_slot(n, S.n.tags, new_ref(Py_None));
  init_slot(n, S.n.entry, new_ref(e.entry));
  init_slot(n, S.n.ctx, current_ctx(this_thread().current));
  PyObject* wref = fresh([&] { return PyWeakref_NewRef(n, nullptr); }, tracked);
  init_slot(n, S.n.wref, wref);

  // consumers and readers of the inputs
  for (size_t li = 0; li < call.lazies.size(); ++li) {
    const Lazy& l = call.lazies[li];
    if (l.leaf == 0 && info.metadata_only) {
      continue;  // a MetaArg: not a Ref, so not a read
    }
    PyObject* xn = l.node;
    if (slot(xn, S.n.executed) == Py_False) {
      count_consumer(xn);
    }
    PyObject* st = genie::per_output(slot(xn, S.n.storages), l.out_i);  // (checked by the key)
    if (st == nullptr || Py_TYPE(st) != S.storage) {
      throw std::logic_error("an input's storage is not a genie.graph.Storage");
    }
    add_reader(st, wref);
  }

  // Storage.add_writer, and graph.pending_total
  for (const auto& w : writes) {
    PyObject* st = w.ptr();
    PyObject* pw = slot(st, S.st_pending);
    if (!PyList_CheckExact(pw)) {  // the first write: the shared empty tuple becomes a list
      PyObject* list = fresh([&] { return PyList_New(0); }, !deferred);
      slot(st, S.st_pending) = list;
      Py_DECREF(pw);
      pw = list;
    }
    if (PyList_Append(pw, n) < 0) {
      throw py::error_already_set();
    }
    if (!deferred) {
      for (PyObject* o : {st, pw}) {
        if (!PyObject_GC_IsTracked(o)) {
          PyObject_GC_Track(o);
        }
      }
    }
  }
  if (deferred) {  // graph.defer_writer: retracked if it stays pending (see there)
    py::object r = py::reinterpret_steal<py::object>(
        checked(PyObject_CallOneArg(S.defer_writer, wref)));
  }
  if (!writes.empty()) {
    PyObject* total = PyList_GET_ITEM(S.pending_total, 0);
    PyObject* more = checked(PyLong_FromSsize_t(static_cast<Py_ssize_t>(writes.size())));
    PyObject* sum = PyNumber_Add(total, more);
    Py_DECREF(more);
    if (sum == nullptr || PyList_SetItem(S.pending_total, 0, sum) < 0) {
      throw py::error_already_set();
    }
  }

  // graph.untrack_node: what was made here is untracked already; an aliased storage goes off
  // the GC's lists as untrack_node takes it off
  if (untracked) {
    for (size_t j = 0; j < e.outs.size(); ++j) {
      if (e.outs[j].kind != Kind::kFresh) {
        untrack_storage(genie::per_output(storages.ptr(), e.outs[j].k));
      }
    }
  }

  // outputs: fresh wrappers, or the written argument itself
  auto output = [&](size_t j) {
    const Out& o = e.outs[j];
    return o.kind == Kind::kWrite ? new_ref(sources[j])
                                  : new_lazy(n, o, gc_untrack, sources[j]);
  };
  if (n_out == 1 && e.single && e.outs.size() == 1) {
    return output(0);  // the common case: the one tensor itself, no list of flat outputs
  }
  py::object flat = py::reinterpret_steal<py::object>(checked(PyList_GetSlice(e.consts, 0, n_out)));
  for (size_t j = 0; j < e.outs.size(); ++j) {
    PyObject* t = output(j);
    PyObject* old = PyList_GET_ITEM(flat.ptr(), e.outs[j].k);
    PyList_SET_ITEM(flat.ptr(), e.outs[j].k, t);
    Py_DECREF(old);
  }
  if (n_out == 1 && e.single) {
    return new_ref(PyList_GET_ITEM(flat.ptr(), 0));
  }
  if (e.flat_kind == &PyList_Type) {
    return flat.release().ptr();  // a new list, as out_spec.unflatten makes
  }
  if (e.flat_kind == &PyTuple_Type) {
    return checked(PyList_AsTuple(flat.ptr()));
  }
  return checked(PyObject_CallMethodOneArg(e.out_spec, names->unflatten, flat.ptr()));
}

char not_handled_tag;
PyObject* const kNotHandled = reinterpret_cast<PyObject*>(&not_handled_tag);


// lazy_tensor._detach_alias: detach(x) of a LazyTensor of the default graph is a new wrapper of
// x's very value (x's node, output and metadata, one more holder of the output's count), with no
// node of its own;
// kNotHandled where that does not apply (the Python path then decides).
PyObject* detach_alias(PyObject* args, PyObject* kwargs) {
  if (kwargs != nullptr || PyTuple_GET_SIZE(args) != 1) {
    return kNotHandled;
  }
  PyObject* x = PyTuple_GET_ITEM(args, 0);
  if (reinterpret_cast<PyObject*>(Py_TYPE(x)) != reinterpret_cast<PyObject*>(S.lazy)) {
    return kNotHandled;
  }
  py::object node = py::reinterpret_steal<py::object>(lazy_attr(x, names->node));
  py::object out = py::reinterpret_steal<py::object>(lazy_attr(x, names->out));
  if (!node || !out || Py_TYPE(node.ptr()) != S.node ||
      slot(node.ptr(), S.n.graph) != S.default_graph || !PyLong_CheckExact(out.ptr())) {
    return kNotHandled;
  }
  const Py_ssize_t k = PyLong_AsSsize_t(out.ptr());
  PyObject* metas = slot(node.ptr(), S.n.metas);
  if (k < 0 || !PyList_CheckExact(metas) || k >= PyList_GET_SIZE(metas)) {
    PyErr_Clear();
    return kNotHandled;
  }
  if (!genie::wrapper_counts(x, node.ptr(), k)) {
    return kNotHandled;  // x is not among the holders its node's output counts
  }
  Out o;
  if (!decode_meta(PyList_GET_ITEM(metas, k), o)) {
    return kNotHandled;  // math bits: the Python path
  }
  return bound_wrapper(o, node.ptr(), out.ptr(), flags.gc_untrack, x).release().ptr();
}

// The record path for one call: a new reference, nullptr with an error set, or kNotHandled.
// The fallback for a call this path has no entry for, then the entry learned from what it
// recorded. `call` holds the arguments as they were flattened before the call, or is empty for
// an op seen for the first time (its policy is cached by the fallback: flattened after it).
PyObject* fallback_and_learn(PyObject* func, PyObject* args, PyObject* kwargs, Call& call) {
  PyObject* r = PyObject_CallFunctionObjArgs(S.fallback, func, args,
                                             kwargs != nullptr ? kwargs : Py_None, nullptr);
  if (r == nullptr) {
    return nullptr;
  }
  try {
    const OpInfo* info = op_info(func);
    if (info != nullptr && info->ok &&
        (!call.words.empty() || flatten(args, kwargs, *info, func, call))) {
      learn(func, *info, args, kwargs, call, r);
    }
    PyErr_Clear();  // a call that cannot be learned is still recorded
  } catch (...) {
    Py_DECREF(r);
    throw;
  }
  return r;
}

// The record path for one call: a new reference, nullptr with an error set, or kNotHandled.
PyObject* try_record(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (!S.ready || !flags.native_record || !flags.meta_cache || flags.record_source) {
    reasons[kOff]++;
    return kNotHandled;
  }
  if (dict_get(S.profiler, names->profiler_enabled) != Py_False) {
    reasons[kProfiler]++;
    return kNotHandled;
  }
  if (kwargs == Py_None || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) == 0)) {
    kwargs = nullptr;
  } else if (kwargs != nullptr && !PyDict_CheckExact(kwargs)) {
    reasons[kKwargs]++;
    return kNotHandled;
  }
  if (!PyTuple_CheckExact(args)) {
    reasons[kArgs]++;
    return kNotHandled;
  }
  // .item() and .cpu() of a pending value on the steady embedded path: read here (csrc/read.cpp)
  if (PyObject* r = genie::read_op_steady(func, args, kwargs)) {
    reasons[kHandled]++;
    return r;
  }
  // detach before the op's facts: a detach that detach_alias takes never reaches the fallback,
  // so its policy (which records it: not random, dynamic, a copy or an in-place view) is never
  // cached, and op_info's failed lookup costs an AttributeError each time (16 detaches per MLP
  // training step, ~3,400 instructions each). Outside a capture block only, as below.
  if (func == S.detach && PyList_GET_SIZE(this_thread().graphs) == 0) {
    PyObject* r = detach_alias(args, kwargs);
    if (r != kNotHandled) {
      reasons[kHandled]++;
      return r;
    }
  }
  const OpInfo* info = op_info(func);
  if (info != nullptr && !info->ok) {
    reasons[kOpPolicy]++;
    return kNotHandled;
  }
  // lazy_tensor.current_graph(): only the default graph (a capture block records in Python);
  // the default graph never keeps its nodes (checked by _record_init)
  if (PyList_GET_SIZE(this_thread().graphs) != 0) {
    reasons[kCapture]++;
    return kNotHandled;
  }
  Call call;
  if (info == nullptr) {  // the first call of this op: no policy cached yet
    reasons[kUnseen]++;
    return fallback_and_learn(func, args, kwargs, call);
  }
  if (!flatten(args, kwargs, *info, func, call)) {
    if (PyErr_Occurred()) {
      return nullptr;
    }
    reasons[call.reason]++;
    return kNotHandled;
  }
  bool hit = false;
  std::shared_ptr<Entry> e = entry_of(func, *info, args, kwargs, call, hit);
  if (!e) {
    reasons[kUnseen]++;
    return fallback_and_learn(func, args, kwargs, call);
  }
  PyObject* r = e->python_only ? nullptr
                               : record_hit(func, *info, args, kwargs, call, *e, S.default_graph,
                                            flags.gc_untrack, hit);
  if (r == nullptr && !PyErr_Occurred()) {
    reasons[kEntry]++;
    if (!hit) {
      counted_hits--;  // the fallback finds the entry entry_for counted: one lookup too many
    }
    return kNotHandled;
  }
  reasons[hit ? kHandled : kMissNative]++;
  return r;
}

// `native(func, args, kwargs)`, or where it declines (kNotHandled) the Python `fallback` with the
// same call; C++ exceptions become Python ones. The body of __torch_dispatch__ and of the factory
// kernels.
// f() for a C entry point: a C++ exception becomes the Python error (nullptr returned).
template <class F>
PyObject* guarded(F&& f) {
  try {
    return f();
  } catch (py::error_already_set& err) {
    err.restore();
    return nullptr;
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return nullptr;
  }
}

// --- sending ahead (genie.backends.remote.send_ahead) ----------------------------------------
//
// While a server is connected, every `ahead_every`-th call recorded through native_or_fallback
// hands its result to `ahead_cb`, which sends what that value depends on to the server without
// waiting for the answer, so the server computes it while the program records on (the client's
// recording and the server's kernels overlap instead of taking turns). A count of calls, not
// of time: the same program cuts its steps at the same ops every time, so the requests repeat
// and hit the server's vetted plans. 0 (no server, GENIE_REMOTE_AHEAD=0): one compare per call.
// Not re-entered: what the callback records (nothing, normally) is not counted.
int64_t ahead_every = 0;
int64_t ahead_count = 0;
PyObject* ahead_cb = nullptr;  // strong reference while ahead_every > 0
bool in_ahead = false;

// `r` (a new reference, or nullptr), after the callback's turn came; nullptr when it raised
// (the error surfaces at the op that triggered it: the failure of a run sent earlier).
PyObject* after_record(PyObject* r) {
  if (ahead_every <= 0 || r == nullptr || in_ahead || ++ahead_count < ahead_every) {
    return r;
  }
  ahead_count = 0;
  in_ahead = true;
  PyObject* ok = PyObject_CallOneArg(ahead_cb, r);
  in_ahead = false;
  if (ok == nullptr) {
    Py_DECREF(r);
    return nullptr;
  }
  Py_DECREF(ok);
  return r;
}

void record_ahead(int64_t every, py::object cb) {
  if (every > 0 && !PyCallable_Check(cb.ptr())) {
    throw py::type_error("_record_ahead needs a callable when every > 0");
  }
  Py_CLEAR(ahead_cb);
  ahead_every = every > 0 ? every : 0;
  ahead_count = 0;
  if (ahead_every > 0) {
    ahead_cb = cb.release().ptr();
  }
}

// Every value the program reads starts the count again (executor.run_targets, host reads): a
// step's pieces are cut at the same ops each step whatever the step's length.
void record_ahead_reset() {
  ahead_count = 0;
}

PyObject* native_or_fallback(PyObject* (*native)(PyObject*, PyObject*, PyObject*),
                             PyObject* fallback, PyObject* func, PyObject* args, PyObject* kwargs) {
  PyObject* r = guarded([&] { return native(func, args, kwargs); });
  if (r != kNotHandled) {
    return after_record(r);
  }
  return after_record(PyObject_CallFunctionObjArgs(
      fallback, func, args, kwargs != nullptr ? kwargs : Py_None, nullptr));
}

// --- recording from the IValue stack (csrc/python_key.cpp's kernel) ----------------------------
//
// The Python-key kernel used to convert every call's IValues into an args tuple (a Python object
// per argument) for record_call, whose flatten() walked them again into the call's key words and
// leaves. record_stack fills the same Call from the IValues directly: the words flatten() would
// write for the args tuple and kwargs dict python_args makes (positional arguments up to the last
// that is not its default; keyword-only ones that are not their default, by name), the
// LazyTensor arguments by their Python objects (the tensors' PyObject slots), and a Python object
// only for each constant leaf the node keeps (ints, floats, bools: made per call, small ints and
// None are CPython's singletons; dtypes, layouts and memory formats torch's). It takes a call only
// where try_record would record it from a learned entry with no write: the same preconditions
// (flags, profiler, no capture block, the op's policy cached and allowed), no read or detach op
// (try_record's own paths), arguments of the types above or lists of ints or of LazyTensors (no
// str, device, optional-tensor list or other argument type), an entry found
// for the exact words, no output written and every viewed output's source a LazyTensor argument.
// Anything else is declined before any side effect (kStackDeclined), and the kernel takes
// python_args + record_call as before, which then counts the call's reason. A miss is declined
// too: entry_for, learning and shape-generic entries take the args tuple.
// config.stack_record_check (GENIE_STACK_RECORD_CHECK=1, in tests) flattens the args tuple too
// for every call built here and raises where words, leaves or aliased sources differ.

char stack_declined_tag;
PyObject* const kStackDeclined = reinterpret_cast<PyObject*>(&stack_declined_tag);
uint64_t n_stack = 0;           // calls record_stack recorded
uint64_t n_stack_declined = 0;  // calls it declined
// Why record_stack declined its last call, and (with stack_record_check on) the declines by op
// and reason: _stack_record_declines() (coverage measurements).
const char* stack_why = "";
std::map<std::pair<PyObject*, std::string>, uint64_t>& stack_declines =
    *new std::map<std::pair<PyObject*, std::string>, uint64_t>();

// v.push_back(x) where the caller reserved the room: SmallVector's push_back is an out-of-line
// call (~14 instructions) for its growth path.
template <class V, class T>
inline void put(V& v, T x) {
  v.data()[v.size()] = x;
  v.set_size(v.size() + 1);
}

// Appends one leaf (word pair and a Python object) for the IValue `v` of schema kind `kind`, as
// to_python then flatten's leaf() would; false: declined.
// A float leaf (a Python float, owned by the call) and its key words: its bits where float values
// can change the output's metadata, else nothing of its value (as flatten keys a float).
PyObject* stack_float(double d, const OpInfo& info, Call& call) {
  PyObject* x = checked(PyFloat_FromDouble(d));
  put(call.owned, x);
  put(call.words, kFloat);
  if (info.float_values_matter) {
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    put(call.words, bits);
    call.nan = call.nan || std::isnan(d);
  } else {
    put(call.words, 0);
  }
  return x;
}

bool stack_leaf(const c10::IValue& v, uint8_t kind, const OpInfo& info, Call& call,
                int64_t& index) {
  PyObject* x = nullptr;  // a new reference
  if (v.isNone()) {
    put(call.words, kNone);
    put(call.words, 0);
    put(call.leaves, Py_None);
    return true;
  }
  if (kind != genie::kStackValue) {
    if (!v.isInt()) {
      stack_why = "an enum argument not an int";
      return false;
    }
    if (kind == genie::kStackDtype) {
      x = reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt())));
      put(call.words, kDtype);
    } else if (kind == genie::kStackLayout) {
      x = reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(v.toInt())));
      put(call.words, kSingleton);
    } else {
      x = torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt()));
      put(call.words, kSingleton);
    }
    put(call.words, reinterpret_cast<uint64_t>(x));
    put(call.leaves, x);  // torch's singletons, alive for the process
    return true;
  }
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {  // toPyObject's None
      put(call.words, kNone);
      put(call.words, 0);
      put(call.leaves, Py_None);
      return true;
    }
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl->is_wrapped_number()) {
      // python_key.cpp's wrapped_number: the number of a 0-dim CPU tensor with no Python object
      if (!t.device().is_cpu() || impl->pyobj_slot()->load_pyobj() != nullptr) {
        stack_why = "a wrapped number with a Python object";
        return false;
      }
      switch (t.scalar_type()) {
        case at::ScalarType::Double: {
          x = stack_float(*t.const_data_ptr<double>(), info, call);
          break;
        }
        case at::ScalarType::Long:
          x = checked(PyLong_FromLongLong(*t.const_data_ptr<int64_t>()));
          put(call.owned, x);
          put(call.words, kInt);
          put(call.words, static_cast<uint64_t>(*t.const_data_ptr<int64_t>()));
          break;
        case at::ScalarType::Bool: {
          const bool b = *t.const_data_ptr<bool>();
          put(call.words, kBool);
          put(call.words, b ? 1 : 0);
          x = b ? Py_True : Py_False;
          break;
        }
        default:
          stack_why = "a wrapped number of another dtype";
          return false;
      }
      put(call.leaves, x);
      return true;
    }
    x = impl->pyobj_slot()->load_pyobj();
    if (x == nullptr || Py_TYPE(x) != S.lazy) {
      stack_why = "a tensor not a LazyTensor";
      return false;
    }
    Py_INCREF(x);
    put(call.owned, x);
    PyObject* node;
    PyObject* out;
    if (!lazy_attrs(x, &node, &out)) {
      stack_why = "a LazyTensor without _node/_out";
      return false;
    }
    const LeafRead r = read_lazy_leaf(x, node, out, call, index);
    if (r != LeafRead::kOk) {
      PyErr_Clear();  // (an output number past Py_ssize_t: the Python arguments' path decides)
      if (r == LeafRead::kDevices) {
        stack_why = "LazyTensors on several devices";
      }
      return false;
    }
    const Lazy& l = call.lazies.back();
    put(call.words, kLazy);
    put(call.words, reinterpret_cast<uint64_t>(l.meta));
    put(call.leaves, x);
    return true;
  }
  if (v.isInt()) {
    const int64_t i = v.toInt();
    x = checked(PyLong_FromLongLong(i));
    put(call.owned, x);
    put(call.words, kInt);
    put(call.words, static_cast<uint64_t>(i));
  } else if (v.isBool()) {
    x = v.toBool() ? Py_True : Py_False;
    put(call.words, kBool);
    put(call.words, v.toBool() ? 1 : 0);
  } else if (v.isDouble()) {
    x = stack_float(v.toDouble(), info, call);
  } else {
    // str, device, lists of other things, generators, symbolic ints, ...
    stack_why = v.isTensorList() || v.isOptionalTensorList() ? "a tensor list"
                : v.isString()                               ? "a str"
                : v.isDevice()                               ? "a device"
                : v.isList()                                 ? "another list"
                                                             : "another argument type";
    return false;
  }
  put(call.leaves, x);
  return true;
}

// Whether two Calls flattened the same call: equal words, the same leaves (LazyTensors and
// singletons by identity, numbers by type and value, floats by bits) and LazyTensor readings.
bool same_call(const Call& a, const Call& b, std::string& why) {
  if (a.words.size() != b.words.size() ||
      std::memcmp(a.words.data(), b.words.data(), a.words.size() * sizeof(uint64_t)) != 0) {
    why = "the key words differ";
    return false;
  }
  if (a.leaves.size() != b.leaves.size() || a.lazies.size() != b.lazies.size()) {
    why = "the number of leaves or LazyTensors differs";
    return false;
  }
  for (size_t i = 0; i < a.leaves.size(); ++i) {
    PyObject* x = a.leaves[i];
    PyObject* y = b.leaves[i];
    if (x == y) {
      continue;
    }
    if (Py_TYPE(x) != Py_TYPE(y)) {
      why = "leaf " + std::to_string(i) + " is a " + Py_TYPE(x)->tp_name + ", flatten's a " +
            Py_TYPE(y)->tp_name;
      return false;
    }
    if (PyFloat_CheckExact(x)) {
      const double u = PyFloat_AS_DOUBLE(x), w = PyFloat_AS_DOUBLE(y);
      if (std::memcmp(&u, &w, sizeof u) != 0) {
        why = "float leaf " + std::to_string(i) + " differs";
        return false;
      }
      continue;
    }
    if (PyLong_CheckExact(x)) {
      const int eq = PyObject_RichCompareBool(x, y, Py_EQ);
      if (eq != 1) {
        PyErr_Clear();
        why = "int leaf " + std::to_string(i) + " differs";
        return false;
      }
      continue;
    }
    why = std::string("leaf ") + std::to_string(i) + " (" + Py_TYPE(x)->tp_name +
          ") is another object than flatten's";
    return false;
  }
  for (size_t i = 0; i < a.lazies.size(); ++i) {
    const Lazy& l = a.lazies[i];
    const Lazy& m = b.lazies[i];
    if (l.tensor != m.tensor || l.node != m.node || l.out_i != m.out_i || l.meta != m.meta ||
        l.leaf != m.leaf) {
      why = "LazyTensor " + std::to_string(i) + " is read differently";
      return false;
    }
  }
  return true;
}

[[noreturn]] void stack_check_failed(PyObject* func, const std::string& why) {
  py::object name = py::reinterpret_steal<py::object>(PyObject_Str(func));
  PyErr_Clear();
  throw std::logic_error("genie: the record from the IValue stack of " +
                         (name ? py::str(name).cast<std::string>() : std::string("an op")) +
                         " differs from flatten()'s of its Python arguments: " + why +
                         " (GENIE_STACK_RECORD_CHECK; GENIE_STACK_RECORD=0 takes the Python "
                         "arguments' path)");
}

// One argument (a leaf, or a list of ints or of tensors: a list header and its elements).
bool stack_arg(const c10::IValue& v, uint8_t kind, const OpInfo& info, Call& call,
               int64_t& index) {
  if (kind == genie::kStackValue && (v.isIntList() || v.isTensorList())) {
    // view's sizes, permute's dims; cat's and stack's tensors
    const auto items = v.toListRef();
    put(call.words, static_cast<uint64_t>(kList));
    put(call.words, static_cast<uint64_t>(items.size()));
    for (const c10::IValue& item : items) {
      if (!stack_leaf(item, genie::kStackValue, info, call, index)) {
        return false;
      }
    }
    return true;
  }
  return stack_leaf(v, kind, info, call, index);
}

PyObject* try_record_stack(PyObject* func, const c10::IValue* values, size_t positional,
                           const size_t* kw, size_t n_kw, PyObject* const* kw_names,
                           const uint8_t* kinds, PyObject* check_args, PyObject* check_kwargs) {
  if (!S.ready || !flags.native_record || !flags.meta_cache || flags.record_source ||
      !flags.stack_record || dict_get(S.profiler, names->profiler_enabled) != Py_False ||
      func == S.detach || genie::read_op_is(func)) {
    stack_why = "off, profiler, detach or a read";
    return kStackDeclined;
  }
  const OpInfo* info = op_info(func);
  if (info == nullptr || !info->ok || !info->writes.empty() ||
      PyList_GET_SIZE(this_thread().graphs) != 0) {
    stack_why = info == nullptr ? "op policy not cached" : !info->ok ? "op policy"
                : !info->writes.empty() ? "writes" : "capture";
    return kStackDeclined;
  }
  Call call;
  size_t n_words = 3 + (n_kw > 0 ? 2 + 2 * n_kw : 0), n_leaves = 0;  // room for put()
  auto room = [&](const c10::IValue& v) {
    const size_t k = v.isList() ? v.toListRef().size() : 1;
    n_words += 2 + 2 * k;
    n_leaves += k;
  };
  for (size_t i = 0; i < positional; ++i) {
    room(values[i]);
  }
  for (size_t j = 0; j < n_kw; ++j) {
    room(values[kw[j]]);
  }
  call.words.reserve(n_words);
  call.leaves.reserve(n_leaves);
  call.owned.reserve(n_leaves);
  put(call.words, reinterpret_cast<uint64_t>(func));
  put(call.words, static_cast<uint64_t>(kState));
  put(call.words, genie::state_word());
  int64_t index = -1;
  for (size_t i = 0; i < positional; ++i) {
    if (!stack_arg(values[i], kinds[i], *info, call, index)) {
      return kStackDeclined;
    }
  }
  if (n_kw > 0) {  // as flatten walks a kwargs dict: its size, then by name, each name and value
    put(call.words, static_cast<uint64_t>(kDict));
    put(call.words, static_cast<uint64_t>(n_kw));
    for (size_t j = 0; j < n_kw; ++j) {
      put(call.words, static_cast<uint64_t>(kKey));
      put(call.words, reinterpret_cast<uint64_t>(kw_names[j]));  // interned
      if (!stack_arg(values[kw[j]], kinds[kw[j]], *info, call, index)) {
        return kStackDeclined;
      }
    }
  }
  if (call.lazies.empty()) {
    stack_why = "no LazyTensor";
    return kStackDeclined;
  }
  if (check_args != nullptr) {
    Call ref;
    if (!flatten(check_args, check_kwargs, *info, func, ref)) {
      PyErr_Clear();
      stack_check_failed(func, "flatten() refuses the call");
    }
    std::string why;
    if (!same_call(call, ref, why)) {
      stack_check_failed(func, why);
    }
  }
  std::shared_ptr<Entry> e = entries.find(hash_words(call.words), call.words);
  if (!e || e->python_only) {
    stack_why = !e ? "no learned entry (a miss)" : "entry python_only";
    return kStackDeclined;
  }
  c10::SmallVector<PyObject*, 4> sources;  // borrowed: the aliased argument of each output
  for (const Out& o : e->outs) {
    PyObject* src = nullptr;
    if (o.kind == Kind::kWrite) {
      stack_why = "a written output";
      return kStackDeclined;
    }
    if (o.kind == Kind::kView) {
      if (o.pos < 0 || static_cast<size_t>(o.pos) >= positional || !values[o.pos].isTensor()) {
        stack_why = "a view of no tensor argument";
        return kStackDeclined;
      }
      for (const Lazy& l : call.lazies) {
        if (reinterpret_cast<PyObject*>(
                values[o.pos].unsafeToTensorImpl()->pyobj_slot()->load_pyobj()) == l.tensor) {
          src = l.tensor;
          break;
        }
      }
      if (src == nullptr) {
        stack_why = "a view of no LazyTensor argument";
        return kStackDeclined;
      }
    }
    if (check_args != nullptr &&
        src != (o.kind == Kind::kFresh ? nullptr
                                       : alias_source(*info, check_args, check_kwargs, o))) {
      stack_check_failed(func, "an output's aliased argument differs");
    }
    sources.push_back(src);
  }
  const c10::SmallVector<py::object, 4> writes;
  PyObject* r = record_made(func, *info, call, *e, S.default_graph, flags.gc_untrack, true,
                            sources, writes);
  if (r == nullptr) {
    if (PyErr_Occurred()) {
      return nullptr;
    }
    stack_why = "an aliased argument without a storage";
    return kStackDeclined;  // nothing done: the Python arguments' path decides
  }
  reasons[kHandled]++;
  return r;
}

// LazyTensor.__torch_dispatch__(func, types, args=(), kwargs=None), as a staticmethod: torch
// calls it on LazyTensor arguments only (LazyTensor has no subclasses), and a staticmethod is
// found without binding a method object per call.
PyObject* record_dispatch(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t nargs,
                          PyObject* kwnames) {
  PyObject* func = nargs > 0 ? argv[0] : nullptr;
  PyObject* args = nargs > 2 ? argv[2] : nullptr;
  PyObject* kwargs = nargs > 3 ? argv[3] : nullptr;
  if (kwnames != nullptr) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); ++i) {
      PyObject* name = PyTuple_GET_ITEM(kwnames, i);
      PyObject* v = argv[nargs + i];
      if (PyUnicode_CompareWithASCIIString(name, "func") == 0) {
        func = v;
      } else if (PyUnicode_CompareWithASCIIString(name, "args") == 0) {
        args = v;
      } else if (PyUnicode_CompareWithASCIIString(name, "kwargs") == 0) {
        kwargs = v;
      } else if (PyUnicode_CompareWithASCIIString(name, "types") != 0) {
        PyErr_Format(PyExc_TypeError, "__torch_dispatch__() got an unexpected keyword argument '%U'",
                     name);
        return nullptr;
      }
    }
  }
  if (func == nullptr || !S.ready) {
    PyErr_SetString(PyExc_TypeError, "__torch_dispatch__() needs func (and the native record "
                    "path initialized by genie.lazy_tensor)");
    return nullptr;
  }
  py::object empty;
  if (args == nullptr) {
    empty = py::reinterpret_steal<py::object>(PyTuple_New(0));
    args = empty.ptr();
  }
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    // a dispatch mode declined this call (FakeTensorMode, AOTAutograd's modes: a LazyTensor is
    // a subclass they do not know): the Python path decides (lazy_tensor._lift_under_modes)
    return after_record(PyObject_CallFunctionObjArgs(
        S.fallback, func, args, kwargs != nullptr ? kwargs : Py_None, nullptr));
  }
  return native_or_fallback(try_record, S.fallback, func, args, kwargs);
}

// lazy_tensor.record_factory for the common case: a factory call (no tensor argument) whose
// `device=` is a remote_accelerator device (without an index, `device="remote_accelerator"`,
// the current device's, as record_factory fills it in), with the conditions of try_record and
// genie.context active (record_factory activates it: its first call takes Python) or off
// (GENIE_CONTEXT=0: activating does nothing, and every factory call used to take Python). The
// node is the one record_factory records, from the same meta-cache entry (found by identity key,
// or from entry_for on a miss); every other call goes to record_factory. Returns kNotHandled for
// those.
PyObject* try_record_factory(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (!S.ready || S.factory_fallback == nullptr || !flags.native_record || !flags.meta_cache ||
      flags.record_source) {
    reasons[kOff]++;
    return kNotHandled;
  }
  if (dict_get(S.profiler, names->profiler_enabled) != Py_False) {
    reasons[kProfiler]++;
    return kNotHandled;
  }
  if (!PyTuple_CheckExact(args) || kwargs == nullptr || !PyDict_CheckExact(kwargs)) {
    reasons[kArgs]++;
    return kNotHandled;
  }
  PyObject* dev = dict_get(kwargs, names->device);
  if (dev == nullptr || !THPDevice_Check(dev) ||
      (dict_get(S.context_dict, names->active) != Py_True &&
       dict_get(S.context_dict, names->context_on) != Py_False)) {
    reasons[kArgs]++;
    return kNotHandled;
  }
  c10::Device d = reinterpret_cast<THPDevice*>(dev)->device;
  py::object indexed;  // kwargs with the current device's index, for `device="remote_accelerator"`
  if (d.type() == c10::DeviceType::PrivateUse1 && d.index() < 0) {
    // as record_factory: the call's kwargs with device=remote_accelerator:<current index>
    d = c10::Device(c10::DeviceType::PrivateUse1, genie::current_device());
    if (d.index() < genie::device_count()) {
      indexed = py::reinterpret_steal<py::object>(checked(PyDict_Copy(kwargs)));
      // one torch.device per index, kept for the process (lazy_tensor.device_of's cache)
      static PyObject* devices[128] = {};
      PyObject*& named = devices[static_cast<uint8_t>(d.index()) & 127];
      if (named == nullptr) {
        named = checked(THPDevice_New(d));
      }
      if (PyDict_SetItem(indexed.ptr(), names->device, named) < 0) {
        throw py::error_already_set();
      }
      kwargs = indexed.ptr();
    }
  }
  if (d.type() != c10::DeviceType::PrivateUse1 || d.index() < 0 ||
      d.index() >= genie::device_count()) {
    reasons[kDevices]++;
    return kNotHandled;  // record_factory raises eager's error
  }
  const OpInfo* info = op_info(func);
  if (info == nullptr || !info->ok) {
    reasons[info == nullptr ? kUnseen : kOpPolicy]++;
    return kNotHandled;
  }
  if (PyList_GET_SIZE(this_thread().graphs) != 0) {
    reasons[kCapture]++;
    return kNotHandled;
  }
  Call call;
  if (!flatten(args, kwargs, *info, func, call, true)) {
    if (PyErr_Occurred()) {
      return nullptr;
    }
    reasons[call.reason]++;
    return kNotHandled;
  }
  bool hit = false;
  std::shared_ptr<Entry> e = entry_of(func, *info, args, kwargs, call, hit);
  if (!e || e->python_only) {
    if (e && !hit) {
      counted_hits--;  // record_factory finds the entry entry_for counted: one lookup too many
    }
    reasons[kUnseen]++;
    return kNotHandled;
  }
  PyObject* r = record_hit(func, *info, args, kwargs, call, *e, S.default_graph,
                           flags.gc_untrack, hit);
  if (r == nullptr && !PyErr_Occurred()) {
    reasons[kEntry]++;
    if (!hit) {
      counted_hits--;
    }
    return kNotHandled;
  }
  if (r != nullptr) {
    counted_factories++;
  }
  reasons[hit ? kHandled : kMissNative]++;
  return r;
}

// The PrivateUse1 factory kernels' body (genie.factories): _record_factory(func, args, kwargs)
// records natively where try_record_factory can, else calls lazy_tensor.record_factory.
PyObject* record_factory(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "_record_factory(func, args, kwargs)");
    return nullptr;
  }
  return genie::record_factory_call(argv[0], argv[1], argv[2] == Py_None ? nullptr : argv[2]);
}

// torch._library.simple_registry.find_torch_dispatch_rule(op, cls), natively. torch calls it from
// C++ for every op that reaches a subclass's __torch_dispatch__ (dispatch_on_subclass), i.e. for
// every op genie records: as Python, three calls and ~5% of recording a pointwise op. Same
// lookups, same result: the registry's entry for op.__qualname__ (`data`, the registry's dict,
// given by genie.lazy_tensor._install_dispatch_rule_lookup), then that entry's rule for `cls`.
// One difference, not observable through the result: torch's find() adds an empty entry for an
// op it has not seen; this lookup adds nothing.
PyObject* rule_data = nullptr;  // torch._library.simple_registry.singleton._data

PyObject* find_dispatch_rule(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t nargs) {
  static PyObject* qualname = intern("__qualname__");
  static PyObject* rules = intern("torch_dispatch_rules");
  static PyObject* data = intern("_data");
  if (nargs != 2 || rule_data == nullptr) {
    PyErr_SetString(PyExc_TypeError, "find_torch_dispatch_rule(op, torch_dispatch_class) takes 2 "
                    "arguments (and genie.lazy_tensor installs it with the registry's dict)");
    return nullptr;
  }
  py::object name = py::reinterpret_steal<py::object>(PyObject_GetAttr(argv[0], qualname));
  if (!name) {
    return nullptr;
  }
  PyObject* entry = PyDict_GetItemWithError(rule_data, name.ptr());  // borrowed
  if (entry == nullptr) {
    if (PyErr_Occurred()) {
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  py::object holder = py::reinterpret_steal<py::object>(PyObject_GetAttr(entry, rules));
  if (!holder) {
    return nullptr;
  }
  py::object d = py::reinterpret_steal<py::object>(PyObject_GetAttr(holder.ptr(), data));
  if (!d) {
    return nullptr;
  }
  if (!PyDict_Check(d.ptr())) {
    PyErr_SetString(PyExc_TypeError, "torch_dispatch_rules._data is not a dict");
    return nullptr;
  }
  PyObject* r = PyDict_GetItemWithError(d.ptr(), argv[1]);
  if (r == nullptr) {
    if (PyErr_Occurred()) {
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  return new_ref(r);
}

PyObject* set_rule_data(PyObject* /*module*/, PyObject* d) {
  if (!PyDict_Check(d)) {
    PyErr_SetString(PyExc_TypeError, "_set_dispatch_rule_data takes the registry's dict");
    return nullptr;
  }
  Py_XSETREF(rule_data, new_ref(d));
  Py_RETURN_NONE;
}

// --- module contexts: genie.context._module_call's inline path ----------------------------
//
// A submodule called inside a module call (55 a token in a GPT-2 decode) gets its Context as
// genie.context._module_call's inline path gives it: its path from the outermost module's
// names, its Context interned on the call by (path, region, explicit phase), pushed on the
// thread's module stack and made graph.current.ctx; ctx_pop undoes it if the entry is still on
// top. In Python that path cost ~2.4 µs per call in a GPT-2 forward (0.13 ms a token); the
// wrapper's Python frame and these two calls now cost ~1 (measured on the forward). ctx_push
// returns None wherever the inline path would not apply (no module call running, a module the
// outermost one does not name, anything unexpected): the Python code decides those, as before.
// GENIE_NATIVE_CONTEXT=0 keeps the Python path for all calls.

struct CtxState {
  bool ready = false;
  PyObject* tls = nullptr;           // genie.context._tls
  PyTypeObject* context = nullptr;   // genie.context.Context
  PyTypeObject* call = nullptr;      // genie.context.Call
  Py_ssize_t path = 0, cls = 0, region = 0, explicit_ = 0, ctx_call = 0, contexts = 0;
  PyObject* modules = nullptr;       // "modules"
  PyObject* phases = nullptr;        // "phases"
  PyObject* genie_phase = nullptr;   // "_genie_phase"
  PyObject* thread_key = nullptr;    // the thread state dict key holding this thread's lists
  PyObject* name = nullptr;          // "__name__"
  // an outermost module call begun natively (ctx_begin)
  Py_ssize_t call_root = 0, call_phase = 0, call_start = 0, call_nodes = 0;
  PyObject* names = nullptr;         // genie.context._names.data: {weakref(module): its names}
  PyObject* ended = nullptr;         // genie.context._ended(module, call)
  PyObject* empty = nullptr;         // ""
  PyObject* forward = nullptr;       // "forward"
  // a call with keyword arguments or a decode (ctx_begin_walk)
  PyObject* walk = nullptr;          // genie.context._lazy_tensors
  PyObject* globals = nullptr;       // genie.context.__dict__ (share_decode_calls)
  PyObject* share = nullptr;         // "share_decode_calls"
  PyObject* decode = nullptr;        // "decode" (genie.context._tls.decode)
  PyObject* data = nullptr;          // "data" (a WeakKeyDictionary's dict)
  PyObject* role = nullptr;          // "role"
  PyObject* kv_cache = nullptr;      // "kv_cache"
  PyObject* decode_calls = nullptr;  // "phase.decode.calls"
  PyObject* decode_nodes = nullptr;  // "phase.decode.nodes"
  PyObject* root_key = nullptr;      // ("", "forward", None): the outermost context's key
};

CtxState CX;

// genie.context._recorded(): the nodes recorded so far (genie.stats' ops_recorded and
// factories_recorded, with the counts kept here added first).
int64_t recorded_count() {
  record_sync_counts();
  int64_t n = 0;
  for (PyObject* name : {names->ops_recorded, names->factories_recorded}) {
    PyObject* v = dict_get(S.counts, name);  // borrowed
    if (v != nullptr) {
      const long long k = PyLong_AsLongLong(v);
      if (k == -1 && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      n += k;
    }
  }
  return n;
}

PyTypeObject* type_of(const py::dict& objs, const char* name);
PyObject* object_of(const py::dict& objs, const char* name);

bool ctx_lists(ThreadObjects& t) {
  if (t.ctx_modules != nullptr) {
    return true;
  }
  py::object modules = py::reinterpret_steal<py::object>(PyObject_GetAttr(CX.tls, CX.modules));
  py::object phases = py::reinterpret_steal<py::object>(PyObject_GetAttr(CX.tls, CX.phases));
  if (!modules || !phases) {
    PyErr_Clear();
    return false;
  }
  if (!PyList_CheckExact(modules.ptr()) || !PyList_CheckExact(phases.ptr())) {
    return false;
  }
  PyObject* tdict = PyThreadState_GetDict();  // borrowed
  py::object pair = py::reinterpret_steal<py::object>(
      PyTuple_Pack(2, modules.ptr(), phases.ptr()));
  if (tdict == nullptr || !pair || PyDict_SetItem(tdict, CX.thread_key, pair.ptr()) < 0) {
    PyErr_Clear();
    return false;
  }
  t.ctx_modules = modules.ptr();
  t.ctx_phases = phases.ptr();
  return true;
}

PyObject* ctx_push_impl(PyObject* module) {
  if (!CX.ready || !S.ready) {
    Py_RETURN_NONE;
  }
  ThreadObjects& t = const_cast<ThreadObjects&>(this_thread());
  if (!ctx_lists(t)) {
    Py_RETURN_NONE;
  }
  PyObject* st = t.ctx_modules;
  const Py_ssize_t depth = PyList_GET_SIZE(st);
  if (depth == 0) {
    Py_RETURN_NONE;
  }
  PyObject* top = PyList_GET_ITEM(st, depth - 1);
  if (!PyTuple_CheckExact(top) || PyTuple_GET_SIZE(top) != 3) {
    Py_RETURN_NONE;
  }
  PyObject* names_ = PyTuple_GET_ITEM(top, 2);
  if (!PyDict_CheckExact(names_)) {
    Py_RETURN_NONE;
  }
  py::object outer = py::reinterpret_steal<py::object>(current_attr(t.current, names->ctx));
  if (Py_TYPE(outer.ptr()) != CX.context) {
    Py_RETURN_NONE;
  }
  PyObject* call = slot(outer.ptr(), CX.ctx_call);
  if (call == nullptr || Py_TYPE(call) != CX.call) {
    Py_RETURN_NONE;
  }
  PyObject* ref = PyWeakref_NewRef(module, nullptr);  // the module's existing basic ref, if any
  if (ref == nullptr) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  PyObject* path = PyDict_GetItemWithError(names_, ref);  // borrowed
  Py_DECREF(ref);
  if (path == nullptr) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  PyObject* explicit_ = nullptr;  // borrowed
  PyObject** dp = _PyObject_GetDictPtr(module);
  if (dp != nullptr && *dp != nullptr) {
    explicit_ = PyDict_GetItemWithError(*dp, CX.genie_phase);
    if (explicit_ == nullptr && PyErr_Occurred()) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
  }
  if (explicit_ == nullptr || explicit_ == Py_None) {
    PyObject* phases = t.ctx_phases;
    explicit_ = PyList_GET_SIZE(phases) > 0 ? PyList_GET_ITEM(phases, PyList_GET_SIZE(phases) - 1)
                                            : slot(outer.ptr(), CX.explicit_);
  }
  PyObject* region = slot(outer.ptr(), CX.region);
  PyObject* contexts = slot(call, CX.contexts);
  if (explicit_ == nullptr || region == nullptr || contexts == nullptr ||
      !PyDict_CheckExact(contexts)) {
    Py_RETURN_NONE;
  }
  py::object key =
      py::reinterpret_steal<py::object>(checked(PyTuple_Pack(3, path, region, explicit_)));
  PyObject* c = PyDict_GetItemWithError(contexts, key.ptr());  // borrowed
  if (c == nullptr) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    py::object cls = py::reinterpret_steal<py::object>(
        checked(PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(module)), CX.name)));
    py::object made = py::reinterpret_steal<py::object>(new_object(CX.context, true));
    init_slot(made.ptr(), CX.path, new_ref(path));
    init_slot(made.ptr(), CX.cls, new_ref(cls.ptr()));
    init_slot(made.ptr(), CX.region, new_ref(region));
    init_slot(made.ptr(), CX.explicit_, new_ref(explicit_));
    init_slot(made.ptr(), CX.ctx_call, new_ref(call));
    if (PyDict_SetItem(contexts, key.ptr(), made.ptr()) < 0) {
      throw py::error_already_set();
    }
    c = made.ptr();  // the dict holds it
  }
  py::object entry = py::reinterpret_steal<py::object>(
      checked(PyTuple_Pack(3, module, outer.ptr(), names_)));
  if (PyList_Append(st, entry.ptr()) < 0 || PyDict_SetItem(t.current, names->ctx, c) < 0) {
    throw py::error_already_set();
  }
  return entry.release().ptr();
}

// genie.context._enter for an outermost module call (no module call running on this thread) in
// the common case: positional arguments only, every one a LazyTensor none of whose nodes an
// earlier call of this module recorded (not a decode: _begin's producer check), no phase block
// or phase annotation, no context set outside any module, the module's names known (its first
// call makes them). Its Call and root Context are made as _begin and _context make them, pushed
// as _enter pushes; ctx_pop ends the call as _leave does. None wherever the Python code decides.
// The Call whose context recorded LazyTensor `x`'s node (genie.context._begin's producer):
// `producer` (borrowed: `node`, which `x` holds, holds it) with a weak `call_root`, or null where
// the node was recorded outside any call; `node` is the node. False where Python decides (not a
// LazyTensor, objects not of the types expected).
bool producing_call(PyObject* x, py::object& node, PyObject*& producer) {
  producer = nullptr;
  if (Py_TYPE(x) != S.lazy) {
    return false;
  }
  node = py::reinterpret_steal<py::object>(lazy_attr(x, names->node));
  if (!node || Py_TYPE(node.ptr()) != S.node) {
    return false;
  }
  PyObject* ctx = slot(node.ptr(), S.n.ctx);
  if (ctx == nullptr || ctx == Py_None) {
    return true;
  }
  if (Py_TYPE(ctx) != CX.context) {
    return false;
  }
  PyObject* call = slot(ctx, CX.ctx_call);
  if (call == nullptr || call == Py_None) {
    return true;
  }
  if (Py_TYPE(call) != CX.call) {
    return false;
  }
  PyObject* r = slot(call, CX.call_root);
  if (r == nullptr || !PyWeakref_CheckRef(r)) {
    return false;
  }
  producer = call;
  return true;
}

// A call with keyword arguments (or positional ones that are not all LazyTensors) as
// genie.context._begin decides it, in the common cases: its arguments walked (the walk itself,
// genie.context._lazy_tensors, is csrc/walk.cpp's); Py_False where no tensor an earlier call of
// `module` recorded is among them (not a decode: ctx_begin makes its Call); for a decode whose
// module has its shared decode Call with the outermost context interned (every decode step of
// a generate loop after the first: transformers calls the model with keyword arguments and
// its cache object), the tensors that call recorded tagged ``kv_cache``, the Call restarted and
// its context pushed, as _begin, _decode_call and _enter do; the stack entry is returned. None
// wherever the Python code decides (a producer whose phase is not known yet: _begin sets it;
// the first decode; decode calls not shared; anything unexpected), before any side effect.
// Python's _module_call, _host_call, _enter, _begin and _decode_call cost ~35 µs a token of a
// GPT-2 4x128 generate in situ (thread CPU, a loaded 2-core machine).
PyObject* ctx_begin_walk(PyObject* module, PyObject* const* args, Py_ssize_t n,
                         PyObject* kwnames, const ThreadObjects& t, PyObject* root,
                         PyObject* names_) {
  if (CX.walk == nullptr) {
    Py_RETURN_NONE;
  }
  const Py_ssize_t nk = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  // (args, kwargs), as _begin walks them
  py::object pargs = py::reinterpret_steal<py::object>(checked(PyTuple_New(n)));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyTuple_SET_ITEM(pargs.ptr(), i, new_ref(args[i]));
  }
  py::object kw = py::reinterpret_steal<py::object>(checked(PyDict_New()));
  for (Py_ssize_t i = 0; i < nk; ++i) {
    if (PyDict_SetItem(kw.ptr(), PyTuple_GET_ITEM(kwnames, i), args[n + i]) < 0) {
      throw py::error_already_set();
    }
  }
  py::object pair =
      py::reinterpret_steal<py::object>(checked(PyTuple_Pack(2, pargs.ptr(), kw.ptr())));
  py::object found =
      py::reinterpret_steal<py::object>(checked(PyObject_CallOneArg(CX.walk, pair.ptr())));
  if (!PyList_CheckExact(found.ptr())) {
    Py_RETURN_NONE;
  }
  // the producers: any of `module`'s makes this a decode
  const Py_ssize_t nf = PyList_GET_SIZE(found.ptr());
  std::vector<PyObject*> kv;  // nodes `module`'s earlier calls recorded (borrowed: found holds)
  std::vector<py::object> held;
  for (Py_ssize_t i = 0; i < nf; ++i) {
    py::object node;
    PyObject* producer = nullptr;
    if (!producing_call(PyList_GET_ITEM(found.ptr(), i), node, producer)) {
      Py_RETURN_NONE;
    }
    if (producer == nullptr || PyWeakref_GET_OBJECT(slot(producer, CX.call_root)) != module) {
      continue;
    }
    PyObject* phase = slot(producer, CX.call_phase);
    if (phase == nullptr || phase == Py_None) {
      Py_RETURN_NONE;  // its call was the prefill: _begin says so
    }
    kv.push_back(node.ptr());
    held.push_back(std::move(node));
  }
  if (kv.empty()) {
    Py_RETURN_FALSE;
  }
  // _decode_call(module): the module's shared Call, its outermost context interned
  PyObject* share = dict_get(CX.globals, CX.share);
  if (share != Py_True) {
    Py_RETURN_NONE;
  }
  py::object decode = py::reinterpret_steal<py::object>(PyObject_GetAttr(CX.tls, CX.decode));
  py::object data = decode ? py::reinterpret_steal<py::object>(
                                 PyObject_GetAttr(decode.ptr(), CX.data))
                           : py::object();
  if (!data || !PyDict_CheckExact(data.ptr())) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  PyObject* call = dict_get(data.ptr(), root);  // borrowed (weak keys compare by referent)
  if (call == nullptr || Py_TYPE(call) != CX.call) {
    Py_RETURN_NONE;
  }
  PyObject* contexts = slot(call, CX.contexts);
  if (contexts == nullptr || !PyDict_CheckExact(contexts)) {
    Py_RETURN_NONE;
  }
  PyObject* c = dict_get(contexts, CX.root_key);
  if (c == nullptr || Py_TYPE(c) != CX.context) {
    Py_RETURN_NONE;
  }
  py::object hold_call = py::reinterpret_borrow<py::object>(call);
  py::object hold_c = py::reinterpret_borrow<py::object>(c);
  // the side effects, as _begin, _decode_call and _enter make them
  for (PyObject* node : kv) {
    PyObject*& tags = slot(node, S.n.tags);
    if (tags == nullptr || tags == Py_None) {
      PyObject* d = checked(PyDict_New());
      Py_XSETREF(tags, d);
    }
    if (PyObject_SetItem(tags, CX.role, CX.kv_cache) < 0) {
      throw py::error_already_set();
    }
  }
  PyObject*& start = slot(call, CX.call_start);
  Py_XSETREF(start, checked(PyLong_FromLongLong(recorded_count())));
  PyObject*& nodes = slot(call, CX.call_nodes);
  Py_XSETREF(nodes, new_ref(Py_None));
  add_count(CX.decode_calls, 1);
  py::object entry = py::reinterpret_steal<py::object>(
      checked(PyTuple_Pack(3, module, Py_None, names_)));
  if (PyList_Append(t.ctx_modules, entry.ptr()) < 0 ||
      PyDict_SetItem(t.current, names->ctx, c) < 0) {
    throw py::error_already_set();
  }
  return entry.release().ptr();
}

PyObject* ctx_begin(PyObject* module, PyObject* const* args, Py_ssize_t n, PyObject* kwnames,
                    const ThreadObjects& t) {
  const Py_ssize_t nk = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  if (CX.names == nullptr || n + nk < 1 || PyList_GET_SIZE(t.ctx_phases) != 0) {
    Py_RETURN_NONE;
  }
  PyObject** dp = _PyObject_GetDictPtr(module);
  if (dp != nullptr && *dp != nullptr) {
    PyObject* p = PyDict_GetItemWithError(*dp, CX.genie_phase);  // borrowed
    if (p == nullptr && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    if (p != nullptr && p != Py_None) {
      Py_RETURN_NONE;
    }
  }
  py::object outer = py::reinterpret_steal<py::object>(current_attr(t.current, names->ctx));
  if (outer.ptr() != Py_None) {
    Py_RETURN_NONE;
  }
  PyObject* ref = PyWeakref_NewRef(module, nullptr);  // the module's basic weak reference
  if (ref == nullptr) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  PyObject* names_ = PyDict_GetItemWithError(CX.names, ref);  // borrowed
  if (names_ == nullptr || !PyDict_CheckExact(names_)) {
    Py_DECREF(ref);
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    Py_RETURN_NONE;
  }
  py::object root = py::reinterpret_steal<py::object>(ref);
  bool lazies = nk == 0;  // positional LazyTensors only: their nodes read directly, below
  for (Py_ssize_t i = 0; lazies && i < n; ++i) {
    lazies = Py_TYPE(args[i]) == S.lazy;
  }
  if (!lazies) {
    PyObject* r = ctx_begin_walk(module, args, n, kwnames, t, root.ptr(), names_);
    if (r != Py_False) {
      return r;  // a decode's entry, or None: Python decides
    }
    Py_DECREF(r);  // not a decode: its Call, below
  }
  for (Py_ssize_t i = 0; lazies && i < n; ++i) {
    py::object node;
    PyObject* producer = nullptr;
    if (!producing_call(args[i], node, producer)) {
      Py_RETURN_NONE;
    }
    if (producer == nullptr) {
      continue;
    }
    if (PyWeakref_GET_OBJECT(slot(producer, CX.call_root)) == module) {
      Py_RETURN_NONE;  // an earlier call of this module produced it: a decode (Python decides)
    }
  }
  // Call(module)
  py::object call = py::reinterpret_steal<py::object>(new_object(CX.call, true));
  init_slot(call.ptr(), CX.call_root, new_ref(root.ptr()));
  init_slot(call.ptr(), CX.call_phase, new_ref(Py_None));
  init_slot(call.ptr(), CX.call_start, checked(PyLong_FromLongLong(recorded_count())));
  init_slot(call.ptr(), CX.call_nodes, new_ref(Py_None));
  PyObject* contexts = checked(PyDict_New());
  init_slot(call.ptr(), CX.contexts, contexts);
  // _context(call, "", cls, "forward", None), interned on the call
  py::object cls = py::reinterpret_steal<py::object>(
      checked(PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(module)), CX.name)));
  py::object c = py::reinterpret_steal<py::object>(new_object(CX.context, true));
  init_slot(c.ptr(), CX.path, new_ref(CX.empty));
  init_slot(c.ptr(), CX.cls, new_ref(cls.ptr()));
  init_slot(c.ptr(), CX.region, new_ref(CX.forward));
  init_slot(c.ptr(), CX.explicit_, new_ref(Py_None));
  init_slot(c.ptr(), CX.ctx_call, new_ref(call.ptr()));
  py::object key =
      py::reinterpret_steal<py::object>(checked(PyTuple_Pack(3, CX.empty, CX.forward, Py_None)));
  if (PyDict_SetItem(contexts, key.ptr(), c.ptr()) < 0) {
    throw py::error_already_set();
  }
  py::object entry = py::reinterpret_steal<py::object>(
      checked(PyTuple_Pack(3, module, Py_None, names_)));
  if (PyList_Append(t.ctx_modules, entry.ptr()) < 0 ||
      PyDict_SetItem(t.current, names->ctx, c.ptr()) < 0) {
    throw py::error_already_set();
  }
  return entry.release().ptr();
}

// genie.context._ended(module, call) for a decode call (a steady generate's every step): its
// contexts kept while it is the module's shared decode Call, else released; its size counted
// in phase.decode.nodes. False where the Python function decides (another phase, objects not as
// expected).
bool decode_ended(PyObject* module, PyObject* call, PyObject* phase, PyObject* nodes) {
  if (CX.walk == nullptr || !PyUnicode_CheckExact(phase) ||
      PyUnicode_Compare(phase, CX.decode) != 0 || nodes == nullptr || !PyLong_CheckExact(nodes)) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return false;
  }
  PyObject* contexts = slot(call, CX.contexts);
  py::object decode = py::reinterpret_steal<py::object>(PyObject_GetAttr(CX.tls, CX.decode));
  py::object data = decode ? py::reinterpret_steal<py::object>(
                                 PyObject_GetAttr(decode.ptr(), CX.data))
                           : py::object();
  py::object ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(module, nullptr));
  if (!data || !ref || !PyDict_CheckExact(data.ptr()) || contexts == nullptr ||
      !PyDict_CheckExact(contexts)) {
    PyErr_Clear();
    return false;
  }
  const long long n = PyLong_AsLongLong(nodes);
  if (n == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  if (dict_get(data.ptr(), ref.ptr()) != call) {
    PyDict_Clear(contexts);
  }
  add_count(CX.decode_nodes, n);
  return true;
}

PyObject* ctx_push(PyObject* /*self*/, PyObject* module) {
  return guarded([&] { return ctx_push_impl(module); });
}

PyObject* ctx_pop(PyObject* /*self*/, PyObject* entry) {
  return guarded([&]() -> PyObject* {
    ThreadObjects& t = const_cast<ThreadObjects&>(this_thread());
    if (!ctx_lists(t)) {
      Py_RETURN_NONE;
    }
    PyObject* st = t.ctx_modules;
    const Py_ssize_t depth = PyList_GET_SIZE(st);
    // as genie.context._leave: popped only if still on top
    if (depth > 0 && PyList_GET_ITEM(st, depth - 1) == entry && PyTuple_CheckExact(entry) &&
        PyTuple_GET_SIZE(entry) == 3) {
      py::object ctx = py::reinterpret_steal<py::object>(current_attr(t.current, names->ctx));
      PyObject* outer = new_ref(PyTuple_GET_ITEM(entry, 1));
      const int bad = PyList_SetSlice(st, depth - 1, depth, nullptr) < 0 ||
                      PyDict_SetItem(t.current, names->ctx, outer) < 0;
      Py_DECREF(outer);
      if (bad) {
        return nullptr;
      }
      // the outermost call ended (_leave): its size, its contexts released unless a shared
      // decode call keeps them (genie.context._ended decides where its phase is known)
      PyObject* call = depth == 1 && Py_TYPE(ctx.ptr()) == CX.context
                           ? slot(ctx.ptr(), CX.ctx_call) : nullptr;
      if (call != nullptr && Py_TYPE(call) == CX.call) {
        PyObject* start = slot(call, CX.call_start);
        const long long s0 = start != nullptr ? PyLong_AsLongLong(start) : -1;
        if (s0 == -1 && PyErr_Occurred()) {
          throw py::error_already_set();
        }
        PyObject*& nodes = slot(call, CX.call_nodes);
        PyObject* old = nodes;
        nodes = checked(PyLong_FromLongLong(recorded_count() - s0));
        Py_XDECREF(old);
        PyObject* phase = slot(call, CX.call_phase);
        if (phase == nullptr || phase == Py_None) {
          PyObject* contexts = slot(call, CX.contexts);
          if (contexts != nullptr && PyDict_CheckExact(contexts)) {
            PyDict_Clear(contexts);
          }
        } else if (!decode_ended(PyTuple_GET_ITEM(entry, 0), call, phase, nodes) &&
                   CX.ended != nullptr) {
          py::object r = py::reinterpret_steal<py::object>(checked(
              PyObject_CallFunctionObjArgs(CX.ended, PyTuple_GET_ITEM(entry, 0), call, nullptr)));
        }
      }
    }
    Py_RETURN_NONE;
  });
}

// --- nn.Module.__call__ while contexts are on ------------------------------------------------
//
// genie.context installs a ModuleCall as nn.Module.__call__ (a C function in place of a Python
// wrapper): a module call that never touches the device decides so here, without a Python frame
// (the Python wrapper cost an eager 8-layer MLP forward ~1.2-1.4x; this check costs it ~1%:
// docs/semantics.md). Its outcomes:
//   - no module call of the device running on this thread and every tensor argument
//     (positional and keyword) on another device: torch's own __call__, nothing else;
//   - inside a device module call, a submodule its outermost module names: ctx_push's context
//     around torch's __call__ (popped however the call ends);
//   - anything else (a device tensor among the arguments, no tensor argument, a module the
//     outermost one does not name): genie.context._module_call decides, in Python.
// Read on the class (`nn.Module.__call__`) it is torch's own function: TorchDynamo reads
// `type(m).__call__` and inlines that, so traced code never sees Genie's check. Read on a module
// (`m.__call__`, as transformers' generate takes `model_forward = self.__call__`) it is this
// object bound to the module, so such calls get their context. The type's method-descriptor
// flag makes `m(x)` call it with the module first, no bound method made.

struct ModuleCall {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* orig;  // nn.Module.__call__ as torch defines it
  PyObject* slow;  // genie.context._module_call
};

// 1: every tensor among the arguments is on a device other than remote_accelerator and there
// is at least one; 0: otherwise (Python decides).
int host_only(PyObject* const* args, Py_ssize_t n, PyObject* kwnames) {
  const Py_ssize_t nk = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  bool seen = false;
  for (Py_ssize_t i = 0; i < n + nk; ++i) {
    PyObject* a = args[i];
    if (!THPVariable_Check(a)) {
      continue;
    }
    if (Py_TYPE(a) == S.lazy ||
        THPVariable_Unpack(a).device().type() == c10::DeviceType::PrivateUse1) {
      return 0;
    }
    seen = true;
  }
  return seen ? 1 : 0;
}

PyObject* module_call_vectorcall(PyObject* callable, PyObject* const* args, size_t nargsf,
                                 PyObject* kwnames) {
  auto* self = reinterpret_cast<ModuleCall*>(callable);
  const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (n < 1 || !CX.ready || !S.ready) {
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
  }
  PyObject* entry = guarded([&]() -> PyObject* {
    ThreadObjects& t = const_cast<ThreadObjects&>(this_thread());
    if (!ctx_lists(t)) {
      Py_RETURN_NONE;
    }
    if (PyList_GET_SIZE(t.ctx_modules) == 0) {
      if (host_only(args + 1, n - 1, kwnames)) {
        return new_ref(Py_True);  // torch's call, nothing else
      }
      return ctx_begin(args[0], args + 1, n - 1, kwnames, t);
    }
    return ctx_push_impl(args[0]);
  });
  if (entry == nullptr) {
    return nullptr;
  }
  if (entry == Py_None) {
    Py_DECREF(entry);
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
  }
  if (entry == Py_True) {
    Py_DECREF(entry);
    return PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
  }
  PyObject* r = PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);  // the call's error, if any, survives the pop
  PyObject* popped = ctx_pop(nullptr, entry);
  Py_DECREF(entry);
  if (popped == nullptr) {
    if (r == nullptr) {
      PyErr_Clear();  // the call's own error is the one to raise
    } else {
      Py_DECREF(r);
      Py_XDECREF(et);
      Py_XDECREF(ev);
      Py_XDECREF(tb);
      return nullptr;
    }
  } else {
    Py_DECREF(popped);
  }
  PyErr_Restore(et, ev, tb);
  return r;
}

PyObject* module_call_get(PyObject* self, PyObject* obj, PyObject* /*type*/) {
  if (obj == nullptr || obj == Py_None) {
    return new_ref(reinterpret_cast<ModuleCall*>(self)->orig);
  }
  return PyMethod_New(self, obj);  // `m.__call__` (transformers' generate calls the model so)
}

// Attributes read through to torch's function (`__name__`, `__qualname__`, ...), and
// `__wrapped__` is that function: inspect.signature(m.__call__) and functools.wraps see torch's.
PyObject* module_call_getattro(PyObject* self, PyObject* name) {
  PyObject* orig = reinterpret_cast<ModuleCall*>(self)->orig;
  if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__wrapped__") == 0) {
    return new_ref(orig);
  }
  PyObject* r = PyObject_GenericGetAttr(self, name);
  if (r == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    r = PyObject_GetAttr(orig, name);
  }
  return r;
}

void module_call_dealloc(PyObject* self) {
  auto* m = reinterpret_cast<ModuleCall*>(self);
  Py_XDECREF(m->orig);
  Py_XDECREF(m->slow);
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject ModuleCallType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* module_call_new(PyObject* /*module*/, PyObject* const* args, Py_ssize_t n) {
  if (n != 2 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError,
                    "_module_call(orig, slow) takes nn.Module.__call__ and the Python wrapper");
    return nullptr;
  }
  if (ModuleCallType.tp_name == nullptr) {
    ModuleCallType.tp_name = "genie._C.ModuleCall";
    ModuleCallType.tp_basicsize = sizeof(ModuleCall);
    ModuleCallType.tp_flags =
        Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR;
    ModuleCallType.tp_doc = "nn.Module.__call__ while genie.context is active (csrc/record.cpp)";
    ModuleCallType.tp_vectorcall_offset = offsetof(ModuleCall, vectorcall);
    ModuleCallType.tp_call = PyVectorcall_Call;
    ModuleCallType.tp_descr_get = module_call_get;
    ModuleCallType.tp_getattro = module_call_getattro;
    ModuleCallType.tp_dealloc = module_call_dealloc;
    if (PyType_Ready(&ModuleCallType) < 0) {
      ModuleCallType.tp_name = nullptr;
      return nullptr;
    }
  }
  auto* m = PyObject_New(ModuleCall, &ModuleCallType);
  if (m == nullptr) {
    return nullptr;
  }
  m->vectorcall = module_call_vectorcall;
  m->orig = new_ref(args[0]);
  m->slow = new_ref(args[1]);
  return reinterpret_cast<PyObject*>(m);
}

bool context_init(const py::dict& objs) {
  CtxState c;
  c.tls = object_of(objs, "tls");
  c.context = type_of(objs, "Context");
  c.call = type_of(objs, "Call");
  check_slots(c.context, {"path", "cls", "region", "explicit", "call"});
  check_slots(c.call, {"root", "phase", "start", "nodes", "contexts"});
  c.path = slot_offset(c.context, "path");
  c.cls = slot_offset(c.context, "cls");
  c.region = slot_offset(c.context, "region");
  c.explicit_ = slot_offset(c.context, "explicit");
  c.ctx_call = slot_offset(c.context, "call");
  c.contexts = slot_offset(c.call, "contexts");
  c.modules = intern("modules");
  c.phases = intern("phases");
  c.genie_phase = intern("_genie_phase");
  c.thread_key = intern("genie.context.thread");
  c.name = intern("__name__");
  c.call_root = slot_offset(c.call, "root");
  c.call_phase = slot_offset(c.call, "phase");
  c.call_start = slot_offset(c.call, "start");
  c.call_nodes = slot_offset(c.call, "nodes");
  if (objs.contains("names") && objs.contains("ended")) {  // the outermost call natively
    c.names = object_of(objs, "names");
    c.ended = object_of(objs, "ended");
  }
  c.empty = intern("");
  c.forward = intern("forward");
  if (objs.contains("walk") && objs.contains("globals")) {  // with keyword arguments, decodes
    c.walk = object_of(objs, "walk");
    c.globals = object_of(objs, "globals");
    c.share = intern("share_decode_calls");
    c.decode = intern("decode");
    c.data = intern("data");
    c.role = intern("role");
    c.kv_cache = intern("kv_cache");
    c.decode_calls = intern("phase.decode.calls");
    c.decode_nodes = intern("phase.decode.nodes");
    c.root_key = checked(PyTuple_Pack(3, c.empty, c.forward, Py_None));
  }
  c.ready = true;
  CX = c;
  return S.ready;
}

// _graph_refs(rec, *seqs): append to list `rec` a Ref(t._node, t._out) for each item t of each
// sequence, in order: what genie.dynamo's caller of a compiled graph records for its inputs, one
// Ref per graph input every call (parameters are inputs), without a Python __init__ per Ref.
// False, with nothing appended, where this path is off (the caller builds them in Python).
PyObject* graph_refs(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || !PyList_CheckExact(args[0])) {
    PyErr_SetString(PyExc_TypeError, "_graph_refs(rec: list, *sequences)");
    return nullptr;
  }
  if (!S.ready) {
    Py_RETURN_FALSE;
  }
  return guarded([&]() -> PyObject* {
    PyObject* rec = args[0];
    for (Py_ssize_t a = 1; a < nargs; ++a) {
      py::object seq = py::reinterpret_steal<py::object>(
          checked(PySequence_Fast(args[a], "_graph_refs: a list or tuple of LazyTensors")));
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
      PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* t = items[i];
        // the instance dict, as generic attribute lookup finds them; else that lookup itself
        PyObject* node = lazy_attr(t, names->node);
        if (node == nullptr) {
          node = checked(PyObject_GetAttr(t, names->node));
        }
        PyObject* out = lazy_attr(t, names->out);
        if (out == nullptr && (out = PyObject_GetAttr(t, names->out)) == nullptr) {
          Py_DECREF(node);
          throw py::error_already_set();
        }
        PyObject* r = S.ref->tp_alloc(S.ref, 0);
        if (r == nullptr) {
          Py_DECREF(node);
          Py_DECREF(out);
          throw py::error_already_set();
        }
        init_slot(r, S.ref_node, node);
        init_slot(r, S.ref_out, out);
        const int rc = PyList_Append(rec, r);
        Py_DECREF(r);
        if (rc < 0) {
          throw py::error_already_set();
        }
      }
    }
    Py_RETURN_TRUE;
  });
}

// _note_reads(rec, wref): lazy_tensor._record's note of each Ref in list `rec` for record_known
// (a compiled graph call: one Ref per graph input), natively: one more consumer of the input node
// while that node has not run, and `wref` (the reading node's weak reference) among its storage's
// readers (Storage.add_reader, pruned as it prunes). False, nothing noted, where this
// path is off (the caller notes them in Python).
PyObject* note_reads(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_CheckExact(args[0])) {
    PyErr_SetString(PyExc_TypeError, "_note_reads(rec: list, wref)");
    return nullptr;
  }
  if (!S.ready) {
    Py_RETURN_FALSE;
  }
  return guarded([&]() -> PyObject* {
    PyObject* rec = args[0];
    PyObject* wref = args[1];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rec); ++i) {
      PyObject* x = PyList_GET_ITEM(rec, i);
      if (Py_TYPE(x) != S.ref) {
        continue;
      }
      PyObject* xn = slot(x, S.ref_node);
      if (Py_TYPE(xn) != S.node) {
        throw std::logic_error("a Ref's node is not a genie.graph.Node");
      }
      const int done = PyObject_IsTrue(slot(xn, S.n.executed));
      if (done < 0) {
        throw py::error_already_set();
      }
      if (done == 0) {
        count_consumer(xn);
      }
      PyObject* sts = slot(xn, S.n.storages);
      const Py_ssize_t out = PyLong_AsSsize_t(slot(x, S.ref_out));
      if (out == -1 && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      PyObject* st = genie::per_output(sts, out);
      if (st == nullptr) {
        throw std::logic_error("a Ref's output is not one of its node's storages");
      }
      if (Py_TYPE(st) != S.storage) {
        throw std::logic_error("an input's storage is not a genie.graph.Storage");
      }
      add_reader(st, wref);
    }
    Py_RETURN_TRUE;
  });
}

// --- a compiled graph call, recorded with its entry known ----------------------------------
//
// genie.dynamo's caller of a compiled graph records genie::graph (or genie::graph_mut) with the
// meta-cache entry its first call got: Dynamo's guards fix the inputs' metadata, so no key is
// built over its inputs (parameters are inputs: ~100 at nanoGPT's depth). _graph_entry makes the
// native Entry of that MetaEntry once; _record_graph then records each call as try_record records
// a hit (record_hit: the Refs, the Node, its reads noted, the outputs), the node's fields those
// of lazy_tensor.record_known's (tests/unit/test_compile.py compares the two).

// One lazy input of the last call _record_graph recorded with an entry: the tensor, its instance
// dict and that dict's version, and the _node/_out read from it then (borrowed: while the dict
// has that version it still holds them). A version is unique over the process's dicts and changes
// with every write, so the same tensor with a dict of that version has these _node/_out.
struct LastInput {
  PyObject* tensor = nullptr;
  PyObject* dict = nullptr;
  uint64_t version = 0;
  PyObject* node = nullptr;
  PyObject* out = nullptr;
};

struct GraphEntry {
  std::shared_ptr<Entry> e;
  size_t n_leaves = 0;
  size_t n_lazies = 0;
  std::vector<LastInput> last;  // per lazy input (Pythons whose dicts have a version tag)
};

const char* const kGraphEntry = "genie.graph_entry";

void graph_entry_free(PyObject* capsule) {
  delete static_cast<GraphEntry*>(PyCapsule_GetPointer(capsule, kGraphEntry));
}

// Whether a call may take the native record at all (try_record's conditions, but the op's).
bool record_on() {
  return S.ready && flags.native_record && flags.meta_cache && !flags.record_source &&
         dict_get(S.profiler, names->profiler_enabled) == Py_False &&
         PyList_GET_SIZE(this_thread().graphs) == 0;
}

// _graph_entry(func, args, entry): a capsule of the native Entry of MetaEntry `entry`, which a
// call func(*args) got (args: (key, [written,] tensors, ints), every tensor a LazyTensor), or
// None where this path cannot record such calls (the caller records them in Python).
PyObject* graph_entry(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "_graph_entry(func, args: tuple, entry)");
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    PyObject* func = args[0];
    PyObject* a = args[1];
    PyObject* entry = args[2];
    if (!record_on() || Py_TYPE(entry) != S.meta_entry) {
      Py_RETURN_NONE;
    }
    const OpInfo* info = op_info(func);
    Call call;
    if (info == nullptr || !info->ok || !flatten(a, nullptr, *info, func, call)) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    auto g = std::make_unique<GraphEntry>();
    g->e = make_entry(*info, a, nullptr, call, entry);
    if (g->e->python_only) {
      Py_RETURN_NONE;
    }
    g->n_leaves = call.leaves.size();
    g->n_lazies = call.lazies.size();
    PyObject* cap = checked(PyCapsule_New(g.get(), kGraphEntry, graph_entry_free));
    g.release();
    return cap;
  });
}

// A graph call's leaves and lazy inputs, args = (key, [written,] tensors, ints), as flatten
// finds them for record_hit, without the key's words (the entry is known) or each input's
// TensorMeta and device (Dynamo's guards fix them; the caller vouches): per input only its
// _node/_out and the bounds of its storage. The inputs' objects are prefetched in stages first
// (tensor dicts, nodes, storage lists), so that a call whose ~100 inputs went cold since the
// last one (a decode step's forward, between whole tokens of other work) waits for their cache
// misses together instead of one after another. false: not a call this path takes (the caller
// records it in Python).
bool graph_leaves(PyObject* args, Call& call, GraphEntry& g) {
  call.leaves.reserve(g.n_leaves);
  call.lazies.reserve(g.n_lazies);
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    const bool is_list = PyList_CheckExact(a);
    if (!is_list && !PyTuple_CheckExact(a)) {
      call.leaves.push_back(a);  // the key
      continue;
    }
    PyObject** items = is_list ? reinterpret_cast<PyListObject*>(a)->ob_item
                               : reinterpret_cast<PyTupleObject*>(a)->ob_item;
    const Py_ssize_t k = Py_SIZE(a);
    for (Py_ssize_t j = 0; j < k; ++j) {
      PyObject* x = items[j];
      __builtin_prefetch(x);
      call.leaves.push_back(x);
    }
  }
#if PY_VERSION_HEX < 0x030C0000
  // an input whose dict is unchanged since the last call takes that call's _node/_out (no
  // lookups: its dict's keys stay cold); the others' dict keys are prefetched for the lookups
  if (g.last.size() != g.n_lazies) {
    g.last.assign(g.n_lazies, LastInput{});
  }
  for (PyObject* x : call.leaves) {
    if (Py_TYPE(x) == S.lazy) {
      PyObject** dp = _PyObject_GetDictPtr(x);
      if (dp != nullptr && *dp != nullptr) {
        __builtin_prefetch(*dp);
      }
    }
  }
  c10::SmallVector<char, 128> same;
  for (PyObject* x : call.leaves) {
    if (Py_TYPE(x) != S.lazy) {
      continue;
    }
    const size_t j = same.size();
    PyObject** dp = _PyObject_GetDictPtr(x);
    PyObject* d = dp != nullptr ? *dp : nullptr;
    const LastInput* c = j < g.last.size() ? &g.last[j] : nullptr;
    // (a wrapper whose impl holds its record is read from there, as cheaply: csrc/wrapper.cpp;
    // its dict, if any, does not change when the record does)
    const bool hit = d != nullptr && c != nullptr && c->tensor == x && c->dict == d &&
                     genie::lazy_impl_of(x) == nullptr &&
                     c->version == reinterpret_cast<PyDictObject*>(d)->ma_version_tag;
    same.push_back(hit ? 1 : 0);
    if (!hit && d != nullptr) {
      PyDictKeysObject* keys = reinterpret_cast<PyDictObject*>(d)->ma_keys;
      __builtin_prefetch(keys);
      __builtin_prefetch(reinterpret_cast<char*>(keys) + 64);
    }
  }
#endif
  for (size_t i = 0; i < call.leaves.size(); ++i) {
    PyObject* x = call.leaves[i];
    PyTypeObject* t = Py_TYPE(x);
    if (t == S.lazy) {
      PyObject* node = nullptr;
      PyObject* out = nullptr;
#if PY_VERSION_HEX < 0x030C0000
      const size_t j = call.lazies.size();
      if (j < same.size() && same[j]) {
        node = new_ref(g.last[j].node);
        out = new_ref(g.last[j].out);
      }
#endif
      if (node == nullptr) {
        node = lazy_attr(x, names->node);
        if (node == nullptr) {
          return false;
        }
        out = lazy_attr(x, names->out);
        if (out == nullptr) {
          Py_DECREF(node);
          return false;
        }
#if PY_VERSION_HEX < 0x030C0000
        PyObject** dp = _PyObject_GetDictPtr(x);
        if (j < g.last.size() && dp != nullptr && *dp != nullptr &&
            genie::lazy_impl_of(x) == nullptr) {
          g.last[j] = LastInput{x, *dp, reinterpret_cast<PyDictObject*>(*dp)->ma_version_tag,
                                node, out};
        }
#endif
      }
      call.lazies.push_back(Lazy{x, node, out, 0, nullptr, static_cast<Py_ssize_t>(i)});
      if (Py_TYPE(node) != S.node || !PyLong_CheckExact(out)) {
        return false;
      }
      __builtin_prefetch(reinterpret_cast<char*>(node) + S.n.storages);
      call.lazies.back().out_i = PyLong_AsSsize_t(out);
    } else if (i > 0 && t != &PyLong_Type) {
      return false;  // (leaf 0 is the key)
    }
  }
  for (Lazy& l : call.lazies) {
    PyObject* st = genie::per_output(slot(l.node, S.n.storages), l.out_i);
    if (st == nullptr) {
      return false;
    }
    __builtin_prefetch(st);
    __builtin_prefetch(reinterpret_cast<char*>(st) + S.st_readers);
  }
  for (Lazy& l : call.lazies) {  // the reader lists record_hit appends to
    PyObject* st = genie::per_output(slot(l.node, S.n.storages), l.out_i);
    if (Py_TYPE(st) != S.storage) {
      return false;
    }
    PyObject* readers = slot(st, S.st_readers);
    __builtin_prefetch(readers);
    if (PyList_CheckExact(readers)) {
      __builtin_prefetch(reinterpret_cast<PyListObject*>(readers)->ob_item +
                         PyList_GET_SIZE(readers), 1);
    }
  }
  return true;
}

// _record_graph(capsule, func, args): func(*args) recorded natively with the entry of
// _graph_entry; NotImplemented, nothing recorded, where this path does not take the call (off,
// a capture block, the profiler, an argument not of the kinds and count the entry was made for):
// the caller records it in Python. The caller vouches that args' metadata is the entry's.
PyObject* record_graph(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "_record_graph(entry, func, args: tuple)");
    return nullptr;
  }
  auto* g = static_cast<GraphEntry*>(PyCapsule_GetPointer(args[0], kGraphEntry));
  if (g == nullptr) {
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    PyObject* func = args[1];
    PyObject* a = args[2];
    if (!record_on()) {
      Py_RETURN_NOTIMPLEMENTED;
    }
    const OpInfo* info = op_info(func);
    Call call;
    if (info == nullptr || !info->ok || info->metadata_only ||
        !graph_leaves(a, call, *g) ||
        call.leaves.size() != g->n_leaves || call.lazies.size() != g->n_lazies) {
      PyErr_Clear();
      Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject* r = record_hit(func, *info, a, nullptr, call, *g->e, S.default_graph,
                             flags.gc_untrack, false);
    if (r == nullptr && !PyErr_Occurred()) {
      Py_RETURN_NOTIMPLEMENTED;
    }
    return r;
  });
}

// _make_lazy_wrapper(shape, stride, offset, dtype, index, base): make_wrapper for the Python
// record path (genie.lazy_tensor._wrapper), so that its wrappers are the native path's kind (a
// LazyImpl, key-free where that is on) and both paths' tensors behave alike; None where this build
// makes wrappers through torch._make_wrapper_subclass.
PyObject* make_lazy_wrapper(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t nargs) {
#if GENIE_WRAP_NATIVE
  if (nargs != 6 || !S.ready) {
    PyErr_SetString(PyExc_TypeError, "_make_lazy_wrapper(shape, stride, offset, dtype, index, base)");
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    Out o;
    o.sizes = py::cast<std::vector<int64_t>>(py::handle(argv[0]));
    o.strides = py::cast<std::vector<int64_t>>(py::handle(argv[1]));
    o.offset = py::cast<int64_t>(py::handle(argv[2]));
    if (o.sizes.size() != o.strides.size() || o.offset < 0 ||
        std::any_of(o.sizes.begin(), o.sizes.end(), [](int64_t d) { return d < 0; })) {
      throw py::value_error("_make_lazy_wrapper: as many strides as sizes, sizes and the offset "
                            "not negative");
    }
    if (!THPDtype_Check(argv[3])) {
      throw py::type_error("_make_lazy_wrapper: dtype must be a torch.dtype");
    }
    o.dtype = reinterpret_cast<THPDtype*>(argv[3])->scalar_type;
    o.index = static_cast<c10::DeviceIndex>(py::cast<int64_t>(py::handle(argv[4])));
    o.nbytes = at::detail::computeStorageNbytes(o.sizes, o.strides, c10::elementSize(o.dtype),
                                                static_cast<size_t>(o.offset));
    return make_wrapper(o, argv[5] == Py_None ? nullptr : argv[5]);
  });
#else
  Py_RETURN_NONE;
#endif
}

PyMethodDef methods[] = {
    {"_make_lazy_wrapper",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(make_lazy_wrapper)), METH_FASTCALL,
     "A data-less LazyTensor as the native record path makes its outputs (csrc/record.cpp "
     "make_wrapper): (shape, stride, offset, dtype, index, base) -> LazyTensor; None where "
     "this build makes wrappers through torch.Tensor._make_wrapper_subclass."},
    {"_record_dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(record_dispatch)),
     METH_FASTCALL | METH_KEYWORDS,
     "LazyTensor.__torch_dispatch__ (as a staticmethod): records the common case natively and "
     "calls genie.lazy_tensor._dispatch for every other call."},
    {"_find_torch_dispatch_rule",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(find_dispatch_rule)), METH_FASTCALL,
     "torch._library.simple_registry.find_torch_dispatch_rule(op, cls), natively (the same "
     "lookups in the registry dict given to _set_dispatch_rule_data)."},
    {"_ctx_push", ctx_push, METH_O,
     "genie.context._module_call's inline path natively: push `module`'s context inside a "
     "module call and return the stack entry, or None where the Python code decides."},
    {"_ctx_pop", ctx_pop, METH_O,
     "Pop the entry _ctx_push returned, if it is still on top, restoring the outer context."},
    {"_module_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(module_call_new)),
     METH_FASTCALL,
     "_module_call(orig, slow): the object genie.context installs as nn.Module.__call__ (calls "
     "that never touch the device go straight to orig, natively; see csrc/record.cpp)."},
    {"_record_factory",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(record_factory)), METH_FASTCALL,
     "_record_factory(func, args, kwargs): a factory call recorded natively where the common case "
     "allows, else by genie.lazy_tensor.record_factory (the PrivateUse1 factory kernels' body)."},
    {"_graph_refs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(graph_refs)),
     METH_FASTCALL,
     "_graph_refs(rec, *sequences): append Ref(t._node, t._out) for each t, in order, to list "
     "rec (a compiled graph call's recorded inputs); False, nothing appended, where the native "
     "record path is off."},
    {"_note_reads", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(note_reads)),
     METH_FASTCALL,
     "_note_reads(rec, wref): record_known's note of each Ref in rec as a read by wref's node "
     "(consumers, storage readers); False, nothing noted, where the native record path is off."},
    {"_graph_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(graph_entry)),
     METH_FASTCALL,
     "_graph_entry(func, args, entry): the native entry (a capsule) of a compiled graph call's "
     "MetaEntry, for _record_graph; None where the native record path cannot take such calls."},
    {"_record_graph", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(record_graph)),
     METH_FASTCALL,
     "_record_graph(entry, func, args): a compiled graph call recorded natively with its known "
     "entry (as lazy_tensor.record_known); NotImplemented, nothing recorded, where it declines."},
    {"_set_dispatch_rule_data", set_rule_data, METH_O,
     "The dict of torch._library.simple_registry.singleton that _find_torch_dispatch_rule reads."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject* type_of(const py::dict& objs, const char* name) {
  PyObject* t = objs[name].ptr();
  if (!PyType_Check(t)) {
    throw std::runtime_error(std::string(name) + " is not a class");
  }
  Py_INCREF(t);
  return reinterpret_cast<PyTypeObject*>(t);
}

PyObject* object_of(const py::dict& objs, const char* name) {
  return py::object(objs[name]).release().ptr();
}

// _record_init: the Python objects this path works with. Returns whether the path is on.
bool record_init(const py::dict& objs) {
  if (names == nullptr) {
    names = new Names();
  }
  State s;
  s.lazy = type_of(objs, "LazyTensor");
  s.node = type_of(objs, "Node");
  s.ref = type_of(objs, "Ref");
  s.storage = type_of(objs, "Storage");
  s.meta_arg = type_of(objs, "MetaArg");
  s.tensor_meta = type_of(objs, "TensorMeta");
  s.meta_entry = type_of(objs, "MetaEntry");
  s.graph_type = type_of(objs, "Graph");
  s.fallback = object_of(objs, "fallback");
  s.entry_for = objs.contains("entry_for") ? object_of(objs, "entry_for") : nullptr;
  s.counts = object_of(objs, "counts");
  s.profiler = object_of(objs, "profiler");
  s.tls = object_of(objs, "tls");
  s.current = object_of(objs, "current");
  s.default_graph = object_of(objs, "default_graph");
  s.graph_dict = checked(PyObject_GenericGetDict(s.default_graph, nullptr));
  if (PyDict_GetItemString(s.graph_dict, "keep_nodes") != Py_False) {
    throw std::runtime_error("the default graph keeps its nodes");
  }
  s.counter = object_of(objs, "counter");
  s.leaf_spec = object_of(objs, "leaf_spec");
  s.copy_ops = object_of(objs, "copy_ops");
  s.detach = objs.contains("detach") ? object_of(objs, "detach") : nullptr;
  s.device_ops = objs.contains("device_ops") ? object_of(objs, "device_ops") : nullptr;
  s.pending_total = object_of(objs, "pending_total");
  s.retrack_below = object_of(objs, "retrack_below");
  s.defer_writer = object_of(objs, "defer_writer");
  if (objs.contains("factory_fallback") && objs.contains("context")) {
    s.factory_fallback = object_of(objs, "factory_fallback");
    s.context_dict = checked(PyObject_GenericGetDict(objs["context"].ptr(), nullptr));
  }
  if (!PyList_CheckExact(s.pending_total) || PyList_GET_SIZE(s.pending_total) != 1) {
    throw std::runtime_error("pending_total must be a one-item list");
  }
  s.limit = objs["limit"].cast<size_t>();
  if (!PyDict_Check(s.counts) || !PyDict_Check(s.profiler)) {
    throw std::runtime_error("counts and profiler must be dicts");
  }
  if (!genie::is_node_type(s.node)) {  // genie._C.Node's fields, and none of the class's own
    throw std::runtime_error(std::string(s.node->tp_name) +
                             " has other slots than the native record path writes");
  }
  check_slots(s.ref, {"node", "out"});
  check_slots(s.storage, {"pending_writes", "readers", "_prune_at", "role"});
  check_slots(s.meta_arg, {"meta"});
  check_slots(s.tensor_meta, {"shape", "stride", "offset", "dtype", "index", "conj", "neg"});
  check_slots(s.meta_entry, {"metas", "out_spec", "consts", "plan", "spec", "klass", "state"});
  NodeSlots& n = s.n;
  PyTypeObject* t = s.node;
  n.op = slot_offset(t, "op");
  n.spec = slot_offset(t, "spec");
  n.metas = slot_offset(t, "metas");
  n.out_spec = slot_offset(t, "out_spec");
  n.storages = slot_offset(t, "_st");
  n.writes = slot_offset(t, "writes");
  n.outputs = slot_offset(t, "_out");
  n.values = slot_offset(t, "values");
  n.executed = slot_offset(t, "executed");
  n.index = slot_offset(t, "index");
  n.rng = slot_offset(t, "rng");
  n.graph = slot_offset(t, "graph");
  n.seq = slot_offset(t, "_seq");
  n.where = slot_offset(t, "where");
  n.consumers = slot_offset(t, "n_consumers");
  n.tags = slot_offset(t, "tags");
  n.entry = slot_offset(t, "entry");
  n.ctx = slot_offset(t, "ctx");
  n.wref = slot_offset(t, "_wref");
  s.ref_node = slot_offset(s.ref, "node");
  s.ref_out = slot_offset(s.ref, "out");
  s.st_pending = slot_offset(s.storage, "pending_writes");
  s.st_readers = slot_offset(s.storage, "readers");
  s.st_prune = slot_offset(s.storage, "_prune_at");
  s.st_role = slot_offset(s.storage, "role");
  s.tm_shape = slot_offset(s.tensor_meta, "shape");
  s.tm_stride = slot_offset(s.tensor_meta, "stride");
  s.tm_offset = slot_offset(s.tensor_meta, "offset");
  s.tm_dtype = slot_offset(s.tensor_meta, "dtype");
  s.tm_index = slot_offset(s.tensor_meta, "index");
  s.tm_conj = slot_offset(s.tensor_meta, "conj");
  s.tm_neg = slot_offset(s.tensor_meta, "neg");
  s.me_metas = slot_offset(s.meta_entry, "metas");
  s.me_out_spec = slot_offset(s.meta_entry, "out_spec");
  s.me_consts = slot_offset(s.meta_entry, "consts");
  s.me_plan = slot_offset(s.meta_entry, "plan");
  s.me_spec = slot_offset(s.meta_entry, "spec");
  s.me_klass = slot_offset(s.meta_entry, "klass");
  s.me_state = slot_offset(s.meta_entry, "state");
  s.ma_meta = slot_offset(s.meta_arg, "meta");
  if (objs.contains("rules") && objs.contains("meta_cache_dict")) {
    s.rules = object_of(objs, "rules");
    s.meta_cache_dict = object_of(objs, "meta_cache_dict");
    if (!PyDict_CheckExact(s.rules) || !PyDict_CheckExact(s.meta_cache_dict)) {
      throw std::runtime_error("rules and meta_cache_dict must be dicts");
    }
    if (objs.contains("kw_rules")) {
      s.kw_rules = object_of(objs, "kw_rules");
      if (!PyDict_CheckExact(s.kw_rules)) {
        throw std::runtime_error("kw_rules must be a dict");
      }
    }
  }
  s.ready = true;
  clear_entries();
  S = s;  // the previous objects (a re-init) stay referenced: init runs once per import
  return true;
}

void record_config(const py::object& config) {
  flags.native_record = config.attr("native_record").cast<bool>();
  flags.meta_cache = config.attr("meta_cache").cast<bool>();
  flags.record_source = config.attr("record_source").cast<bool>();
  flags.gc_untrack = config.attr("gc_untrack").cast<bool>();
  flags.gc_defer_writes = config.attr("gc_defer_writes").cast<bool>();
  flags.native_record_miss = config.attr("native_record_miss").cast<bool>();
  flags.stack_record = config.attr("stack_record").cast<bool>();
  flags.stack_record_check = config.attr("stack_record_check").cast<bool>();
  flags.generic_meta = config.attr("generic_meta").cast<bool>() &&
                       config.attr("shape_rules").cast<bool>();
}

void record_clear() {
  clear_entries();
}

py::dict record_stats() {
  py::dict d;
  for (int i = 0; i < kReasons; ++i) {
    d[kReasonNames[i]] = reasons[i];
  }
  d["entries"] = entries.n;
  d["generic_classes"] = generics.n;
  d["generic_made"] = n_generic_made;
  return d;
}

void record_reset_stats() {
  reasons.fill(0);
}

} // namespace

namespace genie {

void record_ahead_restart() {
  record_ahead_reset();
}

PyObject* record_call(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (!S.ready) {
    PyErr_SetString(PyExc_RuntimeError, "genie's native record path is not initialized");
    return nullptr;
  }
  return native_or_fallback(try_record, S.fallback, func, args, kwargs);
}

PyObject* const kStackDeclined = ::kStackDeclined;

PyObject* record_stack(PyObject* func, const c10::IValue* values, size_t positional,
                       const size_t* kw, size_t n_kw, PyObject* const* kw_names,
                       const uint8_t* kinds, PyObject* check_args, PyObject* check_kwargs) {
  PyObject* r = guarded([&] {
    return try_record_stack(func, values, positional, kw, n_kw, kw_names, kinds, check_args,
                            check_kwargs);
  });
  if (r == kStackDeclined) {
    n_stack_declined++;
    if (flags.stack_record_check) {
      stack_declines[{func, stack_why}]++;
    }
    return r;
  }
  n_stack++;
  return after_record(r);
}

void stack_record_declined(PyObject* func, const char* why) {
  n_stack_declined++;
  if (flags.stack_record_check) {
    stack_declines[{func, why}]++;
  }
}

bool stack_record_on() {
  return S.ready && flags.stack_record;
}

bool stack_record_check() {
  return flags.stack_record_check;
}

PyObject* record_factory_call(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (S.factory_fallback == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "genie's native record path is not initialized");
    return nullptr;
  }
  return native_or_fallback(try_record_factory, S.factory_fallback, func, args, kwargs);
}

PyTypeObject* lazy_type() {
  return S.ready ? S.lazy : nullptr;
}

PyObject* detach_op() {
  return S.ready ? S.detach : nullptr;
}

int dispatch_rule_may_apply(PyObject* func, PyObject* qualname) {
  if (rule_data == nullptr) {
    return 1;  // torch's own lookup is in place: only torch's path applies it
  }
  // The registry holds an entry for a few ops (~120 in torch 2.13): only those need the lookup.
  PyObject* entry = PyDict_GetItemWithError(rule_data, qualname);
  if (entry == nullptr) {
    return PyErr_Occurred() ? -1 : 0;
  }
  PyObject* argv[2] = {func, reinterpret_cast<PyObject*>(S.lazy)};
  PyObject* r = find_dispatch_rule(nullptr, argv, 2);
  if (r == nullptr) {
    return -1;
  }
  const int found = r != Py_None;
  Py_DECREF(r);
  return found;
}

void add_record_functions(py::module_& m) {
  if (PyModule_AddFunctions(m.ptr(), methods) < 0) {
    throw py::error_already_set();
  }
  m.def("_record_init", &record_init, py::arg("objects"),
        "Give the native record path the Python objects it works with (genie.lazy_tensor calls "
        "it once); returns whether the path is available in this build.");
  m.def("_context_init", &context_init, py::arg("objects"),
        "Give _ctx_push/_ctx_pop genie.context's thread-local stack and classes; returns whether "
        "they work (the native record path is initialized).");
  m.def("_record_config", &record_config, py::arg("config"),
        "Mirror genie.config.config's native_record, native_record_miss, meta_cache, "
        "record_source, gc_untrack and gc_defer_writes "
        "(genie.config calls it on every change).");
  m.def("_record_sync_counts", &record_sync_counts,
        "Add the ops recorded natively since the last call to genie.stats' ops_recorded and "
        "meta_cache_hits (genie.stats.sync calls it).");
  m.def("_record_clear", &record_clear,
        "Forget every learned meta-cache entry (genie.meta.MetaCache calls it when it clears).");
  m.def("_record_stats", &record_stats,
        "Calls by outcome: handled natively, learned, and each reason for taking the Python "
        "path; and the number of learned entries.");
  m.def("_record_reset_stats", &record_reset_stats, "Zero the counts of _record_stats.");
  m.def("_record_ahead", &record_ahead, py::arg("every"), py::arg("callback"),
        "Call `callback(result)` with every `every`-th result recorded (0: never): "
        "genie.backends.remote sends what it depends on to the server ahead.");
  m.def("_record_ahead_reset", &record_ahead_reset,
        "Start _record_ahead's count again (the program read a value).");
  m.def("_stack_record_stats", []() { return py::make_tuple(n_stack, n_stack_declined); },
        "(calls the Python-key kernel recorded from the IValue stack, calls it declined to the "
        "Python arguments' path): csrc/record.cpp's record_stack.");
  m.def("_stack_record_declines", []() {
    py::list r;
    for (const auto& [k, n] : stack_declines) {
      r.append(py::make_tuple(py::handle(k.first), k.second, n));
    }
    return r;
  }, "[(op, why, calls)]: the calls record_stack declined while stack_record_check was on.");
  m.attr("_record_native") = true;
  m.attr("_record_wrap") = GENIE_WRAP_NATIVE ? "native" : "python";
}

} // namespace genie
