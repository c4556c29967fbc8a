"""torch.compile through a Genie server on loopback (issue 30): a compiled graph goes to the
server once, as data (ATen ops its opset admits), and later calls send only inputs.

Values are compared with eager on the CPU. The server compiles graphs with ``aot_eager`` here
(``GENIE_COMPILER``; Inductor's C++ builds take minutes on a loaded CI machine).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

import genie
from genie import graphs
from genie.backends import compiled as compiled_backend
from genie.remote import ProtocolError

pytest.importorskip("zmq")
sys.path.insert(0, str(Path(__file__).parent))
from test_remote import ServerProc  # noqa: E402

DEV = "remote_accelerator:0"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    before = os.environ.get("GENIE_COMPILER")
    os.environ["GENIE_COMPILER"] = "aot_eager"
    try:
        s = ServerProc(tmp_path_factory.mktemp("genie-keys"), "--quota", "64MiB")
    finally:
        if before is None:
            os.environ.pop("GENIE_COMPILER")
        else:
            os.environ["GENIE_COMPILER"] = before
    yield s
    assert s.stop() == 0


@pytest.fixture
def remote(server: ServerProc):
    compiled = compiled_backend.compiler()
    compiled_backend.set_compiler("aot_eager")
    torch._dynamo.reset()
    genie.connect(server.address, key_file=str(server.key_file), timeout=60)
    yield server
    genie.disconnect()
    compiled_backend.set_compiler(compiled)


def test_compiled_training_sends_each_graph_once(remote) -> None:
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                              torch.nn.Linear(16, 1))
    lazy = copy.deepcopy(ref).to(DEV)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_l = torch.optim.AdamW(lazy.parameters(), lr=1e-2)

    def step(m, opt, x, y):
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    cstep = torch.compile(step)
    sent = []
    for _ in range(6):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        want = step(ref, opt_r, x, y).item()
        got = cstep(lazy, opt_l, x.to(DEV), y.to(DEV)).item()
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        sent.append(genie.stats().get("graphs_sent", 0))
    for a, b in zip(ref.parameters(), lazy.parameters(), strict=True):
        torch.testing.assert_close(b.cpu(), a.detach())
    s = genie.stats()
    assert s["graph_calls"] == 18 and s["round_trips"] > 0
    # forward, backward, step: each sent once (the loss of step 1 needs only the forward)
    assert sent == [1, 3, 3, 3, 3, 3], sent


def test_graph_with_an_op_outside_the_servers_opset_is_refused(remote) -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten._reshape_alias.default, (x, [4], [1]))
    g.output([y])
    for n in (x, y):  # device values (what Dynamo's fake run records)
        n.meta["val"] = torch.empty(4, device="meta")
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    data, kinds = graphs.encode(gm, [torch.empty(4)])
    key = graphs.register(data, kinds).key
    xd = torch.arange(4.0).to(DEV)
    out = torch.ops.genie.graph(key, [xd], [])[0]  # records (meta runs locally), sends nothing
    with pytest.raises(ProtocolError, match=r"refused: .*_reshape_alias.*does not run on a "
                                            r"Genie server"):
        out.cpu()
    assert (xd * 2).sum().item() == 12.0  # the session goes on
