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
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

#include <ATen/EmptyTensor.h>
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

}  // namespace

void add_client_functions(py::module_& m) {
  m.def("_client_reply", &client_reply, py::arg("parts"), py::arg("rid"), py::arg("into"),
        py::arg("limit"),
        "A steady run reply (header, one frame per output) read natively: (header less 'o', "
        "bytes received) with the outputs set as into[k].host, or None for the Python path "
        "(csrc/client_run.cpp).");
  m.def("_client_reply_init", &client_reply_init, py::arg("dtypes"), py::arg("copy_max"),
        "The wire dtypes by name and ZERO_COPY_MIN for _client_reply (set once at import).");
}

}  // namespace genie
