// Storages of remote_accelerator tensors: no bytes, a fake address (see storage.cpp).
#pragma once

#include <cstddef>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <pybind11/pybind11.h>

namespace genie {

// A storage of `nbytes` bytes on remote_accelerator:`index` that holds no memory: its data
// pointer is a fresh fake address (nullptr for zero bytes, as eager's allocators give), unique
// among all storages made here, never dereferenced.
c10::Storage fake_storage(size_t nbytes, c10::DeviceIndex index);

// Give the wrapper `t` the storage of `base` (an alias of base's value: the same StorageImpl,
// so data_ptr, untyped_storage() and is_set_to answer as eager's views do), or, without `base`,
// a fresh fake storage of the size t's own storage has.
void set_storage(const at::Tensor& t, const at::Tensor* base);

// A resize_ that needs more than t's storage holds: the storage (shared with t's views) takes
// `nbytes` and a fresh fake address, as eager's reallocation moves the bytes of every view.
void grow_storage(const at::Tensor& t, size_t nbytes);

// genie._C._set_storage, _new_storage, _grow_storage (typed in genie/_C.pyi).
void add_storage_functions(pybind11::module_& m);

} // namespace genie
