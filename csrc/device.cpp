// Device count and per-thread current device for remote_accelerator; see device.h.
#include "device.h"

#include <atomic>

#include <c10/util/Exception.h>

namespace genie {
namespace {

// Default 1 so that `remote_accelerator:0` works before Python configures anything.
std::atomic<c10::DeviceIndex> g_device_count{1};

// Thread-local like cudaSetDevice: autograd device threads each pin their own
// index through the guard without disturbing the caller's thread.
thread_local c10::DeviceIndex t_current_device = 0;

} // namespace

c10::DeviceIndex check_device_index(int64_t index) {
  const int64_t count = device_count();
  TORCH_CHECK_INDEX(index >= 0 && index < count,
                    "remote_accelerator device index ", index, " is out of range: ", count,
                    " device(s) are configured (valid indices 0..", count - 1,
                    "). Set GENIE_DEVICE_COUNT (or call genie._C._set_device_count) to expose more.");
  return static_cast<c10::DeviceIndex>(index);
}

c10::DeviceIndex device_count() noexcept {
  return g_device_count.load(std::memory_order_relaxed);
}

void set_device_count(int64_t count) {
  TORCH_CHECK_VALUE(
      count >= 1 && count <= kMaxDevices,
      "remote_accelerator device count must be in [1, ", static_cast<int>(kMaxDevices),
      "], got ", count, ".");
  g_device_count.store(static_cast<c10::DeviceIndex>(count), std::memory_order_relaxed);
}

c10::DeviceIndex current_device() noexcept {
  return t_current_device;
}

void set_device(c10::DeviceIndex index) {
  t_current_device = check_device_index(index);
}

c10::DeviceIndex exchange_device(c10::DeviceIndex index) {
  const auto previous = t_current_device;
  t_current_device = check_device_index(index);
  return previous;
}

c10::DeviceIndex resolve_device_index(int64_t index) {
  return index == -1 ? current_device() : check_device_index(index);
}

} // namespace genie
