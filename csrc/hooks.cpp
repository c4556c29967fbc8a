// at::PrivateUse1HooksInterface for remote_accelerator.
//
// Generic ATen/Python code reaches a PrivateUse1 backend through these hooks:
// torch.Generator(device=...) (getNewGenerator), default generators and
// seeding (getDefaultGenerator), the autograd engine's stream bookkeeping
// (hasPrimaryContext), torch.accelerator (device count/current device).
// Genie tensors are storage-less Python wrapper subclasses, so anything that
// asks about host pointers gets a clear error or "no"; pinned memory is host memory.
#include "hooks.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "device.h"
#include "generator.h"

namespace genie {
namespace {

struct Hooks final : public at::PrivateUse1HooksInterface {
  void init() const override {}

  bool isBuilt() const override {
    return true;
  }

  bool isAvailable() const override {
    return device_count() > 0;
  }

  // There is no driver context to create lazily; every device is "initialized".
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override {
    return true;
  }

  c10::DeviceIndex deviceCount() const override {
    return device_count();
  }

  void setCurrentDevice(c10::DeviceIndex device) const override {
    set_device(device);
  }

  c10::DeviceIndex getCurrentDevice() const override {
    return current_device();
  }

  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    return exchange_device(device);
  }

  // "maybe": an invalid index (e.g. -1) leaves the current device alone.
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    if (device < 0 || device >= device_count()) {
      return current_device();
    }
    return exchange_device(device);
  }

  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    return default_generator(device_index);
  }

  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    return new_generator(device_index);
  }

  at::Device getDeviceFromPtr(void* /*data*/) const override {
    TORCH_CHECK(false,
                "remote_accelerator tensors have no host pointer, so a device cannot be "
                "inferred from a raw pointer (e.g. torch.from_blob / __cuda_array_interface__-"
                "style paths are unsupported). Create the tensor on CPU and call .to(\"remote_accelerator\").");
  }

  // "Pinned" memory for remote_accelerator is ordinary host memory: transfers are staged by
  // Genie (the bytes go over the wire or to the embedded device from any host buffer), so
  // t.pin_memory() is a copy in the CPU allocator's memory and no pointer reports pinned, as
  // is_pinned() answers where no accelerator pins. DataLoader(pin_memory=True) then runs as in
  // plain torch (it pins for the current accelerator, which Genie makes remote_accelerator).
  bool isPinnedPtr(const void* /*data*/) const override {
    return false;
  }

  at::Allocator* getPinnedMemoryAllocator() const override {
    return c10::GetCPUAllocator();
  }

  void resizePrivateUse1Bytes(const c10::Storage& /*storage*/, size_t newsize) const override {
    TORCH_CHECK(false,
                "remote_accelerator tensors have no host storage; cannot resize storage to ", newsize,
                " bytes. Use tensor-level ops (resize_/new_empty) which Genie intercepts.");
  }
};

} // namespace

void register_hooks() {
  // Leaked on purpose: ATen keeps the raw pointer for the life of the process.
  static Hooks* hooks = new Hooks();
  static bool registered = false;
  if (registered) {
    return;
  }
  TORCH_CHECK(!at::isPrivateUse1HooksRegistered(),
              "Cannot register Genie's remote_accelerator runtime: another extension already "
              "registered PrivateUse1 hooks in this process. Only one PrivateUse1 backend can be "
              "loaded at a time.");
  at::RegisterPrivateUse1HooksInterface(hooks);
  registered = true;
}

} // namespace genie
