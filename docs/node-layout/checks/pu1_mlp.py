import sys, os, time, torch, genie
torch.set_num_threads(1)
def build(dev):
    torch.manual_seed(0)
    layers = []
    for _ in range(4): layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(dev)
    torch.manual_seed(1)
    x = torch.randn(32, 256).to(dev); t = torch.randn(32, 256).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), t)
        loss.backward(); opt.step()
        return loss.item()
    return step
se=build("cpu"); sg=build("remote_accelerator")
le=[se() for _ in range(20)]; lg=[sg() for _ in range(20)]
print("losses equal", le==lg, le[-1], lg[-1])
te,tg=[],[]
for r in range(30):
    t0=time.thread_time(); [se() for _ in range(20)]; te.append(time.thread_time()-t0)
    t0=time.thread_time(); [sg() for _ in range(20)]; tg.append(time.thread_time()-t0)
te.sort(); tg.sort()
print(os.environ.get("GENIE_SPIKE_PU1","base"), "eager %.3f genie %.3f ratio %.3f"%(te[15]/20*1e3, tg[15]/20*1e3, tg[15]/te[15]))
