// The global state that can change an op's output metadata or values, as one integer.
//
// Eager reads process-global settings when an op runs: the default dtype (the result dtype of
// `int / int`, of `int_tensor * 1.5`, of a factory without dtype=), the deterministic-algorithm
// flags (an op that has no deterministic kernel raises; empty tensors are filled with NaN), and
// on CUDA the TF32 / reduced-precision / cuDNN flags (values). Genie records an op now and runs it
// later, so the state the op was recorded under is part of its meta-cache key (a cached entry of
// another state would give the other state's dtype), and the executor runs a tape under the state
// its ops were recorded under (genie.executor). One word, read here once per recorded op
// (a few loads; ~40 ns from Python): default dtype in bits 0-7, deterministic algorithms 8,
// warn-only 9, fill uninitialized memory 10, and under _state_mask's "precision" group the fp32
// precision of CUDA matmul/conv/rnn and oneDNN matmul/conv (3 bits each from 11), the reduced-
// precision reduction options of cuBLAS (2 bits each from 26), cuDNN deterministic 30, benchmark 31
// and enabled 32. Grad mode, inference mode and autocast are not in it: they decide which ops
// reach the device (the autograd and autocast keys run above it), so they are in the op and its
// input dtypes already; the executor runs with grad and autocast off.
#include "state.h"

#include <ATen/Context.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/ScalarType.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace genie {

namespace {

// Whether the fp32-precision and cuDNN flags are in the word: where this process has CUDA
// (decided at the first read, so a program that never records pays nothing; _state_mask sets it).
int precision_group = -1;

bool with_precision() {
  if (precision_group < 0) {
    precision_group = at::hasCUDA() ? 1 : 0;
  }
  return precision_group == 1;
}

constexpr int kPrecisionShift = 11;

const std::pair<at::Float32Backend, at::Float32Op> kPrecisions[] = {
    {at::Float32Backend::CUDA, at::Float32Op::MATMUL},
    {at::Float32Backend::CUDA, at::Float32Op::CONV},
    {at::Float32Backend::CUDA, at::Float32Op::RNN},
    {at::Float32Backend::MKLDNN, at::Float32Op::MATMUL},
    {at::Float32Backend::MKLDNN, at::Float32Op::CONV},
};

const char* precision_name(uint64_t p) {
  switch (static_cast<at::Float32Precision>(p)) {
    case at::Float32Precision::IEEE:
      return "ieee";
    case at::Float32Precision::TF32:
      return "tf32";
    case at::Float32Precision::BF16:
      return "bf16";
    default:
      return "none";
  }
}

}  // namespace

uint64_t state_word() {
  auto& ctx = at::globalContext();
  uint64_t w = static_cast<uint64_t>(c10::typeMetaToScalarType(c10::get_default_dtype())) & 0xff;
  w |= static_cast<uint64_t>(ctx.deterministicAlgorithms()) << 8;
  w |= static_cast<uint64_t>(ctx.deterministicAlgorithmsWarnOnly()) << 9;
  w |= static_cast<uint64_t>(ctx.deterministicFillUninitializedMemory()) << 10;
  if (with_precision()) {
    int shift = kPrecisionShift;
    for (const auto& [backend, op] : kPrecisions) {
      w |= (static_cast<uint64_t>(ctx.float32Precision(backend, op)) & 7) << shift;
      shift += 3;
    }
    w |= (static_cast<uint64_t>(ctx.allowFP16ReductionCuBLAS()) & 3) << 26;
    w |= (static_cast<uint64_t>(ctx.allowBF16ReductionCuBLAS()) & 3) << 28;
    w |= static_cast<uint64_t>(ctx.deterministicCuDNN()) << 30;
    w |= static_cast<uint64_t>(ctx.benchmarkCuDNN()) << 31;
    w |= static_cast<uint64_t>(ctx.userEnabledCuDNN()) << 32;
  }
  return w;
}

namespace {

// Make `w` the state (the fields its group holds); returns the state before.
uint64_t state_apply(uint64_t w) {
  const uint64_t before = state_word();
  if (before == w) {
    return before;
  }
  auto& ctx = at::globalContext();
  const auto dtype = static_cast<c10::ScalarType>(w & 0xff);
  if ((before & 0xff) != (w & 0xff)) {
    c10::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
  }
  if (((before ^ w) >> 8 & 3) != 0) {
    ctx.setDeterministicAlgorithms((w >> 8 & 1) != 0, (w >> 9 & 1) != 0);
  }
  if (((before ^ w) >> 10 & 1) != 0) {
    ctx.setDeterministicFillUninitializedMemory((w >> 10 & 1) != 0);
  }
  if (with_precision()) {
    int shift = kPrecisionShift;
    for (const auto& [backend, op] : kPrecisions) {
      const uint64_t p = w >> shift & 7;
      if ((before >> shift & 7) != p) {
        ctx.setFloat32Precision(backend, op, static_cast<at::Float32Precision>(p));
      }
      shift += 3;
    }
    const uint64_t fp16 = w >> 26 & 3;
    const uint64_t bf16 = w >> 28 & 3;
    ctx.setAllowFP16ReductionCuBLAS(fp16 == 0, fp16 != 2);
    ctx.setAllowBF16ReductionCuBLAS(bf16 == 0, bf16 != 2);
    ctx.setDeterministicCuDNN((w >> 30 & 1) != 0);
    ctx.setBenchmarkCuDNN((w >> 31 & 1) != 0);
    ctx.setUserEnabledCuDNN((w >> 32 & 1) != 0);
  }
  return before;
}

PyObject* py_state_word(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyLong_FromUnsignedLongLong(state_word());
}

// The math-bit keys a real tensor's values depend on (genie.executor.real_dispatch): a
// materialization reached from inside __torch_dispatch__ runs with them excluded, and a real
// kernel would then read a conjugate (or negative) view's raw memory and ignore the bit.
constexpr c10::DispatchKey kMathBits[] = {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative,
                                          c10::DispatchKey::ZeroTensor};

// Re-enable the math-bit keys this thread excludes; returns which it re-enabled (bit i:
// kMathBits[i]), for _math_bits_restore. Two calls instead of three guard objects (~6 µs
// from Python per materialization).
PyObject* py_math_bits_on(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyLong_FromLong(genie::math_bits_on());
}

// Exclude again the keys `mask` (a _math_bits_on result) names, in reverse order.
PyObject* py_math_bits_restore(PyObject* /*self*/, PyObject* arg) {
  const long mask = PyLong_AsLong(arg);
  if (mask == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  genie::math_bits_restore(mask);
  Py_RETURN_NONE;
}

// Set grad mode to `arg` (a bool); returns the mode before. The interpreter turns grad mode off
// around a run (genie.backends.eager.run_instrs) once per materialization: torch._C's
// is_grad_enabled + _set_grad_enabled parse their arguments per call (~1.5 µs the pair).
PyObject* py_grad_swap(PyObject* /*self*/, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) {
    return nullptr;
  }
  const bool before = c10::GradMode::is_enabled();
  c10::GradMode::set_enabled(on != 0);
  return PyBool_FromLong(before ? 1 : 0);
}

PyMethodDef methods[] = {
    {"_state_word", py_state_word, METH_NOARGS,
     "The global state an op's result depends on, as one int (csrc/state.cpp): part of every "
     "meta-cache key."},
    {"_math_bits_on", py_math_bits_on, METH_NOARGS,
     "Re-enable the math-bit dispatch keys (Conjugate, Negative, ZeroTensor) this thread "
     "excludes; returns a mask of those it re-enabled, for _math_bits_restore."},
    {"_math_bits_restore", py_math_bits_restore, METH_O,
     "Exclude again the math-bit keys named by `mask` (a _math_bits_on result)."},
    {"_grad_swap", py_grad_swap, METH_O,
     "Set grad mode to `enabled`; returns the mode before (one call: no argument parsing)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

long math_bits_on() {
  long mask = 0;
  for (int i = 0; i < 3; ++i) {
    if (c10::impl::tls_is_dispatch_key_excluded(kMathBits[i])) {
      c10::impl::tls_set_dispatch_key_excluded(kMathBits[i], false);
      mask |= 1L << i;
    }
  }
  return mask;
}

void math_bits_restore(long mask) {
  for (int i = 2; i >= 0; --i) {
    if ((mask >> i & 1) != 0) {
      c10::impl::tls_set_dispatch_key_excluded(kMathBits[i], true);
    }
  }
}

void add_state_functions(pybind11::module_& m) {
  if (PyModule_AddFunctions(m.ptr(), methods) < 0) {
    throw pybind11::error_already_set();
  }
  m.def("_state_apply", &state_apply, pybind11::arg("word"),
        "Make `word` (a _state_word value) the global state; returns the state word before.");
  m.def(
      "_state_mask", [](bool precision) { precision_group = precision ? 1 : 0; },
      pybind11::arg("precision"),
      "Whether the word holds the fp32-precision and cuDNN flags (the real device is CUDA).");
  m.def(
      "_state_describe",
      [](uint64_t w) {
        pybind11::dict d;
        d["default_dtype"] = c10::toString(static_cast<c10::ScalarType>(w & 0xff));
        d["deterministic"] = (w >> 8 & 1) != 0;
        d["warn_only"] = (w >> 9 & 1) != 0;
        d["fill_uninitialized_memory"] = (w >> 10 & 1) != 0;
        if (with_precision()) {
          int shift = kPrecisionShift;
          for (const auto& [backend, op] : kPrecisions) {
            const char* b = backend == at::Float32Backend::CUDA ? "cuda" : "mkldnn";
            const char* o = op == at::Float32Op::MATMUL ? "matmul"
                            : op == at::Float32Op::CONV ? "conv"
                                                        : "rnn";
            const std::string key = std::string(b) + "." + o;
            d[key.c_str()] = precision_name(w >> shift & 7);
            shift += 3;
          }
        }
        return d;
      },
      pybind11::arg("word"), "A state word's fields by name (for messages and tests).");
}

}  // namespace genie
