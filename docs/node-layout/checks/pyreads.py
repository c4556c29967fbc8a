# Steady-state Python reads of Node fields per generate call / MLP step (what properties on a
# native node would cost): each slot descriptor wrapped by a counting property after warm-up
# (the natives found their offsets by then and read by offset, uncounted).
import os, sys, collections
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "bench")
import torch
torch.set_num_threads(1)
import genie
from genie.graph import Node
import bench_models as bm
dev = torch.device("remote_accelerator:0")
cnt = collections.Counter(); who = collections.Counter()
def wrap():
    for name in Node.__slots__:
        if name == "__weakref__":
            continue
        d = Node.__dict__[name]
        def get(o, d=d, name=name):
            cnt[name] += 1
            if name in ("leaves", "op", "index"):
                fr = sys._getframe(1)
                who[f"{name} {fr.f_code.co_filename.split('/')[-1]}:{fr.f_code.co_name}:{fr.f_lineno}"] += 1
            return d.__get__(o, Node)
        def set_(o, v, d=d, name=name):
            cnt[name + "="] += 1
            d.__set__(o, v)
        setattr(Node, name, property(get, set_))
f = bm._generate_run(bm._generate_model(dev, False), dev, 8, False)
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlp_def.py")).read())
g = make("remote_accelerator:0")
for _ in range(4): f()
for _ in range(10): g()
wrap()
f(); cnt.clear(); who.clear(); f(); f()
print("generate per call:", {k: v / 2 for k, v in cnt.most_common()})
print("  by site:", [(k, v / 2) for k, v in who.most_common(6)])
cnt.clear(); who.clear()
for _ in range(10): g()
print("mlp per step:", {k: v / 10 for k, v in cnt.most_common()})
print("  by site:", [(k, v / 10) for k, v in who.most_common(6)])
