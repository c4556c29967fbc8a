"""torch.compile on the device for the workloads of bench/bench_compile.py, against eager:
losses of 20 nanoGPT-style training steps (AdamW) and GPT-2 greedy tokens with a static KV
cache. Dynamo traces a transformer for tens of seconds on a loaded CPU, so these run with
``GENIE_FULL_TESTS=1``; tests/unit/test_compile.py covers the same paths on small models.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

import genie
from genie.backends import compiled as compiled_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_compile import GPT, _gpt_step  # noqa: E402  (one definition of the workloads)

DEV = "remote_accelerator:0"
pytestmark = pytest.mark.skipif(os.environ.get("GENIE_FULL_TESTS") != "1",
                                reason="Dynamo traces a transformer (a minute here); "
                                       "GENIE_FULL_TESTS=1")


@pytest.fixture(autouse=True)
def fast_compiler():
    before = compiled_backend.compiler()
    compiled_backend.set_compiler(os.environ.get("GENIE_COMPILER") or "aot_eager")
    torch._dynamo.reset()
    yield
    compiled_backend.set_compiler(before)
    torch._dynamo.reset()


def test_nanogpt_20_training_steps_losses_equal_eager():
    torch.manual_seed(0)
    ref = GPT(vocab=512, block=64, layers=2, d=64, heads=4)
    lazy = copy.deepcopy(ref).to(DEV)
    lazy.head.weight = lazy.wte.weight  # deepcopy keeps the tie; .to() too (checked below)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_l = torch.optim.AdamW(lazy.parameters(), lr=1e-3)
    step = torch.compile(_gpt_step)
    g = torch.Generator().manual_seed(1)
    want, got = [], []
    for _ in range(20):
        x = torch.randint(0, 512, (2, 64), generator=g)
        y = torch.randint(0, 512, (2, 64), generator=g)
        want.append(_gpt_step(ref, opt_r, x, y).item())
        got.append(step(lazy, opt_l, x.to(DEV), y.to(DEV)))
    # the graphs run Core ATen decompositions (layer_norm, AdamW's update): float operations in
    # another order than eager's kernels, ~5e-6 relative after 20 steps
    torch.testing.assert_close(torch.stack([v.cpu() for v in got]), torch.tensor(want),
                               rtol=2e-5, atol=1e-5)
    # the key projection's bias has a gradient of zero in exact arithmetic (softmax ignores a
    # constant added to every key): its float noise differs with the order of operations and
    # Adam scales noise to steps of lr = 1e-3, so parameters agree to a couple of steps of lr
    for a, b in zip(ref.parameters(), lazy.parameters(), strict=True):
        torch.testing.assert_close(b.cpu(), a.detach(), rtol=1e-3, atol=3e-3)
    s = genie.stats()
    assert s["graph_calls"] == 60 and s.get("graphs_op_by_op", 0) == 0, s


def test_gpt2_static_cache_greedy_tokens_equal_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500,
                                  n_positions=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    ref.generation_config.pad_token_id = 0
    ref.generation_config.disable_compile = True
    lazy = copy.deepcopy(ref).to(DEV)
    lazy.forward = torch.compile(lazy.forward)
    ids = torch.randint(1, 500, (1, 8), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = lazy.generate(ids.to(DEV), **kw).cpu()
        got2 = lazy.generate(ids.to(DEV), **kw).cpu()  # compiled graphs reused
    assert torch.equal(got, want) and torch.equal(got2, want)
    s = genie.stats()
    assert s["graph_calls"] >= 16 and s.get("graphs_op_by_op", 0) == 0, s


def test_gpt2_compiled_forward_with_its_default_cache_is_one_graph_with_eagers_logits():
    """``torch.compile(model)`` called directly, as a new user calls it: transformers' default
    ``DynamicCache`` starts its keys with ``torch.tensor([], device=...)``, a constant in the
    graph (it was a LazyTensor among Dynamo's fake values: the trace failed)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    lazy = torch.compile(copy.deepcopy(ref).to(DEV))
    ids = torch.randint(0, 500, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids).logits
        for _ in range(2):
            genie.reset_stats()
            got = lazy(ids.to(DEV)).logits
            s = genie.stats()
            assert s["graph_calls"] == 1 and s.get("graphs_op_by_op", 0) == 0, s
            torch.testing.assert_close(got.cpu(), want)
