// DeviceGuardImplInterface for remote_accelerator (PrivateUse1).
//
// C++ reaches this through DeviceGuard (e.g. in `_to_copy`) and the autograd
// engine, which pins one worker thread per device index. Genie's device is lazy
// and all execution/synchronization happens in Python, so there is a single
// default stream per device and every event/sync operation is a no-op:
// nothing is ever in flight from C++'s point of view.
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "device.h"

namespace genie {
namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

c10::Stream default_stream(c10::Device d) {
  return c10::Stream(c10::Stream::DEFAULT, d);
}

void check_type(c10::Device d) {
  TORCH_CHECK(d.type() == kType, "remote_accelerator guard got a non-PrivateUse1 device: ", d);
}

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kType;
  }

  c10::Device exchangeDevice(c10::Device d) const override {
    check_type(d);
    return c10::Device(kType, exchange_device(d.index()));
  }

  c10::Device getDevice() const override {
    return c10::Device(kType, current_device());
  }

  void setDevice(c10::Device d) const override {
    check_type(d);
    set_device(d.index());
  }

  // Called from guard destructors with an index that was valid when saved; if
  // Python shrank the device count meanwhile, keep the current index instead
  // of throwing from a destructor.
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    try {
      set_device(d.index());
    } catch (...) {
    }
  }

  // noexcept on getStream/exchangeStream: older torch releases declare them
  // noexcept, newer does not; a noexcept override compiles against both.
  c10::Stream getStream(c10::Device d) const noexcept override {
    return default_stream(d);
  }

  c10::Stream getDefaultStream(c10::Device d) const override {
    return default_stream(d);
  }

  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    return default_stream(d);
  }

  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*isHighPriority*/) const override {
    return default_stream(d);
  }

  // There is only one stream per device, so "the previous stream" is the same one.
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    return default_stream(s.device());
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return device_count();
  }

  // Events stay null: a null event counts as "completed" and blocking on it is
  // a no-op, which matches a device whose work C++ never observes in flight.
  void record(void** /*event*/, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {}

  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}

  bool queryEvent(void* /*event*/) const override {
    return true;
  }

  void destroyEvent(void* /*event*/, const c10::DeviceIndex /*device_index*/) const noexcept override {}

  bool queryStream(const c10::Stream& /*stream*/) const override {
    return true;
  }

  void synchronizeStream(const c10::Stream& /*stream*/) const override {}

  void synchronizeEvent(void* /*event*/) const override {}

  void synchronizeDevice(const c10::DeviceIndex /*device_index*/) const override {}

  double elapsedTime(void* /*event1*/, void* /*event2*/, const c10::DeviceIndex /*device_index*/)
      const override {
    TORCH_CHECK(false, "remote_accelerator events do not record time; "
                       "time the Python-side materialization instead.");
  }
};

} // namespace
} // namespace genie

C10_REGISTER_GUARD_IMPL(PrivateUse1, genie::GuardImpl);
