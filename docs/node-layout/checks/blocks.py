# docs/node-layout.md, Status: pymalloc blocks held per recorded op of a pending chain (intermediate tensors dead, nodes alive)
import gc, os, sys
sys.path.insert(0, os.getcwd())
import torch, genie
D = "remote_accelerator"
x = torch.randn(8, device=D); genie.materialize(x)
def chain(n):
    y = x
    for _ in range(n):
        y = torch.relu(y + 1.0)
    return y
for _ in range(3):
    genie.materialize(chain(300))  # warm: meta cache, native record, plans
res = []
for n in (1000, 2000):
    gc.collect(); b0 = sys.getallocatedblocks()
    y = chain(n)
    gc.collect(); b1 = sys.getallocatedblocks()
    res.append((b1 - b0) / (2 * n))
    genie.materialize(y); del y
print(f"{os.getcwd()}: blocks per pending op {res[0]:.2f} / {res[1]:.2f}")
