// genie._C._match_core: the plan cache's column match, per node, natively (match.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

void match_init(pybind11::object node, pybind11::object ref, pybind11::object storage,
                pybind11::object held_after, pybind11::object same_kind);

pybind11::object match_core(pybind11::tuple flat, pybind11::list entries, pybind11::list klasses,
                            pybind11::object wheres, pybind11::dict produced,
                            pybind11::list want_out, pybind11::list targets, bool generic,
                            bool pending, pybind11::dict pin, pybind11::object entryless);

}  // namespace genie
