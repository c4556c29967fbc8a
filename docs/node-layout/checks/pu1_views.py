"""Thread CPU per call of a view, view chains and adds on natively made LazyTensors (median of 5 x
4,000 calls); run with GENIE_KEY_FREE=0 and 1 (docs/node-layout.md
section 7, step 4). The first line printed is the wrapper's dispatch keys."""
import torch, genie, time, sys, os
torch.set_num_threads(1)
x = torch.randn(8, 16).to("remote_accelerator") + 0
for _ in range(5): y = x + 1
print(torch._C._dispatch_keys(x + 1))
def bench(f, n=20000):
    for _ in range(500): f()
    ts=[]
    for r in range(5):
        t0=time.thread_time_ns()
        for _ in range(n//5): f()
        ts.append((time.thread_time_ns()-t0)/(n//5))
    return sorted(ts)[2]
y = x + 1
for name, f in (("view", lambda: y.view(-1)), ("view.t", lambda: y.view(16, 8).t()), ("view.t.unsq", lambda: y.view(16,8).t().unsqueeze(0)), ("add", lambda: y + y), ("add_chain", lambda: ((y + 1) * 2) - y)):
    print("%-12s %7.0f ns" % (name, bench(f)))
