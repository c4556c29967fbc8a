// Storages of remote_accelerator tensors: the right size, no bytes, a unique fake address.
//
// Libraries decide aliasing from addresses: tied weights and safetensors' shared-tensor check
// compare `untyped_storage().data_ptr()`, view tests compare `t.data_ptr()` with the base's plus
// the byte offset, `is_set_to` compares StorageImpls. So each recorded value gets a storage of
// its own, whose data pointer is an address no other storage made here covers, and every view
// of it (its wrapper is made with set_storage(t, &base)) holds that same StorageImpl: eager's
// answers, with no memory behind them (the bytes live on the real device, in the graph).
//
// The addresses come from one counter in [kBase, kEnd): a storage takes its size rounded up to
// kAlign bytes plus one kAlign gap, so two storages' ranges never touch. kBase = 2^60 is not a
// canonical x86-64 (or AArch64 user) address: a pointer that were ever dereferenced would fault
// at once instead of reading memory. The range holds 3 * 2^60 bytes of storages; past it the
// counter starts again at kBase (a collision then needs a storage made 3 EiB ago still alive).
// Deterministic: the same program gives the same addresses.
#include "storage.h"

#include <atomic>
#include <cstdint>

#include <c10/core/Allocator.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace genie {
namespace {

constexpr uint64_t kBase = uint64_t{1} << 60;
constexpr uint64_t kEnd = uint64_t{1} << 62;
constexpr uint64_t kAlign = 512;  // as the CUDA caching allocator's blocks

std::atomic<uint64_t> g_next{kBase};

uint64_t take(size_t nbytes) {
  const uint64_t span = ((static_cast<uint64_t>(nbytes) + kAlign - 1) / kAlign + 1) * kAlign;
  uint64_t at = g_next.load(std::memory_order_relaxed);
  uint64_t next;
  do {
    if (span >= kEnd - kBase) {
      at = kBase;  // larger than the whole range: no address is unique; take the start
      next = at;
      break;
    }
    next = at + span;
    if (next > kEnd) {
      at = kBase;
      next = at + span;
    }
  } while (!g_next.compare_exchange_weak(at, next, std::memory_order_relaxed));
  return at;
}

} // namespace

c10::Storage fake_storage(size_t nbytes, c10::DeviceIndex index) {
  const c10::Device device(c10::DeviceType::PrivateUse1, index);
  void* data = nbytes == 0 ? nullptr : reinterpret_cast<void*>(take(nbytes));
  // No context and no deleter: nothing to free. The meta allocator (as _make_wrapper_subclass
  // gives) only serves a resize, which the hooks refuse for remote_accelerator storages.
  return c10::Storage(c10::Storage::use_byte_size_t{}, nbytes, at::DataPtr(data, device),
                      c10::GetAllocator(c10::kMeta), /*resizable=*/true);
}

void set_storage(const at::Tensor& t, const at::Tensor* base) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (base != nullptr && base->defined() && base->has_storage()) {
    impl->set_storage_keep_dtype(base->storage());
    return;
  }
  impl->set_storage_keep_dtype(fake_storage(impl->storage().nbytes(), t.device().index()));
}

void grow_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  if (st->nbytes() >= nbytes) {
    return;
  }
  void* data = nbytes == 0 ? nullptr : reinterpret_cast<void*>(take(nbytes));
  st->set_data_ptr_noswap(at::DataPtr(data, t.device()));
  st->set_nbytes(nbytes);
}

void add_storage_functions(py::module_& m) {
  m.def(
      "_set_storage",
      [](py::handle t, py::handle base) {
        if (!THPVariable_Check(t.ptr()) || (!base.is_none() && !THPVariable_Check(base.ptr()))) {
          throw py::type_error("_set_storage(t, base) takes tensors");
        }
        if (base.is_none()) {
          set_storage(THPVariable_Unpack(t.ptr()), nullptr);
        } else {
          const at::Tensor b = THPVariable_Unpack(base.ptr());
          set_storage(THPVariable_Unpack(t.ptr()), &b);
        }
      },
      py::arg("t"), py::arg("base") = py::none(),
      "Give the wrapper `t` base's storage (an alias), or a fresh fake-address storage of its "
      "own size (csrc/storage.cpp).");
  m.def(
      "_new_storage",
      [](size_t nbytes, int64_t index) {
        PyObject* s = torch::createPyObject(
            fake_storage(nbytes, static_cast<c10::DeviceIndex>(index)));
        if (s == nullptr) {
          throw py::error_already_set();
        }
        return py::reinterpret_steal<py::object>(s);
      },
      py::arg("nbytes"), py::arg("index"),
      "A torch.UntypedStorage of `nbytes` bytes on remote_accelerator:`index` at a fresh fake "
      "address, holding no memory (genie.storage: torch.load onto the device).");
  m.def(
      "_grow_storage",
      [](py::handle t, size_t nbytes) {
        if (!THPVariable_Check(t.ptr())) {
          throw py::type_error("_grow_storage(t, nbytes) takes a tensor");
        }
        grow_storage(THPVariable_Unpack(t.ptr()), nbytes);
      },
      py::arg("t"), py::arg("nbytes"),
      "Grow t's storage (shared with its views) to `nbytes` at a fresh fake address, as a "
      "resize_ that reallocates.");
}

} // namespace genie
