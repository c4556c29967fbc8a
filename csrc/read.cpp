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

#include "bind.h"
#include "match.h"
#include "read.h"
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
  // counters
  PyObject* c_hits = intern("plan_cache_hits");
  PyObject* c_generic = intern("plan_cache_generic_hits");
  PyObject* c_waiting = intern("passes_waiting");
  PyObject* c_replays = intern("native_replays");
  PyObject* c_fused = intern("fused_hits");
  PyObject* c_freed = intern("values_freed");
  PyObject* c_executed = intern("nodes_executed");
  PyObject* c_step = intern("step_tapes");
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

// counts[name] += n (genie.stats.bump)
void bump(PyObject* counts, PyObject* name, int64_t n) {
  PyObject* v = PyDict_GetItemWithError(counts, name);
  if (v == nullptr && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  const int64_t now = v == nullptr ? 0 : as_int(v);
  py::object nv = py::reinterpret_steal<py::object>(PyLong_FromLongLong(now + n));
  if (!nv || PyDict_SetItem(counts, name, nv.ptr()) < 0) {
    throw py::error_already_set();
  }
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
  auto M = [&](Ctx k, PyObject* name) { return attr(C(k), name); };
  auto first = [](const py::object& l) {  // a one-item list's item (genie's mutable flags)
    if (!PyList_Check(l.ptr()) || PyList_GET_SIZE(l.ptr()) < 1) {
      throw py::type_error("genie._C._read: a flag list is not a list of one");
    }
    return PyList_GET_ITEM(l.ptr(), 0);
  };
  py::object counts_ref = M(kStats, s.m_counts);
  PyObject* counts = counts_ref.ptr();
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
      bump(counts, s.c_step, 1);
    }
  }

  // plan_cache.plan's lookup by the requested ops
  PyObject* pc = C(kPlanCache);
  py::object cache = attr(pc, s.cache);
  const int64_t span = span_of(cache.ptr(), targets);
  const bool enabled = truth(attr(pc, s.enabled).ptr());
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
  generic = generic && truth(attr(pc, s.generic).ptr());
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
  py::object entryless = attr(pc, s.m_entryless), py_params = attr(pc, s.m_params);
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
  bump(counts, s.c_hits, 1);
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
    bump(counts, s.c_generic, 1);
  }
  if (truth(attr(f.ptr(), s.waiting).ptr())) {
    bump(counts, s.c_waiting, 1);
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
  bump(counts, s.c_replays, 1);
  bump(counts, s.c_fused, 1);
  const int64_t freed = as_int(attr(program.ptr(), s.freed).ptr());
  if (freed) {
    bump(counts, s.c_freed, freed);
  }
  bump(counts, s.c_executed, PyList_GET_SIZE(tmpl.ptr()));
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

}  // namespace

namespace genie {

void add_read_functions(py::module_& m) {
  m.def("_read", &read_steady, py::arg("targets"), py::arg("n"), py::arg("index"), py::arg("ctx"),
        "genie.executor.run_targets' steady read in one call (csrc/read.cpp): the values, or "
        "where the Python path goes on.");
}

}  // namespace genie
