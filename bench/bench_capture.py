"""Recording cost inside ``genie.capture()`` with semantic metadata on and off, and without capture.

Three variants record the same ATen ops (record only: nothing is materialized):

* ``genie``: LazyTensor recording into the default graph, no capture block;
* ``capture (metadata off)``: inside ``genie.capture(metadata=False)``: the dispatch mode, the
  capture graph that keeps every node, ids and fingerprint (computed on read, so not here);
* ``capture (metadata on)``: inside ``genie.capture()``: plus the global module and optimizer
  hooks that track module paths, phases and regions, and one scope reference per node.

Semantic metadata (module paths, roles, categories, FLOPs, bytes) is computed only when read, so
``capture (metadata on) / capture (metadata off)`` is the price of tracking it while recording.
Each timed call opens a fresh block (a capture's graph lives as long as the block's result).
"""

from __future__ import annotations

import pytest
import torch

import genie

SUITE = "bench_capture: recording cost per op inside genie.capture() (record only)"
N_CHAIN = 2000
VARIANTS = ["genie", "capture (metadata off)", "capture (metadata on)"]
RATIOS = [("capture (metadata on)", "capture (metadata off)"),
          ("capture (metadata on)", "genie"), ("capture (metadata off)", "genie")]


def _wrap(variant: str, fn):  # noqa: ANN001, ANN202
    if variant == "genie":
        return fn

    metadata = variant == "capture (metadata on)"

    def run():  # noqa: ANN202
        with genie.capture(metadata=metadata):
            return fn()

    return run


def _bench(benchmark, ratios, workloads, variant: str, fn, title: str) -> None:  # noqa: ANN001
    run = _wrap(variant, fn)
    ops = workloads.recorded_ops(run)  # also warms the meta cache
    benchmark(run)
    row = ratios.row(SUITE, title, ratios=RATIOS)
    if not row.notes:
        row.notes.append(f"{ops} ops/call")
    ratios.add(row, variant, benchmark, per=ops)


@pytest.mark.parametrize("variant", VARIANTS)
def test_capture_chain(benchmark, ratios, workloads, variant: str) -> None:
    benchmark.group = "capture: 2,000-op elementwise chain, 4x4"
    x = torch.randn(4, 4).to(workloads.dev)
    genie.materialize(x)
    _bench(benchmark, ratios, workloads, variant, lambda: workloads.chain(x, N_CHAIN),
           f"chain of {N_CHAIN:,} elementwise ops (4x4)")


@pytest.mark.parametrize("variant", VARIANTS)
def test_capture_mlp_forward(benchmark, ratios, workloads, variant: str) -> None:
    benchmark.group = "capture: MLP forward (4 x Linear 256 + ReLU, batch 32), no_grad"
    model = workloads.mlp().to(workloads.dev)
    x = torch.randn(32, 256).to(workloads.dev)
    genie.materialize(x, *model.parameters())

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    _bench(benchmark, ratios, workloads, variant, fwd,
           "MLP forward (4 x Linear(256) + ReLU, batch 32)")


@pytest.mark.parametrize("variant", VARIANTS)
def test_capture_gpt2_forward(benchmark, ratios, workloads, variant: str) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    benchmark.group = "capture: GPT-2 forward (2 layers, d=32, 8 tokens), no_grad"
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                  n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval().to(workloads.dev)
    ids = torch.randint(0, 100, (1, 8)).to(workloads.dev)
    genie.materialize(ids, *model.parameters())

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return model(ids).logits

    _bench(benchmark, ratios, workloads, variant, fwd,
           "GPT-2 forward (2 layers, d=32, 8 tokens)")
