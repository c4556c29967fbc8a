// genie._C: the Python face of Genie's native remote_accelerator runtime.
//
// Importing this module is what makes PyTorch's C++ accept the PrivateUse1
// device: the guard (guard.cpp) and allocator (allocator.cpp) register at
// library load, the hooks (hooks.cpp) when the module initializes. The
// functions below let genie's Python device module configure and query the
// runtime; they are private (underscored) and typed in genie/_C.pyi.
#include <array>
#include <cstdint>

#include <pybind11/pybind11.h>
#include <torch/csrc/Generator.h>

#include "device.h"
#include "generator.h"
#include "hooks.h"

namespace py = pybind11;

namespace {

// Python objects for the default generators, created once per index and kept
// alive for the process (like torch.cuda.default_generators) so that repeated
// lookups return the same torch.Generator object. Guarded by the GIL.
py::object default_generator_object(int64_t index) {
  static std::array<PyObject*, genie::kMaxDevices> objects{};
  const auto resolved = genie::resolve_device_index(index);
  PyObject*& obj = objects[resolved];
  if (obj == nullptr) {
    obj = THPGenerator_initDefaultGenerator(genie::default_generator(resolved));
    if (obj == nullptr) {
      throw py::error_already_set();
    }
  }
  return py::reinterpret_borrow<py::object>(obj);
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Genie's native remote_accelerator (PrivateUse1) runtime.";

  genie::register_hooks();

  m.def("_set_device_count", &genie::set_device_count, py::arg("count"),
        "Set how many remote_accelerator devices exist (1..64). Call before the first backward().");
  m.def("_device_count", []() { return static_cast<int>(genie::device_count()); },
        "Number of remote_accelerator devices.");
  m.def("_current_device", []() { return static_cast<int>(genie::current_device()); },
        "This thread's current remote_accelerator device index.");
  m.def(
      "_set_device",
      [](int64_t index) { genie::set_device(genie::check_device_index(index)); },
      py::arg("index"), "Make `index` this thread's current device; IndexError if out of range.");
  m.def(
      "_exchange_device",
      [](int64_t index) {
        return static_cast<int>(genie::exchange_device(genie::check_device_index(index)));
      },
      py::arg("index"), "Set the current device and return the previous index.");
  m.def("_default_generator", &default_generator_object, py::arg("index"),
        "The default torch.Generator of device `index` (-1: current device); same object every call.");
  m.attr("_max_devices") = static_cast<int>(genie::kMaxDevices);
}
