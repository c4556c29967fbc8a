# Consumer-count distribution of the nodes bound (before bind), and in held_after's scans the
# state of each consumer met (dead / ran / pending in the run / pending outside).
import os, sys, collections
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "bench")
import torch
torch.set_num_threads(1)
import genie
from genie import executor, planner
import bench_models as bm
dev = torch.device("remote_accelerator:0")
dist = collections.Counter(); scan = collections.Counter()
ob = executor._bind
def bind(tape, kept, upto=None, release=False):
    for n in tape.nodes:
        if not n.executed:
            dist[min(len(n.consumers), 4)] += 1
    return ob(tape, kept, upto, release)
executor._bind = bind
oh = planner._has_pending_consumer
def hp(n, in_run):
    for w in n.consumers:
        c = w()
        scan["dead" if c is None else "ran" if c.executed else "in run" if c.index in in_run else "pending outside"] += 1
    return oh(n, in_run)
planner._has_pending_consumer = hp
f = bm._generate_run(bm._generate_model(dev, False), dev, 8, False)
f(); dist.clear(); scan.clear(); f(); f()
print("generate consumers per node (4 = 4+):", dict(sorted(dist.items())), "scan:", dict(scan))
dist.clear(); scan.clear()
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlp_def.py")).read())
g = make("remote_accelerator:0")
for _ in range(5): g()
dist.clear(); scan.clear()
for _ in range(10): g()
print("mlp consumers per node:", dict(sorted(dist.items())), "scan:", dict(scan))
