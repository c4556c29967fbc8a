// Running a Python callable with some of PyTorch's C++ warnings dropped.
//
// A C++ warning (TORCH_WARN) goes to the thread's current c10 warning handler; the one Python
// installs around a call of a torch binding (torch.var, Tensor.cpu) holds it until the call
// returns, then issues it as a Python warning at the caller's line. An op Genie runs from inside
// such a call (a probe at record time, a tape at materialization) thus warns at the user's line
// even where Genie has already warned what eager warns, exactly once, at the call: std/var of a
// reduction with no degrees of freedom (genie.checks.dof_warning). Python's warning filters
// cannot reach a warning that is issued after the Python code that caused it has returned, so
// the dropping happens here, at the handler: a handler of our own for the call, which passes
// every other warning on to the handler that was current.
#include "warnings.h"

#include <string>
#include <utility>

#include <c10/util/Exception.h>

namespace genie {

namespace {

class Dropping : public c10::WarningHandler {
 public:
  Dropping(c10::WarningHandler* next, std::string text) : next_(next), text_(std::move(text)) {}

  void process(const c10::Warning& warning) override {
    if (warning.msg().find(text_) == std::string::npos) {
      next_->process(warning);
    }
  }

 private:
  c10::WarningHandler* next_;
  std::string text_;
};

pybind11::object without_warning(const std::string& text, const pybind11::object& fn) {
  Dropping handler(c10::WarningUtils::get_warning_handler(), text);
  c10::WarningUtils::WarningHandlerGuard guard(&handler);
  return fn();
}

}  // namespace

void add_warning_functions(pybind11::module_& m) {
  m.def("_without_warning", &without_warning, pybind11::arg("text"), pybind11::arg("fn"),
        "fn() with the C++ warnings whose message contains `text` dropped (every other one "
        "goes on as before).");
}

}  // namespace genie
