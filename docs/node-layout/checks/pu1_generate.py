"""GPT-2 4x128 greedy generate (32 tokens, a new prompt length each call, no attention_mask), eager
and Genie alternating in one process: tokens compared, genie / eager (thread CPU, median of 10);
run with GENIE_KEY_FREE=0 and 1 (docs/node-layout.md section 7,
step 4)."""
import sys, time, itertools, torch, genie, os
torch.set_num_threads(1)
from transformers import GPT2Config, GPT2LMHeadModel
import transformers; transformers.logging.set_verbosity_error()
cfg = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=1024, attn_implementation="eager")
torch.manual_seed(0)
m_e = GPT2LMHeadModel(cfg).eval()
m_g = GPT2LMHeadModel(cfg).eval().to("remote_accelerator"); m_g.load_state_dict(m_e.state_dict())
lengths = itertools.count(8)
def run(model, dev):
    n = next(lengths)
    ids = torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n)).to(dev)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    return out.cpu()
for _ in range(4): a=run(m_e, "cpu"); b=run(m_g, "remote_accelerator")
te, tg = [], []; same=True
for r in range(10):
    t0 = time.thread_time(); a=run(m_e, "cpu"); te.append(time.thread_time() - t0)
    lengths = itertools.count(next(lengths)-1)
    t0 = time.thread_time(); b=run(m_g, "remote_accelerator"); tg.append(time.thread_time() - t0)
    same = same and torch.equal(a, b)
te.sort(); tg.sort()
print("key-free" if os.environ.get("GENIE_KEY_FREE", "1") != "0" else "python-key", "eager %.2f ms genie %.2f ms ratio %.3f same %s" % (te[5]*1e3, tg[5]*1e3, tg[5]/te[5], same))
