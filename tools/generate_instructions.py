"""Instructions per generated token of bench_models.py's generate row, counted by callgrind.

Usage::

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=PyRun_SimpleStringFlags \\
        --callgrind-out-file=/tmp/gen.out .venv/bin/python tools/generate_instructions.py genie
    callgrind_annotate /tmp/gen.out | grep "PROGRAM TOTALS"

MODE: ``genie`` (the model on ``remote_accelerator``) or ``eager`` (on the CPU). The model and
call are :mod:`generate_cpu`'s (GPT-2 4 x 128, greedy ``generate`` of 32 tokens); three calls
(prompt lengths 8, 9, 10) warm every cache first, outside the count; only one call, with a prompt
length of 11, runs inside ``PyRun_SimpleString``, the one function callgrind collects in. Divide
the total by 32 for instructions per token. Immune to the machine's load, unlike
:mod:`generate_cpu`'s CPU times; a run takes ~8 minutes (torch's and transformers' imports under
valgrind). ``callgrind_annotate --inclusive=yes`` then splits genie's count: ``Program::run``
(the replay), ``match_core`` (plan lookup), ``bind_nodes``, ``record_hit`` (the native record),
``pythonFallback`` (torch's dispatch into ``__torch_dispatch__``).
"""
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import generate_cpu as g  # noqa: E402

torch.set_num_threads(1)
mode = sys.argv[1] if len(sys.argv) > 1 else "genie"
if mode not in ("genie", "eager"):
    raise SystemExit(f"generate_instructions.py: MODE is 'genie' or 'eager', got {mode!r}")
dev = g.DEV if mode == "genie" else "cpu"
model = g.gpt2().to(dev)
for n in (8, 9, 10):  # caches, the plan cache, the allocator
    g.generate(model, dev, n)
MEASURED = lambda: g.generate(model, dev, 11)  # noqa: E731
ctypes.pythonapi.PyRun_SimpleString(b"import __main__\n__main__.MEASURED()")
