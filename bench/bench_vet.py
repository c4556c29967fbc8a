"""The server's concrete vet of a moving step, with and without its effect rules (issue 27).

Until a structure's shape class serves it, a worker vets each call whose integers moved (a
decode step's KV length, a new prompt length) on meta tensors (``genie.remote.guard.vet_tape``);
the effect cache misses for the ops whose operands' sizes moved, and ``genie.remote.vet_rules``
computes those effects without meta kernels. Here the GPT-2 12x768 decode step of
bench_remote_models (vocab 1000, 64-token prompt, KV cache growing) runs embedded, its tapes
are kept, and each round vets the next step's tape twice, rules on and rules off (all ops on
meta), each with its own effect cache (as two workers would: the ops whose sizes did not move
hit, the moved ones miss), in alternating order: milliseconds per vet, one interleaved run.
"""

from __future__ import annotations

import pytest
import torch
from conftest import interleave

from genie.passes import pipeline
from genie.remote import guard, vet_rules

transformers = pytest.importorskip("transformers")

SUITE = "bench_vet: the server's concrete vet of a moving step (genie.remote.guard)"
STEPS = 24


@pytest.fixture(scope="module")
def decode_tapes():
    from bench_remote_models import PROMPT, _gpt2
    from transformers import DynamicCache

    tapes = []
    real = pipeline.run

    def keep(tape, device):
        tapes.append(tape)
        return real(tape, device)

    pipeline.run = keep
    try:
        model = _gpt2(12, 768, 12).to("remote_accelerator:0")
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            cache = DynamicCache()
            ids = torch.randint(0, 1000, (1, PROMPT), generator=g).to("remote_accelerator:0")
            model(ids, past_key_values=cache, use_cache=True).logits.cpu()
            for _ in range(STEPS + 4):
                t = torch.randint(0, 1000, (1, 1), generator=g).to("remote_accelerator:0")
                model(t, past_key_values=cache, use_cache=True).logits.cpu()
    finally:
        pipeline.run = real
    steps = [t for t in tapes if len(t.instrs) > 100][-(STEPS + 4):]
    assert len(steps) == STEPS + 4
    return steps


def test_vet_moving_decode_step(benchmark, ratios, decode_tapes):
    row = ratios.row(SUITE, f"GPT-2 12x768 decode step ({len(decode_tapes[-1].instrs)} "
                     "instructions), KV length moved", unit="ms/vet", scale=1e3,
                     ratios=[("rules", "meta")])
    caches = {"meta": {}, "rules": {}}
    rules = dict(vet_rules.RULES)
    tapes = {k: iter(decode_tapes) for k in caches}

    def variant(name):
        def run():
            guard._effects = caches[name]
            vet_rules.RULES = rules if name == "rules" else {}
            guard.vet_tape(next(tapes[name]), 1 << 40)
        return run

    saved = guard._effects
    try:
        for name in caches:  # the prefill's shapes and the first steps, as a worker saw them
            for _ in range(3):
                variant(name)()
        interleave(benchmark, row, {k: variant(k) for k in caches}, rounds=STEPS)
    finally:
        guard._effects = saved
        vet_rules.RULES = rules
