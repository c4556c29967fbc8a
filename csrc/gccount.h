// The cyclic GC's young-generation count and the objects genie._C keeps off the collector.
#pragma once
#include <Python.h>

namespace genie {

// Check the build's offsets (csrc/gc_probe.c) against the gc module; until this succeeds (and
// where the build had none), the functions below only track and untrack.
void gc_count_init();

// Whether gc_count_init found the count (the functions below keep it).
bool gc_count_active();

// The young generation's count now (0 where gc_count_init did not find it): read it right before
// an allocation that gc_untrack_new is then given.
int gc_young();

// `o`, just allocated (the count read `before` right before it), off the collector's lists and,
// where its allocation counted (exactly one more than `before`: not a list from CPython's free
// list, no collection in between), off the count too. Only for objects allocated this way: an
// object untracked later may have been counted before the last collection reset the count, and
// taking it off then would hide allocations of the program's own from the collector.
void gc_untrack_new(PyObject* o, int before);

// The count back up to `before` where frees since lowered it: CPython lowers the count at every
// free of a collector-allocated object, those gc_untrack_new took off the count at allocation
// too, so freeing a run's recorded nodes (a few such objects each) would eat the count the
// program's own allocations built and delay the collection of its garbage cycles (with no
// counted object of Genie's in between, indefinitely). Called after code that frees such objects
// in bulk (csrc/bind.cpp); counted objects freed there stay counted (a collection comes sooner,
// never later).
void gc_young_at_least(int before);

// The count up by `k`: frees that lowered it outside any bracket above and are known only later
// (the liveness tokens of a pending node dropped unread: csrc/node.cpp).
void gc_young_credit(int k);

// The count down by `k` (not below 0), as CPython lowers it at each free of a collector-allocated
// object: where Genie frees no such object but once did (a liveness token and its weak reference
// per output, before the count per output: csrc/wrapper.cpp, csrc/node.cpp), so that the
// collector runs when it ran before (docs/node-layout.md section 7, step 2b).
void gc_young_debit(int k);

}  // namespace genie
