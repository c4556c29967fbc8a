// genie._C._WorkerLane, genie._C._ShapeAdmit: a session worker's steady request in one native
// call (genie/remote/worker.py, Worker._run_lane; issue 27, "vet once, replay natively").
//
// A run request of a skeleton whose structure the worker has replayed natively sends only the
// constants that changed since its last call (a delta: [position, value, ...]). On the Python
// path each such request applies the delta, resolves the input handles, patches the last call's
// instructions (protocol.refill), keys the call for its shape class (shape_class.shape_params),
// looks up its vetted shapes or asks its class (ShapeClass.admit), and runs the program: ~20
// pieces of Python, ~110 µs of a GPT-2 decode step's ~180 (docs/benchmarks.md, session 49). A
// lane holds what those pieces read, for one skeleton and one class key, and does them in one
// call:
//
// _WorkerLane(program, devices, instrs, copy, consts, input_slots, kinds, static, instr_ints,
//             exact, admit)
//   program: the structure's _ReplayProgram; devices: its run's devices; instrs: the lane's own
//   list of the last call's instructions (objects with `leaves` and `rng`; an instruction is
//   replaced by `copy(instruction)` before its first patch, so that the lane never patches an
//   object the program was compiled from); consts: the skeleton's constants list
//   (Compiled.consts, patched in place); input_slots: the slot of each of the first
//   len(input_slots) constants (the tape's inputs, handle ids); kinds: per constant
//   (kind, instruction, leaf, position): kInput, kInt (an int leaf, `position` among the
//   instructions' integers of the class key), kFloat (a float leaf whose value decides no
//   size), kWrittenBool (a bool leaf that is a value argument whole, written only into an
//   output: shape_class's value leaves, e.g. HF's stopping criteria `full((batch,), is_done)`,
//   True at a generate's last step; a program reads it per step), kSeed / kOffset (a random
//   op's seed / offset), kFixed (anything else: a delta may name it only with the value it has, of type
//   None, bool, int, float or str); static: the inputs' static key (genie._C._input_key's
//   bytes) of the class key; instr_ints: the instructions' integers of the last call; exact: a list of
//   [ints, peak] of vetted calls; admit: a _ShapeAdmit or None.
//
// step(store, used_at, delta, tick, budget, split, early) -> dict | tuple | int
//   int (> 0): the request is not the lane's, nothing changed: the caller runs it on the Python
//   path, which checks (and refuses) it as before: 1 a malformed delta, 2 a delta that changes
//   a constant the lane does not patch (or to another type, or a negative seed), 3 an input
//   that is not a handle id the session holds, 4 inputs of another static key (dtype, rank,
//   layout, aliasing), 5 integers neither vetted exactly nor admitted by the class (or the
//   class's expressions could not be evaluated natively: an overflow, a division by zero),
//   6 a working set over `budget`.
//   Otherwise the request is the lane's: every input marked used at `tick`, the delta written
//   into `consts` and the instructions, and the program run with grad mode off (with `early`
//   called after instruction `split - 1` as Program.run does): the program's {slot: value}, or
//   (instruction, exception, live values) when an instruction failed. `how` then says how the
//   call was admitted (0 vetted shapes, 1 the class) and `inputs` holds its {slot: tensor}.
//
// serve(sess, h, freed, made, outputs, writes, split, early, fd, t0, names, limits) -> None |
//   int | (stage, result): a steady run request whole (Worker._serve): what Worker.handle,
//   _run and _run_lane do for it in Python, from its decoded header to its reply, for the
//   requests the Python path would give this lane (no constants, ids, skeleton, graphs or
//   chunked frames; `id0` an exact int >= 0; `free` a list or absent; `ph` 0 or 1; `ev` pairs of
//   exact ints, handle ids >= 0 and role codes < limits[1], at most limits[0] pairs, each id
//   held, freed by the request or among its new ids). None, having changed nothing, for any
//   other request: the Python path runs it from the start and refuses what it refuses.
//   Otherwise the request's frees are dropped (`freed` takes their values when they are at most
//   min(limits[4], quota / 8) bytes, deallocated after the reply), the session's tick and
//   decoding set, and: an int when the lane passes it (8: the session is over its quota before
//   the program, or one of step's codes; the Python path continues from its lane's pass); else
//   the program ran: (0, result) when the rest is the Python path's after a step (a failed
//   instruction, a refresh, a put it refuses, a quota it passes: nothing of the puts is left);
//   (1, result) with the kept values put under id0.., the hints applied and the reply left to
//   Python (an early split, no `fd`, a value _send_reply does not write); (2, None): the reply
//   written to `fd` (_send_reply's message, `st` the seconds since `t0` on CLOCK_MONOTONIC).
//   limits: (max hints, role codes, max handles, bytes a handle costs, frees kept for later).
//
// _ShapeAdmit(n, fixed, fixed_vals, same_a, same_b, reps, signs, guard, bound): a
//   shape_class.ShapeClass's admission held natively. `fixed`, `same_a`, `same_b`, `reps`:
//   positions among a call's n integers; the symbols' values are ints[reps[k]] * signs[k];
//   `guard` and `bound`: expression trees over them as lists of nodes (op, value, children,
//   comparisons), the root last (shape_class.native_expr builds them from the class's checked
//   expressions; only integer arithmetic, comparisons and boolean logic). admit(ints) -> int |
//   None | False: the bound, None when the call is not in the class (as ShapeClass.admit), False
//   when it cannot tell (an overflow of int64, a division by zero: the Python admit decides).
#include "worker_replay.h"

#include <Python.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/stl.h>

#include "replay.h"
#include "session.h"

namespace py = pybind11;

namespace genie {
namespace {

[[noreturn]] void raise() {
  throw py::error_already_set();
}

// --- expressions --------------------------------------------------------------------------------

// Node ops (shape_class.native_expr uses the same codes).
enum Op : int {
  kConst = 0, kVar = 1, kAdd = 2, kSub = 3, kMul = 4, kFloorDiv = 5, kMod = 6, kPow = 7,
  kNeg = 8, kNot = 9, kAnd = 10, kOr = 11, kCmp = 12, kIf = 13, kAbs = 14, kMin = 15,
  kMax = 16, kBool = 17,
};
// Comparison codes of a kCmp node.
enum Cmp : int { kEq = 0, kNe = 1, kLt = 2, kLe = 3, kGt = 4, kGe = 5 };

struct Node {
  int op = kConst;
  int64_t v = 0;
  std::vector<int32_t> kids;
  std::vector<int32_t> cmps;
};

using Val = std::optional<int64_t>;  // nullopt: not evaluable natively

class Expr {
 public:
  Expr() = default;
  Expr(const py::list& nodes, int64_t nvars) {
    for (const auto& item : nodes) {
      auto t = py::cast<py::tuple>(item);
      if (t.size() != 4) {
        throw py::value_error("_ShapeAdmit: a node is (op, value, children, comparisons)");
      }
      Node n;
      n.op = py::cast<int>(t[0]);
      n.v = py::cast<int64_t>(t[1]);
      n.kids = py::cast<std::vector<int32_t>>(t[2]);
      n.cmps = py::cast<std::vector<int32_t>>(t[3]);
      const auto here = static_cast<int32_t>(nodes_.size());
      for (int32_t k : n.kids) {
        if (k < 0 || k >= here) {
          throw py::value_error("_ShapeAdmit: a child that is not an earlier node");
        }
      }
      if (n.op < kConst || n.op > kBool || (n.op == kVar && (n.v < 0 || n.v >= nvars)) ||
          (n.op == kCmp && (n.kids.size() < 2 || n.cmps.size() + 1 != n.kids.size())) ||
          (n.op == kIf && n.kids.size() != 3) ||
          ((n.op == kMin || n.op == kMax) && n.kids.size() < 2) ||
          ((n.op == kAnd || n.op == kOr) && n.kids.empty()) ||
          ((n.op >= kAdd && n.op <= kPow) && n.kids.size() != 2) ||
          ((n.op == kNeg || n.op == kNot || n.op == kAbs || n.op == kBool) &&
           n.kids.size() != 1)) {
        throw py::value_error("_ShapeAdmit: a malformed node");
      }
      for (int32_t c : n.cmps) {
        if (c < kEq || c > kGe) {
          throw py::value_error("_ShapeAdmit: an unknown comparison");
        }
      }
      nodes_.push_back(std::move(n));
    }
    if (nodes_.empty()) {
      throw py::value_error("_ShapeAdmit: an empty expression");
    }
  }

  Val eval(const std::vector<int64_t>& vars) const {
    return at(static_cast<int32_t>(nodes_.size()) - 1, vars);
  }

 private:
  // Python's semantics on integers (floor division and modulo round towards -inf; `and`/`or`
  // give an operand), in int64: an overflow is nullopt, never a wrong value.
  Val at(int32_t i, const std::vector<int64_t>& vars) const {
    const Node& n = nodes_[static_cast<size_t>(i)];
    switch (n.op) {
      case kConst:
        return n.v;
      case kVar:
        return vars[static_cast<size_t>(n.v)];
      case kAnd:
      case kOr: {
        Val r;
        for (int32_t k : n.kids) {
          r = at(k, vars);
          if (!r || ((*r != 0) != (n.op == kAnd))) {
            return r;  // (and: the first false operand; or: the first true one)
          }
        }
        return r;
      }
      case kIf: {
        Val c = at(n.kids[0], vars);
        if (!c) {
          return c;
        }
        return at(n.kids[*c != 0 ? 1 : 2], vars);
      }
      case kCmp: {
        Val left = at(n.kids[0], vars);
        if (!left) {
          return left;
        }
        for (size_t k = 0; k < n.cmps.size(); ++k) {
          Val right = at(n.kids[k + 1], vars);
          if (!right) {
            return right;
          }
          const int64_t a = *left;
          const int64_t b = *right;
          bool ok = false;
          switch (n.cmps[k]) {
            case kEq: ok = a == b; break;
            case kNe: ok = a != b; break;
            case kLt: ok = a < b; break;
            case kLe: ok = a <= b; break;
            case kGt: ok = a > b; break;
            default: ok = a >= b; break;
          }
          if (!ok) {
            return 0;
          }
          left = right;
        }
        return 1;
      }
      case kMin:
      case kMax: {
        Val r = at(n.kids[0], vars);
        for (size_t k = 1; r && k < n.kids.size(); ++k) {
          Val x = at(n.kids[k], vars);
          if (!x) {
            return x;
          }
          r = n.op == kMin ? std::min(*r, *x) : std::max(*r, *x);
        }
        return r;
      }
      default:
        break;
    }
    Val a = at(n.kids[0], vars);
    if (!a) {
      return a;
    }
    int64_t r = 0;
    switch (n.op) {
      case kNeg:
        if (__builtin_sub_overflow(int64_t{0}, *a, &r)) {
          return std::nullopt;
        }
        return r;
      case kAbs:
        if (*a >= 0) {
          return a;
        }
        if (__builtin_sub_overflow(int64_t{0}, *a, &r)) {
          return std::nullopt;
        }
        return r;
      case kNot:
        return *a == 0 ? 1 : 0;
      case kBool:
        return *a != 0 ? 1 : 0;
      default:
        break;
    }
    Val bv = at(n.kids[1], vars);
    if (!bv) {
      return bv;
    }
    const int64_t x = *a;
    const int64_t y = *bv;
    switch (n.op) {
      case kAdd:
        if (__builtin_add_overflow(x, y, &r)) {
          return std::nullopt;
        }
        return r;
      case kSub:
        if (__builtin_sub_overflow(x, y, &r)) {
          return std::nullopt;
        }
        return r;
      case kMul:
        if (__builtin_mul_overflow(x, y, &r)) {
          return std::nullopt;
        }
        return r;
      case kFloorDiv:
      case kMod: {
        if (y == 0 || (x == INT64_MIN && y == -1)) {
          return std::nullopt;  // (Python: ZeroDivisionError; or a value past int64)
        }
        int64_t q = x / y;
        int64_t m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) {
          q -= 1;
          m += y;
        }
        return n.op == kFloorDiv ? q : m;
      }
      case kPow: {
        if (y < 0 || y > 64) {
          return std::nullopt;
        }
        int64_t p = 1;
        for (int64_t k = 0; k < y; ++k) {
          if (__builtin_mul_overflow(p, x, &p)) {
            return std::nullopt;
          }
        }
        return p;
      }
      default:
        return std::nullopt;
    }
  }

  std::vector<Node> nodes_;
};

// --- a class's admission ------------------------------------------------------------------------

std::vector<int64_t> positions(const py::object& o, int64_t n, const char* what) {
  auto v = py::cast<std::vector<int64_t>>(o);
  for (int64_t p : v) {
    if (p < 0 || p >= n) {
      throw py::value_error(std::string("_ShapeAdmit: a position outside the call in ") + what);
    }
  }
  return v;
}

class ShapeAdmit {
 public:
  ShapeAdmit(int64_t n, const py::object& fixed, const py::object& fixed_vals,
             const py::object& same_a, const py::object& same_b, const py::object& reps,
             const py::object& signs, const py::list& guard, const py::list& bound)
      : n_(n),
        fixed_(positions(fixed, n, "fixed")),
        fixed_vals_(py::cast<std::vector<int64_t>>(fixed_vals)),
        same_a_(positions(same_a, n, "same_a")),
        same_b_(positions(same_b, n, "same_b")),
        reps_(positions(reps, n, "reps")),
        signs_(py::cast<std::vector<int64_t>>(signs)),
        guard_(guard, static_cast<int64_t>(reps_.size())),
        bound_(bound, static_cast<int64_t>(reps_.size())) {
    if (fixed_.size() != fixed_vals_.size() || same_a_.size() != same_b_.size() ||
        signs_.size() != reps_.size()) {
      throw py::value_error("_ShapeAdmit: lists of different lengths");
    }
    for (int64_t s : signs_) {
      if (s != 1 && s != -1) {
        throw py::value_error("_ShapeAdmit: a sign that is not 1 or -1");
      }
    }
  }

  // The bound; nullopt: not in the class; `unknown` set: not evaluable natively.
  std::optional<int64_t> admit(const std::vector<int64_t>& ints, bool& unknown) const {
    unknown = false;
    if (static_cast<int64_t>(ints.size()) != n_) {
      return std::nullopt;
    }
    for (size_t k = 0; k < fixed_.size(); ++k) {
      if (ints[static_cast<size_t>(fixed_[k])] != fixed_vals_[k]) {
        return std::nullopt;
      }
    }
    for (size_t k = 0; k < same_a_.size(); ++k) {
      if (ints[static_cast<size_t>(same_a_[k])] != ints[static_cast<size_t>(same_b_[k])]) {
        return std::nullopt;
      }
    }
    std::vector<int64_t> vals(reps_.size());
    for (size_t k = 0; k < reps_.size(); ++k) {
      const int64_t x = ints[static_cast<size_t>(reps_[k])];
      if (signs_[k] < 0 && x == INT64_MIN) {
        unknown = true;
        return std::nullopt;
      }
      vals[k] = signs_[k] < 0 ? -x : x;
    }
    Val g = guard_.eval(vals);
    if (!g) {
      unknown = true;
      return std::nullopt;
    }
    if (*g == 0) {
      return std::nullopt;
    }
    Val b = bound_.eval(vals);
    if (!b) {
      unknown = true;
      return std::nullopt;
    }
    return b;
  }

  py::object py_admit(const std::vector<int64_t>& ints) const {
    bool unknown = false;
    auto r = admit(ints, unknown);
    if (unknown) {
      return py::bool_(false);
    }
    return r ? py::object(py::int_(*r)) : py::object(py::none());
  }

 private:
  int64_t n_;
  std::vector<int64_t> fixed_, fixed_vals_, same_a_, same_b_, reps_, signs_;
  Expr guard_, bound_;
};

// --- the lane -----------------------------------------------------------------------------------

enum Kind : int {
  kInput = 0, kInt = 1, kFloat = 2, kSeed = 3, kOffset = 4, kFixed = 5, kWrittenBool = 6
};

struct ConstKind {
  int kind = kFixed;
  int64_t instr = -1;
  int64_t leaf = -1;
  int64_t pos = -1;  // kInt: position among the instructions' integers
};

struct IntsHash {
  size_t operator()(const std::vector<int64_t>& v) const {
    uint64_t h = 1469598103934665603ULL;
    for (int64_t x : v) {
      h ^= static_cast<uint64_t>(x) + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

// An exact int64 of a Python int (exact type, not a bool): false when not one.
bool exact_int(PyObject* o, int64_t& out) {
  if (!PyLong_CheckExact(o)) {
    return false;
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  out = v;
  return true;
}

class Lane {
 public:
  static constexpr size_t kMaxExact = 64;

  Lane(py::object program, py::list devices, py::list instrs, py::object copy,
       py::list consts, const py::list& input_slots, const py::list& kinds, py::bytes stat,
       std::vector<int64_t> instr_ints, const py::list& exact, py::object admit)
      : program_(std::move(program)),
        devices_(std::move(devices)),
        instrs_(std::move(instrs)),
        copy_(std::move(copy)),
        consts_(std::move(consts)),
        static_(stat),
        instr_ints_(std::move(instr_ints)),
        admit_obj_(std::move(admit)) {
    const Py_ssize_t nc = PyList_GET_SIZE(consts_.ptr());
    if (static_cast<Py_ssize_t>(kinds.size()) != nc) {
      throw py::value_error("_WorkerLane: one kind per constant");
    }
    for (const auto& s : input_slots) {
      slots_.push_back(py::reinterpret_borrow<py::object>(s));
    }
    if (static_cast<Py_ssize_t>(slots_.size()) > nc) {
      throw py::value_error("_WorkerLane: more inputs than constants");
    }
    const auto ni = static_cast<int64_t>(PyList_GET_SIZE(instrs_.ptr()));
    own_.assign(static_cast<size_t>(ni), 0);
    for (const auto& item : kinds) {
      auto t = py::cast<py::tuple>(item);
      ConstKind k;
      k.kind = py::cast<int>(t[0]);
      k.instr = py::cast<int64_t>(t[1]);
      k.leaf = py::cast<int64_t>(t[2]);
      k.pos = py::cast<int64_t>(t[3]);
      const bool leafy = k.kind == kInt || k.kind == kFloat || k.kind == kSeed ||
                         k.kind == kOffset || k.kind == kWrittenBool;
      if (k.kind < kInput || k.kind > kWrittenBool ||
          (leafy && (k.instr < 0 || k.instr >= ni)) ||
          ((k.kind == kInt || k.kind == kFloat || k.kind == kWrittenBool) && k.leaf < 0) ||
          (k.kind == kInt &&
           (k.pos < 0 || k.pos >= static_cast<int64_t>(instr_ints_.size())))) {
        throw py::value_error("_WorkerLane: a malformed constant kind");
      }
      kinds_.push_back(k);
    }
    for (size_t k = 0; k < slots_.size(); ++k) {
      if (kinds_[k].kind != kInput) {
        throw py::value_error("_WorkerLane: the first constants are the inputs");
      }
    }
    for (const auto& e : exact) {
      auto t = py::cast<py::sequence>(e);
      remember(py::cast<std::vector<int64_t>>(t[0]), py::cast<int64_t>(t[1]));
    }
    if (!admit_obj_.is_none()) {
      admit_ = &py::cast<ShapeAdmit&>(admit_obj_);
    }
  }

  void remember(std::vector<int64_t> ints, int64_t peak) {
    if (exact_.size() >= kMaxExact) {
      exact_.clear();
    }
    exact_[std::move(ints)] = peak;
  }

  py::object step(const py::handle& store, const py::handle& used_at, const py::handle& delta,
                  const py::handle& tick, int64_t budget, int64_t split,
                  const py::object& early) {
    PyObject* sd = store.ptr();
    PyObject* ud = used_at.ptr();
    PyObject* d = delta.ptr();
    if (!PyDict_Check(sd) || !PyDict_Check(ud) || !PyLong_CheckExact(tick.ptr())) {
      throw py::type_error("_WorkerLane.step: store and used_at dicts, tick an int");
    }
    // 1. the delta, checked whole before anything changes
    if (!PyList_Check(d) || PyList_GET_SIZE(d) % 2 != 0) {
      return py::int_(1);
    }
    const Py_ssize_t nd = PyList_GET_SIZE(d) / 2;
    const Py_ssize_t nc = PyList_GET_SIZE(consts_.ptr());
    const size_t n_in = slots_.size();
    std::vector<int64_t> at(static_cast<size_t>(nd));
    std::vector<int64_t> num(static_cast<size_t>(nd), 0);
    ints_ = instr_ints_;  // (the instructions' integers of this call; committed if admitted)
    in_ids_.assign(n_in, nullptr);
    for (Py_ssize_t k = 0; k < nd; ++k) {
      int64_t p = 0;
      if (!exact_int(PyList_GET_ITEM(d, 2 * k), p) || p < 0 || p >= nc) {
        return py::int_(1);
      }
      at[static_cast<size_t>(k)] = p;
      PyObject* v = PyList_GET_ITEM(d, 2 * k + 1);
      const ConstKind& c = kinds_[static_cast<size_t>(p)];
      int64_t x = 0;
      switch (c.kind) {
        case kInput:
          if (!PyLong_CheckExact(v)) {
            return py::int_(3);
          }
          in_ids_[static_cast<size_t>(p)] = v;
          break;
        case kInt:
          if (!exact_int(v, x)) {
            return py::int_(2);
          }
          ints_[static_cast<size_t>(c.pos)] = x;
          break;
        case kFloat:
          if (!PyFloat_CheckExact(v)) {
            return py::int_(2);
          }
          break;
        case kWrittenBool:
          if (!PyBool_Check(v)) {
            return py::int_(2);
          }
          break;
        case kSeed:
        case kOffset:
          if (!exact_int(v, x) || x < 0) {
            return py::int_(2);
          }
          num[static_cast<size_t>(k)] = x;
          break;
        default: {
          // a constant the lane holds fixed: only its own value again (a client's delta may
          // name a constant it sent before), of a plain type compared by value
          PyObject* old = PyList_GET_ITEM(consts_.ptr(), static_cast<Py_ssize_t>(p));
          if (v != old) {
            if (Py_TYPE(v) != Py_TYPE(old) ||
                !(v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v) ||
                  PyFloat_CheckExact(v) || PyUnicode_CheckExact(v))) {
              return py::int_(2);
            }
            const int eq = PyObject_RichCompareBool(old, v, Py_EQ);
            if (eq < 0) {
              raise();
            }
            if (eq == 0) {
              return py::int_(2);
            }
          }
          break;
        }
      }
    }
    // 2. the inputs: handle ids the session holds
    py::dict inputs;
    for (size_t k = 0; k < n_in; ++k) {
      PyObject* hid = in_ids_[k];
      if (hid == nullptr) {
        hid = PyList_GET_ITEM(consts_.ptr(), static_cast<Py_ssize_t>(k));
        in_ids_[k] = hid;
      }
      if (!PyLong_CheckExact(hid)) {
        return py::int_(3);
      }
      PyObject* t = PyDict_GetItemWithError(sd, hid);  // borrowed
      if (t == nullptr) {
        if (PyErr_Occurred()) {
          raise();
        }
        return py::int_(3);
      }
      if (PyDict_SetItem(inputs.ptr(), slots_[k].ptr(), t) < 0) {
        raise();
      }
    }
    // 3. the class key's static part and the call's integers
    input_key_into(inputs.ptr(), stat_, all_);
    if (stat_ != static_) {
      return py::int_(4);
    }
    all_.insert(all_.end(), ints_.begin(), ints_.end());
    // 4. admitted: vetted exactly, or by the class; within the budget
    int64_t peak = 0;
    auto hit = exact_.find(all_);
    if (hit != exact_.end()) {
      peak = hit->second;
      how_ = 0;
    } else {
      bool unknown = false;
      std::optional<int64_t> b;
      if (admit_ != nullptr) {
        b = admit_->admit(all_, unknown);
      }
      if (!b) {
        return py::int_(5);
      }
      peak = *b;
      how_ = 1;
    }
    if (peak > budget) {
      return py::int_(6);
    }
    // 5. the request is the lane's: commit
    for (PyObject* hid : in_ids_) {
      if (PyDict_SetItem(ud, hid, tick.ptr()) < 0) {
        raise();
      }
    }
    static PyObject* const leaves_name = PyUnicode_InternFromString("leaves");
    static PyObject* const rng_name = PyUnicode_InternFromString("rng");
    for (Py_ssize_t k = 0; k < nd; ++k) {
      const int64_t p = at[static_cast<size_t>(k)];
      PyObject* v = PyList_GET_ITEM(d, 2 * k + 1);
      Py_INCREF(v);
      PyList_SetItem(consts_.ptr(), static_cast<Py_ssize_t>(p), v);  // (steals v)
      const ConstKind& c = kinds_[static_cast<size_t>(p)];
      if (c.kind == kInput || c.kind == kFixed) {
        continue;  // (a fixed constant named with its own value: nothing to patch)
      }
      PyObject* ins = PyList_GET_ITEM(instrs_.ptr(), static_cast<Py_ssize_t>(c.instr));
      if (!own_[static_cast<size_t>(c.instr)]) {
        // the first patch of this instruction: a copy of its own (the program skips the leaves
        // it baked of the very object it was compiled from, as for protocol.refill's copies)
        py::object fresh = copy_(py::handle(ins));
        if (PyList_SetItem(instrs_.ptr(), static_cast<Py_ssize_t>(c.instr),
                           fresh.release().ptr()) < 0) {
          raise();
        }
        ins = PyList_GET_ITEM(instrs_.ptr(), static_cast<Py_ssize_t>(c.instr));
        own_[static_cast<size_t>(c.instr)] = 1;
      }
      if (c.kind == kInt || c.kind == kFloat || c.kind == kWrittenBool) {
        py::object leaves = py::reinterpret_steal<py::object>(PyObject_GetAttr(ins, leaves_name));
        if (!leaves || !PyList_Check(leaves.ptr()) ||
            c.leaf >= PyList_GET_SIZE(leaves.ptr())) {
          if (PyErr_Occurred()) {
            raise();
          }
          throw py::value_error("_WorkerLane: an instruction's leaves are not its list");
        }
        Py_INCREF(v);
        PyList_SetItem(leaves.ptr(), static_cast<Py_ssize_t>(c.leaf), v);
        continue;
      }
      py::object rng = py::reinterpret_steal<py::object>(PyObject_GetAttr(ins, rng_name));
      if (!rng || !PyTuple_Check(rng.ptr()) || PyTuple_GET_SIZE(rng.ptr()) != 2) {
        if (PyErr_Occurred()) {
          raise();
        }
        throw py::value_error("_WorkerLane: a random instruction without (seed, offset)");
      }
      py::tuple fresh(2);
      const int which = c.kind == kSeed ? 0 : 1;
      for (int e = 0; e < 2; ++e) {
        PyObject* x = e == which ? v : PyTuple_GET_ITEM(rng.ptr(), e);
        Py_INCREF(x);
        PyTuple_SET_ITEM(fresh.ptr(), e, x);
      }
      if (PyObject_SetAttr(ins, rng_name, fresh.ptr()) < 0) {
        raise();
      }
    }
    instr_ints_.swap(ints_);
    inputs_ = inputs;
    ++runs_;
    c10::AutoGradMode no_grad(false);
    return run_program(program_, inputs, instrs_, devices_, split, early);
  }

  // serve(sess, h, freed, made, outputs, writes, split, early, fd, t0, names, limits): a
  // steady run request of this lane's skeleton whole, from its header to its reply (see the
  // file's head, "serve").
  py::object serve(const py::handle& sess, const py::handle& h, const py::handle& freed,
                   const py::handle& made, const py::handle& outputs, bool writes,
                   int64_t split, const py::object& early, int fd, double t0,
                   const py::handle& names, const std::vector<int64_t>& limits) {
    static PyObject* const k_c = PyUnicode_InternFromString("c");
    static PyObject* const k_ids = PyUnicode_InternFromString("ids");
    static PyObject* const k_sk = PyUnicode_InternFromString("sk");
    static PyObject* const k_g = PyUnicode_InternFromString("g");
    static PyObject* const k_fc = PyUnicode_InternFromString("fc");
    static PyObject* const k_id0 = PyUnicode_InternFromString("id0");
    static PyObject* const k_free = PyUnicode_InternFromString("free");
    static PyObject* const k_ev = PyUnicode_InternFromString("ev");
    static PyObject* const k_ph = PyUnicode_InternFromString("ph");
    static PyObject* const k_d = PyUnicode_InternFromString("d");
    static PyObject* const k_rid = PyUnicode_InternFromString("rid");
    static PyObject* const a_store = PyUnicode_InternFromString("store");
    static PyObject* const a_storages = PyUnicode_InternFromString("storages");
    static PyObject* const a_roles = PyUnicode_InternFromString("roles");
    static PyObject* const a_used_at = PyUnicode_InternFromString("used_at");
    static PyObject* const a_nbytes = PyUnicode_InternFromString("nbytes");
    static PyObject* const a_skel = PyUnicode_InternFromString("skel_bytes");
    static PyObject* const a_quota = PyUnicode_InternFromString("quota");
    static PyObject* const a_tick = PyUnicode_InternFromString("tick");
    static PyObject* const a_decoding = PyUnicode_InternFromString("decoding");
    static PyObject* const a_pb = PyUnicode_InternFromString("peer_bytes");
    if (limits.size() != 5) {
      throw py::value_error("_WorkerLane.serve: limits are (max hints, roles, max handles, "
                            "handle cost, frees kept for later)");
    }
    const int64_t max_hints = limits[0], n_roles = limits[1], max_handles = limits[2],
                  handle_cost = limits[3], later_max = limits[4];
    PyObject* hd = h.ptr();
    if (!PyDict_Check(hd) || !PyList_Check(made.ptr()) || !PyList_Check(outputs.ptr()) ||
        !PyList_Check(freed.ptr())) {
      throw py::type_error("_WorkerLane.serve: a header dict, slot lists and a list of frees");
    }
    auto item = [hd](PyObject* k) -> PyObject* {  // borrowed, nullptr when absent
      PyObject* v = PyDict_GetItemWithError(hd, k);
      if (v == nullptr && PyErr_Occurred()) {
        raise();
      }
      return v;
    };
    // 1. the request is the lane's as the Python path would find it, else nothing changes
    // (None: that path runs it from the start, refusing what it refuses)
    for (PyObject* k : {k_c, k_ids, k_sk, k_g, k_fc}) {
      if (item(k) != nullptr) {
        return py::none();
      }
    }
    int64_t id0 = 0;
    PyObject* id0_o = item(k_id0);
    const int64_t n_made = PyList_GET_SIZE(made.ptr());
    if (id0_o == nullptr || !exact_int(id0_o, id0) || id0 < 0 ||
        id0 > INT64_MAX - n_made) {
      return py::none();
    }
    const int64_t end = id0 + n_made;
    PyObject* free_o = item(k_free);
    if (free_o != nullptr && free_o != Py_None && !PyList_Check(free_o)) {
      return py::none();
    }
    PyObject* ph = item(k_ph);
    int64_t phv = 0;
    if (ph != nullptr && (!exact_int(ph, phv) || (phv != 0 && phv != 1))) {
      return py::none();
    }
    // the hints: pairs of exact ints, handle ids >= 0 and role codes, at most max_hints
    hints_.clear();
    PyObject* ev = item(k_ev);
    if (ev != nullptr && ev != Py_None) {
      if (!PyList_Check(ev) || PyList_GET_SIZE(ev) % 2 != 0 ||
          PyList_GET_SIZE(ev) > 2 * max_hints) {
        return py::none();
      }
      const Py_ssize_t n = PyList_GET_SIZE(ev);
      for (Py_ssize_t i = 0; i < n; i += 2) {
        int64_t hid = 0, code = 0;
        if (!exact_int(PyList_GET_ITEM(ev, i), hid) || hid < 0 ||
            !exact_int(PyList_GET_ITEM(ev, i + 1), code) || code < 0 || code >= n_roles) {
          return py::none();
        }
        hints_.emplace_back(hid, code);
      }
    }
    py::object store = attr(sess, a_store);
    py::object storages = attr(sess, a_storages);
    py::object roles = attr(sess, a_roles);
    py::object used_at = attr(sess, a_used_at);
    PyObject* sd = store.ptr();
    PyObject* rd = roles.ptr();
    if (!PyDict_Check(sd) || !PyDict_Check(rd)) {
      throw py::type_error("_WorkerLane.serve: the session's maps must be dicts");
    }
    // the frees' ids (exact ints, as worker._id_list): a hint may name one of them
    frees_.clear();
    const Py_ssize_t nf = free_o != nullptr && free_o != Py_None ? PyList_GET_SIZE(free_o) : 0;
    for (Py_ssize_t i = 0; i < nf; ++i) {
      int64_t x = 0;
      if (exact_int(PyList_GET_ITEM(free_o, i), x)) {
        frees_.push_back(x);
      }
    }
    std::sort(frees_.begin(), frees_.end());
    for (const auto& [hid, code] : hints_) {  // every hinted id the session's (Worker._run)
      if (hid >= id0 && hid < end) {
        continue;
      }
      py::object k = py::reinterpret_steal<py::object>(PyLong_FromLongLong(hid));
      const int held = PyDict_Contains(sd, k.ptr());
      if (held < 0) {
        raise();
      }
      if (!held && !std::binary_search(frees_.begin(), frees_.end(), hid)) {
        return py::none();
      }
    }
    // 2. the request is the lane's up to the program (its frees, as Worker.handle drops them)
    int64_t quota = int_attr(sess, a_quota);
    int64_t nbytes = int_attr(sess, a_nbytes);
    if (nf > 0) {
      std::vector<py::object> held;
      for (Py_ssize_t i = 0; i < nf; ++i) {
        PyObject* hid = PyList_GET_ITEM(free_o, i);
        if (!PyLong_CheckExact(hid)) {
          continue;
        }
        PyObject* v = PyDict_GetItemWithError(sd, hid);
        if (v == nullptr) {
          if (PyErr_Occurred()) {
            raise();
          }
          continue;
        }
        held.push_back(py::reinterpret_borrow<py::object>(v));
      }
      const int64_t delta =
          session_drop_handles(store, storages, roles, used_at, py::handle(free_o));
      nbytes += delta;
      set_int(sess, a_nbytes, nbytes);
      if (-delta <= std::min(later_max, quota / 8)) {  // (deallocated once the reply is out)
        for (const py::object& v : held) {
          if (PyList_Append(freed.ptr(), v.ptr()) < 0) {
            raise();
          }
        }
      }
    }
    if (PyObject_SetAttr(sess.ptr(), a_decoding, phv == 1 ? Py_True : Py_False) < 0) {
      raise();
    }
    py::object tick = py::reinterpret_steal<py::object>(
        PyLong_FromLongLong(int_attr(sess, a_tick) + 1));
    if (PyObject_SetAttr(sess.ptr(), a_tick, tick.ptr()) < 0) {
      raise();
    }
    const int64_t skel = int_attr(sess, a_skel);
    int64_t used = nbytes + skel + handle_cost * static_cast<int64_t>(PyDict_GET_SIZE(sd));
    if (used > quota) {
      return py::int_(kQuota);
    }
    PyObject* d = item(k_d);
    py::object r = step(store, used_at, d != nullptr ? py::handle(d) : py::handle(Py_None), tick,
                        quota - used, split, early);
    if (PyLong_CheckExact(r.ptr())) {
      return r;
    }
    // 3. the program ran: what Worker._run_lane does after it (any case but the plain one goes
    // back to it, at a point where doing a step again changes nothing: stage 0)
    auto back = [&r](int stage) { return py::make_tuple(stage, r); };
    PyObject* kept = r.ptr();
    if (!PyDict_Check(kept)) {
      return back(0);  // (an instruction failed: the failure's reply)
    }
    for (const auto& [hid, code] : hints_) {  // the held values' hints now
      if (!(hid >= id0 && hid < end)) {
        hint(sd, rd, hid, code);
      }
    }
    if (writes) {  // resize_ of a resident value grows it (Session.refresh)
      nbytes += session_storages_grown(inputs_.attr("values")(), storages);
      set_int(sess, a_nbytes, nbytes);
    }
    py::list ids(n_made), vals(n_made);
    for (int64_t i = 0; i < n_made; ++i) {
      PyObject* v = PyDict_GetItemWithError(kept, PyList_GET_ITEM(made.ptr(), i));
      if (v == nullptr) {
        if (PyErr_Occurred()) {
          raise();
        }
        return back(0);
      }
      PyList_SET_ITEM(ids.ptr(), i, PyLong_FromLongLong(id0 + i));
      Py_INCREF(v);
      PyList_SET_ITEM(vals.ptr(), i, v);
    }
    py::object put = session_put_handles(store, storages, used_at, ids, vals, tick, max_handles);
    if (put.is_none()) {
      return back(0);  // (nothing put: Session.put_many refuses it, naming the value)
    }
    nbytes += py::cast<int64_t>(put);
    set_int(sess, a_nbytes, nbytes);
    used = nbytes + skel + handle_cost * static_cast<int64_t>(PyDict_GET_SIZE(sd));
    if (used > quota) {  // put back as it was: the Python path refuses it, naming what it holds
      nbytes += session_drop_handles(store, storages, roles, used_at, ids);
      set_int(sess, a_nbytes, nbytes);
      return back(0);
    }
    for (const auto& [hid, code] : hints_) {  // the made values' hints, now that they exist
      if (hid >= id0 && hid < end) {
        hint(sd, rd, hid, code);
      }
    }
    if (split > 0 || fd < 0) {
      return back(1);  // (an early answer may have been sent: the Python path replies)
    }
    const Py_ssize_t no = PyList_GET_SIZE(outputs.ptr());
    py::list out(no);
    int64_t out_bytes = 0;
    for (Py_ssize_t i = 0; i < no; ++i) {
      PyObject* v = PyDict_GetItemWithError(kept, PyList_GET_ITEM(outputs.ptr(), i));
      if (v == nullptr) {
        if (PyErr_Occurred()) {
          raise();
        }
        return back(1);
      }
      if (THPVariable_Check(v)) {
        out_bytes += static_cast<int64_t>(THPVariable_Unpack(v).nbytes());
      }
      Py_INCREF(v);
      PyList_SET_ITEM(out.ptr(), i, v);
    }
    if (out_bytes > quota) {
      return back(1);  // (the Python path refuses it for the quota)
    }
    PyObject* rid_p = item(k_rid);
    py::object rid = rid_p != nullptr ? py::reinterpret_borrow<py::object>(rid_p) : py::int_(-1);
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    const double st = std::round((static_cast<double>(now.tv_sec) + now.tv_nsec * 1e-9 - t0) *
                                 1e6) / 1e6;
    py::object sent = session_send_reply(
        fd, py::int_(used),
        py::make_tuple(static_cast<int64_t>(PyDict_GET_SIZE(sd)), nbytes), attr(sess, a_pb),
        rid,
        py::float_(st), py::str(how_ ? "class" : "hit"), out, names);
    if (sent.is_none()) {
      return back(1);
    }
    return py::make_tuple(2, py::none());
  }

  int how() const { return how_; }
  int64_t runs() const { return runs_; }
  py::list instrs() const { return instrs_; }
  py::dict inputs() const { return inputs_; }
  py::list consts() const { return consts_; }
  py::tuple instr_ints() const { return py::tuple(py::cast(instr_ints_)); }
  size_t exact_size() const { return exact_.size(); }

 private:
  py::object program_;
  py::list devices_;
  py::list instrs_;
  py::object copy_;
  std::vector<char> own_;  // per instruction: the lane's own copy (patched in place)
  py::list consts_;
  std::vector<py::object> slots_;
  std::vector<ConstKind> kinds_;
  std::string static_;
  std::vector<int64_t> instr_ints_;
  std::unordered_map<std::vector<int64_t>, int64_t, IntsHash> exact_;
  py::object admit_obj_;
  const ShapeAdmit* admit_ = nullptr;
  int how_ = 0;
  int64_t runs_ = 0;
  py::dict inputs_;
  static constexpr int kQuota = 8;  // (worker.LANE_PASS: over the quota before the program)

  static py::object attr(const py::handle& o, PyObject* name) {
    PyObject* v = PyObject_GetAttr(o.ptr(), name);
    if (v == nullptr) {
      raise();
    }
    return py::reinterpret_steal<py::object>(v);
  }
  static int64_t int_attr(const py::handle& o, PyObject* name) {
    py::object v = attr(o, name);
    int64_t x = 0;
    if (!exact_int(v.ptr(), x)) {
      throw py::type_error("_WorkerLane.serve: a session's count is not an int");
    }
    return x;
  }
  static void set_int(const py::handle& o, PyObject* name, int64_t x) {
    py::object v = py::reinterpret_steal<py::object>(PyLong_FromLongLong(x));
    if (!v || PyObject_SetAttr(o.ptr(), name, v.ptr()) < 0) {
      raise();
    }
  }
  // worker._apply_hints of one hint: a held value's role, only ever more evictable
  static void hint(PyObject* sd, PyObject* rd, int64_t hid, int64_t code) {
    py::object k = py::reinterpret_steal<py::object>(PyLong_FromLongLong(hid));
    const int held = PyDict_Contains(sd, k.ptr());
    if (held < 0) {
      raise();
    }
    if (!held) {
      return;
    }
    PyObject* old = PyDict_GetItemWithError(rd, k.ptr());
    int64_t o = 0;
    if (old == nullptr && PyErr_Occurred()) {
      raise();
    }
    if (old == nullptr || (exact_int(old, o) && code < o)) {
      py::object c = py::reinterpret_steal<py::object>(PyLong_FromLongLong(code));
      if (PyDict_SetItem(rd, k.ptr(), c.ptr()) < 0) {
        raise();
      }
    }
  }

  // scratch, reused per step
  std::vector<int64_t> ints_, all_;
  std::vector<std::pair<int64_t, int64_t>> hints_;
  std::vector<int64_t> frees_;
  std::vector<PyObject*> in_ids_;
  std::string stat_;
};

}  // namespace

void add_worker_replay_functions(py::module_& m) {
  py::class_<ShapeAdmit>(m, "_ShapeAdmit",
                         "A shape class's admission held natively (csrc/worker_replay.cpp; "
                         "genie.remote.shape_class.ShapeClass.native).")
      .def(py::init<int64_t, py::object, py::object, py::object, py::object, py::object,
                    py::object, py::list, py::list>(),
           py::arg("n"), py::arg("fixed"), py::arg("fixed_vals"), py::arg("same_a"),
           py::arg("same_b"), py::arg("reps"), py::arg("signs"), py::arg("guard"),
           py::arg("bound"))
      .def("admit", &ShapeAdmit::py_admit, py::arg("ints"));
  py::class_<Lane>(m, "_WorkerLane",
                   "A session worker's steady request of one skeleton in one native call "
                   "(csrc/worker_replay.cpp; genie.remote.worker.Worker._run_lane).")
      .def(py::init<py::object, py::list, py::list, py::object, py::list, const py::list&,
                    const py::list&, py::bytes, std::vector<int64_t>, const py::list&,
                    py::object>(),
           py::arg("program"), py::arg("devices"), py::arg("instrs"), py::arg("copy"),
           py::arg("consts"),
           py::arg("input_slots"), py::arg("kinds"), py::arg("static"),
           py::arg("instr_ints"), py::arg("exact"), py::arg("admit"))
      .def("step", &Lane::step, py::arg("store"), py::arg("used_at"), py::arg("delta"),
           py::arg("tick"), py::arg("budget"), py::arg("split") = -1,
           py::arg("early") = py::none())
      .def("serve", &Lane::serve, py::arg("sess"), py::arg("h"), py::arg("freed"),
           py::arg("made"), py::arg("outputs"), py::arg("writes"), py::arg("split"),
           py::arg("early"), py::arg("fd"), py::arg("t0"), py::arg("names"), py::arg("limits"))
      .def("remember", &Lane::remember, py::arg("ints"), py::arg("peak"))
      .def_property_readonly("how", &Lane::how)
      .def_property_readonly("runs", &Lane::runs)
      .def_property_readonly("instrs", &Lane::instrs)
      .def_property_readonly("inputs", &Lane::inputs)
      .def_property_readonly("consts", &Lane::consts)
      .def_property_readonly("instr_ints", &Lane::instr_ints)
      .def_property_readonly("exact_size", &Lane::exact_size);
}

}  // namespace genie
