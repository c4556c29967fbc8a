// genie._C._read: the steady embedded read (genie.executor.run_targets) in one native call, from
// the pending targets to the bound values, for the common case: the step's extra targets
// (genie.executor.with_step), the plan-cache lookup by the requested ops (PlanCache.span,
// _target_key, writes_last, PlanCache.match: the column match, genie::match_core), the hit's
// parameters (plan_cache.params where no host tensor is a parameter and the floats that changed
// are the previous step's), the fused run and bind (genie.executor._run_hit, genie::hit_run) and
// the counters and memory accounting they update. The Python code these replace stays the
// reference, and the general path for everything else: the call hands back where the Python
// code goes on (see the Return below); nothing it did is done again there.
//
// Taken only where genie.executor._fusing() holds and no profiler runs (checked by the caller).
//
// Return:
// * a list: the values of the first `n` targets (the fused hit ran and bound);
// * (0, targets, span, key): no column-match hit (key None: the cache is off): the caller goes on
//   with plan_cache.plan(targets, ..., known=(span, key)), which skips what ran here;
// * (1, targets, found): a hit (found = (plan, match, generic, params), counted as
//   plan_cache.plan counts it) this call does not run fused: genie.executor._run_hit runs it;
// * (2, targets, found, out): the fused run failed (out: hit_run's (instruction, exception,
//   live values)): genie.executor._hit_failed binds what ran and raises at the reading line.
//
// Node fields are read by name (no slot offsets): the node type may change under this file.
#include <Python.h>

#include <cstdint>

#include <pybind11/pybind11.h>

#include <ATen/ops/_local_scalar_dense.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/autograd/python_variable.h>

#include "bind.h"
#include "match.h"
#include "read.h"
#include "wrapper.h"
#include "record.h"
#include "replay.h"
#include "slice.h"
#include "state.h"

namespace py = pybind11;

namespace {

// the modules genie.executor hands over once (_READ_CTX), by position; what they hold is read by
// name at every call (tests and settings replace some of those objects)
enum Ctx : Py_ssize_t {
  kPlanCache,  // genie.plan_cache: _cache, _enabled, _generic, params, _entryless_at
  kStats,      // genie.stats: _counts
  kGraph,      // genie.graph: pending_total
  kContext,    // genie.context: _steps (thread-local)
  kConfig,     // genie.config.config
  kPipeline,   // genie.passes.pipeline: _config
  kMemory,     // genie.memory: _tracking, _cpu, _seen, _peak
  kDevice,     // genie.device: _real_devices
  kBackends,   // genie.backends: _registry
  kExecutor,   // genie.executor: _PRUNE_AT
  kPartial,    // functools.partial
  kChecks,     // genie.checks: DOF_PENDING (the .item() path)
  kModes,      // genie.modes: _pre_state, _pre_slots (the .item() path)
  kCtxSize
};

PyObject* intern(const char* s) { return PyUnicode_InternFromString(s); }

struct Names {
  PyObject* index = intern("index");
  PyObject* op = intern("op");
  PyObject* name = intern("_name");
  PyObject* cache = intern("_cache");
  PyObject* enabled = intern("_enabled");
  PyObject* generic = intern("_generic");
  PyObject* by_targets = intern("_by_targets");
  PyObject* writes = intern("_writes");
  PyObject* last = intern("_last");
  PyObject* buckets = intern("_buckets");
  PyObject* span = intern("span");
  PyObject* prefix = intern("prefix");
  PyObject* uses = intern("uses");
  PyObject* fast = intern("fast");
  PyObject* outputs = intern("outputs");
  PyObject* flat = intern("flat");
  PyObject* entries = intern("entries");
  PyObject* klasses = intern("klasses");
  PyObject* no_where = intern("no_where");
  PyObject* wheres = intern("wheres");
  PyObject* produced = intern("produced");
  PyObject* inputs = intern("inputs");
  PyObject* changed = intern("changed");
  PyObject* artifacts = intern("artifacts");
  PyObject* passes = intern("passes");
  PyObject* gen = intern("gen");
  PyObject* final_ = intern("final");
  PyObject* program = intern("program");
  PyObject* native = intern("native");
  PyObject* freed = intern("freed");
  PyObject* states = intern("states");
  PyObject* high_water = intern("high_water");
  PyObject* waiting = intern("waiting");
  PyObject* consts = intern("consts");
  PyObject* tmpl = intern("tmpl");
  PyObject* at = intern("at");
  PyObject* rngs = intern("rngs");
  PyObject* fused = intern("fused");
  PyObject* fused_generic = intern("fused_generic");
  PyObject* pending = intern("pending");
  PyObject* shape_generic = intern("shape_generic");
  PyObject* eager = intern("eager");
  PyObject* native_match = intern("native_match");
  PyObject* native_slice = intern("native_slice");
  PyObject* gc_untrack = intern("gc_untrack");
  PyObject* move_to_end = intern("move_to_end");
  // module attributes
  PyObject* m_counts = intern("_counts");
  PyObject* m_pending_total = intern("pending_total");
  PyObject* m_steps = intern("_steps");
  PyObject* m_config = intern("_config");
  PyObject* m_tracking = intern("_tracking");
  PyObject* m_cpu = intern("_cpu");
  PyObject* m_seen = intern("_seen");
  PyObject* m_peak = intern("_peak");
  PyObject* m_real_devices = intern("_real_devices");
  PyObject* m_registry = intern("_registry");
  PyObject* m_prune_at = intern("_PRUNE_AT");
  PyObject* m_params = intern("params");
  PyObject* m_entryless = intern("_entryless_at");
  // the .item() and .cpu() paths (read_op_steady)
  PyObject* m_remote_served = intern("remote_served");
  PyObject* m_before_plan = intern("before_plan");
  PyObject* m_order = intern("_order");
  PyObject* m_fuse = intern("_fuse");
  PyObject* m_read_native = intern("_read_native");
  PyObject* m_read_on = intern("_read_on");
  PyObject* m_dof_pending = intern("DOF_PENDING");
  PyObject* m_pre_state = intern("_pre_state");
  PyObject* m_pre_slots = intern("_pre_slots");
  PyObject* m_item_of = intern("_item_of");
  PyObject* schema_check_mode = intern("_schema_check_mode");
  PyObject* node_ = intern("_node");
  PyObject* out_ = intern("_out");
  PyObject* executed = intern("executed");
  PyObject* metas = intern("metas");
  PyObject* eager_str = intern("eager");
  PyObject* device_ = intern("device");
  PyObject* counts[12] = {
      intern("plan_cache_hits"), intern("plan_cache_generic_hits"), intern("passes_waiting"),
      intern("native_replays"), intern("fused_hits"), intern("values_freed"),
      intern("nodes_executed"), intern("step_tapes"), intern("materializations"),
      intern("materializations.item"), intern("forced_materializations"),
      intern("materializations.cpu")};
};

const Names& names() {
  static const Names* n = new Names();  // never freed (interned strings)
  return *n;
}

py::object attr(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_GetAttr(o, name);
  if (r == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(r);
}

bool truth(PyObject* o) {
  const int t = PyObject_IsTrue(o);
  if (t < 0) {
    throw py::error_already_set();
  }
  return t != 0;
}

int64_t as_int(PyObject* o) {
  const int64_t v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return v;
}

// The counters this file moves, kept here and added to genie.stats._counts when they are read
// (read_sync_counts, one of genie.stats._syncs): a dict update per counter and read cost ~500
// instructions each, five or more per read. Names::counts, in this order.
enum Count : int {
  cHits,       // plan_cache_hits
  cGeneric,    // plan_cache_generic_hits
  cWaiting,    // passes_waiting
  cReplays,    // native_replays
  cFused,      // fused_hits
  cFreed,      // values_freed
  cExecuted,   // nodes_executed
  cStep,       // step_tapes
  cMat,        // materializations
  cMatItem,    // materializations.item
  cForced,     // forced_materializations
  cMatCpu,     // materializations.cpu
  kCounts
};
int64_t counted[kCounts] = {};

// counts[name] += n (genie.stats.bump), for a count this file keeps
inline void bump(Count c, int64_t n = 1) {
  counted[c] += n;
}

// a module's attribute, from its dict (what getattr finds there, for ~50 instructions instead
// of ~200: the module type's lookup first); any other object's, or a name the dict lacks (the
// error getattr raises), through getattr
py::object mattr(PyObject* m, PyObject* name) {
  if (PyModule_CheckExact(m)) {
    PyObject* v = PyDict_GetItemWithError(PyModule_GetDict(m), name);  // borrowed
    if (v != nullptr) {
      return py::reinterpret_borrow<py::object>(v);
    }
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
  }
  return attr(m, name);
}

// plan_cache.PlanCache.span
int64_t span_of(PyObject* cache, const py::list& targets) {
  const Names& s = names();
  int64_t top = -1;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(targets.ptr()); ++i) {
    PyObject* t = PyList_GET_ITEM(targets.ptr(), i);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
      throw py::type_error("genie._C._read: targets must be (node, output) pairs");
    }
    const int64_t k = as_int(attr(PyTuple_GET_ITEM(t, 0), s.index).ptr());
    if (i == 0 || k > top) {
      top = k;
    }
  }
  const int64_t last = as_int(attr(cache, s.last).ptr());
  py::object nt = py::reinterpret_steal<py::object>(PyLong_FromLongLong(top));
  if (PyObject_SetAttr(cache, s.last, nt.ptr()) < 0) {
    throw py::error_already_set();
  }
  return last >= 0 ? top - last : -1;
}

// plan_cache._target_key
py::tuple target_key(const py::list& targets) {
  const Names& s = names();
  const Py_ssize_t n = PyList_GET_SIZE(targets.ptr());
  py::tuple key(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(targets.ptr(), i);
    py::object op = attr(PyTuple_GET_ITEM(t, 0), s.op);
    PyObject* nm = PyObject_GetAttr(op.ptr(), s.name);
    if (nm == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
        throw py::error_already_set();
      }
      PyErr_Clear();
      nm = op.release().ptr();
    }
    PyObject* out = PyTuple_GET_ITEM(t, 1);
    Py_INCREF(out);
    PyObject* pair = PyTuple_Pack(2, nm, out);
    Py_DECREF(nm);
    Py_DECREF(out);
    if (pair == nullptr) {
      throw py::error_already_set();
    }
    PyTuple_SET_ITEM(key.ptr(), i, pair);
  }
  return key;
}

// plan_cache._core's native branch
py::object core(PyObject* plan, const py::list& targets, bool generic, bool pending,
                PyObject* partial, PyObject* entryless) {
  const Names& s = names();
  py::object want_out = attr(plan, s.outputs);
  if (!truth(attr(plan, s.fast).ptr()) || !PyList_Check(want_out.ptr()) ||
      PyList_GET_SIZE(want_out.ptr()) != PyList_GET_SIZE(targets.ptr())) {
    return py::none();
  }
  py::object wheres = truth(attr(plan, s.no_where).ptr()) ? py::none() : attr(plan, s.wheres);
  py::object cb = py::reinterpret_steal<py::object>(PyObject_CallFunctionObjArgs(
      partial, entryless, plan, generic ? Py_True : Py_False, nullptr));
  if (!cb) {
    throw py::error_already_set();
  }
  return genie::match_core(attr(plan, s.flat), attr(plan, s.entries), attr(plan, s.klasses),
                           wheres, attr(plan, s.produced), want_out, targets, generic, pending,
                           attr(plan, s.inputs), cb);
}

// plan_cache.params: natively where it is a lookup (no host tensor parameters; the floats that
// changed none, or those of the step before); else the Python function
py::object params(PyObject* plan, bool generic, const py::object& r, PyObject* py_params,
                  bool native_slice) {
  const Names& s = names();
  PyObject* shaped = PyTuple_GET_ITEM(r.ptr(), 1);
  PyObject* changed = PyTuple_GET_ITEM(r.ptr(), 2);
  PyObject* inputs = PyTuple_GET_ITEM(r.ptr(), 4);
  py::object flat = attr(plan, s.flat);
  PyObject* hosts = PyTuple_GET_ITEM(flat.ptr(), 8);
  const bool has_hosts = truth(PyTuple_GET_ITEM(hosts, 0));
  const bool has_shaped = truth(shaped);
  const bool has_changed = truth(changed);
  py::object plain;
  if (!has_hosts && !has_changed) {
    plain = py::list();
  } else if (!has_hosts && !has_shaped) {
    py::object prev = attr(plan, s.changed);  // (changed, plain) of the step before
    const int eq = PyObject_RichCompareBool(changed, PyTuple_GET_ITEM(prev.ptr(), 0), Py_EQ);
    if (eq < 0) {
      throw py::error_already_set();
    }
    if (eq) {
      plain = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(prev.ptr(), 1));
    }
  }
  if (!plain) {
    return py::reinterpret_steal<py::object>(PyObject_CallFunctionObjArgs(
        py_params, plan, generic ? Py_True : Py_False, r.ptr(), nullptr));
  }
  bool differs = has_shaped;
  if (generic && !differs) {
    py::object d = native_slice ? genie::inputs_differ(py::reinterpret_borrow<py::dict>(inputs),
                                                       attr(plan, s.inputs))
                                : py::reinterpret_borrow<py::object>(Py_NotImplemented);
    if (d.ptr() == Py_NotImplemented) {
      return py::reinterpret_steal<py::object>(PyObject_CallFunctionObjArgs(
          py_params, plan, generic ? Py_True : Py_False, r.ptr(), nullptr));
    }
    differs = truth(d.ptr());
  }
  return py::make_tuple(plain, py::bool_(differs));
}

// PlanCache.match's bookkeeping of a hit: plan.span, most recently used first, the bucket's LRU
// place, plan.uses
void note_match(PyObject* cache, PyObject* plans, PyObject* plan, int64_t span) {
  const Names& s = names();
  py::object sp = py::reinterpret_steal<py::object>(PyLong_FromLongLong(span));
  if (PyObject_SetAttr(plan, s.span, sp.ptr()) < 0) {
    throw py::error_already_set();
  }
  if (PyList_GET_ITEM(plans, 0) != plan) {
    const Py_ssize_t n = PyList_GET_SIZE(plans);
    Py_ssize_t k = 0;
    while (k < n && PyList_GET_ITEM(plans, k) != plan) {
      ++k;
    }
    if (k < n) {
      py::object p = py::reinterpret_borrow<py::object>(plan);
      if (PySequence_DelItem(plans, k) < 0 || PyList_Insert(plans, 0, plan) < 0) {
        throw py::error_already_set();
      }
    }
  }
  py::object buckets = attr(cache, s.buckets);
  py::object prefix = attr(plan, s.prefix);
  const int has = PyDict_Contains(buckets.ptr(), prefix.ptr());  // (an OrderedDict)
  if (has < 0) {
    throw py::error_already_set();
  }
  if (has) {
    py::object r = py::reinterpret_steal<py::object>(
        PyObject_CallMethodOneArg(buckets.ptr(), s.move_to_end, prefix.ptr()));
    if (!r) {
      throw py::error_already_set();
    }
  }
  py::object uses = attr(plan, s.uses);
  py::object nu = py::reinterpret_steal<py::object>(PyLong_FromLongLong(as_int(uses.ptr()) + 1));
  if (PyObject_SetAttr(plan, s.uses, nu.ptr()) < 0) {
    throw py::error_already_set();
  }
}

// genie.executor._fused's cached answer for this hit, when it is still valid; else None (the
// Python path makes it)
py::object fused_of(PyObject* plan, bool generic, PyObject* pipeline_config) {
  const Names& s = names();
  py::object arts = attr(plan, s.artifacts);
  if (!PyDict_Check(arts.ptr())) {
    return py::none();
  }
  PyObject* f = PyDict_GetItemWithError(arts.ptr(), generic ? s.fused_generic : s.fused);
  if (f == nullptr) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return py::none();
  }
  py::object fo = py::reinterpret_borrow<py::object>(f);
  PyObject* passes = PyDict_GetItemWithError(arts.ptr(), s.passes);
  if (passes == nullptr && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  if (attr(f, s.passes).ptr() != (passes == nullptr ? Py_None : passes)) {
    return py::none();
  }
  PyObject* gen = PyDict_GetItemWithError(pipeline_config, s.gen);
  if (gen == nullptr) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return py::none();
  }
  const int eq = PyObject_RichCompareBool(attr(f, s.gen).ptr(), gen, Py_EQ);
  if (eq < 0) {
    throw py::error_already_set();
  }
  if (!eq || !truth(attr(f, s.final_).ptr())) {
    return py::none();
  }
  return fo;
}

py::tuple carry_on(int kind, const py::list& targets, const py::object& a,
                   const py::object& b = py::object()) {
  if (b) {
    return py::make_tuple(kind, targets, a, b);
  }
  return py::make_tuple(kind, targets, a);
}

py::object read_steady(py::list targets, int64_t n, int64_t index, const py::tuple& ctx) {
  const Names& s = names();
  if (PyTuple_GET_SIZE(ctx.ptr()) != kCtxSize) {
    throw py::type_error("genie._C._read: the context must be genie.executor._READ_CTX");
  }
  auto C = [&](Ctx k) { return PyTuple_GET_ITEM(ctx.ptr(), k); };
  auto M = [&](Ctx k, PyObject* name) { return mattr(C(k), name); };
  auto first = [](const py::object& l) {  // a one-item list's item (genie's mutable flags)
    if (!PyList_Check(l.ptr()) || PyList_GET_SIZE(l.ptr()) < 1) {
      throw py::type_error("genie._C._read: a flag list is not a list of one");
    }
    return PyList_GET_ITEM(l.ptr(), 0);
  };
  py::object steps = M(kContext, s.m_steps);

  // with_step: the steps this thread recorded since the last trigger (context.take_steps)
  py::object pending = attr(steps.ptr(), s.pending);
  if (truth(pending.ptr())) {
    py::list fresh;
    if (PyObject_SetAttr(steps.ptr(), s.pending, fresh.ptr()) < 0) {
      throw py::error_already_set();
    }
    py::list opts;
    py::object it = py::reinterpret_steal<py::object>(PyObject_GetIter(pending.ptr()));
    if (!it) {
      throw py::error_already_set();
    }
    while (PyObject* ref = PyIter_Next(it.ptr())) {
      py::object r = py::reinterpret_steal<py::object>(ref);
      py::object o = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(ref));
      if (!o) {
        throw py::error_already_set();
      }
      if (!o.is_none()) {
        opts.append(o);
      }
    }
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    const Py_ssize_t before = PyList_GET_SIZE(targets.ptr());
    targets = genie::step_targets(targets, opts, index);
    if (PyList_GET_SIZE(targets.ptr()) > before) {
      bump(cStep);
    }
  }

  // plan_cache.plan's lookup by the requested ops
  PyObject* pc = C(kPlanCache);
  py::object cache = mattr(pc, s.cache);
  const int64_t span = span_of(cache.ptr(), targets);
  const bool enabled = truth(mattr(pc, s.enabled).ptr());
  if (!enabled) {
    return carry_on(0, targets, py::make_tuple(span, py::none()));
  }
  py::tuple key = target_key(targets);
  auto miss = [&] { return carry_on(0, targets, py::make_tuple(span, key)); };
  py::object writes = attr(cache.ptr(), s.writes);
  if (truth(writes.ptr())) {
    const int in = PySequence_Contains(writes.ptr(), key.ptr());
    if (in < 0) {
      throw py::error_already_set();
    }
    if (in) {
      return miss();
    }
  }
  py::object by_targets = attr(cache.ptr(), s.by_targets);
  PyObject* plans = PyDict_GetItemWithError(by_targets.ptr(), key.ptr());
  if (plans == nullptr) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return miss();
  }
  py::object plans_ref = py::reinterpret_borrow<py::object>(plans);
  if (!PyList_Check(plans) || PyList_GET_SIZE(plans) == 0) {
    return miss();
  }
  PyObject* config = C(kConfig);
  if (!truth(attr(config, s.native_match).ptr())) {
    return carry_on(0, targets, py::make_tuple(span, key, false));  // (the Python match)
  }
  // backends.shape_generic() under _fusing (the eager backend first)
  py::object registry = M(kBackends, s.m_registry);
  if (!PyDict_Check(registry.ptr())) {
    throw py::type_error("genie._C._read: genie.backends._registry is not a dict");
  }
  py::object eager =
      py::reinterpret_borrow<py::object>(PyDict_GetItemWithError(registry.ptr(), s.eager));
  if (!eager) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    throw py::key_error("genie._C._read: no eager backend registered");
  }
  PyObject* sg = PyObject_GetAttr(eager.ptr(), s.shape_generic);
  bool generic = false;
  if (sg == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
      throw py::error_already_set();
    }
    PyErr_Clear();
  } else {
    generic = truth(sg);
    Py_DECREF(sg);
  }
  generic = generic && truth(mattr(pc, s.generic).ptr());
  py::object pt = M(kGraph, s.m_pending_total);
  const bool pend = truth(first(pt));

  // PlanCache.match: those last used at this span first, then most recently used first
  py::list order = py::reinterpret_borrow<py::list>(plans);
  const Py_ssize_t np = PyList_GET_SIZE(plans);
  if (np > 1 && span >= 0 && as_int(attr(PyList_GET_ITEM(plans, 0), s.span).ptr()) != span) {
    py::list front, rest;
    for (Py_ssize_t i = 0; i < np; ++i) {
      PyObject* q = PyList_GET_ITEM(plans, i);
      (as_int(attr(q, s.span).ptr()) == span ? front : rest)
          .append(py::reinterpret_borrow<py::object>(q));
    }
    for (const py::handle q : rest) {
      front.append(q);
    }
    order = front;
  }
  const bool native_slice = truth(attr(config, s.native_slice).ptr());
  py::object entryless = mattr(pc, s.m_entryless), py_params = mattr(pc, s.m_params);
  py::object plan, r, p;
  for (const py::handle cand : order) {
    r = core(cand.ptr(), targets, generic, pend, C(kPartial), entryless.ptr());
    if (r.is_none()) {
      continue;
    }
    p = params(cand.ptr(), generic, r, py_params.ptr(), native_slice);
    if (p.is_none()) {
      continue;
    }
    plan = py::reinterpret_borrow<py::object>(cand);
    break;
  }
  if (!plan) {
    return miss();
  }
  note_match(cache.ptr(), plans, plan.ptr(), span);
  bump(cHits);
  py::tuple found = py::make_tuple(plan, r, py::bool_(generic), p);
  auto general = [&] { return carry_on(1, targets, found); };

  // genie.executor._run_hit's test for the fused path
  const bool differs = truth(PyTuple_GET_ITEM(p.ptr(), 1));
  py::object f = fused_of(plan.ptr(), differs, M(kPipeline, s.m_config).ptr());
  if (f.is_none()) {
    return general();
  }
  py::object program = attr(f.ptr(), s.program);
  if (program.is_none()) {
    return general();
  }
  py::object states = attr(plan.ptr(), s.states);
  const Py_ssize_t ns = PyObject_Length(states.ptr());
  if (ns < 0) {
    throw py::error_already_set();
  }
  if (ns > 1) {
    return general();
  }
  if (ns == 1) {
    py::object w =
        py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(genie::state_word()));
    const int in = PySequence_Contains(states.ptr(), w.ptr());
    if (in < 0) {
      throw py::error_already_set();
    }
    if (!in) {
      return general();
    }
  }
  // memory tracking on (a peak was asked for): a hit of the plan's own shapes runs fused once its
  // run's high-water mark is known (executor._high_water), and memory.after_run accounts it
  const bool tracking = truth(first(M(kMemory, s.m_tracking)));
  if (tracking && (differs || attr(f.ptr(), s.high_water).is_none())) {
    return general();
  }
  py::object idx = py::reinterpret_steal<py::object>(PyLong_FromLongLong(index));
  py::object real_devices = M(kDevice, s.m_real_devices);
  if (!PyDict_Check(real_devices.ptr())) {
    throw py::type_error("genie._C._read: genie.device._real_devices is not a dict");
  }
  PyObject* dev = PyDict_GetItemWithError(real_devices.ptr(), idx.ptr());
  if (dev == nullptr) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return general();  // (executor._device_for finds it, or says why not)
  }
  py::list devices;
  devices.append(py::reinterpret_borrow<py::object>(dev));
  py::object cpu_ref = M(kMemory, s.m_cpu);
  PyObject* cpu = first(cpu_ref);
  const int64_t hold = (!tracking && cpu != Py_None && cpu == dev) ? index : -1;  // held_here

  if (differs) {
    bump(cGeneric);
  }
  if (truth(attr(f.ptr(), s.waiting).ptr())) {
    bump(cWaiting);
  }
  PyObject* shaped = PyTuple_GET_ITEM(r.ptr(), 1);
  py::object rngs = attr(plan.ptr(), s.rngs);
  py::object stale = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(p.ptr(), 0));
  if (truth(shaped) || truth(rngs.ptr())) {
    py::list all;
    for (PyObject* part : {stale.ptr(), shaped, rngs.ptr()}) {
      py::object it = py::reinterpret_steal<py::object>(PyObject_GetIter(part));
      if (!it) {
        throw py::error_already_set();
      }
      while (PyObject* x = PyIter_Next(it.ptr())) {
        if (PyList_Append(all.ptr(), x) < 0) {
          Py_DECREF(x);
          throw py::error_already_set();
        }
        Py_DECREF(x);
      }
      if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
    }
    stale = all;
  }
  py::object outputs = attr(plan.ptr(), s.outputs);
  py::object want = py::reinterpret_steal<py::object>(PyList_GetSlice(outputs.ptr(), 0, n));
  if (!want) {
    throw py::error_already_set();
  }
  py::object flat = attr(plan.ptr(), s.flat);
  py::object tmpl = attr(f.ptr(), s.tmpl);
  PyObject* found_nodes = PyTuple_GET_ITEM(r.ptr(), 0);
  py::object out = genie::hit_run_object(
      attr(program.ptr(), s.native), py::reinterpret_borrow<py::dict>(PyTuple_GET_ITEM(r.ptr(), 4)),
      attr(f.ptr(), s.consts), py::reinterpret_borrow<py::list>(tmpl), attr(f.ptr(), s.at),
      py::reinterpret_borrow<py::list>(found_nodes), py::reinterpret_borrow<py::list>(stale),
      devices, py::reinterpret_borrow<py::list>(PyTuple_GET_ITEM(flat.ptr(), 15)),
      as_int(M(kExecutor, s.m_prune_at).ptr()), truth(attr(config, s.gc_untrack).ptr()), hold,
      py::reinterpret_borrow<py::list>(want));
  if (PyTuple_GET_SIZE(out.ptr()) == 3) {
    return carry_on(2, targets, found, out);
  }
  bump(cReplays);
  bump(cFused);
  const int64_t freed = as_int(attr(program.ptr(), s.freed).ptr());
  if (freed) {
    bump(cFreed, freed);
  }
  bump(cExecuted, PyList_GET_SIZE(tmpl.ptr()));
  const int64_t bound = as_int(PyTuple_GET_ITEM(out.ptr(), 1));
  py::object left = py::reinterpret_steal<py::object>(
      PyLong_FromLongLong(as_int(first(pt)) - bound));
  if (PyList_SetItem(pt.ptr(), 0, left.release().ptr()) < 0) {
    throw py::error_already_set();
  }
  const int64_t held = as_int(PyTuple_GET_ITEM(out.ptr(), 2));
  if (held >= 0) {  // memory.held
    if (PySet_Add(M(kMemory, s.m_seen).ptr(), idx.ptr()) < 0) {
      throw py::error_already_set();
    }
    py::object peaks = M(kMemory, s.m_peak);
    if (!PyDict_Check(peaks.ptr())) {
      throw py::type_error("genie._C._read: genie.memory._peak is not a dict");
    }
    PyObject* peak = PyDict_GetItemWithError(peaks.ptr(), idx.ptr());
    if (peak == nullptr && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    if (held > (peak == nullptr ? 0 : as_int(peak))) {
      py::object h = py::reinterpret_steal<py::object>(PyLong_FromLongLong(held));
      if (PyDict_SetItem(peaks.ptr(), idx.ptr(), h.ptr()) < 0) {
        throw py::error_already_set();
      }
    }
    return py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(out.ptr(), 0));
  }
  // not held here (a CUDA device, or the CPU accounting not set up yet): memory.after_run
  return carry_on(3, targets, found, out);
}

// genie.stats' sync for this file's counts (one of genie.stats._syncs)
void read_sync_counts(const py::object& stats) {
  const Names& s = names();
  py::object counts = mattr(stats.ptr(), s.m_counts);
  for (int c = 0; c < kCounts; ++c) {
    const int64_t n = counted[c];
    if (n == 0) {
      continue;
    }
    counted[c] = 0;
    PyObject* v = PyDict_GetItemWithError(counts.ptr(), s.counts[c]);
    if (v == nullptr && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    py::object nv = py::reinterpret_steal<py::object>(
        PyLong_FromLongLong((v == nullptr ? 0 : as_int(v)) + n));
    if (!nv || PyDict_SetItem(counts.ptr(), s.counts[c], nv.ptr()) < 0) {
      throw py::error_already_set();
    }
  }
}

// --- .item() and .cpu() on the steady path -------------------------------------------------------
//
// genie.lazy_tensor._item_now and _transfer's download for the embedded steady case, from the
// record path (csrc/record.cpp's try_record, before the op's facts): .item() / bool() / int(), or
// a _to_copy to a CPU device (.cpu(), .to("cpu"), print's), of a pending LazyTensor whose read
// genie.executor.run_targets would send to _read_fast (no server for its device, nothing sent
// ahead to settle, the eager backend alone, the fused path's settings, no dispatch mode, no
// pending data-dependent check), with the same counts, the same read (read_steady, then
// executor._read_on where it hands back) and the same answer: the real tensor's
// _local_scalar_dense where lazy_tensor._plain holds (else lazy_tensor._item_of), or the op on
// the real tensor with the math-bit keys on. Saves the Python frames between the kernel and the
// read (~30k instructions per .item(), ~90k per .cpu()). Anything else: not taken (the Python
// path, before any effect).

struct ItemCtx {
  PyObject* op = nullptr;       // aten._local_scalar_dense.default
  PyObject* to_copy = nullptr;  // aten._to_copy.default
  PyObject* lazy = nullptr;    // genie.lazy_tensor.LazyTensor
  PyObject* tensor = nullptr;  // torch.Tensor
  PyObject* ctx = nullptr;     // genie.executor._READ_CTX
  PyObject* module = nullptr;  // genie.lazy_tensor (its _item_of)
};
ItemCtx item_ctx;  // strong references, never released (set once per process)

void read_item_init(py::object op, py::object to_copy, py::object lazy, py::object tensor,
                    py::tuple ctx, py::object module) {
  if (PyTuple_GET_SIZE(ctx.ptr()) != kCtxSize) {
    throw py::type_error("genie._C._read_item_init: the context must be genie.executor._READ_CTX");
  }
  for (PyObject** o : {&item_ctx.op, &item_ctx.to_copy, &item_ctx.lazy, &item_ctx.tensor,
                       &item_ctx.ctx, &item_ctx.module}) {
    Py_CLEAR(*o);
  }
  item_ctx.op = op.release().ptr();
  item_ctx.to_copy = to_copy.release().ptr();
  item_ctx.lazy = lazy.release().ptr();
  item_ctx.tensor = tensor.release().ptr();
  item_ctx.ctx = ctx.release().ptr();
  item_ctx.module = module.release().ptr();
}

// Whether a server runs the tapes of remote_accelerator:`index` (device.remote_served, set once
// genie.backends.remote is imported): a read there is lazy_tensor._item_now's host read or a
// round trip, the Python path's
bool served(PyObject* ctx, int64_t index) {
  py::object f = mattr(PyTuple_GET_ITEM(ctx, kDevice), names().m_remote_served);
  if (f.is_none()) {
    return false;
  }
  py::object i = py::reinterpret_steal<py::object>(PyLong_FromLongLong(index));
  py::object r = py::reinterpret_steal<py::object>(PyObject_CallOneArg(f.ptr(), i.ptr()));
  if (!r) {
    throw py::error_already_set();
  }
  return truth(r.ptr());
}

// executor._fusing() and run_targets' other tests for _read_fast, and backends.fetch passing the
// values through (the eager backend alone), from the modules' current objects
bool read_fast_allowed(PyObject* ctx) {
  const Names& s = names();
  auto C = [&](Ctx k) { return PyTuple_GET_ITEM(ctx, k); };
  auto flag = [](const py::object& l) {  // a one-item list's item is True
    return PyList_Check(l.ptr()) && PyList_GET_SIZE(l.ptr()) == 1 &&
           PyList_GET_ITEM(l.ptr(), 0) == Py_True;
  };
  if (!mattr(C(kBackends), s.m_before_plan).is_none() ||
      !flag(mattr(C(kExecutor), s.m_read_native)) || !flag(mattr(C(kExecutor), s.m_fuse))) {
    return false;
  }
  py::object order = mattr(C(kBackends), s.m_order);
  if (!PyList_CheckExact(order.ptr()) || PyList_GET_SIZE(order.ptr()) != 1) {
    return false;
  }
  PyObject* first = PyList_GET_ITEM(order.ptr(), 0);
  if (first != s.eager_str &&
      (!PyUnicode_CheckExact(first) || PyUnicode_Compare(first, s.eager_str) != 0)) {
    return false;
  }
  py::object dof = mattr(C(kChecks), s.m_dof_pending);
  if (!PyList_CheckExact(dof.ptr()) || PyList_GET_SIZE(dof.ptr()) != 0) {
    return false;
  }
  // modes.disable_modes() is _NO_MODES: no mode on the dispatch stack nor the pre-dispatch one
  if (c10::impl::TorchDispatchModeTLS::stack_len() != 0) {
    return false;
  }
  py::object slots = mattr(C(kModes), s.m_pre_slots);
  if (!PyList_CheckExact(slots.ptr())) {
    return false;  // (this torch's pre-dispatch stack is read another way: the Python path)
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(slots.ptr()); ++i) {
    if (PyList_GET_ITEM(slots.ptr(), i) != Py_None) {
      return false;
    }
  }
  return attr(mattr(C(kModes), s.m_pre_state).ptr(), s.schema_check_mode).is_none();
}

// lazy_tensor._plain(real) and _item._op(real), for the dtypes whose Scalar is a Python float,
// int or bool as torch answers them; None where that does not hold (lazy_tensor._item_of then)
py::object plain_item(PyObject* real) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(real)) != item_ctx.tensor ||
      c10::impl::TorchDispatchModeTLS::stack_len() != 0) {
    return py::none();
  }
  const at::Tensor& t = THPVariable_Unpack(real);
  if (t.is_neg() || t.is_conj() || t._is_zerotensor() || !t.is_cpu()) {
    return py::none();  // (a CUDA read waits for the device: torch's op, without the GIL)
  }
  switch (t.scalar_type()) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kLong: case at::kInt: case at::kShort: case at::kChar: case at::kByte:
    case at::kBool:
      break;
    default:
      return py::none();
  }
  c10::Scalar v;
  try {
    v = at::_local_scalar_dense(t);
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    throw py::error_already_set();
  }
  PyObject* r = v.isFloatingPoint() ? PyFloat_FromDouble(v.toDouble())
                : v.isBoolean()     ? PyBool_FromLong(v.toBool() ? 1 : 0)
                                    : PyLong_FromLongLong(v.toLong());
  if (r == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(r);
}

// _to_copy's keyword arguments of a copy to the host (.cpu(), .to("cpu"): device= a CPU device;
// lazy_tensor._transfer's download)
bool to_host(PyObject* kwargs) {
  if (kwargs == nullptr || !PyDict_CheckExact(kwargs)) {
    return false;
  }
  PyObject* dev = PyDict_GetItemWithError(kwargs, names().device_);
  if (dev == nullptr) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return false;
  }
  return THPDevice_Check(dev) && reinterpret_cast<THPDevice*>(dev)->device.is_cpu();
}

}  // namespace

namespace genie {

bool read_op_is(PyObject* func) {
  return item_ctx.op != nullptr && (func == item_ctx.op || func == item_ctx.to_copy);
}

PyObject* read_op_steady(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (item_ctx.op == nullptr || (func != item_ctx.op && func != item_ctx.to_copy) ||
      PyTuple_GET_SIZE(args) != 1) {
    return nullptr;
  }
  genie::release_pending();  // outputs whose wrappers died without the GIL (csrc/wrapper.cpp)
  const bool item = func == item_ctx.op;
  const Names& s = names();
  if (item ? kwargs != nullptr : !to_host(kwargs)) {
    return nullptr;
  }
  PyObject* x = PyTuple_GET_ITEM(args, 0);
  if (reinterpret_cast<PyObject*>(Py_TYPE(x)) != item_ctx.lazy) {
    return nullptr;
  }
  PyObject* ctx = item_ctx.ctx;
  if (!read_fast_allowed(ctx)) {
    return nullptr;
  }
  py::object node = attr(x, s.node_);
  py::object out = attr(x, s.out_);
  if (attr(node.ptr(), s.executed).ptr() != Py_False) {
    return nullptr;  // its value may be ready (run_targets' test): the Python path
  }
  py::object metas = attr(node.ptr(), s.metas);
  py::object meta =
      py::reinterpret_steal<py::object>(PyObject_GetItem(metas.ptr(), out.ptr()));
  if (!meta) {
    throw py::error_already_set();
  }
  const int64_t index = as_int(attr(meta.ptr(), s.index).ptr());
  if (served(ctx, index)) {
    return nullptr;
  }
  // lazy_tensor._item_now, materialize(x, trigger="cpu"): counted before the read (a read that
  // raises has counted it)
  bump(cMat);
  bump(item ? cMatItem : cMatCpu);
  record_ahead_restart();  // run_targets: a read
  py::list targets;
  targets.append(py::make_tuple(node, out));
  py::object r = read_steady(targets, 1, index, py::reinterpret_borrow<py::tuple>(ctx));
  if (!PyList_CheckExact(r.ptr())) {  // where _read_fast goes on in Python
    py::object on = mattr(PyTuple_GET_ITEM(ctx, kExecutor), s.m_read_on);
    r = py::reinterpret_steal<py::object>(PyObject_CallFunction(
        on.ptr(), "OnL", r.ptr(), static_cast<Py_ssize_t>(1), static_cast<long long>(index)));
    if (!r) {
      throw py::error_already_set();
    }
    if (!PyList_Check(r.ptr()) || PyList_GET_SIZE(r.ptr()) < 1) {
      throw py::type_error("genie._C: executor._read_on must return the values' list");
    }
  }
  PyObject* real = PyList_GET_ITEM(r.ptr(), 0);
  if (!item) {
    // lazy_tensor._transfer: the host copy of the value, the op called on it with the math-bit
    // keys on (executor.real_dispatch). (_own_download's mark is a server's: none here.)
    py::object a = py::reinterpret_steal<py::object>(PyTuple_Pack(1, real));
    if (!a) {
      throw py::error_already_set();
    }
    const long mask = genie::math_bits_on();
    PyObject* copy = PyObject_Call(func, a.ptr(), kwargs);
    genie::math_bits_restore(mask);
    if (copy == nullptr) {
      throw py::error_already_set();
    }
    return copy;
  }
  py::object v = plain_item(real);
  if (v.is_none()) {
    py::object of = mattr(item_ctx.module, s.m_item_of);
    v = py::reinterpret_steal<py::object>(PyObject_CallOneArg(of.ptr(), real));
    if (!v) {
      throw py::error_already_set();
    }
  }
  bump(cForced);
  return v.release().ptr();
}


void add_read_functions(py::module_& m) {
  m.def("_read", &read_steady, py::arg("targets"), py::arg("n"), py::arg("index"), py::arg("ctx"),
        "genie.executor.run_targets' steady read in one call (csrc/read.cpp): the values, or "
        "where the Python path goes on.");
  m.def("_read_sync_counts", &read_sync_counts, py::arg("stats"),
        "Add the counts csrc/read.cpp kept since the last call to genie.stats._counts.");
  m.def("_read_item_init", &read_item_init, py::arg("op"), py::arg("to_copy"), py::arg("lazy"),
        py::arg("tensor"), py::arg("ctx"), py::arg("module"),
        "Set up the steady reads of .item() and .cpu() (csrc/read.cpp's read_op_steady): the "
        "ops, LazyTensor, torch.Tensor, genie.executor._READ_CTX and genie.lazy_tensor.");
}

}  // namespace genie
