"""CPU time per generated token, eager against genie, and where genie's materializations go.

Usage: ``.venv/bin/python tools/generate_cpu.py [calls]``. The ``generate`` row of
``bench/bench_models.py`` (GPT-2 4 x 128, vocab 1000, random weights, greedy ``generate`` of 32
tokens, a prompt length never seen before in every call), timed with ``time.thread_time`` (this
thread's CPU time: on a shared machine, other processes' load does not enter it; one intra-op
thread) with eager and genie alternating call by call. Prints ms per token of each, their ratio
(the median of per-call ratios), the same for a steady token (the median step from the 5th to the
31st, stamped by a logits processor that changes no score) with what a call costs beyond 32
steady tokens (its prefill, first decodes and last token), and genie's materialization phases
per token: ``plan`` (plan-cache lookup), ``run`` (the replay, ``passes.pipeline.run``),
``bind``, ``after_run`` (memory accounting), ``teardown`` (freeing the tape and the step's
nodes it was the last to hold) and ``materialize`` (all of it, from the trigger). Outputs are
checked equal to eager's.
Eager runs in this process with Genie's ``nn.Module.__call__`` wrapper removed around its calls
(``genie.context.deactivate``, outside the timing; installed again for genie's), as
``bench_models.py`` measures it: eager as a process without Genie runs it.
"""
import itertools
import statistics
import sys
import time

import torch
import transformers

import genie
from genie import backends, context, executor, memory, plan_cache
from genie import lazy_tensor as lt
from genie.passes import pipeline

torch.set_num_threads(1)
T = time.thread_time
DEV = "remote_accelerator:0"
acc: dict[str, float] = {}


def _add(k: str, v: float) -> None:
    acc[k] = acc.get(k, 0.0) + v


def _timed(mod, name: str, key: str) -> None:  # noqa: ANN001
    f = getattr(mod, name)

    def w(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t = T()
        try:
            return f(*a, **k)
        finally:
            _add(key, T() - t)

    setattr(mod, name, w)


def _run_targets(targets, index):  # noqa: ANN001, ANN202 - executor.run_targets, phases timed
    fast = [executor._ready(n, o) for n, o in targets]
    if all(v is not None for v in fast):
        return backends.fetch(fast)
    t0 = T()
    tape = plan_cache.plan(targets, backends.shape_generic())
    t1 = T()
    outs = executor.run_tape(tape, index)
    t2 = T()
    del tape
    _add("plan", t1 - t0)
    _add("teardown", T() - t2)
    return backends.fetch(outs)


def gpt2() -> transformers.GPT2LMHeadModel:
    cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000,
                                  n_positions=1024, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    m.generation_config.pad_token_id = 0
    return m


class _Stamps(transformers.LogitsProcessor):
    """Notes this thread's CPU time at each step's logits processing (changes no score)."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.t.append(T())
        return scores


def generate(model, dev: str, n: int,  # noqa: ANN001
             stamps: _Stamps | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(1, 1000, (1, n), generator=g).to(dev)
    extra = {} if stamps is None else \
        {"logits_processor": transformers.LogitsProcessorList([stamps])}
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                              min_new_tokens=32, do_sample=False, **extra).cpu()


def _split(stamps: _Stamps, start: float, end: float) -> tuple[float, float]:
    """(a steady token, what the call costs beyond 32 of them): the steady token is the median
    step from the 5th to the 31st (each is the previous token's materialization and this
    token's forward); the rest is the prefill, the first decodes and the last token's edges."""
    ts = [start, *stamps.t, end]
    steps = [b - a for a, b in zip(ts, ts[1:])]
    steady = statistics.median(steps[4:31])
    return steady, (end - start) - 32 * steady


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    _timed(pipeline, "run", "run")
    _timed(executor, "_bind", "bind")
    _timed(memory, "after_run", "after_run")
    _timed(lt, "materialize", "materialize")
    executor.run_targets = _run_targets
    mg, me = gpt2().to(DEV), gpt2()
    lengths = itertools.count(8)
    for _ in range(2):
        n = next(lengths)
        generate(mg, DEV, n), generate(me, "cpu", n)
    acc.clear()
    te, tg, ratios, steady, edges = 0.0, 0.0, [], [], []
    for _ in range(calls):
        n = next(lengths)
        context.deactivate()
        se = _Stamps()
        t = T()
        want = generate(me, "cpu", n, se)
        e = T() - t
        context.activate()
        sg = _Stamps()
        t1 = T()
        got = generate(mg, DEV, n, sg)
        g = T() - t1
        assert torch.equal(got, want), "genie's tokens differ from eager's"
        te, tg = te + e, tg + g
        ratios.append(g / e)
        (ue, xe), (ug, xg) = _split(se, t, t + e), _split(sg, t1, t1 + g)
        steady.append((ug / ue, ue, ug))
        edges.append((xe, xg))
    tokens = calls * 32
    print(f"eager {te / tokens * 1e3:.3f} ms/token, genie {tg / tokens * 1e3:.3f} ms/token, "
          f"genie/eager {statistics.median(ratios):.2f}x (median of {calls} calls, CPU time)")
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    print(f"  steady tokens (5th to 31st, median step): eager {med(steady, 1) * 1e3:.3f} ms, "
          f"genie {med(steady, 2) * 1e3:.3f} ms, genie/eager {med(steady, 0):.2f}x; beyond 32 "
          f"steady tokens a call costs eager {med(edges, 0) * 1e3:.2f} ms, genie "
          f"{med(edges, 1) * 1e3:.2f} ms (prefill, first decodes, last token)")
    for k in ("materialize", "plan", "run", "bind", "after_run", "teardown"):
        print(f"  {k}: {acc.get(k, 0.0) / tokens * 1e3:.3f} ms/token")


if __name__ == "__main__":
    main()
