"""Instructions per op of bench_models.py's chain rows, counted by callgrind (immune to load).

Usage::

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=PyRun_SimpleStringFlags \\
        --callgrind-out-file=/tmp/cg.out .venv/bin/python tools/chain_instructions.py ROW
    callgrind_annotate --inclusive=yes /tmp/cg.out | head -60

ROW: ``record`` (record a 2,000-op elementwise chain and drop it, as the record row times it),
``keep`` (record only: the graphs stay alive), ``warm`` (record + materialize the already-seen
chain) or ``floor`` (the same chain on a ``__torch_dispatch__`` subclass that records nothing).
Everything is warmed first, outside the count; only the ``REPS`` (default 2) calls measured run
inside ``PyRun_SimpleString``, the one function callgrind collects in. Divide the total by
``REPS * 2000`` for instructions per op; ``record - keep`` is the teardown. A run takes ~2
minutes (torch's import under valgrind). Figures: docs/benchmarks.md, issue 11.
"""
import ctypes
import os
import sys

import torch

import genie

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from bench_models import _DispatchFloor as Floor  # noqa: E402  (the chain row's floor)
from conftest import elementwise_chain  # noqa: E402

N = 2000
torch.set_num_threads(1)

x = torch.randn(4, 4).to("remote_accelerator:0")
genie.materialize(x)
floor = Floor(torch.randn(4, 4))
kept = []
rows = {
    "record": lambda: elementwise_chain(x, N),
    "keep": lambda: kept.append(elementwise_chain(x, N)),
    "warm": lambda: genie.materialize(elementwise_chain(x, N)),
    "floor": lambda: elementwise_chain(floor, N),
}
for _ in range(3):  # caches, the plan cache, the allocator
    for name in ("record", "warm", "floor"):
        rows[name]()
MEASURED = rows[sys.argv[1]]
reps = int(os.environ.get("REPS", "2"))
ctypes.pythonapi.PyRun_SimpleString(
    f"import __main__\nfor _ in range({reps}): __main__.MEASURED()".encode())
