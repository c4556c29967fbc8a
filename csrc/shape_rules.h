// Native shape rules (output metadata of common ops without a meta kernel); see shape_rules.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

// Adds _shape_rules_init and the _rule_* functions genie.shape_rules registers to genie._C.
void add_shape_rule_functions(pybind11::module_& m);

}  // namespace genie
