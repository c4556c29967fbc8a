"""The device: registration, the torch.remote_accelerator module, modules and generators."""

import subprocess
import sys

import pytest
import torch

import genie


def test_device_registered_and_idempotent():
    assert torch._C._get_privateuse1_backend_name() == "remote_accelerator"
    genie.device.register()
    genie._autoload()
    assert torch.device("remote_accelerator:0").type == "remote_accelerator"
    assert torch.remote_accelerator is genie.device


def test_cuda_shaped_module():
    ra = torch.remote_accelerator
    assert ra.is_available()
    assert ra.device_count() >= 1
    assert ra.current_device() == 0
    with ra.device(0):
        assert ra.current_device() == 0
    ra.set_device(0)
    ra.synchronize()


def test_device_index_out_of_range_raises_clear_error():
    n = torch.remote_accelerator.device_count()
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.ones(2, device=f"remote_accelerator:{n}")
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.remote_accelerator.set_device(n)


def test_tensor_and_module_methods(dev):
    t = torch.ones(3, device=dev)
    assert t.is_remote_accelerator and not torch.ones(3).is_remote_accelerator
    assert t.device == dev
    m = torch.nn.Linear(4, 2)
    w = m.weight.detach().clone()
    m.to("remote_accelerator")
    assert m.weight.device.type == "remote_accelerator"
    assert isinstance(m.weight, torch.nn.Parameter) and m.weight.requires_grad
    torch.testing.assert_close(m.weight.cpu(), w)
    m2 = torch.nn.Linear(4, 2).remote_accelerator()
    assert m2.bias.is_remote_accelerator


def test_generators_and_seeding():
    g = torch.Generator(device="remote_accelerator")
    g.manual_seed(123)
    assert g.initial_seed() == 123
    state = g.get_state()
    g2 = torch.Generator(device="remote_accelerator")
    g2.set_state(state)
    assert g2.initial_seed() == 123
    torch.manual_seed(7)  # seeds every device through manual_seed_all
    assert torch.remote_accelerator.initial_seed() == 7
    s = torch.remote_accelerator.get_rng_state()
    a = torch.randn(4, device="remote_accelerator").cpu()
    torch.remote_accelerator.set_rng_state(s)
    b = torch.randn(4, device="remote_accelerator").cpu()
    torch.testing.assert_close(a, b)


def test_device_exists_after_plain_import_torch_when_installed():
    """The torch.backends entry point registers the device without `import genie`."""
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="torch.backends") if e.name == "genie"]
    if not eps:
        pytest.skip("genie is not pip-installed here (entry points need an install); "
                    "tools/setup.sh installs it")
    for first in ("import torch", "import genie; import torch"):  # either may come first
        code = f"{first}; print(torch.ones(2, device='remote_accelerator').device)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0 and "remote_accelerator:0" in out.stdout, out.stderr[-2000:]


@pytest.mark.skipif(genie.device.real_device(0).type == "cuda" and torch.cuda.device_count() < 2,
                    reason="remote_accelerator:1 maps to cuda:1: needs two GPUs")
def test_two_devices_copy_between_them_and_mismatch_error():
    code = """
import torch, genie
x = torch.randn(3, device="remote_accelerator:0")
y = x.to("remote_accelerator:1") * 2
assert y.device == torch.device("remote_accelerator:1")
torch.testing.assert_close(y.cpu(), x.cpu() * 2)
try:
    x + y
except RuntimeError as e:
    assert "same device" in str(e)
else:
    raise AssertionError("device mismatch must raise")
print("ok")
"""
    env = {**__import__("os").environ, "GENIE_DEVICE_COUNT": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
