"""Storages and data pointers on the device (issue 29, family 3), each against eager on the CPU.

A remote_accelerator storage holds no bytes but has eager's size and a fake address of its own
(csrc/storage.cpp): views sit at their byte offsets, aliases share the storage, distinct tensors
differ, so what libraries decide from addresses (tied weights, safetensors' shared tensors,
``is_set_to``, view tests) comes out as on the CPU. Recording never touches the addresses.
"""

import subprocess
import sys
import textwrap

import torch

import genie

DEV = "remote_accelerator:0"


def _both(fn):
    """fn(device) on the CPU and on the device."""
    return fn("cpu"), fn(DEV)


def _aliasing(d):
    """Every aliasing question a library asks, answered as a tuple of booleans and offsets."""
    a = torch.arange(12., device=d).reshape(3, 4)
    b = torch.arange(12., device=d).reshape(3, 4)
    p = a.data_ptr()
    s = a.untyped_storage()
    return (
        p != 0,
        a.view(-1).data_ptr() == p,
        a[True].data_ptr() == p,
        a[1:].data_ptr() - p,
        a[:, 1].data_ptr() - p,
        a.t().data_ptr() == p,
        a.detach().data_ptr() == p,
        a[0].untyped_storage().data_ptr() == s.data_ptr(),
        s.data_ptr() == p,
        b.data_ptr() != p,
        b.untyped_storage().data_ptr() != s.data_ptr(),
        (a + 0).data_ptr() != p,
        a.clone().data_ptr() != p,
        a.contiguous().data_ptr() == p,
        a.t().contiguous().data_ptr() == p,
        s.nbytes(), s.size(), a[1:].untyped_storage().nbytes(),
        a.view(-1).untyped_storage()._cdata == s._cdata,
        b.untyped_storage()._cdata == s._cdata,
        a.is_set_to(a), a.view(3, 4).is_set_to(a), a[1:].is_set_to(a), b.is_set_to(a),
        a.view(torch.int32).data_ptr() == p,
        a.storage_offset(), a[2:].storage_offset(),
        torch.empty(0, device=d).data_ptr(),
    )


def test_aliasing_answers_equal_eager():
    cpu, dev = _both(_aliasing)
    assert dev == cpu


def test_addresses_are_unique_nonzero_and_aligned():
    ts = [torch.empty(n, device=DEV) for n in (1, 7, 1000, 3)]
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in ts)
    assert all(lo != 0 and lo % 64 == 0 for lo, _ in ranges)
    assert all(hi < nxt for (_, hi), (nxt, _) in zip(ranges, ranges[1:], strict=False))


def test_in_place_ops_keep_the_address():
    for d in ("cpu", DEV):
        a = torch.zeros(4, device=d)
        p = a.data_ptr()
        a.add_(1).mul_(2)
        a[1:].fill_(3)
        torch.neg(a, out=a)
        assert a.data_ptr() == p
    assert a.cpu().tolist() == [-2.0, -3.0, -3.0, -3.0]  # recording still computes the values


def test_view_of_a_view_and_unbind_and_split_offsets():
    def f(d):
        a = torch.arange(24., device=d).reshape(2, 3, 4)
        p = a.data_ptr()
        return ([t.data_ptr() - p for t in a.unbind(1)], [t.data_ptr() - p for t in a.split(1, 2)],
                a[1][2][1:].data_ptr() - p, a.view(6, 4)[3:].untyped_storage().nbytes())
    cpu, dev = _both(f)
    assert dev == cpu


def test_resize_moves_every_view_as_eager():
    def f(d):
        a = torch.zeros(4, device=d)
        v = a[1:]
        p, n = a.data_ptr(), a.untyped_storage().nbytes()
        a.resize_(1000)
        return (a.data_ptr() != p, v.data_ptr() == a.data_ptr() + 4,
                a.untyped_storage().nbytes() >= 4000, n, v.untyped_storage()._cdata ==
                a.untyped_storage()._cdata)
    cpu, dev = _both(f)
    assert dev == cpu


def test_tied_weights_stay_tied_through_to_and_state_dict():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight
            self.other = torch.nn.Linear(4, 4)

    torch.manual_seed(0)
    m = Tied().to(DEV)
    assert m.head.weight is m.emb.weight
    sd = m.state_dict()
    ptr = {k: v.untyped_storage().data_ptr() for k, v in sd.items()}
    assert ptr["head.weight"] == ptr["emb.weight"]
    assert len(set(ptr.values())) == len(ptr) - 1
    # a tied copy made by a library (the value, not the Parameter) is still recognised
    assert m.emb.weight.detach().data_ptr() == m.head.weight.data_ptr()


def _find_shared_tensors(state_dict):
    """safetensors.torch._find_shared_tensors, verbatim in what it computes (safetensors is not a
    dependency): tensors grouped by (device, storage address, storage size)."""
    from collections import defaultdict

    tensors = defaultdict(set)
    for k, v in state_dict.items():
        if v.device != torch.device("meta") and v.untyped_storage().data_ptr() != 0 and \
                v.untyped_storage().nbytes() != 0:
            tensors[(v.device, v.untyped_storage().data_ptr(),
                     v.untyped_storage().nbytes())].add(k)
    return sorted(sorted(names) for names in tensors.values())


def test_safetensors_shared_tensor_detection_equals_eager():
    def sd(d):
        torch.manual_seed(0)
        w = torch.randn(6, 4, device=d)
        return {"a": w, "a_view": w[2:], "b": torch.randn(3, device=d), "c": w.t(),
                "d": torch.randn(2, 2, device=d).view(-1), "e": torch.zeros(0, device=d)}
    assert _find_shared_tensors(sd(DEV)) == _find_shared_tensors(sd("cpu"))


def test_storage_size_identity_and_bytes():
    a = torch.arange(4., device=DEV)
    s = a.untyped_storage()
    assert s.device == torch.device(DEV) and s.nbytes() == 16 and len(s) == 16
    assert s.data_ptr() == a.data_ptr()
    assert a.view(2, 2).untyped_storage()._cdata == s._cdata
    # reading the bytes materializes the value (through set_ onto the storage): eager's bytes
    ref = torch.arange(4.).untyped_storage()
    assert s.tolist() == ref.tolist() and s[5] == ref[5]
    assert s.cpu().tolist() == ref.tolist()


def test_recording_never_dereferences_the_fake_address():
    """A fake address is not a canonical pointer: anything that read it would crash this
    process. A training step, printing, saving and loading run in a child process."""
    code = textwrap.dedent("""
        import io, torch, genie
        D = "remote_accelerator"
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(D)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(16, 4, device=D)
        for _ in range(3):
            opt.zero_grad(); m(x).pow(2).mean().backward(); opt.step()
        buf = io.BytesIO(); torch.save(m.state_dict(), buf); buf.seek(0)
        sd = torch.load(buf)
        print(m[0].weight.data_ptr() >= 2**60, repr(m(x).sum())[:12], sorted(sd)[:1])
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("True tensor(")


def test_data_ptr_costs_nothing_per_op():
    """A fresh output's storage is one counter step (no allocation, no Python call)."""
    x = torch.ones(8, device=DEV)
    genie.reset_stats()
    ys = [x + i for i in range(100)]
    assert len({y.data_ptr() for y in ys}) == 100
    assert genie.stats().get("materializations", 0) == 0
