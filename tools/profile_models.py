"""Where genie's time goes on the bench_models rows: a workload to run under py-spy, and a
classifier of py-spy's raw samples into record, meaning, lookup, replay, bind and the rest.

Usage:
    PYTHONPATH=. py-spy record --native -r 100 -f raw -o /tmp/decode.txt -- \
        .venv/bin/python tools/profile_models.py run decode 20
    .venv/bin/python tools/profile_models.py classify /tmp/decode.txt [-v]
    .venv/bin/python tools/profile_models.py split generate [ROUNDS]

Rows (as in ``bench/bench_models.py``): ``decode`` (GPT-2 12 x 768, one decode step per call
after a 64-token prompt, KV cache growing, logits materialized), ``generate`` (GPT-2 4 x 128,
``generate(ids, max_new_tokens=32)``, a new prompt length per call; ``generate-eos``: the model's
``eos_token_id`` kept and ``min_new_tokens=32``, so every token's stopping check materializes
its forward, as ``bench/bench_remote_models.py`` calls it), ``mlp256`` / ``mlp2048``
(4 x Linear + ReLU, MSE, AdamW step). ``DEV=cpu`` runs the row eagerly instead. The first four
calls run inside ``warm()``: the classifier leaves their samples out (first runs of plans, the
passes' verification). A sample counts under the innermost Genie frame it has (native frames
by their csrc file), with the device kernels under a replay told apart by name; samples with no
Genie frame are the model's Python and torch's own dispatch.
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import sys
import time


def make(row: str, D: str) -> tuple:  # noqa: N803
    """``(step, model, units)``: one call of ``row`` on device ``D``, the model it calls and how
    many tokens (generate: 32) or steps one call makes."""
    import torch

    import genie
    import transformers
    from transformers import DynamicCache

    torch.set_num_threads(1)
    sync = (lambda t: t) if D == "cpu" else genie.materialize

    def gpt2(layers: int, width: int, heads: int) -> torch.nn.Module:
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads,
                                      vocab_size=1000, n_positions=1024, bos_token_id=0,
                                      eos_token_id=0, attn_implementation="eager")
        torch.manual_seed(0)
        m = transformers.GPT2LMHeadModel(cfg).eval()
        m.generation_config.pad_token_id = 0
        return m

    if row == "decode":
        m = gpt2(12, 768, 12).to(D)
        g = torch.Generator().manual_seed(0)
        cache = DynamicCache()
        tok = torch.randint(0, 1000, (1, 1), generator=g).to(D)
        with torch.no_grad():
            sync(m(torch.randint(0, 1000, (1, 64), generator=g).to(D), cache=cache,
                   use_cache=True).logits)

        def step() -> None:
            with torch.no_grad():
                sync(m(tok, cache=cache, use_cache=True).logits)
    elif row in ("generate", "generate-eos"):
        m = gpt2(4, 128, 4).to(D)
        kw: dict = {"min_new_tokens": 32}  # generate-eos: the EOS check reads every token
        if row == "generate":
            m.generation_config.eos_token_id = None  # 32 tokens every call
            kw = {}
        lengths = itertools.count(8)

        def step() -> None:
            n = next(lengths)
            ids = torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n))
            with torch.no_grad():
                m.generate(ids.to(D), max_new_tokens=32, **kw).cpu()
    elif row in ("mlp256", "mlp2048"):
        w, b = (256, 32) if row == "mlp256" else (2048, 64)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[x for _ in range(4) for x in (torch.nn.Linear(w, w),
                                                                     torch.nn.ReLU())]).to(D)
        x, t = torch.randn(b, w).to(D), torch.randn(b, w).to(D)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), t)
            loss.backward()
            opt.step()
            loss.item()
    else:
        sys.exit(f"unknown row {row!r}: decode, generate, generate-eos, mlp256 or mlp2048")
    return step, (model if row.startswith("mlp") else m), 32 if row.startswith("generate") else 1


def run(row: str, secs: float) -> None:
    step = make(row, os.environ.get("DEV", "remote_accelerator"))[0]

    def warm() -> None:
        for _ in range(4):
            step()

    warm()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < secs:
        step()
        n += 1
    print(f"{row}: {n} calls, {(time.perf_counter() - t0) / n * 1e3:.1f} ms/call")


SMALL = 16  # split: a materialization of fewer instructions is "small"


# (category, substrings of a frame), tried in order on the innermost frame that matches any
_KINDS = [
    ("passes: verify (a new plan's first run, twice, compared)",
     ["_verify_run (", "_close (genie/passes", "verify (genie/passes/__init__"]),
    ("passes: gate", ["_gate_run ("]),
    ("replay", ["native_replay.py", "genie/backends/eager.py", "codegen.py", "(replay.cpp)",
                "(whole.cpp)"]),
    ("lookup (slice, match, plan)", ["plan_cache.py", "planner.py", "(match.cpp)",
                                     "(slice.cpp)", "tape_io.py"]),
    ("bind/teardown/memory", ["_bind (genie/executor", "genie/memory.py", "(bind.cpp)",
                              "(memory.cpp)", "(storage.cpp)"]),
    ("meaning (context)", ["ctx_push", "ctx_pop", "genie/context.py"]),
    ("record", ["(record.cpp)", "genie/lazy_tensor.py", "genie/meta.py", "shape_rules.py",
                "genie/graph.py", "factories.py", "(python_key.cpp)"]),
    ("materialize other (executor)", ["genie/executor.py"]),
]
KERNEL = re.compile(r"mkl_|at::native::|callback_fn<|gemm|gemv|Vectorized|cpu_kernel|vml")


def kind(frame: str) -> str | None:
    x = re.sub(r":\d+\)", ")", frame)
    if "_module_call (" in x:  # the module wrapper: the model's code runs under it
        return None
    if "genie/passes/" in x and "run (genie/passes/pipeline" not in x and \
            "_verify_run" not in x and "_gate_run" not in x:
        return "passes: rewrite/prepare"
    for name, subs in _KINDS:
        if any(sub in x for sub in subs):
            return name
    return None

_STEP, _WARM = "make.<locals>.step (profile_models.py", "run.<locals>.warm (profile_models.py"


def classify(path: str, verbose: bool) -> None:
    tot = 0
    c: collections.Counter = collections.Counter()
    sub: dict = collections.defaultdict(collections.Counter)
    for line in open(path):
        stack, n_ = line.rstrip().rsplit(" ", 1)
        n = int(n_)
        frames = [f for f in stack.split(";") if "module_call_vectorcall" not in f]
        idx = [k for k, fr in enumerate(frames) if fr.startswith(_STEP)]
        if not idx or any(x.startswith(_WARM) for x in frames):
            continue
        fr = frames[idx[-1] + 1:]
        tot += n
        k = None
        if any("gc_collect_main" in x for x in fr):
            k = "cyclic GC (collections triggered during the step)"
        for x in ([] if k else reversed(fr)):
            k = kind(x)
            if k:
                break
        k = k or "model python + torch dispatch (not genie)"
        leaf = fr[-1] if fr else "step"
        if k == "replay" and KERNEL.search(leaf):
            k = "replay: kernels"
        if k.startswith("passes: verify") and KERNEL.search(leaf):
            k = "passes: verify, kernels"
        c[k] += n
        sub[k][re.sub(r":\d+\)", ")", leaf)] += n
    print("total samples", tot)
    for k, v in c.most_common():
        print(f"{v / tot * 100:5.1f}% {k}")
        if verbose:
            for leaf, m in sub[k].most_common(5):
                print(f"        {m / tot * 100:5.1f}% {leaf[:110]}")


def split(row: str, rounds: int) -> None:
    """Where a call's time goes, by timers rather than samples: genie's and eager's call of
    ``row`` interleaved in this process (``rounds`` pairs after four warm-up calls each), medians
    per token (generate) or step. The model's forward is timed at its outermost module's
    ``forward`` (a training step: forward and loss, backward, ``opt.step`` are the forward);
    genie's materializations at ``executor.run_targets``, split into the plan lookup
    (``plan_cache.plan``), the replay (``pipeline.run``: the device kernels included), binding
    (``executor._bind``), ``memory.after_run`` and the rest (the glue between them and the
    teardown of the nodes that ran, freed when the tape goes). ``other`` is the caller's Python
    and what it records outside the forward (a generate loop's logits processing, stopping
    criteria, ``.item()``'s path into the materialization).

    The materializations are also counted per call and told apart by size: ``small`` (tapes of
    fewer than ``SMALL`` instructions: a generate loop's stopping check, ``bool(unfinished.max()
    == 0)``, 7 instructions once per token) and ``large`` (the model's work), with the median
    time of one small materialization: a fixed cost per materialization, paid with the caches
    cold from the record before it."""
    import statistics

    import torch

    from genie import executor, memory, plan_cache
    from genie.passes import pipeline

    acc: collections.Counter = collections.Counter()

    def timed(owner: object, name: str, label: str) -> None:
        f = getattr(owner, name)

        def w(*a: object, **k: object) -> object:
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t0

        setattr(owner, name, w)

    g_step, g_model, units = make(row, "remote_accelerator")
    e_step, e_model, _ = make(row, "cpu")
    if row.startswith("mlp"):  # the training step's record: everything before loss.item()
        timed(torch.Tensor, "item", "materialize+item")
        fwd = None
    else:
        fwd = type(g_model)
        timed(fwd, "forward", "forward")
    timed(executor, "run_targets", "materialize")
    sizes: list[int] = []  # per materialization of the call: its tape's instructions
    small: list[float] = []  # µs of each small one

    def sized(f: object) -> object:
        def w(*a: object, **k: object) -> object:
            tape = f(*a, **k)
            sizes.append(len(tape.instrs))
            return tape
        return w

    run_targets = executor.run_targets

    def run_targets_sized(*a: object, **k: object) -> object:
        n, t0 = len(sizes), time.perf_counter()
        try:
            return run_targets(*a, **k)
        finally:
            if len(sizes) > n and sizes[-1] < SMALL:
                small.append((time.perf_counter() - t0) * 1e6)

    executor.run_targets = run_targets_sized
    plan_cache.plan = sized(plan_cache.plan)
    timed(plan_cache, "plan", "plan")
    timed(pipeline, "run", "replay")
    timed(executor, "_bind", "bind")
    timed(memory, "after_run", "after_run")
    timed(executor, "_read", "native read")  # lookup, fused replay and bind (csrc/read.cpp)
    for _ in range(4):
        g_step()
        e_step()
    rows: dict[str, dict[str, list[float]]] = {"genie": {}, "eager": {}}
    counts: list[tuple[int, int]] = []  # per genie call: (small, large) materializations
    small.clear()
    for i in range(rounds):
        for who, step in (("genie", g_step), ("eager", e_step))[:: 1 if i % 2 else -1]:
            acc.clear()
            sizes.clear()
            t0 = time.perf_counter()
            step()
            acc["total"] = time.perf_counter() - t0
            for k, v in acc.items():
                rows[who].setdefault(k, []).append(v / units * 1e6)
            if who == "genie":
                counts.append((sum(n < SMALL for n in sizes), sum(n >= SMALL for n in sizes)))
    med = {w: {k: statistics.median(v) for k, v in r.items()} for w, r in rows.items()}
    g, e = med["genie"], med["eager"]
    if fwd is None:  # mlp: the record is the step minus loss.item()
        g["forward"] = g["total"] - g.get("materialize+item", 0.0)
        e["forward"] = e["total"] - e.get("materialize+item", 0.0)
    mat = g.get("materialize", 0.0)
    parts = {k: g.get(k, 0.0) for k in ("plan", "replay", "bind", "after_run")}
    unit = "token" if units > 1 else "step"
    print(f"{row}: medians of {rounds} interleaved calls, µs per {unit}")
    print(f"  eager: total {e['total']:.0f} | forward {e['forward']:.0f} | other "
          f"{e['total'] - e['forward']:.0f}")
    print(f"  genie: total {g['total']:.0f} ({g['total'] / e['total']:.2f}x) | forward (record) "
          f"{g['forward']:.0f} | other {g['total'] - g['forward'] - mat:.0f} | materialize "
          f"{mat:.0f}: " + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()) +
          f", glue+teardown {mat - sum(parts.values()):.0f}")
    ns, nl = (statistics.median(c) for c in zip(*counts))
    one = statistics.median(small) if small else 0.0
    print(f"  genie materializations per call: {ns:.0f} small (< {SMALL} instructions, "
          f"{one:.0f} µs each: {ns * one / units:.0f} µs per {unit}), {nl:.0f} large")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 20)
    elif len(sys.argv) >= 3 and sys.argv[1] == "split":
        split(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 10)
    elif len(sys.argv) >= 3 and sys.argv[1] == "classify":
        classify(sys.argv[2], "-v" in sys.argv)
    else:
        sys.exit(__doc__)
