// genie.memory's accounting of the real CPU storages Genie holds, natively.
//
// After every run the executor hands the values it kept to genie.memory.hold; memory_allocated()
// is the bytes of the distinct real storages among them that are still alive (views count once).
// In Python that was a weak reference with a release callback per kept value, made anew every
// step (a kept value's Python object rarely outlives its step): ~3 µs per value, ~50 µs of a
// small training step, and as much again to release them. Here a value costs a hash lookup: each
// storage is held by a weak pointer to its StorageImpl (never keeping its memory alive), and
// the figure is summed over the storages that are still alive, pruning the dead.
#include <cstdint>
#include <unordered_map>
#include <vector>

#include <c10/core/Storage.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include "memory.h"

namespace py = pybind11;

namespace {

struct Held {
  const c10::StorageImpl* impl;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t bytes;
};

// One device's held storages: an array, summed in order, and each one's position in it. (A
// node-based map, walked after every run, cost one cache miss after another per storage once a
// replay had streamed a model's weights through the caches: ~18 us of a GPT-2 12 x 768 decode
// step for its ~200 storages, against ~1 us warm.)
struct Storages {
  std::vector<Held> held;
  std::unordered_map<const c10::StorageImpl*, size_t> at;
};

std::unordered_map<int64_t, Storages> held;  // device index -> its held storages

int64_t sum_alive(Storages& m) {
  std::vector<Held>& h = m.held;
  for (const Held& e : h) {  // the reference counts expired() reads, asked for together
    __builtin_prefetch(e.impl, 0, 3);
  }
  int64_t total = 0;
  size_t j = 0;
  for (size_t i = 0; i < h.size(); ++i) {
    if (h[i].storage.expired()) {
      m.at.erase(h[i].impl);
      continue;
    }
    total += h[i].bytes;
    if (j != i) {
      h[j] = std::move(h[i]);
      m.at[h[j].impl] = j;
    }
    ++j;
  }
  h.erase(h.begin() + static_cast<std::ptrdiff_t>(j), h.end());
  return total;
}

}  // namespace

namespace genie {

int64_t mem_hold(int64_t index, const py::iterable& values) {
  Storages& m = held[index];
  for (const py::handle v : values) {
    if (!THPVariable_Check(v.ptr())) {
      continue;  // a server handle: the server accounts for it
    }
    const at::Tensor& t = THPVariable_Unpack(v.ptr());
    if (!t.defined() || !t.has_storage() || t.device().type() != c10::DeviceType::CPU) {
      continue;  // CUDA: torch.cuda's allocator accounts for it
    }
    const c10::Storage& st = t.storage();
    const c10::StorageImpl* impl = st.unsafeGetStorageImpl();
    const auto bytes = static_cast<int64_t>(st.nbytes());
    auto it = m.at.find(impl);
    if (it == m.at.end()) {  // new
      m.at.emplace(impl, m.held.size());
      m.held.push_back(Held{impl, st.getWeakStorageImpl(), bytes});
      continue;
    }
    Held& e = m.held[it->second];
    if (e.storage.expired()) {  // a dead storage's address reused by a new one
      e.storage = st.getWeakStorageImpl();
    }
    e.bytes = bytes;  // (a resize_ in place changes what the storage holds)
  }
  return sum_alive(m);
}

int64_t mem_allocated(int64_t index) {
  auto it = held.find(index);
  return it == held.end() ? 0 : sum_alive(it->second);
}

}  // namespace genie
