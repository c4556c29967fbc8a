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

// Make the free of a `type` instance (genie.graph.Node) leave the young count where it was
// before, with everything it releases: a node's objects (its lists, Refs, weak references,
// Storages, and the nodes of a pending graph dropped unread, freed one after the other) were
// taken off the count at allocation (gc_untrack_new), and their frees would otherwise eat the
// count the program's own allocations built (a program that dropped a 50-op chain unread every
// 50 steps ran no young collection at all, and its garbage cycles stayed). A counted value freed
// with them (a node a Python record made, a computed tensor) stays counted: a collection comes
// sooner, never later. Idempotent; false where the count is not kept.
bool gc_count_frees_of(PyTypeObject* type);

}  // namespace genie
