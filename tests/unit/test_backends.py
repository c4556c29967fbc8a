"""Backends: the registry and its fallback, and the ``compiled`` backend against eager.

The compiled tests use ``torch.compile(backend="aot_eager")`` (graph capture and
functionalization, ATen kernels) to stay fast; ``GENIE_FULL_TESTS=1`` adds ``inductor`` and the
transformers models.
"""

import copy
import logging
import os

import pytest
import torch
from torch import nn

import genie
from genie import backends, plan_cache
from genie.backends import compiled

D = "remote_accelerator"
FULL = os.environ.get("GENIE_FULL_TESTS") == "1"


@pytest.fixture(autouse=True)
def _restore():
    order, comp = backends.backend_order(), compiled.compiler()
    warned = set(backends._warned)
    yield
    backends.set_backends(order)
    compiled.set_compiler(comp)
    backends._warned.clear()
    backends._warned.update(warned)


@pytest.fixture
def use_compiled():
    torch._dynamo.reset()  # no compiled code from another test's compiler serves this one
    compiled.set_compiler("aot_eager")
    backends.set_backends(["compiled", "eager"])
    plan_cache.clear()
    backends._warned.clear()


# --- registry -----------------------------------------------------------------------------------

def test_builtin_backends_are_registered():
    assert {"eager", "compiled"} <= set(backends.registered_backends())


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="already registered"):
        @backends.register_backend("eager")
        class Again:
            pass


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match="registered: .*compiled.*eager"):
        backends.set_backends(["warp_drive"])


def test_order_from_env_and_api_ends_with_eager(monkeypatch):
    monkeypatch.setattr(backends, "_order", [])
    monkeypatch.setenv("GENIE_BACKENDS", "compiled")
    assert backends.backend_order() == ["compiled", "eager"]
    backends.set_backends(["eager"])
    assert backends.backend_order() == ["eager"]


def test_a_backend_that_cannot_take_a_tape_falls_back_with_one_warning(caplog):
    calls = []

    @backends.register_backend("test_picky")
    class Picky:
        def is_available(self):
            return True

        def check(self, tape):
            calls.append(len(tape.instrs))
            return "only takes tapes it likes"

        def run(self, tape, device):
            raise AssertionError("never called")

    try:
        backends.set_backends(["test_picky"])
        x = torch.ones(3, device=D)
        with caplog.at_level(logging.WARNING, logger="genie"):
            assert (x * 2).sum().item() == 6.0
            assert (x * 3).sum().item() == 9.0
        assert len(calls) == 2
        msgs = [r.getMessage() for r in caplog.records if "test_picky" in r.getMessage()]
        assert len(msgs) == 1 and "only takes tapes it likes" in msgs[0]
    finally:
        backends._registry.pop("test_picky")


# --- compiled vs eager --------------------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


MODELS = {
    "mlp": (_mlp, lambda: torch.randn(8, 16), nn.functional.mse_loss, lambda: torch.randn(8, 4)),
    "transformer": (_transformer, lambda: torch.randn(2, 6, 32), nn.functional.mse_loss,
                    lambda: torch.randn(2, 6, 32)),
    "cnn": (_cnn, lambda: torch.randn(4, 3, 8, 8), nn.functional.cross_entropy,
            lambda: torch.randint(0, 10, (4,))),
}


def _train(model, opt, x, y, loss_fn, dev):
    opt.zero_grad()
    loss = loss_fn(model(x.to(dev)), y.to(dev))
    loss.backward()
    opt.step()
    return loss


def _training_steps_equal_eager(name: str, steps: int, **sgd) -> None:
    """``steps`` SGD steps of MODELS[name] on the device and eagerly: losses and state equal."""
    make, data, loss_fn, target = MODELS[name]
    ref = make()
    dev_model = copy.deepcopy(ref).to(D)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, **sgd)
    opt = torch.optim.SGD(dev_model.parameters(), lr=0.05, **sgd)
    for step in range(steps):
        torch.manual_seed(100 + step)
        x, y = data(), target()
        want = _train(ref, ref_opt, x, y, loss_fn, "cpu")
        got = _train(dev_model, opt, x, y, loss_fn, D)
        genie.materialize(got, *dev_model.parameters(), *dev_model.buffers())
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(ref.state_dict().items(), dev_model.state_dict().values(),
                           strict=True):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_training_steps_equal_eager(name, use_compiled):
    _training_steps_equal_eager(name, 5, momentum=0.9)
    s = genie.stats()
    print(name, {k: v for k, v in s.items() if "compiled" in k or "plan" in k})
    # The first steps differ (parameter uploads, momentum buffers); from the third on, the plan
    # repeats: compiled once (its first run is the trial against eager), then reused.
    assert s["plan_cache_hits"] >= 2 and s["compiled_runs"] >= 2
    assert s["compiled_verified"] == s["compiled_plans"] <= 3


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_forward_equals_eager(name, use_compiled):
    make, data, _, _ = MODELS[name]
    ref = make().eval()
    dev_model = copy.deepcopy(ref).to(D)
    genie.materialize(*dev_model.parameters(), *dev_model.buffers())
    genie.reset_stats()
    for _ in range(3):
        x = data()
        with torch.no_grad():
            want = ref(x)
            got = dev_model(x.to(D)).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    s = genie.stats()
    assert (s["plan_cache_misses"], s["plan_cache_hits"]) == (1, 2)
    # one compilation, reused by the next steps (the transformer's eval fast path is two fused
    # ops: too small to compile)
    assert s.get("compiled_plans", 0) == (name != "transformer")


@pytest.mark.parametrize("capturable", [False, True])
def test_adamw_steps_equal_eager(capturable, use_compiled, caplog):
    """AdamW's step size is a Python float that changes every step (``capturable=False``): a plan
    parameter, fed to the compiled graph as an input. In ``addcdiv_``'s Scalar ``value``
    torch.compile would specialize it, so the lowering moves it into a Tensor argument: the loop
    compiles a bounded number of times, not once per step. ``capturable=True`` keeps it a
    tensor."""
    _adamw_steps_equal_eager(capturable, caplog)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="inductor compiles C++ (minutes); GENIE_FULL_TESTS=1")
def test_inductor_adamw_steps_equal_eager(use_compiled, caplog):
    compiled.set_compiler("inductor")
    _adamw_steps_equal_eager(False, caplog)


def _adamw_steps_equal_eager(capturable: bool, caplog) -> None:
    ref = _mlp()
    dev_model = copy.deepcopy(ref).to(D)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = torch.optim.AdamW(dev_model.parameters(), lr=0.01, capturable=capturable)
    with caplog.at_level(logging.WARNING, logger="genie"):
        for step in range(8):
            torch.manual_seed(step)
            x, y = torch.randn(8, 16), torch.randn(8, 4)
            want = _train(ref, ref_opt, x, y, nn.functional.mse_loss, "cpu").item()
            got = _train(dev_model, opt, x, y, nn.functional.mse_loss, D).item()
            assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    s = genie.stats()  # the loop's (reading the parameters below plans more)
    for p, q in zip(ref.parameters(), dev_model.parameters(), strict=True):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-4, atol=1e-5)
    assert s["plan_cache_hits"] >= 5
    skipped = [r.getMessage() for r in caplog.records if "'compiled' skipped" in r.getMessage()]
    assert not skipped
    # first steps differ (uploads, optimizer state), then one plan: compiled with the floats it
    # saw change as inputs, then reused by every later step
    assert s["compiled_runs"] >= 4 and s["compiled_verified"] == s["compiled_plans"] <= 4


def test_scalar_rewrites_equal_eager(use_compiled):
    """Each op of compiled._SCALAR_REWRITES, with a Scalar argument that changes every step."""
    a, b = torch.randn(16, 16), torch.rand(16, 16) + 0.5
    da, db = a.to(D), b.to(D)
    genie.materialize(da, db)
    cases = {
        "addcdiv": lambda x, y, v: torch.addcdiv(x, x, y, value=v) * 2,
        "addcdiv_": lambda x, y, v: (x * 1).addcdiv_(x, y, value=v) * 2,
        "addcmul": lambda x, y, v: torch.addcmul(x, x, y, value=v) * 2,
        "addcmul_": lambda x, y, v: (x * 1).addcmul_(x, y, value=v) * 2,
        "add alpha": lambda x, y, v: torch.add(x, y, alpha=v) * 2,
        "add_ alpha": lambda x, y, v: (x * 1).add_(y, alpha=v) * 2,
        "sub alpha": lambda x, y, v: torch.sub(x, y, alpha=v) * 2,
        "sub_ alpha": lambda x, y, v: (x * 1).sub_(y, alpha=v) * 2,
        "mul.Scalar": lambda x, y, v: torch.ops.aten.mul.Scalar(x, v) + y,
        "div_.Scalar": lambda x, y, v: torch.ops.aten.div_.Scalar(x * 1, v) + y,
        # the _foreach_ forms (multi-tensor optimizers): a float list, one float per tensor
        "_foreach_div_.ScalarList": lambda x, y, v: _foreach_sum(
            lambda xs: torch._foreach_div_(xs, [v, 2 * v]), x, y),
        "_foreach_addcdiv_.ScalarList": lambda x, y, v: _foreach_sum(
            lambda xs: torch._foreach_addcdiv_(xs, [x, y], [y, x], [-v, v / 3]), x, y),
        "_foreach_addcmul.Scalar": lambda x, y, v: sum(torch._foreach_addcmul(
            [x, y], [y, x], [x, x], value=v)),
        "_foreach_mul.Scalar": lambda x, y, v: sum(torch._foreach_mul([x, y], v)),
        "_foreach_add_.List alpha": lambda x, y, v: _foreach_sum(
            lambda xs: torch._foreach_add_(xs, [y, x], alpha=-v), x, y),
        "_foreach_sub_.ScalarList": lambda x, y, v: _foreach_sum(
            lambda xs: torch._foreach_sub_(xs, [v, v * v]), x, y),
    }
    for name, f in cases.items():
        genie.reset_stats()
        for k in range(5):
            v = 0.3 / (k + 1)
            torch.testing.assert_close(f(da, db, v).sum(0).cpu(), f(a, b, v).sum(0), msg=name)
        s = genie.stats()
        assert s["compiled_runs"] >= 2 and s["compiled_plans"] <= 2, (name, s)


def _foreach_sum(update, x, y):
    """``update`` applied in place to copies of ``x`` and ``y``, then their sum."""
    xs = [x * 1, y * 1]
    update(xs)
    return xs[0] + xs[1]


@pytest.mark.parametrize("case", ["clamp", "scalar operand"])
def test_changing_scalar_outside_the_rewrites_falls_back(case, use_compiled, caplog):
    """A changing float in a Scalar argument the lowering cannot move (an op outside the table,
    or a rewrite whose operand is a Python number): refused by name, eager's values."""
    x = torch.rand(16, 16).to(D)
    genie.materialize(x)
    xc = x.cpu()
    f = {"clamp": lambda t, v: (t * 2).clamp(min=v).exp().sum(0),
         "scalar operand": lambda t, v: torch.add(t * 2, 3.0, alpha=v).exp().sum(0)}[case]
    with caplog.at_level(logging.WARNING, logger="genie"):
        for k in range(4):
            torch.testing.assert_close(f(x, 0.1 * k).cpu(), f(xc, 0.1 * k))
    msgs = [r.getMessage() for r in caplog.records if "'compiled' skipped" in r.getMessage()]
    name = {"clamp": "'min' of aten.clamp.default", "scalar operand": "'alpha' of aten.add"}[case]
    assert len(msgs) == 1 and name in msgs[0], msgs


def test_changing_floats_in_tensor_arguments_do_not_recompile(use_compiled):
    x = torch.randn(16, 16).to(D)
    genie.materialize(x)
    xc = x.cpu()
    for k in range(6):
        lr = 0.1 / (k + 1)
        got = ((x * lr).exp() / (1.0 + lr)).sum(0).cpu()
        torch.testing.assert_close(got, ((xc * lr).exp() / (1.0 + lr)).sum(0))
    s = genie.stats()
    # the first plan bakes the floats; the first change recompiles with them as inputs; no more
    assert s["compiled_plans"] == 2 and s["compiled_runs"] >= 3


def test_random_ops_fall_back_to_eager_with_the_same_values(use_compiled, caplog):
    def run():
        torch.manual_seed(7)
        x = torch.ones(64, 64, device=D)
        return [(nn.functional.dropout(x * 2, 0.5) + 1).sum(0).cpu() for _ in range(2)]

    with caplog.at_level(logging.WARNING, logger="genie"):
        got = run()
    warnings = [r.getMessage() for r in caplog.records if "'compiled' skipped" in r.getMessage()]
    assert len(warnings) == 1 and "random ops" in warnings[0]
    backends.set_backends(["eager"])
    want = run()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_compiler_failure_falls_back_to_eager(use_compiled, caplog):
    def broken(gm, example_inputs):
        raise RuntimeError("this compiler is broken")

    compiled.set_compiler(broken)
    x = torch.randn(8, 8).to(D)
    with caplog.at_level(logging.WARNING, logger="genie"):
        for _ in range(2):
            got = ((x @ x).relu() + 1).sum(0).cpu()
    xc = x.cpu()
    torch.testing.assert_close(got, ((xc @ xc).relu() + 1).sum(0))
    msgs = [r.getMessage() for r in caplog.records if "'compiled' skipped" in r.getMessage()]
    assert len(msgs) == 1 and "this compiler is broken" in msgs[0], [r.getMessage() for r in caplog.records]


@pytest.mark.kernel_error
def test_execution_errors_propagate(use_compiled):
    x = torch.randn(4, 4, device=D)
    bad = torch.tensor([[0, 9, 0, 0]]).to(D)  # index 9 is out of range: only the data says so
    y = torch.gather(x * 2, 0, bad).exp().sum()
    with pytest.raises(genie.ExecutionError):
        y.item()


def test_small_tapes_run_without_compiling(use_compiled):
    x = torch.ones(3, device=D)
    genie.materialize(x)
    assert (x + 1).sum().item() == 6.0  # two ops: not worth a compilation
    assert "compiled_plans" not in genie.stats()


def test_the_fx_graph_has_placeholders_for_values_that_change(use_compiled):
    w = torch.randn(4, 4).to(D)
    genie.materialize(w)
    (torch.ones(4, 4).to(D) @ w * 3.0 + 1).relu().sum().item()
    plan = plan_cache.cache().plans()[-1]
    code = plan.artifacts["compiled"].graph.code
    # w (an input: in<slot>) and the uploaded host tensor are placeholders
    assert "def forward(self, in1, upload0)" in code
    assert "3.0" in code  # scalars are part of the plan: baked in


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="inductor compiles C++ (minutes); GENIE_FULL_TESTS=1")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_inductor_training_steps_equal_eager(name, use_compiled):
    compiled.set_compiler("inductor")
    _training_steps_equal_eager(name, 3)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="transformers models; GENIE_FULL_TESTS=1")
@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama"])
def test_compiled_transformers_forward_equals_eager(arch, use_compiled):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    common = dict(vocab_size=96, num_hidden_layers=2, num_attention_heads=4,
                  attn_implementation="eager")
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_positions=32, n_embd=64, n_layer=2, n_head=4, vocab_size=96,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))
    elif arch == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=64, intermediate_size=128, max_position_embeddings=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_key_value_heads=2,
            max_position_embeddings=64, **common))
    model.eval()
    dev_model = copy.deepcopy(model).to(D)
    ids = torch.randint(1, 96, (2, 8))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = dev_model(input_ids=ids.to(D)).logits.cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert genie.stats().get("compiled_verified", 0) >= 1  # compiled, and agreed with eager
