"""Cost of the server's index checks (genie.index_check) on a GPT-2-like greedy decode.

Two loopback servers on one device, ``--index-check 1`` and ``--index-check 0``; the same
``model.generate`` (random GPT-2 weights: 4 layers, 4 heads, width 128, vocab 1000; 8-token prompt,
32 new tokens) through each, alternating, ``ROUNDS`` times; prints the median time per token
after the first and the index checks and syncs per decode step (``genie.stats()``). Tokens must
equal eager's. No assertion on time: a figure to quote, with the machine it ran on.

    PYTHONPATH=. python bench/index_check_cost.py            # cpu (cuda:0 if present)
    PYTHONPATH=. python bench/index_check_cost.py --device cpu --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import genie

ROOT = Path(__file__).resolve().parents[1]
CLOCK = [time.perf_counter]
DEV = "remote_accelerator:0"


def _server(device: str, check: str, keys: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GENIE_LOG_LEVEL": "WARNING"}
    env.pop("GENIE_SERVER", None)
    p = subprocess.Popen([sys.executable, "-m", "genie.remote.server", "--device", device,
                          "--listen", "127.0.0.1:0", "--insecure", "--index-check", check,
                          "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env, cwd=keys)
    for _ in range(200):
        line = p.stdout.readline()
        m = re.search(r"tcp://[\d.]+:\d+", line)
        if m:
            return p, m.group(0)
    p.kill()
    raise RuntimeError(f"genie-server did not start: {line!r}")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux ``/proc``), insensitive to others' load."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _decode(model: torch.nn.Module, ids: torch.Tensor, tokens: int) -> tuple[float, dict]:
    """Seconds per token after the first, and the counters of the decode steps. The clock is
    ``CLOCK``: wall time, or this thread's CPU time (in process: insensitive to other processes'
    load on a shared machine)."""
    stamps: list[float] = []

    class Stamp:  # a logits processor: called once per generated token, changes nothing
        def __call__(self, input_ids, scores):  # noqa: ANN001, ANN204
            stamps.append(CLOCK[0]())
            return scores

    from transformers import LogitsProcessorList

    out = model.generate(ids.to(DEV), max_new_tokens=tokens, do_sample=False, pad_token_id=0,
                         logits_processor=LogitsProcessorList([Stamp()])).cpu()
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), {"out": out, **genie.stats()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--in-process", action="store_true",
                   help="the embedded executor instead of servers: GENIE_INDEX_CHECK on and off, "
                   "both in the interpreter (run with GENIE_NATIVE_REPLAY=0 GENIE_CODEGEN=0); "
                   "times are this thread's CPU time")
    a = p.parse_args()
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=1000,
                                  n_positions=256, bos_token_id=0, eos_token_id=999)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(1, 999, (1, 8))
    ref = model.generate(ids, max_new_tokens=a.tokens, do_sample=False, pad_token_id=0)
    if a.in_process:
        CLOCK[0] = time.thread_time  # CPU time of this thread: the whole decode runs on it
        _report(a, *_in_process(a, model, ids, ref))
        return
    with tempfile.TemporaryDirectory() as keys:
        servers = {c: _server(a.device, c, keys) for c in ("1", "0")}
        times: dict[str, list[float]] = {"1": [], "0": []}
        counts: dict[str, dict] = {}
        cpu = {"1": 0.0, "0": 0.0}  # the servers' CPU seconds over the timed rounds
        try:
            for r in range(a.rounds + 1):  # the first round warms both servers up
                for c, (_, addr) in servers.items():
                    genie.connect(addr, insecure=True, timeout=60)
                    m = copy.deepcopy(model).to(DEV)
                    genie.reset_stats()
                    c0 = _cpu_seconds(servers[c][0].pid)
                    dt, s = _decode(m, ids, a.tokens)
                    c1 = _cpu_seconds(servers[c][0].pid)
                    del m
                    genie.disconnect()
                    if r:
                        cpu[c] += c1 - c0
                    assert torch.equal(s.pop("out"), ref), "tokens differ from eager's"
                    if r:
                        times[c].append(dt)
                        counts[c] = s
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait()
    _report(a, times, counts)
    per = {c: v / (a.rounds * a.tokens) for c, v in cpu.items()}
    print(f"server CPU time per token (whole generate, /proc, {a.rounds} rounds): check off "
          f"{per['0'] * 1e3:.2f} ms, check on {per['1'] * 1e3:.2f} ms: "
          f"{(per['1'] - per['0']) * 1e6:+.0f} us")


def _in_process(a: argparse.Namespace, model: torch.nn.Module, ids: torch.Tensor,
                ref: torch.Tensor) -> tuple[dict, dict]:
    from genie.config import config

    m = copy.deepcopy(model).to(DEV)
    times: dict[str, list[float]] = {"1": [], "0": []}
    counts: dict[str, dict] = {}
    for r in range(a.rounds + 1):
        for c in ("1", "0"):
            config.index_check = c
            genie.reset_stats()
            dt, s = _decode(m, ids, a.tokens)
            assert torch.equal(s.pop("out"), ref), "tokens differ from eager's"
            if r:
                times[c].append(dt)
                counts[c] = {k.replace("index_check", "server_index_check"): v
                             for k, v in s.items()}
    config.index_check = "0"
    return times, counts


def _report(a: argparse.Namespace, times: dict, counts: dict) -> None:
    for c, name in (("0", "check off"), ("1", "check on")):
        s = counts[c]
        print(f"{name:9}: {statistics.median(times[c]) * 1e3:7.2f} ms/token median, "
              f"{min(times[c]) * 1e3:7.2f} min ({a.rounds} rounds; all: "
              f"{', '.join(f'{t * 1e3:.2f}' for t in times[c])}); one generate of {a.tokens} "
              f"tokens: {s.get('materializations', 0)} materializations, "
              f"{s.get('server_index_checks', 0)} index tensors "
              f"checked, {s.get('server_index_check_syncs', 0)} syncs")
    on, off = statistics.median(times["1"]), statistics.median(times["0"])
    lo_on, lo_off = min(times["1"]), min(times["0"])
    print(f"device {a.device}: the check adds {(on - off) * 1e6:.0f} us per token by medians "
          f"({(on / off - 1) * 100:+.1f}%), {(lo_on - lo_off) * 1e6:.0f} us by minima "
          f"({(lo_on / lo_off - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
