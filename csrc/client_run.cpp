// genie._C._client_reply: a remote client's steady run reply read in one native call
// (genie.remote.client.Client._receive and Client._read_outputs).
//
// A steady run (a plan's request, booked before its answer: Client.run's `early` case) waits for
// one reply: a msgpack header {"t": "ok", "rid": rid, "o": metas, "st", "res", "vt", "er", "ix"}
// and one frame per requested output. The Python path reads it in ~30 Python steps right after
// the wait, on the caches the client wakes to (`unpack`, the header's checks, `join_frames`, per
// output `_host_tensor`: ~40-60 µs a request where each step is a cache miss). Here the header is
// decoded, checked and its outputs made into host tensors in one call.
//
// The client does not trust the server: this reader takes only the plain case and declines
// (returns None, having changed nothing) anything else, which then goes the Python path from
// the start, the reference (GENIE_CLIENT_NATIVE=0 always takes it). Declined: a header that is
// not exactly one msgpack map of the keys above with their plain types (a key unknown here, a
// duplicate key, trailing bytes, a status other than "ok", another request's rid, frames split
// into chunks ("fc"), a header over `limit` bytes); an output count that is not the request's or
// the frames'; an output meta that is not [dtype name, shape of non-negative ints, None or
// strides of the shape's rank]; a dtype name not among the wire dtypes; a frame whose size is
// not the meta's; strides that are not a dense, non-overlapping layout of the frame's elements;
// an empty tensor; a frame of ZERO_COPY_MIN bytes or more (the Python path may keep its memory);
// a one-element bool whose byte is not 0 or 1 (Python reads its truth). Whatever is taken is
// what the Python path makes of it (tests/unit/test_client_native.py holds both equal, the
// malformed replies among them): every output a fresh tensor of the allocator with the frame's
// bytes, marked `_genie_own`, set as `into[k].host` only once all outputs are made.
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

#include <ATen/EmptyTensor.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace genie {
namespace {

// the wire dtypes by name (genie.remote.protocol._DTYPES within WIRE_DTYPES; set once at import)
std::vector<std::pair<std::string, at::ScalarType>> g_dtypes;
// genie.remote.client.ZERO_COPY_MIN (set with the dtypes)
int64_t g_copy_max = 0;

constexpr size_t kMaxDims = 64;

// A bounded msgpack reader over one buffer: every read checks the bytes left; any format it does
// not take (or a malformed one) makes `ok` false.
struct Reader {
  const uint8_t* p;
  const uint8_t* end;
  bool ok = true;

  bool need(size_t n) {
    if (!ok || static_cast<size_t>(end - p) < n) {
      ok = false;
    }
    return ok;
  }
  uint64_t be(int n) {
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) {
      x = (x << 8) | p[i];
    }
    p += n;
    return x;
  }
  // the tag of the next value, not consumed (0xc1, msgpack's "never used", when none)
  uint8_t peek() {
    return need(1) ? *p : 0xc1;
  }
  bool nil() {
    if (peek() == 0xc0) {
      ++p;
      return true;
    }
    return false;
  }
  // an integer (msgpack's int formats) within int64
  bool integer(int64_t& x) {
    if (!need(1)) {
      return false;
    }
    const uint8_t t = *p;
    if (t <= 0x7f) {
      x = t;
      ++p;
      return true;
    }
    if (t >= 0xe0) {
      x = static_cast<int8_t>(t);
      ++p;
      return true;
    }
    int n = 0;
    bool sign = false;
    switch (t) {
      case 0xcc: n = 1; break;
      case 0xcd: n = 2; break;
      case 0xce: n = 4; break;
      case 0xcf: n = 8; break;
      case 0xd0: n = 1; sign = true; break;
      case 0xd1: n = 2; sign = true; break;
      case 0xd2: n = 4; sign = true; break;
      case 0xd3: n = 8; sign = true; break;
      default: return false;  // not an integer (the caller declines)
    }
    ++p;
    if (!need(n)) {
      return false;
    }
    const uint64_t u = be(n);
    if (!sign) {
      if (u > static_cast<uint64_t>(INT64_MAX)) {
        ok = false;
        return false;
      }
      x = static_cast<int64_t>(u);
    } else {
      const int shift = 64 - 8 * n;  // sign-extend
      x = static_cast<int64_t>(u << shift) >> shift;
    }
    return true;
  }
  bool is_float() {
    const uint8_t t = peek();
    return t == 0xca || t == 0xcb;
  }
  bool floating(double& x) {
    if (!need(1)) {
      return false;
    }
    const uint8_t t = *p;
    if (t == 0xca) {
      ++p;
      if (!need(4)) {
        return false;
      }
      const auto u = static_cast<uint32_t>(be(4));
      float f;
      std::memcpy(&f, &u, 4);
      x = f;
      return true;
    }
    if (t == 0xcb) {
      ++p;
      if (!need(8)) {
        return false;
      }
      const uint64_t u = be(8);
      std::memcpy(&x, &u, 8);
      return true;
    }
    return false;
  }
  // a str's bytes (not copied)
  bool str(const char*& s, size_t& n) {
    if (!need(1)) {
      return false;
    }
    const uint8_t t = *p;
    if (t >= 0xa0 && t <= 0xbf) {
      n = t & 0x1f;
      ++p;
    } else if (t == 0xd9 || t == 0xda || t == 0xdb) {
      const int k = t == 0xd9 ? 1 : t == 0xda ? 2 : 4;
      ++p;
      if (!need(k)) {
        return false;
      }
      n = be(k);
    } else {
      return false;
    }
    if (!need(n)) {
      return false;
    }
    s = reinterpret_cast<const char*>(p);
    p += n;
    return true;
  }
  // A container's header: the fix form (`fix`: 0x90 an array, 0x80 a map, 16 counts), the 16-bit
  // form `t16` and, where `t32` is not 0, the 32-bit one; false (no error) for another tag.
  bool header(size_t& n, uint8_t fix, uint8_t t16, uint8_t t32) {
    if (!need(1)) {
      return false;
    }
    const uint8_t t = *p;
    if (t >= fix && t <= fix + 0x0f) {
      n = t & 0x0f;
      ++p;
      return true;
    }
    if (t != t16 && (t32 == 0 || t != t32)) {
      return false;
    }
    const int k = t == t16 ? 2 : 4;
    ++p;
    if (!need(k)) {
      return false;
    }
    n = be(k);
    return true;
  }
  bool array(size_t& n) {
    if (!header(n, 0x90, 0xdc, 0xdd)) {
      return false;
    }
    // every element is at least one byte: a count past the bytes left is malformed
    if (n > static_cast<size_t>(end - p)) {
      ok = false;
    }
    return ok;
  }
  bool map(size_t& n) {
    return header(n, 0x80, 0xde, 0);
  }
  bool ints(std::vector<int64_t>& out) {
    size_t n = 0;
    if (!array(n) || n > kMaxDims) {
      return false;
    }
    out.resize(n);
    for (size_t i = 0; i < n; ++i) {
      if (!integer(out[i])) {
        return false;
      }
    }
    return true;
  }
};

struct Out {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;  // empty with `dense`: contiguous
  bool dense;                   // no strides sent
};

// Whether `stride` lays out `shape` densely without overlap (every element once, span = numel):
// the dims of more than one element, sorted by stride, each stride the product of the sizes
// before it. (genie.remote.protocol.frame_tensor checks the span only; what passes that but is
// not this goes the Python path.)
bool dense_layout(const std::vector<int64_t>& shape, const std::vector<int64_t>& stride) {
  std::vector<std::pair<int64_t, int64_t>> d;  // (stride, size)
  for (size_t i = 0; i < shape.size(); ++i) {
    if (stride[i] < 0) {
      return false;
    }
    if (shape[i] != 1) {
      d.emplace_back(stride[i], shape[i]);
    }
  }
  std::sort(d.begin(), d.end());
  int64_t expect = 1;
  for (const auto& [st, sz] : d) {
    if (st != expect) {
      return false;
    }
    if (__builtin_mul_overflow(expect, sz, &expect)) {
      return false;
    }
  }
  return true;
}

struct Buf {
  Py_buffer v{};
  bool held = false;
  ~Buf() {
    if (held) {
      PyBuffer_Release(&v);
    }
  }
};

bool key_is(const char* s, size_t n, const char* k) {
  return n == std::strlen(k) && std::memcmp(s, k, n) == 0;
}

// The reply `parts` (the header frame, then one frame per output) to the request `rid`, its
// outputs read into `into`'s handles: (the header without "o", the bytes received), or None
// where the Python path must read it (see above). Raises only what Python itself raises (no
// memory, a handle refusing `host`).
py::object client_reply(const py::list& parts, int64_t rid, const py::list& into,
                        Py_ssize_t limit) {
  if (g_dtypes.empty()) {
    throw std::runtime_error("genie._C._client_reply: _client_reply_init was not called");
  }
  const Py_ssize_t nparts = PyList_GET_SIZE(parts.ptr());
  const Py_ssize_t n = PyList_GET_SIZE(into.ptr());
  if (nparts != n + 1) {
    return py::none();
  }
  std::vector<Buf> bufs(static_cast<size_t>(nparts));
  int64_t got = 0;
  for (Py_ssize_t i = 0; i < nparts; ++i) {
    if (PyObject_GetBuffer(PyList_GET_ITEM(parts.ptr(), i), &bufs[i].v, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      return py::none();
    }
    bufs[i].held = true;
    got += bufs[i].v.len;
  }
  const Py_buffer& hv = bufs[0].v;
  if (hv.len > limit) {
    return py::none();
  }
  Reader r{static_cast<const uint8_t*>(hv.buf), static_cast<const uint8_t*>(hv.buf) + hv.len};
  size_t nk = 0;
  if (!r.map(nk)) {
    return py::none();
  }
  // what the keys hold
  bool seen_t = false, seen_rid = false, seen_o = false, seen_st = false, seen_res = false;
  bool seen_vt = false, seen_er = false, seen_ix = false;
  bool st_float = false;
  double st_d = 0;
  int64_t st_i = 0, er = 0, res0 = 0, res1 = 0, ix[3] = {0, 0, 0};
  const char* vt_s = nullptr;
  size_t vt_n = 0;
  std::vector<Out> outs;
  for (size_t k = 0; k < nk; ++k) {
    const char* ks = nullptr;
    size_t kn = 0;
    if (!r.str(ks, kn)) {
      return py::none();
    }
    bool* seen = nullptr;
    if (key_is(ks, kn, "t")) {
      seen = &seen_t;
      const char* s = nullptr;
      size_t sn = 0;
      if (!r.str(s, sn) || !key_is(s, sn, "ok")) {
        return py::none();
      }
    } else if (key_is(ks, kn, "rid")) {
      seen = &seen_rid;
      int64_t x = 0;
      if (!r.integer(x) || x != rid) {
        return py::none();
      }
    } else if (key_is(ks, kn, "st")) {
      seen = &seen_st;
      if (r.is_float()) {
        st_float = true;
        if (!r.floating(st_d)) {
          return py::none();
        }
      } else if (!r.integer(st_i)) {
        return py::none();
      }
    } else if (key_is(ks, kn, "res")) {
      seen = &seen_res;
      size_t an = 0;
      if (!r.array(an) || an != 2 || !r.integer(res0) || !r.integer(res1)) {
        return py::none();
      }
    } else if (key_is(ks, kn, "vt")) {
      seen = &seen_vt;
      if (!r.str(vt_s, vt_n)) {
        return py::none();
      }
    } else if (key_is(ks, kn, "er")) {
      seen = &seen_er;
      if (!r.integer(er)) {
        return py::none();
      }
    } else if (key_is(ks, kn, "ix")) {
      seen = &seen_ix;
      size_t an = 0;
      if (!r.array(an) || an != 3 || !r.integer(ix[0]) || !r.integer(ix[1]) ||
          !r.integer(ix[2])) {
        return py::none();
      }
    } else if (key_is(ks, kn, "o")) {
      seen = &seen_o;
      size_t an = 0;
      if (!r.array(an) || static_cast<Py_ssize_t>(an) != n) {
        return py::none();
      }
      outs.resize(an);
      for (size_t j = 0; j < an; ++j) {
        Out& o = outs[j];
        size_t mn = 0;
        const char* ds = nullptr;
        size_t dn = 0;
        if (!r.array(mn) || mn != 3 || !r.str(ds, dn)) {
          return py::none();
        }
        bool found = false;
        for (const auto& [name, st] : g_dtypes) {
          if (key_is(ds, dn, name.c_str())) {
            o.dtype = st;
            found = true;
            break;
          }
        }
        if (!found || !r.ints(o.shape)) {
          return py::none();
        }
        o.dense = r.nil();
        if (!o.dense && (!r.ints(o.stride) || o.stride.size() != o.shape.size())) {
          return py::none();
        }
      }
    } else {
      return py::none();  // a key this reader does not know: the Python path's
    }
    if (*seen) {
      return py::none();  // a duplicate key
    }
    *seen = true;
  }
  if (!r.ok || r.p != r.end || !seen_t || !seen_rid) {
    return py::none();
  }
  if (!seen_o && n != 0) {
    return py::none();
  }
  // the outputs, each checked against its frame
  std::vector<at::Tensor> made;
  made.reserve(outs.size());
  for (size_t j = 0; j < outs.size(); ++j) {
    const Out& o = outs[j];
    const Py_buffer& fv = bufs[j + 1].v;
    int64_t numel = 1;
    for (const int64_t d : o.shape) {
      if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) {
        return py::none();
      }
    }
    const int64_t item = static_cast<int64_t>(c10::elementSize(o.dtype));
    int64_t nbytes = 0;
    if (numel == 0 || __builtin_mul_overflow(numel, item, &nbytes) || nbytes != fv.len ||
        nbytes >= g_copy_max) {
      return py::none();
    }
    if (!o.dense && !dense_layout(o.shape, o.stride)) {
      return py::none();
    }
    if (o.dtype == at::kBool && numel == 1 && *static_cast<const uint8_t*>(fv.buf) > 1) {
      return py::none();
    }
    std::vector<int64_t> stride = o.stride;
    if (o.dense) {
      stride.resize(o.shape.size());
      int64_t s = 1;
      for (size_t i = o.shape.size(); i-- > 0;) {
        stride[i] = s;
        s *= std::max<int64_t>(o.shape[i], 1);
      }
    }
    // (the CPU allocator's tensor as eager's empty_strided makes it, without the dispatcher)
    at::Tensor t = at::detail::empty_strided_cpu(o.shape, stride, o.dtype);
    std::memcpy(t.data_ptr(), fv.buf, static_cast<size_t>(nbytes));
    made.push_back(std::move(t));
  }
  // the header as Python would have it, less "o" (read here)
  py::dict h;
  h["t"] = py::str("ok", 2);
  h["rid"] = py::int_(rid);
  if (seen_st) {
    h["st"] = st_float ? py::object(py::float_(st_d)) : py::object(py::int_(st_i));
  }
  if (seen_res) {
    h["res"] = py::list(py::make_tuple(res0, res1));
  }
  if (seen_vt) {
    PyObject* s = PyUnicode_DecodeUTF8(vt_s, static_cast<Py_ssize_t>(vt_n), "strict");
    if (s == nullptr) {  // not UTF-8: msgpack's own error, on the Python path
      PyErr_Clear();
      return py::none();
    }
    h["vt"] = py::reinterpret_steal<py::object>(s);
  }
  if (seen_er) {
    h["er"] = py::int_(er);
  }
  if (seen_ix) {
    h["ix"] = py::list(py::make_tuple(ix[0], ix[1], ix[2]));
  }
  static PyObject* own = PyUnicode_InternFromString("_genie_own");
  static PyObject* host = PyUnicode_InternFromString("host");
  std::vector<py::object> ts;
  ts.reserve(made.size());
  for (auto& t : made) {
    py::object o = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t)));
    if (!o || PyObject_SetAttr(o.ptr(), own, Py_True) != 0) {
      throw py::error_already_set();
    }
    ts.push_back(std::move(o));
  }
  for (Py_ssize_t k = 0; k < n; ++k) {
    if (PyObject_SetAttr(PyList_GET_ITEM(into.ptr(), k), host, ts[k].ptr()) != 0) {
      throw py::error_already_set();
    }
  }
  return py::make_tuple(h, got);
}

void client_reply_init(const py::dict& dtypes, int64_t copy_max) {
  std::vector<std::pair<std::string, at::ScalarType>> out;
  for (const auto& [name, d] : dtypes) {
    if (!THPDtype_Check(d.ptr())) {
      throw py::type_error("genie._C._client_reply_init: dtypes maps names to torch dtypes");
    }
    out.emplace_back(name.cast<std::string>(), reinterpret_cast<THPDtype*>(d.ptr())->scalar_type);
  }
  g_dtypes = std::move(out);
  g_copy_max = copy_max;
}


// --- genie._C._client_book: a steady run's handles and residency records ---------------------
//
// Client._book of a plan's tape (its kept slots' rows known: _kept_rows) with nothing uploaded
// or put back, residency not recording: per kept slot the tape makes, a Handle (the server's id
// id0 + place), and for a dense value a Resident hinted next time (Residency.ran: `live`, a weak
// reference to the handle; `pending`, it and its node's). The Python path builds each with its
// __init__ (~2 µs a slot, 18 a GPT-2 token); here the objects are allocated and their slots set
// through the classes' own member descriptors. Declined (None, having changed nothing but the
// `sized` cache, which the Python path fills alike): a row that is not four ints, a node index
// or output out of range, a released node, a kept input that is not a Handle of this client.

struct Classes {
  PyTypeObject* handle = nullptr;
  PyTypeObject* resident = nullptr;
  // member descriptors, in the order of kHandleSlots / kResidentSlots
  std::vector<PyObject*> hs;
  std::vector<PyObject*> rs;
  Py_ssize_t sized_memory = 0;  // genie.remote.residency.SIZED_MEMORY
};
Classes g_cls;
const char* const kHandleSlots[] = {"id", "client", "meta", "host", "res"};
const char* const kResidentSlots[] = {"role",   "nbytes", "storage", "epoch", "source",
                                      "recipe", "slot",   "evicted", "pins"};

// the descriptors of `names` (each a member descriptor of `tp`, named in its __slots__, which
// names nothing else but __weakref__: a slot added in Python fails here, at import, not later)
std::vector<PyObject*> slot_descriptors(PyTypeObject* tp, const char* const* names, size_t n) {
  py::object t = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(tp));
  py::tuple declared = py::tuple(t.attr("__slots__"));
  size_t own = 0;
  for (auto x : declared) {
    if (x.cast<std::string>() != "__weakref__") {
      ++own;
    }
  }
  if (own != n || tp->tp_new != PyBaseObject_Type.tp_new || tp->tp_itemsize != 0) {
    throw py::type_error(std::string("genie._C._client_book_init: ") + tp->tp_name +
                         " has other slots or a __new__ than this build's native booking knows");
  }
  std::vector<PyObject*> out;
  py::dict d = t.attr("__dict__");
  for (size_t i = 0; i < n; ++i) {
    PyObject* x = PyDict_GetItemString(d.ptr(), names[i]);
    if (x == nullptr || !Py_IS_TYPE(x, &PyMemberDescr_Type)) {
      throw py::type_error(std::string("genie._C._client_book_init: ") + tp->tp_name +
                           " has no slot " + names[i]);
    }
    Py_INCREF(x);
    out.push_back(x);
  }
  return out;
}

void client_book_init(const py::object& handle, const py::object& resident,
                      Py_ssize_t sized_memory) {
  if (!PyType_Check(handle.ptr()) || !PyType_Check(resident.ptr())) {
    throw py::type_error("genie._C._client_book_init: takes the Handle and Resident classes");
  }
  Classes c;
  c.handle = reinterpret_cast<PyTypeObject*>(handle.ptr());
  c.resident = reinterpret_cast<PyTypeObject*>(resident.ptr());
  c.hs = slot_descriptors(c.handle, kHandleSlots, std::size(kHandleSlots));
  c.rs = slot_descriptors(c.resident, kResidentSlots, std::size(kResidentSlots));
  c.sized_memory = sized_memory;
  Py_INCREF(handle.ptr());
  Py_INCREF(resident.ptr());
  g_cls = std::move(c);  // (the previous classes and descriptors, if any, stay referenced)
}

// a new instance of `tp` with `vals` set through `descs` (none set: an allocation failure)
py::object make_slotted(PyTypeObject* tp, const std::vector<PyObject*>& descs,
                        std::initializer_list<PyObject*> vals) {
  py::object o = py::reinterpret_steal<py::object>(tp->tp_alloc(tp, 0));
  if (!o) {
    throw py::error_already_set();
  }
  size_t i = 0;
  for (PyObject* v : vals) {
    if (Py_TYPE(descs[i])->tp_descr_set(descs[i], o.ptr(), v) != 0) {
      throw py::error_already_set();
    }
    ++i;
  }
  return o;
}

// an exact int within int64
bool small_int(PyObject* x, int64_t& v) {
  if (!PyLong_CheckExact(x)) {
    return false;
  }
  int over = 0;
  v = PyLong_AsLongLongAndOverflow(x, &over);
  return over == 0;
}

// a tuple of exact ints within int64
bool int_tuple(PyObject* x, std::vector<int64_t>& out) {
  if (!PyTuple_CheckExact(x)) {
    return false;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(x);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!small_int(PyTuple_GET_ITEM(x, i), out[static_cast<size_t>(i)])) {
      return false;
    }
  }
  return true;
}

// genie.remote.residency.dense and _nbytes of a plain TensorMeta `m` (exact ints and tuples of
// them, a torch dtype, conj and neg False), in one: `nbytes` its bytes when dense, -1 - bytes
// when not. False: not a plain one, or a product past int64 (Residency.size_of then sizes it)
bool native_size(PyObject* m, int64_t& nbytes) {
  static PyObject* n_offset = PyUnicode_InternFromString("offset");
  static PyObject* n_conj = PyUnicode_InternFromString("conj");
  static PyObject* n_neg = PyUnicode_InternFromString("neg");
  static PyObject* n_shape = PyUnicode_InternFromString("shape");
  static PyObject* n_stride = PyUnicode_InternFromString("stride");
  static PyObject* n_dtype = PyUnicode_InternFromString("dtype");
  auto get = [m](PyObject* name) {
    py::object v = py::reinterpret_steal<py::object>(PyObject_GetAttr(m, name));
    if (!v) {
      PyErr_Clear();
    }
    return v;
  };
  py::object offset = get(n_offset), conj = get(n_conj), neg = get(n_neg), shape = get(n_shape),
             stride = get(n_stride), dtype = get(n_dtype);
  int64_t off = 0;
  thread_local std::vector<int64_t> sh, st;
  if (!offset || !conj || !neg || !shape || !stride || !dtype || conj.ptr() != Py_False ||
      neg.ptr() != Py_False || !small_int(offset.ptr(), off) || !int_tuple(shape.ptr(), sh) ||
      !int_tuple(stride.ptr(), st) || !THPDtype_Check(dtype.ptr())) {
    return false;
  }
  const at::ScalarType type = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
  int64_t n = 0;
  try {
    n = static_cast<int64_t>(c10::elementSize(type));  // (torch.dtype.itemsize)
  } catch (const std::exception&) {
    return false;
  }
  for (int64_t x : sh) {
    if (__builtin_mul_overflow(n, x, &n)) {
      return false;
    }
  }
  // dense: offset 0 and strides that tile the elements exactly (a permutation of contiguous
  // strides), read as dense() reads them (zip: the shorter of shape and stride)
  bool is_dense = off == 0;
  if (is_dense) {
    const size_t k = std::min(sh.size(), st.size());
    int64_t expect = 1;
    bool broke = false;
    for (size_t i = 0; i < k; ++i) {
      const int64_t z = sh[sh.size() - 1 - i], s = st[st.size() - 1 - i];
      if (z != 1) {
        if (s != expect || z == 0) {
          broke = true;
          break;
        }
        if (__builtin_mul_overflow(expect, z, &expect)) {
          return false;
        }
      }
    }
    if (broke) {
      std::vector<std::pair<int64_t, int64_t>> dims;
      for (size_t i = 0; i < k; ++i) {
        if (sh[i] != 1) {
          dims.emplace_back(st[i], sh[i]);
        }
      }
      std::sort(dims.begin(), dims.end());
      expect = 1;
      for (const auto& [s, z] : dims) {
        if (s != expect) {
          is_dense = false;
          break;
        }
        if (__builtin_mul_overflow(expect, z, &expect)) {
          return false;
        }
      }
    }
  }
  nbytes = is_dense ? n : -1 - n;
  return n >= 0;
}

struct BookRow {
  PyObject* slot;  // the row's slot (a borrowed int of `rows`)
  PyObject* node;  // nullptr: a kept input (`value` its handle)
  PyObject* value;  // the input's handle, or the node's meta (None: no tensor)
  int64_t out = 0;
  int64_t place = 0;
  int64_t nbytes = -1;  // a dense value's bytes (-1: not hinted)
};

py::object client_book(const py::list& rows, const py::list& nodes, const py::dict& inputs,
                       const py::object& id0_obj, const py::object& client, const py::dict& sized,
                       const py::dict& live, const py::list& pending, const py::object& size_of) {
  if (g_cls.handle == nullptr) {
    throw py::type_error("genie._C._client_book: _client_book_init was not called");
  }
  static PyObject* metas_name = PyUnicode_InternFromString("metas");
  if (!PyLong_CheckExact(id0_obj.ptr())) {
    return py::none();
  }
  int over0 = 0;
  const int64_t id0 = PyLong_AsLongLongAndOverflow(id0_obj.ptr(), &over0);
  if (over0 != 0) {
    return py::none();
  }
  const Py_ssize_t n = PyList_GET_SIZE(rows.ptr());
  std::vector<BookRow> got;
  got.reserve(static_cast<size_t>(n));
  // what the rows name, held (size_of runs Python, which may drop a node's or a list's)
  std::vector<py::object> hold;
  hold.reserve(3 * static_cast<size_t>(n));
  // 1. everything read and checked; nothing changed but the `sized` cache
  for (Py_ssize_t r = 0; r < n; ++r) {
    PyObject* row = PyList_GET_ITEM(rows.ptr(), r);
    if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 4) {
      return py::none();
    }
    int64_t f[4];
    for (int q = 0; q < 4; ++q) {
      PyObject* x = PyTuple_GET_ITEM(row, q);
      if (!PyLong_CheckExact(x)) {
        return py::none();
      }
      int over = 0;
      f[q] = PyLong_AsLongLongAndOverflow(x, &over);
      if (over != 0) {
        return py::none();
      }
    }
    hold.push_back(py::reinterpret_borrow<py::object>(row));
    BookRow b{PyTuple_GET_ITEM(row, 0), nullptr, nullptr, f[2], f[3], -1};
    if (f[1] < 0) {  // a kept input: its own handle
      PyObject* v = PyDict_GetItemWithError(inputs.ptr(), b.slot);
      if (v == nullptr) {
        if (PyErr_Occurred()) {
          throw py::error_already_set();
        }
        return py::none();
      }
      if (Py_TYPE(v) != g_cls.handle) {
        return py::none();
      }
      PyObject* cd = g_cls.hs[1];  // its `client` slot
      py::object c = py::reinterpret_steal<py::object>(
          Py_TYPE(cd)->tp_descr_get(cd, v, reinterpret_cast<PyObject*>(g_cls.handle)));
      if (!c) {  // (unset)
        PyErr_Clear();
        return py::none();
      }
      if (c.ptr() != client.ptr()) {
        return py::none();
      }
      b.value = v;
      got.push_back(b);
      continue;
    }
    int64_t sum = 0;
    if (f[1] >= PyList_GET_SIZE(nodes.ptr()) || f[2] < 0 || f[3] < 0 ||
        __builtin_add_overflow(id0, f[3], &sum)) {
      return py::none();
    }
    PyObject* node = PyList_GET_ITEM(nodes.ptr(), f[1]);
    if (node == Py_None) {
      return py::none();
    }
    py::object metas = py::reinterpret_steal<py::object>(PyObject_GetAttr(node, metas_name));
    if (!metas) {
      PyErr_Clear();
      return py::none();
    }
    if (!PyList_CheckExact(metas.ptr()) && !PyTuple_CheckExact(metas.ptr())) {
      return py::none();
    }
    const Py_ssize_t nm = PySequence_Fast_GET_SIZE(metas.ptr());
    if (f[2] >= nm) {
      return py::none();
    }
    PyObject* m = PySequence_Fast_ITEMS(metas.ptr())[f[2]];
    hold.push_back(py::reinterpret_borrow<py::object>(node));
    hold.push_back(py::reinterpret_borrow<py::object>(m));
    b.node = node;
    b.value = m;
    got.push_back(b);
  }
  // (dense, bytes) of each value by its metadata object, as Residency.ran reads them once the
  // handles are made (an error of a row above comes first, as on the Python path)
  for (BookRow& b : got) {
    if (b.node == nullptr || b.value == Py_None) {
      continue;
    }
    PyObject* m = b.value;
    py::object key = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(m));
    PyObject* e = PyDict_GetItemWithError(sized.ptr(), key.ptr());
    if (e == nullptr && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    py::object entry;
    if (e != nullptr && PyTuple_CheckExact(e) && PyTuple_GET_SIZE(e) == 3 &&
        PyTuple_GET_ITEM(e, 0) == m) {
      entry = py::reinterpret_borrow<py::object>(e);
    } else if (native_size(m, b.nbytes)) {
      // (Residency.size_of's entry, made here)
      if (PyDict_GET_SIZE(sized.ptr()) >= g_cls.sized_memory) {
        PyDict_Clear(sized.ptr());
      }
      py::object nb = py::reinterpret_steal<py::object>(
          PyLong_FromLongLong(b.nbytes < 0 ? -b.nbytes - 1 : b.nbytes));
      if (!nb) {
        throw py::error_already_set();
      }
      py::tuple t = py::make_tuple(py::reinterpret_borrow<py::object>(m),
                                   py::bool_(b.nbytes >= 0), nb);
      if (PyDict_SetItem(sized.ptr(), key.ptr(), t.ptr()) != 0) {
        throw py::error_already_set();
      }
      if (b.nbytes < 0) {
        b.nbytes = -1;  // not dense: not hinted
      }
      continue;
    } else {
      entry = size_of(py::reinterpret_borrow<py::object>(m));
      if (!PyTuple_CheckExact(entry.ptr()) || PyTuple_GET_SIZE(entry.ptr()) != 3) {
        throw py::type_error("genie._C._client_book: size_of returns (meta, dense, nbytes)");
      }
    }
    PyObject* dense = PyTuple_GET_ITEM(entry.ptr(), 1);
    if (dense == Py_True) {
      PyObject* nb = PyTuple_GET_ITEM(entry.ptr(), 2);
      int over = 0;
      b.nbytes = PyLong_CheckExact(nb) ? PyLong_AsLongLongAndOverflow(nb, &over) : -1;
      if (b.nbytes < 0 || over != 0) {
        return py::none();
      }
    } else if (dense != Py_False) {
      return py::none();
    }
  }
  // 2. the handles and records made, as the Python path makes them
  py::dict kept;
  // (Residency.ran clears what the last run left to hint first)
  if (PyList_SetSlice(pending.ptr(), 0, PyList_GET_SIZE(pending.ptr()), nullptr) != 0) {
    throw py::error_already_set();
  }
  for (const BookRow& b : got) {
    if (b.node == nullptr) {
      if (PyDict_SetItem(kept.ptr(), b.slot, b.value) != 0) {
        throw py::error_already_set();
      }
      continue;
    }
    py::object hid = py::reinterpret_steal<py::object>(PyLong_FromLongLong(id0 + b.place));
    // (id0 + place checked in 1.)
    if (!hid) {
      throw py::error_already_set();
    }
    py::object h = make_slotted(g_cls.handle, g_cls.hs,
                                {hid.ptr(), client.ptr(), b.value, Py_None, Py_None});
    if (PyDict_SetItem(kept.ptr(), b.slot, h.ptr()) != 0) {
      throw py::error_already_set();
    }
    if (b.nbytes < 0) {
      continue;
    }
    py::object nb = py::reinterpret_steal<py::object>(PyLong_FromLongLong(b.nbytes));
    py::object minus1 = py::reinterpret_steal<py::object>(PyLong_FromLong(-1));
    py::object zero = py::reinterpret_steal<py::object>(PyLong_FromLong(0));
    py::object pins = py::reinterpret_steal<py::object>(PyList_New(0));
    if (!nb || !minus1 || !zero || !pins) {
      throw py::error_already_set();
    }
    py::object res = make_slotted(g_cls.resident, g_cls.rs,
                                  {Py_None, nb.ptr(), Py_None, zero.ptr(), Py_None, Py_None,
                                   minus1.ptr(), Py_None, pins.ptr()});
    if (Py_TYPE(g_cls.hs[4])->tp_descr_set(g_cls.hs[4], h.ptr(), res.ptr()) != 0) {
      throw py::error_already_set();
    }
    py::object wh = py::reinterpret_steal<py::object>(PyWeakref_NewRef(h.ptr(), nullptr));
    py::object wn = py::reinterpret_steal<py::object>(PyWeakref_NewRef(b.node, nullptr));
    if (!wh || !wn || PyDict_SetItem(live.ptr(), hid.ptr(), wh.ptr()) != 0) {
      throw py::error_already_set();
    }
    py::object k = py::reinterpret_steal<py::object>(PyLong_FromLongLong(b.out));
    if (!k || PyList_Append(pending.ptr(), py::make_tuple(wh, wn, k).ptr()) != 0) {
      throw py::error_already_set();
    }
  }
  return kept;
}

}  // namespace

void add_client_functions(py::module_& m) {
  m.def("_client_reply", &client_reply, py::arg("parts"), py::arg("rid"), py::arg("into"),
        py::arg("limit"),
        "A steady run reply (header, one frame per output) read natively: (header less 'o', "
        "bytes received) with the outputs set as into[k].host, or None for the Python path "
        "(csrc/client_run.cpp).");
  m.def("_client_reply_init", &client_reply_init, py::arg("dtypes"), py::arg("copy_max"),
        "The wire dtypes by name and ZERO_COPY_MIN for _client_reply (set once at import).");
  m.def("_client_book", &client_book, py::arg("rows"), py::arg("nodes"), py::arg("inputs"),
        py::arg("id0"), py::arg("client"), py::arg("sized"), py::arg("live"), py::arg("pending"),
        py::arg("size_of"),
        "A steady run's kept handles and residency records made natively (Client._book of a "
        "plan's tape): the kept dict, or None for the Python path (csrc/client_run.cpp).");
  m.def("_client_book_init", &client_book_init, py::arg("handle"), py::arg("resident"),
        py::arg("sized_memory"),
        "The Handle and Resident classes and residency's SIZED_MEMORY for _client_book (set "
        "once at import).");
}

}  // namespace genie
