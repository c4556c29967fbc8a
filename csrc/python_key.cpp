// genie._C: LazyTensor calls recorded from a C++ kernel on the Python dispatch key.
//
// A LazyTensor carries the Python dispatch key, so every aten op on it reaches PyTorch's Python
// fallback (pythonFallback): the interpreter converts the dispatcher's IValue stack into a Python
// args tuple and kwargs dict (parseIValuesToPyArgsKwargs), collects the overloaded arguments and
// a tuple of their types, looks __torch_dispatch__ up by name on the first one, asks
// torch._library.simple_registry for a registered dispatch rule, calls __torch_dispatch__ with
// four arguments and converts what it returns back into IValues (pushPyOutToStack). For the
// 2,000-op chain of bench_models that round trip is ~9k of the ~32k instructions an op costs,
// more than Genie's own record.
//
// This file registers one boxed kernel on the Python key for the aten operators (a per-operator
// kernel takes precedence over the key's fallback, as torch.library's impl(..., "Python") does;
// operators with a CompositeImplicitAutograd kernel are left alone: they never reach the key).
// For a call that only Genie's __torch_dispatch__ would see (no TorchDispatchMode active, every
// argument tensor with the Python key a LazyTensor, no dispatch rule registered for the op and
// LazyTensor, LazyTensor.__torch_dispatch__ still genie's native one), it does what that path
// does, with less: the stack converted to the same args and kwargs (the same conversion per
// argument type; defaulted trailing and keyword-only arguments dropped as torch drops them),
// genie's record called directly (genie::record_call, what _record_dispatch calls), the result
// pushed as torch pushes it. Every other call goes to PyTorch's own fallback, captured before
// this file's first registration, so other tensor subclasses, modes (genie.capture included)
// and registered rules behave exactly as without it. GENIE_PYTHON_KEY=0 (config.python_key)
// sends every call to PyTorch's fallback (the reference). tests/unit/test_python_key.py.
//
// Built on torch >= 2.11 (PyObjectSlot::load_pyobj, OperatorHandle::getPythonOp and
// getComputedKernelForDispatchKey are its API); older torch builds this file without the kernel.

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#elif __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

#if defined(TORCH_VERSION_MAJOR) && defined(TORCH_VERSION_MINOR) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11))
#define GENIE_PYTHON_KEY_KERNEL 1
// torch 2.11/2.12 still pass the interpreter to OperatorHandle::getPythonOp.
#define GENIE_PYTHON_OP_TAKES_INTERPRETER (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13)
#else
#define GENIE_PYTHON_KEY_KERNEL 0
#endif

#if GENIE_PYTHON_KEY_KERNEL
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/PythonFallbackKernel.h>
#include <ATen/core/stack.h>
#include <ATen/ops/detach_ops.h>
#include <ATen/ops/view_ops.h>
#include <ATen/TensorUtils.h>
#include <c10/util/SmallVector.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/PyInterpreterHooks.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>
#endif

#include "record.h"
#include "wrapper.h"
#include "whole.h"

namespace py = pybind11;

namespace {

#if GENIE_PYTHON_KEY_KERNEL

// The keys below the Python key, as pythonFallback excludes them while __torch_dispatch__ runs.
constexpr c10::DispatchKeySet kAfterPython =
    c10::DispatchKeySet(c10::DispatchKeySet::FULL) ^
    (c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Python) |
     c10::DispatchKeySet(c10::DispatchKey::Python));

std::atomic<bool> enabled{false};
PyObject* td_name = nullptr;        // "__torch_dispatch__"
PyObject* genie_dispatch = nullptr;  // LazyTensor.__dict__["__torch_dispatch__"] when enabled
// PyTorch's Python-key fallback (pythonFallback), read from an operator's computed table before
// any registration here. Never destroyed (static destructors run after the interpreter is gone).
c10::SafeKernelFunction* torch_fallback = nullptr;
torch::Library* library = nullptr;
std::set<const c10::FunctionSchema*>* installed = nullptr;  // the operators `library` took
bool installed_here(const c10::OperatorHandle& op) {
  return installed != nullptr && installed->count(&op.schema()) > 0;
}
uint64_t n_recorded = 0;   // calls this kernel recorded through genie::record_call
uint64_t n_delegated = 0;  // calls it handed to PyTorch's fallback
uint64_t n_factories = 0;  // factory calls recorded by factory_kernel
uint64_t n_detached = 0;   // detaches from C++ recorded by DetachVTable::native_detach
torch::Library* factory_library = nullptr;

// How parseIValuesToPyArgsKwargs converts an argument: by its schema type for the enums stored
// as ints, else by the value.
enum ArgKind : uint8_t { kValue, kDtype, kLayout, kMemoryFormat };
static_assert(kValue == genie::kStackValue && kDtype == genie::kStackDtype &&
                  kLayout == genie::kStackLayout && kMemoryFormat == genie::kStackMemoryFormat,
              "record_stack reads the kinds as python_key.cpp's");

struct OpArgs {
  PyObject* func = nullptr;  // torch.ops.<ns>.<name>.<overload> (static lifetime)
  PyObject* qualname = nullptr;  // func.__qualname__: its key in torch's dispatch-rule registry
  std::vector<ArgKind> kinds;
  std::vector<PyObject*> names;  // interned argument names
  size_t kwarg_only_start = 0;
  std::vector<size_t> kw_sorted;  // the keyword-only positions by name (as flatten sorts a dict)
  bool tensor_return = false;  // exactly one return, a Tensor
};

// By schema address: an operator's schema lives while it is registered, and aten's are never
// deregistered. Read and written with the GIL held.
std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<OpArgs>>* op_args = nullptr;

bool matches(const c10::Argument& arg, c10::TypeKind kind) {
  const auto& t = arg.real_type();
  if (t->kind() == kind) {
    return true;
  }
  if (auto opt = t->cast<c10::OptionalType>()) {
    return opt->getElementType()->kind() == kind;
  }
  return false;
}

// torch.ops.<ns>.<name>.<overload>, as torch's getTorchApiFunction finds it. A new reference
// kept forever (an OpOverload lives as long as its packet, i.e. the process).
PyObject* python_op(const c10::OperatorHandle& op) {
  auto slow = [&]() -> PyObject* {
    const auto& qualified = op.operator_name().name;
    const auto& overload = op.schema().overload_name();
    const auto pos = qualified.find("::");
    TORCH_INTERNAL_ASSERT(pos != std::string::npos, qualified);
    py::object ns = py::module_::import("torch").attr("ops").attr(qualified.substr(0, pos).c_str());
    py::object packet = ns.attr(qualified.c_str() + pos + 2);
    py::object overload_op = packet.attr(overload.empty() ? "default" : overload.c_str());
    return overload_op.release().ptr();
  };
#if GENIE_PYTHON_OP_TAKES_INTERPRETER
  return op.getPythonOp(c10::impl::getGlobalPyInterpreter(), slow);
#else
  return op.getPythonOp(slow);
#endif
}

const OpArgs& args_of(const c10::OperatorHandle& op) {
  const c10::FunctionSchema* schema = &op.schema();
  auto it = op_args->find(schema);
  if (it != op_args->end()) {
    return *it->second;
  }
  auto a = std::make_unique<OpArgs>();
  a->func = python_op(op);
  a->qualname = PyObject_GetAttrString(a->func, "__qualname__");
  if (a->qualname == nullptr) {
    throw python_error();
  }
  const auto& arguments = schema->arguments();
  a->kwarg_only_start = arguments.size();
  while (a->kwarg_only_start > 0 && arguments[a->kwarg_only_start - 1].kwarg_only()) {
    --a->kwarg_only_start;
  }
  for (const auto& arg : arguments) {
    a->kinds.push_back(matches(arg, c10::ScalarTypeType::Kind)     ? kDtype
                       : matches(arg, c10::LayoutType::Kind)       ? kLayout
                       : matches(arg, c10::MemoryFormatType::Kind) ? kMemoryFormat
                                                                   : kValue);
    PyObject* name = PyUnicode_InternFromString(arg.name().c_str());
    if (name == nullptr) {
      throw python_error();
    }
    a->names.push_back(name);
  }
  for (size_t i = a->kwarg_only_start; i < arguments.size(); ++i) {
    a->kw_sorted.push_back(i);
  }
  std::sort(a->kw_sorted.begin(), a->kw_sorted.end(), [&](size_t x, size_t y) {
    return PyUnicode_Compare(a->names[x], a->names[y]) < 0;
  });
  const auto& returns = schema->returns();
  a->tensor_return =
      returns.size() == 1 && returns[0].real_type()->kind() == c10::TypeKind::TensorType;
  return *op_args->emplace(schema, std::move(a)).first->second;
}

// A wrapped number (the Python scalar of `x * 0.5`, as the argument parser wraps it) as toPyObject
// gives it: the number read from the 0-dim CPU tensor. toPyObject first wraps the tensor in a new
// Python object to ask it for a `_wrapped_number` attribute, which only a tensor with a Python
// object of its own can have (~1.3k instructions per call, most of a scalar op's conversion);
// nullptr (no error) sends those, and dtypes other than toPyObject's common ones, to toPyObject.
PyObject* wrapped_number(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!t.device().is_cpu() || impl->pyobj_slot()->load_pyobj() != nullptr) {
    return nullptr;
  }
  switch (t.scalar_type()) {
    case at::ScalarType::Double:
      return PyFloat_FromDouble(*t.const_data_ptr<double>());
    case at::ScalarType::Long:
      return PyLong_FromLongLong(*t.const_data_ptr<int64_t>());
    case at::ScalarType::Bool:
      return PyBool_FromLong(*t.const_data_ptr<bool>() ? 1 : 0);
    default:
      return nullptr;
  }
}

// An argument as parseIValuesToPyArgsKwargs gives it to __torch_dispatch__; a new reference.
PyObject* to_python(const c10::IValue& v, ArgKind kind) {
  if (v.isNone()) {
    Py_RETURN_NONE;
  }
  switch (kind) {
    case kDtype: {
      PyObject* o = reinterpret_cast<PyObject*>(
          torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt())));
      Py_INCREF(o);
      return o;
    }
    case kLayout: {
      PyObject* o = reinterpret_cast<PyObject*>(
          torch::getTHPLayout(static_cast<c10::Layout>(v.toInt())));
      Py_INCREF(o);
      return o;
    }
    case kMemoryFormat: {
      PyObject* o = torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt()));
      Py_INCREF(o);
      return o;
    }
    case kValue:
      break;
  }
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    // Undefined and wrapped-number tensors convert as toPyObject converts them (None, a number).
    if (t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number()) {
      return THPVariable_Wrap(t);
    }
    if (t.defined()) {
      if (PyObject* n = wrapped_number(t)) {
        return n;
      }
    }
  } else if (v.isInt()) {
    return PyLong_FromLongLong(v.toInt());
  } else if (v.isDouble()) {
    return PyFloat_FromDouble(v.toDouble());
  } else if (v.isBool()) {
    return PyBool_FromLong(v.toBool() ? 1 : 0);
  } else if (v.isTensorList() || v.isOptionalTensorList() || v.isIntList() ||
             v.isDoubleList()) {
    // A list, element by element as toPyObject converts them (foreach ops, cat, sizes).
    const auto items = v.toListRef();
    py::object list = py::reinterpret_steal<py::object>(PyList_New(items.size()));
    if (!list) {
      return nullptr;
    }
    for (size_t i = 0; i < items.size(); ++i) {
      PyObject* o = to_python(items[i], kValue);
      if (o == nullptr) {
        return nullptr;
      }
      PyList_SET_ITEM(list.ptr(), i, o);
    }
    return list.release().ptr();
  }
  return torch::jit::toPyObject(v).release().ptr();
}

// The argument at schema position i equals its default (parseIValuesToPyArgsKwargs's is_default).
bool is_default(const c10::FunctionSchema& schema, const c10::IValue* values, size_t i) {
  const auto& d = schema.arguments()[i].default_value();
  return d.has_value() && !(*d != values[i]);
}

void delegate(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  ++n_delegated;  // racy without the GIL: a statistic only
  torch_fallback->callBoxed(op, ks, stack);
}

// 1: a LazyTensor (with the Python key, or a key-free LazyImpl: see "PrivateUse1" below), 0:
// another tensor without the Python key, -1: another subclass.
inline int classify(const c10::TensorImpl* t, PyTypeObject* lazy) {
  if (!t->key_set().has(c10::DispatchKey::Python)) {
    return genie::lazy_impl(const_cast<c10::TensorImpl*>(t)) != nullptr ? 1 : 0;
  }
  PyObject* o = t->pyobj_slot()->load_pyobj();
  return o != nullptr && Py_TYPE(o) == lazy ? 1 : -1;
}

// The call's Python arguments as parseIValuesToPyArgsKwargs gives them: positional arguments up
// to the last one that is not its default; keyword-only ones that are not their default, by name.
// `dict_always`: an empty kwargs dict rather than none (torch's Python kernels get one).
std::pair<py::object, py::object> python_args(const c10::FunctionSchema& schema, const OpArgs& a,
                                              const c10::IValue* values, bool dict_always) {
  const size_t n = schema.arguments().size();
  size_t positional = a.kwarg_only_start;
  while (positional > 0 && is_default(schema, values, positional - 1)) {
    --positional;
  }
  py::object args = py::reinterpret_steal<py::object>(PyTuple_New(positional));
  if (!args) {
    throw python_error();
  }
  for (size_t i = 0; i < positional; ++i) {
    PyObject* o = to_python(values[i], a.kinds[i]);
    if (o == nullptr) {
      throw python_error();
    }
    PyTuple_SET_ITEM(args.ptr(), i, o);
  }
  py::object kwargs;
  if (dict_always) {
    kwargs = py::reinterpret_steal<py::object>(PyDict_New());
    if (!kwargs) {
      throw python_error();
    }
  }
  for (size_t i = a.kwarg_only_start; i < n; ++i) {
    if (is_default(schema, values, i)) {
      continue;
    }
    if (!kwargs) {
      kwargs = py::reinterpret_steal<py::object>(PyDict_New());
      if (!kwargs) {
        throw python_error();
      }
    }
    py::object o = py::reinterpret_steal<py::object>(to_python(values[i], a.kinds[i]));
    if (!o || PyDict_SetItem(kwargs.ptr(), a.names[i], o.ptr()) < 0) {
      throw python_error();
    }
  }
  return {std::move(args), std::move(kwargs)};
}

// What a kernel returned, pushed as pushPyOutToStack pushes it.
void push_outputs(const c10::OperatorHandle& op, const OpArgs& a, const py::object& out,
                  PyTypeObject* lazy, torch::jit::Stack* stack) {
  const auto& returns = op.schema().returns();
  if (a.tensor_return && (Py_TYPE(out.ptr()) == lazy || THPVariable_Check(out.ptr()))) {
    torch::jit::push(stack, THPVariable_Unpack(out.ptr()));
  } else if (returns.empty()) {
    TORCH_CHECK(out.is_none(), "Expected __torch_dispatch__ for ", op.operator_name(),
                " to return None but it returned something else instead.");
  } else if (returns.size() == 1) {
    torch::jit::push(stack, torch::jit::toIValue(out, returns[0].real_type()));
  } else {
    auto outs = py::cast<py::sequence>(out);
    for (size_t i = 0; i < outs.size(); ++i) {
      torch::jit::push(stack, torch::jit::toIValue(outs[i], returns[i].real_type()));
    }
  }
}

void record_lazy(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack,
                 PyTypeObject* lazy, bool at_python);

// The call on the stack made Python: its arguments converted as torch converts them for a Python
// kernel (parseIValuesToPyArgsKwargs; an empty kwargs dict rather than none), `call(args,
// kwargs)` (a new reference, or nullptr with the error set) in place of the kernel, its result
// pushed as torch pushes a Python kernel's. With the GIL held.
template <typename F>
void call_python(const c10::OperatorHandle& op, torch::jit::Stack* stack, PyTypeObject* lazy,
                 F&& call) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const OpArgs& a = args_of(op);
  auto [args, kwargs] = python_args(schema, a, stack->data() + (stack->size() - n), true);
  torch::jit::drop(*stack, n);
  py::object out = py::reinterpret_steal<py::object>(call(a, args.ptr(), kwargs.ptr()));
  if (!out) {
    throw python_error();
  }
  push_outputs(op, a, out, lazy, stack);
}

// LazyTensor.__torch_dispatch__(func, (LazyTensor,), args, kwargs), as torch's Python fallback
// calls it (the reference path for a key-free LazyTensor, which never reaches that fallback).
// `rule`: a dispatch rule registered for (func, LazyTensor) (torch.library.register_torch_dispatch)
// is called instead, as torch calls one: rule(LazyTensor, func, types, args, kwargs).
void call_torch_dispatch(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                         PyTypeObject* lazy, bool rule = false) {
  call_python(op, stack, lazy, [&](const OpArgs& a, PyObject* args, PyObject* kwargs) {
    PyObject* cls = reinterpret_cast<PyObject*>(lazy);
    py::tuple types = py::make_tuple(py::reinterpret_borrow<py::object>(cls));
    py::object fn;
    if (rule) {
      fn = py::module_::import("torch._library.simple_registry")
               .attr("find_torch_dispatch_rule")(py::handle(a.func), py::handle(cls));
      return PyObject_CallFunctionObjArgs(fn.ptr(), cls, a.func, types.ptr(), args, kwargs,
                                          nullptr);
    }
    fn = py::reinterpret_steal<py::object>(PyObject_GetAttr(cls, td_name));
    if (!fn) {
      return static_cast<PyObject*>(nullptr);
    }
    return PyObject_CallFunctionObjArgs(fn.ptr(), a.func, types.ptr(), args, kwargs, nullptr);
  });
}

// Under a TorchDispatchMode, a call with a key-free LazyTensor argument: what torch's Python
// fallback does for one with the Python key, LazyTensor counted among the overloaded types
// (genie.lazy_tensor._under_modes: the innermost mode, then, if it declines, as modes do for a
// tensor subclass they do not know, LazyTensor.__torch_dispatch__).
void under_modes(const c10::OperatorHandle& op, torch::jit::Stack* stack, PyTypeObject* lazy) {
  py::gil_scoped_acquire gil;
  static PyObject* fn = nullptr;  // genie.lazy_tensor._under_modes, kept for the process
  if (fn == nullptr) {
    fn = py::object(py::module_::import("genie.lazy_tensor").attr("_under_modes")).release().ptr();
  }
  call_python(op, stack, lazy, [](const OpArgs& a, PyObject* args, PyObject* kwargs) {
    return PyObject_CallFunctionObjArgs(fn, a.func, args, kwargs, nullptr);
  });
}

// Whether `pred` holds for a tensor among the call's `n` arguments (lists included).
template <typename P>
bool any_tensor(const c10::IValue* values, size_t n, P&& pred) {
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = values[i];
    if (v.isTensor()) {
      if (pred(v.unsafeToTensorImpl())) {
        return true;
      }
    } else if (v.isTensorList() || v.isOptionalTensorList()) {
      for (const auto& e : v.toListRef()) {
        if (!e.isNone() && pred(e.unsafeToTensorImpl())) {
          return true;
        }
      }
    }
  }
  return false;
}

bool has_key_free_lazy(const c10::IValue* values, size_t n) {
  return any_tensor(values, n, [](c10::TensorImpl* t) {
    return !t->key_set().has(c10::DispatchKey::Python) && genie::lazy_impl(t) != nullptr;
  });
}

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  PyTypeObject* lazy = genie::lazy_type();
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 && genie::wrappers_key_free &&
      lazy != nullptr &&
      has_key_free_lazy(stack->data() + (stack->size() - op.schema().arguments().size()),
                        op.schema().arguments().size())) {
    return under_modes(op, stack, lazy);
  }
  if (!enabled.load(std::memory_order_relaxed) || lazy == nullptr ||
      c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    return delegate(op, ks, stack);
  }
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const c10::IValue* values = stack->data() + (stack->size() - n);
  bool any = false;
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = values[i];
    int c = 0;
    if (v.isTensor()) {
      c = classify(v.unsafeToTensorImpl(), lazy);
    } else if (v.isTensorList() || v.isOptionalTensorList()) {
      for (const auto& e : v.toListRef()) {
        if (!e.isNone()) {
          const int ce = classify(e.unsafeToTensorImpl(), lazy);
          if (ce < 0) {
            return delegate(op, ks, stack);
          }
          c |= ce;
        }
      }
    }
    if (c < 0) {
      return delegate(op, ks, stack);
    }
    any = any || c > 0;
  }
  if (!any) {
    return delegate(op, ks, stack);
  }
  record_lazy(op, ks, stack, lazy, true);
}

// A call of `op` with a LazyTensor argument, recorded (the stack replaced by its outputs).
// `at_python`: reached at the Python key, where whatever genie does not record goes to torch's
// Python fallback; at PrivateUse1 (key-free LazyTensors, below the modes) genie's
// __torch_dispatch__ is called as that fallback would call it.
void record_lazy(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack,
                 PyTypeObject* lazy, bool at_python) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const c10::IValue* values = stack->data() + (stack->size() - n);
  c10::impl::ExcludeDispatchKeyGuard exclude(kAfterPython);
  py::gil_scoped_acquire gil;
  const OpArgs& a = args_of(op);
  if (!enabled.load(std::memory_order_relaxed) ||
      _PyType_Lookup(lazy, td_name) != genie_dispatch) {
    // __torch_dispatch__ was replaced (or GENIE_PYTHON_KEY=0, the reference): torch's path
    // calls it
    return at_python ? delegate(op, ks, stack) : call_torch_dispatch(op, stack, lazy);
  }
  // A dispatch rule registered for (func, LazyTensor) is torch's to apply.
  const int rule = genie::dispatch_rule_may_apply(a.func, a.qualname);
  if (rule < 0) {
    throw python_error();
  }
  if (rule > 0) {
    return at_python ? delegate(op, ks, stack) : call_torch_dispatch(op, stack, lazy, true);
  }

  // A learned entry's call recorded from the IValues themselves (record.cpp's record_stack): the
  // positional and keyword-only arguments python_args would give; what it declines takes the
  // Python arguments below.
  if (genie::stack_record_on()) {
    size_t positional = a.kwarg_only_start;
    while (positional > 0 && is_default(schema, values, positional - 1)) {
      --positional;
    }
    // the keyword-only arguments python_args would put in kwargs, in flatten's (name) order
    c10::SmallVector<size_t, 4> kw;
    c10::SmallVector<PyObject*, 4> kw_names;
    for (size_t i : a.kw_sorted) {
      if (!is_default(schema, values, i)) {
        kw.push_back(i);
        kw_names.push_back(a.names[i]);
      }
    }
    {
      std::pair<py::object, py::object> check;  // stack_record_check: python_args, to compare
      if (genie::stack_record_check()) {
        check = python_args(schema, a, values, false);
      }
      PyObject* r = genie::record_stack(a.func, values, positional, kw.data(), kw.size(),
                                        kw_names.data(),
                                        reinterpret_cast<const uint8_t*>(a.kinds.data()),
                                        check.first.ptr(), check.second.ptr());
      if (r != genie::kStackDeclined) {
        py::object out = py::reinterpret_steal<py::object>(r);
        if (!out) {
          throw python_error();
        }
        torch::jit::drop(*stack, n);
        ++n_recorded;
        push_outputs(op, a, out, lazy, stack);
        return;
      }
    }
  }

  auto [args, kwargs] = python_args(schema, a, values, false);
  torch::jit::drop(*stack, n);

  py::object out = py::reinterpret_steal<py::object>(genie::record_call(a.func, args.ptr(),
                                                                        kwargs.ptr()));
  if (!out) {
    throw python_error();
  }
  ++n_recorded;
  push_outputs(op, a, out, lazy, stack);
}

// --- PrivateUse1: LazyTensors without the Python key ---------------------------------------
//
// A natively made LazyTensor (record.cpp's make_wrapper, a LazyImpl) carries no Python key when
// key-free wrappers are on (GENIE_KEY_FREE, default on where the native wrapper exists): torch's
// autograd then treats its views as a backend's (no ViewFunc and reverse-view function per view,
// ~5-8% of a GPT-2 token; docs/node-layout.md section 7 step 4), and an op on it reaches
// PrivateUse1 instead of the Python key. pu1_kernel is registered there for the operators the
// Python-key kernel takes: a call with a LazyTensor argument is recorded as at the Python key
// (TorchDispatchModes have had their turn above: the Python key is in the TLS while one is
// active); a call without one (a DLPack import, a CPU tensor's copy or a factory reaching the
// backend) goes to the PrivateUse1 kernel the operator had before (genie.dlpack's fallback, a
// composite kernel), or raises torch's error for a backend without it. A LazyTensor made while a
// TorchDispatchMode is active keeps the Python key (record.cpp make_wrapper). The Python record
// path makes the same kind of wrapper (record.cpp's _make_lazy_wrapper); a wrapper with math bits
// (made by torch.Tensor._make_wrapper_subclass) keeps the key.
torch::Library* pu1_library = nullptr;
// by schema address: the PrivateUse1 kernel an operator had before pu1_kernel (nullptr: none)
std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<c10::SafeKernelFunction>>*
    pu1_before = nullptr;
uint64_t n_pu1_other = 0;  // calls pu1_kernel passed on (no LazyTensor argument)

void pu1_other(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  ++n_pu1_other;
  const c10::FunctionSchema* key = &op.schema();
  auto it = pu1_before->find(key);
  TORCH_CHECK_NOT_IMPLEMENTED(
      it != pu1_before->end() && it->second != nullptr, "Could not run '", op.operator_name(),
      "' with arguments from the 'remote_accelerator' backend: no tensor of the call was made "
      "by Genie (only tensors made on remote_accelerator by torch's factories, .to() and DLPack "
      "imports are).");
  it->second->callBoxed(op, ks, stack);
}

// reshape calls _reshape_alias(self, size, stride) for a tensor that is not subclass-like (a
// key-free LazyTensor, as eager's CPU tensors) with the strides view would give: recorded as
// view(self, size), which takes its strides from the value it runs on, where _reshape_alias would
// carry the ones Genie's metadata gave (a kernel whose real strides differ from its meta
// kernel's, as _linalg_svd's Vh, would then be read wrong). Other strides: recorded as they are.
bool reshape_as_view(c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::IValue* v = stack->data() + (stack->size() - 3);
  if (!v[0].isTensor()) {
    return false;
  }
  const at::Tensor self = v[0].toTensor();
  std::vector<int64_t> size, stride;
  try {
    size = v[1].toIntVector();
    stride = v[2].toIntVector();
  } catch (const c10::Error&) {  // symbolic sizes: as it is
    return false;
  }
  std::optional<std::vector<int64_t>> as_view =
      at::detail::computeStride(self.sizes(), self.strides(), c10::IntArrayRef(size));
  if (!as_view.has_value() || *as_view != stride) {
    return false;
  }
  torch::jit::drop(*stack, 3);
  torch::jit::push(stack, at::_ops::view::redispatch(ks, self, c10::fromIntArrayRefSlow(size)));
  return true;
}

// Whether the call has a LazyTensor argument (with the Python key or a key-free LazyImpl).
bool has_lazy(const c10::OperatorHandle& op, const torch::jit::Stack* stack, PyTypeObject* lazy) {
  const size_t n = op.schema().arguments().size();
  return lazy != nullptr &&
         any_tensor(stack->data() + (stack->size() - n), n,
                    [lazy](c10::TensorImpl* t) { return classify(t, lazy) > 0; });
}

void pu1_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  PyTypeObject* lazy = genie::lazy_type();
  if (!has_lazy(op, stack, lazy)) {
    return pu1_other(op, ks, stack);
  }
  record_lazy(op, ks, stack, lazy, false);
}

// aten::_reshape_alias's kernel at PrivateUse1: pu1_kernel's, but a LazyTensor reshaped with the
// strides view would give is recorded as view (reshape_as_view).
void reshape_alias_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                          torch::jit::Stack* stack) {
  if (has_lazy(op, stack, genie::lazy_type()) && reshape_as_view(ks, stack)) {
    return;
  }
  pu1_kernel(op, ks, stack);
}

// The PrivateUse1 kernel of the factory operators (genie.factories): what torch.library's Python
// kernel did (the stack converted as parseIValuesToPyArgsKwargs converts it, then
// genie._C._record_factory(func, args, kwargs)) without the Python frame and torch's generic
// conversion. No keys are excluded: torch's Python kernel holder excludes none either.
void factory_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet /*ks*/,
                    torch::jit::Stack* stack) {
  py::gil_scoped_acquire gil;
  call_python(op, stack, genie::lazy_type(), [](const OpArgs& a, PyObject* args, PyObject* kwargs) {
    return genie::record_factory_call(a.func, args, kwargs);
  });
  ++n_factories;
}

// torch's Python bindings ask every tensor-subclass argument of every call for its
// __torch_function__ (check_has_torch_function: PyObject_FastGetAttrString), by a C string: a
// str made, hashed and interned per argument per call before the attribute lookup itself
// (~1.3k instructions, ~4% of a generated token). PyObject_FastGetAttrString takes the type's
// tp_getattr (the char* slot) when there is one; LazyTensor's answers exactly as getattr()
// does, with the names torch asks per call interned once. Nothing else in CPython uses
// tp_getattr while tp_getattro is set. Any other name goes to getattr() by a str: never by
// PyObject_GetAttrString, which calls tp_getattr, this function, again (an endless loop, which
// the compiler makes a tail call: autograd.Function.apply asked each output for "view_as", so a
// Function returning its input, register_full_backward_hook included, spun at 100% CPU).
PyObject* tf_name = nullptr;  // "__torch_function__"

//
// `__torch_function__` (asked for every LazyTensor argument of every call) is a plain class
// attribute of LazyTensor (torch._C._disabled_torch_function_impl, a builtin: no descriptor), so
// generic attribute lookup answers it from the class when the instance has no attribute of its
// own: a wrapper of the native record path has none (its record is in its impl), which is read
// here without the generic path (~190 instructions an argument). A wrapper with attributes (a
// dict, or CPython 3.11's inline values) takes the generic path.
bool no_instance_attributes(PyObject* self) {
  PyTypeObject* t = Py_TYPE(self);
#ifdef Py_TPFLAGS_MANAGED_DICT  // (CPython >= 3.11)
  if (t->tp_flags & Py_TPFLAGS_MANAGED_DICT) {
#if PY_VERSION_HEX < 0x030C0000
    // CPython 3.11's managed dict: the inline values' pointer, then the dict's, before the object
    // (Include/internal/pycore_object.h, _PyObject_ValuesPointer / _PyObject_ManagedDictPointer)
    return reinterpret_cast<void**>(self)[-4] == nullptr &&
           reinterpret_cast<void**>(self)[-3] == nullptr;
#else
    return false;  // another layout: the generic path
#endif
  }
#endif
  PyObject** dp = _PyObject_GetDictPtr(self);  // (no managed dict: never made here)
  return dp == nullptr || *dp == nullptr || PyDict_GET_SIZE(*dp) == 0;
}

PyObject* lazy_getattr(PyObject* self, char* name) {
  if (std::strcmp(name, "__torch_function__") == 0) {
    PyTypeObject* t = Py_TYPE(self);
    if (t->tp_getattro == PyObject_GenericGetAttr) {
      PyObject* v = _PyType_Lookup(t, tf_name);  // borrowed (the type's method cache)
      if (v != nullptr && Py_TYPE(v)->tp_descr_get == nullptr && no_instance_attributes(self)) {
        Py_INCREF(v);
        return v;
      }
    }
    return PyObject_GetAttr(self, tf_name);
  }
  if (std::strcmp(name, "__torch_dispatch__") == 0) {
    return PyObject_GetAttr(self, td_name);
  }
  PyObject* s = PyUnicode_FromString(name);
  if (s == nullptr) {
    return nullptr;
  }
  PyObject* r = PyObject_GetAttr(self, s);
  Py_DECREF(s);
  return r;
}

// --- detach from C++ (torch's PyInterpreter) ------------------------------------------------
//
// Autograd detaches a tensor without the dispatcher where it saves an op's output (SavedVariable:
// relu's, softmax's, tanh's) and again where backward unpacks it: for a tensor with the Python
// key, TensorImpl::shallow_copy_and_detach asks the Python interpreter's vtable, whose detach
// imports torch, looks torch.ops.aten.detach.default up by four attribute names made from C
// strings and calls __torch_dispatch__ through handle_torch_function (8 per MLP 4 x Linear(8)
// step: its forward and backward record in 184 us of CPU time with this, 201 without, load ~5).
// The vtable below forwards every method to torch's and answers detach of a LazyTensor under
// the same conditions as the kernel above (no TorchDispatchMode, genie's native
// __torch_dispatch__, no registered rule) with genie::record_call(aten.detach.default, (t,)),
// what that __torch_dispatch__ does; anything else is torch's detach. Installed with the kernel
// (config.python_key off: torch's); only where the vtable's methods are this file's (torch 2.13).
#if defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 13
#define GENIE_NATIVE_DETACH 1
using c10::impl::PyInterpreterVTable;

struct DetachVTable final : PyInterpreterVTable {
  const PyInterpreterVTable* base;
  explicit DetachVTable(const PyInterpreterVTable* b) : base(b) {}

  c10::intrusive_ptr<c10::TensorImpl> detach(const c10::TensorImpl* self) const override {
    c10::intrusive_ptr<c10::TensorImpl> r = native_detach(self);
    return r ? r : base->detach(self);
  }

  // nullptr: torch's detach decides
  static c10::intrusive_ptr<c10::TensorImpl> native_detach(const c10::TensorImpl* self) {
    PyTypeObject* lazy = genie::lazy_type();
    if (!enabled.load(std::memory_order_relaxed) || lazy == nullptr ||
        c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
      return {};
    }
    // Another subclass's tensor (a FakeTensor under torch.compile) goes to torch's detach
    // before taking the GIL (its PyObject lives as long as `self`); checked again under it.
    PyObject* o = self->pyobj_slot()->load_pyobj();
    PyObject* func = genie::detach_op();
    if (o == nullptr || Py_TYPE(o) != lazy || func == nullptr) {
      return {};
    }
    py::gil_scoped_acquire gil;
    at::impl::MaybeSetTLSOnEntryGuard guard;  // as torch's detach
    if (Py_TYPE(o) != lazy || _PyType_Lookup(lazy, td_name) != genie_dispatch) {
      return {};
    }
    static PyObject* const qualname = PyObject_GetAttrString(func, "__qualname__");
    const int rule = qualname != nullptr ? genie::dispatch_rule_may_apply(func, qualname) : -1;
    if (rule != 0) {
      PyErr_Clear();  // torch's detach looks the rule up again and raises what it raises
      return {};
    }
    py::tuple args = py::make_tuple(py::reinterpret_borrow<py::object>(o));
    py::object out = py::reinterpret_steal<py::object>(genie::record_call(func, args.ptr(),
                                                                          nullptr));
    if (!out) {
      throw python_error();
    }
    TORCH_CHECK(THPVariable_Check(out.ptr()), "detach returned invalid type ",
                Py_TYPE(out.ptr())->tp_name, ", expected Tensor");
    ++n_detached;
    return THPVariable_Unpack(out.ptr()).getIntrusivePtr();
  }

  std::string name() const override { return base->name(); }
  // torch's incref and decref take the GIL (pybind11's gil_scoped_acquire: ~240 instructions,
  // ~330 with its release) even where the caller holds it, as a recording thread does whenever a
  // TensorImpl with a Python object gains its first C++ reference or drops its last one: twice
  // an op for a view (its base saved in the view's autograd metadata and on the stack; ~650
  // instructions of a 20k `x.view(-1)`), ~250 decrefs an MLP 4 x 256 training step. The same
  // Py_INCREF / Py_DECREF where this thread holds the GIL; torch's otherwise.
  static bool holds_gil() {
    if (!Py_IsInitialized()) {
      return false;
    }
    PyThreadState* mine = PyGILState_GetThisThreadState();
    return mine != nullptr && mine == py::detail::get_thread_state_unchecked();
  }
  void incref(PyObject* o) const override {
    if (holds_gil()) {
      Py_INCREF(o);
      return;
    }
    base->incref(o);
  }
  void decref(PyObject* o) const override {
    if (holds_gil()) {
      Py_DECREF(o);
      return;
    }
    base->decref(o);
  }
  bool try_incref(const c10::impl::PyObjectSlot& s) const override { return base->try_incref(s); }
  size_t refcnt(PyObject* o) const override { return base->refcnt(o); }
  void dispatch(const c10::OperatorHandle& op, torch::jit::Stack* stack) const override {
    base->dispatch(op, stack);
  }
  void reportErrorCallback(PyObject* cb, c10::DispatchKey key) const override {
    base->reportErrorCallback(cb, key);
  }
  void python_op_registration_trampoline(const c10::OperatorHandle& op, c10::DispatchKey k,
                                         c10::DispatchKeySet ks, torch::jit::Stack* stack,
                                         bool with_keyset, bool with_op) const override {
    base->python_op_registration_trampoline(op, k, ks, stack, with_keyset, with_op);
  }
  void throw_abstract_impl_not_imported_error(std::string opname, const char* pymodule,
                                              const char* context) const override {
    base->throw_abstract_impl_not_imported_error(std::move(opname), pymodule, context);
  }
  void python_dispatcher(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                         torch::jit::Stack* stack) const override {
    base->python_dispatcher(op, ks, stack);
  }
  bool is_contiguous(const c10::TensorImpl* t, at::MemoryFormat f) const override {
    return base->is_contiguous(t, f);
  }
  c10::SymBool sym_is_contiguous(const c10::TensorImpl* t, at::MemoryFormat f) const override {
    return base->sym_is_contiguous(t, f);
  }
  bool is_strides_like(const c10::TensorImpl* t, at::MemoryFormat f) const override {
    return base->is_strides_like(t, f);
  }
  bool is_non_overlapping_and_dense(const c10::TensorImpl* t) const override {
    return base->is_non_overlapping_and_dense(t);
  }
  c10::Device device(const c10::TensorImpl* t) const override { return base->device(t); }
  int64_t dim(const c10::TensorImpl* t) const override { return base->dim(t); }
  c10::IntArrayRef strides(const c10::TensorImpl* t) const override { return base->strides(t); }
  c10::IntArrayRef sizes(const c10::TensorImpl* t) const override { return base->sizes(t); }
  c10::SymIntArrayRef sym_sizes(const c10::TensorImpl* t) const override {
    return base->sym_sizes(t);
  }
  c10::Layout layout(const c10::TensorImpl* t) const override { return base->layout(t); }
  int64_t numel(const c10::TensorImpl* t) const override { return base->numel(t); }
  c10::SymInt sym_numel(const c10::TensorImpl* t) const override { return base->sym_numel(t); }
  c10::SymIntArrayRef sym_strides(const c10::TensorImpl* t) const override {
    return base->sym_strides(t);
  }
  c10::SymInt sym_storage_offset(const c10::TensorImpl* t) const override {
    return base->sym_storage_offset(t);
  }
  void trace_gpu_event_creation(c10::DeviceType d, uintptr_t e) const override {
    base->trace_gpu_event_creation(d, e);
  }
  void trace_gpu_event_deletion(c10::DeviceType d, uintptr_t e) const override {
    base->trace_gpu_event_deletion(d, e);
  }
  void trace_gpu_event_record(c10::DeviceType d, uintptr_t e, uintptr_t s) const override {
    base->trace_gpu_event_record(d, e, s);
  }
  void trace_gpu_event_wait(c10::DeviceType d, uintptr_t e, uintptr_t s) const override {
    base->trace_gpu_event_wait(d, e, s);
  }
  void trace_gpu_memory_allocation(c10::DeviceType d, uintptr_t p) const override {
    base->trace_gpu_memory_allocation(d, p);
  }
  void trace_gpu_memory_deallocation(c10::DeviceType d, uintptr_t p) const override {
    base->trace_gpu_memory_deallocation(d, p);
  }
  void trace_gpu_stream_creation(c10::DeviceType d, uintptr_t s) const override {
    base->trace_gpu_stream_creation(d, s);
  }
  void trace_gpu_device_synchronization(c10::DeviceType d) const override {
    base->trace_gpu_device_synchronization(d);
  }
  void trace_gpu_stream_synchronization(c10::DeviceType d, uintptr_t s) const override {
    base->trace_gpu_stream_synchronization(d, s);
  }
  void trace_gpu_event_synchronization(c10::DeviceType d, uintptr_t e) const override {
    base->trace_gpu_event_synchronization(d, e);
  }
  void reset_backward_hooks(const c10::TensorImpl* t) const override {
    base->reset_backward_hooks(t);
  }
};

// Puts DetachVTable in front of the interpreter's vtable, once (never destroyed: torch's
// disarm() at exit replaces the pointer, and static destructors run after the interpreter).
void install_detach() {
  c10::impl::PyInterpreter* interp = c10::impl::getGlobalPyInterpreter();
  if (interp != nullptr && dynamic_cast<const DetachVTable*>(interp->vtable_) == nullptr) {
    interp->vtable_ = new DetachVTable(interp->vtable_);
  }
}
#else
#define GENIE_NATIVE_DETACH 0
void install_detach() {}
#endif

// The aten operators that reach the Python key through its fallback: no kernel of their own there,
// no CompositeImplicitAutograd kernel unless csrc/whole.cpp keeps the op whole.
// `any_namespace`: every library's operators, not aten's only.
std::vector<c10::OperatorHandle> ops_reaching_python(bool any_namespace = false) {
  auto& dispatcher = c10::Dispatcher::singleton();
  std::vector<c10::OperatorHandle> ops;
  // csrc/whole.cpp's ops reach the Python key whole when autograd does not decompose them
  const std::set<std::string> whole(genie::whole_ops().begin(), genie::whole_ops().end());
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (!any_namespace && name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasSchema() ||
        (op->hasKernelForDispatchKey(c10::DispatchKey::Python) &&
         (library == nullptr || !installed_here(*op))) ||
        (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
         !(name.overload_name.empty() && whole.count(name.name) > 0)) ||
        !op->hasComputedKernelForDispatchKey(c10::DispatchKey::Python)) {
      continue;
    }
    ops.push_back(*op);
  }
  return ops;
}

bool takes_tensors(const c10::OperatorHandle& op) {
  for (const auto& arg : op.schema().arguments()) {
    const auto& t = arg.real_type();
    if (t->kind() == c10::TypeKind::TensorType) {
      return true;
    }
    if (auto list = t->cast<c10::ListType>()) {
      auto e = list->getElementType();
      if (e->kind() == c10::TypeKind::TensorType) {
        return true;
      }
      if (auto opt = e->cast<c10::OptionalType>(); opt && opt->getElementType()->kind() == c10::TypeKind::TensorType) {
        return true;
      }
    }
    if (auto opt = t->cast<c10::OptionalType>(); opt && opt->getElementType()->kind() == c10::TypeKind::TensorType) {
      return true;
    }
  }
  return false;
}

std::string qualified_name(const c10::OperatorHandle& op) {
  const auto& name = op.operator_name();
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

// Registers the kernel for every aten operator that reaches the Python key through its fallback;
// returns how many.
int64_t install() {
  if (library != nullptr) {
    return -1;
  }
  std::vector<c10::OperatorHandle> ops = ops_reaching_python();
  TORCH_CHECK(!ops.empty(), "genie: no aten operator reaches the Python key");
  torch_fallback = new c10::SafeKernelFunction(
      ops.front().getComputedKernelForDispatchKey(c10::DispatchKey::Python));
  library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::Python, __FILE__,
                               __LINE__);
  installed = new std::set<const c10::FunctionSchema*>();
  for (const auto& op : ops) {
    library->impl(qualified_name(op).c_str(),
                  torch::CppFunction::makeFromBoxedFunction<&kernel>());
    installed->insert(&op.schema());
  }
  install_detach();
  return static_cast<int64_t>(ops.size());
}

// The key-free LazyImpl's shallow_copy_and_detach (autograd's saved variables, Tensor.data): what
// torch's PyInterpreter detach does for a tensor with the Python key. The native detach where it
// applies; else the dispatcher's detach below autograd (the modes first, then pu1_kernel).
c10::intrusive_ptr<c10::TensorImpl> key_free_detach(const c10::TensorImpl* self) {
#if GENIE_NATIVE_DETACH
  if (c10::intrusive_ptr<c10::TensorImpl> r = DetachVTable::native_detach(self)) {
    return r;
  }
#endif
  at::Tensor t(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(const_cast<c10::TensorImpl*>(self)));
  c10::impl::ExcludeDispatchKeyGuard below(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  return at::_ops::detach::call(t).getIntrusivePtr();
}

// Registers pu1_kernel at PrivateUse1 for the operators (of every library loaded by then: genie's
// own compiled-graph ops have a CompositeExplicitAutograd kernel, which PrivateUse1 would
// otherwise run on the LazyTensors themselves) that reach the Python key, take a tensor and have
// no PrivateUse1 kernel of their own (genie's factory, copy and item kernels take LazyTensors as
// they are). A library loaded later: its operators without a PrivateUse1 or composite kernel
// reach genie.dlpack's fallback, which records them; a composite kernel of its own runs on the
// LazyTensors (its ops recorded one by one). From then on natively made wrappers carry no Python
// key. Returns how many
// (-1: already installed). Called once genie's other PrivateUse1 kernels and genie.dlpack's
// fallback are registered (what an operator had before is what pu1_kernel passes calls on to).
int64_t install_pu1() {
  if (pu1_library != nullptr) {
    return -1;
  }
  pu1_before = new std::unordered_map<const c10::FunctionSchema*,
                                      std::unique_ptr<c10::SafeKernelFunction>>();
  pu1_library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                   __FILE__, __LINE__);
  // the other libraries' (one IMPL library a namespace, kept for the process)
  static auto* others = new std::unordered_map<std::string, torch::Library*>();
  static auto* python_others = new std::unordered_map<std::string, torch::Library*>();
  int64_t count = 0;
  for (const auto& op : ops_reaching_python(true)) {
    if (op.hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) || !takes_tensors(op)) {
      continue;
    }
    const std::string qualified = qualified_name(op);
    const c10::FunctionSchema* key = &op.schema();
    (*pu1_before)[key] =
        op.hasComputedKernelForDispatchKey(c10::DispatchKey::PrivateUse1)
            ? std::make_unique<c10::SafeKernelFunction>(
                  op.getComputedKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
            : nullptr;
    const std::string ns = qualified.substr(0, qualified.find("::"));
    torch::Library* lib = pu1_library;
    if (ns != "aten") {
      auto& l = (*others)[ns];
      if (l == nullptr) {
        l = new torch::Library(torch::Library::IMPL, ns, c10::DispatchKey::PrivateUse1, __FILE__,
                               __LINE__);
      }
      lib = l;
    }
    lib->impl(qualified.c_str(),
              qualified == "aten::_reshape_alias"
                  ? torch::CppFunction::makeFromBoxedFunction<&reshape_alias_kernel>()
                  : torch::CppFunction::makeFromBoxedFunction<&pu1_kernel>());
    if (ns != "aten" && !op.hasKernelForDispatchKey(c10::DispatchKey::Python)) {
      // the kernel at the Python key as for aten's (install): under a mode, a key-free
      // LazyTensor argument takes under_modes
      auto& l = (*python_others)[ns];
      if (l == nullptr) {
        l = new torch::Library(torch::Library::IMPL, ns, c10::DispatchKey::Python, __FILE__,
                               __LINE__);
      }
      l->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&kernel>());
    }
    ++count;
  }
  genie::lazy_detach_hook = &key_free_detach;
  genie::wrappers_key_free = true;
  return count;
}

// Registers factory_kernel at PrivateUse1 for the aten operators named `names` (overloads as
// "name.overload"); returns how many (-1: already installed).
int64_t install_factories(const std::vector<std::string>& names) {
  if (factory_library != nullptr) {
    return -1;
  }
  factory_library = new torch::Library(torch::Library::IMPL, "aten",
                                       c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const auto& name : names) {
    factory_library->impl(name.c_str(),
                          torch::CppFunction::makeFromBoxedFunction<&factory_kernel>());
  }
  return static_cast<int64_t>(names.size());
}

#endif  // GENIE_PYTHON_KEY_KERNEL

}  // namespace

namespace genie {

void add_python_key_functions(py::module_& m) {
#if GENIE_PYTHON_KEY_KERNEL
  td_name = PyUnicode_InternFromString("__torch_dispatch__");
  tf_name = PyUnicode_InternFromString("__torch_function__");
  op_args = new std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<OpArgs>>();
  m.def("_pu1_install", &install_pu1,
        "Registers the kernel at PrivateUse1 and makes natively made LazyTensors without the "
        "Python key (csrc/python_key.cpp, \"PrivateUse1\"); -1 if already installed");
  m.def("_pu1_stats", []() { return py::make_tuple(genie::wrappers_key_free, n_pu1_other); });
  m.def("_python_key_install", &install,
        "Register genie's kernel on the Python dispatch key for the aten operators that reach "
        "it (csrc/python_key.cpp); returns how many (-1: already installed).");
  m.def(
      "_python_key_enable",
      [](bool on, py::object dispatch) {
        if (on) {
          Py_XSETREF(genie_dispatch, py::object(dispatch).release().ptr());
        }
        enabled.store(on && library != nullptr);
        return enabled.load();
      },
      py::arg("on"), py::arg("dispatch") = py::none(),
      "Record LazyTensor calls from the Python-key kernel (on: `dispatch` is the "
      "LazyTensor.__torch_dispatch__ it stands for) or hand every call to PyTorch's fallback; "
      "returns whether the kernel records.");
  m.def(
      "_fast_torch_function_check",
      [](py::object cls, bool on) {
        TORCH_CHECK(PyType_Check(cls.ptr()), "_fast_torch_function_check takes a class");
        auto* t = reinterpret_cast<PyTypeObject*>(cls.ptr());
        TORCH_CHECK(t->tp_getattr == nullptr || t->tp_getattr == &lazy_getattr,
                    "the class already has its own tp_getattr");
        t->tp_getattr = on ? &lazy_getattr : nullptr;
      },
      py::arg("cls"), py::arg("on"),
      "Answer torch's per-call __torch_function__ lookups on instances of `cls` (LazyTensor) "
      "without making a str per lookup (the type's tp_getattr, exactly getattr's answer).");
  m.def("_python_key_stats", []() {
    return py::make_tuple(n_recorded, n_delegated, n_factories, n_detached);
  }, "(calls recorded by the Python-key kernel, calls it handed to PyTorch's fallback, factory "
     "calls recorded by the native factory kernel, detaches from C++ recorded natively).");
  m.def("_factory_kernels_install", &install_factories, py::arg("names"),
        "Register genie's native PrivateUse1 kernel for the factory operators `names` "
        "(csrc/python_key.cpp; its body is _record_factory's); returns how many (-1: already "
        "installed).");
  m.attr("_python_key_kernel") = true;
  m.attr("_native_detach") = static_cast<bool>(GENIE_NATIVE_DETACH);
#else
  m.attr("_native_detach") = false;
  m.attr("_python_key_kernel") = false;
#endif
}

}  // namespace genie
