// Random-number generator state for remote_accelerator (PrivateUse1).
//
// Genie never draws random numbers in C++: random ops are recorded lazily and
// replayed on the remote accelerator, which needs only a (seed, offset) pair
// per generator, the same Philox-style state CUDA keeps. This generator is
// therefore pure bookkeeping that Python's torch.Generator API can read/write.
#pragma once

#include <cstdint>

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>
#include <c10/core/GeneratorImpl.h>

namespace genie {

class GeneratorImpl final : public c10::GeneratorImpl {
 public:
  // State tensor layout for get_state/set_state: seed then offset, each a
  // little-endian uint64 (16 bytes in a CPU uint8 tensor).
  static constexpr int64_t kStateSize = 16;

  explicit GeneratorImpl(c10::DeviceIndex device_index, uint64_t seed = c10::default_rng_seed_val);

  void set_current_seed(uint64_t seed) override;
  uint64_t current_seed() const override;
  // Draws a nondeterministic seed (like CPU/CUDA `Generator.seed()`), sets it and returns it.
  uint64_t seed() override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;

 private:
  GeneratorImpl* clone_impl() const override;

  uint64_t seed_;
  uint64_t offset_ = 0;
};

// The process-wide default generator of a device (-1 = current device), created
// on first use with a nondeterministic seed, as CUDA does. Thread-safe.
const at::Generator& default_generator(c10::DeviceIndex device_index);

// A fresh generator (-1 = current device) seeded with c10::default_rng_seed_val,
// which is what `torch.Generator(device=...)` returns.
at::Generator new_generator(c10::DeviceIndex device_index);

} // namespace genie
