// genie._C and the cyclic garbage collector's young-generation count.
//
// CPython counts every object allocated through the collector (list, weak reference, instance of
// a slotted class) until it is freed, and collects the young generation whenever that count
// passes its threshold (700), whether or not the objects are on the collector's lists. Recording
// makes ~10 such objects per op (the node, its lists, Refs, Storages, weak references) and takes
// them off the lists at once (record.cpp, graph.untrack_node), but they live until the value is
// read, so a GPT-2 generate of ~7,000 recorded ops ran ~83 young collections where eager ran
// none; each promotes what is alive then, and every ~25 calls the interpreter ran a full
// collection over the whole heap (~300 ms with torch and transformers loaded). An untracked
// object cannot be in the garbage the collector looks for, so genie._C takes it off the count
// too: its allocation then costs the program's collections nothing, as the tensor eager would
// have made costs nothing.
//
// Only an allocation seen to count is taken off (gc_untrack_new): a list from CPython's free list
// never counted, and an object counted before the last collection reset the count is not this
// allocation's to take; taking either off would hide the program's own allocations from the
// collector and delay the collection of its garbage cycles.
//
// The count lives in CPython's private interpreter state; setup.py finds its offset from the
// interpreter's internal headers (csrc/gc_probe.c), and gc_count_init checks it against the gc
// module (threshold read and written, count moved by one allocation) before any use.
#include "gccount.h"

namespace genie {
namespace {

int* young_count = nullptr;  // set by gc_count_init once checked

}  // namespace

void gc_count_init() {
#if defined(GENIE_GC_COUNT_OFFSET) && defined(GENIE_GC_THRESHOLD_OFFSET)
  char* interp = reinterpret_cast<char*>(PyInterpreterState_Get());
  int* count = reinterpret_cast<int*>(interp + GENIE_GC_COUNT_OFFSET);
  int* threshold = reinterpret_cast<int*>(interp + GENIE_GC_THRESHOLD_OFFSET);
  PyObject* gc = PyImport_ImportModule("gc");
  if (gc == nullptr) {
    PyErr_Clear();
    return;
  }
  const int was_enabled = PyGC_Disable();  // no collection while the count is probed
  bool ok = false;
  PyObject* th = PyObject_CallMethod(gc, "get_threshold", nullptr);
  if (th != nullptr && PyTuple_Check(th) && PyTuple_GET_SIZE(th) == 3) {
    const long t0 = PyLong_AsLong(PyTuple_GET_ITEM(th, 0));
    ok = t0 == *threshold;
    if (ok) {  // the threshold as the gc module sets it
      PyObject* r = PyObject_CallMethod(gc, "set_threshold", "lOO", t0 + 1,
                                        PyTuple_GET_ITEM(th, 1), PyTuple_GET_ITEM(th, 2));
      ok = r != nullptr && *threshold == t0 + 1;
      Py_XDECREF(r);
      r = PyObject_CallMethod(gc, "set_threshold", "lOO", t0, PyTuple_GET_ITEM(th, 1),
                              PyTuple_GET_ITEM(th, 2));
      ok = ok && r != nullptr && *threshold == t0;
      Py_XDECREF(r);
    }
    if (ok) {  // the count moved by one allocation and one free
      const int c0 = *count;
      PyObject* probe = PySet_New(nullptr);  // (a set: no free list in between)
      ok = probe != nullptr && *count == c0 + 1;
      Py_XDECREF(probe);
      ok = ok && *count == c0;
    }
  }
  Py_XDECREF(th);
  Py_DECREF(gc);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    ok = false;
  }
  if (was_enabled) {
    PyGC_Enable();
  }
  young_count = ok ? count : nullptr;
#endif
}

bool gc_count_active() {
  return young_count != nullptr;
}

int gc_young() {
  return young_count != nullptr ? *young_count : 0;
}

void gc_untrack_new(PyObject* o, int before) {
  if (PyObject_GC_IsTracked(o)) {
    PyObject_GC_UnTrack(o);
  }
  if (young_count != nullptr && *young_count == before + 1) {
    *young_count = before;
  }
}

void gc_young_at_least(int before) {
  if (young_count != nullptr && *young_count < before) {
    *young_count = before;
  }
}

void gc_young_credit(int k) {
  if (young_count != nullptr && k > 0) {
    *young_count += k;
  }
}

void gc_young_debit(int k) {
  if (young_count != nullptr && k > 0) {
    *young_count = *young_count > k ? *young_count - k : 0;
  }
}

}  // namespace genie
