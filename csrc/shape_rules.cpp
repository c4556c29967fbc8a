// genie._C: the shape rules of the ops a decode step misses on, natively (genie.shape_rules).
//
// A decode step's KV length is new every step, so its calls miss the meta cache; the native
// record path (record.cpp, "shape-generic entries") then calls the op's shape rule. In Python a
// rule costs 5-16 µs (a pointwise rule's broadcast and TensorIterator layout ~12-16 µs); here the
// same arithmetic costs well under a µs, and most of what is left is making the TensorMeta.
//
// Each function here *is* the op's rule (genie/shape_rules.py registers it in RULES or
// KW_RULES; there is no Python twin), with the rules' contract: it returns exactly the output
// metadata the meta kernel would (shape, stride, storage offset, dtype; tests/unit/
// test_shape_rules.py checks it over OpInfo samples and random layouts) or None, and the meta
// kernel decides, errors included. So every rule accepts only the plain cases (TensorMetas
// without math bits, one dtype, Python ints that fit 64 bits, no overflow) and declines the rest.
// Rules never raise for a call they do not take: a malformed argument is a decline.
#include <algorithm>
#include <cstdint>
#include <cstddef>
#include <initializer_list>
#include <map>
#include <stdexcept>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>

#include "shape_rules.h"
#include "slots.h"

namespace py = pybind11;

namespace genie {
namespace {

// genie.graph.TensorMeta and its slots' offsets (_shape_rules_init).
struct TensorMetaType {
  PyTypeObject* type = nullptr;
  Py_ssize_t shape = 0, stride = 0, offset = 0, dtype = 0, index = 0, conj = 0, neg = 0;
};
TensorMetaType T;

using Dims = c10::SmallVector<int64_t, 6>;

// A plain TensorMeta argument, read.
struct Meta {
  Dims shape, stride;
  int64_t offset = 0;
  PyObject* dtype = nullptr;  // borrowed torch.dtype
  at::ScalarType st = at::kFloat;
  size_t ndim() const { return shape.size(); }
};

bool is_meta(PyObject* o) {
  return T.type != nullptr && Py_TYPE(o) == T.type;
}

// An exact Python int (not a bool) that fits 64 bits.
bool as_int(PyObject* o, int64_t& v) {
  if (!PyLong_CheckExact(o)) {
    return false;
  }
  int overflow = 0;
  v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// A list or tuple of ints (shape_rules._ints), or a TensorMeta's shape/stride tuple.
bool as_ints(PyObject* o, Dims& out) {
  if (!PyList_CheckExact(o) && !PyTuple_CheckExact(o)) {
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
  PyObject** items = PySequence_Fast_ITEMS(o);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!as_int(items[i], out[static_cast<size_t>(i)])) {
      return false;
    }
  }
  return true;
}

bool falsy(PyObject* o) {
  if (o == Py_False) {
    return true;
  }
  const int r = o != nullptr ? PyObject_IsTrue(o) : 1;
  if (r < 0) {
    PyErr_Clear();
  }
  return r == 0;
}

// `o` read where it is a plain TensorMeta (shape_rules._plain: no conj/neg bits).
bool plain(PyObject* o, Meta& m) {
  if (!is_meta(o)) {
    return false;
  }
  PyObject* dtype = slot_value(o, T.dtype);
  PyObject* offset = slot_value(o, T.offset);
  if (dtype == nullptr || !THPDtype_Check(dtype) || offset == nullptr ||
      !falsy(slot_value(o, T.conj)) || !falsy(slot_value(o, T.neg)) ||
      !as_int(offset, m.offset)) {
    return false;
  }
  PyObject* shape = slot_value(o, T.shape);
  PyObject* stride = slot_value(o, T.stride);
  if (shape == nullptr || stride == nullptr || !PyTuple_CheckExact(shape) ||
      !PyTuple_CheckExact(stride) || !as_ints(shape, m.shape) || !as_ints(stride, m.stride) ||
      m.shape.size() != m.stride.size()) {
    return false;
  }
  m.dtype = dtype;
  m.st = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  return true;
}

bool is_float(at::ScalarType s) {  // shape_rules._FLOATS
  return s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16;
}

bool is_arith(at::ScalarType s) {  // shape_rules._ARITH
  return is_float(s) || s == at::kLong || s == at::kInt;
}

PyObject* dtype_object(at::ScalarType s) {  // borrowed
  return reinterpret_cast<PyObject*>(torch::getTHPDtype(s));
}

bool has_zero(const Dims& d) {
  return std::find(d.begin(), d.end(), 0) != d.end();
}

bool mul_ok(int64_t a, int64_t b, int64_t& out) {
  return !__builtin_mul_overflow(a, b, &out);
}

bool numel(const Dims& d, int64_t& n) {
  n = 1;
  for (int64_t s : d) {
    if (!mul_ok(n, s, n)) {
      return false;
    }
  }
  return true;
}

// shape_rules.contiguous_strides: row-major, empty dims counted as 1; false on overflow.
bool contiguous_strides(const Dims& shape, Dims& out) {
  out.resize(shape.size());
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    out[i] = acc;
    if (!mul_ok(acc, std::max<int64_t>(shape[i], 1), acc)) {
      return false;
    }
  }
  return true;
}

// shape_rules._dense: standard contiguous from offset 0, no empty dims.
bool dense(const Meta& m) {
  if (m.offset != 0) {
    return false;
  }
  int64_t acc = 1;
  for (size_t i = m.ndim(); i-- > 0;) {
    if (m.shape[i] == 0 || m.stride[i] != acc || !mul_ok(acc, m.shape[i], acc)) {
      return false;
    }
  }
  return true;
}

// shape_rules._dim: `d` (an exact int) wrapped into [0, ndim), or false.
bool dim(PyObject* o, int64_t ndim, int64_t& d) {
  if (!as_int(o, d) || d < -ndim || d >= ndim) {
    return false;
  }
  if (d < 0) {
    d += ndim;
  }
  return true;
}

Dims slice_of(const Dims& d, size_t lo, size_t hi) {
  return Dims(d.begin() + static_cast<std::ptrdiff_t>(std::min(lo, d.size())),
              d.begin() + static_cast<std::ptrdiff_t>(std::min(hi, d.size())));
}

// shape_rules._broadcast
bool broadcast(const Dims& a, const Dims& b, Dims& out) {
  const size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> r(n);  // (not a SmallVector: GCC's -Wmaybe-uninitialized on its growth)
  for (size_t i = 0; i < n; ++i) {
    const int64_t x = i + a.size() >= n ? a[i + a.size() - n] : 1;
    const int64_t y = i + b.size() >= n ? b[i + b.size() - n] : 1;
    if (x == y || y == 1) {
      r[i] = x;
    } else if (x == 1) {
      r[i] = y;
    } else {
      return false;
    }
  }
  out.assign(r.begin(), r.end());
  return true;
}

PyObject* int_tuple(const Dims& d) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(d.size()));
  if (t == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < d.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(d[i]);
    if (v == nullptr) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), v);
  }
  return t;
}

void set_slot(PyObject* o, Py_ssize_t off, PyObject* v) {
  *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off) = v;
}

// A new TensorMeta (conj and neg False), made as object.__new__ makes a slotted instance; nullptr
// with a Python error only when out of memory.
PyObject* make(const Dims& shape, const Dims& stride, int64_t offset, PyObject* dtype,
               PyObject* index) {
  PyObject* sh = int_tuple(shape);
  PyObject* st = sh != nullptr ? int_tuple(stride) : nullptr;
  PyObject* off = st != nullptr ? PyLong_FromLongLong(offset) : nullptr;
  PyObject* o = off != nullptr ? T.type->tp_alloc(T.type, 0) : nullptr;
  if (o == nullptr) {
    Py_XDECREF(sh);
    Py_XDECREF(st);
    Py_XDECREF(off);
    return nullptr;
  }
  set_slot(o, T.shape, sh);
  set_slot(o, T.stride, st);
  set_slot(o, T.offset, off);
  Py_INCREF(dtype);
  set_slot(o, T.dtype, dtype);
  Py_INCREF(index);
  set_slot(o, T.index, index);
  Py_INCREF(Py_False);
  set_slot(o, T.conj, Py_False);
  Py_INCREF(Py_False);
  set_slot(o, T.neg, Py_False);
  return o;
}

// A fresh row-major output.
PyObject* make_contiguous(const Dims& shape, PyObject* dtype, PyObject* index) {
  Dims stride;
  if (!contiguous_strides(shape, stride)) {
    return nullptr;
  }
  return make(shape, stride, 0, dtype, index);
}

// --- views -----------------------------------------------------------------------------------

// ATen's computeStride (shape_rules._view_strides): strides of a view of (shape, stride) as
// `size` (same numel, no zero-size dim, at least one dim), or false where no view exists.
bool view_strides(const Dims& shape, const Dims& stride, const Dims& size, Dims& out) {
  out.assign(size.size(), 0);
  int64_t view_d = static_cast<int64_t>(size.size()) - 1;
  int64_t chunk_base = stride.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    if (!mul_ok(tensor_numel, shape[d], tensor_numel)) {
      return false;
    }
    int64_t next = 0;
    if (d == 0 || (shape[d - 1] != 1 &&
                   (!mul_ok(tensor_numel, chunk_base, next) || stride[d - 1] != next))) {
      while (view_d >= 0 && (view_numel < tensor_numel || size[view_d] == 1)) {
        if (!mul_ok(view_numel, chunk_base, out[view_d]) ||
            !mul_ok(view_numel, size[view_d], view_numel)) {
          return false;
        }
        view_d--;
      }
      if (view_numel != tensor_numel) {
        return false;
      }
      if (d > 0) {
        chunk_base = stride[d - 1];
        tensor_numel = view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

PyObject* view(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x;
  Dims size;
  if (n != 2 || !plain(a[0], x) || !as_ints(a[1], size) || has_zero(x.shape)) {
    return nullptr;
  }
  int64_t total = 0;
  if (!numel(x.shape, total)) {
    return nullptr;
  }
  if (std::count(size.begin(), size.end(), -1) == 1) {
    int64_t known = 1;
    for (int64_t s : size) {
      if (s != -1 && !mul_ok(known, s, known)) {
        return nullptr;
      }
    }
    if (known <= 0 || total % known != 0) {
      return nullptr;
    }
    for (int64_t& s : size) {
      s = s == -1 ? total / known : s;
    }
  }
  int64_t count = 0;
  if (std::any_of(size.begin(), size.end(), [](int64_t s) { return s <= 0; }) ||
      !numel(size, count) || count != total) {
    return nullptr;
  }
  if (dense(x)) {
    return make_contiguous(size, x.dtype, index);
  }
  Dims stride;
  if (size.empty() || x.shape.empty() || !view_strides(x.shape, x.stride, size, stride)) {
    return nullptr;
  }
  return make(size, stride, x.offset, x.dtype, index);
}

// ATen's inferExpandGeometry (shape_rules' expand), false where it would raise.
bool expand_geometry(const Meta& x, const Dims& size, Dims& shape, Dims& stride) {
  const size_t n = size.size();
  if (n < x.ndim()) {
    return false;
  }
  shape.assign(n, 0);
  stride.assign(n, 0);
  for (size_t i = n; i-- > 0;) {
    const int64_t d = static_cast<int64_t>(x.ndim()) - static_cast<int64_t>(n) +
                      static_cast<int64_t>(i);
    int64_t sz = 1, st = 1;
    if (d >= 0) {
      sz = x.shape[d];
      st = x.stride[d];
    } else if (i + 1 < n && !mul_ok(shape[i + 1], stride[i + 1], st)) {
      return false;
    }
    int64_t target = size[i];
    if (target == -1) {
      if (d < 0) {
        return false;
      }
      target = sz;
    }
    if (target < 0 || (sz != target && sz != 1)) {
      return false;
    }
    if (sz != target) {
      sz = target;
      st = 0;
    }
    shape[i] = sz;
    stride[i] = st;
  }
  return true;
}

PyObject* expand(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x;
  Dims size, shape, stride;
  if (n != 2 || !plain(a[0], x) || !as_ints(a[1], size) ||
      !expand_geometry(x, size, shape, stride)) {
    return nullptr;
  }
  return make(shape, stride, x.offset, x.dtype, index);
}

PyObject* unsqueeze(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x;
  int64_t d = 0;
  if (n != 2 || !plain(a[0], x) || !dim(a[1], static_cast<int64_t>(x.ndim()) + 1, d)) {
    return nullptr;
  }
  int64_t st = 1;
  if (static_cast<size_t>(d) < x.ndim() && !mul_ok(x.shape[d], x.stride[d], st)) {
    return nullptr;
  }
  x.shape.insert(x.shape.begin() + d, 1);
  x.stride.insert(x.stride.begin() + d, st);
  return make(x.shape, x.stride, x.offset, x.dtype, index);
}

PyObject* transpose(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x;
  int64_t d0 = 0, d1 = 0;
  if (n != 3 || !plain(a[0], x) || x.ndim() == 0) {
    return nullptr;
  }
  const auto nd = static_cast<int64_t>(x.ndim());
  if (!dim(a[1], nd, d0) || !dim(a[2], nd, d1)) {
    return nullptr;
  }
  std::swap(x.shape[d0], x.shape[d1]);
  std::swap(x.stride[d0], x.stride[d1]);
  return make(x.shape, x.stride, x.offset, x.dtype, index);
}

// x[..., start:end:step] (ATen's slice: bounds wrapped once, then clamped); any layout.
PyObject* slice(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x;
  if (n < 1 || n > 5 || !plain(a[0], x) || x.ndim() == 0) {
    return nullptr;
  }
  int64_t d = 0, step = 1;
  if (n > 1 && !dim(a[1], static_cast<int64_t>(x.ndim()), d)) {
    return nullptr;
  }
  if (n > 4 && !as_int(a[4], step)) {
    return nullptr;
  }
  const int64_t size = x.shape[d];
  int64_t lo = 0, hi = size;
  if (n > 2 && a[2] != Py_None) {
    if (!as_int(a[2], lo)) {
      return nullptr;
    }
    lo = lo < 0 ? lo + size : lo;
  }
  if (n > 3 && a[3] != Py_None) {
    if (!as_int(a[3], hi)) {
      return nullptr;
    }
    hi = hi < 0 ? hi + size : hi;
  }
  if (step < 1) {
    return nullptr;
  }
  lo = std::min(std::max<int64_t>(lo, 0), size);
  hi = std::min(std::max(hi, lo), size);
  int64_t off = 0;
  if (!mul_ok(lo, x.stride[d], off) || __builtin_add_overflow(off, x.offset, &off) ||
      !mul_ok(x.stride[d], step, x.stride[d])) {
    return nullptr;
  }
  x.shape[d] = (hi - lo) / step + ((hi - lo) % step != 0 ? 1 : 0);
  return make(x.shape, x.stride, off, x.dtype, index);
}

// --- pointwise -------------------------------------------------------------------------------

// Tensor.is_contiguous for the dimension order `order` (fastest first); size-1 dims free.
template <class Order>
bool is_contiguous(const Dims& shape, const Dims& stride, const Order& order) {
  int64_t expected = 1;
  for (int64_t d : order) {
    if (shape[d] != 1) {
      if (stride[d] != expected || !mul_ok(expected, shape[d], expected)) {
        return false;
      }
    }
  }
  return true;
}

// Output strides of an elementwise op over `ops` broadcast to `shape` (no zero-size dim) as
// torch._prims._prim_elementwise_meta computes them (shape_rules._elementwise_strides):
// contiguous or channels-last shortcuts, else TensorIterator's insertion sort of the dimensions
// by the operands' strides (shape_rules.sort_dims).
bool elementwise_strides(const Dims& shape, const c10::SmallVector<Meta, 3>& ops, Dims& out) {
  const size_t n = shape.size();
  if (n == 0) {
    out.clear();
    return true;
  }
  if (n == 1) {
    out.assign(1, 1);
    return true;
  }
  c10::SmallVector<Dims, 3> ts;  // the operands' strides, expanded to `shape`
  for (const Meta& m : ops) {
    Dims sh, st;
    if (m.shape == shape) {
      st = m.stride;
    } else if (!expand_geometry(m, shape, sh, st)) {
      return false;
    }
    ts.push_back(std::move(st));
  }
  Dims rev(n), cl_order;
  for (size_t i = 0; i < n; ++i) {
    rev[i] = static_cast<int64_t>(n - 1 - i);
  }
  bool contiguous = true, channels_last = n == 4;
  const std::initializer_list<int64_t> cl = {1, 3, 2, 0};
  for (const Dims& st : ts) {
    contiguous = contiguous && is_contiguous(shape, st, rev);
    channels_last = channels_last && is_contiguous(shape, st, cl);
  }
  if (contiguous && !channels_last) {
    return contiguous_strides(shape, out);
  }
  Dims perm;
  if (channels_last && !contiguous) {
    perm = {0, 2, 3, 1};
  } else {
    auto should_swap = [&](int64_t a, int64_t b) -> int {
      for (const Dims& st : ts) {
        const int64_t sa = st[a], sb = st[b];
        if (sa == 0 || sb == 0) {
          continue;
        }
        if (sa == sb) {
          if (shape[b] >= shape[a]) {
            continue;
          }
          return 1;
        }
        return sb >= sa ? -1 : 1;
      }
      return 0;
    };
    Dims order = rev;
    for (size_t i = 1; i < n; ++i) {
      size_t d1 = i;
      for (size_t d0 = i; d0-- > 0;) {
        const int c = should_swap(order[d0], order[d1]);
        if (c > 0) {
          std::swap(order[d0], order[d1]);
          d1 = d0;
        } else if (c < 0) {
          break;
        }
      }
    }
    perm.assign(order.rbegin(), order.rend());
  }
  out.assign(n, 0);
  int64_t acc = 1;
  for (size_t i = n; i-- > 0;) {  // physical order, fastest last
    out[perm[i]] = acc;
    if (!mul_ok(acc, shape[perm[i]], acc)) {
      return false;
    }
  }
  return true;
}

// A fresh elementwise output over `ops` (broadcast) of `dtype` (shape_rules._pointwise).
PyObject* pointwise(const c10::SmallVector<Meta, 3>& ops, PyObject* dtype, PyObject* index) {
  Dims shape;
  for (const Meta& m : ops) {
    if (m.offset < 0 || !broadcast(shape, m.shape, shape)) {
      return nullptr;
    }
  }
  Dims stride;
  if (has_zero(shape) || !elementwise_strides(shape, ops, stride)) {
    return nullptr;
  }
  return make(shape, stride, 0, dtype, index);
}

int category(at::ScalarType s) {  // shape_rules._category
  return s == at::kBool ? 0 : c10::isFloatingType(s) ? 2 : c10::isComplexType(s) ? 3 : 1;
}

// Two dense operands of one dtype, or a dense tensor and a Python number of its category
// (shape_rules._binary): the output row-major over the broadcast shape.
PyObject* binary_dense(PyObject* const* a, Py_ssize_t n, PyObject* index, bool compare) {
  Meta x, y;
  if (n != 2 || !plain(a[0], x) || !is_arith(x.st) || !dense(x) || x.ndim() == 0) {
    return nullptr;
  }
  Dims shape;
  if (is_meta(a[1])) {
    if (!plain(a[1], y) || y.dtype != x.dtype || !dense(y) || y.ndim() == 0 ||
        !broadcast(x.shape, y.shape, shape)) {
      return nullptr;
    }
  } else if (PyLong_CheckExact(a[1]) || (PyFloat_CheckExact(a[1]) && is_float(x.st))) {
    shape = x.shape;
  } else {
    return nullptr;
  }
  return make_contiguous(shape, compare ? dtype_object(at::kBool) : x.dtype, index);
}

// Two operands of one dtype (a 0-dim one of a lower category allowed), or a tensor and a Python
// number of its category, any layout (shape_rules._binary_iter).
PyObject* binary_iter(PyObject* const* a, Py_ssize_t n, PyObject* index, bool compare) {
  c10::SmallVector<Meta, 3> ops(1);
  Meta& x = ops[0];
  if (n != 2 || !plain(a[0], x) || !is_arith(x.st)) {
    return nullptr;
  }
  PyObject* dtype = compare ? dtype_object(at::kBool) : x.dtype;
  if (is_meta(a[1])) {
    Meta y;
    if (!plain(a[1], y)) {
      return nullptr;
    }
    const bool lower_zero_dim = y.ndim() == 0 && x.ndim() > 0 && category(y.st) <= category(x.st);
    if (y.dtype != x.dtype && !lower_zero_dim) {
      return nullptr;
    }
    ops.push_back(std::move(y));
    return pointwise(ops, dtype, index);
  }
  PyObject* v = a[1];
  if (!(PyLong_CheckExact(v) || PyBool_Check(v) || (PyFloat_CheckExact(v) && is_float(x.st)))) {
    return nullptr;
  }
  return pointwise(ops, dtype, index);
}

PyObject* arith(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  PyObject* r = binary_dense(a, n, index, false);
  return r != nullptr || PyErr_Occurred() ? r : binary_iter(a, n, index, false);
}

PyObject* compare(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  PyObject* r = binary_dense(a, n, index, true);
  return r != nullptr || PyErr_Occurred() ? r : binary_iter(a, n, index, true);
}

// True division: floating operands of one dtype only (integers promote to float).
PyObject* true_divide(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x;
  if (n != 2 || !plain(a[0], x) || !is_float(x.st)) {
    return nullptr;
  }
  return binary_iter(a, n, index, false);
}

// x * number spelled with the Scalar overload (SDPA's math path).
PyObject* mul_scalar(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  if (n != 2 || is_meta(a[1])) {
    return nullptr;
  }
  return binary_iter(a, n, index, false);
}

// where(cond, a, b): a bool condition, a and b of one dtype.
PyObject* where(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  c10::SmallVector<Meta, 3> ops(3);
  if (n != 3 || !plain(a[0], ops[0]) || !plain(a[1], ops[1]) || !plain(a[2], ops[2]) ||
      ops[0].st != at::kBool || ops[1].dtype != ops[2].dtype || !is_arith(ops[1].st)) {
    return nullptr;
  }
  return pointwise(ops, ops[1].dtype, index);
}

// tanh, exp, neg, sqrt, rsqrt, sigmoid, relu of a float tensor.
PyObject* unary(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  c10::SmallVector<Meta, 3> ops(1);
  if (n != 1 || !plain(a[0], ops[0]) || !is_float(ops[0].st)) {
    return nullptr;
  }
  return pointwise(ops, ops[0].dtype, index);
}

PyObject* pow_scalar(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  c10::SmallVector<Meta, 3> ops(1);
  if (n != 2 || !plain(a[0], ops[0]) || !is_float(ops[0].st) ||
      !(PyLong_CheckExact(a[1]) || PyFloat_CheckExact(a[1]))) {
    return nullptr;
  }
  return pointwise(ops, ops[0].dtype, index);
}

// _softmax(x, dim, half_to_float=False), _log_softmax: x's shape, contiguous whatever x's layout
// (the structured kernels' meta function; an empty x goes to the meta kernel).
PyObject* softmax(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x;
  int64_t d = 0;
  if (n != 3 || !plain(a[0], x) || !PyLong_CheckExact(a[1]) || !falsy(a[2]) ||
      !is_float(x.st) || has_zero(x.shape) ||
      !dim(a[1], std::max<int64_t>(static_cast<int64_t>(x.ndim()), 1), d)) {
    return nullptr;
  }
  return make_contiguous(x.shape, x.dtype, index);
}

// _safe_softmax(x, dim[, dtype=None]) (SDPA's math path): as _softmax.
PyObject* safe_softmax(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  if (n < 2 || n > 3 || (n == 3 && a[2] != Py_None)) {
    return nullptr;
  }
  PyObject* args[3] = {a[0], a[1], Py_False};
  return softmax(args, 3, index);
}

// any.dim(x, dim, keepdim=False), all.dim: a reduction over one dimension (generate's stopping
// checks), bool and contiguous as resize_reduction lays it out, whatever x's layout; uint8 inputs
// (which keep their dtype), 0-dim and empty inputs go to the meta kernel.
PyObject* any_dim(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x;
  int64_t d = 0;
  if (n < 2 || n > 3 || !plain(a[0], x) || x.st == at::kByte || x.ndim() == 0 ||
      has_zero(x.shape) || !dim(a[1], static_cast<int64_t>(x.ndim()), d) ||
      (n == 3 && !PyBool_Check(a[2]))) {
    return nullptr;
  }
  if (n == 3 && a[2] == Py_True) {
    x.shape[d] = 1;
  } else {
    x.shape.erase(x.shape.begin() + d);
  }
  return make_contiguous(x.shape, dtype_object(at::kBool), index);
}

// --- cat and the matmul family ---------------------------------------------------------------

// suggest_memory_format(m) is channels-last (2d or 3d): strides follow NHWC/NDHWC.
bool channels_last_like(const Meta& m) {
  const size_t n = m.ndim();
  if ((n != 4 && n != 5) || m.stride[1] == 0) {
    return false;
  }
  static const int64_t order4[] = {1, 3, 2, 0};
  static const int64_t order5[] = {1, 4, 3, 2, 0};
  const int64_t* order = n == 4 ? order4 : order5;
  int64_t lo = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t d = order[i];
    if (m.shape[d] == 0 || m.stride[d] < lo || (d == 0 && lo == m.stride[1])) {
      return false;
    }
    if (!mul_ok(m.stride[d], m.shape[d], lo)) {
      lo = INT64_MAX;  // Python's exact product: above every stride
    }
  }
  return true;
}

// cat(tensors, dim) of one dtype, any layouts, as torch._refs.cat computes it: 1-d empty inputs
// skipped (a KV cache's first step), the output contiguous unless every input is
// channels-last-like (declined).
PyObject* cat(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  if (n < 1 || n > 2 || (!PyList_CheckExact(a[0]) && !PyTuple_CheckExact(a[0]))) {
    return nullptr;
  }
  const Py_ssize_t k = PySequence_Fast_GET_SIZE(a[0]);
  PyObject** items = PySequence_Fast_ITEMS(a[0]);
  if (k == 0) {
    return nullptr;
  }
  c10::SmallVector<Meta, 4> ts(static_cast<size_t>(k));
  bool all_cl = true;
  for (Py_ssize_t i = 0; i < k; ++i) {
    Meta& t = ts[static_cast<size_t>(i)];
    if (!plain(items[i], t) || t.dtype != ts[0].dtype) {
      return nullptr;
    }
    all_cl = all_cl && channels_last_like(t);
  }
  if (all_cl) {
    return nullptr;
  }
  const Meta* first = nullptr;
  for (const Meta& t : ts) {
    if (!(t.ndim() == 1 && t.shape[0] == 0)) {
      first = &t;
      break;
    }
  }
  if (first == nullptr || first->ndim() == 0) {
    return nullptr;
  }
  const auto nd = static_cast<int64_t>(first->ndim());
  int64_t d = 0;
  if (n == 2 && !dim(a[1], nd, d)) {
    return nullptr;
  }
  int64_t total = 0;
  for (const Meta& t : ts) {
    if (t.ndim() == 1 && t.shape[0] == 0) {
      continue;
    }
    if (t.ndim() != first->ndim() || has_zero(t.shape)) {
      return nullptr;
    }
    for (int64_t i = 0; i < nd; ++i) {
      if (i != d && t.shape[i] != first->shape[i]) {
        return nullptr;
      }
    }
    if (__builtin_add_overflow(total, t.shape[d], &total)) {
      return nullptr;
    }
  }
  Dims shape = first->shape;
  shape[d] = total;
  return make_contiguous(shape, first->dtype, index);
}

// Two plain float operands of one dtype, no empty dims.
bool float_pair(PyObject* const* a, Meta& x, Meta& y) {
  return plain(a[0], x) && plain(a[1], y) && x.dtype == y.dtype && is_float(x.st) &&
         !has_zero(x.shape) && !has_zero(y.shape);
}

bool mm_shape(PyObject* const* a, Meta& x, Dims& shape) {
  Meta y;
  if (!float_pair(a, x, y) || x.ndim() != 2 || y.ndim() != 2 || x.shape[1] != y.shape[0]) {
    return false;
  }
  shape = {x.shape[0], y.shape[1]};
  return true;
}

PyObject* mm(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x;
  Dims shape;
  if (n != 2 || !mm_shape(a, x, shape)) {
    return nullptr;
  }
  return make_contiguous(shape, x.dtype, index);
}

// addmm(bias, m1, m2) with a bias that broadcasts to the product (no beta/alpha).
PyObject* addmm(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta bias, x;
  Dims shape, b;
  if (n != 3 || !plain(a[0], bias) || !mm_shape(a + 1, x, shape) || bias.dtype != x.dtype ||
      bias.ndim() > 2 || !broadcast(bias.shape, shape, b) || b != shape) {
    return nullptr;
  }
  return make_contiguous(shape, x.dtype, index);
}

PyObject* bmm(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x, y;
  if (n != 2 || !float_pair(a, x, y) || x.ndim() != 3 || y.ndim() != 3 ||
      x.shape[0] != y.shape[0] || x.shape[2] != y.shape[1]) {
    return nullptr;
  }
  return make_contiguous({x.shape[0], x.shape[1], y.shape[2]}, x.dtype, index);
}

// matmul(a, b) (recorded whole: csrc/whole.cpp): the shape torch.matmul documents (1-d operands
// promoted and their dim removed, batch dims broadcast), contiguous.
PyObject* matmul(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x, y;
  if (n != 2 || !float_pair(a, x, y) || x.ndim() == 0 || y.ndim() == 0) {
    return nullptr;
  }
  const Dims& sa = x.shape;
  const Dims& sb = y.shape;
  if (sa.back() != (sb.size() == 1 ? sb[0] : sb[sb.size() - 2])) {
    return nullptr;
  }
  Dims shape;
  if (!broadcast(slice_of(sa, 0, sa.size() >= 2 ? sa.size() - 2 : 0),
                 slice_of(sb, 0, sb.size() >= 2 ? sb.size() - 2 : 0), shape)) {
    return nullptr;
  }
  if (sa.size() >= 2) {
    shape.push_back(sa[sa.size() - 2]);
  }
  if (sb.size() > 1) {
    shape.push_back(sb.back());
  }
  return make_contiguous(shape, x.dtype, index);
}

// linear(x, w[, b]) with a 2-d weight and a 1-d bias or none (recorded whole): x's leading
// dims and the weight's output features, contiguous.
PyObject* linear(PyObject* const* a, Py_ssize_t n, PyObject* index) {
  Meta x, w, b;
  if (n < 2 || n > 3 || !float_pair(a, x, w) || x.ndim() == 0 || w.ndim() != 2 ||
      x.shape.back() != w.shape[1]) {
    return nullptr;
  }
  if (n == 3 && a[2] != Py_None &&
      (!plain(a[2], b) || b.dtype != x.dtype || b.ndim() != 1 || b.shape[0] != w.shape[0])) {
    return nullptr;
  }
  Dims shape = x.shape;
  shape.back() = w.shape[0];
  return make_contiguous(shape, x.dtype, index);
}

// --- factories (keyword rules) ---------------------------------------------------------------

// Whether `kwargs` (a dict) has only keys among `names`.
bool only_keys(PyObject* kwargs, std::initializer_list<const char*> names) {
  Py_ssize_t pos = 0, known = 0;
  PyObject *k, *v;
  while (PyDict_Next(kwargs, &pos, &k, &v)) {
    if (!PyUnicode_Check(k)) {
      return false;
    }
    for (const char* name : names) {
      known += PyUnicode_CompareWithASCIIString(k, name) == 0 ? 1 : 0;
    }
  }
  return known == PyDict_GET_SIZE(kwargs);
}

bool is_format(PyObject* o, c10::MemoryFormat f) {
  return o != nullptr && THPMemoryFormat_Check(o) &&
         reinterpret_cast<THPMemoryFormat*>(o)->memory_format == f;
}

// `v` == one of `options` (Python's `in`).
bool one_of(PyObject* v, std::initializer_list<PyObject*> options) {
  for (PyObject* o : options) {
    const int r = PyObject_RichCompareBool(v, o, Py_EQ);
    if (r < 0) {
      PyErr_Clear();
      return false;
    }
    if (r == 1) {
      return true;
    }
  }
  return false;
}

// The output's device index from a factory's keyword arguments (shape_rules._factory_index), a
// new reference, or nullptr: decline.
PyObject* factory_index(PyObject* kwargs, PyObject* index) {
  PyObject* layout = PyDict_GetItemString(kwargs, "layout");  // borrowed
  PyObject* pin = PyDict_GetItemString(kwargs, "pin_memory");
  PyObject* strided = reinterpret_cast<PyObject*>(torch::getTHPLayout(at::kStrided));
  if ((layout != nullptr && !one_of(layout, {Py_None, strided})) ||
      (pin != nullptr && !one_of(pin, {Py_None, Py_False}))) {
    return nullptr;
  }
  PyObject* dev = PyDict_GetItemString(kwargs, "device");
  if (dev == nullptr || dev == Py_None) {
    Py_INCREF(index);
    return index;
  }
  if (!THPDevice_Check(dev)) {
    return nullptr;
  }
  const c10::Device d = reinterpret_cast<THPDevice*>(dev)->device;
  if (d.type() != c10::DeviceType::PrivateUse1) {
    return nullptr;
  }
  if (!d.has_index()) {
    Py_INCREF(index);
    return index;
  }
  return PyLong_FromLong(d.index());
}

// arange with int bounds (position ids of a decode step: a new start every step). Float bounds,
// a zero step or bounds inconsistent with the step's sign go to the meta kernel.
PyObject* arange(PyObject* const* a, Py_ssize_t n, PyObject* kwargs, PyObject* index) {
  int64_t start = 0, end = 0, step = 1;
  if (n < 1 || n > 3 || !as_int(a[n == 1 ? 0 : 1], end) || (n > 1 && !as_int(a[0], start)) ||
      (n == 3 && !as_int(a[2], step)) || step == 0) {
    return nullptr;
  }
  if (!only_keys(kwargs, {"dtype", "layout", "device", "pin_memory"})) {
    return nullptr;
  }
  PyObject* dtype = PyDict_GetItemString(kwargs, "dtype");
  if (dtype == nullptr || dtype == Py_None) {
    dtype = dtype_object(at::kLong);
  } else if (!THPDtype_Check(dtype)) {
    return nullptr;
  } else {
    const at::ScalarType s = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
    if (s != at::kLong && s != at::kInt && s != at::kFloat && s != at::kDouble) {
      return nullptr;
    }
  }
  int64_t span = 0;
  if (__builtin_sub_overflow(end, start, &span) || (span != 0 && (span > 0) != (step > 0)) ||
      (span == INT64_MIN && step == -1)) {
    return nullptr;
  }
  PyObject* out = factory_index(kwargs, index);
  if (out == nullptr) {
    return nullptr;
  }
  // ceil(span / step), exact (span and step of one sign, or span 0)
  const int64_t len = span / step + (span % step != 0 ? 1 : 0);
  PyObject* r = make({len}, {1}, 0, dtype, out);
  Py_DECREF(out);
  return r;
}

// clone(x, memory_format=...): contiguous for contiguous_format; for the default
// (preserve_format), x's own layout where it is dense row-major. Others: the meta kernel.
PyObject* clone(PyObject* const* a, Py_ssize_t n, PyObject* kwargs, PyObject* index) {
  Meta x;
  if (n != 1 || !plain(a[0], x) || !only_keys(kwargs, {"memory_format"})) {
    return nullptr;
  }
  PyObject* fmt = PyDict_GetItemString(kwargs, "memory_format");  // borrowed
  const bool preserve = fmt == nullptr || fmt == Py_None ||
                        is_format(fmt, c10::MemoryFormat::Preserve);
  if (!is_format(fmt, c10::MemoryFormat::Contiguous) && !(preserve && dense(x))) {
    return nullptr;
  }
  return make_contiguous(x.shape, x.dtype, index);
}

// isin(elements, test_elements): a bool tensor of the elements' shape, row-major where the
// elements are contiguous (size-1 dims free: generate's input_ids[:, -1:]); other layouts go to
// the meta kernel (empty_like of the elements).
PyObject* isin(PyObject* const* a, Py_ssize_t n, PyObject* kwargs, PyObject* index) {
  Meta x, t;
  if (n != 2 || !only_keys(kwargs, {"assume_unique", "invert"}) || !plain(a[0], x) ||
      !plain(a[1], t) || !is_arith(x.st) || !is_arith(t.st) || x.ndim() == 0 ||
      has_zero(x.shape)) {
    return nullptr;
  }
  Dims rev(x.ndim());
  for (size_t i = 0; i < x.ndim(); ++i) {
    rev[i] = static_cast<int64_t>(x.ndim() - 1 - i);
  }
  if (!is_contiguous(x.shape, x.stride, rev)) {
    return nullptr;
  }
  return make_contiguous(x.shape, dtype_object(at::kBool), index);
}

// empty_like's strides for a float tensor of (shape, stride), asked of the meta kernel once per
// layout (HF's transposed attention heads keep theirs).
bool like_strides(const Meta& q, Dims& out) {
  static std::map<std::pair<Dims, Dims>, Dims> layouts;  // bounded by the layouts a model has
  auto key = std::make_pair(q.shape, q.stride);
  auto it = layouts.find(key);
  if (it == layouts.end()) {
    if (layouts.size() >= 4096) {
      layouts.clear();
    }
    try {
      const at::Tensor t = at::empty_strided(q.shape, q.stride,
                                             at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
      const auto st = at::empty_like(t).strides();
      it = layouts.emplace(std::move(key), Dims(st.begin(), st.end())).first;
    } catch (const std::exception&) {
      return false;  // the meta kernel decides
    }
  }
  out = it->second;
  return true;
}

// _scaled_dot_product_flash_attention_for_cpu(q, k, v, ...) (SDPA on the CPU): its meta kernel
// reads only the query: the output is empty_like(q), the logsumexp a float (B, Lq, H) transposed
// to (B, H, Lq). A query with a storage offset or of another rank goes to the meta kernel.
PyObject* flash_attention_for_cpu(PyObject* const* a, Py_ssize_t n, PyObject* kwargs,
                                  PyObject* index) {
  Meta q, k, v;
  Dims stride;
  if (n < 3 || n > 5 || !only_keys(kwargs, {"attn_mask", "scale"}) || !plain(a[0], q) ||
      !plain(a[1], k) || !plain(a[2], v) || q.ndim() != 4 || q.offset != 0 ||
      !like_strides(q, stride)) {
    return nullptr;
  }
  const int64_t b = q.shape[0], h = q.shape[1], lq = q.shape[2];
  int64_t lqh = 0;
  if (!mul_ok(lq, h, lqh)) {
    return nullptr;
  }
  PyObject* out = make(q.shape, stride, 0, q.dtype, index);
  PyObject* lse = out != nullptr ? make({b, h, lq}, {lqh, 1, h}, 0, dtype_object(at::kFloat), index)
                                 : nullptr;
  PyObject* r = lse != nullptr ? PyTuple_Pack(2, out, lse) : nullptr;
  Py_XDECREF(out);
  Py_XDECREF(lse);
  return r;
}

// --- the rules as Python callables -------------------------------------------------------------

using Positional = PyObject* (*)(PyObject* const*, Py_ssize_t, PyObject*);
using Keyword = PyObject* (*)(PyObject* const*, Py_ssize_t, PyObject*, PyObject*);

PyObject* declined_or(PyObject* r) {
  if (r == nullptr && !PyErr_Occurred()) {
    Py_RETURN_NONE;
  }
  return r;
}

bool sequence_arg(PyObject* args) {
  if (PyTuple_Check(args) || PyList_Check(args)) {
    return true;
  }
  PyErr_SetString(PyExc_TypeError, "a shape rule takes its op's positional arguments as a tuple");
  return false;
}

// rule(args, index) -> TensorMeta | None, as genie.shape_rules.RULES calls it.
template <Positional F>
PyObject* positional(PyObject* /*self*/, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "a shape rule takes (args, index)");
    return nullptr;
  }
  if (!sequence_arg(argv[0])) {
    return nullptr;
  }
  return declined_or(F(PySequence_Fast_ITEMS(argv[0]), PySequence_Fast_GET_SIZE(argv[0]),
                       argv[1]));
}

// rule(args, kwargs, index) -> TensorMeta | None, as genie.shape_rules.KW_RULES calls it.
template <Keyword F>
PyObject* keyword(PyObject* /*self*/, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 3 || !sequence_arg(argv[0]) || !PyDict_Check(argv[1])) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_TypeError, "a keyword shape rule takes (args, kwargs: dict, index)");
    }
    return nullptr;
  }
  return declined_or(F(PySequence_Fast_ITEMS(argv[0]), PySequence_Fast_GET_SIZE(argv[0]),
                       argv[1], argv[2]));
}

#define GENIE_RULE(name, doc) \
  {"_rule_" #name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&positional<name>)), \
   METH_FASTCALL, doc}

PyMethodDef rule_defs[] = {
    GENIE_RULE(view, "view, _unsafe_view: ATen's computeStride, or contiguous for a dense input."),
    GENIE_RULE(expand, "expand: ATen's inferExpandGeometry."),
    GENIE_RULE(unsqueeze, "unsqueeze: a size-1 dim, its stride as ATen's."),
    GENIE_RULE(transpose, "transpose.int: two dims swapped."),
    GENIE_RULE(slice, "slice.Tensor: bounds wrapped once, then clamped; any layout."),
    GENIE_RULE(arith, "add/sub/mul.Tensor: one dtype (a lower 0-dim operand), TensorIterator's "
               "layout."),
    GENIE_RULE(compare, "le/lt/ge/gt/eq/ne: as add, a bool output."),
    GENIE_RULE(true_divide, "div.Tensor: floating operands of one dtype."),
    GENIE_RULE(mul_scalar, "mul.Scalar: x's layout, no promotion."),
    GENIE_RULE(where, "where.self: a bool condition, two operands of one dtype."),
    GENIE_RULE(unary, "tanh, exp, neg, sqrt, rsqrt, sigmoid, relu of a float tensor."),
    GENIE_RULE(pow_scalar, "pow.Tensor_Scalar of a float tensor."),
    GENIE_RULE(softmax, "_softmax, _log_softmax of a float tensor: contiguous."),
    GENIE_RULE(safe_softmax, "_safe_softmax of a float tensor, no dtype: contiguous."),
    GENIE_RULE(any_dim, "any.dim, all.dim: one dimension reduced, bool, contiguous."),
    GENIE_RULE(cat, "cat: one dtype, contiguous (1-d empty inputs skipped)."),
    GENIE_RULE(mm, "mm: 2-d floats of one dtype."),
    GENIE_RULE(addmm, "addmm: a bias broadcasting to the product, no beta/alpha."),
    GENIE_RULE(bmm, "bmm: 3-d floats of one dtype."),
    GENIE_RULE(matmul, "matmul: torch.matmul's documented shape, contiguous."),
    GENIE_RULE(linear, "linear: a 2-d weight, a 1-d bias or none."),
#define GENIE_KW_RULE(name, doc) \
  {"_rule_" #name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&keyword<name>)), \
   METH_FASTCALL, doc}
    GENIE_KW_RULE(arange, "arange (keyword rule): int bounds, exact length."),
    GENIE_KW_RULE(clone, "clone (keyword rule): contiguous, or a dense input's own layout."),
    GENIE_KW_RULE(isin, "isin.Tensor_Tensor (keyword rule): contiguous elements, a bool output."),
    GENIE_KW_RULE(flash_attention_for_cpu, "_scaled_dot_product_flash_attention_for_cpu "
                  "(keyword rule): empty_like(q) and the float logsumexp."),
    {nullptr, nullptr, 0, nullptr}};

#undef GENIE_RULE
#undef GENIE_KW_RULE

void shape_rules_init(py::object tensor_meta) {
  PyObject* t = tensor_meta.ptr();
  if (!PyType_Check(t)) {
    throw std::invalid_argument("_shape_rules_init takes genie.graph.TensorMeta");
  }
  TensorMetaType m;
  m.type = reinterpret_cast<PyTypeObject*>(t);
  m.shape = slot_offset(m.type, "shape");
  m.stride = slot_offset(m.type, "stride");
  m.offset = slot_offset(m.type, "offset");
  m.dtype = slot_offset(m.type, "dtype");
  m.index = slot_offset(m.type, "index");
  m.conj = slot_offset(m.type, "conj");
  m.neg = slot_offset(m.type, "neg");
  Py_INCREF(t);  // kept for the process
  T = m;
}

}  // namespace

void add_shape_rule_functions(py::module_& m) {
  m.def("_shape_rules_init", &shape_rules_init, py::arg("tensor_meta"),
        "The TensorMeta class the _rule_* functions read and make (genie.shape_rules).");
  for (PyMethodDef* d = rule_defs; d->ml_name != nullptr; ++d) {
    PyObject* f = PyCFunction_NewEx(d, nullptr, m.attr("__name__").ptr());
    if (f == nullptr || PyModule_AddObject(m.ptr(), d->ml_name, f) < 0) {
      Py_XDECREF(f);
      throw py::error_already_set();
    }
  }
}

}  // namespace genie
