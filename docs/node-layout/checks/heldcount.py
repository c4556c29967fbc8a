# How often the consumer scan (planner._has_pending_consumer, reached from match's held_after)
# runs per call, and how long the consumer list and the readers scan that would replace it are.
import os, sys, collections
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "bench")
import torch
torch.set_num_threads(1)
import genie
from genie import planner
import bench_models as bm
dev = torch.device("remote_accelerator:0")
c = collections.Counter()
orig = planner._has_pending_consumer
def counted(n, in_run):
    c["calls"] += 1
    c["consumers"] += len(n.consumers)
    c["readers"] += sum(len(st.readers) for st in n.storages if st is not None)
    return orig(n, in_run)
planner._has_pending_consumer = counted
f = bm._generate_run(bm._generate_model(dev, False), dev, 8, False)
f(); c.clear(); f(); f()
print("generate, per call:", {k: v / 2 for k, v in c.items()})
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlp_def.py")).read())
g = make("remote_accelerator:0")
for _ in range(5): g()
c.clear()
for _ in range(10): g()
print("mlp, per step:", {k: v / 10 for k, v in c.items()})
