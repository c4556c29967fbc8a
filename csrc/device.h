// Process-wide device bookkeeping for Genie's remote_accelerator (PrivateUse1).
//
// The device is virtual: there is no driver to ask how many devices exist or
// which one is current, so Python declares the count and each thread keeps its
// own current index (as CUDA does per host thread). Everything else in csrc/
// (guard, hooks, generators, the Python module) reads this state through these
// functions so that there is exactly one source of truth.
#pragma once

#include <c10/core/Device.h>

namespace genie {

// Upper bound on the device count; sizes the default-generator table.
// DeviceIndex is int8_t, and nothing realistic needs more than this.
constexpr c10::DeviceIndex kMaxDevices = 64;

// Never throws: DeviceGuardImplInterface::deviceCount must be noexcept.
c10::DeviceIndex device_count() noexcept;
// Raises c10::Error unless 1 <= count <= kMaxDevices. Call it before the first
// backward(): the autograd engine sizes its device threads once.
void set_device_count(int64_t count);

c10::DeviceIndex current_device() noexcept;
// Raises c10::IndexError (Python IndexError) for an index outside [0, count).
void set_device(c10::DeviceIndex index);
// Sets `index` current and returns the previous one; same checks as set_device.
c10::DeviceIndex exchange_device(c10::DeviceIndex index);

// Raises c10::IndexError unless 0 <= index < count. Takes int64 so that Python
// ints are checked before narrowing to the int8 DeviceIndex (300 must not wrap to 44).
c10::DeviceIndex check_device_index(int64_t index);

// Maps -1 ("the current device") to the current index and range-checks others.
c10::DeviceIndex resolve_device_index(int64_t index);

} // namespace genie
