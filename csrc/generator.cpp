// remote_accelerator generator: (seed, offset) bookkeeping; see generator.h.
#include "generator.h"

#include <array>
#include <mutex>

#include <ATen/EmptyTensor.h>
#include <ATen/core/TensorBase.h>
#include <c10/util/Exception.h>

#include "device.h"

namespace genie {
namespace {

// Byte-wise so the state format does not depend on host endianness.
void store_le(uint8_t* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<uint8_t>(value >> (8 * i));
  }
}

uint64_t load_le(const uint8_t* in) {
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) {
    value |= static_cast<uint64_t>(in[i]) << (8 * i);
  }
  return value;
}

} // namespace

GeneratorImpl::GeneratorImpl(c10::DeviceIndex device_index, uint64_t seed)
    : c10::GeneratorImpl(
          c10::Device(c10::DeviceType::PrivateUse1, device_index),
          c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      seed_(seed) {}

// A new seed starts a new random stream, so the offset into it restarts too
// (CUDA's Philox generator behaves the same way).
void GeneratorImpl::set_current_seed(uint64_t seed) {
  seed_ = seed;
  offset_ = 0;
}

uint64_t GeneratorImpl::current_seed() const {
  return seed_;
}

uint64_t GeneratorImpl::seed() {
  const uint64_t s = c10::detail::getNonDeterministicRandom();
  set_current_seed(s);
  return s;
}

void GeneratorImpl::set_offset(uint64_t offset) {
  offset_ = offset;
}

uint64_t GeneratorImpl::get_offset() const {
  return offset_;
}

c10::intrusive_ptr<c10::TensorImpl> GeneratorImpl::get_state() const {
  auto state = at::detail::empty_cpu({kStateSize}, c10::ScalarType::Byte);
  auto* bytes = state.data_ptr<uint8_t>();
  store_le(bytes, seed_);
  store_le(bytes + 8, offset_);
  return state.getIntrusivePtr();
}

void GeneratorImpl::set_state(const c10::TensorImpl& new_state) {
  at::detail::check_rng_state(new_state);  // CPU, uint8, strided, contiguous
  TORCH_CHECK(
      new_state.numel() == kStateSize,
      "remote_accelerator Generator.set_state expected a uint8 tensor of ", kStateSize,
      " bytes (seed then offset, little-endian uint64 each), got ", new_state.numel(),
      " bytes. Pass a state obtained from a remote_accelerator generator's get_state().");
  const auto* bytes = static_cast<const uint8_t*>(new_state.data());
  seed_ = load_le(bytes);
  offset_ = load_le(bytes + 8);
}

GeneratorImpl* GeneratorImpl::clone_impl() const {
  auto* copy = new GeneratorImpl(device_.index(), seed_);
  copy->offset_ = offset_;
  return copy;
}

const at::Generator& default_generator(c10::DeviceIndex device_index) {
  // A fixed-size table so returned references stay valid when Python later
  // raises the device count; entries are created lazily under the mutex.
  static std::array<at::Generator, kMaxDevices> generators;
  static std::mutex mutex;
  const auto index = resolve_device_index(device_index);
  std::lock_guard<std::mutex> lock(mutex);
  auto& gen = generators[index];
  if (!gen.defined()) {
    gen = at::make_generator<GeneratorImpl>(index);
    gen.seed();
  }
  return gen;
}

at::Generator new_generator(c10::DeviceIndex device_index) {
  return at::make_generator<GeneratorImpl>(resolve_device_index(device_index));
}

} // namespace genie
