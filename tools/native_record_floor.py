"""The floor of a native record: what an op costs when recording it builds nothing in Python.

Usage (never with genie loaded: this claims the PrivateUse1 slot for itself)::

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 OP=view .venv/bin/python tools/native_record_floor.py
    TORCH_DEVICE_BACKEND_AUTOLOAD=0 OP=add SHAPE=4,4 .venv/bin/python tools/native_record_floor.py

A boxed ``PrivateUse1`` fallback (compiled here with ``load_inline``, ~40 s the first time)
records every op into a C++ arena (the operator and a copy of the stack's IValues) and returns
output ``TensorImpl``s whose metadata come from a cache keyed on (operator, inputs' dtype, sizes,
strides, offset, scalar arguments), filled once by running the op on meta copies; a view's output
shares its input's storage. No liveness, no module context, no plan: only what a record must
do. Prints microseconds per call; with a path prefix ``FLAG`` as its argument it runs
the callgrind protocol of docs/benchmarks.md (1,000 calls between ``FLAG.go`` and ``FLAG.done``).
Session 54's counts (docs/benchmarks.md, "the per-op floor"): ``x.view(-1)`` 8.8k instructions
against eager's 9.5k (genie's record 21.7k); ``x + y`` (4x4) 13.0k against eager's 10.9k (genie
19.1k), of which ~9k is the composite ``add`` kernel above ``PrivateUse1`` (TensorIterator's meta,
``empty``, ``add.out``: two records), which a kernel on the Python key, as genie's, never runs.
"""
import os, sys, time
import torch
from torch.utils.cpp_extension import load_inline

src = r'''
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/alloc_cpu.h>
#include <unordered_map>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <vector>

namespace {
struct Node { const c10::OperatorHandle* op; std::vector<c10::IValue> args; };
std::vector<Node> arena;
int64_t n_rec = 0;
struct OutMeta { std::vector<int64_t> sizes, strides; int64_t offset; c10::ScalarType dtype; int alias; };
std::unordered_map<uint64_t, std::vector<OutMeta>> cache;

inline uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x100000001b3ULL; }

uint64_t key_of(const c10::OperatorHandle& op, const c10::IValue* v, size_t n) {
  uint64_t h = reinterpret_cast<uint64_t>(&op.schema());
  for (size_t i = 0; i < n; ++i) {
    const auto& x = v[i];
    if (x.isTensor()) {
      const auto* t = x.unsafeToTensorImpl();
      h = mix(h, (uint64_t)t->dtype().toScalarType());
      for (auto s : t->sizes()) h = mix(h, s);
      for (auto s : t->strides()) h = mix(h, s + 7);
      h = mix(h, t->storage_offset());
    } else if (x.isIntList()) {
      for (auto s : x.toIntList()) h = mix(h, s + 13);
    } else if (x.isInt()) { h = mix(h, x.toInt() + 17);
    } else if (x.isDouble()) { double d = x.toDouble(); uint64_t b; memcpy(&b, &d, 8); h = mix(h, b);
    } else if (x.isBool()) { h = mix(h, x.toBool() + 19);
    } else { h = mix(h, 23); }
  }
  return h;
}

c10::Storage fake_storage(size_t nbytes) {
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::DataPtr(nullptr, c10::Device(c10::DeviceType::PrivateUse1, 0)), nullptr, false);
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  c10::IValue* v = stack->data() + (stack->size() - n);
  uint64_t k = key_of(op, v, n);
  auto it = cache.find(k);
  if (it == cache.end()) {
    // first time: run the op on meta copies of the inputs
    std::vector<c10::IValue> ms(v, v + n);
    std::vector<at::Tensor> ins;
    for (auto& x : ms) if (x.isTensor()) {
      const auto& t = x.toTensor();
      at::Tensor m = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
      ins.push_back(t); x = m;
    }
    torch::jit::Stack s2(ms.begin(), ms.end());
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &s2);
    std::vector<OutMeta> outs;
    for (auto& r : s2) {
      const auto& t = r.toTensor();
      OutMeta o{t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.scalar_type(), -1};
      if (schema.returns()[outs.size()].alias_info()) o.alias = 0;  // first tensor arg
      outs.push_back(o);
    }
    it = cache.emplace(k, std::move(outs)).first;
  }
  Node nd{&op, std::vector<c10::IValue>(v, v + n)};
  arena.push_back(std::move(nd));
  if (arena.size() > 4096) arena.clear();
  ++n_rec;
  at::Tensor first;
  for (size_t i = 0; i < n; ++i) if (v[i].isTensor()) { first = v[i].toTensor(); break; }
  torch::jit::drop(*stack, n);
  for (const auto& o : it->second) {
    c10::Storage st = o.alias == 0 ? first.storage() : fake_storage(0);
    auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(st), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::scalarTypeToTypeMeta(o.dtype));
    t.unsafeGetTensorImpl()->set_sizes_and_strides(o.sizes, o.strides, o.offset);
    torch::jit::push(stack, std::move(t));
  }
}
}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::PrivateUse1>);

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

at::Tensor make(std::vector<int64_t> sizes) {
  int64_t n = 1; for (auto s : sizes) n *= s;
  auto t = at::detail::make_tensor<c10::TensorImpl>(fake_storage(n * 4), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::scalarTypeToTypeMeta(c10::kFloat));
  std::vector<int64_t> st(sizes.size()); int64_t acc = 1;
  for (int i = (int)sizes.size() - 1; i >= 0; --i) { st[i] = acc; acc *= sizes[i]; }
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, st);
  return t;
}
int64_t recorded() { return n_rec; }
'''
mod = load_inline("proto_rec", cpp_sources=[src], functions=["make", "recorded"], verbose=False,
                  extra_cflags=["-O2"])
S = [int(v) for v in os.environ.get("SHAPE", "256,256").split(",")]
x = mod.make(S); y = mod.make(S)
print(x.device, x.shape, type(x))
OP = os.environ.get("OP", "view")
def f():
    if OP == "view": return x.view(-1)
    if OP == "add": return x + y
r = f(); print("out", r.shape, r.device, r._base is x if OP == "view" else None)
def bench(n=20000):
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter() - t) / n * 1e6)
    return min(ts)
if len(sys.argv) > 1:  # callgrind protocol (FLAG)
    for _ in range(200): f()
    flag = sys.argv[1]
    open(flag + ".ready", "w").close()
    while not os.path.exists(flag + ".go"): time.sleep(0.05)
    for _ in range(1000): f()
    open(flag + ".done", "w").close()
    while not os.path.exists(flag + ".end"): time.sleep(0.05)
else:
    print(OP, f"{bench():.2f} us per call, recorded {mod.recorded()}")
