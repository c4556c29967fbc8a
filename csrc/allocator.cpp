// The PrivateUse1 allocator for remote_accelerator: it refuses to allocate, and answers
// torch.accelerator's memory API from Genie's own accounting.
//
// Genie tensors are Python wrapper subclasses with no storage; their data lives
// (lazily) on the remote accelerator. Any C++ path that tries to give one real
// bytes has bypassed Genie's interception, and silently handing out host memory
// would produce tensors whose contents are never sent anywhere. Zero-byte
// requests succeed because wrapper-subclass construction may ask for them.
//
// torch.accelerator.memory_allocated(), memory_stats(), max_memory_allocated(),
// reset_peak_memory_stats(), empty_cache() and get_memory_info() ask the device type's
// allocator, which must be a c10::DeviceAllocator (a plain c10::Allocator failed torch's
// internal assert "Allocator for remote_accelerator is not a DeviceAllocator"). Its statistics
// are the real device's bytes as genie.memory accounts them (torch.remote_accelerator's
// figures, embedded or a server session's), read through genie.memory._accelerator_*.
#include <Python.h>

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <array>
#include <string>
#include <utility>

#include "device.h"

#define GENIE_DEVICE_ALLOCATOR \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9))
#if GENIE_DEVICE_ALLOCATOR
#include <c10/core/CachingDeviceAllocator.h>
#endif

namespace genie {
namespace {

#if GENIE_DEVICE_ALLOCATOR
// genie.memory.<name>(index) with the GIL held: a new reference; a Python error becomes a
// c10::Error with its message (torch turns it into a RuntimeError at the caller's line).
PyObject* call_memory(const char* name, int64_t index) {
  PyObject* mod = PyImport_ImportModule("genie.memory");
  PyObject* r = nullptr;
  if (mod != nullptr) {
    r = PyObject_CallMethod(mod, name, "L", static_cast<long long>(index));
    Py_DECREF(mod);
  }
  if (r == nullptr) {
    PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
    PyErr_Fetch(&type, &value, &tb);
    std::string msg = "genie.memory." + std::string(name) + " failed";
    if (value != nullptr) {
      PyObject* s = PyObject_Str(value);
      if (s != nullptr) {
        const char* c = PyUnicode_AsUTF8(s);
        if (c != nullptr) {
          msg += ": ";
          msg += c;
        }
        Py_DECREF(s);
      }
    }
    PyErr_Clear();
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    TORCH_CHECK(false, msg);
  }
  return r;
}

// The integers of the tuple genie.memory.<name>(index) returns.
template <size_t N>
std::array<int64_t, N> memory_ints(const char* name, int64_t index) {
  PyGILState_STATE gil = PyGILState_Ensure();
  std::array<int64_t, N> out{};
  PyObject* r = nullptr;
  try {
    r = call_memory(name, index);
  } catch (...) {
    PyGILState_Release(gil);
    throw;
  }
  bool ok = PyTuple_Check(r) && PyTuple_GET_SIZE(r) == static_cast<Py_ssize_t>(N);
  for (size_t i = 0; ok && i < N; ++i) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(r, i));
    ok = !(out[i] == -1 && PyErr_Occurred());
  }
  PyErr_Clear();
  Py_DECREF(r);
  PyGILState_Release(gil);
  TORCH_CHECK(ok, "genie.memory.", name, " returned no tuple of ", N, " integers");
  return out;
}

void memory_call(const char* name, int64_t index) {
  PyGILState_STATE gil = PyGILState_Ensure();
  try {
    Py_DECREF(call_memory(name, index));
  } catch (...) {
    PyGILState_Release(gil);
    throw;
  }
  PyGILState_Release(gil);
}

// A device index torch.accelerator passes: a RuntimeError out of range, as CUDA's allocator
// raises ("Invalid device argument").
int64_t valid_index(c10::DeviceIndex device) {
  const int64_t n = static_cast<int64_t>(device_count());
  TORCH_CHECK(device >= 0 && device < n, "Invalid device argument ", static_cast<int>(device),
              ": remote_accelerator has ", n, " device(s) (valid indices 0..", n - 1,
              "); set GENIE_DEVICE_COUNT to expose more.");
  return device;
}

using Base = c10::DeviceAllocator;
#else
using Base = c10::Allocator;
#endif

struct Allocator final : public Base {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device device(c10::DeviceType::PrivateUse1, current_device());
    TORCH_CHECK(nbytes == 0,
                "Genie remote_accelerator tensors have no host storage; this code path tried to "
                "allocate storage directly (", nbytes, " bytes on ", device,
                "). This usually means a C++ kernel ran for remote_accelerator instead of Genie's "
                "Python interception; please report the op that triggered it.");
    return c10::DataPtr(nullptr, device);
  }

  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t count) const override {
    TORCH_CHECK(count == 0,
                "Genie remote_accelerator tensors have no host storage; cannot copy ", count,
                " bytes between remote_accelerator storages.");
  }

#if GENIE_DEVICE_ALLOCATOR
  bool initialized() override {
    return true;
  }

  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    memory_call("_accelerator_empty_cache", -1);
  }

  // Genie orders a device's work itself (one stream per device): nothing to record.
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}

  // Bytes allocated and reserved, now and at their peak (AGGREGATE, as CUDA's allocator fills
  // it); Genie counts no allocations or segments, so those stay zero.
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const auto v = memory_ints<4>("_accelerator_stats", valid_index(device));
    c10::CachingDeviceAllocator::DeviceStats s;
    constexpr size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    for (auto* a : {&s.allocated_bytes, &s.active_bytes, &s.requested_bytes}) {
      (*a)[all].current = v[0];
      (*a)[all].peak = v[1];
    }
    s.reserved_bytes[all].current = v[2];
    s.reserved_bytes[all].peak = v[3];
    return s;
  }

  // Genie keeps no accumulated counts (allocated and freed totals): they stay zero.
  void resetAccumulatedStats(c10::DeviceIndex /*device*/) override {}

  void resetPeakStats(c10::DeviceIndex device) override {
    memory_call("_accelerator_reset_peak", valid_index(device));
  }

  // (not `override`: torch versions differ in which of these DeviceAllocator declares; where it
  // declares them pure, these define them)
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) {
    const auto v = memory_ints<2>("_accelerator_memory_info", valid_index(device));
    return {static_cast<size_t>(v[0]), static_cast<size_t>(v[1])};
  }

  // Device memory in bytes for torch.cuda-style raw allocations: Genie hands none out (as
  // allocate above); freeing the null pointer it may have returned is a no-op.
  void* raw_alloc(size_t nbytes) {
    TORCH_CHECK(nbytes == 0, "Genie remote_accelerator has no raw device memory to hand out (",
                nbytes, " bytes asked); device values are tensors on remote_accelerator.");
    return nullptr;
  }

  void raw_delete(void* ptr) {
    TORCH_CHECK(ptr == nullptr, "Genie remote_accelerator never handed out raw memory at ", ptr);
  }
#endif
};

Allocator g_allocator;

} // namespace
} // namespace genie

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &genie::g_allocator);
