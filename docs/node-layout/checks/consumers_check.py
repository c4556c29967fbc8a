# Step 1's premise: a node's pending consumers (its consumer list) are exactly the pending readers
# of its output storages whose arguments name it. Checked on every node of every tape bound in a
# GPT-2 generate call and in MLP AdamW steps (before each bind: nodes still pending).
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "bench")
import torch
torch.set_num_threads(1)
import genie
from genie import executor
from genie.graph import Ref
import bench_models as bm
dev = torch.device("remote_accelerator:0")
stats = {"nodes": 0, "with_consumers": 0, "same": 0, "differ": 0, "count_eq_len": 0}
bad = []
orig = executor._bind
def pending(w):
    n = w()
    return n if n is not None and not n.executed else None
def check(tape, kept, upto=None, release=False):
    for n in tape.nodes:
        if n.executed:
            continue
        stats["nodes"] += 1
        a = {id(c) for w in n.consumers if (c := pending(w)) is not None}
        b = set()
        for st in n.storages:
            if st is None:
                continue
            for w in st.readers:
                r = pending(w)
                if r is not None and r.leaves and any(type(x) is Ref and x.node is n for x in r.leaves):
                    b.add(id(r))
        stats["with_consumers"] += bool(a)
        if a == b:
            stats["same"] += 1
        else:
            stats["differ"] += 1
            if len(bad) < 5:
                bad.append((n, len(a), len(b)))
    return orig(tape, kept, upto, release)
executor._bind = check
f = bm._generate_run(bm._generate_model(dev, False), dev, 8, False)
f(); f()
print("generate", stats, bad)
for k in stats: stats[k] = 0
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlp_def.py")).read())
g = make("remote_accelerator:0")
for _ in range(5): g()
print("mlp", stats, bad)
