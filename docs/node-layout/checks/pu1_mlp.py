"""MLP 4x256 AdamW step, eager and Genie alternating in one process: 20 losses compared, then
genie / eager (thread CPU, median of 30 rounds of 20 steps). Run it with GENIE_KEY_FREE=0
and 1 (docs/node-layout.md section 7, step 4)."""
import os, time, torch, genie
torch.set_num_threads(1)
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlp_def.py")).read())
se = make("cpu"); sg = make("remote_accelerator")
le = [se() for _ in range(20)]; lg = [sg() for _ in range(20)]
print("losses equal", le == lg, le[-1], lg[-1])
te, tg = [], []
for r in range(30):
    t0 = time.thread_time(); [se() for _ in range(20)]; te.append(time.thread_time() - t0)
    t0 = time.thread_time(); [sg() for _ in range(20)]; tg.append(time.thread_time() - t0)
te.sort(); tg.sort()
print("key-free" if os.environ.get("GENIE_KEY_FREE", "1") != "0" else "python-key", "eager %.3f genie %.3f ratio %.3f" % (
    te[15] / 20 * 1e3, tg[15] / 20 * 1e3, tg[15] / te[15]))
