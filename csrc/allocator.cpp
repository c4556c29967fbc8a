// The PrivateUse1 allocator for remote_accelerator: it refuses to allocate.
//
// Genie tensors are Python wrapper subclasses with no storage; their data lives
// (lazily) on the remote accelerator. Any C++ path that tries to give one real
// bytes has bypassed Genie's interception, and silently handing out host memory
// would produce tensors whose contents are never sent anywhere. Zero-byte
// requests succeed because wrapper-subclass construction may ask for them.
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include "device.h"

namespace genie {
namespace {

struct Allocator final : public c10::Allocator {
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
};

Allocator g_allocator;

} // namespace
} // namespace genie

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &genie::g_allocator);
