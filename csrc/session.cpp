// genie._C: a server session's per-request work over its resident values (genie/remote/worker.py).
//
// Every request of a replayed structure keys its inputs for the shape class
// (genie.remote.shape_class.shape_params: what a vet of the structure depended on) and, after
// the run, recounts the storages a resize_ of a resident value may have grown (the quota's
// accounting, worker.Session.refresh). A GPT-2 12x768 decode step has 173 inputs: in Python each
// cost ~10 calls and a few dict operations (keying ~140 µs with hot caches, ~300 µs between a
// step's kernels); here it is one pass over the inputs.
//
// _input_key(inputs) -> (static, ints), for each input of the dict `inputs` (slot -> tensor, in
// the dict's order):
//   static: 5 int64 words in native byte order: slot, rank, scalar type, bits (1 conj, 2 neg,
//     4 dense) and its storage's index among the distinct storages met so far (aliasing). Fixed
//     width: two inputs' bytes are equal iff their fields are.
//   ints: its sizes; unless it is dense (its storage holds exactly its elements, from offset 0,
//     contiguous, and no earlier input has that storage: its layout follows from its sizes),
//     also its strides, storage offset and storage bytes.
// A value that is not a strided tensor with a storage is a TypeError (a session holds none).
//
// _storages_grown(values, storages) -> int: for each tensor among `values` whose storage (keyed
// by its StorageImpl's address, which is torch's UntypedStorage._cdata) has an entry
// [count, bytes] in the dict `storages` and now holds other than `bytes`, the entry takes the
// bytes it holds; returns the sum of the changes.
//
// The handles of a run request, each in one pass over the session's dicts (Session in
// genie/remote/worker.py: `store` handle id -> tensor, `storages` as above, `roles` and `used_at`
// handle id -> int). In Python each id cost a few dict operations and a tensor call with cold
// caches (a GPT-2 4x128 token: its 18 frees, 65 inputs and 18 kept values, ~50 µs):
//
// _drop_handles(store, storages, roles, used_at, ids) -> int: every exact int of the list `ids`
//   that `store` holds leaves the four dicts, its storage counted once less; other items (not an
//   exact int, or not held) are skipped, and an id listed twice is dropped once. Returns the
//   change of the bytes counted (<= 0).
//
// _held_inputs(store, used_at, ids, slots, tick) -> dict | int | None: the values of a run's
//   input slots when the first len(slots) items of the list `ids` are handle ids the session
//   holds: {slot: tensor} in the order of `slots`, each id marked used at `tick`. None (nothing
//   marked) when one of them is not an exact int or `ids` is shorter; else the first id that
//   `store` does not hold (nothing marked).
//
// _put_handles(store, storages, used_at, ids, values, tick, max_handles) -> int | None: the run's
//   kept values under new ids, all or nothing: None (nothing changed) unless `ids` and `values`
//   are lists of one length, every id an exact int that `store` does not hold and no other of
//   `ids` repeats, every value a strided tensor with a storage, and the store stays within
//   `max_handles`. Each is stored, marked used at `tick` and its storage counted once more;
//   returns the change of the bytes counted.
//
// _frames_of(values, names) -> (metas, buffers) | None: a reply's tensors as wire frames
// (genie.remote.protocol.tensor_frame of each, in one pass: after a replay the reply runs with
// cold caches, and tensor_frame's ~8 tensor calls cost ~110 µs there for one GPT-2 logits
// tensor): per value [names[dtype], shape, None] and a read-only buffer of its elements
// (_TensorBytes, holding the tensor). None when a value is not a contiguous CPU tensor with
// elements and without conj/neg bits, or its dtype has no name in `names` (the caller frames
// each by tensor_frame).
//
// _send_early(fd, used, res, pb, rid, st, vt, values, names) -> True | None: a run's early
// answer (genie.remote.worker.Worker._answer_early) written whole to the worker's end of the
// front's channel (genie.remote.wire.Channel's framing: part count and lengths, then the EARLY
// status, the msgpack header {"t": "ok", "o": metas, "vt": vt, "er": 1, "rid": rid, "st": st}
// and each value's elements), as the Python path writes it, in one call: the answer is sent
// right after the forward's kernels ran, on caches they left cold, where that path's ~15
// Python calls cost ~100 µs a step in a server (and its clone of each value a tensor call:
// here the bytes go to the socket before the call returns, so nothing can change them).
// None, having written nothing, when a value is not what _frames_of frames or is over 1 MiB
// (the Python path splits it), or `rid` is not an exact int of int64, `vt` not a str, the
// counts not ints: the caller answers by the Python path.
//
// _send_reply(fd, used, res, pb, rid, st, vt, values, names) -> True | None: a run's reply
// (a lane's, genie.remote.worker.Worker._run_lane, after its puts and quota check) written the
// same way: the REPLY status and the header {"t": "ok", "o": metas, "res": res, "vt": vt,
// "rid": rid, "st": st}, as serve_session's Python path writes it, the values' bytes in the
// socket before it returns (the session's frees and the next request may reuse their memory).
// None, having written nothing, for what _send_early leaves to Python.
//
// _channel_write(fd, parts, block) -> (written, total) | None: one genie.remote.wire.Channel
// message (part count, lengths, then the parts' bytes) written from the parts' own buffers with
// one sendmsg, as Channel._frame frames it: the front's post (non-blocking: what the socket did
// not take, the caller keeps for its flush) and a worker's send (`block`: all of it). None,
// having written nothing, when `parts` is not a list of 1 to 511 flat buffers.
#include "session.h"

#include <Python.h>

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace genie {
namespace {

[[noreturn]] void raise() {
  throw py::error_already_set();
}

const at::Tensor& strided_tensor(PyObject* v, const char* what) {
  if (!THPVariable_Check(v)) {
    throw py::type_error(std::string(what) + ": a value is a " + Py_TYPE(v)->tp_name +
                         ", not a tensor");
  }
  const at::Tensor& t = THPVariable_Unpack(v);
  if (t.layout() != c10::kStrided || !t.has_storage()) {
    throw py::type_error(std::string(what) + ": a value is not a strided tensor with a storage");
  }
  return t;
}

void put_word(std::string& out, int64_t w) {
  char b[sizeof w];
  std::memcpy(b, &w, sizeof w);
  out.append(b, sizeof w);
}

// The storages of one call's inputs, each numbered by its first input: an open-addressing table
// reused by every call of the thread (a decode step's ~170 inputs are keyed every request; a
// node-based map cost an allocation and a free per input).
class StorageNumbers {
 public:
  void reset(size_t count) {
    size_t cap = 64;
    shift_ = 58;
    while (cap < 2 * count) {
      cap <<= 1;
      --shift_;
    }
    keys_.assign(cap, nullptr);
    nums_.assign(cap, -1);
    n_ = 0;
  }
  // The number of storage `p` (a new one when it is first seen) and whether it is new.
  std::pair<int64_t, bool> number(const void* p) {
    const size_t mask = keys_.size() - 1;
    size_t i = static_cast<size_t>(
        (static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)) * 0x9E3779B97F4A7C15ULL) >>
        shift_);
    for (;; i = (i + 1) & mask) {
      if (nums_[i] < 0) {
        keys_[i] = p;
        nums_[i] = n_;
        return {n_++, true};
      }
      if (keys_[i] == p) {
        return {nums_[i], false};
      }
    }
  }

 private:
  std::vector<const void*> keys_;
  std::vector<int64_t> nums_;  // -1: an empty place
  int64_t n_ = 0;
  int shift_ = 58;  // 64 - log2(capacity)
};

}  // namespace

void input_key_into(PyObject* d, std::string& stat, std::vector<int64_t>& ints) {
  if (!PyDict_Check(d)) {
    throw py::type_error("_input_key(inputs) takes a dict of slot -> tensor");
  }
  stat.clear();
  ints.clear();
  stat.reserve(static_cast<size_t>(PyDict_GET_SIZE(d)) * 5 * sizeof(int64_t));
  ints.reserve(static_cast<size_t>(PyDict_GET_SIZE(d)) * 4);
  // (at most one storage per input: the table stays at most half full)
  thread_local StorageNumbers storages;
  storages.reset(static_cast<size_t>(PyDict_GET_SIZE(d)));
  Py_ssize_t pos = 0;
  PyObject* k = nullptr;
  PyObject* v = nullptr;
  while (PyDict_Next(d, &pos, &k, &v)) {
    if (!PyLong_CheckExact(k)) {
      throw py::type_error("_input_key: a slot is not an int");
    }
    const int64_t slot = PyLong_AsLongLong(k);
    if (slot == -1 && PyErr_Occurred()) {
      raise();
    }
    const at::Tensor& t = strided_tensor(v, "_input_key");
    const c10::Storage& st = t.storage();
    const int64_t nb = static_cast<int64_t>(st.nbytes());
    const auto [num, fresh] = storages.number(st.unsafeGetStorageImpl());
    const bool dense = fresh && nb == t.numel() * static_cast<int64_t>(t.element_size()) &&
                       t.storage_offset() == 0 && t.is_contiguous();
    const c10::IntArrayRef sizes = t.sizes();
    put_word(stat, slot);
    put_word(stat, static_cast<int64_t>(sizes.size()));
    put_word(stat, static_cast<int64_t>(t.scalar_type()));
    put_word(stat, (t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0) | (dense ? 4 : 0));
    put_word(stat, num);
    ints.insert(ints.end(), sizes.begin(), sizes.end());
    if (!dense) {
      const c10::IntArrayRef strides = t.strides();
      ints.insert(ints.end(), strides.begin(), strides.end());
      ints.push_back(t.storage_offset());
      ints.push_back(nb);
    }
  }
}

namespace {

py::tuple input_key(py::handle inputs) {
  std::string stat;
  std::vector<int64_t> ints;
  input_key_into(inputs.ptr(), stat, ints);
  py::tuple out(static_cast<Py_ssize_t>(ints.size()));
  for (size_t i = 0; i < ints.size(); ++i) {
    PyObject* x = PyLong_FromLongLong(ints[i]);
    if (x == nullptr) {
      raise();
    }
    PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), x);
  }
  return py::make_tuple(py::bytes(stat), out);
}

py::object storage_key(const c10::Storage& st) {
  py::object key =
      py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(st.unsafeGetStorageImpl()));
  if (!key) {
    raise();
  }
  return key;
}

// An entry of the storages dict: [count, bytes].
PyObject* entry_of(PyObject* d, PyObject* key) {
  PyObject* e = PyDict_GetItemWithError(d, key);  // borrowed
  if (e == nullptr && PyErr_Occurred()) {
    raise();
  }
  if (e != nullptr && (!PyList_CheckExact(e) || PyList_GET_SIZE(e) != 2)) {
    throw py::type_error("an entry of the session's storages is not a [count, bytes] list");
  }
  return e;
}

int64_t field(PyObject* e, Py_ssize_t i) {
  const int64_t x = PyLong_AsLongLong(PyList_GET_ITEM(e, i));
  if (x == -1 && PyErr_Occurred()) {
    raise();
  }
  return x;
}

void set_field(PyObject* e, Py_ssize_t i, int64_t x) {
  PyObject* o = PyLong_FromLongLong(x);
  if (o == nullptr) {
    raise();
  }
  PyList_SetItem(e, i, o);  // steals o
}

int64_t storages_grown(py::handle values, py::handle storages) {
  PyObject* d = storages.ptr();
  if (!PyDict_Check(d)) {
    throw py::type_error("_storages_grown(values, storages) takes a dict of storages");
  }
  py::object it = py::reinterpret_steal<py::object>(PyObject_GetIter(values.ptr()));
  if (!it) {
    raise();
  }
  int64_t delta = 0;
  while (true) {
    py::object v = py::reinterpret_steal<py::object>(PyIter_Next(it.ptr()));
    if (!v) {
      if (PyErr_Occurred()) {
        raise();
      }
      return delta;
    }
    if (!THPVariable_Check(v.ptr())) {
      continue;  // (as Session.refresh: only tensors have storages)
    }
    const at::Tensor& t = THPVariable_Unpack(v.ptr());
    if (!t.has_storage()) {
      continue;
    }
    const c10::Storage& st = t.storage();
    PyObject* e = entry_of(d, storage_key(st).ptr());
    if (e == nullptr) {
      continue;
    }
    const int64_t had = field(e, 1);
    const int64_t now = static_cast<int64_t>(st.nbytes());
    if (now != had) {
      set_field(e, 1, now);
      delta += now - had;
    }
  }
}

// Count storage `st` once more (sign 1: a new entry [1, bytes] when not counted yet) or once
// less (-1: the entry dropped at 0) in the dict `d`; returns the change of the bytes counted.
int64_t hold(PyObject* d, const c10::Storage& st, int sign) {
  py::object key = storage_key(st);
  PyObject* e = entry_of(d, key.ptr());
  if (sign > 0) {
    if (e == nullptr) {
      const int64_t nb = static_cast<int64_t>(st.nbytes());
      py::list entry(2);
      entry[0] = py::int_(1);
      entry[1] = py::int_(nb);
      if (PyDict_SetItem(d, key.ptr(), entry.ptr()) < 0) {
        raise();
      }
      return nb;
    }
    set_field(e, 0, field(e, 0) + 1);
    return 0;
  }
  if (e == nullptr) {
    return 0;
  }
  const int64_t c = field(e, 0) - 1;
  if (c == 0) {
    const int64_t nb = field(e, 1);
    if (PyDict_DelItem(d, key.ptr()) < 0) {
      raise();
    }
    return -nb;
  }
  set_field(e, 0, c);
  return 0;
}

PyObject* as_dict(py::handle h, const char* what) {
  if (!PyDict_Check(h.ptr())) {
    throw py::type_error(std::string(what) + ": the session's maps must be dicts");
  }
  return h.ptr();
}

// Remove `key` from the dict `d` when there (a pop without a default's KeyError).
void discard(PyObject* d, PyObject* key) {
  PyObject* v = PyDict_GetItemWithError(d, key);  // borrowed
  if (v == nullptr) {
    if (PyErr_Occurred()) {
      raise();
    }
    return;
  }
  if (PyDict_DelItem(d, key) < 0) {
    raise();
  }
}

int64_t drop_handles(py::handle store, py::handle storages, py::handle roles, py::handle used_at,
                     py::handle ids) {
  PyObject* sd = as_dict(store, "_drop_handles");
  PyObject* std_ = as_dict(storages, "_drop_handles");
  PyObject* rd = as_dict(roles, "_drop_handles");
  PyObject* ud = as_dict(used_at, "_drop_handles");
  if (!PyList_Check(ids.ptr())) {
    throw py::type_error("_drop_handles: ids must be a list");
  }
  // (a list of our own: dropping a value runs no Python, but `ids` is the caller's)
  py::list items = py::reinterpret_steal<py::list>(PySequence_List(ids.ptr()));
  if (!items) {
    raise();
  }
  int64_t delta = 0;
  const Py_ssize_t n = PyList_GET_SIZE(items.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* hid = PyList_GET_ITEM(items.ptr(), i);
    if (!PyLong_CheckExact(hid)) {
      continue;
    }
    PyObject* v = PyDict_GetItemWithError(sd, hid);  // borrowed
    if (v == nullptr) {
      if (PyErr_Occurred()) {
        raise();
      }
      continue;
    }
    py::object held = py::reinterpret_borrow<py::object>(v);  // freed last, after the counting
    if (THPVariable_Check(v) && THPVariable_Unpack(v).has_storage()) {
      delta += hold(std_, THPVariable_Unpack(v).storage(), -1);
    }
    if (PyDict_DelItem(sd, hid) < 0) {
      raise();
    }
    discard(rd, hid);
    discard(ud, hid);
  }
  return delta;
}

py::object held_inputs(py::handle store, py::handle used_at, py::handle ids, py::handle slots,
                       py::handle tick) {
  PyObject* sd = as_dict(store, "_held_inputs");
  PyObject* ud = as_dict(used_at, "_held_inputs");
  if (!PyList_Check(ids.ptr()) || !PyList_Check(slots.ptr()) || !PyLong_CheckExact(tick.ptr())) {
    throw py::type_error("_held_inputs(store, used_at, ids, slots, tick): lists and an int");
  }
  const Py_ssize_t n = PyList_GET_SIZE(slots.ptr());
  if (PyList_GET_SIZE(ids.ptr()) < n) {
    return py::none();
  }
  // (the items are read into a vector of new references: the lists are the caller's)
  std::vector<py::object> hids;
  std::vector<py::object> keys;
  hids.reserve(static_cast<size_t>(n));
  keys.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* hid = PyList_GET_ITEM(ids.ptr(), i);
    if (!PyLong_CheckExact(hid)) {
      return py::none();
    }
    hids.push_back(py::reinterpret_borrow<py::object>(hid));
    keys.push_back(py::reinterpret_borrow<py::object>(PyList_GET_ITEM(slots.ptr(), i)));
  }
  py::dict out;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyDict_GetItemWithError(sd, hids[static_cast<size_t>(i)].ptr());  // borrowed
    if (v == nullptr) {
      if (PyErr_Occurred()) {
        raise();
      }
      return hids[static_cast<size_t>(i)];
    }
    if (PyDict_SetItem(out.ptr(), keys[static_cast<size_t>(i)].ptr(), v) < 0) {
      raise();
    }
  }
  for (const py::object& hid : hids) {
    if (PyDict_SetItem(ud, hid.ptr(), tick.ptr()) < 0) {
      raise();
    }
  }
  return out;
}

py::object put_handles(py::handle store, py::handle storages, py::handle used_at, py::handle ids,
                       py::handle values, py::handle tick, int64_t max_handles) {
  PyObject* sd = as_dict(store, "_put_handles");
  PyObject* std_ = as_dict(storages, "_put_handles");
  PyObject* ud = as_dict(used_at, "_put_handles");
  if (!PyLong_CheckExact(tick.ptr())) {
    throw py::type_error("_put_handles: tick must be an int");
  }
  if (!PyList_Check(ids.ptr()) || !PyList_Check(values.ptr())) {
    return py::none();
  }
  py::list hids = py::reinterpret_steal<py::list>(PySequence_List(ids.ptr()));
  py::list vals = py::reinterpret_steal<py::list>(PySequence_List(values.ptr()));
  if (!hids || !vals) {
    raise();
  }
  const Py_ssize_t n = PyList_GET_SIZE(hids.ptr());
  if (PyList_GET_SIZE(vals.ptr()) != n ||
      static_cast<int64_t>(PyDict_GET_SIZE(sd)) + static_cast<int64_t>(n) > max_handles) {
    return py::none();
  }
  py::set seen;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* hid = PyList_GET_ITEM(hids.ptr(), i);
    PyObject* v = PyList_GET_ITEM(vals.ptr(), i);
    if (!PyLong_CheckExact(hid) || !THPVariable_Check(v) ||
        THPVariable_Unpack(v).layout() != c10::kStrided || !THPVariable_Unpack(v).has_storage()) {
      return py::none();
    }
    const int in_store = PyDict_Contains(sd, hid);
    const int again = PySet_Contains(seen.ptr(), hid);
    if (in_store < 0 || again < 0) {
      raise();
    }
    if (in_store || again) {
      return py::none();
    }
    if (PySet_Add(seen.ptr(), hid) < 0) {
      raise();
    }
  }
  int64_t delta = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* hid = PyList_GET_ITEM(hids.ptr(), i);
    PyObject* v = PyList_GET_ITEM(vals.ptr(), i);
    delta += hold(std_, THPVariable_Unpack(v).storage(), 1);
    if (PyDict_SetItem(sd, hid, v) < 0 || PyDict_SetItem(ud, hid, tick.ptr()) < 0) {
      raise();
    }
  }
  return py::int_(delta);
}

// The name `nd` (dtype -> name) gives a value the wire frames as its bytes (a contiguous,
// non-empty CPU tensor without math bits, of a named dtype, at most `max_bytes`), borrowed; or
// nullptr where it is not one (a Python error raised where the lookup itself failed).
PyObject* frame_name(PyObject* v, PyObject* nd, int64_t max_bytes) {
  if (!THPVariable_Check(v)) {
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(v);
  if (t.layout() != c10::kStrided || !t.has_storage() || !t.device().is_cpu() ||
      t.numel() == 0 || t.is_conj() || t.is_neg() || !t.is_contiguous() ||
      static_cast<int64_t>(t.nbytes()) > max_bytes) {
    return nullptr;
  }
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  PyObject* name = PyDict_GetItemWithError(nd, dtype);
  if (name == nullptr && PyErr_Occurred()) {
    raise();
  }
  return name;
}

// A tensor's elements as a read-only byte buffer (Python's buffer protocol) that keeps it alive.
struct TensorBytes {
  at::Tensor t;
};

py::object frames_of(py::handle values, py::handle names) {
  PyObject* nd = names.ptr();
  if (!PyDict_Check(nd)) {
    throw py::type_error("_frames_of(values, names) takes a dict of dtype -> name");
  }
  py::list vals = py::reinterpret_steal<py::list>(PySequence_List(values.ptr()));
  if (!vals) {
    raise();
  }
  const Py_ssize_t n = PyList_GET_SIZE(vals.ptr());
  py::list metas(n);
  py::list bufs(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyList_GET_ITEM(vals.ptr(), i);
    PyObject* name = frame_name(v, nd, INT64_MAX);  // borrowed
    if (name == nullptr) {
      return py::none();
    }
    const at::Tensor& t = THPVariable_Unpack(v);
    const c10::IntArrayRef sizes = t.sizes();
    py::list shape(sizes.size());
    for (size_t d = 0; d < sizes.size(); ++d) {
      set_field(shape.ptr(), static_cast<Py_ssize_t>(d), sizes[d]);
    }
    py::list meta(3);
    meta[0] = py::reinterpret_borrow<py::object>(name);
    meta[1] = shape;
    meta[2] = py::none();
    metas[i] = meta;
    bufs[i] = py::cast(TensorBytes{t.detach()});
  }
  return py::make_tuple(metas, bufs);
}


// --- a run's early answer, written natively -------------------------------------------------

// msgpack, only what an early answer's header holds (msgpack's format specification).
void mp_uint(std::string& o, uint8_t tag, uint64_t x, int bytes) {
  o.push_back(static_cast<char>(tag));
  for (int k = bytes - 1; k >= 0; --k) {
    o.push_back(static_cast<char>((x >> (8 * k)) & 0xff));
  }
}

void mp_int(std::string& o, int64_t x) {
  if (x >= 0) {
    if (x < 128) {
      o.push_back(static_cast<char>(x));
    } else if (x <= 0xff) {
      mp_uint(o, 0xcc, static_cast<uint64_t>(x), 1);
    } else if (x <= 0xffff) {
      mp_uint(o, 0xcd, static_cast<uint64_t>(x), 2);
    } else if (x <= 0xffffffffLL) {
      mp_uint(o, 0xce, static_cast<uint64_t>(x), 4);
    } else {
      mp_uint(o, 0xcf, static_cast<uint64_t>(x), 8);
    }
  } else if (x >= -32) {
    o.push_back(static_cast<char>(static_cast<int8_t>(x)));
  } else {
    mp_uint(o, 0xd3, static_cast<uint64_t>(x), 8);
  }
}

void mp_str(std::string& o, const char* p, size_t n) {
  if (n < 32) {
    o.push_back(static_cast<char>(0xa0 | n));
  } else if (n <= 0xff) {
    mp_uint(o, 0xd9, n, 1);
  } else if (n <= 0xffff) {
    mp_uint(o, 0xda, n, 2);
  } else {
    mp_uint(o, 0xdb, n, 4);
  }
  o.append(p, n);
}

void mp_array(std::string& o, size_t n) {
  if (n < 16) {
    o.push_back(static_cast<char>(0x90 | n));
  } else if (n <= 0xffff) {
    mp_uint(o, 0xdc, n, 2);
  } else {
    mp_uint(o, 0xdd, n, 4);
  }
}

void mp_double(std::string& o, double x) {
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  mp_uint(o, 0xcb, bits, 8);
}

// An exact int of int64 (not a bool, not a subclass), else false.
bool exact_i64(PyObject* x, int64_t* out) {
  if (!PyLong_CheckExact(x)) {
    return false;
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  *out = v;
  return true;
}

// Two exact ints of int64 in a list or tuple of two.
bool two_i64(PyObject* x, int64_t* a, int64_t* b) {
  if (!(PyList_CheckExact(x) || PyTuple_CheckExact(x)) || PySequence_Fast_GET_SIZE(x) != 2) {
    return false;
  }
  PyObject** items = PySequence_Fast_ITEMS(x);
  return exact_i64(items[0], a) && exact_i64(items[1], b);
}

constexpr int64_t kChunk = 1 << 20;  // genie.remote.protocol.CHUNK: larger frames are split
constexpr Py_ssize_t kMaxValues = 256;  // (the message's buffers stay well within IOV_MAX)

// sendmsg of iov[k...] until all is written or (nonblocking) the socket takes no more; the
// bytes written. OSError raised (with the GIL) as Python's sendmsg raises it.
size_t write_iov(int fd, std::vector<iovec>& iov, bool block) {
  size_t written = 0;
  size_t k = 0;
  int err = 0;
  {
    py::gil_scoped_release off;  // (the parts' buffers are held by the caller)
    while (k < iov.size()) {
      msghdr msg{};
      msg.msg_iov = iov.data() + k;
      msg.msg_iovlen = iov.size() - k;
      const ssize_t w = sendmsg(fd, &msg, MSG_NOSIGNAL | (block ? 0 : MSG_DONTWAIT));
      if (w < 0) {
        if (errno == EINTR) {
          continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          if (!block) {
            break;
          }
          pollfd pf{fd, POLLOUT, 0};
          poll(&pf, 1, -1);
          continue;
        }
        err = errno;
        break;
      }
      written += static_cast<size_t>(w);
      size_t left = static_cast<size_t>(w);
      while (k < iov.size() && left >= iov[k].iov_len) {
        left -= iov[k].iov_len;
        ++k;
      }
      if (left) {
        iov[k].iov_base = static_cast<char*>(iov[k].iov_base) + left;
        iov[k].iov_len -= left;
      }
    }
  }
  if (err) {
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    raise();
  }
  return written;
}

// The early answer (`early`) or a run's reply, written whole to the channel `fd` (see the
// file's head: _send_early, _send_reply).
py::object send_answer(bool early, int fd, py::handle used, py::handle res, py::handle pb,
                       py::handle rid, py::handle st, py::handle vt, py::handle values,
                       py::handle names) {
  PyObject* nd = names.ptr();
  if (!PyDict_Check(nd)) {
    throw py::type_error(early ? "_send_early: names must be a dict of dtype -> name"
                               : "_send_reply: names must be a dict of dtype -> name");
  }
  int64_t u = 0, r0 = 0, r1 = 0, p0 = 0, p1 = 0, id = 0;
  if (!exact_i64(used.ptr(), &u) || !two_i64(res.ptr(), &r0, &r1) ||
      !two_i64(pb.ptr(), &p0, &p1) || !exact_i64(rid.ptr(), &id) ||
      !PyFloat_CheckExact(st.ptr()) || !PyUnicode_CheckExact(vt.ptr()) ||
      !PyList_CheckExact(values.ptr())) {
    return py::none();
  }
  Py_ssize_t vt_n = 0;
  const char* vt_p = PyUnicode_AsUTF8AndSize(vt.ptr(), &vt_n);
  if (vt_p == nullptr) {
    raise();
  }
  const Py_ssize_t n = PyList_GET_SIZE(values.ptr());
  if (n > kMaxValues) {
    return py::none();
  }
  std::vector<at::Tensor> ts;
  ts.reserve(static_cast<size_t>(n));
  std::string head;  // msgpack header
  head.push_back(static_cast<char>(0x86));  // a map of 6
  mp_str(head, "t", 1);
  mp_str(head, "ok", 2);
  mp_str(head, "o", 1);
  mp_array(head, static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyList_GET_ITEM(values.ptr(), i);
    PyObject* name = frame_name(v, nd, kChunk);  // borrowed
    if (name == nullptr) {
      return py::none();
    }
    const at::Tensor& t = THPVariable_Unpack(v);
    Py_ssize_t nn = 0;
    const char* np = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, &nn) : nullptr;
    if (np == nullptr) {
      PyErr_Clear();
      return py::none();
    }
    mp_array(head, 3);  // [name, shape, None], as tensor_frame's
    mp_str(head, np, static_cast<size_t>(nn));
    const c10::IntArrayRef sizes = t.sizes();
    mp_array(head, sizes.size());
    for (const int64_t d : sizes) {
      mp_int(head, d);
    }
    head.push_back(static_cast<char>(0xc0));
    ts.push_back(t);
  }
  if (!early) {  // a reply carries the session's residency (an early answer: the next one's)
    mp_str(head, "res", 3);
    mp_array(head, 2);
    mp_int(head, r0);
    mp_int(head, r1);
  }
  mp_str(head, "vt", 2);
  mp_str(head, vt_p, static_cast<size_t>(vt_n));
  if (early) {
    mp_str(head, "er", 2);
    mp_int(head, 1);
  }
  mp_str(head, "rid", 3);
  mp_int(head, id);
  mp_str(head, "st", 2);
  mp_double(head, PyFloat_AS_DOUBLE(st.ptr()));
  // the status part (genie.remote.wire.STATUS, "<BBqqqqq"): tag 0, EARLY (1) or REPLY (0),
  // the counts
  char status[42];
  status[0] = 0;
  status[1] = early ? 1 : 0;
  const int64_t counts[5] = {u, r0, r1, p0, p1};
  for (int k = 0; k < 5; ++k) {
    for (int b = 0; b < 8; ++b) {  // little-endian whatever the host
      status[2 + 8 * k + b] = static_cast<char>((static_cast<uint64_t>(counts[k]) >> (8 * b)) & 0xff);
    }
  }
  // the channel's framing (genie.remote.wire.Channel._frame, "<I{n}Q"): part count, lengths
  const uint64_t parts = 2 + static_cast<uint64_t>(n);
  std::string frame;
  auto le = [&frame](uint64_t x, int bytes) {
    for (int b = 0; b < bytes; ++b) {
      frame.push_back(static_cast<char>((x >> (8 * b)) & 0xff));
    }
  };
  le(parts, 4);
  le(sizeof status, 8);
  le(head.size(), 8);
  for (const at::Tensor& t : ts) {
    le(t.nbytes(), 8);
  }
  std::vector<iovec> iov;
  iov.reserve(3 + ts.size());
  iov.push_back({frame.data(), frame.size()});
  iov.push_back({status, sizeof status});
  iov.push_back({head.data(), head.size()});
  for (const at::Tensor& t : ts) {
    iov.push_back({t.data_ptr(), t.nbytes()});
  }
  write_iov(fd, iov, true);  // (the values are held by `values` and `ts`)
  return py::bool_(true);
}

// --- the front <-> worker channel's messages, natively (genie.remote.wire.Channel) ------------

constexpr Py_ssize_t kIovParts = 512;  // genie.remote.wire._IOV: parts one sendmsg passes

// Buffers held for one write: each part's bytes (PyBUF_SIMPLE: flat, contiguous), released on
// destruction.
struct Held {
  std::vector<Py_buffer> bufs;
  ~Held() {
    for (Py_buffer& b : bufs) {
      PyBuffer_Release(&b);
    }
  }
};

py::object channel_write(int fd, py::handle parts, bool block) {
  if (!PyList_CheckExact(parts.ptr())) {
    return py::none();
  }
  const Py_ssize_t n = PyList_GET_SIZE(parts.ptr());
  if (n < 1 || n > kIovParts - 1) {
    return py::none();
  }
  Held held;
  held.bufs.reserve(static_cast<size_t>(n));
  std::string head;
  head.reserve(4 + 8 * static_cast<size_t>(n));
  auto le = [&head](uint64_t x, int bytes) {
    for (int b = 0; b < bytes; ++b) {
      head.push_back(static_cast<char>((x >> (8 * b)) & 0xff));
    }
  };
  le(static_cast<uint64_t>(n), 4);
  uint64_t total = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    Py_buffer b;
    if (PyObject_GetBuffer(PyList_GET_ITEM(parts.ptr(), i), &b, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();  // (not a flat buffer: the Python path frames it)
      return py::none();
    }
    held.bufs.push_back(b);
    le(static_cast<uint64_t>(b.len), 8);
    total += static_cast<uint64_t>(b.len);
  }
  std::vector<iovec> iov;
  iov.reserve(static_cast<size_t>(n) + 1);
  iov.push_back({head.data(), head.size()});
  for (Py_buffer& b : held.bufs) {
    iov.push_back({b.buf, static_cast<size_t>(b.len)});
  }
  total += head.size();
  const size_t written = write_iov(fd, iov, block);
  return py::make_tuple(py::int_(written), py::int_(total));
}

}  // namespace

int64_t session_drop_handles(py::handle store, py::handle storages, py::handle roles,
                             py::handle used_at, py::handle ids) {
  return drop_handles(store, storages, roles, used_at, ids);
}

py::object session_put_handles(py::handle store, py::handle storages, py::handle used_at,
                               py::handle ids, py::handle values, py::handle tick,
                               int64_t max_handles) {
  return put_handles(store, storages, used_at, ids, values, tick, max_handles);
}

int64_t session_storages_grown(py::handle values, py::handle storages) {
  return storages_grown(values, storages);
}

py::object session_send_reply(int fd, py::handle used, py::handle res, py::handle pb,
                              py::handle rid, py::handle st, py::handle vt, py::handle values,
                              py::handle names) {
  return send_answer(false, fd, used, res, pb, rid, st, vt, values, names);
}

void add_session_functions(py::module_& m) {
  m.def("_input_key", &input_key, py::arg("inputs"),
        "A tape's inputs keyed for its shape class: (static bytes, ints) (csrc/session.cpp; "
        "genie.remote.shape_class.shape_params).");
  m.def("_storages_grown", &storages_grown, py::arg("values"), py::arg("storages"),
        "Recount the storages of `values` in `storages` ({StorageImpl address: [count, bytes]}) "
        "to the bytes they hold now; returns the change (csrc/session.cpp).");
  m.def("_drop_handles", &drop_handles, py::arg("store"), py::arg("storages"), py::arg("roles"),
        py::arg("used_at"), py::arg("ids"),
        "Drop the held handle ids among `ids` (exact ints) from a session's dicts, their storages "
        "counted once less; returns the change of the bytes counted (csrc/session.cpp).");
  m.def("_held_inputs", &held_inputs, py::arg("store"), py::arg("used_at"), py::arg("ids"),
        py::arg("slots"), py::arg("tick"),
        "{slot: value} of a run's input slots from the first len(slots) ids, each marked used "
        "at `tick`; None when one is not an int, else the first id not held "
        "(csrc/session.cpp).");
  m.def("_put_handles", &put_handles, py::arg("store"), py::arg("storages"), py::arg("used_at"),
        py::arg("ids"), py::arg("values"), py::arg("tick"), py::arg("max_handles"),
        "Store a run's kept values under new ids, all or nothing: the change of the bytes "
        "counted, or None (nothing stored) when an id is held or repeats, a value is not a "
        "strided tensor with a storage, or the store would pass max_handles (csrc/session.cpp).");
  py::class_<TensorBytes>(m, "_TensorBytes", py::buffer_protocol())
      .def_buffer([](TensorBytes& b) -> py::buffer_info {
        return py::buffer_info(b.t.data_ptr(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.t.nbytes())}, {1}, true);
      })
      .def("__len__", [](const TensorBytes& b) { return b.t.nbytes(); });
  m.def("_send_early",
        [](int fd, py::handle used, py::handle res, py::handle pb, py::handle rid, py::handle st,
           py::handle vt, py::handle values, py::handle names) {
          return send_answer(true, fd, used, res, pb, rid, st, vt, values, names);
        },
        py::arg("fd"), py::arg("used"), py::arg("res"),
        py::arg("pb"), py::arg("rid"), py::arg("st"), py::arg("vt"), py::arg("values"),
        py::arg("names"),
        "A run's early answer written whole to the channel `fd` as the Python path writes it "
        "(status, header, frames); True, or None having written nothing when it cannot "
        "(csrc/session.cpp).");
  m.def("_send_reply",
        [](int fd, py::handle used, py::handle res, py::handle pb, py::handle rid, py::handle st,
           py::handle vt, py::handle values, py::handle names) {
          return send_answer(false, fd, used, res, pb, rid, st, vt, values, names);
        },
        py::arg("fd"), py::arg("used"), py::arg("res"), py::arg("pb"), py::arg("rid"),
        py::arg("st"), py::arg("vt"), py::arg("values"), py::arg("names"),
        "A run's reply (a lane's: genie.remote.worker.Worker._run_lane) written whole to the "
        "channel `fd` as the Python path writes it (REPLY status, header with the residency, "
        "frames); True, or None having written nothing when it cannot (csrc/session.cpp).");
  m.def("_channel_write", &channel_write, py::arg("fd"), py::arg("parts"), py::arg("block"),
        "One genie.remote.wire.Channel message of `parts` (a list of flat buffers) written to "
        "`fd` with one sendmsg: (bytes written, bytes of the message); `block`: until all is "
        "written. None, having written nothing, when `parts` is not a list of 1 to 511 flat "
        "buffers (csrc/session.cpp).");
  m.def("_frames_of", &frames_of, py::arg("values"), py::arg("names"),
        "A reply's tensors as wire frames: (metas [name, shape, None], read-only buffers), or "
        "None when one is not a contiguous CPU tensor with elements, without conj/neg bits, "
        "of a dtype in `names` (csrc/session.cpp).");
}

}  // namespace genie
