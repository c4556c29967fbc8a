"""Out-of-range indices and values through a real server: refused before the kernel, everyone
served after.

On CUDA an out-of-range index in an indexing kernel is a device-side assert that breaks the
CUDA context it ran in (with session workers: that session's worker's); the server checks index
arguments first
(genie.index_check, ``--index-check``, on by default on CUDA). Here the server serves the CUDA
device where there is one (the check on by default, the attack real), else the CPU with the check
forced on (``--index-check 1``). Every family of indexing op, and every op whose CUDA kernel
asserts on argument values (``bernoulli``, ``binary_cross_entropy``, ``multinomial``,
``masked_scatter``, ``repeat_interleave``), gets an out-of-range case that must
raise eager's exception type at the call site, after which the same session and another tenant's
session still compute; in-range cases (negative and empty indices included) give eager's values.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import genie

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from test_remote import ServerProc, assert_training_equals_eager  # noqa: E402
from test_security import A2, host  # noqa: E402
from test_security import Session as RawSession  # noqa: E402

from genie.remote import protocol  # noqa: E402
from genie.remote.decompose import NotServedError  # noqa: E402

DEV = "remote_accelerator:0"
CUDA = torch.cuda.is_available()
#: the device the server serves: CUDA where present (the check on by its default, auto)
SERVED = ("--device", "cuda:0") if CUDA else ("--index-check", "1")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("genie-ix-keys")


@pytest.fixture(scope="module")
def server(keys: Path):
    s = ServerProc(keys, "--quota", "256MiB", "--workers", "2", *SERVED)
    yield s
    assert s.stop() == 0, "genie-server did not shut down cleanly on SIGTERM"


@pytest.fixture
def remote(server: ServerProc):
    genie.connect(server.address, key_file=str(server.key_file), timeout=30)
    yield server
    genie.disconnect()


def X() -> torch.Tensor:
    return torch.arange(12.0).reshape(3, 4)


def T(*v) -> torch.Tensor:
    return torch.tensor(v[0] if len(v) == 1 else list(v))


def ran(i: torch.Tensor) -> torch.Tensor:
    """``i`` run on the device (a value the server holds), where the host neither holds nor can
    evaluate its values (genie.executor.host_value): the check of an index is then the server's."""
    if i.device.type != "cpu":
        genie.materialize(i)
    return i


#: family -> (program of (x, idx) on any device, in-range idx, out-of-range idx, exception type,
#: words of eager's message)
FAMILIES = {
    "gather": (lambda x, i: x.gather(0, i), T([[2, 0, 1, 0]]), T([[7, 0, 0, 0]]),
               RuntimeError, "index 7 is out of bounds for dimension 0 with size 3"),
    "gather_negative": (lambda x, i: x.gather(1, i), T([[3], [0], [1]]), T([[-1], [0], [0]]),
                        RuntimeError, "index -1 is out of bounds for dimension 1 with size 4"),
    "index_select": (lambda x, i: x.index_select(0, i), T([2, 0]), T([0, 3]), IndexError,
                     "index out of range in self"),
    # advanced indexing: an index the server holds (``ran``), since one the host knows is
    # checked at the call (genie.checks.check_known_indices), never reaching the server
    "index": (lambda x, i: x[:, ran(i)], T([-4, 3, -1]), T([4]), IndexError,
              "index 4 is out of bounds for dimension 0 with size 4"),
    "index_2d": (lambda x, i: x[ran(i * 0), ran(i)], T([-4, 3, -1]), T([1, 4]), IndexError,
                 "index 4 is out of bounds for dimension 1 with size 4"),
    "index_negative": (lambda x, i: x[ran(i)], T([-3, 2]), T([-4]), IndexError,
                       "index -4 is out of bounds for dimension 0 with size 3"),
    "embedding": (lambda x, i: F.embedding(i, x), T([[0, 2], [1, 1]]), T([[0, 3]]), IndexError,
                  "index out of range in self"),
    "scatter": (lambda x, i: x.clone().scatter_(0, i, 5.0), T([[2, 0, 1, 0]]),
                T([[2, 0, 9, 0]]), RuntimeError, "index 9 is out of bounds"),
    "scatter_add": (lambda x, i: x.scatter_add(1, i, torch.ones_like(i, dtype=x.dtype)),
                    T([[3], [0], [1]]), T([[3], [4], [1]]), RuntimeError,
                    "index 4 is out of bounds for dimension 1 with size 4"),
    "index_put_": (lambda x, i: x.clone().index_put_((ran(i),), torch.tensor(1.0)), T([0, -1]),
                   T([3]), IndexError, "index 3 is out of bounds for dimension 0 with size 3"),
    "index_add_": (lambda x, i: x.clone().index_add_(0, i, torch.ones(len(i), 4, device=x.device)),
                   T([2, 2]),
                   T([3, 0]), RuntimeError, "index 3 is out of bounds for dimension 0"),
    "take": (lambda x, i: x.take(i), T([-12, 11, 0]), T([12]), IndexError,
             "tried to access index 12 on a tensor of 12 elements"),
    "nll_loss": (lambda x, i: F.nll_loss(F.log_softmax(x, 1), i), T([3, -100, 0]),
                 T([3, 4, 0]), IndexError, "Target 4 is out of bounds"),
    "cross_entropy": (lambda x, i: F.cross_entropy(x, i, ignore_index=1), T([3, 1, 0]),
                      T([-1, 0, 0]), IndexError, "Target -1 is out of bounds"),
}


#: values a CUDA kernel asserts on (genie.index_check.Values): family -> as FAMILIES, the second
#: tensor holding the values (probabilities in {0, 1} and one-hot rows: eager's values are exact)
VALUE_FAMILIES = {
    "bernoulli": (lambda x, p: torch.bernoulli(p), T([0.0, 1.0, 1.0]), T([0.0, 1.5, 1.0]),
                  RuntimeError, "Expected p_in >= 0 && p_in <= 1 to be true"),
    "bernoulli_nan": (lambda x, p: torch.zeros_like(p).bernoulli_(p), T([1.0, 0.0]),
                      T([float("nan"), 0.0]), RuntimeError, "Expected p_in >= 0"),
    "binary_cross_entropy": (lambda x, v: F.binary_cross_entropy(v, torch.full_like(v, 0.5)),
                             T([0.25, 0.75]), T([0.25, 1.25]), RuntimeError,
                             "all elements of input should be between 0 and 1"),
    "multinomial": (lambda x, p: torch.multinomial(p, 3, replacement=True),
                    T([[0.0, 1.0], [1.0, 0.0]]), T([[0.0, 0.0], [1.0, 0.0]]), RuntimeError,
                    "sum of probabilities <= 0"),
    "masked_scatter": (lambda x, m: x.masked_scatter(m, torch.ones(4, device=x.device)),
                       T([True, False, False, False]), T([True, True, False, False]),
                       RuntimeError, "Number of elements of source < number of ones in mask"),
    "repeat_interleave": (lambda x, r: torch.repeat_interleave(r, output_size=3), T([1, 2]),
                          T([2, 2]), RuntimeError, "allocated size does not match required size"),
}
FAMILIES |= VALUE_FAMILIES


def _on(x: torch.Tensor, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in (x, *ts)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_out_of_range_is_refused_and_everyone_is_served_after(server: ServerProc,
                                                              family: str) -> None:
    f, good, bad, etype, words = FAMILIES[family]
    other = RawSession(server)  # another tenant, with a session open before the attack
    genie.connect(server.address, key_file=str(server.key_file), timeout=30)
    try:
        x = X()
        xd, bd = _on(x, bad)
        with pytest.raises(etype, match=words) as ei:
            f(xd, bd).cpu()
        assert isinstance(ei.value, genie.ExecutionError), ei.value  # names the op, the line
        assert genie.stats().get("server_index_check_refusals") == 1  # the check, not the kernel
        xd, gd = _on(x, good)  # the same session goes on, with eager's values
        assert torch.allclose(f(xd, gd).cpu(), f(x, good))
    finally:
        genie.disconnect()
    other.alive()  # the other tenant's session, and a fresh one, still compute
    other.close()


def test_empty_and_negative_indices_give_eagers_values(remote) -> None:
    x = X()
    xd = x.to(DEV)
    e = torch.empty(0, dtype=torch.long)
    assert torch.equal(xd.index_select(0, e.to(DEV)).cpu(), x.index_select(0, e))
    assert torch.equal(xd[e.to(DEV)].cpu(), x[e])
    assert torch.equal(F.embedding(e.to(DEV), xd).cpu(), F.embedding(e, x))
    assert torch.equal(xd.gather(0, e.reshape(0, 4).to(DEV)).cpu(), x.gather(0, e.reshape(0, 4)))
    n = torch.tensor([-1, -3])
    assert torch.equal(xd[n.to(DEV)].cpu(), x[n])
    assert torch.equal(xd.take(n.to(DEV)).cpu(), x.take(n))
    assert torch.equal(xd.index_fill(1, n.to(DEV), 7.0).cpu(), x.index_fill(1, n, 7.0))
    m = torch.tensor([True, False, True])  # a mask holds no indices
    assert torch.equal(xd[m.to(DEV)].cpu(), x[m])


def test_empty_values_cost_nothing_and_give_eagers_values(remote) -> None:
    e = torch.empty(0)
    genie.reset_stats()
    assert torch.equal(torch.bernoulli(e.to(DEV)).cpu(), torch.bernoulli(e))
    assert torch.equal(F.binary_cross_entropy(e.to(DEV), e.to(DEV), reduction="sum").cpu(),
                       F.binary_cross_entropy(e, e, reduction="sum"))
    x, m = X(), torch.zeros(0, 4, dtype=torch.bool)
    assert torch.equal(x[:0].to(DEV).masked_scatter(m.to(DEV), e.to(DEV)).cpu(),
                       x[:0].masked_scatter(m, e))
    assert "server_index_checks" not in genie.stats()


def test_probabilities_and_indices_of_one_step_pay_one_sync(remote) -> None:
    w, ids, keep = torch.randn(50, 8), torch.tensor([[3, 49]]), torch.tensor([[1.0, 0.0]])
    wd = w.to(DEV)
    genie.reset_stats()
    h = F.embedding(ids.to(DEV), wd) * torch.bernoulli(keep.to(DEV)).unsqueeze(-1)
    assert torch.allclose(h.cpu(), F.embedding(ids, w) * keep.unsqueeze(-1))
    s = genie.stats()
    assert s["server_index_checks"] == 2 and s["server_index_check_syncs"] == 1, s


def test_an_index_computed_on_the_server_is_checked_before_its_use(remote) -> None:
    x = X()
    i = torch.tensor([0, 1]).to(DEV)
    genie.materialize(i)
    with pytest.raises(IndexError, match="index out of range in self"):
        F.embedding(i * 3, x.to(DEV)).cpu()  # 3 is out of range: computed in the same tape
    assert genie.stats()["server_index_check_refusals"] == 1
    assert torch.equal(F.embedding(i * 2, x.to(DEV)).cpu(), F.embedding(torch.tensor([0, 2]), x))


def test_a_decode_step_pays_one_sync_for_its_indices(remote) -> None:
    wte, wpe = torch.randn(50, 8), torch.randn(16, 8)
    wd, pd = wte.to(DEV), wpe.to(DEV)
    ids, pos = torch.tensor([[3, 49]]), torch.tensor([[0, 1]])
    genie.reset_stats()
    h = F.embedding(ids.to(DEV), wd) + F.embedding(pos.to(DEV), pd)
    assert torch.allclose(h.cpu(), F.embedding(ids, wte) + F.embedding(pos, wpe))
    s = genie.stats()
    assert s["server_index_checks"] == 2 and s["server_index_check_syncs"] == 1, s


def _replays(s: dict) -> int:
    """Runs the server replayed natively (vetted on meta, by a shape class, or known shapes),
    not interpreted (``server_guarded_runs``)."""
    return sum(s.get(k, 0) for k in ("server_vets", "server_shape_class_hits", "server_vet_hits"))


def test_a_checked_structure_replays_natively_and_every_replay_is_checked(remote) -> None:
    """Index checks do not cost a structure its native replay (the first GPU run: every GPT-2
    step through a CUDA server was interpreted, 4.5x eager): the replay stops where an
    interpreted run checks. Token ids uploaded each call and positions computed in the tape
    (an ``arange`` at a moving offset, as a decode step's), then out of range in a replay,
    each raising eager's error at the call; the session computes on."""
    wte, wpe = torch.randn(50, 8), torch.randn(16, 8)
    wd, pd = wte.to(DEV), wpe.to(DEV)

    def step(ids: list[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(ids), device=DEV)
        return (F.embedding(torch.tensor(ids).to(DEV), wd) + F.embedding(pos, pd)).cpu()

    def eager(ids: list[int], start: int) -> torch.Tensor:
        return F.embedding(torch.tensor(ids), wte) + \
            F.embedding(torch.arange(start, start + len(ids)), wpe)

    genie.reset_stats()
    for k in range(5):
        assert torch.equal(step([3, 40 + k], k), eager([3, 40 + k], k))
    s = genie.stats()
    assert _replays(s) >= 3 and s.get("server_guarded_runs", 0) <= 2, s
    assert s["server_index_checks"] >= 10, s  # every call's ids and positions checked
    with pytest.raises(IndexError) as want:
        eager([3, 50], 0)
    with pytest.raises(IndexError, match=re.escape(str(want.value))):
        step([3, 50], 0)  # an uploaded id out of range, in a replay
    with pytest.raises(IndexError) as want:
        eager([3, 4], 15)
    with pytest.raises(IndexError, match=re.escape(str(want.value))):
        step([3, 4], 15)  # a position computed in the tape out of range, in a replay
    assert genie.stats()["server_index_check_refusals"] == 2
    assert torch.equal(step([1, 2], 3), eager([1, 2], 3))
    assert _replays(genie.stats()) >= 6


def test_an_index_written_in_place_between_two_uses_is_checked_again_in_a_replay(remote
                                                                                 ) -> None:
    """The replay's check forgets what an in-place write changes, as the interpreted run's."""
    w = torch.randn(50, 8)
    wd = w.to(DEV)

    def step(shift: int, dev: str) -> torch.Tensor:
        i = torch.tensor([1, 2]).to(dev)
        e1 = F.embedding(i, wd if dev == DEV else w)
        i.add_(shift)
        return (e1 + F.embedding(i, wd if dev == DEV else w)).cpu()

    genie.reset_stats()
    for shift in (3, 7, 40, 47):
        assert torch.equal(step(shift, DEV), step(shift, "cpu"))
    with pytest.raises(IndexError) as want:
        step(48, "cpu")
    with pytest.raises(IndexError, match=re.escape(str(want.value))):
        step(48, DEV)
    s = genie.stats()
    assert _replays(s) >= 3 and s["server_index_check_refusals"] == 1, s


def _embedding_loop(dev: str, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(30, 8).to(dev), torch.nn.Linear(8, 4).to(dev)
    ids, y = torch.randint(0, 30, (6,)).to(dev), torch.randn(6, 4).to(dev)
    opt = torch.optim.AdamW([*emb.parameters(), *head.parameters()], lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(head(emb(ids)), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in (*emb.parameters(), *head.parameters())]


def test_a_checked_training_step_is_answered_early_and_equals_eager(remote) -> None:
    """A training step whose embedding's ids are checked: replayed natively, answered before
    its backward and update have run (the early reply and the check in one replay), eager's
    losses and parameters bit for bit."""
    genie.reset_stats()
    losses, params = _embedding_loop(DEV, 6)
    s = genie.stats()
    want_losses, want_params = _embedding_loop("cpu", 6)
    assert_training_equals_eager(losses, want_losses)
    assert_training_equals_eager(params, want_params)
    assert _replays(s) >= 3 and s.get("server_early_replies", 0) >= 3, s
    assert s["server_index_checks"] >= 6, s


def test_unchecked_index_ops_are_refused_where_checks_are_on(remote) -> None:
    """``embedding_bag``'s kernels have no index rule: off the server's opset (rule version 2),
    refused by the client by name, before anything is sent."""
    w = torch.randn(5, 4)
    with pytest.raises(NotServedError, match="embedding_bag"):
        F.embedding_bag(torch.tensor([1, 2]).to(DEV), w.to(DEV), torch.tensor([0]).to(DEV)).cpu()
    assert (w.to(DEV) * 2).sum().item() == pytest.approx((w * 2).sum().item(), rel=1e-5)


def test_a_server_with_the_check_off_checks_nothing(keys: Path) -> None:
    s = ServerProc(keys, "--index-check", "0", *(("--device", "cuda:0") if CUDA else ()))
    try:
        genie.connect(s.address, key_file=str(s.key_file), timeout=30)
        x = X()
        i = torch.tensor([[2, 0, 1, 0]])
        assert torch.equal(x.to(DEV).gather(0, i.to(DEV)).cpu(), x.gather(0, i))
        assert "server_index_checks" not in genie.stats()
    finally:
        genie.disconnect()
        assert s.stop() == 0


def test_a_cpu_server_checks_by_default_the_kernels_that_do_not(keys: Path) -> None:
    """``auto`` on a CPU server: eager's CPU kernel of ``embedding_dense_backward`` does not bound
    its indices (it would write out of bounds): checked; ``gather``'s kernel does: not checked."""
    s = ServerProc(keys, "--device", "cpu")
    try:
        genie.connect(s.address, key_file=str(s.key_file), timeout=30)
        g = torch.ones(1, 4)
        with pytest.raises(IndexError, match="index out of range in self"):
            torch.ops.aten.embedding_dense_backward(g.to(DEV), torch.tensor([5]).to(DEV), 3, -1,
                                                    False).cpu()
        assert genie.stats()["server_index_check_refusals"] == 1
        i = torch.tensor([2])
        ref = torch.ops.aten.embedding_dense_backward(g, i, 3, -1, False)
        assert torch.equal(torch.ops.aten.embedding_dense_backward(
            g.to(DEV), i.to(DEV), 3, -1, False).cpu(), ref)
        genie.reset_stats()
        x, j = X(), torch.tensor([[2, 0, 1, 0]])
        assert torch.equal(x.to(DEV).gather(0, j.to(DEV)).cpu(), x.gather(0, j))
        assert "server_index_checks" not in genie.stats()
    finally:
        genie.disconnect()
        assert s.stop() == 0


#: one attack per kind of check: an out-of-range index, a value a kernel asserts on
ATTACKS = {
    "gather": lambda: X().to(DEV).gather(0, T([[7, 0, 0, 0]]).to(DEV)).cpu(),
    "bernoulli": lambda: torch.bernoulli(T([0.5, 1.5]).to(DEV)).cpu(),
}


@pytest.mark.skipif(not CUDA, reason="the device-side assert is CUDA's: the attack this file "
                    "defends against, replayed on a server with the check off")
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_without_the_check_a_device_side_assert_costs_only_its_own_session(keys: Path,
                                                                           attack: str) -> None:
    """With ``--index-check 0`` one out-of-range ``gather`` (or ``bernoulli`` with p = 1.5) is a
    device-side assert that leaves a CUDA context unusable. Before session workers it was the
    server's one context (another tenant's next request failed too: the first GPU run of this
    file saw that); now it is the attacker's worker's: the attacker gets an error, another
    tenant's session opened before the attack computes eager's values, and a new session of the
    attacker's key computes too."""
    s = ServerProc(keys, "--device", "cuda:0", "--index-check", "0")
    try:
        other = RawSession(s)
        genie.connect(s.address, key_file=str(s.key_file), timeout=60)
        with pytest.raises(Exception):  # noqa: B017 (whatever CUDA reports)
            ATTACKS[attack]()
        genie.disconnect()
        x = torch.arange(4.0)
        r = other.run(["aten::mul.Scalar"], [[0, 0, [-1, -1], [0], [], False]],
                      [host(x, 0), 3.0], [protocol.tensor_frame(x)[0]], specs=[A2])
        assert r and r["t"] == "ok", r  # the other tenant's worker, its own CUDA context
        dtype, shape, stride = r["o"][0]
        got = protocol.read_into(other.frames[0], protocol.dtype_of(dtype), shape, stride)
        assert torch.equal(got, x * 3)
        other.close()
        genie.connect(s.address, key_file=str(s.key_file), timeout=60)
        y = torch.arange(6.0).reshape(2, 3)
        assert torch.equal((y.to(DEV) @ y.t().to(DEV)).cpu(), y @ y.t())
        assert s.alive()
    finally:
        genie.disconnect()
        s.stop()
