// genie._C._mem_hold / _mem_allocated: genie.memory's CPU accounting (memory.cpp).
#pragma once

#include <cstdint>

#include <pybind11/pybind11.h>

namespace genie {

// Note the real CPU storages of `values` (tensors; anything else is skipped) as held on
// remote_accelerator:`index` while they live; returns the bytes held there now.
int64_t mem_hold(int64_t index, const pybind11::iterable& values);

// The bytes of the live storages held on remote_accelerator:`index`.
int64_t mem_allocated(int64_t index);

}  // namespace genie
