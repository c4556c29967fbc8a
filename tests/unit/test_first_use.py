"""What a new user hits first (issue 29, family 5), each against eager.

Backward hooks and autograd Functions that return their input (they hung at 100% CPU), torch.load
onto the device, pinned memory in pure-CPU programs, a bad server environment at ``import torch``,
``.numpy()`` of a tensor that requires grad, autocast's default dtype, a data-dependent error's
type and message, and plain-CPU programs that must behave exactly as without Genie.
"""

import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import genie

DEV = "remote_accelerator:0"
PY = sys.executable


def _run(code: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    from importlib.metadata import entry_points

    if not [e for e in entry_points(group="torch.backends") if e.name == "genie"]:
        pytest.skip("these programs rely on `import torch` loading Genie (the torch.backends "
                    "entry point), which needs Genie pip-installed; tools/setup.sh installs it")
    e = {k: v for k, v in os.environ.items() if not k.startswith("GENIE_")}
    e.update(env or {})
    return subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=e)


# --- a Function that returns its input: it looped forever in genie._C's getattr ---------------

_HOOKS = """
    import torch, torch.nn as nn
    D = {dev!r}
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    seen = []
    m = m.to(D)
    m.register_full_backward_hook(lambda mod, gi, go: seen.append(go[0].shape))
    class Same(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t
        @staticmethod
        def backward(ctx, g):
            return g * 2
    xd = x.to(D).requires_grad_()
    y = Same.apply(m(xd))
    y.pow(2).sum().backward()
    print(repr(([list(s) for s in seen], xd.grad.cpu().tolist(), m.weight.grad.cpu().tolist())))
"""


def test_backward_hook_and_identity_function_finish_and_equal_eager():
    r = _run(_HOOKS.format(dev=DEV), timeout=120)  # hung forever before the fix
    assert r.returncode == 0, r.stderr[-2000:]
    ref = _run(_HOOKS.format(dev="cpu"), env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert ref.returncode == 0, ref.stderr[-2000:]
    got, want = eval(r.stdout), eval(ref.stdout)  # noqa: S307 (our own child's print)
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]))
    torch.testing.assert_close(torch.tensor(got[2]), torch.tensor(want[2]))


def test_identity_function_in_process_with_python_key():
    """The same, in this process (the native Python-key kernel is on here by default)."""
    class Same(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t

        @staticmethod
        def backward(ctx, g):
            return g

    x = torch.ones(2, device=DEV, requires_grad=True)
    y = Same.apply(x)
    assert y._is_view() and y.data_ptr() == x.data_ptr()  # eager: a view of the input
    y.sum().backward()
    assert x.grad.cpu().tolist() == [1.0, 1.0]


# --- torch.load onto the device ----------------------------------------------------------------

def _checkpoint() -> tuple[bytes, dict]:
    torch.manual_seed(0)
    w = torch.randn(4, 3)
    sd = {"w": w, "w_t": w.t(), "tail": w[2:], "b": torch.arange(5, dtype=torch.int64),
          "h": torch.randn(6).half(), "flag": torch.tensor([True, False]), "n": 7}
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue(), torch.load(io.BytesIO(buf.getvalue()))


@pytest.mark.parametrize("where", [
    "remote_accelerator", DEV, torch.device(DEV), {"cpu": DEV},
    lambda s, loc: s.remote_accelerator(), lambda s, loc: s.remote_accelerator(0)],
    ids=["str", "str:0", "device", "dict", "callable", "callable:0"])
def test_torch_load_map_location_equals_eager(where):
    data, ref = _checkpoint()
    got = torch.load(io.BytesIO(data), map_location=where)
    assert got["n"] == 7
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            g = got[k]
            assert type(g) is genie.LazyTensor and g.device == torch.device(DEV), k
            assert (g.dtype, g.shape, g.stride(), g.storage_offset()) == \
                (v.dtype, v.shape, v.stride(), v.storage_offset()), k
            assert torch.equal(g.cpu(), v), k
    # the tensors that shared a storage in the file share one on the device, as on the CPU
    assert got["w"].untyped_storage().data_ptr() == got["w_t"].untyped_storage().data_ptr() \
        == got["tail"].untyped_storage().data_ptr()
    assert got["tail"].data_ptr() == got["w"].data_ptr() + 2 * 3 * 4
    assert got["b"].untyped_storage().data_ptr() != got["w"].untyped_storage().data_ptr()
    # and alias: an in-place write through one is seen through the others
    got["w"].add_(1)
    torch.testing.assert_close(got["tail"].cpu(), ref["tail"] + 1)


def test_torch_load_state_dict_into_a_device_model():
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    d = torch.nn.Linear(3, 2).to(DEV)
    d.load_state_dict(torch.load(buf, map_location="remote_accelerator"))
    x = torch.randn(5, 3)
    torch.testing.assert_close(d(x.to(DEV)).cpu(), m(x))


def test_torch_load_onto_a_missing_device_raises_as_torch():
    data, _ = _checkpoint()
    with pytest.raises(RuntimeError, match="device_count"):
        torch.load(io.BytesIO(data), map_location="remote_accelerator:63")


def test_set_onto_storages_and_tensors_equals_eager():
    def f(d):
        a = torch.arange(12., device=d)
        x = torch.empty(0, device=d)
        x.set_(a.untyped_storage(), 2, (2, 3), (3, 1))
        y = torch.empty(0, device=d).set_(a)
        z = torch.empty(0, device=d).set_(a.untyped_storage())
        e = a.clone().set_()
        a.mul_(10)
        return ([t.cpu().tolist() for t in (x, y, z, e)],
                [(tuple(t.shape), t.stride(), t.storage_offset()) for t in (x, y, z, e)],
                x.data_ptr() - a.data_ptr(), y.is_set_to(a), z.untyped_storage().nbytes())
    assert f(DEV) == f("cpu")


def test_set_onto_a_storage_of_another_dtype():
    def f(d):
        a = torch.arange(4, dtype=torch.int32, device=d)
        x = torch.empty(0, dtype=torch.int16, device=d).set_(a.untyped_storage(), 1, (3,), (2,))
        return x.cpu().tolist()
    assert f(DEV) == f("cpu")


# --- pinned memory, and pure-CPU programs ------------------------------------------------------

_PLAIN = """
    import io, warnings
    warnings.simplefilter("always")
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        for epoch in range(2):
            for xb, yb in DataLoader(ds, batch_size=8, pin_memory={pin}, num_workers=0):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(m(xb), yb)
                loss.backward()
                opt.step()
            print(epoch, f"{{loss.item():.6f}}", xb.is_pinned())
        buf = io.BytesIO(); torch.save(m.state_dict(), buf); buf.seek(0)
        sd = torch.load(buf)
        print(sorted(sd), sd["0.weight"].sum().item())
        print(torch.arange(6.).reshape(2, 3), m)
        from torch.utils.dlpack import to_dlpack  # DLPack of host tensors: torch's own
        d = torch.from_dlpack(to_dlpack(sd["0.bias"])); d.mul_(2)
        print(d.data_ptr() == sd["0.bias"].data_ptr(), sd["0.bias"].sum().item(),
              torch.from_dlpack(torch.arange(3)).tolist(), torch.asarray(torch.to_dlpack(
                  torch.ones(2)), dtype=torch.float64).tolist())
        try:
            torch.ones(1, requires_grad=True).__dlpack__()
        except BufferError as e:
            print("BufferError", e)
    print(sorted({{(w.category.__name__, str(w.message)) for w in caught}}))
"""


@pytest.mark.parametrize("pin", [False, True])
def test_plain_cpu_program_equals_torch_without_genie(pin):
    """Output and warnings of a small pure-CPU training program are those of plain torch
    (TORCH_DEVICE_BACKEND_AUTOLOAD=0), except the one warning plain torch gives because it finds
    no accelerator for pin_memory=True: with Genie installed remote_accelerator is one, and the
    batches are "pinned" as ordinary host memory (is_pinned() False, as where nothing pins)."""
    code = _PLAIN.format(pin=pin)
    got = _run(code)
    ref = _run(code, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert got.returncode == 0, got.stderr[-3000:]
    assert ref.returncode == 0, ref.stderr[-3000:]
    no_accel = "'pin_memory' argument is set as true but no accelerator is found"
    want = ref.stdout
    if pin:
        assert no_accel in want  # plain torch: the warning, and no pinning
        want = want.replace(
            f"('UserWarning', \"{no_accel}, then device pinned memory won't be used.\")", "")
        want = want.replace("[, ", "[").replace(", ]", "]")
    assert got.stdout == want
    assert "genie" not in got.stderr.lower()


def test_pin_memory_gives_a_host_copy():
    t = torch.arange(4.)
    p = t.pin_memory()
    assert p.device.type == "cpu" and torch.equal(p, t) and p.data_ptr() != t.data_ptr()
    assert p.to(DEV).cpu().tolist() == t.tolist()


# --- a bad server environment -----------------------------------------------------------------

@pytest.mark.parametrize("env", [
    {"GENIE_SERVER": "tcp://127.0.0.1:9", "GENIE_KEY_FILE": "/nonexistent/client.json"},
    {"GENIE_SERVER": "tcp://127.0.0.1:9"},
    {"GENIE_KEY_FILE": "/nonexistent/client.json", "GENIE_SERVER": "tcp://127.0.0.1:9",
     "GENIE_TIMEOUT": "soon"},
], ids=["unreadable-key-file", "server-without-keys", "bad-timeout"])
def test_bad_server_environment_fails_at_first_use_not_import(env):
    code = """
        import torch
        print("cpu", (torch.ones(2) * 2).tolist())
        x = torch.ones(2, device="remote_accelerator") * 2
        print("recorded")
        try:
            x.cpu()
        except Exception as e:
            print("raised", type(e).__name__, e)
    """
    r = _run(code, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[:2] == ["cpu [2.0, 2.0]", "recorded"]
    assert lines[2].startswith("raised GenieError [genie] cannot use the Genie server")
    assert "GENIE_SERVER='tcp://127.0.0.1:9'" in lines[2]
    assert "GENIE_KEY_FILE" in lines[2] and "unset GENIE_SERVER" in lines[2]


# --- numpy, autocast, data-dependent errors ------------------------------------------------------

def test_numpy_of_a_tensor_that_requires_grad_raises_as_eager():
    for d in ("cpu", DEV):
        t = torch.ones(2, device=d, requires_grad=True)
        with pytest.raises(RuntimeError, match="Can't call numpy\\(\\) on Tensor that requires "
                                               "grad. Use tensor.detach\\(\\).numpy\\(\\)"):
            t.numpy()
        assert t.numpy(force=True).tolist() == [1.0, 1.0]
        assert t.detach().cpu().numpy().tolist() == [1.0, 1.0]


def test_autocast_default_dtype_is_the_real_devices():
    real = genie.device.real_device(0).type
    assert torch.get_autocast_dtype("remote_accelerator") == torch.get_autocast_dtype(real)
    with torch.autocast("remote_accelerator"):
        a = torch.randn(2, 2, device=DEV)
        assert (a @ a).dtype == torch.get_autocast_dtype(real)
    with torch.autocast(real):
        b = torch.randn(2, 2, device=real)
        assert (b @ b).dtype == torch.get_autocast_dtype(real)


@pytest.mark.kernel_error  # an out-of-range index on the device
def test_data_dependent_error_has_eagers_type_and_names_the_way_to_the_line():
    x = torch.arange(5., device=DEV)
    # an index only the data shows is out of range (computed on the device; index_select's line
    # is not kept: advanced indexing's is, test_device_semantics)
    y = x.index_select(0, torch.arange(2, device=DEV) + 6) * 2
    with pytest.raises(IndexError) as ei:
        y.cpu()
    with pytest.raises(IndexError) as eager:
        torch.arange(5.).index_select(0, torch.arange(2) + 6)  # eager's type
    e = ei.value
    assert isinstance(e, genie.ExecutionError)
    assert str(eager.value) in str(e) and "GENIE_RECORD_SOURCE=1" in str(e)
    # the traceback ends in Genie's materialization, not a dozen frames below it
    frames = [f for f in __import__("traceback").extract_tb(e.__traceback__)]
    assert not any("/backends/" in f.filename for f in frames)
    assert e.__cause__ is not None and e.__cause__.__traceback__ is None


@pytest.mark.kernel_error  # an out-of-range index on the device
def test_data_dependent_error_names_the_line_with_record_source():
    r = _run("""
        import torch
        x = torch.arange(5., device="remote_accelerator")
        y = x.index_select(0, torch.arange(2, device="remote_accelerator") + 6)
        try:
            y.cpu()
        except IndexError as e:
            print(e)
    """, env={"GENIE_RECORD_SOURCE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "(recorded at <string>:4)" in r.stdout and "GENIE_RECORD_SOURCE" not in r.stdout


# --- beside another accelerator: `import torch` leaves PyTorch's accelerator alone ------------

_BESIDE = """
    import _genie_autoload as a
    a.accelerator_beside = lambda: {other!r}  # a machine with a GPU, as its driver shows it
    import torch
    a.autoload()  # what `import torch` runs, with Genie installed
    print(torch._C._get_privateuse1_backend_name())
"""


@pytest.mark.parametrize("other,env,want", [
    (None, {}, "remote_accelerator"),
    ("cuda", {}, "privateuseone"),
    ("cuda", {"GENIE_AUTOLOAD": "1"}, "remote_accelerator"),
    (None, {"GENIE_AUTOLOAD": "0"}, "privateuseone"),
])
def test_import_torch_registers_the_device_unless_another_accelerator_is_there(other, env, want):
    """Registering PrivateUse1 makes it torch's one accelerator, and PyTorch's autograd then
    cannot run a backward over CUDA tensors in the process (pytorch/pytorch#161129): on a GPU
    machine `import torch` must leave eager CUDA programs as they are, so only `import genie`
    (or GENIE_AUTOLOAD=1) registers the device there."""
    r = subprocess.run([PY, "-c", textwrap.dedent(_BESIDE.format(other=other))],
                       capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("GENIE_")},
                            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **env})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [want], r.stdout + r.stderr


def test_accelerator_beside_reads_the_driver_and_the_visible_devices(monkeypatch):
    """A CUDA torch with NVIDIA's driver node in reach is "beside CUDA", unless the process
    hides every GPU (CUDA_VISIBLE_DEVICES empty or -1); a CPU torch never is."""
    import _genie_autoload

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidiactl")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _genie_autoload.accelerator_beside() == "cuda"
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert _genie_autoload.accelerator_beside() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert _genie_autoload.accelerator_beside() == "cuda"
    monkeypatch.setattr(torch.version, "cuda", None)
    assert _genie_autoload.accelerator_beside() is None


def test_accelerator_beside_finds_none_on_a_cpu_machine():
    """The detection the autoload relies on: this machine's torch has no other accelerator in
    reach (a CPU wheel, or no driver), so the tests above are the only place it says "cuda"."""
    import _genie_autoload

    if torch.cuda.is_available():
        assert _genie_autoload.accelerator_beside() == "cuda"
    else:
        assert _genie_autoload.accelerator_beside() is None


_OTHER_BACKWARD = """
    import torch, genie
    from genie import device
    device._explain_other_backward("cuda")

    def raising(message):  # a Function whose backward raises `message`
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t * 2
            @staticmethod
            def backward(ctx, g):
                raise RuntimeError(message)
        return F

    # the engine's assert, as a backward raises it; any other error stays as it is
    Asserts = raising("opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED")
    Other = raising("something else")

    x = torch.randn(3, requires_grad=True)
    for fn, call in [(Asserts, lambda y: y.sum().backward()),
                     (Asserts, lambda y: torch.autograd.grad(y.sum(), x)),
                     (Other, lambda y: y.sum().backward())]:
        try:
            call(fn.apply(x))
        except RuntimeError as e:
            print(type(e.__cause__).__name__, str(e)[:60].replace(" ", "_"))
    (x * 3).sum().backward()  # a backward that works still does
    print(x.grad.tolist() == [3.0, 3.0, 3.0])
"""


def test_a_backward_over_another_accelerator_says_why_it_cannot_run():
    """Where `import genie` registers the device beside CUDA, the autograd engine's internal
    assert on a CUDA backward becomes an error that says why and what to do, the assert chained;
    other errors and working backwards are untouched."""
    r = subprocess.run([PY, "-c", textwrap.dedent(_OTHER_BACKWARD)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    want = "RuntimeError PyTorch's_autograd_cannot_run_a_backward_over_cuda_tensors_i"
    assert lines[:4] == [want, want, "NoneType something_else", "True"], r.stdout
