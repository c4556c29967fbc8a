# Thread CPU in planner.build_tape and in its held_after loop, per generate call (no mask).
import os, sys, time, collections
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "bench")
import torch
torch.set_num_threads(1)
import genie
from genie import planner
import bench_models as bm
dev = torch.device("remote_accelerator:0")
t = collections.Counter()
ob = planner.build_tape
def bt(*a, **k):
    s = time.thread_time_ns(); r = ob(*a, **k); t["build_tape"] += time.thread_time_ns() - s; t["calls"] += 1
    t["nodes"] += len(r.nodes) if hasattr(r, "nodes") else 0
    return r
oh = planner.held_after
def ha(*a):
    s = time.thread_time_ns(); r = oh(*a); t["held_after"] += time.thread_time_ns() - s; t["ha_calls"] += 1; return r
planner.held_after = ha
import genie.plan_cache as pc, genie.executor as ex
for mod in (pc, ex):
    if getattr(mod, "build_tape", None) is ob: mod.build_tape = bt
planner.build_tape = bt
f = bm._generate_run(bm._generate_model(dev, False), dev, 8, False)
f(); f()
for r in range(3):
    t.clear(); s = time.thread_time_ns(); f(); tot = time.thread_time_ns() - s
    print(f"call {tot/1e6:.1f} ms thread CPU; build_tape {t['build_tape']/1e6:.2f} ms in {t['calls']} calls ({t['nodes']} nodes), held_after {t['held_after']/1e6:.2f} ms in {t['ha_calls']} calls")
