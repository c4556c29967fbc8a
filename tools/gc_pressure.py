"""Count the cyclic GC's full collections during GPT-2 decode steps or generates on genie.

Usage: ``GENIE_PLAN_CACHE=0|1 GENIE_GC_UNTRACK=0|1 .venv/bin/python tools/gc_pressure.py
decode|generate``. Prints full (generation-2) collections, GC time and wall time per step. The
collection count depends on the allocation pattern, not on machine load, so it attributes GC
pressure where timings on a shared machine cannot (docs/benchmarks.md, issue 11).
"""
import gc
import itertools
import sys
import time

import torch
import transformers

import genie
from transformers import DynamicCache
torch.set_num_threads(1)
dev = "remote_accelerator:0"; which = sys.argv[1]
def gpt2(l, w, h):
    cfg = transformers.GPT2Config(n_layer=l, n_embd=w, n_head=h, vocab_size=1000, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0); m = transformers.GPT2LMHeadModel(cfg).eval(); m.generation_config.pad_token_id = 0; return m
gct=[0.0, 0]; t0=[0]
def cb(phase, info):
    if phase == "start": t0[0] = time.perf_counter()
    else:
        gct[0] += time.perf_counter() - t0[0]
        if info["generation"] == 2: gct[1] += 1
gc.callbacks.append(cb)
if which == "decode":
    m = gpt2(12, 768, 12).to(dev); cache = DynamicCache()
    with torch.no_grad(): genie.materialize(m(torch.randint(0, 1000, (1, 64)).to(dev), cache=cache, use_cache=True).logits)
    tok = torch.randint(0, 1000, (1, 1)).to(dev)
    def step():
        with torch.no_grad(): genie.materialize(m(tok, cache=cache, use_cache=True).logits)
    n = 64; unit = "step"
else:
    g = gpt2(4, 128, 4).to(dev); L = itertools.count(8)
    def step():
        k = next(L); ids = torch.randint(1, 1000, (1, k)).to(dev)
        with torch.no_grad(): g.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False).cpu()
    n = 8; unit = "generate (32 tokens)"
step(); gct[:] = [0.0, 0]
t = time.perf_counter()
for _ in range(n): step()
t = time.perf_counter() - t
print(f"{which} GENIE_GC_UNTRACK={genie.config.config.gc_untrack:d}: {n} x {unit}: {gct[1]} full collections, {gct[0]*1e3/n:.1f} ms GC per {unit}, {t*1e3/n:.1f} ms wall per {unit}")
