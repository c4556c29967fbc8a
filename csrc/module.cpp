// genie._C: the Python face of Genie's native remote_accelerator runtime.
//
// Importing this module is what makes PyTorch's C++ accept the PrivateUse1
// device: the guard (guard.cpp) and allocator (allocator.cpp) register at
// library load, the hooks (hooks.cpp) when the module initializes. The
// functions below let genie's Python device module configure and query the
// runtime; they are private (underscored) and typed in genie/_C.pyi.
#include <array>
#include <cstdint>
#include <vector>

#include <pybind11/pybind11.h>
#include <torch/csrc/Generator.h>

#include "bind.h"
#include "client_run.h"
#include "memory.h"
#include "match.h"
#include "node.h"
#include "device.h"
#include "gccount.h"
#include "generator.h"
#include "hooks.h"
#include "record.h"
#include "seq.h"
#include "slice.h"
#include "storage.h"
#include "read.h"
#include "replay.h"
#include "session.h"
#include "shape_rules.h"
#include "state.h"
#include "walk.h"
#include "warnings.h"
#include "whole.h"
#include "wire.h"
#include "worker_replay.h"
#include "wrapper.h"

namespace py = pybind11;

namespace {

// Python objects for the default generators, created once per index and kept
// alive for the process (like torch.cuda.default_generators) so that repeated
// lookups return the same torch.Generator object. Guarded by the GIL.
py::object default_generator_object(int64_t index) {
  static std::array<PyObject*, genie::kMaxDevices> objects{};
  const auto resolved = genie::resolve_device_index(index);
  PyObject*& obj = objects[resolved];
  if (obj == nullptr) {
    obj = THPGenerator_initDefaultGenerator(genie::default_generator(resolved));
    if (obj == nullptr) {
      throw py::error_already_set();
    }
  }
  return py::reinterpret_borrow<py::object>(obj);
}

// Take objects out of (or back into) the cyclic garbage collector's lists. Recording makes
// several small container objects per op (genie.graph.untrack_node says which); with a large
// heap alive (a transformers model: ~400k tracked objects), the collections their allocation
// triggers cost more than the recording itself. Only objects that cannot be part of an
// uncollected cycle are untracked; genie.graph.retrack_below puts them back where a write could
// close one.
void untrack(PyObject* o) {
  if (PyObject_IS_GC(o) && PyObject_GC_IsTracked(o)) {
    PyObject_GC_UnTrack(o);
  }
}

void untrack_objects(const py::args& objects) {
  for (const auto& o : objects) {
    untrack(o.ptr());
  }
}

// Untrack every element of `items` (a list) whose type is exactly `type`.
void untrack_of_type(const py::list& items, const py::handle& type) {
  PyObject* t = type.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(items.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PyList_GET_ITEM(items.ptr(), i);
    if (reinterpret_cast<PyObject*>(Py_TYPE(o)) == t) {
      untrack(o);
    }
  }
}

// One recorded node and its containers (see genie.graph.untrack_node): the node, its argument
// list and the Refs in it, its storage, output and consumer lists, the weak references in its
// outputs, and its own weak reference. One call per recorded op, so no Python-level loop.
//
// Also each output Storage with no pending write, with its two lists: a Storage reaches a node
// only through `pending_writes`, and the write path (Storage.add_writer) tracks the storage and
// that list again when it appends. With genie.graph.track untracking the liveness token and the
// tensor's instance dict, what stays tracked per recorded op is the LazyTensor object itself.
PyTypeObject* graph_type(const char* name) {
  py::object t = py::module_::import("genie.graph").attr(name);
  return reinterpret_cast<PyTypeObject*>(t.release().ptr());  // kept for the process
}

void untrack_storage(PyObject* s) {
  static PyObject* const pw_name = PyUnicode_InternFromString("pending_writes");
  static PyObject* const readers_name = PyUnicode_InternFromString("readers");
  if (!PyObject_GC_IsTracked(s)) {
    return;
  }
  PyObject* pw = PyObject_GetAttr(s, pw_name);
  if (pw == nullptr) {
    throw py::error_already_set();
  }
  // no write yet: the shared empty tuple (genie.graph.Storage), or a list a run emptied
  const bool empty = PyTuple_Check(pw) ? PyTuple_GET_SIZE(pw) == 0
                                       : PyList_Check(pw) && PyList_GET_SIZE(pw) == 0;
  if (empty) {
    PyObject* readers = PyObject_GetAttr(s, readers_name);
    if (readers == nullptr) {
      Py_DECREF(pw);
      throw py::error_already_set();
    }
    if (PyList_Check(readers)) {
      untrack(readers);
    }
    Py_DECREF(readers);
    if (PyList_Check(pw)) {
      untrack(pw);
    }
    untrack(s);
  }
  Py_DECREF(pw);
}

void untrack_node(const py::handle& node, const py::handle& leaves, const py::handle& ref_type) {
  static PyObject* const names[] = {
      PyUnicode_InternFromString("_st"), PyUnicode_InternFromString("_out"),
      PyUnicode_InternFromString("_wref")};
  static PyTypeObject* const storage_type = graph_type("Storage");
  untrack(node.ptr());
  if (PyList_Check(leaves.ptr())) {
    untrack(leaves.ptr());
    untrack_of_type(py::reinterpret_borrow<py::list>(leaves), ref_type);
  }
  const auto untrack_item = [](PyObject* e) {
    if (PyWeakref_CheckRefExact(e)) {
      untrack(e);
    } else if (Py_TYPE(e) == storage_type) {
      untrack_storage(e);
    }
  };
  for (PyObject* name : names) {  // (a single output's storage and weak reference are inline)
    PyObject* o = PyObject_GetAttr(node.ptr(), name);
    if (o == nullptr) {
      throw py::error_already_set();
    }
    if (PyList_Check(o)) {
      untrack(o);
      const Py_ssize_t n = PyList_GET_SIZE(o);
      for (Py_ssize_t i = 0; i < n; ++i) {
        untrack_item(PyList_GET_ITEM(o, i));
      }
    } else {
      untrack_item(o);
    }
    Py_DECREF(o);
  }
}

void track(PyObject* o) {
  if (PyObject_IS_GC(o) && !PyObject_GC_IsTracked(o)) {
    PyObject_GC_Track(o);
  }
}

PyObject* get_attr(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_GetAttr(o, name);
  if (r == nullptr) {
    throw py::error_already_set();
  }
  return r;
}

// The producer nodes of node `n`'s lazy inputs (its leaves, csrc/node.h) onto `stack`.
void push_inputs(PyObject* n, std::vector<py::object>& stack) {
  const Py_ssize_t k = genie::node_n_leaves(n);
  for (Py_ssize_t p = 0; p < k; ++p) {
    int32_t out = -1;
    PyObject* x = genie::node_leaf(n, p, &out);
    if (out >= 0) {
      stack.push_back(py::reinterpret_borrow<py::object>(x));
    }
  }
}

// Track again every untracked node on `stack` and below it (its containers, its inputs), stopping
// at tracked nodes, whose inputs are tracked already.
void retrack_walk(std::vector<py::object>& stack, PyObject* ref_t) {
  static PyObject* const names[] = {
      PyUnicode_InternFromString("_st"), PyUnicode_InternFromString("_out"),
      PyUnicode_InternFromString("_wref")};
  while (!stack.empty()) {
    py::object n = std::move(stack.back());
    stack.pop_back();
    if (PyObject_GC_IsTracked(n.ptr())) {
      continue;
    }
    track(n.ptr());
    for (PyObject* name : names) {
      auto o = py::reinterpret_steal<py::object>(get_attr(n.ptr(), name));
      track(o.ptr());
      if (PyList_Check(o.ptr())) {
        const Py_ssize_t k = PyList_GET_SIZE(o.ptr());
        for (Py_ssize_t i = 0; i < k; ++i) {
          track(PyList_GET_ITEM(o.ptr(), i));
        }
      }
    }
    if (genie::is_node_type(Py_TYPE(n.ptr()))) {
      push_inputs(n.ptr(), stack);
    }
  }
}

// genie.graph.retrack_below: track again every untracked node reachable from the Refs in
// `leaves` (or from the inputs of `leaves`, a node: the native record path's new writer), with
// its containers, stopping at tracked nodes (whose inputs are tracked already).
void retrack_below(const py::handle& leaves, const py::handle& ref_type) {
  static PyObject* const node_name = PyUnicode_InternFromString("node");
  PyObject* const ref_t = ref_type.ptr();
  std::vector<py::object> stack;  // owned references: nothing is freed during the walk
  if (genie::is_node_type(Py_TYPE(leaves.ptr()))) {
    push_inputs(leaves.ptr(), stack);
  } else if (PyList_Check(leaves.ptr())) {
    const Py_ssize_t n = PyList_GET_SIZE(leaves.ptr());
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* x = PyList_GET_ITEM(leaves.ptr(), i);
      if (reinterpret_cast<PyObject*>(Py_TYPE(x)) == ref_t) {
        track(x);
        stack.push_back(py::reinterpret_steal<py::object>(get_attr(x, node_name)));
      }
    }
  }
  retrack_walk(stack, ref_t);
}

// genie.graph.retrack_writers: put pending writers recorded untracked (config.gc_defer_writes)
// back under the collector, with everything below them and the storages they write (each
// storage and its pending-write list: the edge that closes the cycle), so that a cycle a dropped
// write closed is collected.
void retrack_writers(const py::list& nodes, const py::handle& ref_type) {
  static PyObject* const writes_name = PyUnicode_InternFromString("writes");
  static PyObject* const pw_name = PyUnicode_InternFromString("pending_writes");
  static PyObject* const readers_name = PyUnicode_InternFromString("readers");
  std::vector<py::object> stack;
  const Py_ssize_t n = PyList_GET_SIZE(nodes.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* node = PyList_GET_ITEM(nodes.ptr(), i);
    auto writes = py::reinterpret_steal<py::object>(get_attr(node, writes_name));
    if (PyTuple_Check(writes.ptr())) {
      const Py_ssize_t k = PyTuple_GET_SIZE(writes.ptr());
      for (Py_ssize_t j = 0; j < k; ++j) {
        PyObject* st = PyTuple_GET_ITEM(writes.ptr(), j);
        track(st);
        for (PyObject* name : {pw_name, readers_name}) {
          auto o = py::reinterpret_steal<py::object>(get_attr(st, name));
          track(o.ptr());
        }
      }
    }
    stack.push_back(py::reinterpret_borrow<py::object>(node));
  }
  retrack_walk(stack, ref_type.ptr());
}

void track_objects(const py::args& objects) {
  for (const auto& o : objects) {
    PyObject* p = o.ptr();
    if (PyObject_IS_GC(p) && !PyObject_GC_IsTracked(p)) {
      PyObject_GC_Track(p);
    }
  }
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Genie's native remote_accelerator (PrivateUse1) runtime.";

  genie::register_hooks();
  genie::add_node_type(m);
  genie::gc_count_init();
  m.def("_gc_count_active", &genie::gc_count_active,
        "Whether allocations genie._C keeps off the cyclic GC are off its young count too "
        "(csrc/gccount.cpp; false on a CPython whose count setup.py could not find).");
  m.def(
      "_release_nodes",
      [](const py::list& nodes) {
        // as genie._C._bind_nodes releases them (last first), and the count after as before:
        // what the frees take off the young count was taken off at allocation already
        const int young = genie::gc_young();
        for (Py_ssize_t i = PyList_GET_SIZE(nodes.ptr()) - 1; i >= 0; --i) {
          PyObject* node = PyList_GET_ITEM(nodes.ptr(), i);
          PyList_SET_ITEM(nodes.ptr(), i, Py_NewRef(Py_None));
          Py_DECREF(node);
        }
        genie::gc_young_at_least(young);
      },
      py::arg("nodes"),
      "Drop a run's bound nodes from `nodes` (each item becomes None) without the frees "
      "lowering the cyclic GC's young count (csrc/gccount.h: gc_young_at_least).");

  m.def("_set_device_count", &genie::set_device_count, py::arg("count"),
        "Set how many remote_accelerator devices exist (1..64). Call before the first backward().");
  m.def("_device_count", []() { return static_cast<int>(genie::device_count()); },
        "Number of remote_accelerator devices.");
  m.def("_current_device", []() { return static_cast<int>(genie::current_device()); },
        "This thread's current remote_accelerator device index.");
  m.def(
      "_set_device",
      [](int64_t index) { genie::set_device(genie::check_device_index(index)); },
      py::arg("index"), "Make `index` this thread's current device; IndexError if out of range.");
  m.def(
      "_exchange_device",
      [](int64_t index) {
        return static_cast<int>(genie::exchange_device(genie::check_device_index(index)));
      },
      py::arg("index"), "Set the current device and return the previous index.");
  m.def("_default_generator", &default_generator_object, py::arg("index"),
        "The default torch.Generator of device `index` (-1: current device); same object every call.");
  m.def("_gc_untrack", &untrack_objects,
        "Untrack the given objects from the cyclic GC (no-op for untracked or non-GC objects).");
  m.def("_gc_untrack_of_type", &untrack_of_type, py::arg("items"), py::arg("type"),
        "Untrack the elements of the list `items` whose type is exactly `type`.");
  m.def("_gc_untrack_node", &untrack_node, py::arg("node"), py::arg("leaves"), py::arg("ref_type"),
        "Untrack a recorded node, its argument list and Refs, its storage/output/consumer lists, "
        "the weak references in those lists, and its own weak reference.");
  m.def("_gc_retrack_below", &retrack_below, py::arg("leaves"), py::arg("ref_type"),
        "Track again every untracked node reachable from the Refs in `leaves` (and its "
        "containers), stopping at tracked nodes.");
  m.def("_gc_retrack_writers", &retrack_writers, py::arg("nodes"), py::arg("ref_type"),
        "Track again the given writer nodes, everything below them (as _gc_retrack_below) and "
        "the storages they write with their pending-write and reader lists.");
  m.def("_gc_track", &track_objects,
        "Track the given objects again in the cyclic GC (no-op for tracked or non-GC objects).");
  m.def("_bind_nodes", &genie::bind_nodes, py::arg("nodes"), py::arg("outs"), py::arg("kept"),
        py::arg("prune_at"), py::arg("untrack"), py::arg("release") = false,
        "Bind a run's kept values to its nodes (genie.executor._bind); returns the number of "
        "pending-write entries removed. `release`: bind from the last node to the first and "
        "replace each node in `nodes` by None once bound (the caller is done with the list).");
  m.def("_step_targets", &genie::step_targets, py::arg("targets"), py::arg("opts"),
        py::arg("index"),
        "genie.executor.with_step: `targets` and the pending (node, output) of each tensor the "
        "steps of the optimizers `opts` write on device `index`, each once (a new list).");
  m.def("_mem_hold", &genie::mem_hold, py::arg("index"), py::arg("values"),
        "Note the real CPU storages of `values` as held on device `index` while they live "
        "(genie.memory.hold); returns the bytes held there now.");
  m.def("_mem_allocated", &genie::mem_allocated, py::arg("index"),
        "The bytes of the live real CPU storages held on device `index` (genie.memory).");
  m.def("_match_init", &genie::match_init, "Types and Python rules genie._C._match_core uses.");
  m.def("_match_core", &genie::match_core,
        "genie.plan_cache.match's per-node part: None (not this plan) or "
        "(nodes, shaped, changed, input slots, inputs).");
  m.attr("_max_devices") = static_cast<int>(genie::kMaxDevices);
  genie::add_record_functions(m);
  genie::add_seq_functions(m);
  genie::add_python_key_functions(m);
  genie::add_slice_functions(m);
  genie::add_replay_functions(m);
  genie::add_whole_functions(m);
  genie::add_shape_rule_functions(m);
  genie::add_state_functions(m);
  genie::add_warning_functions(m);
  genie::add_walk_functions(m);
  genie::add_storage_functions(m);
  genie::add_session_functions(m);
  genie::add_worker_replay_functions(m);
  genie::add_wire_functions(m);
  genie::add_read_functions(m);
  genie::add_client_functions(m);
  genie::add_wrapper_functions(m);
}
