"""CPU time per generated token, eager against genie, and where genie's materializations go.

Usage: ``.venv/bin/python tools/generate_cpu.py [calls]``. The ``generate`` row of
``bench/bench_models.py`` (GPT-2 4 x 128, vocab 1000, random weights, greedy ``generate`` of 32
tokens, a prompt length never seen before in every call), timed with ``time.thread_time`` (this
thread's CPU time: on a shared machine, other processes' load does not enter it; one intra-op
thread) with eager and genie alternating call by call. Prints ms per token of each, their ratio
(the median of per-call ratios), and genie's materialization phases per token: ``plan``
(plan-cache lookup), ``run`` (the replay, ``passes.pipeline.run``), ``bind``, ``after_run``
(memory accounting), ``teardown`` (freeing the tape and the step's nodes it was the last to
hold) and ``materialize`` (all of it, from the trigger). Outputs are checked equal to eager's.
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


def generate(model, dev: str, n: int) -> torch.Tensor:  # noqa: ANN001
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(1, 1000, (1, n), generator=g).to(dev)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                              min_new_tokens=32, do_sample=False).cpu()


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
    te, tg, ratios = 0.0, 0.0, []
    for _ in range(calls):
        n = next(lengths)
        context.deactivate()
        t = T()
        want = generate(me, "cpu", n)
        e = T() - t
        context.activate()
        t = T()
        got = generate(mg, DEV, n)
        g = T() - t
        assert torch.equal(got, want), "genie's tokens differ from eager's"
        te, tg = te + e, tg + g
        ratios.append(g / e)
    tokens = calls * 32
    print(f"eager {te / tokens * 1e3:.3f} ms/token, genie {tg / tokens * 1e3:.3f} ms/token, "
          f"genie/eager {statistics.median(ratios):.2f}x (median of {calls} calls, CPU time)")
    for k in ("materialize", "plan", "run", "bind", "after_run", "teardown"):
        print(f"  {k}: {acc.get(k, 0.0) / tokens * 1e3:.3f} ms/token")


if __name__ == "__main__":
    main()
