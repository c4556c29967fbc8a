// genie._C.Node: the recorded node's fields as a native struct (docs/node-layout.md, step 4a).
// genie.graph.Node is a Python subclass of it with no fields of its own (its methods and
// properties); the natives read and write the fields below through the member table's offsets
// (slots.h slot_offset), which are the struct's.
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>

namespace genie {

// One recorded op. Every field is an object reference, NULL until set (reading an unset one from
// Python raises AttributeError, as an unset slot did); the names are genie.graph.Node's.
struct NodeObject {
  PyObject_HEAD
  PyObject* op;
  PyObject* leaves;
  PyObject* spec;
  PyObject* metas;
  PyObject* out_spec;
  PyObject* st;  // "_st": a single output's Storage, else a list (slots.h per_output)
  PyObject* writes;
  PyObject* out;  // "_out": a single output's liveness weak reference, else a list
  PyObject* values;
  PyObject* executed;
  PyObject* index;
  PyObject* rng;
  PyObject* graph;
  PyObject* seq;  // "_seq"
  PyObject* where;
  PyObject* n_consumers;
  PyObject* tags;
  PyObject* entry;
  PyObject* ctx;
  PyObject* wref;  // "_wref": the node's own weak reference (reader lists hold it)
  PyObject* weaklist;
};

// The type genie._C.Node (a static type: its deallocator never changes).
extern PyTypeObject NodeType;

// Whether `t` is genie._C.Node or a subclass that adds no field (genie.graph.Node).
bool is_node_type(PyTypeObject* t);

// Adds Node to the genie._C module.
void add_node_type(pybind11::module_& m);

}  // namespace genie
