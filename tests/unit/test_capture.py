"""genie.capture(): the block, semantic metadata (module paths, phases, roles, categories), exports.

Eager is the oracle for ``to_fx``: the exported GraphModule, run on the CPU, must equal the eager
model. Coverage figures (module paths on compute nodes) are asserted with the issue's threshold.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn

import genie
from genie import semantics
from genie.capture import CaptureError, thread_state
from genie.lazy_tensor import LazyTensor
from genie.lazy_tensor import _tls as graph_tls

DEV = "remote_accelerator"


def _hooks_installed() -> bool:
    """Whether a capture's module hooks are still installed, or any trace of them that makes
    ``torch.compile(module)`` warn of global hooks (genie.context's default path installs none:
    it wraps ``nn.Module.__call__``)."""
    from torch.nn.modules import module as m

    return bool(m._has_any_global_hook())


# --- the block ---------------------------------------------------------------------------------

def test_factories_without_device_are_lazy_and_recorded():
    with genie.capture() as g:
        x = torch.randn(8, 16)
        y = torch.tensor([1.0, 2.0])
        z = torch.arange(4)
    for t in (x, y, z):
        assert isinstance(t, LazyTensor) and t.device == torch.device(DEV, 0)
    assert [n.uid for n in g.nodes] == ["op*0", "op*1", "op*2"]
    assert g.complex_id(x) == "randn*0" and g.complex_id(z) == "arange*0"
    assert z.tolist() == [0, 1, 2, 3]


def test_device_index_is_configurable_and_checked():
    with genie.capture(device=0) as g:
        x = torch.zeros(2)
    assert x.device == torch.device(DEV, 0) and g.index == 0
    with pytest.raises(genie.DeviceError, match="does not exist"):
        with genie.capture(device=99):
            pass


def test_leaving_the_block_executes_nothing():
    a = torch.ones(3).to(DEV)
    genie.materialize(a)
    genie.reset_stats()
    with genie.capture() as g:
        b = (a * 2 + torch.ones(3)).relu().sum()
    s = genie.stats()
    assert s.get("materializations", 0) == 0 and s.get("nodes_executed", 0) == 0
    assert len(g.nodes) == 5
    assert b.item() == 9.0


def test_exception_pops_the_mode_and_restores_state():
    with pytest.raises(ValueError):
        with genie.capture():
            torch.ones(2)
            with genie.phase("p"):
                raise ValueError("boom")
    assert torch.ones(2).device.type == "cpu"
    assert not graph_tls.graphs and not thread_state().captures
    assert thread_state().scope is semantics.TOP
    assert not _hooks_installed()


def test_exception_inside_module_forward_pops_module_scope():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("inside forward")

    with pytest.raises(RuntimeError, match="inside forward"):
        with genie.capture():
            nn.Sequential(nn.Identity(), Boom())(torch.ones(1))
    assert thread_state().stack == [] and thread_state().scope is semantics.TOP


def test_nested_blocks_record_into_the_innermost():
    with genie.capture() as outer:
        a = torch.ones(2)
        with genie.capture() as inner:
            b = a + 1
        c = b * 3
    assert [n.op for n in inner.nodes] == [torch.ops.aten.add.Tensor]
    assert inner.complex_id(b) == "add*0|load*0"
    assert [ld.id for ld in inner.loads] == ["load*0"]
    assert outer.complex_id(c) == "mul*0|load*0"
    assert len(outer.nodes) == 2
    assert c.tolist() == [6.0, 6.0]


def test_capture_is_per_thread():
    seen: dict[str, object] = {}
    started, release = threading.Event(), threading.Event()

    def other() -> None:
        started.wait()
        seen["factory"] = torch.ones(2).device.type  # no capture on this thread: a CPU tensor
        x = torch.ones(2, device=DEV)
        seen["graph"] = x._node.graph
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with genie.capture() as g:
        started.set()
        release.wait(10)
        y = torch.ones(2)
    t.join()
    assert seen["factory"] == "cpu"
    assert seen["graph"] is not g.recorder
    assert len(g.nodes) == 1 and g.owns(y._node)


def test_captures_in_two_threads_are_independent():
    results: dict[int, str] = {}

    def work(i: int) -> None:
        with genie.capture() as g:
            x = torch.ones(4 + i)
            for _ in range(50):
                x = x * 1.5
        results[i] = g.fingerprint

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    with genie.capture() as g:
        x = torch.ones(4)
        for _ in range(50):
            x = x * 1.5
    assert results[0] == g.fingerprint != results[1]


# --- host tensors created outside the block ------------------------------------------------------

def test_host_tensor_mixed_with_lazy_is_uploaded_once():
    host = torch.randn(4)
    with genie.capture() as g:
        a = torch.ones(4)
        b = a + host
        c = b * host
    ops = [str(n.op) for n in g.nodes]
    assert ops.count("genie.upload") == 1
    torch.testing.assert_close(c.cpu(), (1 + host) * host)


def test_host_tensor_modified_between_uses_is_uploaded_again():
    host = torch.zeros(2)
    with genie.capture() as g:
        a = torch.ones(2) + host
        host.add_(5)  # host-only op: runs eagerly on the host
        b = torch.ones(2) + host
    assert [str(n.op) for n in g.nodes].count("genie.upload") == 2
    assert a.tolist() == [1.0, 1.0] and b.tolist() == [6.0, 6.0]


def test_host_only_ops_run_eagerly_and_printing_works(capsys):
    host = torch.arange(3.0)
    with genie.capture() as g:
        h2 = host * 2
        x = torch.ones(2)
        print(x)
    assert type(h2) is torch.Tensor and h2.tolist() == [0.0, 2.0, 4.0]
    assert "remote_accelerator" in capsys.readouterr().out
    assert len(g.nodes) == 1


def test_writing_a_host_tensor_with_device_values_raises():
    host = torch.zeros(3)
    with genie.capture():
        x = torch.ones(3)
        with pytest.raises(CaptureError, match="write into a host tensor"):
            host.add_(x)


def test_writing_a_host_tensor_with_literals_of_the_block_runs_on_the_host():
    """``torch.tensor(data)`` is a literal of the block: an op writing a host tensor with only
    literals as device operands stays on the host, as eagerly (foreach optimizers increment their
    CPU step counters with ``_foreach_add_(steps, torch.tensor(1.0, device="cpu"))``)."""
    steps = [torch.zeros(()), torch.ones(())]
    with genie.capture() as g:
        one = torch.tensor(1.0, device="cpu")
        torch._foreach_add_(steps, one, alpha=2.0)
        y = one * 3  # still a literal of the graph
    assert type(one) is genie.LazyTensor
    assert all(type(t) is torch.Tensor for t in steps) and [t.item() for t in steps] == [2.0, 3.0]
    assert y.item() == 3.0 and [str(n.op) for n in g.nodes] == ["genie.upload", "aten.mul.Tensor"]


def test_host_model_weights_are_uploaded_as_parameters():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with genie.capture() as g:
        y = lin(x.to(DEV))
    torch.testing.assert_close(y.cpu(), lin(x))
    uploads = [g.info(n) for n in g.nodes if str(n.op) == "genie.upload"]
    assert sorted((i.role, i.names[0]) for i in uploads) == [
        ("input", None), ("parameter", "bias"), ("parameter", "weight")]


def test_inplace_on_lazy_from_outside_is_recorded_against_a_load():
    a = torch.zeros(3, device=DEV)
    with genie.capture() as g:
        a.add_(1)
    assert g.complex_id(g.nodes[0]) == "add_*0|load*0"
    assert a.tolist() == [1.0, 1.0, 1.0]


# --- semantic metadata -------------------------------------------------------------------------

def _gpt2(n_layer: int = 2):
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=n_layer, n_head=2, n_embd=32, vocab_size=100,
                                  n_positions=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def module_path_coverage(g: genie.CaptureGraph) -> tuple[float, float]:
    """Share of compute nodes with an issuing module, and with a non-root module path."""
    comp = [i for i in g.infos() if i.category in semantics.COMPUTE_CATEGORIES]
    with_module = sum(i.module_class is not None for i in comp) / len(comp)
    with_path = sum(bool(i.module) for i in comp) / len(comp)
    return with_module, with_path


def test_gpt2_forward_module_paths_cover_compute_nodes():
    model = _gpt2().to(DEV)
    ids = torch.randint(0, 100, (1, 8))
    with genie.capture() as g:
        out = model(ids.to(DEV))
    with_module, with_path = module_path_coverage(g)
    assert with_module >= 0.95 and with_path >= 0.95, (with_module, with_path)
    paths = {i.module for i in g.infos()}
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"} <= paths
    c_attn = next(i for i in g.infos() if i.module == "transformer.h.0.attn.c_attn"
                  and i.category == "matmul")
    assert c_attn.module_class == "Conv1D" and c_attn.flops == 2 * 8 * 32 * 96
    roles = {g.load_role(ld) for ld in g.loads}
    assert ("parameter", "transformer.h.0.attn.c_attn.weight") in roles
    assert g.info(out.logits).role == "activation"


def test_gpt2_generate_tags_kv_cache():
    model = _gpt2()
    ids = torch.randint(1, 100, (1, 5))
    ref = model.generate(ids, max_new_tokens=3, do_sample=False)
    md = copy.deepcopy(model).to(DEV)
    with genie.capture() as g:
        out = md.generate(ids.to(DEV), max_new_tokens=3, do_sample=False)
    assert out.tolist() == ref.tolist()
    kv = [i for i in g.infos() if "kv_cache" in i.roles]
    cats = [i for i in kv if i.op == "aten.cat.default"]
    assert len(cats) == 3 * 2 * 2  # steps x layers x (keys, values)
    assert all(i.module.endswith(".attn") for i in kv)


def test_gpt2_decode_step_tags_incoming_and_updated_cache():
    md = _gpt2().to(DEV)
    ids = torch.randint(1, 100, (1, 5)).to(DEV)
    first = md(ids, use_cache=True)
    nxt = first.logits[:, -1:].argmax(-1)
    with genie.capture() as g:
        md(nxt, past_key_values=first.past_key_values, use_cache=True)
    loads = [g.load_role(ld)[0] for ld in g.loads]
    assert loads.count("kv_cache") == 2 * 2  # the previous step's keys and values, per layer
    assert sum(i.op == "aten.cat.default" and i.role == "kv_cache" for i in g.infos()) == 4


def test_phase_and_annotate_phase():
    enc = nn.Linear(4, 4).to(DEV)
    dec = genie.annotate_phase(nn.Linear(4, 4).to(DEV), "decode")
    with genie.capture() as g:
        x = torch.ones(1, 4)
        with genie.phase("prefill"):
            h = enc(x)
            y = dec(h)
            z = y + 1
    assert g.info(h).phase == "prefill"
    assert g.info(y).phase == "decode"
    assert g.info(z).phase == "prefill"
    assert g.info(x).phase is None
    genie.annotate_phase(dec, None)
    with genie.capture() as g2:
        y2 = dec(torch.ones(1, 4))
    assert g2.info(y2).phase is None
    with pytest.raises(TypeError):
        genie.annotate_phase(object(), "x")  # type: ignore[arg-type]


def test_training_step_roles_regions():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).to(DEV)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(5, 4).to(DEV)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    with genie.capture() as g:
        loss = model(x).pow(2).mean()
        loss.backward()  # recorded on the autograd engine's device thread, into this graph
        opt.step()
    infos = g.infos()
    regions = {i.region for i in infos}
    assert regions == {"forward", "backward", "optimizer"}
    assert all(i.role == "gradient" for i in infos if i.region == "backward"
               and i.category != "view")
    load_roles = {g.load_role(ld)[0] for ld in g.loads}
    assert {"parameter", "buffer", "optimizer_state", "input"} <= load_roles
    assert g.info(model[0].weight.grad).role == "gradient"


def test_categories_flops_bytes():
    a = torch.randn(8, 16, device=DEV)
    b = torch.randn(16, 4, device=DEV)
    with genie.capture() as g:
        c = a @ b
        d = c.relu()
        e = d.sum()
        f = d.t()
        w = torch.randn(2, 3, 3, 3)
        img = torch.randn(1, 3, 8, 8)
        k = torch.nn.functional.conv2d(img, w)
    cats = {t: g.info(t) for t in (c, d, e, f, k)}
    assert cats[c].category == "matmul" and cats[c].flops == 2 * 8 * 16 * 4
    assert cats[c].bytes == (8 * 16 + 16 * 4 + 8 * 4) * 4
    assert cats[d].category == "elementwise" and cats[d].flops == 32
    assert cats[e].category == "reduction"
    assert cats[f].category == "view" and cats[f].bytes == 0
    assert cats[k].category == "conv" and cats[k].flops == 2 * (2 * 6 * 6) * (3 * 3 * 3)


def test_metadata_off_still_gives_ids():
    with genie.capture(metadata=False) as g:
        y = nn.Linear(2, 2).to(DEV)(torch.ones(1, 2))
        assert not _hooks_installed()
    info = g.info(y)
    assert info.module is None and info.complex_id.startswith("addmm*0|")


# --- export --------------------------------------------------------------------------------------

def _fx_equals_eager(model: nn.Module, *inputs: torch.Tensor, out=lambda o: o, grad=False):
    model = model.eval()
    with torch.set_grad_enabled(grad):
        ref = out(model(*inputs))
    md = copy.deepcopy(model).to(DEV)
    with torch.set_grad_enabled(grad), genie.capture() as g:
        res = out(md(*[t.to(DEV) for t in inputs]))
    gm = g.to_fx(res)
    got = gm(*g.example_inputs())
    torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    return g, gm


def test_to_fx_mlp():
    torch.manual_seed(0)
    g, gm = _fx_equals_eager(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16),
                                           nn.Linear(16, 4)), torch.randn(3, 8))
    assert isinstance(gm, torch.fx.GraphModule)
    assert [n.op for n in gm.graph.nodes].count("placeholder") == 1


def test_to_fx_cnn():
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Conv2d(8, 4, 3), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(4, 10))
    _fx_equals_eager(cnn, torch.randn(2, 3, 12, 12))


@pytest.mark.parametrize("grad", [False, True], ids=["fastpath", "grad"])
def test_to_fx_transformer_encoder(grad: bool):
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                enable_nested_tensor=False)
    _fx_equals_eager(enc, torch.randn(2, 5, 16), grad=grad)


def test_an_op_without_a_meta_kernel_runs_at_once_in_a_capture_and_exports_its_value():
    """An op with no meta kernel (``geqrf``; torch 2.11's ``_transformer_encoder_layer_fwd``,
    which ``nn.TransformerEncoder``'s inference fast path calls) runs when called, in a capture
    too: its value joins the capture's graph (with no arguments) and the FX export holds it."""
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::geqrf", "Meta"):
        pytest.skip("this torch has a meta kernel for geqrf: nothing runs at once")
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    real = genie.device.real_device(0)  # eager on the real device's kernels: bit-equal
    want = (torch.geqrf(x.to(real))[0] * 2).cpu()
    genie.reset_stats()
    with genie.capture() as g:
        a, _ = torch.geqrf(x.to(DEV))
        y = a * 2
    assert genie.stats().get("materializations.no_meta_kernel") == 1
    torch.testing.assert_close(y.cpu(), want, rtol=0, atol=0)
    torch.testing.assert_close(g.to_fx(y)(*g.example_inputs()), want, rtol=0, atol=0)


def test_to_fx_lstm():
    torch.manual_seed(0)
    _fx_equals_eager(nn.LSTM(8, 16, batch_first=True), torch.randn(2, 5, 8), out=lambda o: o[0])


def test_to_fx_gpt2_forward():
    model = _gpt2()
    g, gm = _fx_equals_eager(model, torch.randint(0, 100, (2, 8)), out=lambda o: o.logits)
    assert any(n.op == "get_attr" and "c_attn" in n.target for n in gm.graph.nodes)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_to_fx_transformers_models(arch: str):
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    if arch == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            vocab_size=100, max_position_embeddings=64))
        out = lambda o: o.last_hidden_state  # noqa: E731
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=100, max_position_embeddings=64))
        out = lambda o: o.logits  # noqa: E731
    g, _ = _fx_equals_eager(model, torch.randint(0, 100, (2, 8)), out=out)
    assert module_path_coverage(g)[0] >= 0.95


def test_to_fx_random_ops_replay_genie_values():
    torch.manual_seed(0)
    with genie.capture() as g:
        x = torch.randn(4, 4)
        y = torch.nn.functional.dropout(x, 0.5, training=True) + torch.rand(4, 4)
    # random values are the real device's generator's (CUDA's differ from the CPU's): the module
    # replays them where genie drew them
    from genie.device import real_device
    gm = g.to_fx(y, device=real_device(0))
    torch.testing.assert_close(gm().cpu(), y.cpu())


def test_to_fx_default_outputs_and_multi_output_ops():
    with genie.capture() as g:
        x = torch.arange(12.0).reshape(3, 4)
        a, b = x.split(2, dim=1)
        m, i = x.max(dim=1)
        s = a + b
    gm = g.to_fx()
    outs = gm()
    assert len(outs) == 3  # i, m (alive, unread), s; x/a/b are read by later nodes
    torch.testing.assert_close(outs[-1], s.cpu())
    assert any(n.target.__name__ == "getitem" for n in gm.graph.nodes if n.op == "call_function"
               and hasattr(n.target, "__name__"))
    del m, i


def test_to_dot_and_summary():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2))).to(DEV)
    with genie.capture() as g:
        with genie.phase("prefill"):
            model(torch.ones(1, 4))
    dot = g.to_dot()
    assert dot.startswith("digraph genie {") and dot.rstrip().endswith("}")
    assert 'label="<root> (Sequential)"' in dot and 'label="1.1 (Linear)"' in dot
    assert dot.count("subgraph cluster_") == 5  # root, 0, 1, 1.0, 1.1
    text = g.summary()
    assert "1.1 (Linear)" in text and "prefill" in text and "matmul" in text
    assert "1.1" not in g.summary(depth=1).split("phase")[0]


def test_to_dot_writes_file(tmp_path):
    with genie.capture() as g:
        torch.ones(2) + 1
    p = tmp_path / "g.dot"
    assert g.to_dot(str(p)) == p.read_text()


def test_genies_own_probes_are_not_recorded_in_a_fresh_process():
    """The first call of an op runs Genie's metadata probe (genie.checks) on host tensors of its
    own; in a fresh process (nothing cached) nested blocks recorded that probe's tensors as the
    program's (an extra ``empty`` in the outer block, the ``add`` twice in the inner)."""
    import subprocess
    import sys

    code = ("import torch, genie\n"
            "with genie.capture() as outer:\n"
            "    a = torch.ones(2)\n"
            "    with genie.capture() as inner:\n"
            "        b = a + 1\n"
            "    c = b * 3\n"
            "print([str(n.op) for n in inner.nodes], [str(n.op) for n in outer.nodes])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout.strip().splitlines()[-1]
    assert out == "['aten.add.Tensor'] ['aten.ones.default', 'aten.mul.Tensor']", out
