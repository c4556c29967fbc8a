"""Record + materialize against eager: the execution overhead on real work (target: -> 1.0x).

* a chain of 8 matmuls of 1024x1024 float32 (``y = y @ w_i``): 17 GFLOP, so eager's time is the
  compute and genie's extra is recording, planning and the executor's per-instruction cost;
* the MLP forward of ``bench_record`` (4 x Linear(256) + ReLU, batch 32, ``no_grad``), where the
  overhead is a larger share of small ops;
* a small transformer encoder forward (2 x ``TransformerEncoderLayer(256, 4 heads, ff 1024)``,
  8 x 64 tokens, eval, ``no_grad``): PyTorch takes its fused fast path, so on genie a layer is
  one recorded op (``_transformer_encoder_layer_fwd``); and the same model with the fast path
  off (~25 ATen ops per layer), also on every other available Genie backend (``genie[compiled]``).

genie: record the ops, then ``genie.materialize(y)`` (the value stays on the real device, as a
program that keeps computing would have it; no copy to the host). ``torch._lazy``: the same ops,
then ``mark_step()`` and ``wait_device_ops()`` (its graph is compiled once, then cached). Inputs
and weights are already on each device before timing. The variants run interleaved (see
``interleave`` in conftest.py), so the ratios are paired.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import genie

SUITE = "bench_materialize: record + materialize vs eager"
RATIOS = [("genie", "eager"), ("torch._lazy", "eager"), ("genie", "torch._lazy")]
N_MATMUL = 8
SIZE = 1024


def _devices(workloads, row) -> dict[str, torch.device]:
    devs = {"eager": torch.device("cpu"), "genie": torch.device(workloads.dev)}
    lazy = workloads.lazy_device()
    if lazy is not None:
        devs["torch._lazy"] = lazy
    else:
        row.notes.append(f"torch._lazy: {workloads.lazy_error()}")
    return devs


def _ready(name: str, workloads, *tensors: torch.Tensor) -> None:
    """Inputs and weights on the device before timing."""
    if name == "genie":
        genie.materialize(*tensors)
    elif name == "torch._lazy":
        workloads.lazy_sync()


def _finish(name: str, workloads) -> Callable[[torch.Tensor], object]:
    """The variant's "compute it now": nothing for eager, materialize for genie, sync for lazy."""
    if name == "genie":
        return genie.materialize
    if name == "torch._lazy":
        return lambda y: (workloads.lazy_sync(), y)[1]
    return lambda y: y


def test_matmul_chain(benchmark, ratios, workloads) -> None:
    benchmark.group = f"materialize: {N_MATMUL} matmuls {SIZE}x{SIZE} (one round = every variant)"
    row = ratios.row(SUITE, f"{N_MATMUL} matmuls {SIZE}x{SIZE} fp32", unit="ms/chain", scale=1e3,
                     ratios=RATIOS)
    torch.manual_seed(0)
    x0 = torch.randn(SIZE, SIZE)
    ws0 = [torch.randn(SIZE, SIZE) / SIZE ** 0.5 for _ in range(N_MATMUL)]
    variants: dict[str, Callable[[], object]] = {}
    for name, dev in _devices(workloads, row).items():
        x, ws = x0.to(dev), [w.to(dev) for w in ws0]
        _ready(name, workloads, x, *ws)
        variants[name] = _chain_run(x, ws, _finish(name, workloads))
    workloads.interleave(benchmark, row, variants, rounds=7)


def _chain_run(x: torch.Tensor, ws: list[torch.Tensor], finish) -> Callable[[], object]:
    def run() -> object:
        y = x
        for w in ws:
            y = y @ w
        return finish(y)

    return run


def _mlp_run(model: torch.nn.Module, x: torch.Tensor, finish) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return finish(model(x))

    return run


def test_mlp_forward(benchmark, ratios, workloads) -> None:
    benchmark.group = "materialize: MLP forward 4 x Linear(256) + ReLU, batch 32 (round = all)"
    row = ratios.row(SUITE, "MLP forward (4 x Linear(256) + ReLU, batch 32, no_grad)",
                     unit="µs/forward", ratios=RATIOS)
    variants: dict[str, Callable[[], object]] = {}
    for name, dev in _devices(workloads, row).items():
        model = workloads.mlp().to(dev)
        x = torch.randn(32, 256).to(dev)
        _ready(name, workloads, x, *model.parameters())
        variants[name] = _mlp_run(model, x, _finish(name, workloads))
    workloads.interleave(benchmark, row, variants, rounds=15, inner=20)


def _transformer() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def test_transformer_forward(benchmark, ratios, workloads) -> None:
    benchmark.group = "materialize: transformer encoder forward, eval (one round = every variant)"
    row = ratios.row(SUITE, "transformer encoder forward (2 x d256/4 heads/ff1024, 8 x 64 tokens)",
                     unit="ms/forward", scale=1e3, ratios=RATIOS)
    torch.manual_seed(0)
    x0 = torch.randn(8, 64, 256)
    variants: dict[str, Callable[[], object]] = {}
    for name, dev in _devices(workloads, row).items():
        model = _transformer().to(dev)
        x = x0.to(dev)
        _ready(name, workloads, x, *model.parameters())
        variants[name] = _mlp_run(model, x, _finish(name, workloads))
    workloads.interleave(benchmark, row, variants, rounds=11)


def test_transformer_forward_unfused(benchmark, ratios, workloads) -> None:
    """The same encoder with PyTorch's fused fast path off (``set_fastpath_enabled(False)``):
    ~25 ATen ops per layer, which the ``compiled`` backend compiles into one graph per plan."""
    benchmark.group = "materialize: transformer encoder forward, unfused (round = every variant)"
    extra = workloads.extra_backends()
    names = ["eager", "genie"] + [f"genie[{b}]" for b in extra]
    row = ratios.row(SUITE, "transformer encoder forward, fast path off (same model)",
                     unit="ms/forward", scale=1e3,
                     ratios=[(v, "eager") for v in names[1:]] + [("torch._lazy", "eager")])
    torch.manual_seed(0)
    x0 = torch.randn(8, 64, 256)
    variants: dict[str, Callable[[], object]] = {}
    devs = _devices(workloads, row)
    for name in names + (["torch._lazy"] if "torch._lazy" in devs else []):
        base = name.split("[")[0]
        dev = devs[base]
        model = _transformer().to(dev)
        x = x0.to(dev)
        _ready(base, workloads, x, *model.parameters())
        run = _mlp_run(model, x, _finish(base, workloads))
        variants[name] = workloads.with_backend(name[len("genie["):-1] if "[" in name else None,
                                                run)
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        for fn in variants.values():  # compile outside the timing (a miss, then the trial run)
            fn(), fn()
        workloads.interleave(benchmark, row, variants, rounds=11)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
