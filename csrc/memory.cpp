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

#include <c10/core/Storage.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include "memory.h"

namespace py = pybind11;

namespace {

struct Held {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t bytes;
};

using Storages = std::unordered_map<const c10::StorageImpl*, Held>;
std::unordered_map<int64_t, Storages> held;  // device index -> its held storages

int64_t sum_alive(Storages& m) {
  int64_t total = 0;
  for (auto it = m.begin(); it != m.end();) {
    if (it->second.storage.expired()) {
      it = m.erase(it);
    } else {
      total += it->second.bytes;
      ++it;
    }
  }
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
    auto it = m.find(impl);
    if (it != m.end() && !it->second.storage.expired()) {
      it->second.bytes = bytes;  // a resize_ in place changes what the storage holds
      continue;
    }
    // new, or a dead storage's address reused by a new one
    m.insert_or_assign(impl, Held{st.getWeakStorageImpl(), bytes});
  }
  return sum_alive(m);
}

int64_t mem_allocated(int64_t index) {
  auto it = held.find(index);
  return it == held.end() ? 0 : sum_alive(it->second);
}

}  // namespace genie
