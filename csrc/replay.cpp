// genie._C._ReplayProgram: a repeated plan's tape compiled once, run without a Python call per op.
//
// genie/backends/eager.py's run_instrs (the interpreter) is the reference: a program computes
// what it computes, op for op, in tape order, with the same frees. What the interpreter decides
// per step from Python objects is decided here once per plan (genie/backends/native_replay.py
// compiles, memoized on Plan.artifacts):
//
// * each instruction's c10::OperatorHandle, and its argument stack built against the schema from
//   the recorded (args, kwargs) by torch's own createStackForSchema (the conversion
//   OpOverload.__call__ does, numbers-as-tensors rule included), kept as a template;
// * patches into a copy of that template for what changes per step: registers (the values of
//   Slots, also inside lists such as cat's Tensor[]; an in-place view op's self through
//   aten::alias), the step's own leaves (floats, host tensors, ints of a shape-generic tape:
//   converted by toIValue with the argument's type, as OpOverload.__call__ converts them),
//   empty_strided tensors for MetaArgs, and the run's real device; a leaf whose value the
//   template holds (a float, an int) is not patched when the step's instruction is the very
//   object the template was built from (kept by the step);
// * outputs (returns flattened as optree.tree_leaves(none_is_leaf=True) flattens them), frees
//   after last use, kept slots;
// * for add/sub/mul/div.Tensor of a float32 CPU tensor and a float constant, the constant's
//   wrapped-number tensor cast to float32 once (Program::cast_scalar), not by TensorIterator on
//   every call: the same value and type promotion.
//
// Runs hold the GIL (kernels that take it, Python kernels, re-enter it) and run under the
// caller's no_grad and disabled dispatch modes, below the autograd keys. A failing instruction
// does not raise here: run returns (its index, the Python exception eager would raise, the live
// registers {slot: value}), and the caller raises genie.errors.ExecutionError from it with that
// progress; the executor binds the nodes that ran, so nothing is re-run after a partial failure.
#include <algorithm>
#include <mutex>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/device_lazy_init.h>
#include <torch/csrc/utils/python_arg_parser.h>

#include "replay.h"

#include <c10/core/GradMode.h>

#include "bind.h"
#include "memory.h"
#include "node.h"
#include "state.h"

namespace py = pybind11;

namespace {

// What a patch puts into the stack (the codes genie/backends/native_replay.py uses).
enum class Src : int {
  Slot = 0,       // a register
  SlotAlias = 1,  // aten::alias of a register (self of an in-place view op)
  Leaf = 2,       // the step's leaf, converted with the argument's type
  Meta = 3,       // empty_strided of a fixed shape/stride/dtype on the instruction's device
  MetaStep = 4,   // empty_strided of the step's MetaArg leaf
  Device = 5,     // the instruction's real device
};

struct Patch {  // (what every run reads first: one cache line up to `type`)
  Src src;
  int32_t arg;   // stack position
  int32_t elem;  // -1: the argument itself; else an element of its list
  bool baked = false;         // Leaf: the template holds the compiled instruction's value
  int64_t a;     // Slot*: register; Leaf, MetaStep: leaf position
  std::optional<int32_t> n;   // Leaf of a fixed-size list argument (int[2] takes one int)
  c10::TypeKind kind = c10::TypeKind::AnyType;  // Leaf: type->kind()
  c10::TypePtr type;          // Leaf: the type to convert to
  std::vector<int64_t> shape, stride;  // Meta
  at::ScalarType dtype = at::kFloat;   // Meta
};

// A compiled graph's placeholder as a direct call learned it: an int's value, or a tensor's
// device, dtype, dispatch keys (math bits), sizes and strides (genie.graphs' shape class).
struct Placeholder {
  bool tensor = false;
  int64_t value = 0;
  c10::Device device = c10::Device(c10::kCPU);
  at::ScalarType dtype = at::kFloat;
  c10::DispatchKeySet keys;
  std::vector<int64_t> sizes, strides;

  static std::optional<Placeholder> of(const c10::IValue& v) {
    Placeholder p;
    if (v.isInt()) {
      p.value = v.toInt();
      return p;
    }
    if (!v.isTensor() || !v.toTensor().defined() ||
        v.toTensor().layout() != c10::kStrided) {
      return std::nullopt;
    }
    const at::Tensor& t = v.toTensor();
    p.tensor = true;
    p.device = t.device();
    p.dtype = t.scalar_type();
    p.keys = t.key_set();
    p.sizes = t.sizes().vec();
    p.strides = t.strides().vec();
    return p;
  }

  bool matches(const c10::IValue& v) const {
    if (!tensor) {
      return v.isInt() && v.toInt() == value;
    }
    if (!v.isTensor()) {
      return false;
    }
    const at::Tensor& t = v.toTensor();
    return t.defined() && t.key_set() == keys && t.scalar_type() == dtype &&
           t.device() == device && t.sizes().equals(sizes) && t.strides().equals(strides);
  }
};

// genie::graph calls run directly (Program::call_direct), for genie.stats() (graph_cache_hits).
int64_t direct_graph_calls = 0;

// The fields every run reads come first (Program::run prefetches them a few instructions ahead:
// a step's data is cold by the time it runs again, after a step's recording on the host).
struct Step {
  bool upload = false;
  bool reads_leaves = false;       // a Leaf or MetaStep patch (or an upload, a random op)
  // a leaf patch that is not baked (see Patch::baked), a MetaStep patch, an upload or a random
  // op: the step's leaves are read even when its instruction is the template's own (`source`)
  bool reads_step_leaves = false;
  bool rng = false;
  bool numbers_as_tensors = false;
  // add/sub/mul/div.Tensor: `other` may be a Python float made a wrapped-number tensor (double);
  // see cast_scalar. The cache holds that tensor cast once for the last (tensor, dtype) seen.
  bool binary_scalar = false;
  int64_t device = 0;  // index into run's devices: 0 the run's device
  // The argument template. A position a patch fills whole holds None here, not the placeholder
  // the template was built with: copying it per run touches no placeholder's reference count.
  std::vector<c10::IValue> stack;
  std::vector<Patch> patches;      // by (arg, elem)
  std::vector<int64_t> outs;  // -1: an output not kept in a slot
  std::vector<int64_t> frees;
  std::optional<c10::OperatorHandle> op;
  // The instruction the template was built from (held, so that its address stays its own): a
  // step whose tape has this very object here has the baked leaves' values in the template
  // already (a plan's shared instruction; only rebuilt ones carry another step's values).
  py::object source;
  // genie::graph / genie::graph_mut: the compiled callable of the shape class its inputs had
  // (see Program::call_direct), learned from `learn` after a dispatched call.
  py::object learn;           // learn(*args) -> None or (callable, ((arg, elem), ...)); or null
  mutable at::Tensor scalar_src, scalar_cast;
  mutable py::object direct;  // the callable, called with the graph's placeholders; or null
  mutable std::vector<std::pair<int32_t, int32_t>> order;  // each placeholder's (arg, elem)
  mutable std::vector<Placeholder> shape_class;            // what `direct` was learned for
  mutable int learns = 0;
};

// The bytes of a Step that every run reads (up to and including `source`).
inline size_t step_hot_bytes(const Step& s) {
  return static_cast<size_t>(reinterpret_cast<const char*>(&s.source + 1) -
                             reinterpret_cast<const char*>(&s));
}

// opAllowsNumbersAsTensors of torch/csrc/jit/python/init.cpp: what OpOverload.__call__ sets
// around its argument conversion.
bool numbers_as_tensors(const std::string& name) {
  const auto sep = name.find("::");
  if (sep == std::string::npos) {
    return false;
  }
  const std::string ns = name.substr(0, sep);
  if (ns == "prims" || ns == "nvprims") {
    return true;
  }
  return ns == "aten" && torch::should_allow_numbers_as_tensors(name.substr(sep + 2));
}

bool tensor_like(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::TensorType) {
    return true;
  }
  if (auto o = t->cast<c10::OptionalType>()) {
    return o->getElementType()->kind() == c10::TypeKind::TensorType;
  }
  return false;
}

bool device_like(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::DeviceObjType) {
    return true;
  }
  if (auto o = t->cast<c10::OptionalType>()) {
    return o->getElementType()->kind() == c10::TypeKind::DeviceObjType;
  }
  return false;
}

c10::TypePtr list_element(const c10::TypePtr& t) {
  c10::TypePtr u = t;
  if (auto o = u->cast<c10::OptionalType>()) {
    u = o->getElementType();
  }
  if (auto l = u->cast<c10::ListType>()) {
    return l->getElementType();
  }
  return nullptr;
}

[[noreturn]] void unsupported(const std::string& why) {
  throw std::invalid_argument("genie native replay: " + why);
}

// A returned value flattened as optree.tree_leaves(out, none_is_leaf=True) flattens what
// OpOverload.__call__ returns (tuples and lists are nodes, everything else a leaf).
void flatten(c10::IValue&& v, std::vector<c10::IValue>& out) {
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) {
      flatten(c10::IValue(e), out);
    }
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      flatten(c10::IValue(e), out);
    }
  } else {
    out.push_back(std::move(v));
  }
}

at::Generator generator_for(const c10::Device& dev) {
  // genie.backends.eager.generator_for: the CUDA device's default generator, else the CPU one
  if (dev.is_cuda()) {
    return at::globalContext().defaultGenerator(
        c10::Device(c10::kCUDA, dev.has_index() ? dev.index() : 0));
  }
  return at::globalContext().defaultGenerator(c10::Device(c10::kCPU));
}

// genie.backends.eager.seed_from (splitmix64); Python's & 2**64-1 is uint64 wrap-around.
uint64_t seed_from(uint64_t seed, uint64_t offset) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (offset + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFFULL;
}

// leaves[p] of an instruction's leaf list (a list, or any sequence), or of a recorded node
// (Plan.replay_source puts the nodes in place of stale instructions: their leaves are inline,
// csrc/node.h, read without making the list), as a new reference.
py::object leaf_at(const py::object& leaves, int64_t p) {
  PyObject* l = leaves.ptr();
  if (PyList_Check(l) && p >= 0 && p < PyList_GET_SIZE(l)) {
    return py::reinterpret_borrow<py::object>(PyList_GET_ITEM(l, p));
  }
  if (genie::is_node_type(Py_TYPE(l))) {
    int32_t out = -1;
    PyObject* x = genie::node_leaf(l, p, &out);
    if (x != nullptr && out < 0) {
      return py::reinterpret_borrow<py::object>(x);
    }
    static PyObject* const leaves_name = PyUnicode_InternFromString("leaves");
    py::object list = py::reinterpret_steal<py::object>(PyObject_GetAttr(l, leaves_name));
    if (!list) {
      throw py::error_already_set();
    }
    return leaf_at(list, p);  // (a lazy input's Ref, or the IndexError of a released node)
  }
  PyObject* r = PySequence_GetItem(l, p);
  if (r == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(r);
}

PyObject* get_attr(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_GetAttr(o, name);
  if (r == nullptr) {
    throw py::error_already_set();
  }
  return r;
}

std::vector<int64_t> int_tuple(PyObject* o) {
  return py::cast<std::vector<int64_t>>(py::handle(o));
}

at::ScalarType dtype_of(PyObject* o) {
  if (!THPDtype_Check(o)) {
    throw std::invalid_argument("genie native replay: expected a torch.dtype");
  }
  return reinterpret_cast<THPDtype*>(o)->scalar_type;
}

c10::Device device_of(PyObject* o) {
  if (!THPDevice_Check(o)) {
    throw std::invalid_argument("genie native replay: expected a torch.device");
  }
  return reinterpret_cast<THPDevice*>(o)->device;
}

// toIValue(x, type) where the answer is plain: a Python int (not a bool) for an int or SymInt
// argument, a Python float for a float argument, the argument itself (no fixed-size list). False
// for anything else (and an int beyond int64: toIValue raises its error).
inline bool leaf_number(PyObject* x, c10::TypeKind kind, c10::IValue& v) {
  if ((kind == c10::TypeKind::IntType || kind == c10::TypeKind::SymIntType) &&
      PyLong_CheckExact(x)) {
    int overflow = 0;
    const long long k = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow != 0 || (k == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    v = static_cast<int64_t>(k);
    return true;
  }
  if (kind == c10::TypeKind::FloatType && PyFloat_CheckExact(x)) {
    v = PyFloat_AS_DOUBLE(x);
    return true;
  }
  return false;
}

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// The `bytes` from `p` on, a cache line each.
inline void prefetch_lines(const void* p, size_t bytes) {
  const char* b = static_cast<const char*>(p);
  for (size_t at = 0; at < bytes; at += 64) {
    prefetch(b + at);
  }
}

// What run reads an instruction's per-step leaves from: genie.planner.Instr's `leaves` slot
// read in place (a member of its __slots__, found once per type), or a node (the leaves inline,
// leaf_at); anything else through getattr.
struct LeafReader {
  PyTypeObject* instr = nullptr;  // the last Instr type seen, and its `leaves` slot's offset
  Py_ssize_t offset = -1;
  PyTypeObject* node = nullptr;   // the last type seen that is_node_type accepted

  bool is_node(PyObject* o) {
    PyTypeObject* t = Py_TYPE(o);
    if (t == node) {
      return true;
    }
    if (t == instr || !genie::is_node_type(t)) {
      return false;
    }
    node = t;
    return true;
  }

  // The slot's value (borrowed) when `o` is of an Instr type with a `leaves` member; nullptr if
  // not (or unset: getattr then raises its AttributeError).
  PyObject* slot(PyObject* o, PyObject* name) {
    PyTypeObject* t = Py_TYPE(o);
    if (t != instr) {
      PyObject* d = _PyType_Lookup(t, name);  // borrowed
      if (d == nullptr || Py_TYPE(d) != &PyMemberDescr_Type) {
        return nullptr;
      }
      const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
      if (m->type != T_OBJECT_EX || (m->flags & READONLY) != 0) {
        return nullptr;
      }
      instr = t;
      offset = m->offset;
    }
    return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + offset);
  }

  // A new reference to the leaves of `src` (itself when a node: read in place by leaf_at).
  py::object leaves(PyObject* src, PyObject* name) {
    if (is_node(src)) {
      return py::reinterpret_borrow<py::object>(src);
    }
    if (PyObject* v = slot(src, name)) {
      return py::reinterpret_borrow<py::object>(v);
    }
    return py::reinterpret_steal<py::object>(get_attr(src, name));
  }

  // The cache lines reading instruction `src`'s leaves touches: the object's own (stage 0), then
  // an Instr's leaf list and its item array (stage 1, once the object's line is in).
  void prefetch_instr(PyObject* src, int stage) {
    if (stage == 0) {
      prefetch_lines(src, 256);  // (a node's first leaves follow its fields)
      return;
    }
    if (Py_TYPE(src) == instr) {
      PyObject* l = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(src) + offset);
      if (l != nullptr && PyList_CheckExact(l)) {
        prefetch(l);
        prefetch(reinterpret_cast<PyListObject*>(l)->ob_item);
      }
    }
  }
};

class Program {
 public:
  Program(int64_t registers, std::vector<int64_t> keep)
      : registers_(registers), keep_(std::move(keep)) {}

  void add_upload(int64_t out, int64_t device, std::vector<int64_t> frees) {
    Step s;
    s.upload = true;
    s.reads_leaves = true;
    s.reads_step_leaves = true;
    s.device = device;
    s.outs = {out};
    s.frees = std::move(frees);
    freed_ += static_cast<int64_t>(s.frees.size());
    steps_.push_back(std::move(s));
  }

  // One op instruction. `args`/`kwargs`: the recorded argument tree with a representative
  // value at every leaf (a placeholder tensor for Slots and MetaArgs); `margs`/`mkwargs`: the
  // same tree with, per leaf, -1 (a constant, baked into the template) or the index of its
  // entry in `patches`: (kind, a) or, for a fixed MetaArg, (3, shape, stride, dtype).
  void add_op(const std::string& name, const std::string& overload, const py::tuple& args,
              const py::dict& kwargs, const py::tuple& margs, const py::dict& mkwargs,
              const py::list& patches, std::vector<int64_t> outs, std::vector<int64_t> frees,
              int64_t device, bool rng, py::object source) {
    Step s;
    s.source = std::move(source);
    s.op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const c10::FunctionSchema& schema = s.op->schema();
    s.numbers_as_tensors = numbers_as_tensors(name);
    s.binary_scalar = (name == "aten::add" || name == "aten::sub" || name == "aten::mul" ||
                       name == "aten::div") && overload == "Tensor";
    {
      torch::jit::ToIValueAllowNumbersAsTensors allow(s.numbers_as_tensors);
      s.stack = torch::jit::createStackForSchema(
          schema, torch::jit::tuple_slice(args), py::reinterpret_borrow<py::kwargs>(kwargs),
          std::nullopt);
    }
    for (size_t k = 0; k < margs.size(); ++k) {
      mark(s, schema, static_cast<int32_t>(k), margs[k], patches);
    }
    for (const auto& item : mkwargs) {
      const auto j = schema.argumentIndexWithName(py::cast<std::string>(item.first));
      if (!j) {
        unsupported("keyword argument not in the schema");
      }
      mark(s, schema, static_cast<int32_t>(*j), item.second, patches);
    }
    std::sort(s.patches.begin(), s.patches.end(), [](const Patch& x, const Patch& y) {
      return std::make_pair(x.arg, x.elem) < std::make_pair(y.arg, y.elem);
    });
    s.rng = rng;
    s.reads_leaves = rng;
    s.reads_step_leaves = rng;
    for (const Patch& p : s.patches) {
      s.reads_leaves |= p.src == Src::Leaf || p.src == Src::MetaStep;
      s.reads_step_leaves |= (p.src == Src::Leaf && !p.baked) || p.src == Src::MetaStep;
      if (p.elem < 0 && !(p.src == Src::Leaf && p.baked)) {
        s.stack[p.arg] = c10::IValue();  // filled by every run (see Step::stack)
      }
    }
    s.device = device;
    s.outs = std::move(outs);
    s.frees = std::move(frees);
    freed_ += static_cast<int64_t>(s.frees.size());
    steps_.push_back(std::move(s));
  }

  // Run on `devices` (0: the run's device; k: remote_accelerator's other real devices) with
  // the step's `inputs` ({slot: tensor}) and `instrs` (its tape's, read for per-step leaves).
  // Returns {slot: value} of the kept slots, or (instruction index, exception, {slot: value} of
  // the live registers) when one failed.
  //
  // With `early` (a callable) and 0 < `split` < the program's length: once instruction
  // `split - 1` has run, `early({slot: value})` is called with the kept slots defined so far
  // (a server answers with them while the rest runs: genie/remote/worker.py "early replies").
  // The caller picks `split` so that nothing after it writes what it reads; an exception
  // `early` raises propagates as the failure of instruction `split - 1`.
  //
  // With `check` (a callable) and `check_at` (instruction indices): before each of those
  // instructions runs, `check(i, {slot: value})` is called with the values of `check_slots`
  // defined then (a server's index check: genie/index_check.py, arguments checked on the device
  // before a kernel that would assert on them); an exception it raises is the failure of
  // instruction `i` (instructions [0, i) ran).
  //
  // A program with a graph hook (genie/backends/cuda_graphs.py: a steady plan's window replayed
  // as a CUDA graph) hands a plain run (no `split`, `early` or `check`) to the hook, which runs
  // it through `run_plain` and its window's programs.
  py::object run(const py::dict& inputs, const py::list& instrs, const py::list& devices,
                 int64_t split = -1, const py::object& early = py::none(),
                 const py::object& check = py::none(),
                 const std::vector<int64_t>& check_at = {},
                 const std::vector<int64_t>& check_slots = {}) {
    if (graph_hook_ && split < 0 && early.is_none() && check.is_none()) {
      // (the program passed, not held by the hook: no reference cycle through C++)
      return graph_hook_(py::cast(this, py::return_value_policy::reference), inputs, instrs,
                         devices);
    }
    return run_plain(inputs, instrs, devices, split, early, check, check_at, check_slots);
  }

  // The hook run calls as hook(program, inputs, instrs, devices) (or None: removes it).
  void set_graph_hook(py::object hook) {
    graph_hook_ = hook.is_none() ? py::object() : std::move(hook);
  }

  py::object run_plain(const py::dict& inputs, const py::list& instrs, const py::list& devices,
                       int64_t split = -1, const py::object& early = py::none(),
                       const py::object& check = py::none(),
                       const std::vector<int64_t>& check_at = {},
                       const std::vector<int64_t>& check_slots = {}) {
    static PyObject* const leaves_name = PyUnicode_InternFromString("leaves");
    static PyObject* const rng_name = PyUnicode_InternFromString("rng");
    static PyObject* const meta_name = PyUnicode_InternFromString("meta");
    static PyObject* const shape_name = PyUnicode_InternFromString("shape");
    static PyObject* const stride_name = PyUnicode_InternFromString("stride");
    static PyObject* const dtype_name = PyUnicode_InternFromString("dtype");

    std::vector<c10::Device> devs;
    devs.reserve(devices.size());
    for (const auto& d : devices) {
      devs.push_back(device_of(d.ptr()));
      torch::utils::maybe_initialize_device(devs.back());  // as Python's .to / factories do
    }
    std::vector<c10::IValue> regs(registers_);
    for (const auto& item : inputs) {
      if (!THPVariable_Check(item.second.ptr())) {
        unsupported("a tape input that is not a tensor");
      }
      regs.at(py::cast<int64_t>(item.first)) = THPVariable_Unpack(item.second.ptr());
    }
    if (static_cast<size_t>(PyList_GET_SIZE(instrs.ptr())) != steps_.size()) {
      unsupported("a tape of another length than its program");
    }

    std::vector<char> checked(check.is_none() ? 0 : steps_.size(), 0);
    for (int64_t i : check_at) {
      if (i >= 0 && static_cast<size_t>(i) < checked.size()) {
        checked[i] = 1;
      }
    }
    for (int64_t k : check_slots) {
      if (!checked.empty() && (k < 0 || static_cast<size_t>(k) >= regs.size())) {
        unsupported("a checked slot outside the program's registers");
      }
    }
    std::vector<c10::IValue> stack, results;  // reused: no allocation per instruction
    // The real values of a tape never carry autograd history (it lives on the LazyTensors, and
    // runs are under no_grad): each op goes straight to its backend kernel, not through the
    // Autograd and ADInplaceOrView kernels first (a view's autograd metadata alone is ~4k
    // instructions). Storage sharing, which Genie's write semantics rest on, is the kernels'.
    c10::impl::ExcludeDispatchKeyGuard below_autograd(
        c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    LeafReader reader;
    // Prefetch distances (a step's data is cold: the host recorded a step since it last ran):
    // instruction i + 2's Step and instruction object, i + 1's template, patches, outputs, frees
    // and leaf list (each stage reads what the one before fetched).
    constexpr size_t kAhead0 = 2, kAhead1 = 1;
    const size_t ns = steps_.size();
    for (size_t q = 0; q < ns && q < kAhead0; ++q) {
      prefetch_lines(&steps_[q], step_hot_bytes(steps_[q]));
      reader.prefetch_instr(PyList_GET_ITEM(instrs.ptr(), q), 0);
    }
    for (size_t i = 0; i < ns; ++i) {
      if (i + kAhead0 < ns) {
        prefetch_lines(&steps_[i + kAhead0], step_hot_bytes(steps_[i + kAhead0]));
        reader.prefetch_instr(PyList_GET_ITEM(instrs.ptr(), i + kAhead0), 0);
      }
      if (i + kAhead1 < ns) {
        const Step& t = steps_[i + kAhead1];
        prefetch_lines(t.stack.data(), t.stack.size() * sizeof(c10::IValue));
        prefetch_lines(t.patches.data(), t.patches.size() * sizeof(Patch));
        prefetch(t.outs.data());
        prefetch(t.frees.data());
        if (t.reads_leaves) {
          reader.prefetch_instr(PyList_GET_ITEM(instrs.ptr(), i + kAhead1), 1);
        }
        // its tensor arguments computed before this instruction (inputs, weights): the kernel
        // reads their TensorImpls first thing (sizes, strides, storage)
        for (const Patch& p : t.patches) {
          if (p.src == Src::Slot || p.src == Src::SlotAlias) {
            const c10::IValue& r = regs[p.a];
            if (r.isTensor()) {
              prefetch_lines(r.unsafeToTensorImpl(), sizeof(c10::TensorImpl));
            }
          }
        }
      }
      const Step& s = steps_[i];
      const c10::Device& dev = devs.at(s.device);
      if (!checked.empty() && checked[i]) {
        py::dict now;
        for (int64_t k : check_slots) {
          if (!regs[k].isNone()) {
            now[py::int_(k)] = torch::jit::toPyObject(regs[k]);
          }
        }
        try {
          check(py::int_(i), now);
        } catch (py::error_already_set& e) {
          e.restore();
          return failure(i, regs);
        }
      }
      try {
        PyObject* src = PyList_GET_ITEM(instrs.ptr(), i);
        const bool same = !s.upload && s.source.ptr() == src;
        py::object leaves;  // the step's leaves of this instruction, when it reads any
        if (s.reads_step_leaves || (s.reads_leaves && !same)) {
          leaves = reader.leaves(src, leaves_name);
        }
        results.clear();
        if (s.upload) {
          // ins.leaves[0].to(dev, copy=dev.type == "cpu"), as Tensor.to(device) spells it
          const at::Tensor& host = THPVariable_Unpack(leaf_at(leaves, 0).ptr());
          results.emplace_back(host.to(host.options().device(dev).memory_format(std::nullopt),
                                       /*non_blocking=*/false, /*copy=*/dev.is_cpu()));
        } else {
          stack = s.stack;
          patch(s, stack, regs, leaves, dev, same, meta_name, shape_name, stride_name,
                dtype_name);
          if (s.binary_scalar) {
            cast_scalar(s, stack);
          }
          if (s.rng) {
            py::object rng = py::reinterpret_steal<py::object>(
                get_attr(PyList_GET_ITEM(instrs.ptr(), i), rng_name));
            call_seeded(s, stack, dev, rng);
          } else if (!s.learn || !call_direct(s, stack, results)) {
            std::vector<c10::IValue> args;
            if (s.learn && s.learns < kLearns) {
              args = stack;  // (the kernel consumes its arguments)
            }
            s.op->callBoxed(stack);
            if (!args.empty()) {
              learn_direct(s, args);
            }
          }
          for (auto& r : stack) {
            flatten(std::move(r), results);
          }
        }
        const size_t n = std::min(results.size(), s.outs.size());
        for (size_t k = 0; k < n; ++k) {
          if (s.outs[k] >= 0) {
            regs[s.outs[k]] = std::move(results[k]);
          }
        }
      } catch (py::error_already_set& e) {
        e.restore();
        return failure(i, regs);
      } catch (...) {
        torch::translate_exception_to_python(std::current_exception());
        return failure(i, regs);
      }
      for (int64_t f : s.frees) {
        regs[f] = c10::IValue();
      }
      if (static_cast<int64_t>(i) + 1 == split && !early.is_none()) {
        py::dict now;
        for (int64_t k : keep_) {
          if (!regs[k].isNone()) {
            now[py::int_(k)] = torch::jit::toPyObject(regs[k]);
          }
        }
        try {
          early(now);
        } catch (py::error_already_set& e) {
          e.restore();
          return failure(i, regs);
        }
      }
    }
    py::dict out;
    for (int64_t k : keep_) {
      out[py::int_(k)] = torch::jit::toPyObject(std::move(regs[k]));
    }
    return out;
  }

  // Makes the last instruction added (a genie::graph or genie::graph_mut call) call its graph's
  // compiled code directly: `learn`, given the instruction's arguments after a dispatched call,
  // returns None or the callable its kernel called for them (genie.graphs.direct) and where each
  // of the graph's placeholders is among the arguments.
  void direct_last(py::object learn) {
    if (steps_.empty() || steps_.back().upload || steps_.back().rng) {
      unsupported("a direct graph call on an instruction that is not an op");
    }
    if (!learn.is_none()) {
      steps_.back().learn = std::move(learn);
    }
  }

  int64_t freed() const { return freed_; }
  size_t size() const { return steps_.size(); }

 private:
  void mark(Step& s, const c10::FunctionSchema& schema, int32_t j, const py::handle& m,
            const py::list& patches) {
    if (j < 0 || static_cast<size_t>(j) >= schema.arguments().size()) {
      unsupported("an argument position outside the schema");
    }
    const c10::Argument& argument = schema.arguments()[j];
    if (py::isinstance<py::int_>(m)) {
      const auto k = py::cast<int64_t>(m);
      if (k >= 0) {
        add_patch(s, j, -1, argument.real_type(), argument.N(), patches[k]);
      }
      return;
    }
    if (!py::isinstance<py::list>(m) && !py::isinstance<py::tuple>(m)) {
      unsupported("an argument tree node that is not a list or tuple");
    }
    const py::sequence elems = py::reinterpret_borrow<py::sequence>(m);
    for (size_t e = 0; e < elems.size(); ++e) {
      const py::object x = elems[e];
      if (!py::isinstance<py::int_>(x)) {
        unsupported("a nested list argument");
      }
      const auto k = py::cast<int64_t>(x);
      if (k < 0) {
        continue;
      }
      const c10::TypePtr elem_type = list_element(argument.real_type());
      if (!elem_type || !s.stack[j].isList() || s.stack[j].toListRef().size() != elems.size()) {
        unsupported("a list argument the schema does not take as a list");
      }
      add_patch(s, j, static_cast<int32_t>(e), elem_type, std::nullopt, patches[k]);
    }
  }

  static void add_patch(Step& s, int32_t j, int32_t e, const c10::TypePtr& type,
                        std::optional<int32_t> n, const py::handle& spec) {
    const py::tuple t = py::reinterpret_borrow<py::tuple>(spec);
    Patch p;
    p.src = static_cast<Src>(py::cast<int>(t[0]));
    p.arg = j;
    p.elem = e;
    switch (p.src) {
      case Src::Slot:
      case Src::SlotAlias:
      case Src::MetaStep:
        if (!tensor_like(type)) {
          unsupported("a tensor where the schema takes " + type->str());
        }
        p.a = py::cast<int64_t>(t[1]);
        break;
      case Src::Meta:
        if (!tensor_like(type)) {
          unsupported("a tensor where the schema takes " + type->str());
        }
        p.a = -1;
        p.shape = py::cast<std::vector<int64_t>>(t[1]);
        p.stride = py::cast<std::vector<int64_t>>(t[2]);
        p.dtype = dtype_of(t[3].ptr());
        break;
      case Src::Leaf:
        p.a = py::cast<int64_t>(t[1]);
        p.type = type;
        p.kind = type->kind();
        p.n = n;
        p.baked = t.size() > 2 && py::cast<bool>(t[2]);
        break;
      case Src::Device:
        if (!device_like(type)) {
          unsupported("a device where the schema takes " + type->str());
        }
        p.a = -1;
        break;
      default:
        unsupported("an unknown patch kind");
    }
    s.patches.push_back(std::move(p));
  }

  // `x op 0.5` with x float32: the recorded float is a wrapped-number double tensor (as
  // OpOverload.__call__ converts it), which TensorIterator casts to float32 on every call with a
  // _to_copy (an allocation and a copy kernel: ~5k instructions, more than the op itself on a
  // small tensor). Cast here once per template value instead, to what that cast gives: the same
  // float value, still a wrapped number, so the type promotion is unchanged. Only for float32
  // (float64 needs no cast; a reduced-precision x is computed from the uncast value, which
  // TensorIterator keeps as the original operand).
  static void cast_scalar(const Step& s, std::vector<c10::IValue>& stack) {
    if (stack.size() < 2 || !stack[0].isTensor() || !stack[1].isTensor()) {
      return;
    }
    const at::Tensor& x = stack[0].toTensor();
    const at::Tensor& w = stack[1].toTensor();
    if (!w.defined() || !x.defined() || !w.unsafeGetTensorImpl()->is_wrapped_number() ||
        w.scalar_type() != at::kDouble || !w.device().is_cpu() || !x.device().is_cpu() ||
        x.scalar_type() != at::kFloat || x.unsafeGetTensorImpl()->is_wrapped_number()) {
      // Only on the CPU, where TensorIterator would copy the scalar to float32 per call. A CUDA
      // kernel reads a CPU scalar operand itself, and a float32 one changes its arithmetic there
      // (measured on an H100: x / c and x * c differ from eager's in the last bit).
      return;
    }
    if (!s.scalar_src.defined() || !s.scalar_src.is_same(w)) {
      // the copy kernel's conversion (a static_cast: out-of-range values become inf, as there)
      at::Tensor c = at::detail::empty_cpu({}, at::kFloat);
      *c.mutable_data_ptr<float>() = static_cast<float>(*w.const_data_ptr<double>());
      c.unsafeGetTensorImpl()->set_wrapped_number(true);
      s.scalar_src = w;  // held: its address is not reused while it is the key
      s.scalar_cast = std::move(c);
    }
    stack[1] = s.scalar_cast;
  }

  static void patch(const Step& s, std::vector<c10::IValue>& stack,
                    const std::vector<c10::IValue>& regs, const py::object& leaves,
                    const c10::Device& dev, bool same, PyObject* meta_name,
                    PyObject* shape_name, PyObject* stride_name, PyObject* dtype_name) {
    std::optional<c10::impl::GenericList> list;  // the list argument being patched, copied
    int32_t list_arg = -1;
    for (const Patch& p : s.patches) {
      if (same && p.baked) {
        continue;  // the template holds this very instruction's value
      }
      c10::IValue v;
      switch (p.src) {
        case Src::Slot:
          v = regs[p.a];
          break;
        case Src::SlotAlias:
          v = at::alias(regs[p.a].toTensor());
          break;
        case Src::Leaf: {
          py::object x = leaf_at(leaves, p.a);
          if (!p.n && leaf_number(x.ptr(), p.kind, v)) {
            break;
          }
          torch::jit::ToIValueAllowNumbersAsTensors allow(s.numbers_as_tensors);
          v = torch::jit::toIValue(x, p.type, p.n);
          break;
        }
        case Src::Meta:
          v = at::empty_strided(p.shape, p.stride, at::TensorOptions().dtype(p.dtype).device(dev));
          break;
        case Src::MetaStep: {
          py::object leaf = leaf_at(leaves, p.a);
          auto m = py::reinterpret_steal<py::object>(get_attr(leaf.ptr(), meta_name));
          auto shape = py::reinterpret_steal<py::object>(get_attr(m.ptr(), shape_name));
          auto stride = py::reinterpret_steal<py::object>(get_attr(m.ptr(), stride_name));
          auto dtype = py::reinterpret_steal<py::object>(get_attr(m.ptr(), dtype_name));
          v = at::empty_strided(int_tuple(shape.ptr()), int_tuple(stride.ptr()),
                                at::TensorOptions().dtype(dtype_of(dtype.ptr())).device(dev));
          break;
        }
        case Src::Device:
          v = dev;
          break;
      }
      if (p.elem < 0) {
        stack[p.arg] = std::move(v);
        continue;
      }
      if (p.arg != list_arg) {
        if (list) {
          stack[list_arg] = c10::IValue(std::move(*list));
        }
        list = stack[p.arg].toList().copy();  // the template's list is shared by every run
        list_arg = p.arg;
      }
      list->set(p.elem, std::move(v));
    }
    if (list) {
      stack[list_arg] = c10::IValue(std::move(*list));
    }
  }

  static constexpr int kLearns = 8;  // learned shape classes per instruction, at most

  // A graph call whose arguments have the shape class `direct` was learned for (see
  // Step::shape_class): the compiled code called as the op's kernel would call it
  // (genie.graphs._run, after its lookup by shape class), without the dispatcher's entry into
  // that Python kernel, the lookup and its checks (~10 µs a call). The results replace the
  // stack. False when there is none or the arguments differ (then the op is dispatched).
  static bool call_direct(const Step& s, std::vector<c10::IValue>& stack,
                          std::vector<c10::IValue>& results) {
    if (!s.direct || c10::impl::TorchDispatchModeTLS::any_modes_set()) {
      return false;
    }
    const size_t n = s.order.size();
    py::tuple args(n);
    for (size_t k = 0; k < n; ++k) {
      const auto [a, e] = s.order[k];
      const c10::IValue& v = stack[a].toListRef()[e];
      if (!s.shape_class[k].matches(v)) {
        return false;
      }
      PyTuple_SET_ITEM(args.ptr(), k,
                       v.isTensor() ? THPVariable_Wrap(v.toTensor())
                                    : PyLong_FromLongLong(v.toInt()));
      if (PyTuple_GET_ITEM(args.ptr(), k) == nullptr) {
        throw py::error_already_set();
      }
    }
    py::object out;
    {
      c10::AutoGradMode no_grad(false);  // as genie.graphs._run
      out = s.direct(*args);
    }
    // genie.graphs._tensor_outs
    if (!py::isinstance<py::list>(out) && !py::isinstance<py::tuple>(out)) {
      out = py::make_tuple(out);
    }
    for (const auto& o : out) {
      if (THPVariable_Check(o.ptr())) {
        results.emplace_back(THPVariable_Unpack(o.ptr()));
      }
    }
    stack.clear();
    ++direct_graph_calls;
    return true;
  }

  // After a dispatched graph call: the callable and shape class of its arguments, if any.
  static void learn_direct(const Step& s, const std::vector<c10::IValue>& args) {
    ++s.learns;
    py::tuple py_args(args.size());
    for (size_t k = 0; k < args.size(); ++k) {
      py_args[k] = torch::jit::toPyObject(args[k]);
    }
    py::object r = s.learn(*py_args);
    s.direct = py::object();
    if (r.is_none()) {
      return;
    }
    const py::tuple t = py::reinterpret_borrow<py::tuple>(r);
    std::vector<std::pair<int32_t, int32_t>> order;
    std::vector<Placeholder> shape_class;
    for (const auto& ae : py::reinterpret_borrow<py::tuple>(t[1])) {
      const auto [a, e] = py::cast<std::pair<int32_t, int32_t>>(ae);
      if (a < 0 || static_cast<size_t>(a) >= args.size() || !args[a].isList() || e < 0 ||
          static_cast<size_t>(e) >= args[a].toListRef().size()) {
        unsupported("a graph placeholder outside the call's argument lists");
      }
      auto p = Placeholder::of(args[a].toListRef()[e]);
      if (!p) {
        return;  // (a symbolic int, an undefined or non-strided tensor: dispatched)
      }
      order.emplace_back(a, e);
      shape_class.push_back(std::move(*p));
    }
    s.order = std::move(order);
    s.shape_class = std::move(shape_class);
    s.direct = t[0];
  }

  // eager.run_instr's random ops: the device's generator seeded from the step's (seed, offset)
  // for this call, then restored (also when the op raises).
  static void call_seeded(const Step& s, std::vector<c10::IValue>& stack, const c10::Device& dev,
                          const py::object& rng) {
    const py::tuple pair = py::reinterpret_borrow<py::tuple>(rng);
    const uint64_t seed = PyLong_AsUnsignedLongLongMask(pair[0].ptr());
    const uint64_t offset = PyLong_AsUnsignedLongLongMask(pair[1].ptr());
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    at::Generator gen = generator_for(dev);
    at::Tensor saved;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      saved = gen.get_state();
      gen.set_current_seed(seed_from(seed, offset));
    }
    try {
      s.op->callBoxed(stack);
    } catch (...) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(saved);
      throw;
    }
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(saved);
  }

  // The Python exception now set, returned with the failing instruction's index and the values
  // computed so far that are still live ({slot: value}: the instructions before i ran; the
  // executor binds their nodes, see genie/executor.py).
  static py::object failure(size_t i, std::vector<c10::IValue>& regs) {
    PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != nullptr && value != nullptr) {
      PyException_SetTraceback(value, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (value == nullptr) {
      Py_INCREF(PyExc_RuntimeError);
      value = PyExc_RuntimeError;
    }
    py::object error = py::reinterpret_steal<py::object>(value);
    py::dict live;
    for (size_t k = 0; k < regs.size(); ++k) {
      if (!regs[k].isNone()) {
        live[py::int_(k)] = torch::jit::toPyObject(std::move(regs[k]));
      }
    }
    return py::make_tuple(py::int_(i), error, live);
  }

  int64_t registers_;
  std::vector<int64_t> keep_;
  std::vector<Step> steps_;
  int64_t freed_ = 0;
  py::object graph_hook_;  // see run
};

// Sets the math-bit keys on and grad mode off for a run, and back when it ends (as
// genie.executor.run_tape and genie.backends.eager.run_instrs do around the general path's).
struct RunState {
  long bits = genie::math_bits_on();
  c10::AutoGradMode no_grad{false};
  ~RunState() { genie::math_bits_restore(bits); }
};

// genie._C._hit_run: a fused plan-cache hit (genie.executor._run_hit) run and bound in one call.
// The replay source is `tmpl` (the program's instructions) with the found node of each plan
// instruction in `stale` (its floats and random ops of this step) in its place, or, with an
// edit script (`at`: plan instruction -> the program's instructions made from it), at those;
// the inputs are `inputs` and the script's `consts`. The program runs with the math-bit keys
// on and grad mode off; its kept values are bound to `found` (genie::bind_nodes, releasing the
// list: `outs`, `prune_at`, `untrack` as genie._C._bind_nodes) and, with `hold` >= 0, held in
// the CPU accounting of remote_accelerator:`hold` (genie::mem_hold). Returns (the values of
// the slots `want`, the pending writes bound, the bytes held or -1, the kept values), or what
// the program returns for a failing instruction (index, exception, live values): nothing is
// bound then (the caller binds what ran, as the general path does).
py::object hit_run(Program& program, const py::dict& inputs, const py::object& consts,
                   const py::list& tmpl, const py::object& at, const py::list& found,
                   const py::list& stale, const py::list& devices, const py::list& outs,
                   int64_t prune_at, bool untrack, int64_t hold, const py::list& want) {
  py::list src = tmpl;
  const Py_ssize_t n = PyList_GET_SIZE(tmpl.ptr());
  if (PyList_GET_SIZE(stale.ptr()) != 0) {
    src = py::reinterpret_steal<py::list>(PyList_GetSlice(tmpl.ptr(), 0, n));
    for (const py::handle i : stale) {
      const Py_ssize_t k = PyLong_AsSsize_t(i.ptr());
      if (k < 0 || k >= PyList_GET_SIZE(found.ptr())) {
        throw py::index_error("genie._C._hit_run: a stale instruction outside the plan");
      }
      PyObject* node = PyList_GET_ITEM(found.ptr(), k);
      if (at.is_none()) {
        if (k >= n) {
          throw py::index_error("genie._C._hit_run: a stale instruction outside the program");
        }
        Py_INCREF(node);
        PyList_SetItem(src.ptr(), k, node);
        continue;
      }
      PyObject* js = PyDict_GetItemWithError(at.ptr(), i.ptr());
      if (js == nullptr || !PyList_Check(js)) {
        if (PyErr_Occurred()) {
          throw py::error_already_set();
        }
        throw py::key_error("genie._C._hit_run: a stale instruction the script does not map");
      }
      for (Py_ssize_t q = 0; q < PyList_GET_SIZE(js); ++q) {
        const Py_ssize_t j = PyLong_AsSsize_t(PyList_GET_ITEM(js, q));
        if (j < 0 || j >= n) {
          throw py::index_error("genie._C._hit_run: a script position outside the program");
        }
        Py_INCREF(node);
        PyList_SetItem(src.ptr(), j, node);
      }
    }
  }
  py::dict in = inputs;
  if (!consts.is_none() && PyDict_GET_SIZE(consts.ptr()) != 0) {
    in = py::reinterpret_steal<py::dict>(PyDict_Copy(inputs.ptr()));
    if (PyDict_Update(in.ptr(), consts.ptr()) < 0) {
      throw py::error_already_set();
    }
  }
  py::object r;
  {
    RunState state;
    r = program.run(in, src, devices);
  }
  if (PyTuple_Check(r.ptr())) {
    return r;  // (failing instruction, its exception, live values)
  }
  src = py::list();  // (its nodes freed while bound, as the others: the caller holds none)
  const auto kept = py::reinterpret_borrow<py::dict>(r);
  py::list vals(PyList_GET_SIZE(want.ptr()));  // before anything is bound, as run_tape
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(want.ptr()); ++k) {
    PyObject* v = PyDict_GetItemWithError(kept.ptr(), PyList_GET_ITEM(want.ptr(), k));
    if (v == nullptr) {
      if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
      throw py::key_error("genie._C._hit_run: a requested slot the program does not keep");
    }
    Py_INCREF(v);
    PyList_SET_ITEM(vals.ptr(), k, v);
  }
  const int64_t bound = genie::bind_nodes(found, outs, kept, prune_at, untrack, true);
  int64_t held = -1;
  if (hold >= 0) {
    static PyObject* const values_name = PyUnicode_InternFromString("values");
    PyObject* values = PyObject_CallMethodNoArgs(kept.ptr(), values_name);
    if (values == nullptr) {
      throw py::error_already_set();
    }
    held = genie::mem_hold(hold, py::reinterpret_steal<py::iterable>(values));
  }
  return py::make_tuple(vals, bound, held, kept);
}

} // namespace

namespace genie {

py::object run_program(py::handle program, const py::dict& inputs, const py::list& instrs,
                       const py::list& devices, int64_t split, const py::object& early) {
  return py::cast<Program&>(program).run(inputs, instrs, devices, split, early);
}

py::object hit_run_object(const py::handle& program, const py::dict& inputs,
                          const py::object& consts, const py::list& tmpl, const py::object& at,
                          const py::list& found, const py::list& stale, const py::list& devices,
                          const py::list& outs, int64_t prune_at, bool untrack, int64_t hold,
                          const py::list& want) {
  return hit_run(program.cast<Program&>(), inputs, consts, tmpl, at, found, stale, devices, outs,
                 prune_at, untrack, hold, want);
}

void add_replay_functions(py::module_& m) {
  py::class_<Program>(m, "_ReplayProgram",
                      "A tape's structure compiled for native replay "
                      "(genie/backends/native_replay.py).")
      .def(py::init<int64_t, std::vector<int64_t>>(), py::arg("registers"), py::arg("keep"))
      .def("add_upload", &Program::add_upload, py::arg("out"), py::arg("device"),
           py::arg("frees"))
      .def("add_op", &Program::add_op, py::arg("name"), py::arg("overload"), py::arg("args"),
           py::arg("kwargs"), py::arg("margs"), py::arg("mkwargs"), py::arg("patches"),
           py::arg("outs"), py::arg("frees"), py::arg("device"), py::arg("rng"),
           py::arg("source") = py::none())
      .def("run", &Program::run, py::arg("inputs"), py::arg("instrs"), py::arg("devices"),
           py::arg("split") = -1, py::arg("early") = py::none(),
           py::arg("check") = py::none(), py::arg("check_at") = std::vector<int64_t>{},
           py::arg("check_slots") = std::vector<int64_t>{})
      .def("run_plain", &Program::run_plain, py::arg("inputs"), py::arg("instrs"),
           py::arg("devices"), py::arg("split") = -1, py::arg("early") = py::none(),
           py::arg("check") = py::none(), py::arg("check_at") = std::vector<int64_t>{},
           py::arg("check_slots") = std::vector<int64_t>{})
      .def("set_graph_hook", &Program::set_graph_hook, py::arg("hook"))
      .def("direct_last", &Program::direct_last, py::arg("learn"))
      .def_property_readonly("freed", &Program::freed)
      .def("__len__", &Program::size);
  m.def("_hit_run", &hit_run, py::arg("program"), py::arg("inputs"), py::arg("consts"),
        py::arg("tmpl"), py::arg("at"), py::arg("found"), py::arg("stale"), py::arg("devices"),
        py::arg("outs"), py::arg("prune_at"), py::arg("untrack"), py::arg("hold"),
        py::arg("want"),
        "A fused plan-cache hit run and bound in one call (csrc/replay.cpp; "
        "genie.executor._run_hit).");
  m.def("_replay_graph_calls", [] {
    const int64_t n = direct_graph_calls;
    direct_graph_calls = 0;
    return n;
  }, "genie::graph calls native replay made directly since the last call (and resets it).");
}

} // namespace genie
