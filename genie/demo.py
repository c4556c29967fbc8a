"""The main demo: a small model on ``remote_accelerator`` against eager PyTorch.

Run it with ``python -m genie.demo``. It builds an MLP, moves it to ``remote_accelerator:0``
(the embedded default: the real device is CUDA if present, else the CPU), shows that recording
computes nothing, prints the planned tape of the one value it asks for, runs it, and checks the
result against the same model run eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

import genie
from genie.device import real_device
from genie.planner import build_tape, format_tape


def main() -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x_cpu = torch.randn(32, 64)
    expected = model(x_cpu)

    genie.reset_stats()
    dev = torch.device("remote_accelerator:0")
    model = model.to(dev)                                   # parameters become lazy uploads
    x = x_cpu.to(dev)
    logits = model(x)                                       # recorded, nothing runs
    unused = (x * 2).sum()                                  # never needed: never computed
    print(f"real device behind {dev}: {real_device(0)}")
    print(f"logits: shape={tuple(logits.shape)} dtype={logits.dtype} device={logits.device}"
          "  (answered from metadata, nothing computed)")
    print(f"after recording: {genie.stats()}")

    tape = build_tape([(logits._node, logits._out)])
    print("\nwhat will run for logits.cpu():")
    print(format_tape(tape))

    out = logits.cpu()                                      # one materialization
    s = genie.stats()
    print(f"\nafter logits.cpu(): nodes_executed={s.get('nodes_executed', 0)} "
          f"materializations={s.get('materializations', 0)}")
    ok = torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
    print(f"max |genie - eager| = {(out - expected).abs().max().item():.3e}  -> "
          f"{'equal to eager' if ok else 'MISMATCH'}")
    print(f"the unused branch ran: {unused._node.executed}")
    return 0 if ok and not unused._node.executed else 1


if __name__ == "__main__":
    raise SystemExit(main())
