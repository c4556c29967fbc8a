"""Deterministic operation ids (seed 000), the structural fingerprint, and golden graph dumps.

Determinism is a contract: the same program yields the same ids, fingerprint and dump in any
process (checked in two fresh subprocesses with different hash seeds); a different shape or dtype
changes the fingerprint; different input values do not.

Golden dumps live in ``tests/unit/golden/``; regenerate them with ``GENIE_UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import genie
from genie import ids

DEV = "remote_accelerator"
ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"


# --- programs ------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.proj(self.norm(x)).chunk(2, dim=-1)  # a multi-output view op
        h = a * torch.sigmoid(b)
        h = h + torch.zeros_like(h)  # reads h only for its metadata
        return x + self.out(h)


def small_program(batch: int = 2, d: int = 8, dtype: torch.dtype = torch.float32,
                  seed: int = 0) -> genie.CaptureGraph:
    """A fixed program touching every kind of id: loads, uploads, factories, views, in-place."""
    torch.manual_seed(seed)
    model = nn.Sequential(Block(d), Block(d)).to(dtype=dtype).to(DEV)
    genie.annotate_phase(model[1], "decode")
    x = torch.randn(batch, d, dtype=dtype).to(DEV)  # recorded before the block: a load
    host_bias = torch.randn(d, dtype=dtype)  # a host tensor: uploaded inside the block
    with genie.capture() as g:
        noise = torch.randn(batch, d, dtype=dtype)  # a device-less factory: lazy
        with genie.phase("prefill"):
            y = model(x + noise)
        y = y + host_bias
        y.mul_(0.5)
        s = y.sum(dim=-1)
        t = s + s  # same op, same inputs, twice: add*0 and add*1
        u = s + s
        del t, u
    return g


def gpt2_program(seq: int = 8) -> genie.CaptureGraph:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval().to(DEV)
    ids_ = torch.randint(0, 100, (1, seq))
    with genie.capture() as g:
        model(ids_.to(DEV))
    return g


PROGRAMS = {"small": small_program, "gpt2": gpt2_program}


def emit(name: str) -> str:
    g = PROGRAMS[name]()
    return g.dump()


# --- ids -----------------------------------------------------------------------------------------

def test_unique_and_complex_ids_follow_seed_000():
    a = torch.ones(2, device=DEV)
    with genie.capture() as g:
        b = torch.ones(2)
        c = a + b
        d = a + b
        e = c * d
        f = b + a
    assert [n.uid for n in g.nodes] == ["op*0", "op*1", "op*2", "op*3", "op*4"]
    assert [g.complex_id(t) for t in (b, c, d, e, f)] == [
        "ones*0", "add*0|load*0|op*0", "add*1|load*0|op*0", "mul*0|op*1|op*2",
        "add*0|op*0|load*0"]
    assert [ld.id for ld in g.loads] == ["load*0"]
    assert g.loads[0].node is a._node


def test_multi_output_inputs_are_named_by_output():
    with genie.capture() as g:
        x = torch.ones(4)
        a, b = x.split(2)
        c = b + a
    assert g.complex_id(c) == "add*0|op*1:1|op*1"


def test_node_lookup_by_uid_and_errors():
    with genie.capture() as g:
        y = torch.ones(1) + 1
    assert g.node_of("op*1") is y._node
    with pytest.raises(KeyError):
        g.node_of("add*0")
    with pytest.raises(KeyError):
        g.info(torch.ones(1, device=DEV))  # recorded outside this capture


# --- fingerprint ---------------------------------------------------------------------------------

def test_same_program_same_fingerprint_and_dump_in_process():
    g1, g2 = small_program(), small_program()
    assert g1.fingerprint == g2.fingerprint
    assert g1.dump() == g2.dump()


def test_different_input_values_same_fingerprint():
    assert small_program(seed=0).fingerprint == small_program(seed=123).fingerprint


def test_different_shape_or_dtype_changes_fingerprint():
    base = small_program().fingerprint
    assert small_program(batch=3).fingerprint != base
    assert small_program(d=16).fingerprint != base
    assert small_program(dtype=torch.float64).fingerprint != base


def test_different_structure_changes_fingerprint():
    def prog(op):
        with genie.capture() as g:
            x = torch.ones(3)
            op(x)
        return g.fingerprint

    assert prog(lambda x: x + 1) == prog(lambda x: x + 1)
    assert prog(lambda x: x + 1) != prog(lambda x: x * 1)
    assert prog(lambda x: x + 1) != prog(lambda x: x + 2)  # constants are program text
    assert prog(lambda x: x + 1) != prog(lambda x: (x + 1) + 1)


def test_fingerprint_is_incremental():
    with genie.capture() as g:
        x = torch.ones(3)
        mid = g.fingerprint
        x = x * 2
        late = g.fingerprint
    with genie.capture() as h:
        x = torch.ones(3)
        x = x * 2
    assert mid != late == h.fingerprint


def _emit_in_subprocesses(names: list[str], hashseeds: list[str]) -> list[str]:
    """Run ``emit`` for ``names`` in one fresh process per hash seed (in parallel)."""
    procs = []
    for seed in hashseeds:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": seed}
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *names],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def test_same_program_in_two_processes():
    names = ["small"]
    try:
        import transformers  # noqa: F401

        names.append("gpt2")
    except ImportError:
        pass
    a, b = _emit_in_subprocesses(names, ["1", "2"])
    assert a == b
    assert a.count("# fingerprint ") == len(names)
    assert a == "".join(emit(n) for n in names)  # and the same as in this long-running process


# --- golden dumps --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["small"])
def test_golden_dump(name: str):
    text = emit(name)
    path = GOLDEN / f"capture_{name}.txt"
    if os.environ.get("GENIE_UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), (
        f"the dump of program {name!r} changed; if intended, regenerate with "
        f"GENIE_UPDATE_GOLDEN=1 pytest {Path(__file__).name}")


def test_const_text_never_shows_addresses():
    class Opaque:
        pass

    assert " at 0x" not in ids.const_text(Opaque())
    assert ids.const_text(torch.zeros(2, 3)) == "tensor:float32[2, 3]"
    assert ids.const_text(1.5) == "1.5" and ids.const_text(True) == "True"


if __name__ == "__main__":
    sys.stdout.write("".join(emit(n) for n in sys.argv[1:]))


def test_default_graph_positions_follow_from_indices_across_captures_and_gaps():
    """A default-graph node stores no position (``_seq`` None: no int per node): its uid's N
    follows from its index, through runs broken by a capture's nodes or an index taken without
    a node, and equals the count of default-graph nodes recorded before it (its uid then)."""
    from genie.graph import DEFAULT_GRAPH, _record_counter

    x = torch.ones(2, device=DEV)
    seqs, nodes = [], []
    for step in range(3):  # the first time through the Python path, then the native one
        before = len(DEFAULT_GRAPH)
        a = x * 2
        with genie.capture() as g:  # another graph's nodes take indices in between
            c = torch.ones(2) + 1
        b = a + 1
        next(_record_counter)  # an index taken without a node
        d = b * 3
        assert len(DEFAULT_GRAPH) == before + 3
        ns = [a._node, b._node, d._node]
        assert [n._seq for n in ns] == [None] * 3
        assert [n.seq for n in ns] == [before, before + 1, before + 2]
        assert [n.uid for n in ns] == [f"op*{before + k}" for k in range(3)]
        assert [n.uid for n in g.nodes] == ["op*0", "op*1"] and g.nodes[0]._seq == 0
        nodes += ns
        seqs += [n.seq for n in ns]
    assert [n.seq for n in nodes] == seqs  # (unchanged by the runs recorded after them)
    del c
