"""Meaning on the default path (genie.context): module paths, regions, phases found, roles.

Every case runs the program on the device and eagerly: values must be equal (the context is
recorded, never changes what runs), and the meaning Genie found must be the one the program has.
"""

import pytest
import torch
from torch import nn

import genie
from genie import context

D = "remote_accelerator"
pytestmark = pytest.mark.skipif(not context._on, reason="GENIE_CONTEXT=0 turns the hooks off")


def _use(native, monkeypatch):
    """Install the native nn.Module.__call__ (csrc/record.cpp, ModuleCall) or the Python
    wrapper context._module_call (GENIE_NATIVE_CONTEXT=0, the reference)."""
    context.deactivate()
    monkeypatch.setattr(context, "_native", native)
    context.activate()


@pytest.fixture(autouse=True, params=[True, False], ids=["native", "python"])
def _push_path(request, monkeypatch):
    """Every case both ways: module calls decided and submodule contexts pushed natively, and
    by the Python wrapper."""
    _use(request.param, monkeypatch)
    yield request.param
    context.deactivate()
    monkeypatch.setattr(context, "_native", True)
    context.activate()


def _contexts(t):
    """Every node ``t`` depends on, in record order, with what its context says."""
    seen, todo, out = set(), [t._node], []
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        todo.extend(x.node for x in (n.leaves or ()) if type(x).__name__ == "Ref")
    return [(str(n.op), None if n.ctx is None else
             (n.ctx.path, n.ctx.cls, n.ctx.region, n.ctx.explicit, n.ctx.phase))
            for n in sorted(out, key=lambda n: n.index)]


def test_native_and_python_pushes_give_the_same_contexts(monkeypatch):
    """Nested modules, a phase block inside a forward, a module annotated with a phase, a
    prefill then decodes: every node's context equal both ways, and the phase counters."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = _Attn(), nn.Sequential(nn.Linear(8, 8), nn.GELU())

        def forward(self, x, past=None):
            with genie.phase("inner"):
                h = self.mlp(x)
            y, past = self.attn(h, past)
            return y + h, past

    torch.manual_seed(0)
    m = Block()
    genie.annotate_phase(m.mlp[1], "act")
    m.to(D)
    got = {}
    for native in (True, False):
        _use(native, monkeypatch)
        genie.reset_stats()
        x = torch.linspace(-1, 1, 24).reshape(1, 3, 8).to(D)
        with torch.no_grad():
            y, past = m(x)
            y2, past = m(y[:, -1:], past)
            y3, _ = m(y2, past)
        s = genie.stats()
        got[native] = (_contexts(y3), {k: v for k, v in s.items() if k.startswith("phase.")})
    assert got[True] == got[False]
    paths = {c[1][0] for c in got[True][0] if c[1] is not None}
    assert {"mlp.0", "attn.qkv", "attn.out"} <= paths, paths
    assert any(c[1] is not None and c[1][4] == "act" for c in got[True][0])


def test_an_outermost_call_begun_natively_gives_pythons_contexts_and_phases(monkeypatch):
    """With no module call running, an outermost call whose arguments are LazyTensors (positional)
    that no earlier call of the module produced is begun natively (its Call and root Context,
    ended at its return as _leave ends it): the contexts, the calls' sizes and the phase found
    later (a prefill, once a decode uses its output) equal the Python wrapper's. Python's _enter
    runs only for the module's first call (its names) and for the decode."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, past=None):
            h = self.lin(x).relu()
            return h, (h if past is None else torch.cat([past, h], 1))

    torch.manual_seed(0)
    m = M().to(D)
    got = {}
    for native in (True, False):
        _use(native, monkeypatch)
        enters, enter = _count_enters(monkeypatch)
        genie.reset_stats()
        xs = [torch.full((1, 1, 8), float(i)).to(D) for i in range(3)]
        with torch.no_grad():
            h1, _ = m(xs[0])  # the first call: names made in Python
            h2, past = m(xs[1])  # fresh arguments: begun natively
            h3, past = m(h2[:, -1:], past)  # a decode of the second call (a prefill, then)
            h4, _ = m(xs[2])
        calls = [h._node.ctx.call for h in (h1, h2, h3, h4)]
        got[native] = ([_contexts(h) for h in (h1, h2, h3, h4)],
                       [(c.phase, c.nodes, len(c.contexts)) for c in calls],
                       {k: v for k, v in genie.stats().items() if k.startswith("phase.")})
        assert len(enters) == (2 if native else 4)
        assert current_ctx() is None and not context._tls.modules
        monkeypatch.setattr(context, "_enter", enter)
    assert got[True] == got[False]
    assert [p for p, _, _ in got[True][1]] == [None, "prefill", "decode", None]
    assert got[True][2]["phase.prefill.calls"] == 1


def current_ctx():
    from genie.graph import current

    return current.ctx


def test_nodes_carry_module_path_and_region():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    m.load_state_dict(ref.state_dict())
    m.to(D)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    h = m[0](x.to(D))
    assert h._node.ctx.path == "" and h._node.ctx.cls == "Linear"  # the outermost call here
    y = m(x.to(D))
    assert y._node.ctx.path == "2.0" and y._node.ctx.region == "forward"
    assert m[1](h)._node.ctx.path == ""
    loss = y.sum()
    assert loss._node.ctx is None  # outside any module
    loss.backward()
    g = m[0].weight.grad
    assert g._node.ctx.region == "backward" and context.role(g) == "gradient"
    opt.step()
    # in-place updates are writes to the parameter's storage (the tensor keeps its node)
    assert m[0].weight._storage.pending_writes[-1].ctx.region == "optimizer"
    assert context.role(m[0].weight) == "weight"
    assert context.role(y) == "activation" and context.role(x.to(D)) == "input"
    # the same computation eagerly
    ref(x).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    torch.testing.assert_close(m[0].weight.cpu(), ref[0].weight)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    m.generation_config.pad_token_id = 0
    return m


def test_generate_phases_found_and_tokens_equal_eager():
    ref = _gpt2()
    m = _gpt2().to(D)
    ids = torch.randint(1, 50, (1, 7), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        genie.reset_stats()
        got = m.generate(ids.to(D), attention_mask=torch.ones_like(ids).to(D), **kw).cpu()
    assert torch.equal(got, want)
    s = genie.stats()
    # one prefill (the prompt), then one decode call per further token
    assert s["phase.prefill.calls"] == 1 and s["phase.decode.calls"] == 5
    assert s["phase.prefill.nodes"] > 0 and s["phase.decode.nodes"] > 0
    per_decode = s["phase.decode.nodes"] / 5
    assert per_decode < s["phase.prefill.nodes"] * 1.5  # same model, one token


class _Attn(nn.Module):
    """A hand-written one-layer decoder that returns its KV cache as a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x, past=None):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if past is not None:
            k = torch.cat([past[0], k], dim=1)
            v = torch.cat([past[1], v], dim=1)
        a = torch.softmax(q @ k.transpose(1, 2) / 8 ** 0.5, dim=-1) @ v
        return self.out(a), (k, v)


def _count_enters(monkeypatch) -> tuple[list, object]:
    """Note each module ``context._enter`` (Python's way into a call) is given; the list it
    notes them in, and the real ``_enter``."""
    enters: list = []
    enter = context._enter
    monkeypatch.setattr(context, "_enter", lambda *a: (enters.append(a[0]), enter(*a))[1])
    return enters, enter


def _twins(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    """Two instances of ``cls`` with the same weights: one on the CPU (the reference), one on
    the device."""
    torch.manual_seed(0)
    ref = cls()
    m = cls()
    m.load_state_dict(ref.state_dict())
    return ref, m.to(D)


def _decode_loop(model, dev, steps=4):
    x = torch.linspace(-1, 1, 5 * 8).reshape(1, 5, 8).to(dev)
    with torch.no_grad():
        y, past = model(x)
        outs = [y[:, -1:]]
        for _ in range(steps):
            y, past = model(outs[-1], past)
            outs.append(y)
    return torch.cat(outs, dim=1), past


def test_hand_written_decode_loop_phases_and_kv_role():
    ref, m = _twins(_Attn)
    want, _ = _decode_loop(ref, "cpu")
    genie.reset_stats()
    got, past = _decode_loop(m, D)
    torch.testing.assert_close(got.cpu(), want)
    s = genie.stats()
    assert (s["phase.prefill.calls"], s["phase.decode.calls"]) == (1, 4)
    assert context.role(past[0]) == "activation"  # the last cache: not fed back (yet)
    with torch.no_grad():
        _, past2 = m(got[:, -1:], past)
    assert context.role(past[0]) == "kv_cache" and context.role(past[1]) == "kv_cache"
    assert past2[0]._node.ctx.phase == "decode"


class _Cache:
    """A cache object as transformers' (its tensors in a list attribute, replaced each step)."""

    def __init__(self):
        self.layers = []


class _KwAttn(_Attn):
    """_Attn called as transformers' generate calls a model: by keyword, with a cache object."""

    def forward(self, x, cache=None, use_cache=True):
        y, kv = super().forward(x, tuple(cache.layers) if cache and cache.layers else None)
        if cache is not None:
            cache.layers[:] = kv
        return y


def _kw_decode_loop(model, dev, steps):
    x = torch.linspace(-1, 1, 5 * 8).reshape(1, 5, 8).to(dev)
    cache = _Cache()
    with torch.no_grad():
        outs = [model(x=x, cache=cache, use_cache=True)[:, -1:]]
        for _ in range(steps):
            outs.append(model(x=outs[-1], cache=cache, use_cache=True))
    return torch.cat(outs, dim=1), cache


def _roles(t):
    """The role tag of every node ``t`` depends on, in record order."""
    seen, todo, out = set(), [t._node], []
    while todo:
        n = todo.pop()
        if id(n) not in seen:
            seen.add(id(n))
            out.append(n)
            todo.extend(x.node for x in (n.leaves or ()) if type(x).__name__ == "Ref")
    return [(str(n.op), (n.tags or {}).get("role")) for n in sorted(out, key=lambda n: n.index)]


def test_a_decode_called_by_keyword_is_begun_natively_as_python_begins_it(monkeypatch):
    """A decode loop that passes its input and a cache object by keyword (as transformers'
    generate calls the model every token): from the second decode step on, each step is begun
    natively (csrc/record.cpp, ctx_begin_walk: no Python _enter), and every node's context and
    role tag, the phase counters and the values equal the Python wrapper's."""
    ref, m = _twins(_KwAttn)
    want, _ = _kw_decode_loop(ref, "cpu", steps=5)
    got = {}
    for native in (True, False):
        _use(native, monkeypatch)
        enters, enter = _count_enters(monkeypatch)
        genie.reset_stats()
        out, cache = _kw_decode_loop(m, D, steps=5)
        got[native] = (_contexts(out), _roles(out), _roles(cache.layers[0]),
                       {k: v for k, v in genie.stats().items() if k.startswith("phase.")})
        torch.testing.assert_close(out.cpu(), want)
        # native: the prefill (the module's names) and the first decode (its shared Call) only
        assert len(enters) == (2 if native else 6)
        assert current_ctx() is None and not context._tls.modules
        monkeypatch.setattr(context, "_enter", enter)
    assert got[True] == got[False]
    assert got[True][3]["phase.decode.calls"] == 5 and got[True][3]["phase.prefill.calls"] == 1
    assert sum(r == "kv_cache" for _, r in got[True][2]) >= 5  # each step's cache, fed back


def test_decode_calls_share_one_call_and_intern_no_context_per_step(monkeypatch):
    """The decode calls of one model share a Call: after the first decode step a steady decode
    interns no new context (the same objects, the same count), and every node's context, the
    phase counters and the values are those of a new Call per call (the reference)."""
    ref, m = _twins(_Attn)
    want, _ = _decode_loop(ref, "cpu", steps=5)
    got = {}
    for share in (True, False):
        monkeypatch.setattr(context, "share_decode_calls", share)
        genie.reset_stats()
        out, past = _decode_loop(m, D, steps=5)
        torch.testing.assert_close(out.cpu(), want)
        s = genie.stats()
        got[share] = (_contexts(out), {k: v for k, v in s.items() if k.startswith("phase.")})
    assert got[True] == got[False]
    assert got[True][1]["phase.decode.calls"] == 5 and got[True][1]["phase.prefill.calls"] == 1

    monkeypatch.setattr(context, "share_decode_calls", True)
    x = torch.linspace(-1, 1, 5 * 8).reshape(1, 5, 8).to(D)
    with torch.no_grad():
        y, past = m(x)
        y1, past = m(y[:, -1:], past)
        call = y1._node.ctx.call
        interned = dict(call.contexts)
        y2, past = m(y1, past)
        y3, past = m(y2, past)
    assert y2._node.ctx.call is call and y3._node.ctx.call is call
    assert y._node.ctx.call is not call and y._node.ctx.phase == "prefill"
    assert call.contexts == interned  # no context made after the first decode step
    assert {y3._node.ctx, past[0]._node.ctx} <= set(interned.values())


def test_a_shared_decode_call_is_freed_with_its_model_without_cyclic_garbage():
    """The decode Call a model's calls share (and its contexts, which point at it) goes with the
    model by reference counting: nothing is left for the cyclic collector."""
    import gc
    import weakref

    torch.manual_seed(0)
    m = _Attn().to(D)
    out, past = _decode_loop(m, D, steps=2)
    call = weakref.ref(past[0]._node.ctx.call)
    assert call() is not None and call().phase == "decode"
    out.cpu()  # a first run of a plan (passes, verification) may leave garbage of its own
    for _ in range(10):  # earlier tests' garbage (TorchDynamo's fake tensors after
        if not gc.collect():  # test_compile) can take several passes to go
            break
    gc.disable()
    try:
        del m, out, past
        assert call() is None, "the shared decode Call outlived its model and nodes"
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_explicit_phase_overrides_detection():
    torch.manual_seed(0)
    m = _Attn().to(D)
    genie.reset_stats()
    with torch.no_grad(), genie.phase("encode"):
        y, past = m(torch.ones(1, 3, 8, device=D))
        z = y * 2  # outside any module, inside the block
    assert y._node.ctx.phase == "encode" and z._node.ctx.phase == "encode"
    with torch.no_grad():
        y2, _ = m(y[:, -1:], past)
    assert y2._node.ctx.phase == "decode"
    annotated = genie.annotate_phase(_Attn().to(D), "vision")
    with torch.no_grad():
        assert annotated(torch.ones(1, 2, 8, device=D))[0]._node.ctx.phase == "vision"


def test_training_loop_has_no_phase():
    torch.manual_seed(0)
    m = nn.Linear(4, 4).to(D)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    genie.reset_stats()
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(2, 4).to(D)).pow(2).sum().backward()
        opt.step()
    assert not any(k.startswith("phase.") for k in genie.stats())


def test_role_of_a_host_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="remote_accelerator tensor"):
        context.role(torch.ones(2))


def test_a_called_model_is_freed_with_its_weights():
    """The hooks' per-model caches hold nothing strongly: a model that was called on the device
    and dropped frees its weights (and the device bytes they hold)."""
    import gc
    import weakref

    m = _Attn().to(D)
    with torch.no_grad():
        y, _ = m(torch.ones(1, 2, 8, device=D))
    y.cpu()
    w = weakref.ref(m.qkv.weight)
    del m, y
    gc.collect()
    assert w() is None


def test_context_is_popped_when_a_forward_raises_and_modules_keep_their_fast_path():
    """The wrapper around ``nn.Module.__call__`` pops the module's context however the call
    ends (as an ``always_call`` hook would), the error is eager's, and no global module hook is
    installed (every module call of the process keeps torch's hook-free fast path)."""
    from torch.nn.modules import module as nn_module

    class Boom(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN202
            return x.view(7)  # 4 elements: eager raises RuntimeError

    outer = nn.Sequential(nn.Linear(2, 2), Boom()).to("remote_accelerator")
    x = torch.ones(2, 2, device="remote_accelerator")
    assert context.active()
    with pytest.raises(RuntimeError) as got:
        outer(x)
    with pytest.raises(RuntimeError) as want:
        nn.Sequential(nn.Linear(2, 2), Boom())(torch.ones(2, 2))
    assert type(got.value) is type(want.value)
    assert not context._tls.modules  # nothing left on the stack
    y = nn.Linear(2, 2).to("remote_accelerator")(x)
    assert y._node.ctx.path == "" and y._node.ctx.cls == "Linear"
    assert (x + 1)._node.ctx is None  # outside any module again
    assert not nn_module._global_forward_pre_hooks and not nn_module._global_forward_hooks
    # kwargs reach the phase detection without reading frames: a KV cache passed by keyword
    lin = nn.Linear(2, 2).to("remote_accelerator")

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x, past=None):  # noqa: ANN001, ANN202
            return self.lin(x if past is None else x + past)

    step = Step()
    first = step(x)
    second = step(x, past=first)
    assert first._node.ctx.phase == "prefill" and second._node.ctx.phase == "decode"
    assert context.role(first) == "kv_cache"


def test_an_optimizer_step_that_raises_leaves_no_context_behind():
    """Optimizer step hooks have no post hook on an exception: the entry of a step that raised is
    dropped at the next module call or step (its frame is gone), so later nodes get their own
    module context, not the optimizer's; a module called inside a running step (an LBFGS-style
    closure) is still inside it."""

    class Boom(torch.optim.SGD):
        def step(self, closure=None):  # noqa: ANN001, ANN202
            raise RuntimeError("step failed")

    model = nn.Linear(2, 2).to("remote_accelerator")
    x = torch.ones(1, 2, device="remote_accelerator")
    opt = Boom(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="step failed"):
        opt.step()
    y = model(x)
    assert y._node.ctx.region == "forward" and y._node.ctx.path == ""
    assert not context._tls.modules

    seen = []

    class Closure(torch.optim.SGD):
        def step(self, closure=None):  # noqa: ANN001, ANN202
            seen.append(closure())
            return super().step()

    opt2 = Closure(model.parameters(), lr=0.1)
    opt2.step(lambda: model(x))
    assert seen[0]._node.ctx.region == "optimizer"  # the closure's forward runs inside the step
    assert not context._tls.modules
    with pytest.raises(RuntimeError, match="step failed"):
        opt.step()
    opt2.step(lambda: model(x))  # a later step drops the failed one first
    assert seen[1]._node.ctx.region == "optimizer" and not context._tls.modules


def test_eager_model_called_by_keyword_gets_no_context_and_a_lazy_keyword_does():
    """An eager model in the same process, called as ``generate`` calls it (keyword tensors
    only), pays no context: no :class:`~genie.context.Call` is made and no module is pushed
    (the wrapper answered ~11% of an eager GPT-2 token before). A call whose tensors are on
    the device, positional or keyword, gets its context, and a positional host tensor with a
    lazy keyword one is not taken for a host call."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x=None, extra=None):  # noqa: ANN001, ANN202
            seen.append(list(context._tls.modules))
            y = self.lin(x)
            return y if extra is None else y + extra

    seen: list[list] = []
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 2)
    want = net(x=x)
    calls = []
    orig = context.Call.__init__

    def spy(self, root):  # noqa: ANN001, ANN202
        calls.append(root)
        orig(self, root)

    context.Call.__init__ = spy
    try:
        got = net(x=x)  # keyword host tensor: an eager call
        assert seen[-1] == [] and calls == []
        torch.testing.assert_close(got, want)
        lazy = Net().to(D)
        lazy.load_state_dict(net.state_dict())
        y = lazy(x=x.to(D))  # keyword lazy tensor: a genie call
        assert len(calls) == 1 and y._node.ctx.path == "lin" and y._node.ctx.call is not None
        z = lazy(x.to(D), extra=x.to(D))  # (its Call made natively, or by Call.__init__)
        c = z._node.ctx.call
        assert z._node.ctx.path == "" and c is not None and c is not y._node.ctx.call
        assert c.root() is lazy and c.phase is None and len(calls) in (1, 2)
        # positional host, lazy keyword: not a host call; no tensor at the top level: context
        assert not context._host_call((x,), {"extra": torch.ones(2, device=D)})
        assert context._host_call((), {"x": x}) and not context._host_call((), {})
        torch.testing.assert_close(y.cpu(), want)
    finally:
        context.Call.__init__ = orig
    assert not context._tls.modules


def test_a_forward_leaves_no_cyclic_garbage():
    """A module call's contexts point at its Call and the Call interned them: once the call
    returns that cycle is broken, so a forward's contexts and its Call are freed by reference
    counting when its nodes go (not left for a full collection of the process's heap)."""
    import gc
    import weakref

    ref, m = _twins(_Attn)
    x = torch.randn(1, 2, 8)
    with torch.no_grad():
        want, _ = ref(x)
        m(x.to(D))  # the model's names, caches
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            y, past = m(x.to(D))
        call = weakref.ref(y._node.ctx.call)
        ctxs = {y._node.ctx.path, past[0]._node.ctx.path}
        torch.testing.assert_close(y.cpu(), want)  # the context changes nothing that runs
        del y, past
        assert call() is None, f"the Call of {ctxs} outlived its nodes: a reference cycle"
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_an_eager_module_never_reaches_python_and_attribute_reads_see_torchs_call(_push_path):
    """With the native ``nn.Module.__call__`` installed (the default), a module call that never
    touches the device runs no Python of Genie's: torch's ``__call__`` directly, the values
    eager's; a device call still reaches Genie. Reading ``Module.__call__``
    gives torch's function (TorchDynamo inlines that one); ``m.__call__(x)``, as transformers'
    ``generate`` calls its model, is the installed call bound to ``m``."""
    import sys

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    x = torch.randn(3, 4)
    want = torch.nn.functional.linear(
        torch.relu(torch.nn.functional.linear(x, m[0].weight, m[0].bias)), m[2][0].weight,
        m[2][0].bias)
    entered = []
    slow = context._module_call.__code__

    def prof(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call" and frame.f_code is slow:
            entered.append(frame.f_locals["self"])

    sys.setprofile(prof)
    try:
        got = m(x)
        lazy = nn.Linear(4, 4).to(D)
        y = lazy(torch.ones(1, 4, device=D))
    finally:
        sys.setprofile(None)
    torch.testing.assert_close(got, want)
    assert y._node.ctx.path == "" and y._node.ctx.cls == "Linear"
    if _push_path:
        assert entered == [lazy], entered  # the eager model: decided natively
        assert type(nn.Module.__dict__["__call__"]).__name__ == "ModuleCall"
        assert nn.Module.__call__ is context._orig_call  # what TorchDynamo inlines
    else:
        assert len(entered) == 6 and entered[-1] is lazy  # the reference: a frame per call
    # a bound read (transformers' generate: model_forward = self.__call__) still gets a context
    y = lazy.__call__(torch.ones(1, 4, device=D))
    assert y._node.ctx.path == "" and y._node.ctx.cls == "Linear"
    torch.testing.assert_close(m.__call__(x), want)
    if _push_path:  # introspection of a module's __call__ sees what it saw without Genie
        import inspect

        assert str(inspect.signature(m.__call__)) == str(inspect.signature(
            context._orig_call.__get__(m)))
        assert m.__call__.__name__ == context._orig_call.__name__


def test_an_fx_trace_anywhere_in_the_process_leaves_contexts_and_roles_on():
    """torch.fx's tracer puts back the ``nn.Module.__call__`` it read (torch's function) when
    it is done: Genie's module call follows it back in. Before, one ``symbolic_trace`` (of a
    lambda, in another test) ended contexts for the rest of the process: a decode loop's KV
    cache then counted as an activation."""
    m = _Attn().to(D)
    m(torch.randn(1, 3, 8, device=D))  # the device in use: Genie's module call installed
    installed = nn.Module.__dict__["__call__"]
    torch.fx.symbolic_trace(lambda x: torch.ops.aten.mul.Tensor(x, 2.0))
    torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))  # one that calls modules too
    assert nn.Module.__dict__["__call__"] is installed
    y = m(torch.randn(1, 3, 8, device=D))
    assert y[0]._node.ctx is not None and y[0]._node.ctx.path == "out"
    genie.reset_stats()
    got, past = _decode_loop(m, D)
    s = genie.stats()
    assert (s["phase.prefill.calls"], s["phase.decode.calls"]) == (1, 4)
    with torch.no_grad():
        m(got[:, -1:], past)
    assert context.role(past[0]) == "kv_cache"


def test_lazy_tensors_walks_containers_objects_and_reported_classes_the_same_every_time():
    """What an outermost call's arguments hold (context._lazy_tensors, which finds a decode's KV
    cache): through list, tuple and dict subclasses and plain objects' attributes; not into
    modules or host tensors; an object that reports another __class__ walked as that class
    says, each time (the walk remembers what to do with each type)."""
    class Seq(list):
        pass

    class Map(dict):
        pass

    class Holder:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class LooksLikeADict:  # isinstance(x, dict) holds through __class__, as for a proxy
        __slots__ = ("v",)  # no __dict__: only its values() reach the tensor
        __class__ = property(lambda self: dict)  # type: ignore[assignment]

        def __init__(self, v):
            self.v = v

        def values(self):
            return [self.v]

    a, b, c, d, e = (torch.ones(2, device=D) * k for k in range(5))
    mod = nn.Linear(2, 2).to(D)
    args = (Seq([a, 1, "s"]), {"m": Map(x=b), "h": Holder(t=c, inner=Holder(t=d)), "mod": mod,
                               "cpu": torch.ones(2)}, LooksLikeADict(e))
    for _ in range(2):  # the second walk answers from the types it remembered
        got = context._lazy_tensors(args)
        assert sorted(id(t) for t in got) == sorted(id(t) for t in (a, b, c, d, e))


def _walk_reference(obj):
    """context._lazy_tensors as it was written in Python (before csrc/walk.cpp), in its order:
    the reference the native walk is checked against."""
    found, seen, todo = [], set(), [(obj, 0)]
    while todo:
        x, depth = todo.pop()
        k = context._kind(x)
        if k == context._TENSOR:
            if getattr(x, "_node", None) is not None:
                found.append(x)
            continue
        if depth > 6 or k == context._SKIP or id(x) in seen:
            continue
        seen.add(id(x))
        if k == context._SEQ:
            vals = x
        elif k == context._DICT:
            vals = x.values()
        else:
            d = getattr(x, "__dict__", None)
            if not isinstance(d, dict):
                continue
            vals = d.values()
        todo += [(v, depth + 1) for v in vals if type(v) not in context._ATOMS]
    return found


def test_lazy_tensors_finds_what_the_python_walk_found_in_its_order():
    """The native walk (csrc/walk.cpp) against the Python one it replaces: the same tensors in
    the same order through cycles, shared containers, the depth limit (a tensor in a container
    6 levels down is found, 7 down is not), iterables that are list or tuple subclasses with
    their own ``__iter__``, dict subclasses with their own ``values()``, objects with slots only, host
    tensors and modules (not entered)."""
    class Rev(list):
        def __iter__(self):
            return reversed(list(list.__iter__(self)))

    class Vals(dict):
        def values(self):
            return [v for _, v in sorted(self.items())]

    class Slotted:
        __slots__ = ("t",)

        def __init__(self, t):
            self.t = t

    class Obj:
        pass

    ts = [torch.ones(2, device=D) * k for k in range(12)]
    deep = ts[0]
    for _ in range(5):  # found: its list is 6 containers down (the outer tuple is 0)
        deep = [deep]
    too_deep = ts[1]
    for _ in range(6):  # not found: its list is 7 down
        too_deep = [too_deep]
    o = Obj()
    o.cache = [(ts[2], ts[3]), (ts[4], ts[5])]
    o.me = o  # a cycle
    shared = [ts[6]]
    args = ((deep, too_deep, o, shared, shared, Rev([ts[7], ts[8], 1]),
             Vals(b=ts[9], a=ts[10]), Slotted(ts[11]), nn.Linear(2, 2).to(D), torch.ones(3)),
            {"past": o, "x": ts[3], "n": 5, "s": "text", "none": None})
    want = _walk_reference(args)
    ids = {id(t) for t in want}
    assert id(ts[0]) in ids and id(ts[1]) not in ids and id(ts[11]) not in ids and len(want) > 8
    for _ in range(2):  # the second walk answers from the types it remembered
        got = context._lazy_tensors(args)
        assert [id(t) for t in got] == [id(t) for t in want]
