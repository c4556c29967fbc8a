// The global state an op's result depends on, as one word; see state.cpp.
#pragma once

#include <cstdint>

#include <pybind11/pybind11.h>

namespace genie {

// The state word now: default dtype, deterministic-algorithm flags and, where enabled
// (_state_mask), the backend precision flags. Part of every meta-cache key (csrc/record.cpp,
// genie.lazy_tensor._record).
uint64_t state_word();

// Re-enable the math-bit keys (Conjugate, Negative, ZeroTensor) this thread excludes, as
// genie._C._math_bits_on; returns which it re-enabled, for math_bits_restore.
long math_bits_on();

// Exclude again the keys `mask` (a math_bits_on result) names.
void math_bits_restore(long mask);

// Adds _state_word, _state_apply and _state_mask to the genie._C module.
void add_state_functions(pybind11::module_& m);

}  // namespace genie
